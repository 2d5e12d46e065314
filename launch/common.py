"""What every launcher (local, SLURM, SkyPilot) shares: the list of secrets and the TCP port probe.
(The gated-model check is :func:`forge_core.models.gated_without_token`, called with ``cfg.model``.)"""

from __future__ import annotations

import asyncio
import socket
import time

# Environment variables whose values no launcher writes down (scripts, pickles, configs, logs):
# SLURM hands them to the job through a private file, SkyPilot through ``--secret``.
SECRETS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")


def port_open(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """True when a TCP connection to ``host:port`` succeeds within ``timeout_s`` seconds (then closed).
    False on refusal, timeout or a name that does not resolve."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


async def wait_port(host: str, port: int, deadline: float, interval_s: float = 0.25) -> bool:
    """:func:`port_open` retried (in a thread, so many ports are probed at once) every ``interval_s``
    seconds until it succeeds (True) or ``deadline`` (``time.monotonic()`` seconds) passes (False)."""
    while (left := deadline - time.monotonic()) > 0:
        if await asyncio.to_thread(port_open, host, port, min(2.0, left)):
            return True
        await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
    return False
