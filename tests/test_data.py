"""GSM8K loading (local JSONL and hub errors), bad rows, the prompt stream and chat formatting."""

import json
import os

import pytest

from forge_core.data import DataError, PromptSource, load_gsm8k, load_jsonl, parse_row

GSM8K_DIR = os.environ.get("GSM8K_DIR", "")


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def test_local_jsonl(tmp_path):
    _write(tmp_path / "train.jsonl", [{"question": " Q1 ", "answer": "steps\n#### 1,200"},
                                      {"question": "Q2", "answer": "#### -3"}])
    probs = load_gsm8k("train", str(tmp_path))
    assert [(p.question, p.answer) for p in probs] == [("Q1", "1200"), ("Q2", "-3")]
    assert probs[0].id.endswith("train.jsonl:1")


@pytest.mark.skipif(bool(os.environ.get("FORGE_SYNTHETIC_GSM8K")), reason="GSM8K_DIR does not name the real GSM8K copy")
def test_real_gsm8k_files():
    train, test = load_gsm8k("train", GSM8K_DIR), load_gsm8k("test", GSM8K_DIR)
    assert (len(train), len(test)) == (7473, 1319)
    assert train[0].answer == "72"


def test_missing_file_names_path(tmp_path):
    with pytest.raises(DataError, match=r"test\.jsonl"):
        load_gsm8k("test", str(tmp_path))


def test_row_without_answer_marker_names_file_and_line(tmp_path):
    _write(tmp_path / "train.jsonl", [{"question": "a", "answer": "#### 1"}, {"question": "b", "answer": "no marker"}])
    with pytest.raises(DataError, match=r"train\.jsonl:2: answer has no '#### N'"):
        load_jsonl(str(tmp_path / "train.jsonl"))


def test_bad_json_and_missing_field(tmp_path):
    _write(tmp_path / "a.jsonl", ["{not json"])
    with pytest.raises(DataError, match=r"a\.jsonl:1: not valid JSON \(Expecting property name enclosed in double "
                                         r"quotes at column 2\)"):
        load_jsonl(str(tmp_path / "a.jsonl"))
    (tmp_path / "c.jsonl").write_bytes(b'{"question": "a", "answer": "#### 1"}\n\xff\xfe{"question"}\n')
    with pytest.raises(DataError, match=r"c\.jsonl:2: not UTF-8 text \(byte 1 of the line\)"):
        load_jsonl(str(tmp_path / "c.jsonl"))
    _write(tmp_path / "b.jsonl", [{"question": "q"}])
    with pytest.raises(DataError, match=r"b\.jsonl:1: expected an object"):
        load_jsonl(str(tmp_path / "b.jsonl"))
    with pytest.raises(DataError, match="not a number"):
        parse_row({"question": "q", "answer": "#### many"}, "x:1")
    with pytest.raises(DataError, match="x:2: the text after '####' is not a number"):  # not Python's digit limit
        parse_row({"question": "q", "answer": "#### 1e5000"}, "x:2")
    with pytest.raises(DataError, match="x:3: the question is empty"):
        parse_row({"question": " \n", "answer": "#### 1"}, "x:3")


def test_hub_failure_says_how_to_use_a_local_copy(monkeypatch):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="GSM8K_DIR="):
        load_gsm8k("train", None)


def test_prompt_source_is_seeded_and_resumable(tmp_path):
    _write(tmp_path / "train.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(5)])
    probs = load_jsonl(str(tmp_path / "train.jsonl"))
    a = PromptSource(probs, seed=3)
    first = [p.answer for p in a.next_batch(4)]
    state = a.state_dict()
    nxt = [p.answer for p in a.next_batch(4)]  # crosses into epoch 1
    assert sorted(first + nxt[:1]) == sorted(str(i) for i in range(5))  # a full epoch, no repeats
    b = PromptSource(probs, seed=3)
    assert [p.answer for p in b.next_batch(4)] == first
    c = PromptSource(probs, seed=3)
    c.load_state_dict(state)
    assert [p.answer for p in c.next_batch(4)] == nxt
    assert [p.answer for p in PromptSource(probs, seed=4).next_batch(5)] != [p.answer for p in PromptSource(probs, seed=3).next_batch(5)]
