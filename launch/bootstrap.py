"""Turn a launcher's host list into Monarch meshes (shared by the SLURM and SkyPilot adapters).

Every node runs one Monarch *worker* (a host agent that spawns procs when the controller asks);
node 0 also runs the *controller*, which attaches to all workers and gets back one ``HostMesh``
with a single dimension ``hosts`` in node-rank order::

    node 0:  start_worker_background(c)  ->  await attach(c, timeout_s)  ->  recipe places actors
    node i:  run_worker(c)                    (blocks until the controller shuts the mesh down)

    c = cluster_from_slurm()  or  cluster_from_sky()   # node_rank, hosts (IPs), port

Facts about torchmonarch 0.7.0 this relies on (measured on two network-namespace hosts):

- Workers: ``run_worker_loop_until_shutdown(address="tcp://IP:PORT", ca="trust_all_connections")``
  returns on ``HostMesh.shutdown()`` (``run_worker_loop_forever`` kills the process instead); if the
  controller dies, the worker waits for a new one. ``tcp://*`` is not implemented: each worker binds
  its own routable address.
- Controller: ``enable_transport`` must come first and name an explicit ``tcp://CONTROLLER_IP:0``
  (the same address again is a no-op): the ``"tcp"`` shortcut *panics* when the hostname resolves
  only to loopback (``/etc/hosts`` often maps it to 127.0.x.1); with ``"ipc"`` (the default) remote
  workers never connect back.
- ``attach_to_workers`` returns at once and keeps retrying; ``await mesh.initialized`` never fails
  for a host that is not up, so :func:`attach` probes each worker port and bounds the wait.

Command line: ``python -m launch.bootstrap worker --host IP [--port P]`` or ``worker --from slurm|sky``
(address from the launcher's environment) runs a worker; ``show --from slurm|sky`` prints the Cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

from launch.common import port_open

if TYPE_CHECKING:  # monarch is imported lazily: parsing host lists must not need it
    from monarch.actor import HostMesh

DEFAULT_PORT = 26600
PORT_ENV = "FORGE_MONARCH_PORT"
TRUST_ALL = "trust_all_connections"


class WorkerUnreachable(TimeoutError):
    """Some workers did not come up within ``timeout_s`` seconds; ``hosts`` lists them (``"IP:PORT"``, in
    node-rank order) and the message names every one."""

    def __init__(self, hosts: Sequence[str], timeout_s: float, detail: str = "") -> None:
        self.hosts = list(hosts)
        self.timeout_s = timeout_s
        super().__init__(f"Monarch workers not reachable within {timeout_s:g} s: {', '.join(self.hosts)}"
                         + (f" ({detail})" if detail else ""))


@dataclass
class Cluster:
    """What a launcher knows about its allocation; ValueError for no hosts, or a rank or port out of range.

    Attributes:
        node_rank: this node's rank, 0 .. len(hosts) - 1. Rank 0 runs the controller.
        hosts: node addresses in rank order (IPv4 after ``cluster_from_*``; names work as well).
        port: TCP port of the Monarch worker on every node.
    """

    node_rank: int
    hosts: list[str] = field(default_factory=list)
    port: int = DEFAULT_PORT

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ValueError("Cluster needs at least one host")
        if not 0 <= self.node_rank < len(self.hosts):
            raise ValueError(f"node_rank {self.node_rank} outside 0..{len(self.hosts) - 1} for hosts {self.hosts}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} outside 1..65535")

    @property
    def num_nodes(self) -> int:
        """Number of nodes (hosts) in the allocation."""
        return len(self.hosts)

    @property
    def is_controller(self) -> bool:
        """True on node rank 0, which runs the controller (and a worker)."""
        return self.node_rank == 0

    def worker_addresses(self) -> list[str]:
        """Monarch channel addresses of all workers, ``tcp://HOST:PORT``, in rank order."""
        return [f"tcp://{h}:{self.port}" for h in self.hosts]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist expression (``"gpu-[01-03,7],login1"``) into host names: with ``scontrol
    show hostnames`` when it is on PATH (the authority), else a built-in parser (comma lists, bracket
    ranges with zero padding, several bracket groups). Raises ValueError on a malformed expression."""
    if not (nodelist := nodelist.strip()):
        return []
    if shutil.which("scontrol"):
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            if out := subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                                     capture_output=True, text=True, timeout=10).stdout.split():
                return out
    return _expand_nodelist_py(nodelist)


def _expand_one(expr: str) -> list[str]:
    """Expand the first bracket group of ``expr`` (``"a[1-2,07]b"``), recursively for the others."""
    m = re.search(r"\[([^\[\]]*)\]", expr)
    if not m:
        return [expr]
    out = []
    for item in m.group(1).split(","):
        lo, _, hi = item.partition("-")
        hi = hi if "-" in item else lo
        if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
            raise ValueError(f"bad item {item!r} in {expr!r}")
        for v in range(int(lo), int(hi) + 1):  # zero padding as in lo: 01-03 -> 01 02 03
            out += _expand_one(expr[:m.start()] + str(v).zfill(len(lo)) + expr[m.end():])
    return out


def _expand_nodelist_py(nodelist: str) -> list[str]:
    """The built-in hostlist parser: split at top-level commas, expand each part's brackets.
    Raises ValueError on unbalanced brackets or a bad range."""
    hosts, depth, part = [], 0, ""
    for ch in nodelist + ",":
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise ValueError(f"unbalanced ']' in nodelist {nodelist!r}")
        if ch == "," and depth == 0:
            hosts += _expand_one(part) if part else []
            part = ""
        else:
            part += ch
    if depth:
        raise ValueError(f"unbalanced '[' in nodelist {nodelist!r}")
    return hosts


def resolve(host: str) -> str:
    """IPv4 address of ``host`` (unchanged when it is an IPv4 literal). Raises OSError (socket.gaierror)
    when the name does not resolve."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]


def local_ip_for(host: str) -> str:
    """The local IPv4 address this machine uses to reach ``host`` (its routing source address; ``host``
    itself when it is one of ours): what a worker binds and the controller advertises. No packet is
    sent (a UDP socket is only connected). Raises OSError when ``host`` does not resolve or has no route.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((resolve(host), 9))
        return s.getsockname()[0]


def _resolve_hosts(names: Sequence[str], node_rank: int) -> list[str]:
    """Resolve names to IPs; this node's loopback address (Debian's 127.0.1.1 /etc/hosts line) becomes
    the one it uses to reach the first non-loopback node. All-loopback lists (nodes emulated on one
    machine: 127.0.0.1, 127.0.0.2, ...) are kept: each node binds its own."""
    ips = [resolve(n) for n in names]  # IPv4 literals
    loopback = [ipaddress.ip_address(ip).is_loopback for ip in ips]
    others = [ip for ip, lo in zip(ips, loopback) if not lo]
    if loopback[node_rank] and others:
        ips[node_rank] = local_ip_for(others[0])
    return ips


def _cluster(env: Mapping[str, str], names: Sequence[str], rank: int, port: int | None) -> Cluster:
    """The Cluster of ``names`` resolved; port: ``port``, else ``$FORGE_MONARCH_PORT``, else 26600."""
    port = int(port if port is not None else env.get(PORT_ENV, DEFAULT_PORT))
    c = Cluster(node_rank=rank, hosts=list(names), port=port)  # checks the rank before names are resolved
    c.hosts = _resolve_hosts(c.hosts, rank)
    return c


def cluster_from_slurm(env: Mapping[str, str] | None = None, port: int | None = None) -> Cluster:
    """The Cluster of the current SLURM job step (one task per node; with more, only local rank 0
    should run a worker): ``SLURM_NODEID`` and ``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST`` or
    ``SLURM_NODELIST`` (:func:`expand_nodelist`, names resolved to IPv4; slurmd sets ``SLURM_NODEID``
    to this node's index in the step's node list, the order it expands to); the port is ``port``, else
    ``$FORGE_MONARCH_PORT``, else 26600. Raises KeyError when not inside a SLURM job, OSError when a
    node name does not resolve."""
    env = os.environ if env is None else env
    if "SLURM_NODEID" not in env:
        raise KeyError("SLURM_NODEID is not set: not running inside a SLURM job step")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise KeyError("SLURM_JOB_NODELIST is not set: not running inside a SLURM job")
    return _cluster(env, expand_nodelist(nodelist), int(env["SLURM_NODEID"]), port)


def cluster_from_sky(env: Mapping[str, str] | None = None, port: int | None = None) -> Cluster:
    """The Cluster of the current SkyPilot task: ``SKYPILOT_NODE_RANK`` and ``SKYPILOT_NODE_IPS``
    (newline-separated, rank order; none: a single node, this one); the port is ``port``, else
    ``$FORGE_MONARCH_PORT``, else 26600. Raises KeyError when ``SKYPILOT_NODE_RANK`` is not set,
    ValueError when ``SKYPILOT_NUM_NODES`` disagrees with the IP list."""
    env = os.environ if env is None else env
    if "SKYPILOT_NODE_RANK" not in env:
        raise KeyError("SKYPILOT_NODE_RANK is not set: not running inside a SkyPilot task")
    ips = ([line.strip() for line in env.get("SKYPILOT_NODE_IPS", "").splitlines() if line.strip()]
           or ["127.0.0.1"])  # single node: controller and worker share this machine
    n = env.get("SKYPILOT_NUM_NODES")
    if n is not None and int(n) != len(ips):
        raise ValueError(f"SKYPILOT_NUM_NODES={n} but SKYPILOT_NODE_IPS lists {len(ips)} IPs")
    return _cluster(env, ips, int(env["SKYPILOT_NODE_RANK"]), port)


CLUSTER_FROM = {"slurm": cluster_from_slurm, "sky": cluster_from_sky}  # launcher name -> its Cluster


def node_address(cluster: Cluster) -> str:
    """This node's IPv4 address as the other nodes reach it: ``hosts[node_rank]`` resolved by
    :func:`_resolve_hosts` (loopback replaced by a routable address). Raises OSError when a host does
    not resolve or has no route."""
    return _resolve_hosts(cluster.hosts, cluster.node_rank)[cluster.node_rank]


def worker_address(cluster: Cluster) -> str:
    """``tcp://MY_IP:PORT``: the address this node's worker binds and the controller dials (MY_IP:
    :func:`node_address`). Raises OSError as it."""
    return f"tcp://{node_address(cluster)}:{cluster.port}"


class PortInUse(OSError):
    """This node's worker port is already listened on (another run's worker on this node?)."""


def check_port_free(cluster: Cluster) -> None:
    """Raise :class:`PortInUse`, naming this node's address, the port and how to pick another, when
    something listens on the worker port here: a worker that cannot bind it dies, and the controller
    would attach to whatever listens there. Raises OSError when this node's address cannot be found."""
    host = node_address(cluster)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the worker's own bind: TIME_WAIT is no use
        try:
            s.bind((host, cluster.port))
        except OSError as e:
            raise PortInUse(f"Monarch worker port {cluster.port} on {host} is taken ({e.strerror}; another run's "
                            f"worker on this node?): set another with monarch_port in the SLURM profile, or "
                            f"{PORT_ENV}") from None


def run_worker(cluster: Cluster) -> None:
    """Run this node's Monarch worker; returns when the controller shuts the host mesh down (if it
    disconnects without that, the worker waits for a new one). Raises :class:`PortInUse` when its port
    is taken here, OSError when this node's address cannot be found."""
    from monarch.actor import run_worker_loop_until_shutdown

    check_port_free(cluster)
    run_worker_loop_until_shutdown(address=worker_address(cluster), ca=TRUST_ALL)


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End a worker process started by :func:`start_worker_background`: SIGTERM, then SIGKILL
    after ``grace_s`` seconds; returns once it has exited (at once if it already had)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


try:  # resolved up front: the child between fork and exec must not import anything
    import ctypes

    # the worker's preexec_fn: SIGTERM when its parent dies (prctl(PR_SET_PDEATHSIG = 1, SIGTERM))
    _PDEATHSIG = functools.partial(ctypes.CDLL(None, use_errno=True).prctl, 1, int(signal.SIGTERM))
except (OSError, AttributeError):  # not Linux/glibc: no parent-death signal
    _PDEATHSIG = None


def start_worker_background(cluster: Cluster) -> subprocess.Popen:
    """Start this node's worker (``python -m launch.bootstrap worker --host MY_IP --port PORT``, the
    repository root on PYTHONPATH) in a child process that gets SIGTERM when this process dies
    (PR_SET_PDEATHSIG); :func:`stop` ends it. Returns at once (the worker needs about 1-2 s to import
    Monarch; :func:`attach` waits for it). Raises :class:`PortInUse` when the worker port is taken here,
    OSError when the interpreter cannot be started."""
    check_port_free(cluster)
    host = node_address(cluster)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.Popen([sys.executable, "-m", "launch.bootstrap", "worker", "--host", host,
                             "--port", str(cluster.port)], env=env, preexec_fn=_PDEATHSIG)


async def wait_port(host: str, port: int, deadline: float, interval_s: float = 0.25) -> bool:
    """:func:`port_open` retried (in a thread, so many ports are probed at once) every ``interval_s``
    seconds until it succeeds (True) or ``deadline`` (``time.monotonic()`` seconds) passes (False)."""
    while (left := deadline - time.monotonic()) > 0:
        if await asyncio.to_thread(port_open, host, port, min(2.0, left)):
            return True
        await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
    return False


async def attach(cluster: Cluster, timeout_s: float = 120.0) -> "HostMesh":
    """Attach the controller (this process) to every worker; return the initialized HostMesh (one
    dimension ``hosts`` in rank order, :func:`host_slice`; ``await mesh.shutdown()`` ends every worker).

    Enables Monarch's TCP transport at ``tcp://CONTROLLER_IP:0`` (the address reaching ``hosts[0]``),
    then waits up to ``timeout_s`` seconds (wall clock) for every worker port to accept TCP (workers may
    start before or after this call), and the rest of the budget for the mesh to initialize.

    Raises:
        WorkerUnreachable (a TimeoutError): some workers were not up within ``timeout_s``; the message
            names each as ``IP:PORT``. Workers that were up are shut down first, leaving no process behind.
        OSError: ``hosts[0]`` has no route from here. Monarch raises when another transport was enabled.
    """
    from monarch.actor import attach_to_workers, enable_transport

    deadline = time.monotonic() + timeout_s
    enable_transport(f"tcp://{local_ip_for(cluster.hosts[0])}:0")  # for rank 0: its own IP
    up = await asyncio.gather(*(wait_port(h, cluster.port, deadline) for h in cluster.hosts))
    if missing := [f"{h}:{cluster.port}" for h, ok in zip(cluster.hosts, up) if not ok]:
        if live := [a for a, ok in zip(cluster.worker_addresses(), up) if ok]:
            with contextlib.suppress(Exception):  # best effort, 5 s a step: shut the live workers down
                rel = attach_to_workers(workers=live, ca=TRUST_ALL, name="release")
                await asyncio.wait_for(rel.initialized, timeout=5.0)
                await asyncio.wait_for(rel.shutdown(), timeout=5.0)
        raise WorkerUnreachable(missing, timeout_s)

    mesh = attach_to_workers(workers=cluster.worker_addresses(), ca=TRUST_ALL)
    try:
        await asyncio.wait_for(mesh.initialized, timeout=max(1.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise WorkerUnreachable([f"{h}:{cluster.port}" for h in cluster.hosts], timeout_s,
                                "ports open but the host mesh did not initialize; "
                                "see /tmp/$USER/monarch_log.log") from None
    return mesh


def host_slice(mesh: "HostMesh", i: int) -> "HostMesh":
    """The sub-mesh of node ``i`` (the ``hosts`` dimension removed); spawn on it with
    ``host_slice(mesh, i).spawn_procs(per_host={"procs": n})``. A slice is a reference: shut down the
    full mesh, not the slice. Raises IndexError for i outside 0..num_hosts-1."""
    return mesh.slice(hosts=i)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``worker`` runs a worker (blocks), ``show`` prints the Cluster as JSON."""
    p = argparse.ArgumentParser(prog="python -m launch.bootstrap", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="run this node's Monarch worker until shut down")
    w.add_argument("--host", help="address to bind (this node's IP)")
    w.add_argument("--port", type=int, default=None, help=f"worker port (default {DEFAULT_PORT})")
    w.add_argument("--from", dest="source", choices=["slurm", "sky"],
                   help="take node rank, hosts and port from the launcher's environment")
    s = sub.add_parser("show", help="print the Cluster seen from the environment")
    s.add_argument("--from", dest="source", choices=["slurm", "sky"], required=True)
    a = p.parse_args(argv)
    if a.cmd == "show":
        print(json.dumps(asdict(CLUSTER_FROM[a.source]())))
        return 0
    if not (a.source or a.host):
        p.error("worker needs --host or --from")
    try:  # --port 0 is refused by Cluster, not taken for "no port"
        c = CLUSTER_FROM[a.source](port=a.port) if a.source else _cluster(os.environ, [a.host], 0, a.port)
    except (KeyError, ValueError, OSError) as e:  # not in that launcher's job; a bad port, rank or host name
        p.error(f"worker {a.host or a.source}: {e.args[0] if isinstance(e, KeyError) else e}")
    print(f"[bootstrap] worker {worker_address(c)} (node {c.node_rank}/{c.num_nodes})", flush=True)
    run_worker(c)
    return 0


if __name__ == "__main__":
    sys.exit(main())
