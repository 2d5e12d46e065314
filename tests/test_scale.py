"""Generator replicas and weight transports: the Dispatcher, replica dispatch through real actors,
the choice of transport per replica, the staged (network) sync while generating, and the layout
checks. CPU only; the tiny random Llama of tests/test_e2e.py for everything that spawns actors."""

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from forge_core.config import ConfigError, load_config
from forge_core.controller import Dispatcher, sync_routes
from forge_core.weight_sync import choose_transport

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_DIR = os.environ.get("GSM8K_DIR", "")
TINY = ["model.name=tiny_llama", "prompts_per_step=2", "generator.group_size=4", "generator.max_response_tokens=12",
        "generator.max_prompt_tokens=128", "trainer.micro_batch_size=4", "trainer.lr=1e-3",
        "eval.every=0", "eval.at_start=false"]
needs_data = pytest.mark.skipif(not os.path.isdir(GSM8K_DIR), reason="GSM8K_DIR must name a local GSM8K copy")


# ---- actor calls -----------------------------------------------------------------------------------

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


# ---- Dispatcher (pure bookkeeping) ---------------------------------------------------------------

def _check_partition(plan: dict, n: int, eligible: list) -> None:
    """Every group index 0..n-1 assigned exactly once, whole (a group is an index: never split),
    only to eligible replicas, and no replica listed without work."""
    got = sorted(g for gs in plan.values() for g in gs)
    assert got == list(range(n)), plan
    assert set(plan) <= set(eligible), plan
    assert all(plan.values()), plan


def _round(d: Dispatcher, n: int, eligible: list, seconds_per_group: dict) -> dict:
    """One rollout: assign ``n`` groups, then report each replica done after its per-group time."""
    plan = d.assign(n, eligible)
    _check_partition(plan, n, eligible)
    for r, gs in plan.items():
        d.done(r, len(gs), len(gs) * seconds_per_group[r])
    assert d.outstanding == [0] * len(d.outstanding)
    return plan


def test_dispatcher_balances_equal_replicas():
    d = Dispatcher(3)
    for n in (3, 6, 9, 12, 30):  # no speed known yet, then equal measured speeds
        plan = _round(d, n, [0, 1, 2], {0: 1.0, 1: 1.0, 2: 1.0})
        sizes = [len(plan.get(r, [])) for r in range(3)]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n, sizes
    plan = _round(d, 7, [0, 1, 2], {0: 1.0, 1: 1.0, 2: 1.0})  # not divisible: off by at most one
    sizes = sorted(len(v) for v in plan.values())
    assert sizes == [2, 2, 3], plan


def test_dispatcher_gives_a_slow_replica_less():
    d = Dispatcher(3)
    speed = {0: 3.0, 1: 1.0, 2: 1.0}  # replica 0 takes 3x longer per group
    first = _round(d, 12, [0, 1, 2], speed)
    assert [len(first[r]) for r in range(3)] == [4, 4, 4]  # nothing measured yet: even split
    for _ in range(3):
        plan = _round(d, 12, [0, 1, 2], speed)
        sizes = [len(plan.get(r, [])) for r in range(3)]
        # proportional to speed would be 12 * (1/3) / (1/3 + 2) = 1.7 groups for the slow one
        assert sizes[0] * 2 <= min(sizes[1], sizes[2]), sizes
        assert sizes[0] <= 3 and sum(sizes) == 12, sizes
    # it recovers: the slow replica becomes as fast as the others, its share comes back
    for _ in range(6):
        plan = _round(d, 12, [0, 1, 2], {0: 1.0, 1: 1.0, 2: 1.0})
    assert sorted(len(v) for v in plan.values()) == [4, 4, 4], plan


def test_dispatcher_counts_outstanding_work():
    """A replica still busy with earlier groups gets less of the next batch (overlapping rollouts)."""
    d = Dispatcher(2)
    a = d.assign(4, [0, 1])
    assert [len(a[0]), len(a[1])] == [2, 2]
    d.done(1, 2, 2.0)  # replica 1 finished; replica 0 still has its 2 groups
    b = d.assign(4, [0, 1])
    _check_partition(b, 4, [0, 1])
    assert len(b.get(0, [])) < len(b[1]), b


def test_dispatcher_only_eligible_replicas():
    d = Dispatcher(4)
    for eligible in ([2], [1, 3], [0, 3], [3, 2, 1]):
        plan = _round(d, 5, eligible, {r: 1.0 for r in range(4)})
        assert set(plan) <= set(eligible)
    plan = d.assign(3, [1])
    assert plan == {1: [0, 1, 2]}
    with pytest.raises(ValueError, match="no generator replica is eligible"):
        d.assign(2, [])


# ---- transport choice and routes ------------------------------------------------------------------

@pytest.mark.parametrize("setting,same,ib,want", [
    ("auto", True, False, "ipc"), ("auto", True, True, "ipc"),
    ("auto", False, True, "rdma"), ("auto", False, False, "nccl"),
    ("nccl", True, False, "nccl"), ("nccl", False, True, "nccl"), ("nccl", False, False, "nccl"),
    ("rdma", True, False, "rdma"), ("rdma", False, False, "rdma"), ("rdma", False, True, "rdma"),
    ("ipc", True, False, "ipc"), ("ipc", True, True, "ipc"),
])
def test_choose_transport(setting, same, ib, want):
    how, why = choose_transport(setting, same, ib)
    assert how == want
    if setting == "auto":
        assert why.startswith("auto: ") and ("same host" if same else "other host") in why
        if not same:
            assert ("ibverbs on both ends" in why) == ib
    else:
        assert why == "weight_sync.transport"  # an explicit setting wins, and says so


@pytest.mark.parametrize("ib", [False, True])
def test_ipc_across_hosts_is_refused(ib):
    with pytest.raises(ValueError, match=r"weight_sync\.transport=ipc"):
        choose_transport("ipc", False, ib)
    with pytest.raises(ValueError, match=r"weight_sync\.transport='tcp'"):
        choose_transport("tcp", True, ib)


def _fake_services(gen_hosts: list, ib_hosts: set, trainer_host: int = 0) -> SimpleNamespace:
    def svc(name, host):
        return SimpleNamespace(name=name, slot=SimpleNamespace(host=host), where=[{"ibverbs": host in ib_hosts}])

    gens = [svc(f"generator_{i}", h) for i, h in enumerate(gen_hosts)]
    return SimpleNamespace(generators=gens, trainer=svc("trainer", trainer_host))


def _log_lines(err: str) -> list[str]:
    return [l for l in err.splitlines() if l.startswith("[forge] weight sync:")]


def test_sync_routes_multi_node(capsys):
    # trainer on node 0 (ibverbs); replicas 0-1 on node 0, 2-4 on node 1 (no ibverbs), 5-6 on node 2 (ibverbs)
    svc = _fake_services([0, 0, 1, 1, 1, 2, 2], ib_hosts={0, 2})
    routes = sync_routes(svc, "auto")
    assert routes == [("ipc", 0), ("ipc", 0), ("nccl", 1), ("follow", 2), ("follow", 2), ("rdma", 0), ("follow", 5)]
    lines = _log_lines(capsys.readouterr().err)
    assert len(lines) == 7  # one line per replica
    want = {0: ("node 0", "ipc", "auto: same host"), 2: ("node 1", "nccl", "no ibverbs device"),
            5: ("node 2", "rdma", "ibverbs on both ends"), 3: ("node 1", "follow", "generator_2"),
            6: ("node 2", "follow", "generator_5")}
    for i, (node, how, why) in want.items():
        line = lines[i]
        assert f"generator_{i} ({node})" in line and f": {how} " in line and why in line, line
        if how != "follow":
            assert "<- trainer (node 0)" in line, line

    # two nodes without ibverbs: one nccl group member per remote node, ranks 1..n in replica order
    svc = _fake_services([1, 1, 2, 3, 3, 3], ib_hosts=set())
    assert sync_routes(svc, "auto") == [("nccl", 1), ("follow", 0), ("nccl", 2), ("nccl", 3), ("follow", 3),
                                        ("follow", 3)]
    capsys.readouterr()


def test_sync_routes_explicit_settings(capsys):
    svc = _fake_services([0, 0, 1, 1], ib_hosts=set())
    # nccl on the trainer's own node too: every same-host replica is its own group member
    assert sync_routes(svc, "nccl") == [("nccl", 1), ("nccl", 2), ("nccl", 3), ("follow", 2)]
    lines = _log_lines(capsys.readouterr().err)
    assert "generator_0 (node 0) <- trainer (node 0): nccl (weight_sync.transport)" in lines[0]
    assert sync_routes(svc, "rdma") == [("rdma", 0), ("rdma", 0), ("rdma", 0), ("follow", 2)]
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"weight_sync\.transport=ipc"):
        sync_routes(svc, "ipc")
    assert sync_routes(_fake_services([0, 0], set()), "ipc") == [("ipc", 0), ("ipc", 0)]


# ---- layout validation --------------------------------------------------------------------------

def test_layout_errors_name_the_key():
    with pytest.raises(ConfigError) as e:  # 3 replicas + trainer + reference on a 3-GPU node
        load_config("qwen3_1_7b", ["layout.generator.replicas=3"])
    msg = str(e.value)
    assert "node 0 has 3 GPUs" in msg and "layout.gpus_per_node" in msg and "layout.generator.replicas" in msg, msg
    with pytest.raises(ConfigError, match=r"node 1 has 8 GPUs.*layout\.generator\.replicas x layout\.generator\.tp = 2 x 8"):
        load_config("llama3_8b", ["layout.generator.replicas=2", "layout.generator.tp=8"])  # 2 x tp 8 on node 1 (8 GPUs)
    with pytest.raises(ConfigError, match=r"layout\.generator\.tp=3 must divide the model's 16 attention heads"):
        load_config("qwen3_1_7b", ["layout.generator.tp=3", "layout.gpus_per_node=8"])
    with pytest.raises(ConfigError, match=r"layout\.generator\.host: node 1 is outside layout\.nodes=1"):
        load_config("smollm2_135m", ["layout.generator.host=1"])
    with pytest.raises(ConfigError, match=r"layout\.generator\.hosts: node 2 is outside layout\.nodes=2"):
        load_config("qwen3_1_7b", ["layout.nodes=2", "layout.generator.hosts=[0,2]", "layout.generator.replicas=2"])
    with pytest.raises(ConfigError, match=r"weight_sync\.transport=ipc") as e:
        load_config("smollm2_135m", ["layout.nodes=2", "layout.generator.host=1", "weight_sync.transport=ipc"])
    assert "node" in str(e.value)
    # what does fit passes
    load_config("smollm2_135m", ["layout.nodes=2", "layout.generator.host=1"])
    load_config("qwen3_1_7b", ["layout.gpus_per_node=8", "layout.generator.replicas=3", "layout.generator.tp=2"])
    load_config("smollm2_135m", ["layout.generator.replicas=3"])  # CPU: no GPU count


# ---- replica dispatch through real actors ------------------------------------------------------

def _problems(n: int, seed: int = 0) -> list:
    from forge_core.data import PromptSource, load_gsm8k

    return PromptSource(load_gsm8k("train", GSM8K_DIR), seed).next_batch(n)


def _check_batch(eps: list, problems: list, G: int) -> dict:
    """Episodes in problem order, G per problem, each group from one replica; returns {group: replica}."""
    assert len(eps) == len(problems) * G
    owner = {}
    for j, e in enumerate(eps):
        assert e.group == j // G and e.prompt_id == problems[j // G].id and e.target == problems[j // G].answer
        owner.setdefault(e.group, set()).add(e.replica)
    assert all(len(r) == 1 for r in owner.values()), owner  # a group is never split over replicas
    for g in range(len(problems)):  # the G samples of a group share their prompt
        assert len({tuple(e.prompt_ids) for e in eps[g * G:(g + 1) * G]}) == 1
    return {g: r.pop() for g, r in owner.items()}


@pytest.mark.slow
@needs_data
def test_replicas_dispatch_through_controller(tmp_path):
    """3 CPU replicas behind the real Controller: every prompt served once, whole groups per replica,
    problem order kept, each episode carrying the version of the replica that sampled it."""
    from forge_core.advantages import compute_advantages
    from forge_core.controller import Controller
    from forge_core.data import PromptSource, load_gsm8k
    from forge_core.services import call, spawn_services

    cfg = load_config("smollm2_135m", TINY + ["layout.generator.replicas=3", "generator.dtype=float32"])
    G = cfg.generator.group_size

    async def go():
        c = Controller(cfg, str(tmp_path), progress=False)
        c.source = PromptSource(load_gsm8k("train", GSM8K_DIR), 0)
        c.svc = await spawn_services(cfg)
        try:
            await c.start()
            gens = c.svc.generators
            assert [g.name for g in gens] == ["generator_0", "generator_1", "generator_2"]
            assert c.routes == [("ipc", 0)] * 3 and c.versions == [0, 0, 0]

            problems = _problems(6)
            eps, st = await c._generate(problems, 0, [0, 1, 2])
            owner = _check_batch(eps, problems, G)
            per = [sum(1 for r in owner.values() if r == i) for i in range(3)]
            print(f"\n[scale] batch 0: groups per replica {per}, {st['gen_tok_s']:.0f} tok/s")
            assert per == [2, 2, 2] and st["gen_replicas"] == 3  # nothing measured yet: an even split
            assert c.dispatcher.outstanding == [0, 0, 0] and all(c.dispatcher.rate)
            assert all(e.policy_version == 0 for e in eps)

            # one real training step, and only replica 1 loads version 1
            eps, _ = await call("reward", c.svc.reward.score, eps)
            lists, _ = await call("reference", c.svc.reference.logprobs, eps)
            for e, lp in zip(eps, lists):
                e.ref_logprobs = lp
            for e in eps:
                e.advantage = 1.0 if e.group % 2 == 0 else -1.0  # a random model's rewards are all 0: force signal
            m = await call("trainer", c.svc.trainer.train_step, eps)
            assert m["version"] == 1 and not m["skipped"]
            h = await call("trainer", c.svc.trainer.publish)
            c.versions[1] = (await call("generator_1", gens[1].update_weights, h))["version"]
            versions = [await call(g.name, g.get_version) for g in gens]
            assert versions == [0, 1, 0] == c.versions
            assert c._eligible(1) == [0, 1, 2] and c._eligible(2) == [1]  # staleness bound S=1

            problems = _problems(6, seed=1)
            eps, st = await c._generate(problems, 1, [0, 1, 2])
            owner = _check_batch(eps, problems, G)
            assert all(e.policy_version == versions[e.replica] for e in eps), [(e.replica, e.policy_version) for e in eps]
            problems = _problems(5, seed=2)  # only the fresh replica is eligible: it takes every group
            eps, st = await c._generate(problems, 2, c._eligible(2))
            owner = _check_batch(eps, problems, G)
            assert set(owner.values()) == {1} and st["gen_replicas"] == 1
            assert all(e.policy_version == 1 for e in eps)
            # a full weight sync brings every replica to the trainer's version again
            await c.publish_and_sync()
            assert c.versions == [1, 1, 1] == [await call(g.name, g.get_version) for g in gens]
            digests = {await call(g.name, g.weights_digest) for g in gens}
            assert digests == {await call("trainer", c.svc.trainer.weights_digest)}
        finally:
            await c.shutdown()

    asyncio.run(go())


def test_reference_of_batch_k_overlaps_generation_of_batch_k_plus_1(tmp_path):
    """The rollout loop with timed stand-ins for the actors (S=1, one replica at version 0): batch
    0's reference forward runs while batch 1 generates, batches reach the buffer in order, and a
    failure of the finishing step reaches the training loop as ``background_error``."""
    from forge_core.controller import Controller
    from forge_core.episode import Episode

    cfg = load_config("smollm2_135m", TINY + ["max_staleness=1"])
    G = cfg.generator.group_size
    spans: dict = {}

    class Timed(Controller):
        fail_reference = False

        async def _generate(self, problems, k, replicas, rnd=0):
            t0 = time.perf_counter()
            await asyncio.sleep(0.4)
            spans[("gen", k)] = (t0, time.perf_counter())
            eps = [Episode(prompt_id=str(k), group=j // G, target="", prompt_ids=[1], response_ids=[2, 3],
                           behaviour_logprobs=[-1.0, -1.0], text="", policy_version=0, reward=float(j % 2))
                   for j in range(len(problems) * G)]
            return eps, {"gen_s": 0.4, "gen_tokens": 2 * len(eps), "gen_tok_s": 1.0, "gen_replicas": 1}

        async def _supervised(self, name, endpoint, episodes, **kw):
            if name == "reward":
                return episodes, None
            if self.fail_reference:
                raise RuntimeError("reference stand-in failed")
            t0 = time.perf_counter()
            await asyncio.sleep(0.3)
            spans[("ref", int(episodes[0].prompt_id))] = (t0, time.perf_counter())
            return [([[0.0, 0.0]] * len(episodes), 0.3)]

    added: list = []

    async def add(eps):
        added.append(eps[0].prompt_id)
        return len(added) * len(eps)

    async def go(c):
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

    c = Timed(cfg, str(tmp_path), progress=False)
    asyncio.run(go(c))
    (g1a, g1b), (r0a, r0b) = spans[("gen", 1)], spans[("ref", 0)]
    assert g1a < r0b and r0a < g1b, spans  # the two intervals overlap
    assert spans[("gen", 1)][0] < spans[("gen", 0)][1] + 0.2  # batch 1 did not wait for batch 0's reference
    assert added == ["0", "1"] and c.batches_made == 2 and c.rollouts_in_flight == 0  # batch 2 needs version 1
    assert [round(r["ref_s"], 1) for r in c.rollout_stats] == [0.3, 0.3]

    c = Timed(cfg, str(tmp_path), progress=False)
    c.fail_reference = True
    asyncio.run(go(c))
    assert isinstance(c.background_error, RuntimeError) and "reference stand-in failed" in str(c.background_error)


def _run(args: list, run_id: str, out, timeout: int = 600, env_extra: dict | None = None) -> tuple[int, str]:
    env = dict(os.environ, FORGE_RUN_ID=run_id, WANDB_MODE="disabled", **(env_extra or {}))
    cmd = [sys.executable, "-m", "launch.local", "run", "smollm2_135m", *TINY, f"output_dir={out}", *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(l) for l in f]


@pytest.mark.slow
@needs_data
def test_cli_three_replicas_staleness_bound(tmp_path):
    t0 = time.perf_counter()
    rc, out = _run(["layout.generator.replicas=3", "max_staleness=1", "prompts_per_step=3", "steps=4"], "rep3", tmp_path)
    assert rc == 0, out[-3000:]
    rows = _rows(tmp_path / "rep3" / "metrics.jsonl")
    print(f"\n[scale] 3 replicas, S=1: {time.perf_counter() - t0:.0f} s; per step (staleness_max, gen_replicas, "
          f"generator_version): {[(r['staleness_max'], r['gen_replicas'], r['generator_version']) for r in rows]}")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness_max"] <= 1 for r in rows)
    assert all("gen_replicas" in r for r in rows) and rows[0]["gen_replicas"] == 3
    # after a weight sync the batch goes over the replicas, not all to the first one to load the new version
    assert sum(r["gen_replicas"] for r in rows[1:]) / len(rows[1:]) >= 2, [r["gen_replicas"] for r in rows]
    assert rows[-1]["policy_version"] == 4
    actors = json.loads((tmp_path / "rep3" / "actors.json").read_text())
    assert {"generator_0", "generator_1", "generator_2"} <= set(actors)
    assert out.count("weight sync: generator_") == 3 and out.count(": ipc (auto: same host)") == 3


@pytest.mark.slow
@needs_data
def test_cli_nccl_transport_two_replicas(tmp_path):
    """weight_sync.transport=nccl on one machine: each replica joins the gloo group as its own member."""
    t0 = time.perf_counter()
    rc, out = _run(["layout.generator.replicas=2", "weight_sync.transport=nccl", "weight_sync.bucket_mb=1",
                    "steps=3"], "nccl", tmp_path)
    assert rc == 0, out[-3000:]
    rows = _rows(tmp_path / "nccl" / "metrics.jsonl")
    print(f"\n[scale] nccl (gloo), 2 replicas: {time.perf_counter() - t0:.0f} s; weight_transfer_s "
          f"{[round(r['weight_transfer_s'], 3) for r in rows]}, exposed {[round(r['weight_sync_exposed_s'], 4) for r in rows]}")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["weight_transfer_s"] > 0 for r in rows)
    assert all(r["staleness_max"] <= 1 for r in rows) and rows[-1]["policy_version"] == 3
    assert "generator_0 (node 0) <- trainer (node 0): nccl (weight_sync.transport)" in out
    assert "generator_1 (node 0) <- trainer (node 0): nccl (weight_sync.transport)" in out
    # every process's staging buffer (the trainer's, each receiver's) is gone from /dev/shm after the run
    pids = [a["pid"] for a in json.loads((tmp_path / "nccl" / "actors.json").read_text()).values()]
    if os.path.isdir("/dev/shm"):
        assert not [n for n in os.listdir("/dev/shm") if any(n.startswith(f"forge-weights-{p}-") for p in pids)]


# ---- the staged (network) sync while generating ------------------------------------------------

@pytest.mark.slow
@needs_data
def test_staged_sync_generation_goes_on_during_transfer():
    """The test process plays the trainer (a TorchTitan tiny model's HF-layout weights in a staging
    buffer, a Sender); one CPU generator replica's WeightReceiver fetches over nccl (gloo) while the
    sender's broadcast is deliberately held back: the replica keeps generating at its old version,
    the swap happens between generate calls, and the weights are bit-identical after it. Then rdma."""
    from forge_core import titan
    from forge_core.layout import plan_layout
    from forge_core.services import call, spawn_service
    from forge_core.weight_sync import Sender, StagingBuffer

    cfg = load_config("smollm2_135m", TINY + ["weight_sync.bucket_mb=1", "generator.dtype=bfloat16"])  # 1 MiB buckets
    hold_s = 4.0

    async def go():
        plan = plan_layout(cfg)
        g = await spawn_service(cfg, "generator", plan.generators[0], plan, None, "generator")
        sender = None
        spec = titan.titan_model_args(cfg.model.name)
        buf = StagingBuffer(titan.hf_layout(spec.hf), getattr(torch, cfg.generator.dtype), "cpu")
        try:
            buf.fill(titan.named_hf_tensors(titan.build_model(spec, torch.device("cpu"), seed=123), spec,
                                            dtype=buf.dtype))
            old = await call("generator", g.weights_digest)
            assert old != buf.digest()
            sender = Sender("127.0.0.1", 120)
            handle = buf.handle(1, group=sender.info(2, 0))
            assert handle.nbytes > 3 << 20  # several 1 MiB buckets

            t0 = time.perf_counter()
            fetch = asyncio.create_task(call("receiver", g.receiver.fetch, handle, "nccl", 1, timeout_s=120))
            gens = []
            for i in range(2):
                eps, _ = await call("generator", g.generate, _problems(2, seed=i), i)
                gens.append(time.perf_counter() - t0)
                assert all(e.policy_version == 0 for e in eps)
                assert not fetch.done(), "the fetch returned before the sender started broadcasting"
            await asyncio.sleep(max(hold_s - (time.perf_counter() - t0), 0))
            assert not fetch.done()
            assert await call("generator", g.weights_digest) == old  # nothing swapped yet
            t_start = time.perf_counter() - t0
            sender.start(buf.flat, cfg.weight_sync.bucket_mb << 20)
            got = await fetch
            t_fetch = time.perf_counter() - t0
            assert sender.wait() is None
            print(f"\n[scale] nccl staged: generate calls returned at {[round(x, 2) for x in gens]} s, broadcast "
                  f"started at {t_start:.2f} s, fetch done at {t_fetch:.2f} s ({handle.nbytes / 1e6:.1f} MB)")
            assert max(gens) < t_start < t_fetch and got["transfer_s"] > 0
            assert await call("generator", g.weights_digest) == old  # staged beside the engine, not loaded
            eps, _ = await call("generator", g.generate, _problems(2, seed=5), 5)
            assert all(e.policy_version == 0 for e in eps)
            r = await call("generator", g.update_weights, handle, True)  # the swap, between two generate calls
            assert r["version"] == 1 and r["mode"] == "staged"
            assert await call("generator", g.weights_digest) == buf.digest()  # bit-identical
            assert await call("generator", g.get_version) == 1
            eps, _ = await call("generator", g.generate, _problems(2, seed=6), 6)
            assert all(e.policy_version == 1 for e in eps)

            # rdma (Monarch RDMABuffer; its TCP fallback on this CPU machine), generating meanwhile
            buf.fill(titan.named_hf_tensors(titan.build_model(spec, torch.device("cpu"), seed=7), spec, dtype=buf.dtype))
            handle = buf.handle(2, rdma=True)
            fetch = asyncio.create_task(call("receiver", g.receiver.fetch, handle, "rdma", 0, timeout_s=120))
            eps, _ = await call("generator", g.generate, _problems(2, seed=8), 8)
            assert all(e.policy_version == 1 for e in eps)
            got = await fetch
            assert got["transfer_s"] > 0
            assert await call("generator", g.weights_digest) != buf.digest()
            r = await call("generator", g.update_weights, handle, True)
            assert r["version"] == 2 and await call("generator", g.weights_digest) == buf.digest()
            print(f"[scale] rdma staged: {got['transfer_s']:.3f} s, {got['gb_s']:.2f} GB/s")
        finally:
            if sender is not None:
                sender.wait()
            await g.stop()
            buf.close()

    asyncio.run(go())


# ---- a node leader whose staged copy never comes (fakes around the real Controller._sync_locked) --

class _Endpoint:
    """A fake endpoint: ``call_one`` runs ``fn`` (a coroutine function)."""

    def __init__(self, fn):
        self.fn = fn

    def call_one(self, *args):
        return self.fn(*args)


def test_hung_leader_staged_copy_respawns_it_and_the_followers_still_load(tmp_path):
    """generator_0 fetches over the network (nccl) and generator_1 on its node follows its staged
    copy. The leader's receiver hangs when asked for that copy: the call misses its deadline
    (``fault.call_timeout_s``), the leader is respawned (faults.jsonl names it), the version is
    published again, and then both replicas load it, the follower from the new staged copy."""
    from forge_core.controller import Controller

    cfg = load_config("smollm2_135m", ["fault.call_timeout_s=0.5", "fault.timeout_per_token_s=0"])
    ctl = Controller(cfg, str(tmp_path), progress=False)
    log = {"staged": 0, "loads": [], "respawned": []}

    async def publish(*_):
        return SimpleNamespace(version=1, nbytes=1000)

    async def fetch(*_):
        return {"transfer_s": 0.01}

    async def staged(version):
        log["staged"] += 1
        if log["staged"] == 1:
            await asyncio.sleep(3600)  # hung
        return f"staged copy of version {version}"

    def generator(name):
        async def update_weights(*args):
            log["loads"].append((name, args[0] if isinstance(args[0], str) else "handle"))
            return {"version": 1, "sync_s": 0.01, "mode": "ipc"}

        return SimpleNamespace(name=name, update_weights=_Endpoint(update_weights),
                               receiver=SimpleNamespace(fetch=_Endpoint(fetch), staged=_Endpoint(staged)))

    async def respawn(name):
        log["respawned"].append(name)

    ctl.svc = SimpleNamespace(trainer=SimpleNamespace(publish=_Endpoint(publish)),
                              generators=[generator("generator_0"), generator("generator_1")],
                              respawn=respawn, write_placement=lambda path: None, dtypes={"generator": "float32"})
    ctl.routes = [("nccl", 1), ("follow", 0)]
    ctl.versions = [0, 0]
    asyncio.run(asyncio.wait_for(ctl._sync_locked(), 60))  # without the deadline: TimeoutError here
    assert log["respawned"] == ["generator_0"] and ctl.generation == 1
    assert sorted(log["loads"]) == [("generator_0", "handle"), ("generator_1", "staged copy of version 1")]
    faults = [json.loads(l) for l in open(tmp_path / "faults.jsonl")]
    assert [f["service"] for f in faults] == ["generator_0"]
    assert "receiver_generator_0" in faults[0]["error"] and "did not answer" in faults[0]["error"]
    assert ctl.versions == [1, 1]


def test_a_respawn_keeps_the_dtype_its_role_resolved(monkeypatch):
    """generator.dtype=auto: a respawned generator replica or reference gets the dtype its role
    resolved at the start, not a new probe (which could pick another dtype than the weights the
    trainer publishes); the other roles, and a first spawn, keep the config's setting."""
    from forge_core import services
    from forge_core.layout import plan_layout
    cfg = load_config("smollm2_135m", TINY)
    plan = plan_layout(cfg)
    assert cfg.generator.dtype == "auto"
    assert services.actor_kwargs(cfg, "generator", plan.generators[0], plan)["generator"]["dtype"] == "auto"
    assert services.actor_kwargs(cfg, "generator", plan.generators[0], plan, dtype="float32")["generator"]["dtype"] \
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


def test_colocated_trainer_kwargs_import_no_torchtitan_in_the_controller():
    """One GPU for all (colocated, the engine asleep between rollouts): the trainer's ``shared_gb``
    is the sleeping engine's 2 GB plus the reference's bf16 weights (2 bytes x 134.5M parameters of
    SmolLM2-135M), computed from the HF config alone: the controller never imports TorchTitan
    (about 11 s between the engine's start and the trainer's spawn, with the event loop blocked)."""
    code = ("import sys; from forge_core.config import load_config; from forge_core.layout import plan_layout;"
            "from forge_core.services import actor_kwargs;"
            "cfg = load_config('smollm2_135m', sys.argv[1:]); plan = plan_layout(cfg);"
            "print(plan.colocated, actor_kwargs(cfg, 'trainer', plan.trainer, plan)['shared_gb'],"
            " 'torchtitan' in sys.modules)")
    args = ["device=cuda", "generator.backend=vllm", "layout.gpus_per_node=1", "layout.trainer.gpus=1",
            "layout.reference.gpus=0", "max_staleness=0"]
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=True)
    colocated, shared_gb, titan_imported = out.stdout.split()
    assert colocated == "True" and titan_imported == "False", out.stdout
    assert abs(float(shared_gb) - (2.0 + 2 * 134.5e6 / 1e9)) < 0.001, out.stdout


def test_vllm_worker_calls_pickle():
    """With TP > 1, vLLM pickles what ``apply_model`` runs to its worker processes: every call the
    vLLM generator makes there (load, compare, digest, state dict) must survive a pickle round trip
    with a real same-host handle, its network parts (an RDMA buffer) left behind."""
    import pickle
    from functools import partial

    from forge_core.actors import vllm_generator as vg
    from forge_core.weight_sync import StagingBuffer

    buf = StagingBuffer([("w", (2, 3), 6)], torch.float32, torch.device("cpu"))
    try:
        h = dataclasses.replace(buf.handle(3), rdma=object())  # an unpicklable stand-in for RDMABuffer
        for fn in (partial(vg._load, handle=vg._local(h), bucket_bytes=1 << 20),
                   partial(vg._mismatches, handle=vg._local(h), hf={}, tp=2),
                   partial(vg._digest, layout=h.layout, hf={}), partial(vg._state_dict, layout=h.layout, hf={})):
            back = pickle.loads(pickle.dumps(fn))
            assert back.func is fn.func and back.keywords.keys() == fn.keywords.keys()
        assert pickle.loads(pickle.dumps(vg._local(h))).ipc == h.ipc
        with pytest.raises(Exception):
            pickle.dumps(lambda m: vg._load(m, h, 1))  # what the generator passed before: not picklable
    finally:
        buf.close()


def test_a_tp_replica_is_one_process():
    """A generator replica on several GPUs (TP > 1) is ONE process: vLLM starts its own TP workers.
    (One process per GPU, as for the trainer, would start one whole TP engine per GPU, all on the
    same GPUs: the first TP=2 run on 2 x H200 ran 4,441 tok/s that way.) Checked on CPU with a
    2-GPU slot, which the CPU generator ignores."""
    from forge_core.layout import plan_layout, Slot
    from forge_core.services import call, spawn_service

    cfg = load_config("smollm2_135m", TINY + ["generator.dtype=float32"])

    async def go():
        svc = await spawn_service(cfg, "generator", Slot(0, [0, 1]), plan_layout(cfg), name="generator_tp2")
        try:
            assert svc.ranks == 1 and len(svc.where) == 1, svc.where
            assert await call(svc.name, svc.get_version) == 0
        finally:
            await svc.stop(30)

    asyncio.run(go())


@pytest.mark.parametrize("cls", ["trainer.Trainer", "reference.Reference"])
def test_gpu_actors_pick_their_gpu_before_importing_torchtitan_models(monkeypatch, cls):
    """Importing TorchTitan's models starts CUDA, after which CUDA_VISIBLE_DEVICES is ignored: a
    sharded reference built its model spec first, and both ranks landed on GPU 0 (NCCL: 'Duplicate
    GPU detected', 2 x H200). The trainer and the reference must call init_device first."""
    import importlib

    from forge_core import titan

    mod_name, name = cls.split(".")
    mod = importlib.import_module(f"forge_core.actors.{mod_name}")
    order = []

    class Stop(Exception):
        pass

    def fake_init_device(*a, **k):
        order.append("init_device")
        return torch.device("cpu")

    def fake_spec(*a, **k):
        order.append("titan_model_args")
        raise Stop

    monkeypatch.setattr(mod, "init_device", fake_init_device)
    monkeypatch.setattr(titan, "titan_model_args", fake_spec)
    actor = object.__new__(getattr(mod, name))
    kw = dict(model={"name": "smollm2_135m", "seed": 0}, device="cpu", temperature=1.0, seq_len=64, seed=0, threads=1)
    if name == "Reference":
        kw.update(dtype="float32", micro_batch_size=1)
    else:
        cfg = load_config("smollm2_135m", [])
        kw.update(trainer=cfg.trainer, loss=cfg.loss, publish_dtype="float32", max_response_tokens=32)
    with pytest.raises(Stop):
        type(actor).__init__(actor, **kw)
    assert order == ["init_device", "titan_model_args"]
