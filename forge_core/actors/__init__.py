"""Monarch actors: generator, reward, reference model, trainer, replay buffer. Each runs in its own process."""

import os

import torch


def setup_process(threads: int, seed: int) -> None:
    """Per-actor process setup: cap torch/OpenMP threads (the actors share the host's cores) and seed."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
