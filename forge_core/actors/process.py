"""Per-process setup of an actor: threads, seed and quiet libraries, its share of the host's CPU cores, its
device, its dtype."""

import contextlib
import os
import timeit
from typing import Callable, Optional

import torch


def setup_process(threads: int, seed: int) -> None:
    """Per-actor process setup: cap torch/OpenMP threads (the actors share the host's cores; 0:
    :class:`CoreShare` sizes them per piece of work), seed, and turn off transformers' progress bars
    (its "Loading weights" bar of each model load, from every actor at once; also the HF hub's)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    n = threads or len(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(threads or 1)
    torch.manual_seed(seed)


class CoreShare:
    """Shares this host's CPU cores among the run's actor processes that are computing right now
    (``threads_per_actor: 0``). Each busy actor holds a file ``name`` in ``path``, a directory
    (created if missing) every CPU actor of the run on this host shares; before each piece of work
    (a micro-batch, 16 decode steps) it sets its torch threads to ``cores // busy actors``, so an
    actor computing while the others wait gets every core, and two computing at once get half each.
    With a fixed count (``threads``: ``threads_per_actor`` > 0) or no ``path`` it does nothing."""

    def __init__(self, path: Optional[str], name: str, threads: int):
        self.path = path if path and threads == 0 else None
        self.mark = os.path.join(self.path, name) if self.path else ""
        self.cores = len(os.sched_getaffinity(0))
        if self.path:
            os.makedirs(self.path, exist_ok=True)

    def refresh(self) -> int:
        """Set torch's threads to this host's cores over its busy actors; returns the count."""
        if not self.path:
            return torch.get_num_threads()
        busy = 1
        with contextlib.suppress(FileNotFoundError):
            busy = max(len(os.listdir(self.path)), 1)
        n = max(self.cores // busy, 1)
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        return n

    def __enter__(self) -> "CoreShare":
        if self.path:
            open(self.mark, "w").close()
            self.refresh()
        return self

    def __exit__(self, *exc) -> None:
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.mark)


def init_device(device: str, gpus: list, per_node: int, rank: int, world: int, port: int,
                mps_priority: int = 0) -> torch.device:
    """This rank's device. On CUDA: its GPU first in ``CUDA_VISIBLE_DEVICES`` (set before CUDA
    starts; with several ranks each sees only its own GPU, as DTensor's RNG and DeviceMesh expect)
    and, with ``world > 1``, ``torch.distributed`` (NCCL) over the service's ranks, which share one
    host, rendezvous at ``127.0.0.1:port`` (a port the OS gave rank 0's host). ``mps_priority`` 1
    makes this process a below-normal priority client under CUDA MPS (``CUDA_MPS_CLIENT_PRIORITY``,
    ``trainer.mps_client_priority``). Call it before anything starts CUDA (importing TorchTitan's
    models does).

    Raises:
        RuntimeError: with ``world > 1``, CUDA had started before and sees other GPUs too.
    """
    if device != "cuda":
        return torch.device("cpu")
    from forge_core.layout import visible_devices

    os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices([gpus[rank]], per_node, only_own=world > 1)
    if mps_priority:
        os.environ["CUDA_MPS_CLIENT_PRIORITY"] = str(mps_priority)
    torch.cuda.set_device(0)
    if world > 1 and torch.cuda.device_count() != 1:  # NCCL would put several ranks on one GPU
        raise RuntimeError(f"rank {rank}: CUDA started before init_device and sees {torch.cuda.device_count()} GPUs, "
                           f"not GPU {gpus[rank]} alone")
    if world > 1:
        import torch.distributed as dist

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
    return torch.device("cuda:0")


def matmul_probe(hidden: int, rows: int = 64, reps: int = 5) -> tuple[float, float]:
    """``(bf16_s, fp32_s)``: the best of ``reps`` timings (seconds) of a ``[rows, hidden] @ [hidden,
    hidden]`` matmul in each dtype on this process's CPU threads (a few milliseconds where bf16 has
    hardware support; where it has none, AVX2-only CPUs, bf16 runs ~60x slower)."""
    def best(a: torch.Tensor, b: torch.Tensor) -> float:
        a @ b  # warm-up (oneDNN picks its kernel)
        return min(timeit.repeat(lambda: a @ b, number=1, repeat=reps))

    a, b = torch.randn(rows, hidden), torch.randn(hidden, hidden)
    return best(a.bfloat16(), b.bfloat16()), best(a, b)


def resolve_dtype(setting: str, device: str, hidden: int, who: str,
                  probe: Optional[Callable[[int], tuple[float, float]]] = None) -> torch.dtype:
    """The dtype for ``setting`` (``"bfloat16"``, ``"float32"`` or ``"auto"``). ``auto``: bf16 on
    GPUs; on a CPU, bf16 only where the probe (:func:`matmul_probe` of the model's ``hidden`` size,
    or ``probe``) finds a bf16 matmul at least as fast as fp32, and the choice and both timings are
    printed once per process, naming ``who``. An explicit setting is never overridden.

    Raises:
        ValueError: an unknown setting.
    """
    if setting != "auto":
        if setting not in ("bfloat16", "float32"):
            raise ValueError(f"dtype {setting!r} must be bfloat16, float32 or auto")
        return getattr(torch, setting)
    if device == "cuda":
        return torch.bfloat16
    if probe is None and hidden in _PROBED:
        return _PROBED[hidden]
    t16, t32 = (probe or matmul_probe)(hidden)
    dt = torch.bfloat16 if t16 <= t32 else torch.float32
    print(f"[forge] {who}: dtype auto -> {str(dt).removeprefix('torch.')} (a 64x{hidden} @ {hidden}x{hidden} "
          f"matmul: bf16 {t16 * 1e3:.2f} ms, fp32 {t32 * 1e3:.2f} ms, {torch.get_num_threads()} thread(s))", flush=True)
    if probe is None:
        _PROBED[hidden] = dt
    return dt


_PROBED: dict[int, torch.dtype] = {}  # this process's probe results, by hidden size
