"""Versioned trainer -> generator weight transfer through Monarch ``RDMABuffer``.

The trainer owns one contiguous *staging* buffer holding every parameter back to back
(:class:`FlatWeights`). ``publish`` copies the live parameters into it (one memcpy) and hands out a
:class:`WeightHandle`: the version, the buffer wrapped in ``monarch.rdma.RDMABuffer`` (registered
once; ibverbs where the hardware has it, Monarch's TCP fallback elsewhere) and the layout.
A receiver keeps its own parameters as views into a flat buffer of the same layout, so
``await handle.buffer.read_into(flat)`` writes the new weights straight into the model: no
per-tensor copies, no pickling. The sender must not publish version v+1 before every receiver
has finished reading version v; the controller enforces this by awaiting the pull.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class WeightHandle:
    """What a receiver needs to pull one weight version.

    Attributes:
        version: the policy version (number of optimizer steps applied).
        buffer: ``monarch.rdma.RDMABuffer`` over the sender's staging bytes.
        layout: ``[(name, shape, numel)]`` in buffer order (element offsets are cumulative).
        dtype: element dtype name, e.g. ``"float32"``.
        nbytes: buffer size in bytes.
    """

    version: int
    buffer: Any
    layout: list
    dtype: str
    nbytes: int


def _params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return list(model.named_parameters())  # tied weights appear once


class FlatWeights:
    """A model's parameters packed into one flat buffer.

    ``share=True`` (receivers) re-points every parameter at a view of the buffer, so writing the
    buffer updates the model. ``share=False`` (the trainer) keeps a separate staging copy that
    :meth:`snapshot` refreshes, in ``dtype`` (the receivers' dtype, e.g. bf16 from fp32 master
    weights: the cast happens once, on the sender, and halves the bytes sent).
    """

    def __init__(self, model: torch.nn.Module, share: bool, dtype: torch.dtype | None = None):
        params = _params(model)
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) != 1:
            raise ValueError(f"weight sync needs one parameter dtype, found {dtypes}")
        self.dtype = dtypes.pop()
        if dtype is not None and dtype != self.dtype:
            if share:
                raise ValueError(f"a receiver's buffer must have its parameters' dtype {self.dtype}, not {dtype}")
            self.dtype = dtype
        self.layout = [(n, tuple(p.shape), p.numel()) for n, p in params]
        total = sum(n for *_, n in self.layout)
        self.flat = torch.empty(total, dtype=self.dtype, device=params[0][1].device)
        self.params = [p for _, p in params]
        off = 0
        for p in self.params:
            view = self.flat[off:off + p.numel()].view_as(p)
            view.copy_(p.detach())
            if share:
                p.data = view
            off += p.numel()
        self._rdma = None

    @property
    def nbytes(self) -> int:
        """Size of the buffer in bytes."""
        return self.flat.numel() * self.flat.element_size()

    def snapshot(self) -> None:
        """Copy the live parameters into the staging buffer (trainer side)."""
        off = 0
        with torch.no_grad():
            for p in self.params:
                self.flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                off += p.numel()

    def handle(self, version: int) -> WeightHandle:
        """A :class:`WeightHandle` for the buffer's current contents (registers it once)."""
        if self._rdma is None:
            from monarch.rdma import RDMABuffer

            self._rdma = RDMABuffer(self.flat.view(torch.uint8))
        return WeightHandle(version, self._rdma, self.layout, str(self.dtype).removeprefix("torch."), self.nbytes)

    async def pull(self, handle: WeightHandle) -> float:
        """Read ``handle``'s buffer into this (receiver) buffer. Returns the seconds it took.

        Raises:
            ValueError: if the sender's layout differs from this model's (names, shapes or dtype).
        """
        if handle.layout != self.layout or handle.dtype != str(self.dtype).removeprefix("torch."):
            bad = next((a, b) for a, b in zip(handle.layout + [None], self.layout + [None]) if a != b)
            raise ValueError(f"weight layout mismatch between trainer and receiver at {bad}")
        t0 = time.perf_counter()
        await handle.buffer.read_into(self.flat.view(torch.uint8))
        return time.perf_counter() - t0

    def digest(self) -> str:
        """sha256 of the live parameters' bytes cast to the buffer dtype, in layout order
        (for bitwise-equality checks between a sender and its receivers)."""
        h = hashlib.sha256()
        for p in self.params:
            h.update(p.detach().to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
