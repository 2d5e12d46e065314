"""Prompt sources: GSM8K (local JSONL, hub errors), a recipe's own files (JSONL, Parquet) and hub
datasets through the field mapping (a local fixture laid out as the hub stores it), bad rows, the
prompt stream and chat formatting."""

import json
import os

import pytest

from forge_core.data import (DataConfig, DataError, Problem, PromptSource, chat_prompt, load_gsm8k, load_jsonl,
                             load_split, map_row, parse_row)

GSM8K_DIR = os.environ.get("GSM8K_DIR", "")


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def test_local_jsonl(tmp_path):
    _write(tmp_path / "train.jsonl", [{"question": " Q1 ", "answer": "steps\n#### 1,200"},
                                      {"question": "Q2", "answer": "#### -3"}])
    probs = load_gsm8k("train", str(tmp_path))
    assert [(p.prompt, p.answer) for p in probs] == [("Q1", "1200"), ("Q2", "-3")]
    assert probs[1].row == {"question": "Q2", "answer": "#### -3"}  # what a reward function gets
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


def _cfg(**kw) -> DataConfig:
    return DataConfig(**{"dir": None, **kw})


def test_file_source_maps_fields_of_jsonl_and_parquet(tmp_path):
    """A recipe's own data: the field mapping names prompt and answer; answers stay verbatim (strings);
    the rest of the row reaches the reward function; JSONL and Parquet give the same problems."""
    rows = [{"problem": "2+3?", "solution": 5, "level": 1}, {"problem": " 7*6? ", "solution": "42", "level": 2}]
    _write(tmp_path / "train.jsonl", rows)
    import datasets
    datasets.Dataset.from_list([dict(r, solution=str(r["solution"])) for r in rows]).to_parquet(
        str(tmp_path / "train.parquet"))
    for name in ("train.jsonl", "train.parquet"):
        got = load_split(_cfg(source="file", train=str(tmp_path / name), prompt_field="problem",
                              answer_field="solution"), "train")
        assert [(p.prompt, p.answer, p.row["level"]) for p in got] == [("2+3?", "5", 1), ("7*6?", "42", 2)], name
    assert got[1].id.endswith("train.parquet[1]") and load_split(
        _cfg(source="file", train=str(tmp_path / "train.jsonl"), prompt_field="problem", answer_field="solution"),
        "train")[1].id.endswith("train.jsonl:2")


def test_file_source_errors_name_the_file_line_and_the_fields(tmp_path):
    _write(tmp_path / "a.jsonl", [{"problem": "q", "solution": "1"}, {"question": "q2", "solution": "2"}])
    cfg = _cfg(source="file", train=str(tmp_path / "a.jsonl"), prompt_field="problem", answer_field="solution")
    with pytest.raises(DataError, match=r"a\.jsonl:2: no field 'problem' \(data.prompt_field\); the row has "
                                         r"\['question', 'solution'\]"):
        load_split(cfg, "train")
    with pytest.raises(DataError, match=r"data file not found: .*nope\.jsonl"):
        load_split(_cfg(source="file", train=str(tmp_path / "nope.jsonl")), "train")
    with pytest.raises(DataError, match=r"data.test is empty: this recipe has no test split"):
        load_split(_cfg(source="file", train=str(tmp_path / "a.jsonl"), test=""), "test")
    with pytest.raises(DataError, match=r"a .jsonl or .parquet file is expected"):
        load_split(_cfg(source="file", train=str(tmp_path / "a.csv")), "train")
    import datasets
    datasets.Dataset.from_list([{"q": "x", "a": "1"}]).to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(DataError, match=r"b\.parquet: no field 'problem' \(data.prompt_field\); its fields are "
                                         r"\['a', 'q'\]"):
        load_split(_cfg(source="file", train=str(tmp_path / "b.parquet"), prompt_field="problem"), "train")
    with pytest.raises(DataError, match=r"x:1: field 'answer' \(the answer\) is null"):
        map_row({"prompt": "p", "answer": None}, "x:1")
    with pytest.raises(DataError, match=r"x:2: field 'prompt' \(the prompt\) is empty"):
        map_row({"prompt": "  ", "answer": "1"}, "x:2")
    with pytest.raises(DataError, match=r"x:3: field 'messages' must be a non-empty list"):
        map_row({"messages": [{"role": "user"}], "answer": "1"}, "x:3", messages_field="messages")


def test_chat_messages_field_and_the_system_prompt(tmp_path):
    """``messages_field``: a conversation to continue; the recipe's system prompt goes first unless
    the conversation has its own."""
    from forge_core.models import ModelConfig, load_tokenizer

    tok = load_tokenizer(ModelConfig(name="smollm2_135m"))
    p = map_row({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes?"},
                              {"role": "user", "content": "2+2?"}], "answer": "4"}, "x:1", messages_field="messages")
    text = chat_prompt(tok, p, "Be brief.")
    assert text.index("Be brief.") < text.index("Hi") < text.index("Yes?") < text.index("2+2?")
    own = Problem(id="y", prompt="", answer="", messages=({"role": "system", "content": "Mine."},
                                                          {"role": "user", "content": "Q"}))
    assert "Be brief." not in chat_prompt(tok, own, "Be brief.") and "Mine." in chat_prompt(tok, own, "Be brief.")
    assert chat_prompt(tok, "Q", "S") == chat_prompt(tok, Problem(id="", prompt="Q", answer=""), "S")


def _hendrycks_math_fixture(root) -> str:
    """A local dataset laid out as ``EleutherAI/hendrycks_math`` is on the hub: a README whose YAML
    header declares one config per subject (``algebra``, ...) with ``<subject>/train-*.parquet`` and
    ``<subject>/test-*.parquet``; fields ``problem``, ``level``, ``type``, ``solution``."""
    import datasets

    d = root / "hendrycks_math"
    rows = {"train": [("What is $1+1$?", "$1+1=\\boxed{2}$"), ("Solve $2x=4$.", "So $x=\\boxed{2}$.")],
            "test": [("Compute $\\frac{1}{2}+\\frac{1}{2}$.", "It is $\\boxed{1}$.")]}
    for subject in ("algebra", "prealgebra"):
        (d / subject).mkdir(parents=True)
        for split, items in rows.items():
            datasets.Dataset.from_list([{"problem": f"[{subject}] {q}", "level": "Level 1", "type": "Algebra",
                                         "solution": s} for q, s in items]).to_parquet(
                str(d / subject / f"{split}-00000-of-00001.parquet"))
    header = "".join(f"- config_name: {s}\n  data_files:\n  - split: train\n    path: {s}/train-*\n"
                     f"  - split: test\n    path: {s}/test-*\n" for s in ("algebra", "prealgebra"))
    (d / "README.md").write_text(f"---\nconfigs:\n{header}---\n# hendrycks_math (fixture)\n")
    return str(d)


def test_hub_source_with_field_mapping_against_a_local_fixture(tmp_path, monkeypatch):
    """``source: hub`` loads through ``datasets.load_dataset(hub_id, hub_config, split=...)``: the
    documented MATH example (recipes' README: EleutherAI/hendrycks_math) against a fixture in the hub's
    layout, with no network; a missing field lists the dataset's fields."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    hub_id = _hendrycks_math_fixture(tmp_path)
    cfg = _cfg(source="hub", hub_id=hub_id, hub_config="prealgebra", train="train", test="test",
               prompt_field="problem", answer_field="solution")
    train, test = load_split(cfg, "train"), load_split(cfg, "test")
    assert [p.prompt for p in train] == ["[prealgebra] What is $1+1$?", "[prealgebra] Solve $2x=4$."]
    assert train[0].answer == "$1+1=\\boxed{2}$" and train[0].row["level"] == "Level 1"
    assert test[0].id == f"{hub_id}/test[0]"
    with pytest.raises(DataError, match=r"no field 'question' \(data.prompt_field\); its fields are \['level', "
                                         r"'problem', 'solution', 'type'\]"):
        load_split(_cfg(source="hub", hub_id=hub_id, hub_config="algebra", prompt_field="question"), "train")
    with pytest.raises(DataError, match=r"could not load .*split 'validation'"):
        load_split(_cfg(source="hub", hub_id=hub_id, hub_config="algebra", train="validation",
                        prompt_field="problem"), "train")


def test_the_math_recipes_hub_mapping_against_a_local_fixture(tmp_path, monkeypatch):
    """recipes/qwen3_1_7b_math as it is, its hub_id pointed at a fixture in EleutherAI/hendrycks_math's
    layout: its config (algebra), splits and field mapping load, and its `math` reward scores a response
    with the solution's boxed answer as correct and another as wrong."""
    from forge_core.config import load_config
    from forge_core.rewards import load_reward_fn

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = load_config("qwen3_1_7b_math", [f"data.hub_id={_hendrycks_math_fixture(tmp_path)}"])
    train, test = load_split(cfg.data, "train"), load_split(cfg.data, "test")
    assert [p.prompt for p in train][0] == "[algebra] What is $1+1$?" and len(test) == 1
    fn = load_reward_fn(cfg.reward)
    ex = {**test[0].row, "target": test[0].answer}
    assert fn("So the sum is \\boxed{1}.", ex)["correct"] == 1.0 and fn("\\boxed{2}", ex)["correct"] == 0.0
