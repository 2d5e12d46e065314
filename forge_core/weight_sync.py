"""Versioned trainer -> generator weight transfer: one staging buffer, three transports.

The trainer's rank 0 owns a *staging buffer* (:class:`StagingBuffer`): every published tensor back to
back, in HF names and layout (what vLLM's ``load_weights`` and HF models take), in the receivers'
dtype. ``publish`` casts and copies the live (possibly FSDP-sharded) fp32 master weights into it once;
a :class:`WeightHandle` describes that version. A receiver gets the bytes by one transport, chosen
per receiver by :func:`choose_transport` (``weight_sync.transport``):

    ipc    same host: CUDA IPC of the GPU buffer, or a shared-memory file (/dev/shm) of a CPU buffer.
           The receiver loads straight from the sender's buffer; nothing is copied twice.
    nccl   other hosts: a process group of the trainer's rank 0 and one receiver per remote node
           (NCCL on GPUs: InfiniBand, RoCE, EFA through its plugin, or plain TCP sockets; gloo on
           CPU); the trainer broadcasts the buffer in ``weight_sync.bucket_mb`` slices.
    rdma   other hosts: Monarch ``RDMABuffer`` reads (ibverbs where both ends have a device, else
           Monarch's TCP fallback).

A network transport lands in the receiver's own staging buffer (:class:`Receiver`), filled by a
``WeightReceiver`` actor that lives in the generator's process while the generator keeps generating;
only the swap (a device copy of the staged bytes into the engine's weights) waits for the generator,
between two generate calls. The other replicas of that node then load from the staged buffer over
IPC, so the bytes cross the network once per node. The sender must not overwrite its buffer before
every receiver of version v has loaded it: the controller awaits the whole sync before the next publish.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import glob
import hashlib
import itertools
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

TRANSPORTS = ("ipc", "nccl", "rdma")


@dataclass
class GroupInfo:
    """Rendezvous of a weight-transfer process group: the trainer's ``addr:port`` (a TCPStore),
    ``world`` members (rank 0 = the trainer) and a generation number (a new group after a respawn)."""

    addr: str
    port: int
    world: int
    generation: int = 0


@dataclass
class WeightHandle:
    """What a receiver needs to load one weight version.

    Attributes:
        version: the policy version (optimizer steps applied).
        layout: ``[(hf_name, shape, numel)]`` in buffer order (element offsets are cumulative).
        dtype: element dtype name, e.g. ``"bfloat16"``.
        nbytes: buffer size in bytes.
        ipc: same-host access: ``("cuda", rebuild_fn, args, gpu_uuid, key)`` or ``("shm", path, key)``, key (pid, id).
        rdma: a ``monarch.rdma.RDMABuffer`` over the bytes, or None.
        group: the nccl/gloo group the sender broadcasts to, or None.
    """

    version: int
    layout: list
    dtype: str
    nbytes: int
    ipc: Any = None
    rdma: Any = None
    group: Optional[GroupInfo] = None


def choose_transport(setting: str, same_host: bool, ibverbs: bool) -> tuple[str, str]:
    """``(transport, why)`` for one receiver. ``auto``: ``ipc`` on the sender's host; across hosts
    ``rdma`` when both ends have an ibverbs device, else ``nccl``. An explicit setting wins.

    Raises:
        ValueError: ``ipc`` for a receiver on another host, or an unknown setting.
    """
    if setting == "auto":
        if same_host:
            return "ipc", "auto: same host"
        return ("rdma", "auto: other host, ibverbs on both ends") if ibverbs else (
            "nccl", "auto: other host, no ibverbs device on both ends")
    if setting not in TRANSPORTS:
        raise ValueError(f"weight_sync.transport={setting!r} must be auto or one of {TRANSPORTS}")
    if setting == "ipc" and not same_host:
        raise ValueError("weight_sync.transport=ipc cannot reach a receiver on another host")
    return setting, "weight_sync.transport"


def layout_views(flat: torch.Tensor, layout: list) -> list[tuple[str, torch.Tensor]]:
    """``[(name, view)]`` of a flat buffer laid out as ``layout`` (``[(name, shape, numel)]``)."""
    offsets = itertools.accumulate((n for *_, n in layout), initial=0)
    return [(name, flat[off:off + n].view(shape)) for (name, shape, n), off in zip(layout, offsets)]


def digest_of(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over ``(name, tensor)`` pairs' bytes in the given order (a buffer's layout order)."""
    h = hashlib.sha256()
    for _, t in named:
        h.update(t.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy().tobytes())
    return h.hexdigest()


def gpu_uuid(device: Any = None) -> str:
    """The physical identity of a CUDA device (stable across ``CUDA_VISIBLE_DEVICES`` orders)."""
    return str(torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device()).uuid)


_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
_LOCAL: dict = {}  # (pid, id) -> tensor: buffers of this process, opened by ipc without a round trip


def remove_shm_buffers(pid: int) -> None:
    """Remove the shared-memory files of the CPU staging buffers process ``pid`` of this host
    created (after the process ended: nobody maps them by name any more)."""
    for path in glob.glob(f"{_SHM_DIR}/forge-weights-{pid}-*") if _SHM_DIR else []:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class StagingBuffer:
    """Every published tensor back to back in ``layout`` order (``[(hf_name, shape, numel)]``), in
    ``dtype`` on ``device``, ``nbytes`` bytes; CPU buffers live in a shared-memory file so that
    processes of the same host can map them."""

    def __init__(self, layout: list, dtype: torch.dtype, device: Any):
        self.layout = [(n, tuple(s), int(k)) for n, s, k in layout]
        self.dtype = dtype
        total = sum(k for *_, k in self.layout)
        self.nbytes = total * torch.empty((), dtype=dtype).element_size()
        self.path = None
        if torch.device(device).type == "cpu" and _SHM_DIR:
            self.path = os.path.join(_SHM_DIR, f"forge-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            self.flat = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8).view(dtype)
        else:
            self.flat = torch.empty(total, dtype=dtype, device=device)
        self.views = dict(layout_views(self.flat, self.layout))
        self.key = (os.getpid(), uuid.uuid4().hex)
        _LOCAL[self.key] = self.flat
        self._rdma = self._ipc = None

    def fill(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(hf_name, tensor)`` pairs into the buffer (casting); every layout name must come.

        Raises:
            ValueError: an unknown name, a shape mismatch or a missing name.
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
        if missing := [n for n, *_ in self.layout if n not in seen]:
            raise ValueError(f"weight sync: tensors missing from the published weights: {missing[:3]}")
        if self.flat.is_cuda:
            torch.cuda.synchronize(self.flat.device)

    def handle(self, version: int, rdma: bool = False, group: Optional[GroupInfo] = None) -> WeightHandle:
        """A :class:`WeightHandle` of the current contents: same-host IPC always, an RDMA buffer when
        ``rdma`` (registered once), the broadcast group when given."""
        if self._ipc is None:
            if self.flat.is_cuda:
                from torch.multiprocessing.reductions import reduce_tensor

                fn, args = reduce_tensor(self.flat)
                self._ipc = ("cuda", fn, tuple(args), gpu_uuid(self.flat.device), self.key)
            else:
                self._ipc = ("shm", self.path, self.key)
        if rdma and self._rdma is None:
            from monarch.rdma import RDMABuffer

            self._rdma = RDMABuffer(self.flat.view(torch.uint8))
        return WeightHandle(version, self.layout, str(self.dtype).removeprefix("torch."), self.nbytes, self._ipc,
                            self._rdma if rdma else None, group)

    def digest(self) -> str:
        """sha256 of the buffer's bytes (layout order)."""
        return hashlib.sha256(self.flat.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()

    def close(self) -> None:
        """Release the buffer (removes the shared-memory file)."""
        _LOCAL.pop(self.key, None)
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)


def open_ipc(handle: WeightHandle) -> torch.Tensor:
    """The sender's bytes of ``handle`` in this process, as a flat tensor of its dtype: the same
    tensor in the sender's own process, an opened CUDA IPC handle (device index remapped by GPU UUID,
    so processes may order ``CUDA_VISIBLE_DEVICES`` freely) or a mapped shared-memory file.

    Raises:
        RuntimeError: the sender's GPU is not visible here, or its shared-memory file is gone.
    """
    if handle.ipc[-1] in _LOCAL:
        return _LOCAL[handle.ipc[-1]]
    dtype = getattr(torch, handle.dtype)
    if handle.ipc[0] == "shm":
        path = handle.ipc[1]
        if not os.path.exists(path):
            raise RuntimeError(f"weight sync: the sender's shared-memory buffer {path} is gone (sender died?)")
        return torch.from_file(path, shared=True, size=handle.nbytes, dtype=torch.uint8).view(dtype)
    _, fn, args, uuid_, _ = handle.ipc
    local = next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == uuid_), None)
    if local is None:
        raise RuntimeError(f"weight sync: the sender's GPU {uuid_} is not visible in this process "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
    return fn(*args[:6], local, *args[7:])  # args[6]: the storage device


def ipc_buckets(layout: list, bucket_elems: int) -> list[tuple[int, int, list]]:
    """Split ``layout`` into consecutive buckets of at most ``bucket_elems`` elements (a tensor
    larger than that gets a bucket of its own): ``[(start, end, entries)]`` in element offsets."""
    out, off = [], 0  # [start, end, entries] of each bucket
    for entry in layout:
        if not out or off + entry[2] - out[-1][0] > bucket_elems:
            out.append([off, off, []])
        off += entry[2]
        out[-1][1] = off
        out[-1][2].append(entry)
    return [tuple(b) for b in out]


def load_into_model(model: torch.nn.Module, handle: WeightHandle, bucket_bytes: int = 1 << 30,
                    device: Optional[torch.device] = None) -> dict:
    """Load ``handle``'s weights (HF names) into a vLLM model through its ``load_weights``.

    Same GPU: the views of the source buffer go straight to ``load_weights`` (one device copy per
    tensor, done by vLLM's weight loaders, which also fuse q/k/v and gate/up and shard for TP).
    Another GPU of the node: buckets of ``bucket_bytes`` are copied device to device into a local
    buffer (two, alternating, so the next copy overlaps this bucket's load), then loaded.
    Runs inside the vLLM worker(s) (``LLM.apply_model``); returns ``{"mode", "buckets"}``.
    """
    remote = open_ipc(handle)
    dev = device or next(model.parameters()).device  # a model being reloaded layer by layer sits on meta
    torch.cuda.synchronize(dev)
    if remote.device == dev:
        model.load_weights(layout_views(remote, handle.layout))
        torch.cuda.synchronize(dev)
        return {"mode": "same_gpu", "buckets": 1}
    buckets = ipc_buckets(handle.layout, max(bucket_bytes // remote.element_size(), 1))
    biggest = max(e - s for s, e, _ in buckets)
    local = [torch.empty(biggest, dtype=remote.dtype, device=dev) for _ in range(2)]
    side = torch.cuda.Stream(dev)

    def copy(i: int) -> Any:  # bucket i into local[i % 2] on the side stream
        s, e, _ = buckets[i]
        with torch.cuda.stream(side):
            local[i % 2][:e - s].copy_(remote[s:e], non_blocking=True)
        return side.record_event()
    ev = copy(0)
    for i, (s, e, entries) in enumerate(buckets):
        torch.cuda.current_stream(dev).wait_event(ev)
        if i + 1 < len(buckets):
            side.wait_stream(torch.cuda.current_stream(dev))
            ev = copy(i + 1)
        model.load_weights(layout_views(local[i % 2][:e - s], entries))
    torch.cuda.synchronize(dev)
    return {"mode": "peer_gpu", "buckets": len(buckets)}


# ---- process groups (nccl transport) -------------------------------------------------------

_GROUPS: dict = {}  # (addr, port, generation, rank) -> process group


def group(info: GroupInfo, rank: int, timeout_s: float, cuda: bool, store: Any = None) -> Any:
    """This process's member ``rank`` of the weight-transfer group ``info`` (created once; NCCL
    for ``cuda`` buffers, gloo for CPU ones), without touching ``torch.distributed``'s default
    group (the trainer's FSDP group may exist alongside). Blocks until every member joined.

    Raises:
        TimeoutError: the group did not form within ``timeout_s``, naming the rendezvous address.
    """
    import torch.distributed as dist

    key = (info.addr, info.port, info.generation, rank)
    if key in _GROUPS:
        return _GROUPS[key]
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(info.addr, info.port, info.world, False, timeout=timeout)
        store = dist.PrefixStore(f"forge-weights-{info.generation}", store)
        if cuda:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, info.world, opts)
        else:
            pg = dist.ProcessGroupGloo(store, rank, info.world, timeout)
    except Exception as e:  # torch raises DistStoreError / RuntimeError on timeouts
        raise TimeoutError(f"weight sync (nccl): member {rank}/{info.world} could not form the group at "
                           f"{info.addr}:{info.port} within {timeout_s:g} s: {str(e)[:300]}") from None
    _GROUPS[key] = pg
    return pg


def broadcast(pg: Any, flat: torch.Tensor, bucket_bytes: int) -> None:
    """Broadcast ``flat`` from rank 0 to every member in slices of ``bucket_bytes`` (in place on
    receivers); on CUDA on a side stream, so the caller's stream is not held; returns when done."""
    raw = flat.view(torch.uint8)
    stream = torch.cuda.Stream(raw.device) if raw.is_cuda else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        works = [pg.broadcast(raw[i:i + bucket_bytes], 0) for i in range(0, raw.numel(), bucket_bytes)]
        for w in works:
            w.wait()
    if stream is not None:
        stream.synchronize()


class Sender:
    """The trainer rank 0's side of the nccl transport: hosts the group's TCPStore (port from the
    OS; ``addr``: an address of this host that every receiver can reach) and broadcasts each published
    version in a background thread, so training goes on. ``timeout_s``: group formation and transfer
    timeout (seconds)."""

    def __init__(self, addr: str, timeout_s: float):
        import torch.distributed as dist

        self.timeout_s = timeout_s
        self.store = dist.TCPStore("0.0.0.0", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.group_info = GroupInfo(addr, self.store.port, 1)
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    def info(self, world: int, generation: int) -> GroupInfo:
        """The group to broadcast to: ``world`` members including this sender."""
        self.group_info = GroupInfo(self.group_info.addr, self.store.port, world, generation)
        return self.group_info

    def start(self, flat: torch.Tensor, bucket_bytes: int) -> None:
        """Broadcast ``flat`` in the background (joins the previous broadcast first)."""
        self.wait()
        info = self.group_info

        def run():
            try:
                broadcast(group(info, 0, self.timeout_s, flat.is_cuda, self.store), flat, bucket_bytes)
            except BaseException as e:  # reported by wait()
                self.error = e

        self.thread = threading.Thread(target=run, name="forge-weight-send", daemon=True)
        self.thread.start()

    def wait(self) -> Optional[BaseException]:
        """Join the running broadcast; returns what it raised, or None. A failed broadcast (a receiver
        died; the controller respawns it and publishes to a new group) does not fail the sender."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        e, self.error = self.error, None
        return e


class Receiver:
    """A receiver's own staging buffer for the network transports (nccl, rdma) on ``device`` (the
    engine's GPU, or CPU), registered in :data:`RECEIVERS` under ``name`` (the generator replica's) so
    that the generator actor of the same process can load from it."""

    def __init__(self, name: str, device: Any):
        self.name, self.device = name, device
        self.buf: Optional[StagingBuffer] = None
        self.version = -1
        RECEIVERS[name] = self

    async def fetch(self, handle: WeightHandle, transport: str, rank: int, timeout_s: float, bucket_bytes: int) -> dict:
        """Fill the staging buffer with ``handle``'s bytes over ``transport`` (``nccl``: as member
        ``rank`` of the handle's group; ``rdma``: an RDMA read). Returns ``{"transfer_s", "gb_s"}``.

        Raises:
            TimeoutError / RuntimeError: the group did not form or the transfer failed, naming the ends.
        """
        dtype = getattr(torch, handle.dtype)
        if self.buf is None or self.buf.layout != [(n, tuple(s), int(k)) for n, s, k in handle.layout] \
                or self.buf.dtype != dtype:
            self.buf = StagingBuffer(handle.layout, dtype, self.device)
        t0 = time.perf_counter()
        if transport == "nccl":
            pg = await asyncio.to_thread(group, handle.group, rank, timeout_s, self.buf.flat.is_cuda)
            await asyncio.to_thread(broadcast, pg, self.buf.flat, bucket_bytes)
        elif transport == "rdma":
            if handle.rdma is None:
                raise RuntimeError("weight sync (rdma): the trainer published no RDMA buffer")
            await handle.rdma.read_into(self.buf.flat.view(torch.uint8))
        else:
            raise ValueError(f"Receiver.fetch: {transport!r} is not a network transport")
        dt = time.perf_counter() - t0
        self.version = handle.version
        return {"transfer_s": dt, "gb_s": handle.nbytes / max(dt, 1e-9) / 1e9}

    def handle(self, version: int) -> WeightHandle:
        """A same-host handle of the staged bytes (for loading, here and by the node's other replicas)."""
        if self.buf is None or self.version != version:
            raise RuntimeError(f"weight sync: {self.name} has not staged version {version} (holds {self.version})")
        return self.buf.handle(version)


RECEIVERS: dict[str, Receiver] = {}
