"""The local SLURM dev cluster (cluster/dev): up.sh 2, srun, submitit, Monarch over SLURM, down.sh.

Slow and root-only: it installs Debian's slurm/munge packages if missing, turns network
namespaces fr-node1/fr-node2 into SLURM nodes node1/node2 and tears everything down at the end
(a dev cluster that was already up is restarted, then stopped).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, TESTS

DEV = ROOT / "cluster" / "dev"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dev_cluster(slurm_dev_prereqs):
    t0 = time.perf_counter()
    p = subprocess.run([str(DEV / "up.sh"), "2"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"up.sh failed\n{p.stdout}\n{p.stderr}"
    print(f"\nup.sh 2: {time.perf_counter() - t0:.1f}s")
    yield
    p = subprocess.run([str(DEV / "down.sh")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"down.sh failed\n{p.stdout}\n{p.stderr}"
    assert not Path("/var/run/netns/fr-node1").exists()
    assert "# forge-dev" not in Path("/etc/hosts").read_text()


def _srun(*args: str) -> list[str]:
    p = subprocess.run(["srun", "-N2", "-l", *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return sorted(line.strip() for line in p.stdout.splitlines())


def test_srun_two_nodes_own_hostname_and_address(dev_cluster):
    assert _srun("hostname") == ["0: node1", "1: node2"]
    assert _srun("hostname", "-I") == ["0: 10.77.0.11", "1: 10.77.0.12"]
    # Jobs reach the controller host (slurmctld port on the bridge address).
    out = _srun("bash", "-c", "echo >/dev/tcp/10.77.0.1/6817 && echo ok")
    assert out == ["0: ok", "1: ok"]


_PEER_TCP = """
import os, socket, time
rank = int(os.environ["SLURM_PROCID"])
if rank == 1:   # node2 listens on its own address
    s = socket.create_server(("10.77.0.12", 27001)); s.settimeout(30)
    c, a = s.accept(); print("got", c.recv(16).decode(), "from", a[0])
else:           # node1 connects (retrying until node2 listens)
    for _ in range(100):
        try:
            socket.create_connection(("node2", 27001), timeout=2).sendall(b"hello"); break
        except OSError:
            time.sleep(0.1)
    print("sent")
"""


def test_nodes_reach_each_other_over_tcp(dev_cluster):
    assert _srun(sys.executable, "-c", _PEER_TCP) == ["0: sent", "1: got hello from 10.77.0.11"]


def _whoami(tag: str) -> dict:
    import submitit

    env = submitit.JobEnvironment()
    ips = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return {"rank": env.global_rank, "node": env.node, "hostname": socket.gethostname(),
            "ips": ips, "tag": tag}


def _executor(tmp_path):
    import submitit

    ex = submitit.AutoExecutor(folder=str(tmp_path / "%j"), cluster="slurm")
    ex.update_parameters(slurm_partition="dev", nodes=2, tasks_per_node=1, timeout_min=5)
    return ex


def _results(job, timeout_s: float = 180) -> list:
    """``job.results()`` within ``timeout_s``: a job that never ends (pending on nodes that went away,
    say, when something else took the dev cluster down meanwhile) fails the test, cancelled, instead
    of waiting forever (submitit waits with no deadline)."""
    deadline = time.monotonic() + timeout_s
    while not job.done():
        if time.monotonic() > deadline:
            state = job.state
            subprocess.run(["scancel", job.job_id], check=False)
            pytest.fail(f"SLURM job {job.job_id} not done after {timeout_s:g} s (state {state})")
        time.sleep(1)
    return job.results()


def test_submitit_two_node_job(dev_cluster, tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    # The job imports this module by name: sbatch exports the environment (PYTHONPATH).
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{TESTS}")
    t0 = time.perf_counter()
    job = _executor(tmp_path).submit(_whoami, "hi")
    res = sorted(_results(job), key=lambda r: r["rank"])
    print(f"\nsubmitit 2-node job: {time.perf_counter() - t0:.1f}s")
    assert [(r["rank"], r["node"], r["hostname"]) for r in res] == [(0, 0, "node1"),
                                                                     (1, 1, "node2")]
    assert res[0]["ips"] == ["10.77.0.11"] and res[1]["ips"] == ["10.77.0.12"]


def _monarch_over_slurm() -> dict | None:
    """What a SLURM adapter runs on every node: workers everywhere, controller on node 0."""
    import asyncio

    from launch import bootstrap as bs
    from test_bootstrap import HostInfo

    cluster = bs.cluster_from_slurm()
    if not cluster.is_controller:
        bs.run_worker(cluster)  # returns (or the process ends) when node 0 shuts the mesh down
        return None
    bs.start_worker_background(cluster)

    async def go() -> dict:
        mesh = await bs.attach(cluster, timeout_s=60)
        try:
            where = []
            for i in range(cluster.num_nodes):
                pm = bs.host_slice(mesh, i).spawn_procs(per_host={"procs": 1})
                vm = await pm.spawn("info", HostInfo).where.call()
                where += [v for _, v in vm.items()]
        finally:
            await mesh.shutdown()
        return {"hosts": cluster.hosts, "where": where}

    return asyncio.run(go())


def test_monarch_mesh_over_slurm(dev_cluster, tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    pytest.importorskip("monarch.actor")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{TESTS}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    job = _executor(tmp_path).submit(_monarch_over_slurm)
    try:
        res = _results(job)
    except Exception:
        subprocess.run(["scancel", job.job_id], check=False)
        raise
    print(f"\nMonarch over SLURM (2 nodes): {time.perf_counter() - t0:.1f}s")
    head = res[0]
    assert head["hosts"] == ["10.77.0.11", "10.77.0.12"]
    assert [w["hostname"] for w in head["where"]] == ["node1", "node2"]
