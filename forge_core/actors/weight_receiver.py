"""The weight receiver actor: fetches a weight version from another host while the generator of the
same process keeps generating (Monarch runs the two actors concurrently; each runs its own messages
one at a time). See :mod:`forge_core.weight_sync`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from monarch.actor import Actor, endpoint

from forge_core.weight_sync import Receiver, WeightHandle

if TYPE_CHECKING:
    from forge_core.config import WeightSyncConfig


class WeightReceiver(Actor):
    """Stages weights for the generator replica ``name`` of this process, on ``device``.

    Args:
        name: the replica's name (the generator loads the staged bytes by it).
        device: ``"cpu"`` or ``"cuda"`` (the engine's first GPU, ``cuda:0`` in this process).
        weight_sync: the ``weight_sync`` config section (bucket size, timeout).
    """

    def __init__(self, name: str, device: str, weight_sync: WeightSyncConfig):
        self.receiver = Receiver(name, "cuda:0" if device == "cuda" else "cpu")
        self.timeout_s = float(weight_sync.timeout_s)
        self.bucket_bytes = int(weight_sync.bucket_mb) << 20

    @endpoint
    async def fetch(self, handle: WeightHandle, transport: str, rank: int = 0) -> dict:
        """Stage ``handle``'s bytes over ``transport`` (``nccl`` as group member ``rank``, or
        ``rdma``). Returns ``{"transfer_s", "gb_s"}``."""
        return await self.receiver.fetch(handle, transport, rank, self.timeout_s, self.bucket_bytes)

    @endpoint
    async def staged(self, version: int) -> WeightHandle:
        """A same-host handle of the staged bytes of ``version`` (for the node's other replicas)."""
        return self.receiver.handle(version)
