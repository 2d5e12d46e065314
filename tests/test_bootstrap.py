"""launch.bootstrap: host-list parsing (fast) and real multi-host Monarch meshes (slow, root).

The slow tests fake two hosts with network namespaces (cluster/dev/netns.sh): fr-node1 at
10.77.0.11 and fr-node2 at 10.77.0.12, each with its own hostname, the root namespace at
10.77.0.1. Monarch controllers run in a subprocess (``python -c "import test_bootstrap; ..."``)
so the pytest process never fixes a Monarch transport for other tests; the actor classes below
live in this module, which workers import through PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import socket
import subprocess
import time

import pytest

from helpers import PY, ROOT, TESTS, child_env, in_ns, netns_nodes, ns_pids, wait_no_pids
from launch import bootstrap as bs

NODE_IPS = ["10.77.0.11", "10.77.0.12"]
PORT = 26611  # inside the namespaces only


# --------------------------------------------------------------------------- fast: parsing


def test_cluster_from_sky_parses_rank_and_ips():
    env = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.1.0.4\n10.1.0.5\n",
           "SKYPILOT_NUM_NODES": "2"}
    c = bs.cluster_from_sky(env)
    assert (c.node_rank, c.hosts, c.port) == (1, ["10.1.0.4", "10.1.0.5"], bs.DEFAULT_PORT)
    assert c.worker_addresses() == ["tcp://10.1.0.4:26600", "tcp://10.1.0.5:26600"]
    assert not c.is_controller and c.num_nodes == 2
    assert bs.cluster_from_sky({**env, "FORGE_MONARCH_PORT": "29000"}).port == 29000
    assert bs.cluster_from_sky(env, port=1234).port == 1234


def test_cluster_from_sky_single_node_and_errors():
    c = bs.cluster_from_sky({"SKYPILOT_NODE_RANK": "0"})
    assert c.hosts == ["127.0.0.1"] and c.is_controller
    with pytest.raises(KeyError, match="SKYPILOT_NODE_RANK"):
        bs.cluster_from_sky({})
    with pytest.raises(ValueError, match="SKYPILOT_NUM_NODES"):
        bs.cluster_from_sky({"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "10.0.0.1",
                             "SKYPILOT_NUM_NODES": "2"})
    with pytest.raises(ValueError, match="node_rank"):
        bs.cluster_from_sky({"SKYPILOT_NODE_RANK": "3", "SKYPILOT_NODE_IPS": "10.0.0.1"})


@pytest.mark.parametrize("expr,expected", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu-[01-02,7],login1", ["gpu-01", "gpu-02", "gpu-7", "login1"]),
    ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
])
def test_expand_nodelist_python_parser(expr, expected):
    assert bs._expand_nodelist_py(expr) == expected


def test_expand_nodelist_rejects_malformed():
    with pytest.raises(ValueError):
        bs._expand_nodelist_py("node[1-3")
    with pytest.raises(ValueError):
        bs._expand_nodelist_py("node[3-1]")


def test_cluster_from_slurm_parses_env(monkeypatch):
    # Names resolve through the resolver; IP literals pass through unchanged.
    monkeypatch.setattr(bs, "resolve", lambda h: {"n1": "10.9.0.1", "n2": "10.9.0.2"}.get(h, h))
    monkeypatch.setattr(bs, "expand_nodelist", bs._expand_nodelist_py)
    env = {"SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"}
    c = bs.cluster_from_slurm(env)
    assert (c.node_rank, c.hosts, c.port) == (1, ["10.9.0.1", "10.9.0.2"], 26600)
    with pytest.raises(KeyError, match="SLURM_NODEID"):
        bs.cluster_from_slurm({"SLURM_JOB_NODELIST": "n1"})
    with pytest.raises(KeyError, match="NODELIST"):
        bs.cluster_from_slurm({"SLURM_NODEID": "0"})


def test_cluster_from_slurm_replaces_own_loopback(monkeypatch):
    # Debian maps a host's own name to 127.0.1.1: this node must bind a routable address.
    monkeypatch.setattr(bs, "resolve", lambda h: {"n1": "127.0.1.1", "n2": "127.0.0.1"}.get(h, h))
    monkeypatch.setattr(bs, "expand_nodelist", bs._expand_nodelist_py)
    c = bs.cluster_from_slurm({"SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1,10.9.0.2"})
    assert c.hosts[1] == "10.9.0.2" and not c.hosts[0].startswith("127.")


def test_local_ip_for_loopback():
    assert bs.local_ip_for("127.0.0.1") == "127.0.0.1"
    c = bs.Cluster(node_rank=0, hosts=["127.0.0.1"], port=30000)
    assert bs.worker_address(c) == "tcp://127.0.0.1:30000"


@pytest.mark.parametrize("args, error", [
    (["--host", "127.0.0.1", "--port", "0"], "worker 127.0.0.1: port 0 outside 1..65535"),  # was: the default port
    (["--host", "no-such-host.invalid"], "worker no-such-host.invalid: "),
    (["--from", "sky"], "worker sky: SKYPILOT_NODE_RANK is not set: not running inside a SkyPilot task"),
    (["--from", "slurm"], "worker slurm: "),
    ([], "worker needs --host or --from"),
])
def test_worker_command_line_refuses_bad_input_before_starting(args, error, capsys, monkeypatch):
    monkeypatch.setattr(bs, "run_worker", lambda c: pytest.fail(f"worker started: {c}"))
    for k in [k for k in os.environ if k.startswith(("SKYPILOT_", "SLURM_"))]:
        monkeypatch.delenv(k)
    with pytest.raises(SystemExit) as e:
        bs.main(["worker", *args])
    assert e.value.code == 2 and error in capsys.readouterr().err


def test_loopback_host_list_keeps_each_nodes_own_address(monkeypatch):
    # Several hosts emulated on one machine: every node binds its own listed loopback address ...
    env = {"SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.2"}
    for rank, ip in enumerate(("127.0.0.1", "127.0.0.2")):
        c = bs.cluster_from_sky({**env, "SKYPILOT_NODE_RANK": str(rank)}, port=30000)
        assert c.hosts == ["127.0.0.1", "127.0.0.2"] and bs.worker_address(c) == f"tcp://{ip}:30000"
    # ... while on a real cluster a node whose own name maps to 127.0.1.1 binds its routable address.
    monkeypatch.setattr(bs, "local_ip_for", lambda host: "10.9.0.1")
    assert bs.worker_address(bs.Cluster(0, ["127.0.1.1", "10.9.0.2"], 30000)) == "tcp://10.9.0.1:30000"


# --------------------------------------------------------------------------- actors (slow tests)

try:
    from monarch.actor import Actor, endpoint
except ImportError:  # pragma: no cover - the fast tests do not need Monarch
    Actor = object

    def endpoint(f):
        return f


class HostInfo(Actor):
    """Reports where it runs."""

    @endpoint
    def where(self) -> dict:
        ips = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
        return {"hostname": socket.gethostname(), "ips": ips, "pid": os.getpid()}


class WeightHolder(Actor):
    """Owns a tensor (the trainer side) and exposes it as an RDMABuffer."""

    @endpoint
    def publish(self, numel: int, seed: int):
        import torch
        from monarch.rdma import RDMABuffer

        g = torch.Generator().manual_seed(seed)
        self.t = torch.randn(numel, generator=g, dtype=torch.float32)
        self.buf = RDMABuffer(self.t.view(torch.uint8))
        return self.buf, hashlib.sha256(self.t.numpy().tobytes()).hexdigest()


class WeightReader(Actor):
    """Pulls a remote RDMABuffer into local memory (the generator side)."""

    @endpoint
    async def pull(self, buf, numel: int):
        import torch

        dst = torch.zeros(numel, dtype=torch.float32)
        t0 = time.perf_counter()
        await buf.read_into(dst.view(torch.uint8))
        dt = time.perf_counter() - t0
        return hashlib.sha256(dst.numpy().tobytes()).hexdigest(), dt


def _values(value_mesh) -> list:
    return [v for _, v in value_mesh.items()]


def _controller_mesh(hosts: list[str], port: int, numel: int) -> dict:
    """Controller in a subprocess: attach, one HostInfo per host, RDMA node1 -> node2."""
    import asyncio

    async def go() -> dict:
        t0 = time.perf_counter()
        cluster = bs.Cluster(node_rank=0, hosts=hosts, port=port)
        mesh = await bs.attach(cluster, timeout_s=60)
        out: dict = {"attach_s": time.perf_counter() - t0, "where": []}
        try:
            procs = [bs.host_slice(mesh, i).spawn_procs(per_host={"procs": 1})
                     for i in range(len(hosts))]
            for pm in procs:
                info = pm.spawn("info", HostInfo)
                out["where"] += _values(await info.where.call())
            holder = procs[0].spawn("holder", WeightHolder)
            reader = procs[1].spawn("reader", WeightReader)
            (buf, sha_src), = _values(await holder.publish.call(numel, 1234))
            (sha_dst, dt), = _values(await reader.pull.call(buf, numel))
            out.update(sha_src=sha_src, sha_dst=sha_dst, rdma_s=dt, bytes=numel * 4)
        finally:
            await mesh.shutdown()
        out["total_s"] = time.perf_counter() - t0
        return out

    return asyncio.run(go())


def _controller_missing_host(hosts: list[str], port: int, timeout_s: float) -> dict:
    """Controller as node rank 0 with a background worker; hosts[1] never comes up."""
    import asyncio

    cluster = bs.Cluster(node_rank=0, hosts=hosts, port=port)
    worker = bs.start_worker_background(cluster)
    t0 = time.perf_counter()
    err = None
    try:
        asyncio.run(bs.attach(cluster, timeout_s=timeout_s))
    except bs.WorkerUnreachable as e:
        err = {"type": type(e).__name__, "msg": str(e), "hosts": e.hosts,
               "is_timeout": isinstance(e, TimeoutError)}
    elapsed = time.perf_counter() - t0
    try:  # attach released the live worker: it must exit by itself
        worker_rc = worker.wait(timeout=15)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker_rc = "still running"
    return {"error": err, "elapsed_s": elapsed, "worker_rc": worker_rc}


# --------------------------------------------------------------------------- slow: loopback hosts


@pytest.mark.slow
def test_two_loopback_hosts_one_mesh(tmp_path):
    # Two "hosts" on this machine, as SkyPilot would list them: each worker binds its own address
    # with the same port (one bind of 127.0.0.1 for both would fail), and one mesh spans both.
    pytest.importorskip("monarch.actor")
    ips, port = ["127.0.0.1", "127.0.0.2"], 26641
    workers = []
    for rank in (0, 1):
        env = {**_env(), "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NODE_IPS": "\n".join(ips),
               "SKYPILOT_NUM_NODES": "2", "FORGE_MONARCH_PORT": str(port)}
        with open(tmp_path / f"worker{rank}.log", "wb") as log:
            workers.append(subprocess.Popen([PY, "-m", "launch.bootstrap", "worker", "--from", "sky"], env=env,
                                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    try:
        r = _run_controller(None, f"_controller_mesh({ips!r}, {port}, 1024)")
        assert len(r["where"]) == 2 and r["where"][0]["pid"] != r["where"][1]["pid"], r
        assert r["sha_src"] == r["sha_dst"]  # an RDMABuffer read from host 1's actor into host 2's
        assert [w.wait(timeout=20) for w in workers] == [0, 0]  # mesh.shutdown() ended both workers
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    for rank, ip in enumerate(ips):
        log = (tmp_path / f"worker{rank}.log").read_text()
        assert f"[bootstrap] worker tcp://{ip}:{port} (node {rank}/2)" in log, log[-2000:]


def test_a_taken_worker_port_stops_node_0_naming_it(tmp_path):
    """Something listens on the worker port here (another run's worker on this node): node 0 stops
    at once, naming address and port. Its worker could not bind the port, and the controller would
    have attached to whatever listens there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(bs.PortInUse, match=f"Monarch worker port {port} on 127.0.0.1 is taken"):
            bs.start_worker_background(bs.Cluster(node_rank=0, hosts=["127.0.0.1"], port=port))
        env = {**_env(), "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "127.0.0.1", "FORGE_MONARCH_PORT": str(port)}
        p = subprocess.run([PY, "-m", "launch.node", "--from", "sky", "--attach-timeout", "20", "smollm2_135m",
                            "model.name=tiny_llama", f"output_dir={tmp_path}"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and f"error: Monarch worker port {port} on 127.0.0.1 is taken" in p.stderr, p.stderr
    assert "monarch_port in the SLURM profile" in p.stderr and not os.listdir(tmp_path)  # no run started
    bs.check_port_free(bs.Cluster(node_rank=0, hosts=["127.0.0.1"], port=port))  # closed: free again


def test_actors_report_the_launchers_node_address():
    """A multi-node launcher sets FORGE_NODE_ADDR to its Monarch worker's address (launch.node): the
    actors' ``addr``, where weight transfers connect, is that one, not the first of ``hostname -I``
    (on a multi-homed node maybe one the other nodes cannot reach)."""
    pytest.importorskip("monarch.actor")
    code = ("import asyncio, json\nfrom monarch.actor import this_host\n"
            "from forge_core.actors.placement import Placement\n"
            "async def go():\n    procs = this_host().spawn_procs(per_host={'procs': 1})\n"
            "    w = await procs.spawn('p', Placement).where.call_one()\n    await procs.stop()\n    return w\n"
            "print('RESULT ' + json.dumps(asyncio.run(go())))")
    p = subprocess.run([PY, "-c", code], env={**_env(), "FORGE_NODE_ADDR": "10.123.0.7"}, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    where = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert where["addr"] == "10.123.0.7" and "10.123.0.7" not in where["ips"], where


# --------------------------------------------------------------------------- slow: fixtures

@pytest.fixture(scope="module")
def two_hosts():
    """fr-node1 and fr-node2; created here (and removed at the end) unless they already exist."""
    with netns_nodes((1, 2)):
        yield NODE_IPS


def _env() -> dict:
    """A child's environment: this module and launch/ importable (workers import the actor classes
    above), one thread per process."""
    return child_env(ROOT, TESTS, OMP_NUM_THREADS="1")


def _run_controller(i: int | None, call: str, timeout: float = 180) -> dict:
    code = (f"import json, test_bootstrap as t; r = t.{call}; "
            "print('RESULT ' + json.dumps(r))")
    cmd = [PY, "-c", code]
    if i is not None:
        cmd = in_ns(i, shlex.join(cmd))
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"controller failed rc={p.returncode}\n{p.stdout}\n{p.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


# --------------------------------------------------------------------------- slow: tests


@pytest.mark.slow
def test_attach_two_hosts_actors_and_rdma(two_hosts, tmp_path):
    # Only our processes may live in the namespaces for the "nothing left behind" check.
    if ns_pids(1) or ns_pids(2):
        pytest.skip("fr-node1/fr-node2 already run processes (is the dev SLURM cluster up?)")
    workers = []
    for i, ip in ((1, NODE_IPS[0]), (2, NODE_IPS[1])):
        with open(tmp_path / f"worker{i}.log", "wb") as log:
            workers.append(subprocess.Popen(
                in_ns(i, f"{PY} -m launch.bootstrap worker --host {ip} --port {PORT}"),
                env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    try:
        numel = 4 * 1024 * 1024  # 16 MiB of float32
        r = _run_controller(
            None, f"_controller_mesh({NODE_IPS!r}, {PORT}, {numel})")
        print(f"\nattach {r['attach_s']:.2f}s, total {r['total_s']:.2f}s, RDMA {r['bytes'] / 2**20:.0f} "
              f"MiB in {r['rdma_s']:.3f}s ({r['bytes'] / r['rdma_s'] / 1e9:.2f} GB/s)")
        where = r["where"]
        assert [w["hostname"] for w in where] == ["node1", "node2"]
        assert NODE_IPS[0] in where[0]["ips"] and NODE_IPS[1] in where[1]["ips"]
        assert r["sha_src"] == r["sha_dst"], "tensor changed in transit"
        # mesh.shutdown() ends the workers and their procs.
        for w in workers:
            assert w.wait(timeout=20) is not None
        assert wait_no_pids(1) == [] and wait_no_pids(2) == []
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()


@pytest.mark.slow
def test_attach_names_host_that_never_comes_up(two_hosts):
    if ns_pids(1) or ns_pids(2):
        pytest.skip("fr-node1/fr-node2 already run processes (is the dev SLURM cluster up?)")
    timeout_s = 6.0
    # Controller runs as node rank 0 inside fr-node1 with its own background worker; node2
    # (10.77.0.12) never starts a worker.
    r = _run_controller(1, f"_controller_missing_host({NODE_IPS!r}, {PORT}, {timeout_s})",
                        timeout=90)
    print(f"\nmissing host: raised after {r['elapsed_s']:.2f}s (timeout {timeout_s}s): {r['error']}")
    err = r["error"]
    assert err is not None, "attach did not fail"
    assert err["is_timeout"] and err["type"] == "WorkerUnreachable"
    assert f"{NODE_IPS[1]}:{PORT}" in err["msg"] and NODE_IPS[0] not in err["msg"]
    assert err["hosts"] == [f"{NODE_IPS[1]}:{PORT}"]
    assert timeout_s <= r["elapsed_s"] < timeout_s + 10, r
    assert r["worker_rc"] != "still running", "the reachable worker was not released"
    assert wait_no_pids(1) == [] and wait_no_pids(2) == []
