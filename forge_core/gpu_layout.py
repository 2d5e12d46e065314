"""GPU placement: which physical GPUs of its node each service gets, and colocation.

``layout.gpus_per_node`` GPUs per node; each service asks for ``layout.<svc>.gpus`` on node
``layout.<svc>.host``. Services on one node get consecutive GPUs in the order generator, trainer,
reference; ``layout.reference.gpus=0`` puts the reference on the trainer's first GPU. With one GPU per node (``gpus_per_node <= 1``) every GPU service shares GPU 0:
*colocated* mode (the generator sleeps while the trainer works). Every actor process sees all of
its node's GPUs with its own first in ``CUDA_VISIBLE_DEVICES`` (:func:`visible_devices`), so
``cuda:0`` is its device and CUDA IPC handles from other GPUs of the node can still be opened.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SERVICES = ("generator", "trainer", "reference")


@dataclass
class GpuPlan:
    """``gpus[svc]``: physical GPU indices on the service's node; ``colocated``: all share one GPU."""

    gpus: dict = field(default_factory=dict)
    colocated: bool = False
    per_node: int = 0


def plan_gpus(cfg: Any) -> GpuPlan:
    """Assign GPUs to the services of a ``device=cuda`` config (an empty plan on CPU).

    Raises:
        ValueError: naming the node when the services ask for more GPUs than it has.
    """
    if cfg.device != "cuda":
        return GpuPlan()
    n = int(cfg.layout.gpus_per_node)
    if n <= 1:
        return GpuPlan({s: [0] for s in SERVICES}, True, max(n, 1))
    used: dict[int, int] = {}
    gpus = {}
    for s in SERVICES:
        if s == "reference" and int(cfg.layout.reference.gpus) == 0 and cfg.layout.reference.host == cfg.layout.trainer.host:
            gpus[s] = gpus["trainer"][:1]  # shares the trainer's first GPU
            continue
        host, k = int(cfg.layout[s].host), max(int(cfg.layout[s].gpus), 1)
        start = used.get(host, 0)
        if start + k > n:
            raise ValueError(f"layout: node {host} has {n} GPUs (layout.gpus_per_node) but generator, trainer and "
                             f"reference ask for more there (at layout.{s}.gpus={k}, {start} already taken)")
        gpus[s] = list(range(start, start + k))
        used[host] = start + k
    return GpuPlan(gpus, False, n)


def visible_devices(own: list, per_node: int = 0) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a process using physical GPUs ``own``: those first (in order),
    then the node's other GPUs (``per_node`` of them in all)."""
    rest = [i for i in range(per_node) if i not in own]
    return ",".join(str(i) for i in list(own) + rest)
