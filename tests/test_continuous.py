"""Continuous rollouts (``rollout.mode=continuous``): the config check, the replay buffer's order, the
vLLM engine stream against a stand-in engine, the real Controller's loops around stand-in replicas
that hold groups across calls (the staleness bound per group, lost groups, checkpoints and resume),
and one real CPU run through every actor in which no trained episode exceeds ``max_staleness``."""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace

import pytest

from forge_core import checkpoint
from forge_core.actors.replay_buffer import ReplayBuffer
from forge_core.config import ConfigError, load_config
from forge_core.controller import Controller
from forge_core.data import PromptSource, load_gsm8k
from forge_core.episode import Episode
from forge_core.services import ActorFailed
from helpers import TINY, TINY_MODEL
from test_controller import _Ep, stand_in_services

# stand-in services: groups of 2, a 1 s deadline per call, no respawn
STANDIN = [*TINY_MODEL, "generator.group_size=2", "fault.call_timeout_s=1", "fault.timeout_per_token_s=0",
           "fault.max_restarts=0", "rollout.mode=continuous"]


# ---- the config ------------------------------------------------------------------------------------
def test_continuous_mode_is_refused_with_max_staleness_0_and_explained():
    """max_staleness=0 would stop generation at every step (what batch mode does): refused, naming both
    keys and what to set instead. The default stays batch; an unknown mode is named."""
    with pytest.raises(ConfigError, match=r"rollout.mode=continuous needs max_staleness >= 1: .* set max_staleness=1 "
                                          r".* or rollout.mode=batch"):
        load_config("smollm2_135m", ["rollout.mode=continuous", "max_staleness=0"])
    with pytest.raises(ConfigError, match=r"rollout.mode='async' must be one of \('batch', 'continuous'\)"):
        load_config("smollm2_135m", ["rollout.mode=async"])
    with pytest.raises(ConfigError, match=r"env.fn=.* \(multi-turn\) needs rollout.mode=batch"):
        load_config("smollm2_135m_tool", ["rollout.mode=continuous"])
    with pytest.raises(ConfigError, match=r"one GPU per node needs generator.sleep_level=0"):
        load_config("qwen3_1_7b", ["layout.gpus_per_node=1", "rollout.mode=continuous"])
    assert load_config("smollm2_135m").rollout.mode == "batch"
    assert load_config("qwen3_1_7b", ["layout.gpus_per_node=1", "generator.sleep_level=0",
                                      "rollout.mode=continuous"]).rollout.mode == "continuous"


# ---- the replay buffer -----------------------------------------------------------------------------
def _ep(version: int, prompt: str) -> Episode:
    return Episode(prompt_id=prompt, group=0, target="", prompt_ids=[1], response_ids=[2], behaviour_logprobs=[-1.0],
                   text="", policy_version=version)


def test_buffer_hands_out_the_oldest_versions_first_in_continuous_mode():
    """Groups arrive out of version order in continuous mode; the trainer takes the oldest first (an
    old group left for the next step could exceed the bound there), whole groups in the order added
    among equals. The default order (batch mode) stays the order added."""
    adds = [[_ep(v, p), _ep(v, p)] for v, p in ((1, "a"), (0, "b"), (1, "c"), (0, "d"))]
    by_version, fifo = ReplayBuffer(100, 1, oldest_version_first=True), ReplayBuffer(100, 1)
    for eps in adds:
        by_version.add(eps)
        fifo.add(eps)
    assert [e.prompt_id for e in by_version.sample(4, step=1)] == ["b", "b", "d", "d"]
    assert [e.prompt_id for e in by_version.sample(2, step=2)] == ["a", "a"]
    assert [e.prompt_id for e in fifo.sample(4, step=1)] == ["a", "a", "b", "b"]


# ---- the vLLM engine stream against a stand-in engine ------------------------------------------------
class _Engine:
    """A stand-in for ``vllm.LLM`` as :class:`EngineStream` uses it: ``enqueue`` returns vLLM 0.26's
    internal ids (``<id>-<random>``), ``llm_engine.step`` finishes a request after ``steps(prompt)``
    steps and reports it under its external id, as vLLM's output processor does."""

    def __init__(self, steps):
        self.steps, self.left, self.n, self.calls = steps, {}, 0, 0
        self.llm_engine = self

    def enqueue(self, prompts, params, use_tqdm=False):
        ids = []
        for p in prompts:
            self.n += 1
            self.left[str(self.n)] = (self.steps(p["prompt_token_ids"]), p["prompt_token_ids"])
            ids.append(f"{self.n}-a1b2c3d4")
        return ids

    def step(self):
        self.calls += 1
        out = []
        for rid, (n, ids) in list(self.left.items()):
            if n <= 1:
                del self.left[rid]
                out.append(SimpleNamespace(request_id=rid, finished=True, prompt=ids))
            else:
                self.left[rid] = (n - 1, ids)
        return out


def test_engine_stream_keeps_requests_across_calls_and_lets_updates_in_between_steps():
    """Rollout groups stay in the engine across calls and come back, tagged, as they finish; an
    evaluation beside them gets its own outputs only; a weight update (the actor's lock) gets in
    between two engine steps while groups are in flight; a failing step is raised to the next taker."""
    from forge_core.actors.vllm_generator import EngineStream

    async def go():
        lock = asyncio.Lock()
        engine = _Engine(lambda ids: ids[0])  # a prompt [n] finishes after n steps
        stream = EngineStream(engine, lock)
        stream.add([[3], [40]], None, [("short", 0), ("long", 0)])
        assert await stream.groups(5.0) == [(("short", 0), engine_out("1", [3]))]
        assert stream.held() == ["long"]
        async with lock:  # a weight update: the engine does not step meanwhile
            steps = engine.calls
            await asyncio.sleep(0.01)
            assert engine.calls == steps
        assert engine.left  # the long group is still in flight after the update
        evals = await stream.run([[2], [5]], None)  # beside the rollout group
        assert [o.prompt for o in evals] == [[2], [5]] and stream.held() == ["long"]
        got = []
        while not got:
            got = await stream.groups(5.0)
        assert [t for t, _ in got] == [("long", 0)] and stream.held() == [] and stream.take_busy() > 0
        engine.step = lambda: 1 / 0
        stream.add([[1]], None, [("bad", 0)])
        with pytest.raises(RuntimeError, match="vLLM engine step failed: ZeroDivisionError"):
            await stream.groups(5.0)

    asyncio.run(asyncio.wait_for(go(), 30))


def engine_out(rid, prompt):
    return SimpleNamespace(request_id=rid, finished=True, prompt=prompt)


class _Llm:
    """A stand-in for ``vllm.LLM`` behind :class:`VllmGenerator`: a request of n samples finishes after
    ``steps`` engine steps with n completions of ``steps`` tokens (vLLM's flat logprobs, the sampled
    token first); weight loads and prefix-cache resets are counted."""

    def __init__(self, steps: int):
        self.steps, self.left, self.n, self.loads, self.resets = steps, {}, 0, 0, 0
        self.llm_engine = self

    def enqueue(self, prompts, params, use_tqdm=False):
        ids = []
        for p in prompts:
            self.n += 1
            self.left[str(self.n)] = [self.steps, p["prompt_token_ids"], params.n]
            ids.append(f"{self.n}-0f0f0f0f")
        return ids

    def step(self):
        time.sleep(0.002)  # an engine step takes time
        out = []
        for rid, x in list(self.left.items()):
            x[0] -= 1
            if x[0] == 0:
                del self.left[rid]
                toks = list(range(5, 5 + self.steps))
                lp = SimpleNamespace(start_indices=list(range(len(toks))), token_ids=toks, logprobs=[-0.5] * len(toks))
                c = SimpleNamespace(token_ids=toks, logprobs=lp, finish_reason="length")
                out.append(SimpleNamespace(request_id=rid, finished=True, outputs=[c] * x[2]))
        return out

    def apply_model(self, fn):
        self.loads += 1
        return [{"mode": "ipc"}]

    def reset_prefix_cache(self):
        self.resets += 1


def test_vllm_generator_advance_tags_groups_with_their_submission_version():
    """The vLLM actor's continuous endpoints in this process around a stand-in engine: groups
    submitted under version 0 and still in flight when version 1 loads (between two engine steps,
    the prefix cache left alone) come back tagged 0; groups submitted after the load are tagged 1;
    a held-out evaluation meanwhile gets its own outputs; without continuous mode advance refuses."""
    from forge_core.actors.vllm_generator import EngineStream, VllmGenerator
    from forge_core.config import GeneratorConfig, to_dataclass
    from forge_core.models import ModelConfig, load_tokenizer
    from forge_core.weight_sync import WeightHandle

    cfg = load_config("smollm2_135m", TINY)
    g = object.__new__(VllmGenerator)  # no engine: the stand-in's
    g.g = to_dataclass(cfg.generator, GeneratorConfig)
    g.name, g.system_prompt, g.env, g.version = "generator", "", None, 0
    g.sleeps, g.awake = False, {"weights", "kv_cache"}
    g.tok = load_tokenizer(to_dataclass(cfg.model, ModelConfig))
    g.quantized, g.bucket_bytes = False, 1 << 20
    g.llm, g.lock = _Llm(steps=40), asyncio.Lock()
    g.stream = EngineStream(g.llm, g.lock)
    g._sampling = lambda s, ignore_eos=False, seed=None: SimpleNamespace(n=s["n"], max_tokens=s["max_tokens"])
    ep = lambda name, *args: getattr(VllmGenerator, name)._method(g, *args)  # noqa: E731
    problems = load_gsm8k("train", os.environ["GSM8K_DIR"])[:4]
    G = cfg.generator.group_size

    async def go():
        done, held, _ = await ep("advance", [(1, problems[0]), (2, problems[1])], 0, 0.01)
        assert done == [] and sorted(held) == [1, 2]
        r = await ep("update_weights", WeightHandle(version=1, layout=[], dtype="bfloat16", nbytes=1))
        assert r["version"] == 1 and g.llm.loads == 1 and g.llm.resets == 0 and g.llm.left  # loaded in flight
        done, held, _ = await ep("advance", [(3, problems[2])], 0, 0.01)
        evals, _ = await ep("generate", problems[3:4], 7, {"n": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 8})
        assert len(evals) == 1 and evals[0].prompt_id == problems[3].id  # beside the rollouts, its own output
        got = {}
        while len(got) < 3:
            done, held, busy = await ep("advance", [], 0, 5.0)
            got.update(done)
        assert {k: {e.policy_version for e in eps} for k, eps in got.items()} == {1: {0}, 2: {0}, 3: {1}}
        assert all(len(eps) == G and all(len(e.behaviour_logprobs) == len(e.response_ids) == 40 for e in eps)
                   for eps in got.values())
        assert [e.prompt_id for e in got[3]] == [problems[2].id] * G and held == []

    asyncio.run(asyncio.wait_for(go(), 60))
    g.stream = None
    with pytest.raises(RuntimeError, match="advance needs rollout.mode=continuous"):
        asyncio.run(ep("advance", [], 0, 0.0))


# ---- the Controller around stand-in replicas -------------------------------------------------------
def _controller(tmp_path, overrides, *, replicas=1, calls=lambda line: 1, lose=None, reward=None) -> Controller:
    """A Controller whose services are coroutines in this process. Each replica's ``advance`` holds a
    group for ``calls(line)`` calls (``line``: its prompt's line in train.jsonl), tags it with the
    version loaded when it was submitted and returns ``(finished, held, busy_s)``; ``lose(key)`` true:
    the replica forgets that group (as a respawned one would). The trainer records every trained
    batch with its version at the time (``ctl.trained``: ``[(version, episodes)]``); the replay buffer
    is the real one (oldest versions first)."""
    cfg = load_config("smollm2_135m", STANDIN + overrides)
    ctl = Controller(cfg, str(tmp_path), progress=False)
    buf, version = ReplayBuffer(cfg.buffer_capacity, cfg.max_staleness, oldest_version_first=True), [0]
    ctl.trained, ctl.drawn, ctl.buffer, ctl.in_flight_at_save = [], [], buf, []
    G = cfg.generator.group_size

    def replica(r):
        held, loaded = {}, [0]  # key -> [calls left, problem, version at submission]

        async def advance(submit, seed, wait_s):
            for key, p in submit:
                ctl.drawn.append(p.id)
                held[key] = [calls(_line(p)), p, loaded[0]]
            await asyncio.sleep(0.002)
            done = []
            for key in list(held):
                if lose and lose(key):
                    del held[key]
                    continue
                held[key][0] -= 1
                if held[key][0] <= 0:
                    _, p, v = held.pop(key)
                    done.append((key, [Episode(prompt_id=p.id, group=0, target=p.answer, prompt_ids=[1], text="",
                                               response_ids=[2], behaviour_logprobs=[-1.0], policy_version=v)
                                       for _ in range(G)]))
            return done, list(held), 0.002

        async def update_weights(handle, staged=False):
            loaded[0] = handle.version
            return {"version": handle.version, "sync_s": 0.0, "mode": "ipc"}

        return svc(f"generator_{r}" if replicas > 1 else "generator", advance=advance, update_weights=update_weights)

    gens = [replica(r) for r in range(replicas)]
    stand_in_services(ctl, cfg, gens, buf, version, reward=reward, record=lambda v, eps: (v, eps),
                      on_save=lambda with_optimizer: with_optimizer and ctl.in_flight_at_save.append(
                          ctl.rollouts_in_flight + len(ctl.live)))  # at a checkpoint (not final/)
    return ctl


def svc(name, **endpoints):
    return SimpleNamespace(name=name, **{k: _Ep(f) for k, f in endpoints.items()})


def _line(p) -> int:
    return int(p.id.rsplit(":", 1)[1])  # a problem's id: file:line


def _check_trained(ctl) -> list[int]:
    """Every trained batch is B episodes in whole groups, each episode within max_staleness of the
    trainer's version at that step; returns the staleness of every trained episode."""
    G, stale = ctl.cfg.generator.group_size, []
    for v, eps in ctl.trained:
        assert len(eps) == ctl.B
        for g in range(0, len(eps), G):
            assert len({(e.prompt_id, e.policy_version) for e in eps[g:g + G]}) == 1, "a split group"
        stale += [v - e.policy_version for e in eps]
    assert max(stale) <= ctl.cfg.max_staleness and min(stale) >= 0, stale
    return stale


def test_no_trained_episode_exceeds_max_staleness_with_groups_of_uneven_length(tmp_path):
    """Two replicas; a group of every fifth prompt takes 12 advance calls, the others 1-3, so groups
    finish out of order and some finish too late for their step: those are evicted, never trained,
    and the run still makes its steps. Every trained episode is within max_staleness=1 of the
    trainer's version, and the generators ran ahead (some trained episodes are one version behind)."""
    ctl = _controller(tmp_path, ["steps=8", "max_staleness=1"], replicas=2,
                      calls=lambda line: 12 if line % 5 == 0 else 1 + line % 3)
    asyncio.run(asyncio.wait_for(ctl._run(0.0), 60))
    stale = _check_trained(ctl)
    assert len(ctl.trained) == 8 and 1 in stale
    assert ctl.buffer.stats()["evicted_stale"] > 0  # the slow groups came too late, and were not trained
    trained = {e.prompt_id for _, eps in ctl.trained for e in eps}
    assert len(trained) * ctl.cfg.generator.group_size == sum(len(eps) for _, eps in ctl.trained)  # none twice


def test_a_step_whose_last_group_on_the_way_is_too_stale_gets_another_batch(tmp_path):
    """Groups held for these numbers of advance calls, in the order they are drawn: at step 7 the
    buffer holds one group, and the last group on the way comes in beyond max_staleness and is
    evicted. The training loop must then ask for one more batch; it used to wait for a batch that
    nothing was making, for ever."""
    held = [3, 3, 2, 1, 2, 12, 1, 2, 3, 12, 12, 3, 12, 12, 3, 12]
    drawn = iter(range(1000))

    def calls(_line):
        i = next(drawn)
        return held[i] if i < len(held) else 1

    ctl = _controller(tmp_path, ["steps=8", "max_staleness=1"], replicas=2, calls=calls)
    asyncio.run(asyncio.wait_for(ctl._run(0.0), 30))
    _check_trained(ctl)
    assert len(ctl.trained) == 8 and ctl.lost_batches >= 1 and ctl.buffer.stats()["evicted_stale"] > 0


def test_a_group_a_replica_loses_is_submitted_again(tmp_path):
    """A replica that no longer holds a group it was given (respawned) reports it missing from
    ``held``: the group goes out again and trains; nothing waits for it forever."""
    forgot = []

    def lose(key):
        if key == 3 and not forgot:
            forgot.append(key)
            return True
        return False

    ctl = _controller(tmp_path, ["steps=4", "max_staleness=1"], calls=lambda line: 2, lose=lose)
    asyncio.run(asyncio.wait_for(ctl._run(0.0), 60))
    _check_trained(ctl)
    assert forgot == [3] and len(ctl.trained) == 4
    assert len(ctl.drawn) == len(set(ctl.drawn)) + 1  # the lost group's prompt was submitted twice, and no other


def test_dynamic_sampling_refills_groups_in_continuous_mode(tmp_path):
    """advantage.drop_zero_variance: a group without signal is dropped and a new prompt goes out for
    its batch; every step trains groups with signal only."""
    ctl = _controller(tmp_path, ["steps=5", "max_staleness=1", "advantage.drop_zero_variance=true"],
                      reward=lambda e, i: 1.0 if _line(SimpleNamespace(id=e.prompt_id)) % 3 == 0 else float(i % 2))
    asyncio.run(asyncio.wait_for(ctl._run(0.0), 60))
    _check_trained(ctl)
    assert len(ctl.trained) == 5 and all(_line(SimpleNamespace(id=e.prompt_id)) % 3 for _, b in ctl.trained for e in b)
    assert len(ctl.drawn) > 5 * ctl.cfg.prompts_per_step


def test_a_checkpoint_drains_the_replicas_and_a_resumed_run_goes_on_from_it(tmp_path):
    """What continuous mode guarantees at a checkpoint: it is written when no group is in flight or
    being finished (the replicas drained), so it holds the buffer's whole groups, the prompt stream's
    position and the groups owed; a run stopped after it and resumed draws the next prompts from
    exactly there (none skipped, none drawn again) and trains each prompt at most once, within the
    staleness bound. (Which groups finish first depends on timing: the batches after a resume are not
    bit-identical to an uninterrupted run's.)"""
    args = ["steps=6", "max_staleness=1", "checkpoint.every=2", "checkpoint.keep=10", "checkpoint.background=false"]
    first = _controller(tmp_path, args, calls=lambda line: 1 + line % 3)
    train_step = first.svc.trainer.train_step.fn

    async def preempted_at_step_4(eps):
        if len(first.trained) == 3:
            raise RuntimeError("preempted")
        return await train_step(eps)

    first.svc.trainer.train_step.fn = preempted_at_step_4
    with pytest.raises(ActorFailed, match="preempted"):
        asyncio.run(asyncio.wait_for(first._run(0.0), 60))
    assert first.in_flight_at_save == [0]  # step 2's checkpoint: nothing in flight
    ckpt = tmp_path / "checkpoints" / "step_000002"
    state, held = checkpoint.read_state(str(ckpt))
    G = first.cfg.generator.group_size
    assert len(held) % G == 0 and all(len({e.prompt_id for e in held[i:i + G]}) == 1 for i in range(0, len(held), G))
    then = _controller(tmp_path, args, calls=lambda line: 1 + line % 3)
    asyncio.run(asyncio.wait_for(then._run(0.0), 60))
    assert [v for v, _ in then.trained] == [2, 3, 4, 5] and then.in_flight_at_save == [0, 0]
    src = PromptSource(load_gsm8k("train", os.environ["GSM8K_DIR"]), 0)
    src.load_state_dict(state["source"])
    assert then.drawn == [p.id for p in src.next_batch(len(then.drawn))]  # on from the checkpoint's position
    before = [e for _, eps in first.trained[:2] for e in eps]  # the steps the checkpoint holds
    trained = [e.prompt_id for e in before] + [e.prompt_id for _, eps in then.trained for e in eps]
    assert len(trained) == len(set(trained)) * G  # each prompt trained at most once (G episodes)
    assert not {e.prompt_id for e in held} & {e.prompt_id for e in before}
    _check_trained(then)


# ---- a real CPU run ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_real_continuous_run_trains_no_episode_beyond_max_staleness(tmp_path):
    """The tiny model through every actor with two generator replicas, continuous rollouts and a
    checkpoint: every trained episode's policy version is within max_staleness=1 of the trainer's
    version at that step (some are one behind: generation ran ahead), groups are whole, and the
    checkpoint was written with no group in flight."""
    cfg = load_config("smollm2_135m", TINY + ["rollout.mode=continuous", "max_staleness=1", "steps=4",
                                              "layout.generator.replicas=2", "checkpoint.every=2",
                                              f"output_dir={tmp_path}", "run_id=c"])

    class Recording(Controller):
        async def _next_batch(self):
            eps = await super()._next_batch()
            self.trained.append((self.step, eps))
            return eps

        def state_dict(self):
            if self.paused:  # inside save_checkpoint, where the trainer's files are written
                self.in_flight_at_save.append(self.rollouts_in_flight)
            return super().state_dict()

    ctl = Recording(cfg, str(tmp_path / "c"), progress=False)
    ctl.trained, ctl.in_flight_at_save = [], []
    asyncio.run(ctl.run())
    stale = _check_trained(ctl)
    assert [v for v, _ in ctl.trained] == [0, 1, 2, 3] and 1 in stale
    assert {e.replica for _, eps in ctl.trained for e in eps} == {0, 1}
    assert ctl.in_flight_at_save == [0, 0] and len(checkpoint.complete(str(tmp_path / "c" / "checkpoints"))) == 2
