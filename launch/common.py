"""What every launcher (local, SLURM, SkyPilot) shares: the list of secrets and the TCP port probe.
(The gated-model check is :func:`forge_core.models.gated_without_token`, called with ``cfg.model``.)"""

from __future__ import annotations

import socket

from forge_core import SECRETS  # noqa: F401  (the one list, re-exported for the launchers)


def port_open(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """True when a TCP connection to ``host:port`` succeeds within ``timeout_s`` seconds (then closed).
    False on refusal, timeout or a name that does not resolve."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
