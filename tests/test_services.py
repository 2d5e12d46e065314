"""Actor calls and services without actor processes: a Ctrl-C that meets an actor's answer, and
what a respawn of a service keeps (the dtype its role resolved, its share of the cores)."""

import asyncio
import os
from types import SimpleNamespace

import pytest

from forge_core.config import load_config
from helpers import TINY


def test_call_never_swallows_a_cancel_that_meets_the_answer():
    """Ctrl-C cancels the controller's main task. When the actor's answer lands in the same loop
    iteration as the cancel, ``call`` must still raise CancelledError (Python 3.11's
    ``asyncio.wait_for`` returned the answer, the run went on, and a Ctrl-C was lost), with a
    deadline or without one; a missed deadline still names the actor."""
    from forge_core.services import ActorFailed, call

    async def main():
        loop = asyncio.get_running_loop()
        for timeout_s in (60.0, None):
            fut = loop.create_future()
            task = asyncio.create_task(call("trainer", SimpleNamespace(call_one=lambda: fut), timeout_s=timeout_s))
            await asyncio.sleep(0)  # the call now waits for the answer
            fut.set_result("answer")
            task.cancel()  # in the same iteration
            with pytest.raises(asyncio.CancelledError):
                await task
        never = loop.create_future()
        with pytest.raises(ActorFailed, match="actor 'trainer' did not answer within 0 s"):
            await call("trainer", SimpleNamespace(call_one=lambda: never), timeout_s=0.05)

    asyncio.run(main())


def test_an_actors_long_error_keeps_its_last_line():
    """A remote actor's error holds its whole traceback; the exception is its last line (a CUDA
    out-of-memory in the trainer's start-up was once cut away), so a long message loses its middle."""
    from forge_core.services import ActorFailed, call

    trace = "Traceback (most recent call last):\n" + "  File x.py, line 1, in f\n" * 400 + \
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 384.00 MiB."

    async def fail():
        raise RuntimeError(trace)

    with pytest.raises(ActorFailed) as e:
        asyncio.run(call("trainer", SimpleNamespace(call_one=fail)))
    msg = str(e.value)
    assert msg.startswith("actor 'trainer' failed: RuntimeError: Traceback (most recent call last):")
    assert msg.endswith("CUDA out of memory. Tried to allocate 384.00 MiB.") and len(msg) < 2200, msg[-300:]


def test_a_respawn_keeps_the_dtype_its_role_resolved(monkeypatch):
    """generator.dtype=auto: a respawned generator replica or reference gets the dtype its role
    resolved at the start, not a new probe (which could pick another dtype than the weights the
    trainer publishes); the other roles, and a first spawn, keep the config's setting."""
    from forge_core import services
    from forge_core.layout import plan_layout
    cfg = load_config("smollm2_135m", TINY)
    plan = plan_layout(cfg)
    assert cfg.generator.dtype == "auto"
    assert services.actor_kwargs(cfg, "generator", plan.generators[0], plan)["generator"].dtype == "auto"
    assert services.actor_kwargs(cfg, "generator", plan.generators[0], plan, dtype="float32")["generator"].dtype \
        == "float32"
    assert services.actor_kwargs(cfg, "reference", plan.reference, plan)["dtype"] == "auto"
    assert services.actor_kwargs(cfg, "reference", plan.reference, plan, dtype="bfloat16")["dtype"] == "bfloat16"
    spawned = []

    async def fake_spawn(cfg, role, slot, plan, hosts=None, name="", dtype=None):
        spawned.append((name, dtype))
        return services.Service(name, slot, None, None)

    monkeypatch.setattr(services, "spawn_service", fake_spawn)
    marks = [os.path.join(services.cores_dir(), n) for n in ("generator", "reference")]
    os.makedirs(services.cores_dir(), exist_ok=True)
    for m in marks:  # killed while busy: CoreShare's marks stay, and the other actors would keep half the cores
        open(m, "w").close()
    old = {n: services.Service(n, plan.reference, None, None) for n in ("generator", "reward", "reference")}
    svc = services.Services([old["generator"]], old["reward"], old["reference"], None, None, plan, cfg=cfg,
                            dtypes={"generator": "float32", "reference": "bfloat16"})
    for name in ("generator", "reward", "reference"):
        assert asyncio.run(svc.respawn(name)) is not old[name]
    assert spawned == [("generator", "float32"), ("reward", None), ("reference", "bfloat16")]
    assert not any(os.path.exists(m) for m in marks)  # a respawn removes its service's mark
    assert svc.generator.name == "generator" and svc.generator is not old["generator"]


def test_actors_get_their_config_sections_as_dataclasses_that_pickle():
    """Each actor's config sections arrive as their schema dataclasses (typed attributes, one place
    for each default), survive a pickle round trip (Monarch sends them between processes) and are what
    the constructed actor holds: the trainer's ``trainer`` a TrainerConfig with its LoRAConfig, its
    loss its own loss's subclass (Dr. GRPO's horizon filled in from the generation budget, the
    caller's object left alone)."""
    import dataclasses
    import pickle

    from forge_core.actors.reward import RewardActor
    from forge_core.actors.trainer import Trainer
    from forge_core.config import GeneratorConfig, TrainerConfig, WeightSyncConfig
    from forge_core.layout import plan_layout
    from forge_core.lora import LoRAConfig
    from forge_core.losses import DrGRPOLossConfig
    from forge_core.models import ModelConfig
    from forge_core.rewards import RewardConfig
    from forge_core.services import actor_kwargs

    cfg = load_config("smollm2_135m", [*TINY, "loss=dr_grpo", "loss.rollout_correction=tis", "trainer.lora.rank=4",
                                       "weight_sync.bucket_mb=8"])
    plan = plan_layout(cfg)
    kws = {role: actor_kwargs(cfg, role, getattr(plan, role, plan.trainer), plan)
           for role in ("trainer", "reference", "reward")}
    kws["generator"] = actor_kwargs(cfg, "generator", plan.generators[0], plan, dtype="float32")
    tr = kws["trainer"]
    assert type(tr["trainer"]) is TrainerConfig and type(tr["trainer"].lora) is LoRAConfig
    assert tr["trainer"].lora.rank == 4 and tr["trainer"].lr == 1e-3 and tr["trainer"].betas == [0.9, 0.999]
    assert type(tr["loss"]) is DrGRPOLossConfig and tr["loss"].rollout_correction == "tis"
    assert type(tr["weight_sync"]) is WeightSyncConfig and tr["weight_sync"].bucket_mb == 8
    assert all(type(kw["model"]) is ModelConfig and kw["model"].name == "tiny_llama"
               for kw in (tr, kws["reference"], kws["generator"]))
    g = kws["generator"]["generator"]
    assert type(g) is GeneratorConfig and (g.group_size, g.dtype) == (4, "float32")
    assert type(kws["reward"]["reward_cfg"]) is RewardConfig and isinstance(kws["generator"]["env"], dict)
    for kw in kws.values():
        back = pickle.loads(pickle.dumps(kw))
        assert back == kw and all(type(back[k]) is type(v) for k, v in kw.items())
    t = Trainer(**tr)
    assert t.t == tr["trainer"] and type(t.t) is TrainerConfig and t.lora is t.t.lora
    assert type(t.loss_cfg) is DrGRPOLossConfig and t.loss_cfg.horizon == cfg.generator.max_response_tokens
    assert tr["loss"].horizon is None and dataclasses.replace(t.loss_cfg, horizon=None) == tr["loss"]
    assert t.model_cfg == tr["model"] and (t.sync_timeout_s, t.bucket_bytes) == (300.0, 8 << 20)
    assert pickle.loads(pickle.dumps(t.t)) == t.t and pickle.loads(pickle.dumps(t.loss_cfg)) == t.loss_cfg
    assert RewardActor(**kws["reward"]).cfg.fn == cfg.reward.fn


RANKS_ACTOR = '''
import asyncio, os
from monarch.actor import Actor, current_rank, endpoint


class Ranks(Actor):
    """Rank ``fail`` raises at once; the others wait, as in a collective the failed rank never joins."""

    def __init__(self):
        self.rank = current_rank().rank  # the rank in the service's mesh (as the trainer takes its own)

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def step(self, fail: int) -> int:
        rank = self.rank
        if rank == fail:
            raise RuntimeError(f"rank {rank}: CUDA out of memory")
        if fail >= 0:
            await asyncio.sleep(600)
        return rank
'''
RANKS_CALLER = '''
import asyncio, json, os, signal, time
from monarch.actor import this_host
from forge_core.services import ActorFailed, _Endpoint, call, call_all
from ranks_actor import Ranks


async def go():
    procs = this_host().spawn_procs(per_host={"procs": 2})
    ranks = procs.spawn("ranks", Ranks)
    pids = await call_all("trainer", _Endpoint(ranks, "pid", 2), timeout_s=60)
    out = {"answers": await call_all("trainer", _Endpoint(ranks, "step", 2), -1, timeout_s=60)}
    t0 = time.perf_counter()
    try:
        await call("trainer", _Endpoint(ranks, "step", 2), 1, timeout_s=120)
    except ActorFailed as e:
        out["error"], out["error_after_s"] = str(e), time.perf_counter() - t0
    for pid in pids:  # rank 0 still waits: end both as a respawn would
        os.kill(pid, signal.SIGKILL)
    try:
        await asyncio.wait_for(procs.stop(), 10)
    except Exception:
        pass
    return out

print("RESULT " + json.dumps(asyncio.run(go())))
'''


@pytest.mark.slow
def test_a_rank_that_raises_ends_a_call_of_every_rank_at_once(tmp_path):
    """A service of two ranks: called on each rank, the answers come back in rank order; when rank 1
    raises while rank 0 waits (for a collective rank 1 never joins), the call ends with rank 1's error
    within seconds, not at the caller's 120 s deadline."""
    import json
    import subprocess

    from helpers import PY, ROOT, child_env

    pytest.importorskip("monarch.actor")
    (tmp_path / "ranks_actor.py").write_text(RANKS_ACTOR)
    p = subprocess.run([PY, "-c", RANKS_CALLER], env=child_env(tmp_path), cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(line[7:])
    assert out["answers"] == [0, 1]
    assert "actor 'trainer' failed: " in out["error"] and "rank 1: CUDA out of memory" in out["error"], out
    assert out["error_after_s"] < 30, out
