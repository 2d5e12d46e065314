"""Versioned trainer -> generator weight transfer: Monarch ``RDMABuffer`` across nodes, CUDA IPC
within one GPU node.

The trainer owns one contiguous *staging* buffer holding every parameter back to back
(:class:`FlatWeights`). ``publish`` copies the live parameters into it (one memcpy) and hands out a
:class:`WeightHandle`: the version, the buffer wrapped in ``monarch.rdma.RDMABuffer`` (registered
once; ibverbs where the hardware has it, Monarch's TCP fallback elsewhere) and the layout.
A receiver keeps its own parameters as views into a flat buffer of the same layout, so
``await handle.buffer.read_into(flat)`` writes the new weights straight into the model: no
per-tensor copies, no pickling. The sender must not publish version v+1 before every receiver
has finished reading version v; the controller enforces this by awaiting the pull.

Within one node (the GPU path) the trainer's staging buffer lives on its GPU, in HF names and
layout, in the generator's dtype (:class:`CudaFlatWeights`). Its handle also carries a CUDA IPC
handle of that buffer (:func:`ipc_handle`), the host name and the GPU's UUID. A receiver on the
same host opens it (:func:`open_ipc`: no host round trip, no copy when it shares the GPU, a
device-to-device copy over NVLink/PCIe in buckets otherwise, see :func:`ipc_buckets`); a receiver
on another host reads the same bytes through the RDMA buffer.

``FORGE_WEIGHT_SYNC=rdma`` in the environment makes every receiver take the cross-host path (RDMA
buffer) even on the sender's host, so one GPU node measures what a multi-node layout will pay
(``make bench`` with it set; see recipes/llama3_8b/README.md).
"""

from __future__ import annotations

import hashlib
import os
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
    ipc: Any = None  # (rebuild_fn, args) of torch's CUDA IPC reduction; None on CPU
    host: str = ""  # the sender's hostname (IPC only works on the same host)
    gpu_uuid: str = ""  # the sender's GPU (physical), to map the IPC device index in the receiver

    def same_host(self) -> bool:
        """True when this process runs on the sender's host (CUDA IPC usable) and
        ``FORGE_WEIGHT_SYNC=rdma`` does not force the cross-host path."""
        import socket

        return bool(self.ipc) and self.host == socket.gethostname() and not force_rdma()


def force_rdma() -> bool:
    """``FORGE_WEIGHT_SYNC=rdma``: receivers on the sender's host use the RDMA buffer too."""
    return os.environ.get("FORGE_WEIGHT_SYNC", "auto") == "rdma"


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


# ---- in-node CUDA transport ------------------------------------------------------------------

def gpu_uuid(device: torch.device | int | None = None) -> str:
    """The physical identity of a CUDA device (stable across ``CUDA_VISIBLE_DEVICES`` orders)."""
    return str(torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device()).uuid)


def ipc_handle(t: torch.Tensor) -> tuple:
    """A picklable CUDA IPC handle of ``t`` (``torch.multiprocessing``'s reduction). The sender
    must keep ``t`` alive and unchanged while receivers read it."""
    from torch.multiprocessing.reductions import reduce_tensor

    fn, args = reduce_tensor(t)
    return fn, tuple(args)


def open_ipc(handle: "WeightHandle") -> torch.Tensor:
    """Open ``handle``'s CUDA IPC buffer in this process: a tensor aliasing the sender's GPU memory.

    The device index in torch's handle is the sender's; it is replaced by this process's index of
    the same physical GPU (found by UUID), so actors may order ``CUDA_VISIBLE_DEVICES`` freely.
    Raises:
        RuntimeError: if the sender's GPU is not visible here.
    """
    fn, args = handle.ipc
    args = list(args)
    local = None
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == handle.gpu_uuid:
            local = i
            break
    if local is None:
        raise RuntimeError(f"weight sync: the trainer's GPU {handle.gpu_uuid} is not visible in this process "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
    args[6] = local  # storage_device
    return fn(*args)


def layout_views(flat: torch.Tensor, layout: list) -> list[tuple[str, torch.Tensor]]:
    """``[(name, view)]`` of a flat buffer laid out as ``layout`` (``[(name, shape, numel)]``)."""
    out, off = [], 0
    for name, shape, n in layout:
        out.append((name, flat[off:off + n].view(shape)))
        off += n
    return out


def ipc_buckets(layout: list, bucket_elems: int) -> list[tuple[int, int, list]]:
    """Split ``layout`` into consecutive buckets of at most ``bucket_elems`` elements (a tensor
    larger than that gets a bucket of its own): ``[(start, end, entries)]`` in element offsets."""
    out, start, cur, entries = [], 0, 0, []
    for entry in layout:
        n = entry[2]
        if entries and cur - start + n > bucket_elems:
            out.append((start, cur, entries))
            start, entries = cur, []
        entries.append(entry)
        cur += n
    if entries:
        out.append((start, cur, entries))
    return out


def load_from_ipc(model: torch.nn.Module, handle: "WeightHandle", bucket_bytes: int = 1 << 30) -> dict:
    """Load ``handle``'s weights (HF names) into a vLLM model through its ``load_weights``.

    Same GPU: the views of the trainer's buffer go straight to ``load_weights`` (one device copy
    per tensor, done by vLLM's weight loaders, which also fuse q/k/v and gate/up). Another GPU of
    the node: buckets of ``bucket_bytes`` are copied device to device into a local staging buffer
    (two, alternating, so the next copy overlaps this bucket's load), then loaded.
    Runs inside the vLLM worker (``LLM.apply_model``); returns ``{"mode", "buckets"}``.
    """
    remote = open_ipc(handle)
    dev = next(model.parameters()).device
    torch.cuda.synchronize(dev)
    if remote.device == dev:
        model.load_weights(layout_views(remote, handle.layout))
        torch.cuda.synchronize(dev)
        return {"mode": "ipc_same_gpu", "buckets": 1}
    elem = remote.element_size()
    buckets = ipc_buckets(handle.layout, max(bucket_bytes // elem, 1))
    biggest = max(e - s for s, e, _ in buckets)
    staging = [torch.empty(biggest, dtype=remote.dtype, device=dev) for _ in range(2)]
    copy_stream = torch.cuda.Stream(dev)
    s0, e0, _ = buckets[0]
    with torch.cuda.stream(copy_stream):
        staging[0][:e0 - s0].copy_(remote[s0:e0], non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(copy_stream)
    for i, (s, e, entries) in enumerate(buckets):
        torch.cuda.current_stream(dev).wait_event(ev)
        if i + 1 < len(buckets):
            s2, e2, _ = buckets[i + 1]
            copy_stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(copy_stream):
                staging[(i + 1) % 2][:e2 - s2].copy_(remote[s2:e2], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(copy_stream)
        model.load_weights(layout_views(staging[i % 2][:e - s], entries))
    torch.cuda.synchronize(dev)
    return {"mode": "ipc_peer_gpu", "buckets": len(buckets)}


class CudaFlatWeights:
    """The GPU trainer's staging buffer: every published tensor back to back, in HF names and
    layout, in the generator's dtype, on the trainer's GPU (see the module docstring).

    Args:
        layout: ``[(hf_name, shape, numel)]`` (see :func:`forge_core.titan.hf_layout`).
        dtype: the receivers' dtype.
        device: the trainer's GPU.
    """

    def __init__(self, layout: list, dtype: torch.dtype, device: torch.device):
        self.layout = [(n, tuple(s), int(k)) for n, s, k in layout]
        self.dtype = dtype
        self.flat = torch.empty(sum(k for *_, k in self.layout), dtype=dtype, device=device)
        self.views = dict(layout_views(self.flat, self.layout))
        self._rdma = None
        self._ipc = None

    @property
    def nbytes(self) -> int:
        """Size of the buffer in bytes."""
        return self.flat.numel() * self.flat.element_size()

    def fill(self, named: "Any") -> None:
        """Copy ``(hf_name, tensor)`` pairs into the buffer (casting); every layout name must come.

        Raises:
            ValueError: on an unknown name, a shape mismatch or a missing name.
        """
        seen = set()
        with torch.no_grad():
            for name, t in named:
                v = self.views.get(name)
                if v is None or tuple(v.shape) != tuple(t.shape):
                    raise ValueError(f"weight sync: {name} {tuple(t.shape)} does not match the layout "
                                     f"({None if v is None else tuple(v.shape)})")
                v.copy_(t)
                seen.add(name)
        missing = [n for n, *_ in self.layout if n not in seen]
        if missing:
            raise ValueError(f"weight sync: tensors missing from the published weights: {missing[:3]}")
        torch.cuda.synchronize(self.flat.device)

    def handle(self, version: int, rdma: bool = False) -> WeightHandle:
        """A handle carrying the CUDA IPC handle (and an RDMA buffer when ``rdma``, for receivers
        on other hosts; registered once)."""
        import socket

        if rdma and self._rdma is None:
            from monarch.rdma import RDMABuffer

            self._rdma = RDMABuffer(self.flat.view(torch.uint8))
        if self._ipc is None:
            self._ipc = ipc_handle(self.flat)
        return WeightHandle(version, self._rdma if rdma else None, self.layout, str(self.dtype).removeprefix("torch."),
                            self.nbytes, ipc=self._ipc, host=socket.gethostname(), gpu_uuid=gpu_uuid(self.flat.device))

    def digest(self) -> str:
        """sha256 of the buffer's bytes (layout order), as :meth:`FlatWeights.digest` computes it."""
        return hashlib.sha256(self.flat.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def digest_of(named: "Any") -> str:
    """sha256 over ``(name, tensor)`` pairs' bytes in the given order (the layout's)."""
    h = hashlib.sha256()
    for _, t in named:
        h.update(t.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy().tobytes())
    return h.hexdigest()
