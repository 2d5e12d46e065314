"""Supervised fine-tuning (``loss=sft``) end to end through the CLI with the tiny model: an SFT run's
checkpoint resumes exactly; GRPO starts from its ``final/`` (the trainer and the reference hold its
weights bit for bit); and the bad input of that path (a missing target, an unfinished run as
``model.path``, SFT without trainer GPUs)."""

import asyncio
import json
import os
import shutil

import pytest
import torch

from forge_core.config import ConfigError, load_config
from helpers import TINY_MODEL, cli, cli_here, rows

# the SFT recipe's tiny runs: targets cut at 24 tokens (generator.max_response_tokens), its own group size
TINY = [*TINY_MODEL, "generator.max_response_tokens=24", "generator.max_prompt_tokens=128", "trainer.micro_batch_size=4",
        "trainer.lr=1e-3"]


def trained(run_dir) -> list[dict]:
    """The training rows of a run (held-out evaluation rows have no ``batch_hash``)."""
    return [r for r in rows(run_dir) if "batch_hash" in r]


@pytest.mark.slow
def test_an_sft_run_resumes_exactly_and_grpo_starts_from_its_final(tmp_path):
    """The run as a preemption after step 4 leaves it (a copy of an uninterrupted four-step run without
    its step-4 checkpoint and final/), resumed from its step-2 checkpoint, trains steps 3 and 4 on the
    examples (``batch_hash``) of the uninterrupted run to the same losses, each step logged once. GRPO
    with ``model.path=<run>/final`` then trains from those weights: its reference holds them bit for bit."""
    out = tmp_path / "runs"
    common = ["smollm2_135m_sft", *TINY, f"output_dir={out}", "checkpoint.every=2"]
    r = cli("run", *common, "steps=4", "run_id=whole")
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.copytree(out / "whole", out / "cut", ignore=shutil.ignore_patterns("final", "step_000004"))
    assert sorted(os.listdir(out / "cut" / "checkpoints")) == ["step_000002"]
    r = cli("run", *common, "steps=4", "run_id=cut")
    assert r.returncode == 0, r.stderr[-3000:]
    whole, cut = trained(out / "whole"), trained(out / "cut")
    assert [x["step"] for x in cut] == [1, 2, 3, 4]
    # steps 3 and 4 are the resumed run's (its own start-up), which also wrote final/
    assert all(x["startup_s"] != y["startup_s"] for x, y in zip(cut[2:], whole[2:])) and (out / "cut" / "final").is_dir()
    assert [x["batch_hash"] for x in cut] == [x["batch_hash"] for x in whole]
    assert [x["loss"] for x in cut] == pytest.approx([x["loss"] for x in whole], rel=1e-5)
    assert all(x["target_tokens"] > 0 and x["loss"] > 0 for x in cut)

    from safetensors.torch import load_file

    from forge_core.layout import plan_layout
    from forge_core.services import Service, call, spawn_service

    final = str(out / "whole" / "final")
    sft_weights = load_file(os.path.join(final, "model.safetensors"))

    async def go():  # GRPO's trainer and reference (the actors this needs) from the SFT run's final/
        cfg = load_config("smollm2_135m", [*TINY, f"model.path={final}", "generator.group_size=2"])
        plan = plan_layout(cfg)
        got = await asyncio.gather(spawn_service(cfg, "trainer", plan.trainer, plan),
                                   spawn_service(cfg, "reference", plan.reference, plan), return_exceptions=True)
        try:
            trainer, reference = got
            for e in got:
                if isinstance(e, BaseException):
                    raise e
            await call("reference", reference.load_initial, await call("trainer", trainer.publish))
            loaded = await call("reference", reference.digest)  # what the trainer handed it (version 0)
            return (await call("trainer", trainer.state_dict), loaded,
                    await call("reference", reference.rebuild_initial))  # final/ read from disk again
        finally:
            await asyncio.gather(*(s.stop() for s in got if isinstance(s, Service)))

    trainer_w, reference_digest, from_disk_digest = asyncio.run(go())
    assert set(trainer_w) == set(sft_weights)
    for k, v in sft_weights.items():
        assert torch.equal(trainer_w[k], v), k
    assert reference_digest == from_disk_digest  # the reference (GRPO's KL anchor) is the SFT checkpoint


@pytest.mark.slow
def test_bad_sft_input_is_named(tmp_path):
    """A training row without a target names the row; ``model.path`` at an SFT run that did not finish
    names what the run has and how to finish it; SFT on a GPU recipe without trainer GPUs is refused."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        with open(data / f"{split}.jsonl", "w") as f:
            f.write(json.dumps({"q": "1 + 1?", "sol": "2"}) + "\n" + json.dumps({"q": "2 + 2?", "sol": ""}) + "\n")
    r = cli_here("run", "smollm2_135m_sft", *TINY, "data.source=file", f"data.train={data}/train.jsonl",
            f"data.test={data}/test.jsonl", "data.prompt_field=q", "data.answer_field=sol", "reward.fn=math",
            f"output_dir={tmp_path}/runs")
    assert r.returncode == 2 and "train.jsonl:2: no SFT target: field 'sol' is missing or empty" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()

    run = tmp_path / "sft_run"
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in (1, 2, 3, 4, 5)))
    r = cli_here("run", "smollm2_135m", *TINY, f"model.path={run}/final")
    assert r.returncode == 2 and f"{run} is a run that did not finish (no final/; metrics up to step 5, " \
        f"checkpoints: ['step_000004'])" in r.stderr and "the same run_id" in r.stderr, r.stderr

    with pytest.raises(ConfigError, match=r"loss=sft trains on the trainer's GPUs, and layout.trainer.gpus=0"):
        load_config("qwen3_1_7b", ["loss=sft", "loss.beta=0", "layout.trainer.gpus=0"])
    with pytest.raises(ConfigError, match=r"loss=sft: beta must be 0"):
        load_config("smollm2_135m_sft", ["loss.beta=0.1"])


@pytest.mark.slow
def test_sft_on_tool_conversations(tmp_path):
    """SFT on conversations with the calculator tool (``env.fn=tools``): rows of ``messages`` whose
    assistant turns call the tool; the step trains on the assistant turns alone (``target_tokens``
    counts those, fewer than the response's tokens); a row without an assistant turn is refused by name
    before anything is written."""
    data = tmp_path / "data"
    data.mkdir()
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%d * %d"}}\n</tool_call>'
    convs = [[{"role": "user", "content": f"What is {a} * {b}?"}, {"role": "assistant", "content": call % (a, b)},
              {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": f"The answer is {a * b}."}]
             for a, b in [(347, 829), (12, 13), (41, 59)]]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"messages": c, "answer": c[2]["content"]}) + "\n"
                                                     for c in convs))
    args = ["smollm2_135m_sft", *TINY, "generator.max_response_tokens=96", "env.fn=tools", "data.source=file",
            f"data.train={data}/train.jsonl", f"data.test={data}/test.jsonl", "data.messages_field=messages",
            "data.answer_field=answer", "reward.fn=math", "steps=1", f"output_dir={tmp_path}/runs", "run_id=conv"]
    r = cli_here("run", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = trained(tmp_path / "runs" / "conv")
    assert 0 < row["target_tokens"] < row["seq_tokens"] and row["loss"] > 0

    (data / "train.jsonl").write_text(json.dumps({"messages": convs[0][:1], "answer": "1"}) + "\n" +
                                      (data / "train.jsonl").read_text())
    r = cli_here("run", *args[:-1], "run_id=bad")
    assert r.returncode == 2 and "train.jsonl:1: no assistant turn in its messages" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "runs" / "bad").exists()
