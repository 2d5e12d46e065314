"""The trainer actor: the policy as a TorchTitan model (:mod:`forge_core.titan`) on CPU or GPUs,
AdamW, global-norm clipping and the configured RL loss; it publishes its weights for the generator.

One code path for both devices: fp32 master weights; bf16 compute by autocast on one device, by
FSDP2's mixed precision (bf16 params, fp32 reductions) over several GPUs; optional full activation
checkpointing, per-block ``torch.compile`` and TP of ``trainer.tp`` (TorchTitan's own functions).
With ``trainer.lora.rank`` > 0 (:mod:`forge_core.lora`) only the adapters train (their gradients and
AdamW state alone, in fp32), the frozen base is held in the compute dtype (bf16 on GPUs: no fp32
master copy of weights that never change, and norms whose weight matches their bf16 input, so the
fused kernels run), the published weights are the merged ones, checkpoints hold the adapters, and
the trainer also serves the reference's logprobs (:meth:`Trainer.reference_logprobs`: its base model,
adapters off), so no reference actor holds a second copy of the weights.
One actor per GPU: every rank gets the whole batch, takes its ``rank::world`` share and scales its
loss by its share of the *global* token/row count (TorchTitan turns off FSDP's own gradient
division), so the reduced gradient is the full-batch gradient. Rank 0 holds the published staging
buffer (:mod:`forge_core.weight_sync`) and answers for the mesh.

:meth:`Trainer.train_step` is one optimizer step (micro-batches with gradient accumulation); a
non-finite loss or gradient norm skips the optimizer step, leaving weights and AdamW state untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
from monarch.actor import Actor, current_rank, endpoint
from safetensors.torch import load_file, save as safetensors_bytes

from forge_core import lora as lora_mod
from forge_core import memory, titan
from forge_core.actors.process import CoreShare, init_device, resolve_dtype, setup_process
from forge_core.config import TrainerConfig, WeightSyncConfig
from forge_core.episode import Episode, collate
from forge_core.losses import LossConfig, compute_loss
from forge_core.models import ModelConfig, hf_config_dict, pretrained_dir
from forge_core.packing import pack_batch, pack_episodes, packed_response_logprobs
from forge_core.weight_sync import Sender, StagingBuffer, WeightHandle

_SUM_KEYS = ("train_tokens", "seq_tokens")
_MAX_KEYS = ("ratio_max", "kl_max", "mismatch_max", "is_ratio_max")
_MIN_KEYS = ("ratio_min",)


def loss_share(aggregation: str, response_mask: torch.Tensor, total_rows: int, total_tokens: float) -> float:
    """The weight of a micro-batch's loss in the whole batch's: its share of the response tokens
    (``token_mean``), of the non-empty rows (``seq_mean``) or of all rows (``fixed_horizon``).
    ``response_mask`` is the micro-batch's ``[B, R]`` mask."""
    if aggregation == "token_mean":
        return float(response_mask.sum()) / max(total_tokens, 1.0)
    if aggregation == "seq_mean":
        return float((response_mask.sum(-1) > 0).sum()) / max(total_rows, 1)
    return response_mask.shape[0] / max(total_rows, 1)


def accumulate(agg: dict, m: dict, share: float) -> None:
    """Fold one micro-batch's metrics into ``agg``: sums, maxima, minima, else share-weighted means."""
    for k, v in m.items():
        v = float(v)
        if k in _MAX_KEYS:
            agg[k] = max(agg.get(k, -math.inf), v)
        elif k in _MIN_KEYS:
            agg[k] = min(agg.get(k, math.inf), v)
        else:
            agg[k] = agg.get(k, 0.0) + (v if k in _SUM_KEYS else share * v)


def micro_batches(episodes: list, rank: int, world: int, size: int, budget: int = 0) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches of ``episodes`` as ``(indices, dummy)``: its ``rank::world`` share,
    packed by a token budget (``budget`` > 0, :func:`forge_core.packing.pack_episodes`) or ``size``
    sequences at a time, longest first (each micro-batch is padded to its longest row). Every rank
    gets the same number, as FSDP's collectives need: a rank with fewer runs dummy ones (the batch's
    first episode, its result unused).

    Raises:
        ValueError: an episode longer than ``budget`` (names ``trainer.tokens_per_micro_batch``).
    """
    lens = [len(e.prompt_ids) + len(e.response_ids) for e in episodes]

    def split(idx: list[int]) -> list[list[int]]:
        if budget:
            return [[idx[j] for j in b] for b in pack_episodes([lens[i] for i in idx], budget)]
        idx = sorted(idx, key=lambda i: (-lens[i], i))  # rows of similar length share a micro-batch
        return [sorted(idx[i:i + size]) for i in range(0, len(idx), size)]

    per_rank = [split(list(range(r, len(episodes), world))) for r in range(world)]
    n = max(len(p) for p in per_rank)
    return [(b, False) for b in per_rank[rank]] + [([0], True)] * (n - len(per_rank[rank]))


def logprob_lists(model, episodes: list, *, rank: int, world: int, micro_batch_size: int, budget: int,
                  temperature: float, device, chunk: int, select=None, refresh=None) -> list:
    """Response logprobs of ``episodes`` without gradients, this rank's ``rank::world`` share
    (:func:`micro_batches`): a list with ``[R_i]`` floats for each episode this rank computed and None
    for the others (merge the ranks' lists by index). ``refresh`` is called before each micro-batch
    (a :class:`~forge_core.actors.process.CoreShare`'s). Every rank runs the same number of forwards."""
    out: list = [None] * len(episodes)
    done = []  # on the device until every micro-batch is queued: one GPU sync, not one each
    with torch.no_grad():
        for idx, dummy in micro_batches(episodes, rank, world, micro_batch_size, budget):
            if refresh is not None:
                refresh()
            R = max(max(len(episodes[i].response_ids) for i in idx), 1)
            lp = logprobs_of(model, episodes, idx, R, temperature=temperature, device=device, budget=budget,
                             chunk=chunk, select=select)
            if not dummy:
                done.append((idx, lp))
        for idx, lp in done:
            for i, row in zip(idx, lp.cpu()):
                out[i] = row[:len(episodes[i].response_ids)].tolist()
    return out


def logprobs_of(model, episodes: list, idx: list[int], R: int, *, temperature: float, device, budget: int,
                chunk: int, select=None):
    """``[len(idx), R]`` float32 response logprobs of ``episodes[idx]`` (``R``: response tokens per
    row) under ``model`` at ``temperature``, computed on ``device``: packed into one row of ``budget``
    tokens with logprobs in chunks of ``chunk`` tokens (:mod:`forge_core.packing`) when ``budget`` > 0,
    else padded (:func:`forge_core.titan.response_logprobs`, positions by ``select``)."""
    chunk_eps = [episodes[i] for i in idx]
    if budget:
        return packed_response_logprobs(model, pack_batch(chunk_eps, budget).to(device), R, temperature, chunk)
    return titan.response_logprobs(model, chunk_eps, R, temperature, device, select)


class Trainer(Actor):
    """The policy and its optimizer (see the module docstring).

    Args:
        trainer: the ``trainer`` config section (lr, betas, micro_batch_size, compute_dtype, tp, ``lora``, ...).
        model: the ``model`` config section (name, path, init, seed).
        loss: the ``loss`` config section, its loss's own subclass (e.g. ``GRPOLossConfig``).
        (Each section as its dataclass: :func:`forge_core.config.to_dataclass`.)
        device: ``"cpu"`` or ``"cuda"``.
        publish_dtype: the receivers' weight dtype by default (``generator.dtype``; ``auto``:
            resolved here as a receiver on this host would; the controller passes each receiver's
            own resolved dtype to :meth:`publish`).
        temperature: the sampling temperature (logprobs are of the tempered distribution).
        max_response_tokens: the generation budget (Dr. GRPO's fixed horizon).
        seq_len: longest prompt + response (tokens).
        seed, threads: process seed and torch threads.
        gpus, per_node: physical GPU indices of this node, one per rank (CUDA); GPUs on this node.
        port: ``torch.distributed`` rendezvous port of the ranks (several GPUs).
        addr: this host's address as the generators' hosts reach it (nccl weight transfer).
        weight_sync: the ``weight_sync`` config section (bucket size, timeout; None: its defaults).
        shared_gb: GPU memory (GB) others hold on this rank's GPU (a reference sharing it, a
            sleeping colocated engine), for the activation-checkpointing estimate.
        shared_frac: fraction of this GPU's memory a colocated engine that never sleeps keeps
            (its ``gpu_memory_utilization``), for the same estimate.
        cores_dir: with ``threads`` 0, the run's :class:`~forge_core.actors.process.CoreShare` directory.
    """

    def __init__(self, trainer: TrainerConfig, model: ModelConfig, loss: LossConfig, *, device: str, publish_dtype: str,
                 temperature: float, max_response_tokens: int, seq_len: int, seed: int, threads: int, gpus: list = (),
                 per_node: int = 0, port: int = 0, addr: str = "127.0.0.1",
                 weight_sync: Optional[WeightSyncConfig] = None, shared_gb: float = 0.0, shared_frac: float = 0.0,
                 cores_dir: str = ""):
        self.t = trainer
        self.lora = trainer.lora
        setup_process(threads, seed)
        self.cores = CoreShare(cores_dir, "trainer", threads)
        self.world = max(len(gpus), 1)
        self.rank = current_rank().rank if self.world > 1 else 0
        self.device = init_device(device, list(gpus), per_node, self.rank, self.world, port,
                                  self.t.mps_client_priority)
        self.temperature = temperature
        self.model_name = model.name
        self.spec = titan.titan_model_args(model.name, max_seq_len=max(4096, seq_len))
        self.budget = int(self.t.tokens_per_micro_batch)
        hidden = self.spec.hf["hidden_size"]
        self.publish_dtype = str(resolve_dtype(publish_dtype, device, hidden, "trainer")).removeprefix("torch.")
        self.compute = resolve_dtype(self.t.compute_dtype, device, hidden, "trainer")
        self.ac = self._activation_checkpointing(seq_len, shared_gb, shared_frac)
        par = titan.parallelize_fn(self.spec, self.world, self.t.tp, self.ac, seq_len,
                                   self.t.compile) if device == "cuda" else None
        self.model = titan.build_model(self.spec, self.device, model.seed, par, packed=self.budget > 0,
                                       lora=self.lora if self.lora.rank else None,
                                       dtype=self.compute if self.lora.rank else torch.float32)  # LoRA: the frozen base
        self.model_cfg = model
        self.src = pretrained_dir(model)
        if self.src:
            titan.load_hf_dir(self.model, self.spec, self.src)
        self.model.train()
        self.select = titan.PositionSelect(self.model) if self.t.tp == 1 else None
        self.trainable = lora_mod.trainable(self.model)  # every parameter without LoRA, the adapters with it
        self.opt = torch.optim.AdamW(self.trainable, lr=self.t.lr, betas=tuple(self.t.betas),
                                     weight_decay=self.t.weight_decay, fused=device == "cuda")
        if self.lora.rank and self.rank == 0:
            print(f"[forge] trainer: {lora_mod.describe(self.lora, self.model)}", flush=True)
        self.adapter = titan.state_dict_adapter(self.spec)
        self.staging: dict[str, StagingBuffer] = {}  # per published dtype, on rank 0
        self.last_dtype = self.publish_dtype  # of the last publish (weights_digest's default)
        self.sender: Optional[Sender] = None
        ws = weight_sync or WeightSyncConfig()
        self.addr, self.sync_timeout_s = addr, float(ws.timeout_s)
        self.bucket_bytes = int(ws.bucket_mb) << 20
        self.version = 0
        if loss.aggregation == "fixed_horizon" and loss.horizon is None:
            loss = dataclasses.replace(loss, horizon=max_response_tokens)  # Dr. GRPO: the generation budget
        self.loss_cfg = loss
        self.autocast = self.compute == torch.bfloat16 and self.world == 1
        self.compile_s = self._warm_up() if self.t.compile and self.device.type == "cuda" else 0.0
        self.writer: Optional[FileWriter] = None  # a checkpoint's files being written in the background

    def _activation_checkpointing(self, seq_len: int, shared_gb: float, shared_frac: float = 0.0) -> bool:
        """``trainer.activation_checkpointing``, or when unset: on iff the memory estimate without it
        (:func:`forge_core.memory.trainer_parts`, the publish staging buffer included) exceeds 85%
        (less ``shared_frac``) of this GPU minus ``shared_gb``."""
        if self.t.activation_checkpointing is not None:
            return bool(self.t.activation_checkpointing)
        if self.device.type != "cuda":
            return False
        tokens = self.budget or self.t.micro_batch_size * seq_len
        parts = memory.trainer_parts(self.spec.hf, self.world, tokens, ac=False,
                                     trained=lora_mod.num_params(self.spec.hf, self.lora) if self.lora.rank else None,
                                     base_bytes=self.compute.itemsize, logprob_chunk=self.t.logprob_chunk,
                                     staging_bytes=getattr(torch, self.publish_dtype).itemsize if self.rank == 0 else 0)
        need = sum(v for d in parts for v in d.values()) / 1e9
        have = torch.cuda.get_device_properties(0).total_memory / 1e9 * (0.85 - shared_frac) - shared_gb
        if self.rank == 0:
            print(f"[forge] trainer: activation checkpointing {'on' if need > have else 'off'} (estimate "
                  f"{need:.0f} GB per GPU without it for {tokens} tokens per micro-batch; {have:.0f} GB usable)",
                  flush=True)
        return need > have

    def _warm_up(self) -> float:
        """Compile the blocks now, on a dummy micro-batch (forward and backward, no optimizer step,
        gradients dropped), so the first real step is not the one that pays. Returns seconds."""
        t0 = time.perf_counter()
        n = min(self.budget or 512, self.spec.args.max_seq_len)  # documents of at most the RoPE table's length
        k = max((self.budget or n) // n, 1)
        eps = [Episode(prompt_id="warm-up", group=0, target="", prompt_ids=[1] * (n // 2),
                       response_ids=[1] * (n - n // 2), behaviour_logprobs=[0.0] * (n - n // 2), text="",
                       policy_version=0)] * k
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            lp = logprobs_of(self.model, eps, list(range(k)), n - n // 2, temperature=self.temperature,
                             device=self.device, budget=self.budget, chunk=self.t.logprob_chunk, select=self.select)
        (lp.sum() * 0.0).backward()
        self.opt.zero_grad(set_to_none=True)
        self._sync()
        torch.cuda.empty_cache()  # the dummy step's activations: a colocated engine wakes into this memory
        dt = time.perf_counter() - t0
        if self.rank == 0:
            print(f"[forge] trainer: torch.compile of the blocks took {dt:.0f} s", flush=True)
        return dt

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _reduce(self, agg: dict) -> dict:
        if self.world == 1:
            return agg
        keys, out = sorted(agg), {}
        for op, names in ((dist.ReduceOp.MAX, [k for k in keys if k in _MAX_KEYS]),
                          (dist.ReduceOp.MIN, [k for k in keys if k in _MIN_KEYS]),
                          (dist.ReduceOp.SUM, [k for k in keys if k not in _MAX_KEYS and k not in _MIN_KEYS])):
            if names:
                v = torch.tensor([agg[k] for k in names], dtype=torch.float64, device=self.device)
                dist.all_reduce(v, op=op)
                out.update(zip(names, v.tolist()))
        return out

    @endpoint
    async def train_step(self, episodes: list[Episode]) -> dict:
        """One optimizer step on ``episodes`` with this host's share of the cores (:meth:`_train_step`)."""
        with self.cores:
            return self._train_step(episodes)

    def _train_step(self, episodes: list[Episode]) -> dict:
        """One optimizer step on ``episodes`` (which carry advantages, behaviour and ref logprobs).

        Every micro-batch runs forward and backward even when its loss is not finite (with FSDP the
        ranks' collectives must match); then a non-finite loss or global gradient norm skips the
        optimizer step: weights, AdamW state and the version stay as they were.

        Returns metrics: ``loss``, ``grad_norm``, ``kl_mean``, ``kl_max``, ``clip_frac`` (low + high),
        ``ratio_mean/min/max``, ``train_s`` (seconds), ``train_tokens`` (response tokens),
        ``seq_tokens`` (prompt + response tokens through forward and backward), ``tokens_per_s``,
        ``skipped`` (1.0 when the step was skipped), ``version`` (after the step); on GPUs also
        ``mfu`` (the episodes' useful FLOPs, :func:`forge_core.titan.step_flops`, over the step's
        seconds and the GPUs' datasheet peak; padding and recomputation not counted) and ``peak_mem_gb``.
        """
        self._sync()
        t0 = time.perf_counter()
        total_rows = sum(1 for e in episodes if e.response_ids)
        total_tokens = float(sum(len(e.response_ids) for e in episodes))
        b = collate(episodes, 0)  # the step's [B, R] layout: one R for every micro-batch
        R = b.response_mask.shape[1]
        agg: dict[str, float] = {}
        self.opt.zero_grad(set_to_none=True)
        dev = lambda x, idx: None if x is None else x[idx].to(self.device, non_blocking=True)
        pending = []  # per micro-batch, read after the loop: no GPU sync until every one is queued
        try:
            for idx, dummy in micro_batches(episodes, self.rank, self.world, self.t.micro_batch_size, self.budget):
                self.cores.refresh()
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    lp = logprobs_of(self.model, episodes, idx, R, temperature=self.temperature, device=self.device,
                                     budget=self.budget, chunk=self.t.logprob_chunk, select=self.select)
                if dummy:  # no contribution, but the same collectives as the other ranks
                    (lp.sum() * 0.0).backward()
                    continue
                mask = b.response_mask[idx]
                share = loss_share(self.loss_cfg.aggregation, mask, total_rows, total_tokens)
                loss, metrics = compute_loss(self.loss_cfg, lp, dev(b.behaviour_logprobs, idx),
                                             dev(b.advantages, idx), dev(b.response_mask, idx),
                                             dev(b.ref_logprobs, idx), lazy=True)
                (loss * share).backward()
                seq = sum(len(episodes[i].prompt_ids) + len(episodes[i].response_ids) for i in idx)
                pending.append((loss.detach(), metrics, share, dict(train_tokens=float(mask.sum()), seq_tokens=seq)))
        except torch.OutOfMemoryError as e:
            self.opt.zero_grad(set_to_none=True)
            size, knob = ((f"packed micro-batches of {self.budget} tokens", "tokens_per_micro_batch") if self.budget
                          else (f"{self.t.micro_batch_size} sequences per micro-batch", "micro_batch_size"))
            raise RuntimeError(f"trainer: out of GPU memory at policy version {self.version} ({size}, activation "
                               f"checkpointing {'on' if self.ac else 'off'}): lower trainer.{knob}"
                               f"{'' if self.ac else ' or set trainer.activation_checkpointing=true'}. "
                               f"{str(e).splitlines()[0][:200]}") from None
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.t.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        for loss, metrics, share, counts in pending:
            accumulate(agg, dict(metrics(), loss=loss.item(), **counts), share)
        agg = self._reduce(agg)
        skipped = not (math.isfinite(agg.get("loss", 0.0)) and bool(torch.isfinite(grad_norm)))
        if not skipped:
            self.opt.step()
            self.version += 1
        self.opt.zero_grad(set_to_none=True)
        self._sync()
        dt = time.perf_counter() - t0
        agg["clip_frac"] = agg.get("clip_frac_low", 0.0) + agg.get("clip_frac_high", 0.0)
        tok_s = agg.get("seq_tokens", 0.0) / dt
        agg.update(grad_norm=float(grad_norm), train_s=dt, version=self.version, tokens_per_s=tok_s,
                   skipped=float(skipped))
        if self.device.type == "cuda":
            peak = titan.peak_tflops(torch.cuda.get_device_name(0)) * 1e12 * self.world
            flops = titan.step_flops(self.spec, [len(e.prompt_ids) + len(e.response_ids) for e in episodes],
                                     int(total_tokens), frozen=bool(self.lora.rank))  # the useful FLOPs
            agg.update(mfu=flops / dt / peak if peak else 0.0,
                       peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9)
            torch.cuda.empty_cache()  # colocated: hand the memory back before the generator wakes
        return agg

    def _fill(self, dtype: str) -> Optional[StagingBuffer]:
        """Cast and gather the live weights into the ``dtype`` staging buffer (rank 0's; created on
        first use); every rank iterates, as the gathers are collectives."""
        named = titan.named_hf_tensors(self.model, self.spec, self.adapter, dtype=getattr(torch, dtype))
        if self.rank != 0:
            for _ in named:
                pass
            return None
        if self.sender is not None:
            self.sender.wait()  # the previous version's broadcast still reads the buffer
        if dtype not in self.staging:
            self.staging[dtype] = StagingBuffer(titan.hf_layout(self.spec.hf), getattr(torch, dtype), self.device)
        self.staging[dtype].fill(named)
        self.last_dtype = dtype
        return self.staging[dtype]

    @endpoint
    async def publish(self, rdma: bool = False, group_world: int = 0, generation: int = 0,
                      dtype: Optional[str] = None) -> Optional[WeightHandle]:
        """Cast and gather the weights into the staging buffer of ``dtype`` (the receivers' weight
        dtype; default ``generator.dtype``, resolved) in HF layout; rank 0 returns the handle:
        same-host IPC always, an RDMA buffer when ``rdma``, and with ``group_world > 1`` a broadcast
        to that many group members (this rank included) starts in the background (receivers join
        with ``WeightReceiver.fetch``)."""
        buf = self._fill(dtype or self.publish_dtype)
        if self.rank != 0:
            return None
        group = None
        if group_world > 1:
            if self.sender is None:
                self.sender = Sender(self.addr, self.sync_timeout_s)
            group = self.sender.info(group_world, generation)
            self.sender.start(buf.flat, self.bucket_bytes)
        return buf.handle(self.version, rdma=rdma, group=group)

    @endpoint
    async def compile_time(self) -> float:
        """Seconds ``torch.compile`` of the blocks took at start-up (0 without compile)."""
        return self.compile_s

    @endpoint
    async def get_version(self) -> int:
        """Number of optimizer steps applied (the policy version)."""
        return self.version

    @endpoint
    async def weights_digest(self, dtype: Optional[str] = None) -> str:
        """sha256 of the live weights cast to ``dtype`` (default: the last published one), in HF
        layout (rank 0; else ``""``)."""
        buf = self._fill(dtype or self.last_dtype)
        return buf.digest() if buf is not None else ""

    @endpoint
    async def reference_logprobs(self, episodes: list[Episode]) -> tuple[list, float]:
        """The reference's logprobs when LoRA is on (the ``reference`` service of
        :class:`forge_core.services.BaseModelReference`): this model with its adapters switched off is
        the base model, the initial policy, bit for bit (:func:`forge_core.lora.adapters_off`); computed
        as the policy's are (this trainer's compute dtype), without gradients, micro-batches as the
        reference actor's. Returns ``([R_i] floats per episode, or None for those another rank
        computed), seconds)``, as :meth:`forge_core.actors.reference.Reference.logprobs`.

        Raises:
            RuntimeError: LoRA is off (the reference is then an actor of its own).
        """
        if not self.lora.rank:
            raise RuntimeError("reference_logprobs: trainer.lora.rank=0, the reference is an actor of its own")
        t0 = time.perf_counter()
        mbs = self.t.micro_batch_size * (2 if self.device.type == "cuda" else 1)  # as the reference actor's
        with self.cores, lora_mod.adapters_off(self.model), \
                torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = logprob_lists(self.model, episodes, rank=self.rank, world=self.world, micro_batch_size=mbs,
                                budget=self.budget, temperature=self.temperature, device=self.device,
                                chunk=self.t.logprob_chunk, select=self.select, refresh=self.cores.refresh)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return out, time.perf_counter() - t0

    @endpoint
    async def state_dict(self) -> dict:
        """The live weights in float32 as ``{hf_name: tensor}`` on the CPU (rank 0; for tests); with LoRA the
        merged ones (what :meth:`publish` sends)."""
        out = {k: v.cpu().clone() for k, v in titan.named_hf_tensors(self.model, self.spec, self.adapter,
                                                                       dtype=torch.float32)}
        return out if self.rank == 0 else {}

    @endpoint
    async def save(self, path: str, optimizer: bool = True, dtype: str = "float32", background: bool = False) -> int:
        """HF safetensors (``model.safetensors`` + ``config.json``, in ``dtype``: ``float32`` or, for
        ``final/`` only, ``bfloat16`` (``checkpoint.final_dtype``), written by rank 0), the
        optimizer and RNG state per rank (``optimizer.rank<r>.pt``) and ``trainer.json`` (version).
        Returns the bytes of this rank's files.

        The files are first staged in host memory (serialised: the weights and AdamW state copied off
        the GPU), then written. With ``background`` (checkpoints, ``checkpoint.background``) a thread
        writes them while training goes on, so the caller waits only for the staging; :meth:`saved`
        says when they are on disk. Host memory: one more copy of this rank's files until then. A save
        first waits for the previous background write.

        With LoRA (``trainer.lora.rank`` > 0): a checkpoint (``optimizer``) holds the adapters
        (``adapter.safetensors``, TorchTitan names) and their optimizer state instead of the weights,
        with ``trainer.json`` naming the LoRA settings and the base model (what a resume must match; the
        base weights come from the model's source again); ``final/`` (not ``optimizer``) holds the
        adapter in PEFT's format in ``adapter/`` (:func:`forge_core.lora.save_peft`, written at once) and,
        with ``trainer.lora.save_merged``, the merged model as above.

        Raises:
            ValueError: ``dtype`` other than ``float32`` with ``optimizer`` (a checkpoint resumes exactly).
            OSError: a write without ``background`` fails (a full disk)."""
        if optimizer and dtype != "float32":
            raise ValueError(f"a checkpoint holds the float32 master weights (exact resume), not {dtype}")
        self._drop_writer()
        lora_on = bool(self.lora.rank)
        os.makedirs(path, exist_ok=True)
        files: dict = {}  # name -> bytes (or a memoryview of them)
        if not lora_on or (not optimizer and self.lora.save_merged):
            dt = getattr(torch, dtype)
            sd = {k: v.to(dt).cpu().contiguous() for k, v in titan.named_hf_tensors(self.model, self.spec, self.adapter)}
            if self.rank == 0:
                files["model.safetensors"] = safetensors_bytes(sd, metadata={"format": "pt"})
                files["config.json"] = json.dumps(dict(hf_config_dict(self.model_name), torch_dtype=dtype), indent=1)
            del sd
        info = {"version": self.version, "world": self.world}
        if lora_on:  # every rank gathers (collectives), rank 0 writes
            info.update(lora=lora_mod.meta(self.lora), base=dataclasses.asdict(self.model_cfg))
            if optimizer:
                adapters = lora_mod.adapter_state(self.model)
                if self.rank == 0:
                    files[lora_mod.CHECKPOINT_FILE] = safetensors_bytes(adapters, metadata={"format": "pt"})
            else:
                tensors = lora_mod.peft_state_dict(self.model, self.spec)
                if self.rank == 0:
                    lora_mod.save_peft(os.path.join(path, lora_mod.PEFT_DIR), tensors, self.lora, self.src)
        if self.rank == 0:
            files["trainer.json"] = json.dumps(info)
        if optimizer:
            state = {"optimizer": self.opt.state_dict(), "rng": torch.get_rng_state()}
            if self.device.type == "cuda":
                state["cuda_rng"] = torch.cuda.get_rng_state()
            staged = io.BytesIO()
            torch.save(state, staged)
            files[f"optimizer.rank{self.rank}.pt"] = staged.getbuffer()
        files = {k: v.encode() if isinstance(v, str) else v for k, v in files.items()}
        self.writer = FileWriter(path, files)
        if not background:
            self.writer, writer = None, self.writer
            writer.wait()
        return sum(len(b) for b in files.values())

    @endpoint
    async def saved(self) -> Optional[float]:
        """Whether the last background :meth:`save` is on disk: None while its thread still writes, else
        the seconds the writing took (0.0 when there was none). Raises its OSError (a full disk)."""
        if self.writer is None:
            return 0.0
        if self.writer.thread.is_alive():
            return None
        self.writer, writer = None, self.writer
        return writer.wait()

    def _drop_writer(self) -> None:
        """Wait for a background write still running; its outcome is no longer wanted (the controller
        reads it through :meth:`saved`, or gave that checkpoint up)."""
        if self.writer is not None:
            self.writer.thread.join()
            self.writer = None

    @endpoint
    async def load(self, path: str) -> int:
        """Restore what :meth:`save` wrote (same number of ranks). Returns the version.

        Raises:
            FileNotFoundError: naming the missing checkpoint file.
            ValueError: the weights do not match the model (names the keys), or the checkpoint holds
                the optimizer state of another number of ranks (or of an older version's trainer);
                a LoRA checkpoint resumed without LoRA or the reverse, other ``trainer.lora`` settings
                or another base model (each names the keys and values).
        """
        self._drop_writer()
        st, ad = os.path.join(path, "model.safetensors"), os.path.join(path, lora_mod.CHECKPOINT_FILE)
        self._check_lora_checkpoint(path, os.path.isfile(ad))
        if not os.path.isfile(ad if self.lora.rank else st):
            raise FileNotFoundError(f"checkpoint has no weights: {ad if self.lora.rank else st}")
        ranks = sum(n.startswith("optimizer.rank") for n in os.listdir(path))
        if ranks != self.world:
            raise ValueError(f"checkpoint {path} holds the optimizer state of {ranks} trainer rank(s), this trainer "
                             f"has {self.world}: resume with the layout.trainer.gpus it was saved with" if ranks else
                             f"checkpoint {path} has no optimizer.rank<r>.pt (an optimizer.pt is an older version's "
                             f"trainer): it cannot be resumed; start a new run")
        if self.lora.rank:
            lora_mod.load_adapter_state(self.model, load_file(ad))
        else:
            titan.load_hf_state_dict(self.model, self.spec, load_file(st))
        opt = torch.load(os.path.join(path, f"optimizer.rank{self.rank}.pt"), weights_only=False)
        self.opt.load_state_dict(opt["optimizer"])
        torch.set_rng_state(opt["rng"])
        if "cuda_rng" in opt:
            torch.cuda.set_rng_state(opt["cuda_rng"])
        with open(os.path.join(path, "trainer.json")) as f:
            self.version = json.load(f)["version"]
        return self.version

    def _check_lora_checkpoint(self, path: str, has_adapters: bool) -> None:
        """Raise ValueError when checkpoint ``path`` (``has_adapters``: it holds LoRA adapters) cannot
        resume this trainer: a LoRA checkpoint without LoRA or the reverse, other ``trainer.lora``
        settings (rank, alpha, dropout, target_modules) or another base model (``model.*``)."""
        r = self.lora.rank
        if has_adapters and not r:
            try:
                with open(os.path.join(path, "trainer.json")) as f:
                    saved = json.load(f).get("lora", {})
            except (OSError, ValueError):
                saved = {}
            raise ValueError(f"checkpoint {path} holds LoRA adapters (trainer.lora.rank={saved.get('rank', '?')}, "
                             f"target_modules={saved.get('target_modules', '?')}) and this run has trainer.lora.rank=0 "
                             f"(a full fine-tune): resume it with the run's own trainer.lora settings (its "
                             f"config.yaml), or start a new run (another run_id)")
        if r and not has_adapters:
            raise ValueError(f"checkpoint {path} is a full fine-tune's (model.safetensors, no "
                             f"{lora_mod.CHECKPOINT_FILE}) and this run has trainer.lora.rank={r}: resume it with "
                             f"trainer.lora.rank=0 (its config.yaml), or start a new run (another run_id)")
        if not r:
            return
        with open(os.path.join(path, "trainer.json")) as f:
            info = json.load(f)
        if bad := lora_mod.resume_mismatch(info.get("lora", {}), self.lora):
            raise ValueError(f"checkpoint {path} was trained with other LoRA settings: {'; '.join(bad)}: resume with "
                             f"the checkpoint's, or start a new run (another run_id)")
        base = info.get("base", {})
        mine = dataclasses.asdict(self.model_cfg)
        if diff := [f"model.{k}={base.get(k)!r} (this run: {v!r})" for k, v in mine.items() if base.get(k) != v]:
            raise ValueError(f"checkpoint {path} holds LoRA adapters of another base model: {'; '.join(diff)}: the "
                             f"adapters only make sense on their own base; resume with its model settings")


class FileWriter:
    """Writes ``files`` (``{name: bytes}``, staged in host memory) into the directory ``path`` in a
    thread (file writes release the GIL, so the actor's training goes on). :meth:`wait` joins it.
    A write that fails removes the files at once (a full disk gets its space back)."""

    def __init__(self, path: str, files: dict):
        self.error: Optional[BaseException] = None
        self.write_s = 0.0
        self.thread = threading.Thread(target=self._write, args=(path, files), daemon=True, name="checkpoint-writer")
        self.thread.start()

    def _write(self, path: str, files: dict) -> None:
        t0 = time.perf_counter()
        try:
            for name, data in files.items():
                with open(os.path.join(path, name), "wb") as f:
                    f.write(data)
        except BaseException as e:  # raised by wait()
            self.error = e
            for name in files:  # a full disk: its space back at once (the run's metrics lines need it)
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(path, name))
        self.write_s = time.perf_counter() - t0

    def wait(self) -> float:
        """Seconds the writing took, once done. Raises the write's error (OSError: a full disk)."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.write_s
