"""Several generator replicas in real CPU runs with the tiny random Llama: dispatch through the real
Controller and its actors (whole groups per replica, problem order, each episode's version, the ipc
route to each), and one CLI run with three replicas that two tests look at: the staleness bound, and
the nccl (gloo) transport to every replica."""

import asyncio
import json
import os
import time

import pytest

from forge_core.config import load_config
from helpers import TINY, gsm8k_batch, rows, run

pytestmark = pytest.mark.slow


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


def test_replicas_dispatch_through_controller(tmp_path):
    """3 CPU replicas behind the real Controller: every prompt served once, whole groups per replica,
    problem order kept, each episode carrying the version of the replica that sampled it."""
    from forge_core.controller import Controller
    from forge_core.data import PromptSource, load_gsm8k
    from forge_core.services import call, spawn_services

    cfg = load_config("smollm2_135m", TINY + ["layout.generator.replicas=3", "generator.dtype=float32"])
    G = cfg.generator.group_size

    async def go():
        c = Controller(cfg, str(tmp_path), progress=False)
        c.source = PromptSource(load_gsm8k("train", os.environ["GSM8K_DIR"]), 0)
        c.svc = await spawn_services(cfg)
        try:
            await c.start()
            gens = c.svc.generators
            assert [g.name for g in gens] == ["generator_0", "generator_1", "generator_2"]
            assert c.routes == [("ipc", 0)] * 3 and c.versions == [0, 0, 0]

            problems = gsm8k_batch(6)
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

            problems = gsm8k_batch(6, seed=1)
            eps, st = await c._generate(problems, 1, [0, 1, 2])
            owner = _check_batch(eps, problems, G)
            assert all(e.policy_version == versions[e.replica] for e in eps), [(e.replica, e.policy_version) for e in eps]
            problems = gsm8k_batch(5, seed=2)  # only the fresh replica is eligible: it takes every group
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


@pytest.fixture(scope="module")
def three_replicas(tmp_path_factory):
    """One CLI run the tests below look at: three replicas, ``max_staleness=1``, 3 prompts a step, 4
    steps, weights sent over the nccl transport (gloo on a CPU; 1 MiB buckets), each replica joining
    the group as its own member. ``(run directory, its console output, seconds)``."""
    out = tmp_path_factory.mktemp("replicas")
    t0 = time.perf_counter()
    rc, text = run(["layout.generator.replicas=3", "max_staleness=1", "prompts_per_step=3", "steps=4",
                    "weight_sync.transport=nccl", "weight_sync.bucket_mb=1"], "rep3", out)
    assert rc == 0, text[-3000:]
    return out / "rep3", text, time.perf_counter() - t0


def test_cli_three_replicas_staleness_bound(three_replicas):
    run_dir, out, seconds = three_replicas
    got = rows(run_dir)
    print(f"\n[scale] 3 replicas, S=1: {seconds:.0f} s; per step (staleness_max, gen_replicas, "
          f"generator_version): {[(r['staleness_max'], r['gen_replicas'], r['generator_version']) for r in got]}")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert all(r["staleness_max"] <= 1 for r in got)
    assert all("gen_replicas" in r for r in got) and got[0]["gen_replicas"] == 3
    # after a weight sync the batch goes over the replicas, not all to the first one to load the new version
    assert sum(r["gen_replicas"] for r in got[1:]) / len(got[1:]) >= 2, [r["gen_replicas"] for r in got]
    assert got[-1]["policy_version"] == 4
    actors = json.loads((run_dir / "actors.json").read_text())
    assert {"generator_0", "generator_1", "generator_2"} <= set(actors)


def test_cli_nccl_transport_to_every_replica(three_replicas):
    """weight_sync.transport=nccl on one machine: each replica joins the gloo group as its own member,
    every step moves weights, and every process's staging buffer is gone from /dev/shm after the run.
    (The same-host default, ipc to each of three replicas: test_replicas_dispatch_through_controller.)"""
    run_dir, out, _ = three_replicas
    got = rows(run_dir)
    print(f"\n[scale] nccl (gloo), 3 replicas: weight_transfer_s {[round(r['weight_transfer_s'], 3) for r in got]}, "
          f"exposed {[round(r['weight_sync_exposed_s'], 4) for r in got]}")
    assert all(r["weight_transfer_s"] > 0 for r in got)
    assert out.count("weight sync: generator_") == 3
    for i in range(3):
        assert f"generator_{i} (node 0) <- trainer (node 0): nccl (weight_sync.transport)" in out, out[-3000:]
    pids = [a["pid"] for a in json.loads((run_dir / "actors.json").read_text()).values()]
    if os.path.isdir("/dev/shm"):
        assert not [n for n in os.listdir("/dev/shm") if any(n.startswith(f"forge-weights-{p}-") for p in pids)]
