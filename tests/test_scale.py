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
        "generator.max_prompt_tokens=128", "trainer.micro_batch_size=4", "trainer.lr=1e-3"]
slow = [pytest.mark.slow, pytest.mark.skipif(not os.path.isdir(GSM8K_DIR), reason="GSM8K_DIR must name a local GSM8K copy")]


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
        load_config("llama3_8b", ["layout.generator.replicas=2"])  # 2 x tp 8 on node 1 (8 GPUs)
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
