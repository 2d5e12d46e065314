"""Monarch actors: generator, reward, reference model, trainer, replay buffer. Each runs in its own process."""

import os

import torch


def setup_process(threads: int, seed: int) -> None:
    """Per-actor process setup: cap torch/OpenMP threads (the actors share the host's cores) and seed."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)


def init_device(device: str, gpus: list, per_node: int, rank: int, world: int, port: int) -> torch.device:
    """This rank's device. On CUDA: its GPU first in ``CUDA_VISIBLE_DEVICES`` (set before CUDA
    starts; with several ranks each sees only its own GPU, as DTensor's RNG and DeviceMesh expect)
    and, with ``world > 1``, ``torch.distributed`` (NCCL) over the service's ranks, which share one
    host, rendezvous at ``127.0.0.1:port`` (a port the OS gave rank 0's host)."""
    if device != "cuda":
        return torch.device("cpu")
    from forge_core.layout import visible_devices

    os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices([gpus[rank]], per_node, only_own=world > 1)
    torch.cuda.set_device(0)
    if world > 1:
        import torch.distributed as dist

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
    return torch.device("cuda:0")
