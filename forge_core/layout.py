"""Placement as a plan: which node and which GPUs each service gets. Pure (no Monarch, no CUDA).

The recipe's ``layout`` names the allocation (``nodes`` x ``gpus_per_node``) and where each service
goes. :func:`plan_layout` turns it into :class:`Slot` s and rejects what cannot fit, naming the key:

- generator: ``replicas`` engines of ``tp`` GPUs each, on ``layout.generator.host`` or spread in
  order over ``layout.generator.hosts`` (contiguous blocks: replicas 0..k-1 on the first host, ...).
- trainer: ``layout.trainer.gpus`` GPUs on its host (one rank per GPU: FSDP2, TP of ``trainer.tp``).
- reference: ``layout.reference.gpus`` GPUs of its own (one rank per GPU, FSDP2), or ``0`` on the
  trainer's host: sharded over the trainer's GPUs (one more process per trainer GPU).

On a node, services take consecutive GPUs in the order generator replicas, trainer, reference.
A node with one GPU (``gpus_per_node <= 1``) is shared by every service placed on it: the
generator is then *colocated* with the trainer and sleeps while it trains.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from typing import Any, Optional


class LayoutError(ValueError):
    """A layout that cannot be placed; the message names the ``layout.*`` key."""


@dataclass
class Slot:
    """Where one service (or one generator replica) runs: node index ``host`` and the physical GPU
    indices of that node, one per rank (``[]`` on CPU)."""

    host: int
    gpus: list = field(default_factory=list)

    @property
    def ranks(self) -> int:
        """GPUs of this service (one on CPU): its processes, except a vLLM generator replica, which is
        one process that starts its own TP workers (:func:`forge_core.services.spawn_service`)."""
        return max(len(self.gpus), 1)


@dataclass
class Plan:
    """The placement of every service. ``colocated``: a generator shares a GPU with the trainer."""

    generators: list
    trainer: Slot
    reference: Slot
    colocated: bool = False
    gpus_per_node: int = 0


def plan_layout(cfg: Any, heads: Optional[int] = None) -> Plan:
    """Place every service of ``cfg`` (``device``, ``layout``, ``trainer.tp``; see the module
    docstring); ``heads``: the model's attention heads, which ``layout.generator.tp`` must divide.
    Raises LayoutError naming the key: a host outside ``layout.nodes``, a node asked for more GPUs
    than it has, ``replicas``/``tp`` < 1, ``tp`` not dividing the heads, more than one replica or
    TP > 1 on a one-GPU node, ``trainer.tp`` not dividing the trainer's GPUs."""
    L, g, t, r = cfg.layout, cfg.layout.generator, cfg.layout.trainer, cfg.layout.reference
    if int(g.replicas) < 1 or int(g.tp) < 1:
        raise LayoutError(f"layout.generator.replicas={g.replicas} and layout.generator.tp={g.tp} must be >= 1")
    gkey = "layout.generator.hosts" if list(g.hosts) else "layout.generator.host"
    hosts = list(g.hosts) or [int(g.host)]
    per = -(-int(g.replicas) // len(hosts))  # replicas per host, in contiguous blocks
    ghosts = [int(hosts[i // per]) for i in range(int(g.replicas))]  # the node of each replica
    for key, host in [(gkey, h) for h in ghosts] + [("layout.trainer.host", t.host), ("layout.reference.host", r.host)]:
        if not 0 <= int(host) < int(L.nodes):
            raise LayoutError(f"{key}: node {host} is outside layout.nodes={L.nodes}")
    if heads and heads % int(g.tp):
        raise LayoutError(f"layout.generator.tp={g.tp} must divide the model's {heads} attention heads")
    if cfg.device != "cuda":
        return Plan([Slot(h) for h in ghosts], Slot(int(t.host)), Slot(int(r.host)))
    n = int(L.gpus_per_node)
    used: dict[int, int] = {}
    shared_ref = int(r.gpus) == 0 and r.host == t.host  # the reference sharded over the trainer's GPUs
    if n > 1:  # every node's whole demand first, so the message names each key that asks for GPUs there
        asks: dict[int, list] = collections.defaultdict(list)
        for h in sorted(set(ghosts)):
            k = ghosts.count(h)
            asks[h].append((k * int(g.tp), f"layout.generator.replicas x layout.generator.tp = {k} x {g.tp}"
                                           + (" on this node" if k < int(g.replicas) else "")))
        asks[int(t.host)].append((max(int(t.gpus), 1), f"layout.trainer.gpus={t.gpus}"))
        if not shared_ref:
            asks[int(r.host)].append((max(int(r.gpus), 1), f"layout.reference.gpus={r.gpus}"))
        for h, a in sorted(asks.items()):
            if sum(k for k, _ in a) > n:
                raise LayoutError(f"layout: node {h} has {n} GPUs (layout.gpus_per_node={n}) but the services placed "
                                  f"there ask for {sum(k for k, _ in a)}: {', '.join(w for _, w in a)}")

    def take(host: int, k: int, key: str) -> list:
        if n <= 1:
            if k > 1:
                raise LayoutError(f"{key}={k}: node {host} has one GPU (layout.gpus_per_node={n})")
            return [0]
        start = used.get(host, 0)  # fits: each node's whole demand was checked above
        used[host] = start + k
        return list(range(start, start + k))

    gens = [Slot(h, take(h, int(g.tp), "layout.generator.tp")) for h in ghosts]
    if n <= 1 and len(set(s.host for s in gens)) < len(gens):
        raise LayoutError(f"layout.generator.replicas={g.replicas}: one GPU per node holds one replica per node")
    trainer = Slot(int(t.host), take(int(t.host), max(int(t.gpus), 1), "layout.trainer.gpus"))
    if int(cfg.trainer.tp) < 1 or trainer.ranks % int(cfg.trainer.tp):
        raise LayoutError(f"trainer.tp={cfg.trainer.tp} must be >= 1 and divide layout.trainer.gpus={t.gpus}")
    reference = Slot(int(r.host), list(trainer.gpus) if shared_ref else
                     take(int(r.host), max(int(r.gpus), 1), "layout.reference.gpus"))
    colocated = any(s.host == trainer.host and set(s.gpus) & set(trainer.gpus) for s in gens)
    return Plan(gens, trainer, reference, colocated, max(n, 1))


def visible_devices(own: list, per_node: int = 0, only_own: bool = False,
                    inherited: Optional[str] = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a process using node GPUs ``own``: those first (in order), then
    the node's other GPUs (``per_node`` of them in all; none with ``only_own``), so ``cuda:0`` is the
    process's own GPU and CUDA IPC from the node's other GPUs still works. GPU indices are positions
    in the node's own ``CUDA_VISIBLE_DEVICES`` (``inherited``, default the environment's) when that
    is set, as when several emulated hosts split one machine's GPUs."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES") if inherited is None else inherited
    phys = [x.strip() for x in inherited.split(",") if x.strip()] if inherited else None
    rest = [] if only_own else [i for i in range(len(phys) if phys else per_node) if i not in own]
    return ",".join(phys[i] if phys else str(i) for i in list(own) + rest)
