"""Weight transports: the choice of transport per generator replica and the routes it gives, the
staged (network) sync while a replica generates (a real CPU generator actor), a node leader whose
staged copy never comes (fakes around the real ``Controller._sync_locked``), and what the vLLM
generator sends to its TP workers (pickled)."""

import asyncio
import dataclasses
import json
import time
from types import SimpleNamespace

import pytest
import torch

from forge_core.config import load_config
from forge_core.controller import sync_routes
from forge_core.weight_sync import choose_transport
from helpers import TINY, gsm8k_batch


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


# ---- the staged (network) sync while generating ------------------------------------------------

async def _joined(sender, fetch: asyncio.Task, timeout_s: float = 60.0) -> None:
    """Wait until the receiver whose ``fetch`` is running has joined ``sender``'s group and waits for
    the sender: the sender's store holds the receiver's two keys (its connection's, its address in the
    group), the sender's own come only when it broadcasts. Fails when the fetch ends first, or after
    ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while sender.store.num_keys() < 2:
        assert not fetch.done(), f"the fetch ended before the receiver joined the group: {fetch.exception()!r}"
        assert time.monotonic() < deadline, f"the receiver did not join the group within {timeout_s:g} s"
        await asyncio.sleep(0.02)


@pytest.mark.slow
def test_staged_sync_generation_goes_on_during_transfer():
    """The test process plays the trainer (a TorchTitan tiny model's HF-layout weights in a staging
    buffer, a Sender); one CPU generator replica's WeightReceiver fetches over nccl (gloo) while the
    sender's broadcast is held back until the receiver waits in the group (:func:`_joined`): the
    replica keeps generating at its old version meanwhile, the swap happens between generate calls,
    and the weights are bit-identical after it. Then rdma."""
    from forge_core import titan
    from forge_core.layout import plan_layout
    from forge_core.services import call, spawn_service
    from forge_core.weight_sync import Sender, StagingBuffer

    cfg = load_config("smollm2_135m", TINY + ["weight_sync.bucket_mb=1", "generator.dtype=bfloat16"])  # 1 MiB buckets

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
            await _joined(sender, fetch)  # the receiver is in its fetch, waiting for the sender
            gens = []
            for i in range(2):
                eps, _ = await call("generator", g.generate, gsm8k_batch(2, seed=i), i)
                gens.append(time.perf_counter() - t0)
                assert all(e.policy_version == 0 for e in eps)
                assert not fetch.done(), "the fetch returned before the sender started broadcasting"
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
            eps, _ = await call("generator", g.generate, gsm8k_batch(2, seed=5), 5)
            assert all(e.policy_version == 0 for e in eps)
            r = await call("generator", g.update_weights, handle, True)  # the swap, between two generate calls
            assert r["version"] == 1 and r["mode"] == "staged"
            assert await call("generator", g.weights_digest) == buf.digest()  # bit-identical
            assert await call("generator", g.get_version) == 1
            eps, _ = await call("generator", g.generate, gsm8k_batch(2, seed=6), 6)
            assert all(e.policy_version == 1 for e in eps)

            # rdma (Monarch RDMABuffer; its TCP fallback on this CPU machine), generating meanwhile
            buf.fill(titan.named_hf_tensors(titan.build_model(spec, torch.device("cpu"), seed=7), spec, dtype=buf.dtype))
            handle = buf.handle(2, rdma=True)
            fetch = asyncio.create_task(call("receiver", g.receiver.fetch, handle, "rdma", 0, timeout_s=120))
            eps, _ = await call("generator", g.generate, gsm8k_batch(2, seed=8), 8)
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


# ---- what the vLLM generator sends to its TP workers ------------------------------------------------

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


def _sharded_load_worker(rank, init_file):
    """One of 2 gloo ranks of an FSDP2-sharded model (a sharded reference): rank 0 holds the HF
    weights, rank 1 only their shapes (``meta``, what :meth:`Reference.load_initial` gives a rank
    that cannot see the trainer's GPU); after :func:`titan.load_hf_state_dict` every rank's shards
    gather to rank 0's weights."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as pdm
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama

    from forge_core import titan
    from forge_core.weight_sync import digest_of
    from test_lora import _spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    pdm.device_type = "cpu"
    spec = _spec("llama3")  # its HF layout permutes wq/wk rows: the adapter runs on the meta tensors too
    jc = titan.job_config(128, ac=False)
    jc.training.mixed_precision_param = "float32"
    pd = pdm.ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
    pd.build_mesh()
    want = dict(titan.named_hf_tensors(titan.build_model(spec, torch.device("cpu"), seed=1), spec))
    m = titan.build_model(spec, torch.device("cpu"), seed=0, parallelize=lambda mm: parallelize_llama(mm, pd, jc))
    src = want if rank == 0 else {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in want.items()}
    titan.load_hf_state_dict(m, spec, src)
    got = list(titan.named_hf_tensors(m, spec))  # every rank gathers (collectives)
    assert digest_of(got) == digest_of(want.items())
    dist.destroy_process_group()


def test_sharded_load_reads_rank_0_only(tmp_path):
    """A reference sharded over several GPUs loads the trainer's weights through rank 0 alone: the
    other ranks (each seeing only its own GPU, so unable to open the trainer's CUDA IPC buffer) pass
    shapes, and every shard still equals the trainer's bytes."""
    torch.multiprocessing.spawn(_sharded_load_worker, args=(str(tmp_path / "init"),), nprocs=2)
