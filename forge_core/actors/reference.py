"""The reference model actor: the frozen initial policy, giving reference logprobs for the KL term.

A TorchTitan model (:mod:`forge_core.titan`) in the receivers' dtype, on CPU or GPUs; over several
GPUs (``layout.reference.gpus=n``, or sharded over the trainer's GPUs with ``0``) one actor per GPU
and FSDP2, each rank computing its ``rank::world`` share of a batch. It takes the trainer's
version-0 weights once (:meth:`Reference.load_initial`), so it equals the policy the run started
from bit for bit. With LoRA on the trainer (``trainer.lora.rank`` > 0) there is no reference actor:
the trainer's base model, adapters off, serves the same endpoint
(:meth:`forge_core.actors.trainer.Trainer.reference_logprobs`).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from monarch.actor import Actor, current_rank, endpoint

from forge_core import titan
from forge_core.actors.process import CoreShare, init_device, resolve_dtype, setup_process
from forge_core.actors.trainer import logprob_lists
from forge_core.episode import Episode
from forge_core.models import ModelConfig, pretrained_dir
from forge_core.weight_sync import WeightHandle, digest_of, layout_views, open_ipc


class Reference(Actor):
    """Frozen copy of the initial policy.

    Args:
        model: the ``model`` config section (name, path, init, seed).
        device: ``"cpu"`` or ``"cuda"``.
        dtype: weight dtype (``generator.dtype``; ``auto``: bf16 on GPUs, the faster of bf16 and
            fp32 on this CPU, see :func:`forge_core.actors.process.resolve_dtype`).
        micro_batch_size: sequences per forward (not packing).
        tokens_per_micro_batch: packing budget (tokens per forward; 0: no packing).
        logprob_chunk: response positions per block of the chunked logprobs.
        compile: ``torch.compile`` each block (GPU).
        temperature, seq_len, seed, threads, gpus, per_node, port, cores_dir: as for
            :class:`forge_core.actors.trainer.Trainer`.
        mps_priority: ``trainer.mps_client_priority`` (1: below normal under CUDA MPS).
    """

    def __init__(self, model: ModelConfig, *, device: str, dtype: str, temperature: float, micro_batch_size: int,
                 seq_len: int, seed: int, threads: int, gpus: list = (), per_node: int = 0, port: int = 0,
                 tokens_per_micro_batch: int = 0, logprob_chunk: int = 1024, compile: bool = False,
                 cores_dir: str = "", mps_priority: int = 0):
        setup_process(threads, seed)
        self.cores = CoreShare(cores_dir, "reference", threads)
        self.world = max(len(gpus), 1)
        self.rank = current_rank().rank if self.world > 1 else 0
        # first: importing TorchTitan's models starts CUDA, which then ignores CUDA_VISIBLE_DEVICES
        self.device = init_device(device, list(gpus), per_node, self.rank, self.world, port, mps_priority)
        self.spec = titan.titan_model_args(model.name, max_seq_len=max(4096, seq_len))
        self.model_cfg = model
        self.dtype = resolve_dtype(dtype, device, self.spec.hf["hidden_size"], "reference")
        self.temperature, self.micro_batch_size = temperature, micro_batch_size
        self.budget, self.chunk = tokens_per_micro_batch, logprob_chunk
        par = titan.parallelize_fn(self.spec, self.world, 1, False, seq_len, compile and device == "cuda")  # or None
        self.model = titan.build_model(self.spec, self.device, model.seed, par, dtype=self.dtype,
                                       packed=self.budget > 0)
        self.model.requires_grad_(False)
        self.model.eval()
        self.select = titan.PositionSelect(self.model)
        self.version: Optional[int] = None

    @endpoint
    async def load_initial(self, handle: WeightHandle, transport: str = "ipc") -> float:
        """Load the trainer's version-0 weights over ``transport``: ``ipc`` (the trainer's host) or
        ``rdma`` (another host). Returns seconds. Sharded over several GPUs, rank 0 (on the trainer's
        rank-0 GPU when sharded over the trainer's GPUs) reads the weights and scatters each
        parameter's shards to the others, which read nothing.

        Raises:
            ValueError: the handle is not version 0.
        """
        if handle.version != 0:
            raise ValueError(f"reference model must be the initial policy (version 0), got version {handle.version}")
        t0 = time.perf_counter()
        dtype = getattr(torch, handle.dtype)
        if self.rank != 0:
            # Sharded over several GPUs: each parameter is scattered from rank 0's copy (see
            # titan.load_hf_state_dict), so the other ranks need only its shape, and they could not
            # open the trainer's buffer anyway (each rank sees its own GPU alone).
            flat = torch.empty(handle.nbytes // dtype.itemsize, dtype=dtype, device="meta")
        elif transport == "ipc":
            flat = open_ipc(handle)
        else:
            flat = torch.empty(handle.nbytes, dtype=torch.uint8, device=self.device)
            await handle.rdma.read_into(flat)
            flat = flat.view(dtype)
        titan.load_hf_state_dict(self.model, self.spec, dict(layout_views(flat, handle.layout)))
        del flat
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.version = 0
        return time.perf_counter() - t0

    @endpoint
    async def get_dtype(self) -> str:
        """The weight dtype: what the trainer publishes for :meth:`load_initial`."""
        return str(self.dtype).removeprefix("torch.")

    @endpoint
    async def digest(self) -> str:
        """sha256 of the weights in HF layout (rank 0 of a sharded reference gathers them)."""
        return digest_of(titan.named_hf_tensors(self.model, self.spec))

    @endpoint
    async def rebuild_initial(self) -> str:
        """Rebuild the initial policy from its source, as the trainer built it (a respawned
        reference, while the trainer has moved on): the pretrained weights cast to this dtype, or
        the same seeded random init in fp32, cast. Returns :meth:`digest`; the caller compares it
        with the digest of the original version 0 (a sharded random init is not reproduced)."""
        src = pretrained_dir(self.model_cfg)
        if src:
            titan.load_hf_dir(self.model, self.spec, src)
        else:
            fp32 = titan.build_model(self.spec, self.device, self.model_cfg.seed)
            titan.load_hf_state_dict(self.model, self.spec,
                                     dict(titan.named_hf_tensors(fp32, self.spec, dtype=self.dtype)))
            del fp32
        self.version = 0
        return digest_of(titan.named_hf_tensors(self.model, self.spec))

    @endpoint
    async def logprobs(self, episodes: list[Episode]) -> tuple[list, float]:
        """Reference logprobs of ``episodes``' responses: ``([R_i] floats per episode, or None for
        the episodes another rank computed), seconds)``; merge the ranks' lists by index."""
        t0 = time.perf_counter()
        with self.cores:
            out = logprob_lists(self.model, episodes, rank=self.rank, world=self.world,
                                micro_batch_size=self.micro_batch_size, budget=self.budget,
                                temperature=self.temperature, device=self.device, chunk=self.chunk,
                                select=self.select, refresh=self.cores.refresh)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return out, time.perf_counter() - t0
