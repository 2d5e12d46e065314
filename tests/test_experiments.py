"""A recipe folder as a whole experiment, end to end through the CLI with the tiny model: its own data
(JSONL beside its config) and reward (``reward.py`` in the folder), held-out evaluation during the run
(rows at the right steps and versions; that it leaves the training batches unchanged is checked on
tests/test_e2e.py's shared runs), and the bad input of that
path (each refused before anything is written, or, at run time, stopping the run with checkpoints intact)."""

import json
import os
import random
import shutil
import subprocess

import pytest

from helpers import PY, ROOT, TINY, cli, cli_here, rows
REWARD = '''
def score(response, example):
    """1 for the right sum, a small bonus for short answers."""
    digits = "".join(c for c in response if c.isdigit())
    return {"correct": float(digits == str(example["sum"])), "brevity": 0.1 * (len(response) < 8)}


def nan_on_the_third_batch(response, example):
    import os
    path = os.path.join(os.path.dirname(__file__), "calls")
    n = int(open(path).read()) + 1 if os.path.exists(path) else 1
    open(path, "w").write(str(n))
    return float("nan") if n > 17 else 0.5 * (n % 2)  # 1 check call, then 8 calls a batch
'''
CONFIG = '''
data:
  source: file
  train: data/train.jsonl
  test: data/test.jsonl
  prompt_field: q
  answer_field: sum
  system_prompt: Answer with the number only.
reward:
  fn: reward.py:score
'''


def copy_recipe(tmp_path, name="my_sums", rows=(40, 10)):
    """``cp -r recipes/smollm2_135m <tmp>/<name>`` plus its own data (two JSONL files) and reward."""
    d = tmp_path / name
    shutil.copytree(os.path.join(ROOT, "recipes", "smollm2_135m"), d)
    (d / "data").mkdir()
    rng = random.Random(0)
    for split, n in zip(("train", "test"), rows):
        with open(d / "data" / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                a, b = rng.randint(1, 9), rng.randint(1, 9)
                f.write(json.dumps({"q": f"{a} + {b} = ?", "sum": a + b}) + "\n")
    (d / "reward.py").write_text(REWARD)
    with open(d / "config.yaml", "a") as f:
        f.write(CONFIG)
    return d


@pytest.mark.slow
def test_a_copied_recipe_trains_on_its_own_data_and_reward_and_evaluates(tmp_path):
    """The copy's own JSONL and reward.py: its reward's components are logged; held-out evaluation at
    start and every 2 steps (and the last) logs rows at those steps with the version evaluated."""
    d = copy_recipe(tmp_path)
    r = cli_here("check", d, *TINY)
    assert r.returncode == 0 and "40 training prompts" in r.stderr and "reward.py:score" in r.stdout, r.stderr
    r = cli("run", d, *TINY, "steps=3", "eval.every=2", "eval.at_start=true", "eval.num_questions=4",
            f"output_dir={tmp_path}/runs", "run_id=a")
    assert r.returncode == 0, r.stderr[-3000:]
    got = rows(tmp_path / "runs" / "a")
    steps = [x for x in got if "reward_mean" in x]
    evals = [x for x in got if "eval/pass@1" in x]
    assert [x["step"] for x in steps] == [1, 2, 3]
    assert all({"reward/correct", "reward/brevity", "entropy"} <= set(x) for x in steps), steps[0]
    assert all(x["reward_mean"] == pytest.approx(x["reward/correct"] + x["reward/brevity"]) for x in steps)
    assert [(x["step"], x["eval/policy_version"]) for x in evals] == [(0, 0), (2, 2), (3, 3)]
    assert all(x["eval/questions"] == 4 and "eval/reward/brevity" in x and x["eval/entropy"] > 0 for x in evals)
    assert (tmp_path / "runs" / "a" / "final" / "model.safetensors").is_file()


EVAL = ["eval.every=1", "eval.at_start=true", "eval.num_questions=3", "eval.samples=2", "eval.temperature=1.0"]


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    """A 3-step run of the tiny model with a sampled held-out evaluation (3 questions, 2 samples,
    temperature 1) at the start and after every step."""
    d = tmp_path_factory.mktemp("eval_run")
    r = cli("run", "smollm2_135m", *TINY, "steps=3", "max_staleness=0", f"output_dir={d}", *EVAL, "run_id=eval")
    assert r.returncode == 0, r.stderr[-3000:]
    return d / "eval"


@pytest.mark.slow
def test_make_eval_of_final_gives_the_runs_own_evaluation_of_that_version(eval_run):
    """One score per checkpoint: ``make eval`` of the run's ``final/`` (policy version 3, float32)
    samples the very responses (``responses_digest``) and gives the same pass@1, pass@2, reward and
    response length as the run's own evaluation of version 3 (its generator actor in its own process,
    the weights from the trainer), with a sampled evaluation, so that the calls, seeds, prompts, dtype
    and settings must all agree. The check can fail: other calls (one question a call) sample other
    responses."""
    from forge_core.config import load_config
    from forge_core.evaluate import evaluate

    run = eval_run
    last = [x for x in rows(run) if "eval/pass@1" in x][-1]
    assert last["eval/policy_version"] == 3
    cfg = load_config("smollm2_135m", [*TINY, *EVAL])
    res = evaluate(cfg, str(run / "final"), progress=False, engine="hf")
    assert res["policy_version"] == 3 and res["questions"] == 3 and res["k"] == 2
    assert res["responses_digest"] == last["eval/responses_digest"]
    for k in ("pass@1", "pass@2", "reward_mean", "format_rate", "response_len_mean", "truncated_frac"):
        assert res[k] == last[f"eval/{k}"], k
    other = evaluate(load_config("smollm2_135m", [*TINY, *EVAL, "eval.batch_size=1"]), str(run / "final"),
                     progress=False, engine="hf")
    assert other["responses_digest"] != last["eval/responses_digest"]


@pytest.mark.slow
def test_bad_experiment_input_is_refused_before_anything_is_written(tmp_path):
    """Each refused by ``check`` and by ``run`` (exit 2) naming the file, field or function, with no run
    directory written: a data file that does not exist, a field not in the data (the fields it has are
    listed), a misspelled reward function (its functions listed), a reward with the wrong signature,
    prompts_per_step beyond the data, evaluation without a held-out split."""
    d = copy_recipe(tmp_path, rows=(3, 2))
    (d / "reward.py").write_text(REWARD + "\ndef one(response):\n    return 1.0\n")
    cases = [(["data.train=data/nope.jsonl"], "my_sums/data/nope.jsonl"),
             (["data.prompt_field=question"], "train.jsonl:1: no field 'question' (data.prompt_field); the row has "
                                              "['q', 'sum']"),
             (["reward.fn=reward.py:scor"], "has no function 'scor' (its functions: ['nan_on_the_third_batch', "
                                            "'one', 'score'])"),
             (["reward.fn=reward.py:one"], "one(response) cannot be called as one(response: str, example: dict)"),
             (["prompts_per_step=4"], "prompts_per_step=4 is more than the 3 training prompts"),
             (["data.test=", "eval.every=1"], "data.test is empty")]
    for i, (over, says) in enumerate(cases):
        args = [*TINY, *over, f"output_dir={tmp_path}/runs"]
        for cmd in ("check", "run") if i < 3 else ("run",):  # check and run share the code (load_task)
            r = cli_here(cmd, d, *args)
            assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (cmd, over, r.stderr)
        assert not (tmp_path / "runs").exists(), over


@pytest.mark.slow
def test_a_reward_returning_nan_stops_the_run_naming_it_with_checkpoints_intact(tmp_path):
    """NaN from the recipe's reward at run time (the third batch) stops the run with exit 1, naming the
    function, the example and the value; no respawn of the reward actor; step 1's checkpoint stays."""
    d = copy_recipe(tmp_path)
    r = cli("run", d, *TINY, "reward.fn=reward.py:nan_on_the_third_batch", "steps=4", "max_staleness=0",
            "checkpoint.every=1", f"output_dir={tmp_path}/runs", "run_id=n")
    assert r.returncode == 1, r.stderr[-3000:]
    err = r.stderr
    assert "reward.fn=" in err and "nan_on_the_third_batch' returned nan on example " in err and "data/train.jsonl:" \
        in err and "checkpoints and metrics written so far are intact" in err, err[-3000:]
    assert "respawned" not in err and "Traceback" not in err, err[-3000:]
    run = tmp_path / "runs" / "n"
    assert [x["step"] for x in rows(run)] == [1, 2]
    assert (run / "checkpoints" / "step_000002" / "model.safetensors").is_file()


def test_a_fault_warning_keeps_the_error_whole():
    """A respawn warning quotes the actor's exception (the last line of its error, after a traceback),
    cut at a word boundary, never mid-path."""
    from forge_core.controller import _brief

    path = "/tmp/some/very/long/" + "directory/" * 40 + "file.py"
    err = RuntimeError(f"Traceback (most recent call last):\n  File \"{path}\", line 3, in f\n"
                       f"ValueError: weight layout mismatch between trainer and generator_1")
    assert _brief(err) == "ValueError: weight layout mismatch between trainer and generator_1"
    long = RuntimeError("x " * 300)
    assert _brief(long).endswith(" ...") and len(_brief(long)) <= 404


def test_the_arithmetic_recipes_data_is_what_its_script_writes(tmp_path):
    """recipes/smollm2_135m_arith ships data/*.jsonl; make_data.py writes the same bytes (seeded), with
    no held-out fact among the training facts (not even with its operands swapped)."""
    rows = _shipped_data_is_what_its_script_writes("smollm2_135m_arith", tmp_path)
    def key(r):  # the operation and its two single-digit operands, unordered
        x, y = (int(v) for v in r["question"].split("?")[0].split()[2::2])
        a, b = {"+": (x, y), "x": (x, y), "-": (x - y, y), "/": (y, x // y)}[r["op"]]
        return r["op"], min(a, b), max(a, b)
    assert not {key(r) for r in rows["test"]} & {key(r) for r in rows["train"]}
    assert (len(rows["train"]), len(rows["test"])) == (195, 61)


def test_the_tool_recipes_data_is_what_its_script_writes(tmp_path):
    """recipes/smollm2_135m_tool ships data/*.jsonl; make_data.py writes the same bytes (seeded); no
    held-out (a, b) pair is a training pair, and every answer is the product."""
    rows = _shipped_data_is_what_its_script_writes("smollm2_135m_tool", tmp_path)
    assert not {(r["a"], r["b"]) for r in rows["test"]} & {(r["a"], r["b"]) for r in rows["train"]}
    assert all(r["answer"] == str(r["a"] * r["b"]) for rs in rows.values() for r in rs)
    assert (len(rows["train"]), len(rows["test"])) == (2000, 200)


def _shipped_data_is_what_its_script_writes(recipe: str, tmp_path) -> dict:
    """Run ``recipes/<recipe>/make_data.py`` in ``tmp_path``: it writes the bytes the folder ships in
    ``data/{train,test}.jsonl``. Returns the shipped rows, ``{"train": [...], "test": [...]}``."""
    d = os.path.join(ROOT, "recipes", recipe)
    shutil.copy(os.path.join(d, "make_data.py"), tmp_path)
    subprocess.run([PY, str(tmp_path / "make_data.py")], check=True, capture_output=True)
    for split in ("train", "test"):
        with open(os.path.join(d, "data", f"{split}.jsonl")) as a, open(tmp_path / "data" / f"{split}.jsonl") as b:
            assert a.read() == b.read(), split
    return {s: [json.loads(l) for l in open(os.path.join(d, "data", f"{s}.jsonl"))] for s in ("train", "test")}
