"""A tiny actor beside every service actor (same process): where the process runs, a free TCP
port from the OS (for ``torch.distributed`` rendezvous of a service's ranks) and whether Monarch
sees an ibverbs device there. The controller writes the answers to ``<run>/actors.json``."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess

from monarch.actor import Actor, endpoint


def host_addresses() -> list[str]:
    """Non-loopback IPv4 addresses of this host (``hostname -I``; else what the hostname resolves to)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
        ips = [a for a in out if "." in a and not a.startswith("127.")]
        if ips:
            return ips
    with contextlib.suppress(OSError):
        return sorted({i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)})
    return []


def free_port() -> int:
    """A TCP port the OS reports free on this host (bound and released)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Placement(Actor):
    """Reports the host it runs on."""

    @endpoint
    async def where(self) -> dict:
        """``{"hostname", "ips", "addr", "pid", "free_port", "ibverbs"}`` of this actor's process;
        ``addr``: the address other nodes reach this one at, ``$FORGE_NODE_ADDR`` (a multi-node
        launcher's: its Monarch worker's), else the first of ``ips`` ("" when none); ``ibverbs``:
        Monarch sees an ibverbs RDMA device here (InfiniBand, RoCE, EFA)."""
        from monarch.rdma import is_ibverbs_available

        ips = host_addresses()
        return {"hostname": socket.gethostname(), "ips": ips, "addr": os.environ.get("FORGE_NODE_ADDR") or
                (ips[0] if ips else ""), "pid": os.getpid(), "free_port": free_port(),
                "ibverbs": bool(is_ibverbs_available())}
