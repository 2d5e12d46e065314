"""The pieces of in-run recovery that need no actor: which failures take the run back to a checkpoint,
the refusal of ``fault.min_replicas`` beyond the layout, the weight-sync routes around a dropped
generator replica, the re-dispatch of a dropped replica's work, and the checkpoint figures of a
metrics row. The recoveries themselves, in real runs, are tests/test_chaos.py's."""

import asyncio
import re
from types import SimpleNamespace

import pytest

from forge_core import checkpoint
from forge_core.config import ConfigError, load_config
from forge_core.controller import Dispatcher, sync_routes
from forge_core.layout import Slot
from forge_core.metrics import step_row
from forge_core.services import ActorFailed, BaseModelReference, Services
from forge_core.supervision import ReplicaDropped, Supervision
from helpers import TINY, rows


def test_min_replicas_beyond_the_layout_is_refused_naming_the_key():
    says = "fault.min_replicas=3 is more than the layout's 2 generator replica(s) (layout.generator.replicas)"
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config("smollm2_135m", TINY + ["layout.generator.replicas=2", "fault.min_replicas=3"])
    with pytest.raises(ConfigError, match="fault.min_replicas must be >= 0"):
        load_config("smollm2_135m", TINY + ["fault.min_replicas=-1"])
    assert load_config("smollm2_135m", TINY + ["layout.generator.replicas=2", "fault.min_replicas=2"]).fault.min_replicas == 2


def test_only_the_trainer_and_the_replay_buffer_take_the_run_back():
    """recover() raises every other failure as it is, before touching anything: a generator's, an
    exhausted service's (no actor named), the replay buffer's in a run that has none (SFT), and the
    trainer's while the run starts."""
    sup = SimpleNamespace(svc=SimpleNamespace(trainer=object(), buffer=None), started=True)
    for e in (ActorFailed("actor 'generator' failed", "generator"), ActorFailed("failed 4 times"),
              ActorFailed("actor 'replay_buffer' failed", "replay_buffer"), RuntimeError("not an actor's")):
        with pytest.raises(type(e)) as got:
            asyncio.run(Supervision.recover(sup, e))
        assert got.value is e
    sup.started = False  # a failure while the run starts (start() not done) ends it
    e = ActorFailed("actor 'trainer' failed", "trainer")
    with pytest.raises(ActorFailed) as got:
        asyncio.run(Supervision.recover(sup, e))
    assert got.value is e


def test_a_reference_served_by_the_trainer_names_the_trainer():
    """With LoRA the reference is the trainer's base model: its failure is the trainer's (recovered)."""
    t = SimpleNamespace(name="trainer", slot=Slot(0), procs=None, actor=None, where=[])
    ref = BaseModelReference("reference", Slot(0), None, None, [])
    svc = Services([], reward=None, reference=ref, trainer=t, buffer=None, plan=None)
    with pytest.raises(ActorFailed) as e:
        asyncio.run(svc.respawn("reference"))
    assert e.value.actor == "trainer"


def _svc(hosts: list[int]) -> SimpleNamespace:
    gen = [SimpleNamespace(name=f"generator_{i}", slot=Slot(h), where=[{"ibverbs": False}]) for i, h in enumerate(hosts)]
    return SimpleNamespace(trainer=SimpleNamespace(name="trainer", slot=Slot(0), where=[{"ibverbs": False}]),
                           generators=gen)


def test_weight_sync_routes_go_around_a_dropped_replica():
    """Replicas 1 and 2 on node 1 (2 follows 1's staged copy): with 1 dropped, 2 fetches over the
    network itself; a dropped replica gets no route."""
    svc = _svc([0, 1, 1])
    assert sync_routes(svc, "auto") == [("ipc", 0), ("nccl", 1), ("follow", 1)]
    assert sync_routes(svc, "auto", {1}) == [("ipc", 0), ("none", 0), ("nccl", 1)]
    assert sync_routes(svc, "auto", {0}) == [("none", 0), ("nccl", 1), ("follow", 1)]


def test_the_work_of_a_dropped_replica_goes_to_the_others():
    """_spread: replica 1 is dropped while it holds groups; they are planned again over the replicas
    left, each group done exactly once, and the dispatcher's outstanding counts end at 0."""
    sup = SimpleNamespace(dispatcher=Dispatcher(3))
    done: list[tuple[int, int]] = []

    async def work(r: int, idx: list[int]) -> list[int]:
        await asyncio.sleep(0.01)
        if r == 1:
            raise ReplicaDropped("generator_1")
        done.extend((r, i) for i in idx)
        return [i * 10 for i in idx]

    got = asyncio.run(Supervision._spread(sup, 7, [0, 1, 2], lambda: [0, 2], work))
    assert sorted(i for _, i in done) == list(range(7)) and {r for r, _ in done} == {0, 2}
    assert all(res == [i * 10 for i in idx] and r in (0, 2) for r, idx, res in got)
    assert sup.dispatcher.outstanding == [0, 0, 0]
    assert sup.dispatcher.rate[1] is None  # a dropped replica's 0 s is no speed measurement


def test_a_metrics_row_carries_the_checkpoint_figures():
    trainer = {"version": 3, "loss": 0.5, "clip_frac": 0.0, "grad_norm": 1.0, "train_s": 0.2}
    state = {"generator_version": 3, "skipped_batches": 0, "checkpoint_failures": 0,
             "restarts": {"generator": 0, "trainer": 1, "replay_buffer": 0}}
    timings = {"wait_for_rollout_s": 0.1, "step_s": 1.0, "elapsed_s": 9.0, "startup_s": 5.0}
    row = step_row(3, trainer, {"batch_hash": 1}, {}, state=state, rollouts=[], reported=[], timings=timings,
                   checkpoint={"checkpoint_exposed_s": 0.03, "checkpoint_s": 0.7, "checkpoint_bytes": 38_000_000})
    assert (row["checkpoint_exposed_s"], row["checkpoint_s"], row["checkpoint_bytes"]) == (0.03, 0.7, 38_000_000)
    assert row["restarts_trainer"] == 1 and row["restarts_replay_buffer"] == 0
    row = step_row(3, trainer, {"batch_hash": 1}, {}, state=state, rollouts=[], reported=[], timings=timings)
    assert row["checkpoint_exposed_s"] == row["checkpoint_s"] == row["checkpoint_bytes"] == 0.0


def test_the_trainer_fails_inside_the_run_and_the_steps_since_its_checkpoint_are_the_same(tmp_path):
    """The real Controller's loops around stand-in services (tests/test_controller.py), max_staleness=1
    and dynamic sampling (refills owed across a checkpoint): the trainer fails at step 4; recover()
    takes the run back to the step-2 checkpoint, step 3 is trained again on the same batch, and the run
    ends with the batches of one that never failed, each step logged once, the fault recorded."""
    from test_controller import _controller, _line

    args = ["steps=5", "max_staleness=1", "advantage.drop_zero_variance=true", "checkpoint.every=2",
            "fault.max_restarts=1"]
    reward = lambda e, i: 1.0 if _line(e) % 4 == 0 else float(i % 2)  # noqa: E731
    ids = lambda batches: [[(e.prompt_id, e.policy_version) for e in b] for b in batches]  # noqa: E731
    whole = _controller(tmp_path / "whole", args, reward=reward)
    asyncio.run(asyncio.wait_for(whole._run(0.0), 30))
    ctl = _controller(tmp_path / "cut", args, reward=reward)
    train_step, failed = ctl.svc.trainer.train_step.fn, []

    async def fails_once_at_step_4(eps):
        if len(ctl.trained) == 3 and not failed:
            failed.append(True)
            while not checkpoint.complete(ctl.ckpt_root):  # the step-2 checkpoint, written in the background
                await asyncio.sleep(0.01)
            raise RuntimeError("the trainer's process died")
        return await train_step(eps)

    ctl.svc.trainer.train_step.fn = fails_once_at_step_4

    async def go():
        while True:
            try:
                return await ctl._run(0.0)
            except ActorFailed as e:
                await ctl.recover(e)

    asyncio.run(asyncio.wait_for(go(), 60))
    assert ids(ctl.trained) == ids(whole.trained[:3]) + ids(whole.trained[2:]), "step 3 again, then 4 and 5"
    assert [r["step"] for r in rows(tmp_path / "cut")] == [1, 2, 3, 4, 5]
    assert [r["restarts_trainer"] for r in rows(tmp_path / "cut")] == [0, 0, 1, 1, 1]
    (fault,) = rows(tmp_path / "cut" / "faults.jsonl")
    assert (fault["service"], fault["rollback_to"], fault["steps_recomputed"]) == ("trainer", 2, 1), fault
    assert fault["checkpoint"].endswith("step_000002") and "the trainer's process died" in fault["error"]
