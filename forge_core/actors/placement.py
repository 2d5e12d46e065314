"""A tiny actor that reports where its process runs (hostname, addresses, pid).

The controller spawns one next to each service actor (same process) and writes the answers to
``<run>/actors.json``, so a multi-node run records which node hosted which service.
"""

from __future__ import annotations

import os
import socket
import subprocess

from monarch.actor import Actor, endpoint


def host_addresses() -> list[str]:
    """Non-loopback IPv4 addresses of this host (``hostname -I``; else what the hostname resolves to)."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
        ips = [a for a in out if "." in a and not a.startswith("127.")]
        if ips:
            return ips
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return sorted({i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)})
    except OSError:
        return []


class Placement(Actor):
    """Reports the host it runs on."""

    @endpoint
    async def where(self) -> dict:
        """``{"hostname", "ips", "pid"}`` of this actor's process."""
        return {"hostname": socket.gethostname(), "ips": host_addresses(), "pid": os.getpid()}
