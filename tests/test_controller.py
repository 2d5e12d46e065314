"""The real Controller's loops around stand-in services (no actor processes): what ends a run, and
when, if a weight sync fails, the replay buffer hangs, or the run directory holds an earlier run."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
from types import SimpleNamespace

import pytest

from forge_core import checkpoint
from forge_core.config import load_config
from forge_core.controller import Controller, Dispatcher
from forge_core.actors.replay_buffer import ReplayBuffer
from forge_core.data import PromptSource, load_gsm8k
from forge_core.episode import Episode
from forge_core.metrics import MetricsLog, read_jsonl
from forge_core.services import ActorFailed, RunFailed, call
from helpers import PY, ROOT, TINY_MODEL
from helpers import TINY as TINY_LOCAL

# stand-in services: groups of 2, a 1 s deadline per call, no respawn
TINY = [*TINY_MODEL, "generator.group_size=2", "fault.call_timeout_s=1", "fault.timeout_per_token_s=0",
        "fault.max_restarts=0"]


class _Ep:
    """An endpoint of a stand-in service: ``call_one``/``call_all`` await ``fn``."""

    def __init__(self, fn):
        self.fn = fn

    async def call_one(self, *args):
        return await self.fn(*args)

    async def call_all(self, *args):
        return [await self.fn(*args)]


def _controller(tmp_path, overrides, *, load=None, sample=None, reward=None) -> Controller:
    """A Controller whose services are coroutines in this process: a generator, a reward giving
    ``reward(episode, i)`` (default 0, 1, 0, 1, ...: every group has signal), a trainer that only
    counts versions and keeps its batches in ``ctl.trained``, the real ReplayBuffer.
    ``load(version)`` runs before each replica load; ``sample`` replaces the buffer's."""
    cfg = load_config("smollm2_135m", TINY + overrides)
    ctl = Controller(cfg, str(tmp_path), progress=False)
    buf, version, loaded = ReplayBuffer(cfg.buffer_capacity, cfg.max_staleness), [0], [0]
    ctl.trained, ctl.generated, ctl.buffer = [], [], buf

    async def generate(problems, seed, sampling=None):
        ctl.generated.append(len(problems))
        eps = [Episode(prompt_id=p.id, group=0, target=p.answer, prompt_ids=[1], response_ids=[2], policy_version=loaded[0],
                       behaviour_logprobs=[-1.0], text="") for p in problems for _ in range(cfg.generator.group_size)]
        return eps, {"gen_s": 0.01, "gen_tokens": len(eps), "gen_tok_s": 100.0}

    async def update_weights(handle, staged=False):
        if load:
            await load(handle.version)
        loaded[0] = handle.version
        return {"version": handle.version, "sync_s": 0.0, "mode": "ipc"}

    svc = lambda name, **eps: SimpleNamespace(name=name, **{k: _Ep(f) for k, f in eps.items()})  # noqa: E731
    gen = svc("generator", generate=generate, update_weights=update_weights)
    stand_in_services(ctl, cfg, [gen], buf, version, reward=reward, sample=sample)
    return ctl


def stand_in_services(ctl: Controller, cfg, gens: list, buf: ReplayBuffer, version: list, *, reward=None, sample=None,
                      on_save=None, record=lambda version, eps: eps) -> None:
    """Give ``ctl`` stand-in services around the generator replicas ``gens``: a reward giving
    ``reward(episode, i)`` (default 0, 1, 0, 1, ...: every group has signal), a reference of zero
    logprobs, a trainer that only counts versions (``version[0]``), appends ``record(version, batch)``
    to ``ctl.trained`` and writes checkpoints of just its version (``on_save(with_optimizer)`` first),
    the replay buffer ``buf`` (``sample`` replaces its ``sample``); and a ``start`` that resumes and
    syncs the replicas. Shared by the controller, continuous-rollout and recovery tests."""

    async def score(eps):
        for i, e in enumerate(eps):
            e.reward = reward(e, i) if reward else float(i % 2)
        return eps, None

    async def train_step(eps):
        ctl.trained.append(record(version[0], eps))
        version[0] += 1
        return {"skipped": 0.0, "version": version[0], "loss": 0.0, "clip_frac": 0.0, "grad_norm": 1.0, "train_s": 0.0}

    async def add(eps):
        buf.add(eps)
        return len(buf)

    async def publish(*_):
        return SimpleNamespace(version=version[0], nbytes=1)

    async def nothing(*_):
        return None

    async def save(path, with_optimizer, dtype="float32", background=False):
        if on_save:
            on_save(with_optimizer)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "version"), "w") as f:
            f.write(str(version[0]))
        return 1

    async def saved():
        return 0.0

    async def load_ckpt(path):
        with open(os.path.join(path, "version")) as f:
            version[0] = int(f.read())
        return version[0]

    async def state():
        return list(buf.items)

    async def restore(eps):  # the buffer's contents replaced by the checkpoint's
        buf.items = collections.deque(eps)

    svc = lambda name, **eps: SimpleNamespace(name=name, **{k: _Ep(f) for k, f in eps.items()})  # noqa: E731
    parts = dict(generators=gens, reward=svc("reward", score=score),
                 reference=svc("reference", logprobs=lambda eps: asyncio.sleep(0, ([[0.0]] * len(eps), 0.0))),
                 trainer=svc("trainer", train_step=train_step, publish=publish, save=save, saved=saved, load=load_ckpt),
                 buffer=svc("replay_buffer", add=add, sample=sample or (lambda n, s: asyncio.sleep(0, buf.sample(n, s))),
                            num_episodes=lambda: asyncio.sleep(0, len(buf)), state=state, restore=restore))
    ctl.svc = SimpleNamespace(**parts, generator=gens[0], all=lambda: [*gens, *list(parts.values())[1:]],
                              respawn=nothing, write_placement=lambda path: None, dtypes={"generator": "float32"})
    ctl.source = PromptSource(load_gsm8k("train", os.environ["GSM8K_DIR"]), 0)

    async def start():
        n = len(gens)
        ctl.routes, ctl.versions, ctl.dispatcher = [("ipc", 0)] * n, [0] * n, Dispatcher(n)
        if cfg.resume and (ckpt := checkpoint.resume_point(ctl.ckpt_root)):
            await ctl.restore(ckpt)
        await ctl.publish_and_sync()
        ctl.started = True

    ctl.start = start


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_weight_sync_that_fails_for_good_ends_the_run(tmp_path, staleness):
    """The load of version 1 fails and no restart is left (fault.max_restarts=0). With max_staleness=0
    the training loop then waits for a batch only version 1 may generate: the failure must end the run
    (it used to wait forever); with 1 it ends the run too."""
    async def load(version):
        if version == 1:
            raise RuntimeError("load failed")

    ctl = _controller(tmp_path, ["steps=4", f"max_staleness={staleness}"], load=load)
    with pytest.raises(ActorFailed, match=r"actor 'generator' failed 1 times .*load failed"):
        asyncio.run(asyncio.wait_for(ctl._run(0.0), 30))
    assert ctl.step <= 2


def test_a_hung_replay_buffer_misses_its_deadline(tmp_path):
    async def sample(n, step):
        await asyncio.sleep(3600)

    ctl = _controller(tmp_path, ["steps=2"], sample=sample)
    with pytest.raises(ActorFailed, match=r"actor 'replay_buffer' did not answer within 1 s"):
        asyncio.run(asyncio.wait_for(ctl._run(0.0), 30))


def test_resume_false_refuses_a_run_directory_that_holds_an_earlier_run(tmp_path, monkeypatch):
    """Its metrics would be overwritten and its checkpoints mixed with (and rotated against) the new
    run's: refused before any actor starts, and the earlier run's files stay as they were."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    ctl = _controller(tmp_path, ["resume=false"])
    with pytest.raises(RunFailed, match=r"holds an earlier run .*set another run_id, or resume=true"):
        asyncio.run(ctl.run())
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n' and not (tmp_path / "config.yaml").exists()


def test_call_tells_a_missed_deadline_from_an_actor_that_raised_timeout_error():
    async def raises():
        raise TimeoutError("the actor's own")

    for timeout_s in (None, 30):
        with pytest.raises(ActorFailed, match=r"actor 'x' failed: TimeoutError: the actor's own"):
            asyncio.run(call("x", _Ep(raises), timeout_s=timeout_s))
    with pytest.raises(ActorFailed, match=r"actor 'x' did not answer within 0 s"):
        asyncio.run(call("x", _Ep(lambda: asyncio.sleep(5)), timeout_s=0.1))


def test_the_cli_reports_a_run_that_cannot_go_on_without_a_traceback(tmp_path):
    """launch.local prints every RunFailed (not only ActorFailed) as an error line, exit code 1."""
    import subprocess

    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 1}\n')
    p = subprocess.run([PY, "-m", "launch.local", "run", "smollm2_135m", *TINY, f"output_dir={tmp_path}",
                        "run_id=r", "resume=false"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "error: " in p.stderr and "holds an earlier run" in p.stderr and "written so far are intact" in p.stderr


def _line(e: Episode) -> int:
    return int(e.prompt_id.rsplit(":", 1)[1])  # a problem's id: file:line


@pytest.mark.parametrize("staleness", [0, 1])
def test_dynamic_sampling_refills_the_groups_a_batch_drops(tmp_path, staleness):
    """advantage.drop_zero_variance (DAPO's dynamic sampling): a group whose rewards are all equal is
    dropped and a new prompt sampled in its place, so every step trains prompts_per_step groups with
    signal (dropping alone left batches short, and the run waited forever for a full one)."""
    ctl = _controller(tmp_path, ["steps=5", f"max_staleness={staleness}", "advantage.drop_zero_variance=true"],
                      reward=lambda e, i: 1.0 if _line(e) % 3 == 0 else float(i % 2))  # every 3rd row: no signal
    asyncio.run(asyncio.wait_for(ctl._run(0.0), 30))
    assert len(ctl.trained) == 5 and all(len(b) == ctl.B for b in ctl.trained)
    assert all(_line(e) % 3 for b in ctl.trained for e in b)  # only groups with signal
    assert sum(ctl.generated) > 5 * ctl.cfg.prompts_per_step  # refills were sampled


def test_dynamic_sampling_keeps_the_groups_still_lost_after_max_refills(tmp_path):
    """All rewards equal (a model that never answers): after advantage.max_refills rounds the batch
    is filled with the all-equal groups (advantage 0) and the step trains; no endless resampling."""
    ctl = _controller(tmp_path, ["steps=2", "max_staleness=0", "advantage.drop_zero_variance=true",
                                 "advantage.max_refills=2"], reward=lambda e, i: 0.0)
    asyncio.run(asyncio.wait_for(ctl._run(0.0), 30))
    assert ctl.generated[:3] == [2, 2, 2] and len(ctl.trained) == 2  # a batch, then 2 rounds of refills
    assert all(len(b) == ctl.B and all(e.advantage == 0.0 for e in b) for b in ctl.trained)


def test_dynamic_sampling_resumes_exactly(tmp_path):
    """A checkpoint holds the refills still owed (prompts for groups a batch lost): a run stopped
    after step 2 (its trainer fails at step 3) and resumed trains the same batches as one that was not
    stopped."""
    # (written before the next step: a checkpoint being written in the background when the trainer fails is given up)
    args = ["max_staleness=1", "advantage.drop_zero_variance=true", "checkpoint.every=1", "checkpoint.keep=10",
            "checkpoint.background=false"]
    reward = lambda e, i: 1.0 if _line(e) % 4 == 0 else float(i % 2)  # noqa: E731
    ids = lambda ctl: [[(e.prompt_id, e.policy_version) for e in b] for b in ctl.trained]  # noqa: E731
    whole = _controller(tmp_path / "a", ["steps=4", *args], reward=reward)
    asyncio.run(asyncio.wait_for(whole._run(0.0), 30))
    first = _controller(tmp_path / "b", ["steps=4", *args], reward=reward)
    train_step = first.svc.trainer.train_step.fn

    async def preempted_at_step_3(eps):
        if len(first.trained) == 2:
            raise RuntimeError("preempted")
        return await train_step(eps)

    first.svc.trainer.train_step.fn = preempted_at_step_3
    with pytest.raises(ActorFailed, match="preempted"):
        asyncio.run(asyncio.wait_for(first._run(0.0), 30))
    then = _controller(tmp_path / "b", ["steps=4", *args], reward=reward)
    asyncio.run(asyncio.wait_for(then._run(0.0), 30))
    assert ids(first) + ids(then) == ids(whole) and len(ids(whole)) == 4
    held = json.load(open(tmp_path / "b" / "checkpoints" / "step_000002" / "controller.json"))["refills"]
    assert held, held  # the step-2 checkpoint, which the second run resumed from, owes a refill: this test's case


def test_no_rollout_batch_beyond_the_last_step(tmp_path):
    """The rollout loop makes the batches the run trains and no more: none competes with the last
    step for the CPU, none is cut off in an actor when the run stops at the end."""
    ctl = _controller(tmp_path, ["steps=3", "max_staleness=1"])
    asyncio.run(asyncio.wait_for(ctl._run(0.0), 30))
    assert len(ctl.trained) == 3 and len(ctl.generated) == 3


def test_a_batch_the_buffer_evicted_is_made_again(tmp_path):
    """Episodes the buffer evicts (here: all it holds, once) are made again: the run does not wait
    forever for a batch the rollout loop, having made ``steps`` batches, would never start."""
    evicted = []

    async def sample(n, step):
        if step == 1 and not evicted and len(ctl.buffer.items) >= n:
            evicted.append(len(ctl.buffer.items))
            ctl.buffer.items.clear()
        return ctl.buffer.sample(n, step)

    ctl = _controller(tmp_path, ["steps=3", "max_staleness=1"], sample=sample)
    asyncio.run(asyncio.wait_for(ctl._run(0.0), 30))
    assert len(ctl.trained) == 3 and evicted[0] >= ctl.B
    assert len(ctl.generated) == 3 + evicted[0] // ctl.B


def test_the_progress_bar_shows_the_last_evaluation(tmp_path, capsys):
    """The last step's evaluation finishes after that step's line of the bar (in the background, after
    the weight sync): the bar ends with its pass@1, not the one of the evaluation before it."""
    ctl = _controller(tmp_path, ["steps=2", "eval.every=1", "eval.num_questions=4"])
    ctl.progress, ctl.held_out = True, load_gsm8k("test", os.environ["GSM8K_DIR"])[:4]
    score = ctl.svc.reward.score.fn

    async def version_2_is_right(eps):
        eps, error = await score(eps)
        for e in eps:
            e.correct = e.policy_version == 2
        return eps, error

    ctl.svc.reward.score.fn = version_2_is_right
    asyncio.run(asyncio.wait_for(ctl._run(0.0), 30))
    assert [(r["step"], r["eval/pass@1"]) for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if "eval/pass@1" in r] \
        == [(1, 0.0), (2, 1.0)]
    bar = capsys.readouterr().err.rsplit("\r", 1)[-1]  # what the bar shows at the end
    assert "2/2" in bar and "eval=1.000" in bar, bar


def test_read_jsonl_drops_only_a_torn_last_line(tmp_path):
    """A crash mid-write tears the last line of metrics.jsonl: it is dropped (a resume rewrites the file
    without it). A bad line with lines after it is damage, not a tear: a ValueError naming file and line."""
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    assert read_jsonl(str(p)) == [{"step": 1}, {"step": 2}]
    MetricsLog(str(p), start_step=3).close()
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n'
    p.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match=re.escape(f"{p}, line 2: not a JSON line")):
        read_jsonl(str(p))
    with pytest.raises(ValueError, match="line 2"):
        MetricsLog(str(p), start_step=3)  # a resume refuses a damaged file rather than drop rows from it


def test_wandb_writes_inside_the_run_directory(tmp_path, monkeypatch):
    """With wandb on (offline), its ``wandb/`` folder is in the run directory, not in the directory the
    run was started from (the repository root, for make run); steps logged again (an in-run recovery)
    reach wandb's history too (wandb.log(step=) drops a step that is not above the last)."""
    pytest.importorskip("wandb")
    for k in ("WANDB_DIR", "WANDB_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    log = MetricsLog(str(tmp_path / "run" / "metrics.jsonl"), wandb_cfg=SimpleNamespace(project="forge-test",
                                                                                       mode="offline"), run_name="r")
    for step in (1, 2, 3, 2, 3):  # steps 2 and 3 computed again after an in-run recovery to step 1
        log.log({"step": step, "loss": step / 10})
    log.close()
    assert (tmp_path / "run" / "wandb").is_dir() and not os.listdir(tmp_path / "cwd")
    # every row reached wandb's history, the recomputed ones too, with the training step as x-axis
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    [path] = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    ds, history = DataStore(), []
    ds.open_for_scan(str(path))
    while (data := ds.scan_data()) is not None:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            history.append({i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    assert [(h["step"], h["loss"]) for h in history] == [(1, 0.1), (2, 0.2), (3, 0.3), (2, 0.2), (3, 0.3)], history


def test_reference_of_batch_k_overlaps_generation_of_batch_k_plus_1(tmp_path):
    """The rollout loop with stand-ins for the actors that wait for each other (S=1, one replica at
    version 0): batch 0's reference forward waits until batch 1's generation has started, and batch
    1's generation until batch 0's reference has started, so the loop gets through only if the two
    overlap (in sequence, one waits forever: the test times out). Batches reach the buffer in order,
    and a failure of the finishing step reaches the training loop as ``background_error``."""
    cfg = load_config("smollm2_135m", TINY_LOCAL + ["max_staleness=1"])
    G = cfg.generator.group_size

    class Signalled(Controller):
        fail_reference = False

        async def _generate(self, problems, k, replicas, rnd=0):
            self.started[("gen", k)].set()
            if k == 1:
                await self.started[("ref", 0)].wait()
            eps = [Episode(prompt_id=str(k), group=j // G, target="", prompt_ids=[1], response_ids=[2, 3],
                           behaviour_logprobs=[-1.0, -1.0], text="", policy_version=0, reward=float(j % 2))
                   for j in range(len(problems) * G)]
            return eps, {"gen_s": 0.01, "gen_tokens": 2 * len(eps), "gen_tok_s": 1.0, "gen_replicas": 1}

        async def _supervised(self, name, endpoint, episodes, **kw):
            if name == "reward":
                return episodes, None
            k = int(episodes[0].prompt_id)
            self.started[("ref", k)].set()
            if self.fail_reference:
                raise RuntimeError("reference stand-in failed")
            if k == 0:
                await self.started[("gen", 1)].wait()
            return [([[0.0, 0.0]] * len(episodes), 0.3)]

    added: list = []

    async def add(eps):
        added.append(eps[0].prompt_id)
        return len(added) * len(eps)

    async def go(c):
        c.started = collections.defaultdict(asyncio.Event)  # ("gen" | "ref", batch) -> begun
        c.source = SimpleNamespace(next_batch=lambda n: [None] * n)
        c.svc = SimpleNamespace(buffer=SimpleNamespace(add=SimpleNamespace(call_one=add)))
        c.versions = [0]
        task = asyncio.create_task(c.rollout_loop())
        try:
            async with c.changed:
                await asyncio.wait_for(c.changed.wait_for(lambda: c.buffered >= 2 * c.B or c.background_error), 10)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    c = Signalled(cfg, str(tmp_path), progress=False)
    asyncio.run(go(c))
    assert c.background_error is None, c.background_error
    assert added == ["0", "1"] and c.batches_made == 2 and c.rollouts_in_flight == 0  # batch 2 needs version 1
    assert [r["ref_s"] for r in c.rollout_stats] == [0.3, 0.3]

    c = Signalled(cfg, str(tmp_path), progress=False)
    c.fail_reference = True
    asyncio.run(go(c))
    assert isinstance(c.background_error, RuntimeError) and "reference stand-in failed" in str(c.background_error)
