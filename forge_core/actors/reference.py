"""The reference model actor: the frozen initial policy, giving reference logprobs for the KL term.

A TorchTitan model (:mod:`forge_core.titan`) in the receivers' dtype, on CPU or GPUs; over several
GPUs (``layout.reference.gpus=n``, or sharded over the trainer's GPUs with ``0``) one actor per GPU
and FSDP2, each rank computing its ``rank::world`` share of a batch. It takes the trainer's
version-0 weights once (:meth:`Reference.load_initial`), so it equals the policy the run started
from bit for bit.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from monarch.actor import Actor, endpoint

from forge_core import titan
from forge_core.actors import init_device, setup_process
from forge_core.actors.trainer import rank_chunks
from forge_core.episode import Episode
from forge_core.weight_sync import WeightHandle, layout_views, open_ipc


class Reference(Actor):
    """Frozen copy of the initial policy.

    Args:
        model: the ``model`` config section (name, seed).
        device: ``"cpu"`` or ``"cuda"``.
        dtype: weight dtype (the generator's).
        temperature: the sampling temperature (logprobs of the tempered distribution).
        micro_batch_size: sequences per forward.
        seq_len: longest prompt + response (tokens).
        seed, threads: process seed and torch threads.
        gpus, per_node, port: as for :class:`forge_core.actors.trainer.Trainer`.
    """

    def __init__(self, model: dict, *, device: str, dtype: str, temperature: float, micro_batch_size: int,
                 seq_len: int, seed: int, threads: int, gpus: list = (), per_node: int = 0, port: int = 0):
        from monarch.actor import current_rank

        setup_process(threads, seed)
        self.world = max(len(gpus), 1)
        self.rank = current_rank().rank if self.world > 1 else 0
        self.device = init_device(device, list(gpus), per_node, self.rank, self.world, port)
        self.temperature, self.micro_batch_size = temperature, micro_batch_size
        self.spec = titan.titan_model_args(model["name"], max_seq_len=max(4096, seq_len))
        par = titan.parallelize_fn(self.spec, self.world, 1, False, seq_len) if self.world > 1 else None
        self.model = titan.build_model(self.spec, self.device, model["seed"], par, dtype=getattr(torch, dtype))
        self.model.requires_grad_(False)
        self.model.eval()
        self.select = titan.PositionSelect(self.model)
        self.version: Optional[int] = None

    @endpoint
    async def load_initial(self, handle: WeightHandle, transport: str = "ipc") -> float:
        """Load the trainer's version-0 weights over ``transport``: ``ipc`` (the trainer's host) or
        ``rdma`` (another host). Returns seconds.

        Raises:
            ValueError: the handle is not version 0.
        """
        if handle.version != 0:
            raise ValueError(f"reference model must be the initial policy (version 0), got version {handle.version}")
        t0 = time.perf_counter()
        if transport == "ipc":
            flat = open_ipc(handle)
        else:
            flat = torch.empty(handle.nbytes, dtype=torch.uint8, device=self.device)
            await handle.rdma.read_into(flat)
            flat = flat.view(getattr(torch, handle.dtype))
        titan.load_hf_state_dict(self.model, self.spec, dict(layout_views(flat, handle.layout)))
        del flat
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.version = 0
        return time.perf_counter() - t0

    @endpoint
    async def logprobs(self, episodes: list[Episode]) -> tuple[list, float]:
        """Reference logprobs of ``episodes``' responses: ``([R_i] floats per episode, or None for
        the episodes another rank computed), seconds)``; merge the ranks' lists by index."""
        t0 = time.perf_counter()
        out: list = [None] * len(episodes)
        index = {id(e): i for i, e in enumerate(episodes)}
        with torch.no_grad():
            for chunk, dummy in rank_chunks(episodes, self.rank, self.world, self.micro_batch_size):
                R = max(max(len(e.response_ids) for e in chunk), 1)
                lp = titan.response_logprobs(self.model, chunk, R, self.temperature, self.device, self.select).cpu()
                if not dummy:
                    for e, row in zip(chunk, lp):
                        out[index[id(e)]] = row[:len(e.response_ids)].tolist()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return out, time.perf_counter() - t0
