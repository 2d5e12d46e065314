"""End to end through real Monarch actors with a tiny random-initialised Llama-architecture model."""

import asyncio
import json
import os
import shutil
import signal
import time
from types import SimpleNamespace

import psutil
import pytest
import torch

from forge_core.config import load_config
from helpers import TINY, finish, live_rows, rows, run, start_run, steps

GSM8K_DIR = os.environ["GSM8K_DIR"]  # tests/conftest.py: the real copy, or a synthetic one

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("packing", [[], ["trainer.tokens_per_micro_batch=512"]], ids=["padded", "packed"])
def test_two_grpo_steps_through_actors(packing):
    """2 real GRPO steps: finite loss, changed weights, generator version advanced and bitwise-equal
    weights; padded micro-batches, and packed ones (rows of 512 tokens) in trainer and reference."""
    from forge_core.advantages import compute_advantages
    from forge_core.data import PromptSource, load_gsm8k
    from forge_core.services import call, spawn_services

    async def go():
        cfg = load_config("smollm2_135m", TINY + ["generator.dtype=float32"] + packing)
        svc = await spawn_services(cfg)
        try:
            src = PromptSource(load_gsm8k("train", GSM8K_DIR), 0)
            w0 = await call("trainer", svc.trainer.state_dict)
            await call("generator", svc.generator.update_weights, await call("trainer", svc.trainer.publish))
            await call("reference", svc.reference.load_initial, await call("trainer", svc.trainer.publish))
            losses = []
            for step in range(2):
                eps, gen = await call("generator", svc.generator.generate, src.next_batch(2), step)
                assert len(eps) == 8 and all(e.policy_version == step for e in eps)
                assert all(len(e.behaviour_logprobs) == len(e.response_ids) > 0 for e in eps)
                eps, _ = await call("reward", svc.reward.score, eps)
                lists, _ = await call("reference", svc.reference.logprobs, eps)
                for e, lp in zip(eps, lists):
                    e.ref_logprobs = lp
                adv, _, _ = compute_advantages(torch.tensor([e.reward for e in eps]).view(2, 4), cfg.advantage)
                for e, a in zip(eps, adv.flatten().tolist()):
                    e.advantage = a if any(adv.flatten()) else (1.0 if e.group == 0 else -1.0)  # random model: force signal
                m = await call("trainer", svc.trainer.train_step, eps)
                losses.append(m["loss"])
                sync = await call("generator", svc.generator.update_weights, await call("trainer", svc.trainer.publish))
                assert sync["version"] == step + 1 and sync["sync_s"] > 0
            assert all(map(lambda x: x == x and abs(x) < 1e6, losses))  # finite
            w2 = await call("trainer", svc.trainer.state_dict)
            changed = [k for k in w0 if not torch.equal(w0[k], w2[k])]
            assert len(changed) == len(w0)
            assert await call("generator", svc.generator.get_version) == 2 == await call("trainer", svc.trainer.get_version)
            g = await call("generator", svc.generator.state_dict)
            for k, v in w2.items():
                assert torch.equal(g[k], v), k  # bit for bit (fp32 on both sides here)
            assert await call("generator", svc.generator.weights_digest) == await call("trainer", svc.trainer.weights_digest)
            # the reference stays the initial policy
            r = await call("reference", svc.reference.logprobs, eps[:1])
            assert r[0][0] == eps[0].ref_logprobs
        finally:
            await svc.stop()

    asyncio.run(go())


def test_bf16_sync_is_bitwise_cast_of_master_weights():
    """Generator dtype bf16: the generator holds exactly the trainer's fp32 weights cast to bf16 (the
    two actors alone: a sync needs no other)."""
    from forge_core.layout import plan_layout
    from forge_core.services import Service, call, spawn_service

    async def go():
        cfg = load_config("smollm2_135m", TINY + ["generator.dtype=bfloat16"])
        plan = plan_layout(cfg)
        got = await asyncio.gather(spawn_service(cfg, "generator", plan.generators[0], plan),
                                   spawn_service(cfg, "trainer", plan.trainer, plan), return_exceptions=True)
        try:
            gen, trainer = got
            for e in got:
                if isinstance(e, BaseException):
                    raise e
            await call("generator", gen.update_weights, await call("trainer", trainer.publish))
            t = await call("trainer", trainer.state_dict)
            g = await call("generator", gen.state_dict)
            assert all(v.dtype == torch.bfloat16 for v in g.values())
            for k, v in t.items():
                assert torch.equal(g[k], v.to(torch.bfloat16)), k
        finally:
            await asyncio.gather(*(s.stop() for s in got if isinstance(s, Service)))

    asyncio.run(go())


def test_cli_run_outputs_and_resume(tmp_path):
    rc, out = run(["steps=2", "checkpoint.every=1"], "r1", tmp_path)
    assert rc == 0, out[-3000:]
    run_dir = tmp_path / "r1"
    got = rows(run_dir)
    assert [r["step"] for r in got] == [1, 2]
    for key in ("reward_mean", "reward_std", "accuracy", "response_len_mean", "loss", "kl_mean", "clip_frac",
                "grad_norm", "gen_tok_s", "gen_s", "ref_s", "train_s", "weight_sync_s", "policy_version",
                "staleness_max", "step_s"):
        assert key in got[-1], key
    assert got[-1]["policy_version"] == 2 and all(r["staleness_max"] <= 1 for r in got)
    assert all(r["gen_s"] > 0 and r["ref_s"] > 0 for r in got), got  # every row: its rollout's timings
    # a quiet console on a CPU machine: the dtype and threads are announced, nothing looks like an error
    assert "dtype auto ->" in out and "threads" in out, out[-3000:]
    assert "weight sync: generator (node 0) <- trainer (node 0): ipc (auto: same host)" in out, out[-3000:]
    for noise in ("[RdmaXcel]", "libcuda.so", "terminate called", "Traceback"):
        assert noise not in out, (noise, out[-3000:])
    assert (run_dir / "reward.png").stat().st_size > 1000
    assert (run_dir / "final" / "model.safetensors").is_file() and (run_dir / "final" / "tokenizer.json").is_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(run_dir / "final")  # a loadable HF checkpoint
    tok = AutoTokenizer.from_pretrained(run_dir / "final")  # a generator's tokenizer, without its last call's settings
    assert tok.eos_token == "<|im_end|>" and tok.backend_tokenizer.truncation is None
    # resume the same run id to 3 steps: continues at step 3, no duplicate lines
    rc, out = run(["steps=3", "checkpoint.every=1"], "r1", tmp_path)
    assert rc == 0, out[-3000:]
    assert steps(run_dir) == [1, 2, 3]


def test_ctrl_c_stops_every_actor_and_keeps_outputs(tmp_path):
    p = start_run(["steps=200", "checkpoint.every=1"], "int", tmp_path, start_new_session=True)
    metrics = tmp_path / "int" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and len(live_rows(metrics)) < 3:  # step 1's checkpoint (background) committed
        time.sleep(0.5)
    assert metrics.exists(), "the run never logged a step"
    children = psutil.Process(p.pid).children(recursive=True)
    assert len(children) >= 5  # one process per actor
    os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
    rc, out = finish(p, 120)
    assert rc != 0 and "interrupted" in out, (rc, out[-3000:])
    assert not _alive(children), f"orphan actor processes: {_alive(children)}"
    assert steps(metrics) == list(range(1, len(rows(metrics)) + 1))  # every line parses, no step twice
    # complete checkpoints only (a save cut short by Ctrl-C stays a .tmp dir, which resume ignores)
    ckpts = sorted(c for c in (tmp_path / "int" / "checkpoints").iterdir() if not c.name.endswith(".tmp"))
    assert ckpts and (ckpts[-1] / "controller.json").is_file()
    from safetensors.torch import load_file

    assert load_file(ckpts[-1] / "model.safetensors")


def _alive(procs: list, wait_s: float = 10) -> list[int]:
    """The pids of ``procs`` still running (zombies count as gone) after up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while (alive := [c.pid for c in procs if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def test_dead_actor_is_named_and_outputs_survive(tmp_path):
    # no respawn allowed (fault.max_restarts=0): the run stops at the first death, naming the actor
    # (respawns are tests/test_chaos.py's)
    p = start_run(["steps=200", "checkpoint.every=1", "fault.max_restarts=0"], "dead", tmp_path,
                  start_new_session=True)
    run_dir = tmp_path / "dead"
    deadline = time.time() + 300  # until a complete checkpoint exists: the death must not touch it

    def complete() -> list:  # checkpoint directories whose save finished
        ckpts = run_dir / "checkpoints"
        return [c for c in ckpts.iterdir() if not c.name.endswith(".tmp")] if ckpts.is_dir() else []

    while time.time() < deadline and not ((run_dir / "metrics.jsonl").exists() and complete()):
        time.sleep(0.5)
    children = psutil.Process(p.pid).children(recursive=True)
    pid = json.loads((run_dir / "actors.json").read_text())["generator"]["pid"]
    os.kill(pid, signal.SIGKILL)
    rc, out = finish(p, 180)
    assert rc not in (0, None)
    assert "error: actor 'generator' failed" in out and "Traceback" not in out, out[-3000:]
    assert not _alive(children), f"orphan actor processes: {_alive(children)}"
    got = steps(run_dir)
    assert got and got == list(range(1, len(got) + 1))
    assert complete() and all((c / "controller.json").is_file() for c in complete())


@pytest.mark.parametrize("loss", ["gspo", "dapo", "reinforce"])
def test_loss_is_one_config_key(tmp_path, loss):
    """`make run ARGS="loss=gspo"` trains end to end with that loss."""
    rc, out = run([f"loss={loss}", "steps=1"], loss, tmp_path)
    assert rc == 0, out[-3000:]
    got = rows(tmp_path / loss)
    assert len(got) == 1 and got[0]["loss"] == got[0]["loss"]
    assert f"name: {loss}" in (tmp_path / loss / "config.yaml").read_text()


TWO_TURNS_ENV = """
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class TwoTurns(BaseTextEnv):
    \"\"\"Two model turns; each step's reward depends on the turn's text, so groups have advantages.\"\"\"

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.max_turns = 2

    def step(self, action):
        self.turns += 1
        done = self.turns >= self.max_turns
        return BaseTextEnvStepOutput(observations=[] if done else [{"role": "user", "content": "Go on."}],
                                     reward=(len(action) % 7) / 7, done=done, metadata={})
"""


# One set of runs that several tests below look at (each checks its own thing about them; the module's
# tests that use it are one unit of work under pytest-xdist, tests/conftest.py): a multi-turn GRPO run
# with LoRA adapters through every actor, uninterrupted with held-out evaluation at every step, and the
# same run without evaluation stopped after step 2 and resumed from its step-2 checkpoint.
RESUMED = ["env.max_turns=2", "env.max_turn_tokens=12", "generator.max_response_tokens=48", "reward.fn=none",
           "trainer.lora.rank=4", "max_staleness=0", "checkpoint.every=2", "generator.dtype=float32",
           "trainer.compute_dtype=float32"]
EVERY_STEP_EVAL = ["eval.every=1", "eval.at_start=true", "eval.num_questions=3", "eval.samples=2", "eval.temperature=1.0"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Runs under one directory (``.dir``; the environment file ``env.py`` beside them): ``whole``, 3
    steps with evaluation at the start and after every step (2 samples at temperature 1); ``cut``, the
    same without evaluation run to step 2, then the same run id to step 3 (a resume from its step-2
    checkpoint). The environment (skyrl-gym's interface, two model turns, a reward from each turn's
    text) gives groups advantages, so the adapters learn. ``max_staleness=0``: with 1, the 3-step run
    samples its third batch with version 1 while step 2 trains, which a run told to stop at step 2
    never does (its resume samples that batch with version 2). fp32: the comparisons are exact."""
    d = tmp_path_factory.mktemp("resumed")
    (d / "env.py").write_text(TWO_TURNS_ENV)
    args = [f"env.fn={d}/env.py:TwoTurns", *RESUMED]
    for extra, run_id in ((EVERY_STEP_EVAL + ["steps=3"], "whole"), (["steps=2"], "cut"), (["steps=3"], "cut")):
        rc, out = run(args + extra, run_id, d)
        assert rc == 0, out[-3000:]
    return SimpleNamespace(dir=d, args=args)


def trained(run_dir) -> list[dict]:
    """The training rows of a run's metrics.jsonl (the held-out evaluation's rows left out)."""
    return [r for r in rows(run_dir) if "batch_hash" in r]


def test_multi_turn_episodes_train_masked_and_evaluate_through_the_environment(resumed):
    """Masked episodes train (the environment's turn is masked out of the loss), the per-step
    multi-turn metrics are logged, and the held-out evaluation runs its episodes through the environment."""
    whole = trained(resumed.dir / "whole")
    assert [r["step"] for r in whole] == [1, 2, 3]
    for r in whole:
        assert r["turns_mean"] == 2.0 and 0.1 < r["masked_frac"] < 0.9, r
        assert r["loss"] != 0.0 and r["reward/env"] > 0 and r["tool_calls_mean"] == 0.0, r
    evals = [r for r in rows(resumed.dir / "whole") if "eval/pass@1" in r]
    assert evals and all(e["eval/turns_mean"] == 2.0 and e["eval/masked_frac"] > 0.1 for e in evals), evals


def test_a_resumed_run_trains_what_the_uninterrupted_one_trains(resumed):
    """The run stopped after step 2 and resumed trains step 3 on the same batch (``batch_hash``) to the
    same loss and gradient norm as the uninterrupted run, and logs each step once."""
    whole, cut = trained(resumed.dir / "whole"), trained(resumed.dir / "cut")
    assert [r["step"] for r in cut] == [1, 2, 3]
    for a, b in zip(whole, cut):
        assert a["batch_hash"] == b["batch_hash"] and a["loss"] == b["loss"], (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a["step"], a["grad_norm"], b["grad_norm"])
    assert any(r["grad_norm"] > 0 for r in whole)


def test_evaluation_does_not_change_the_training_batches(resumed):
    """The run with evaluation at every step (sampled, 2 samples) trains on the batches of the run
    without it, to the same losses: evaluation uses its own seed and no rollout state. Its rows come at
    the start and after each step, with the version evaluated."""
    got = rows(resumed.dir / "whole")
    assert [(r["step"], r["eval/policy_version"]) for r in got if "eval/pass@1" in r] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert not [r for r in rows(resumed.dir / "cut") if "eval/pass@1" in r]
    whole, cut = trained(resumed.dir / "whole"), trained(resumed.dir / "cut")
    assert [r["batch_hash"] for r in whole[:2]] == [r["batch_hash"] for r in cut[:2]]  # both from the start
    assert [r["loss"] for r in whole[:2]] == [r["loss"] for r in cut[:2]]


def test_a_lora_run_syncs_merged_weights_and_writes_the_adapter(resumed):
    """With LoRA: every row reports the merged weights' bytes moved (the whole model in fp32, tied
    embeddings once), the reference is the trainer's process (its base model), and final/ holds the
    merged model and the adapter."""
    from forge_core import titan

    n_bytes = sum(v.numel() * 4 for v in titan.build_model(titan.titan_model_args("tiny_llama"),
                                                            torch.device("cpu")).parameters())
    whole = trained(resumed.dir / "whole")
    assert all(r["weight_sync_bytes"] == n_bytes for r in whole[1:]), [r["weight_sync_bytes"] for r in whole]
    actors = json.loads((resumed.dir / "whole" / "actors.json").read_text())
    assert actors["reference"]["pid"] == actors["trainer"]["pid"]
    final = resumed.dir / "whole" / "final"
    assert (final / "model.safetensors").is_file() and (final / "adapter" / "adapter_model.safetensors").is_file()


def test_resuming_a_lora_run_without_lora_is_refused(resumed):
    """A copy of the resumed LoRA run, resumed with ``trainer.lora.rank=0``: refused, naming the key."""
    shutil.copytree(resumed.dir / "cut", resumed.dir / "no_lora")
    rc, out = run(resumed.args + ["steps=4", "trainer.lora.rank=0"], "no_lora", resumed.dir)
    assert rc != 0 and "holds LoRA adapters (trainer.lora.rank=4" in out, out[-3000:]
