"""The trainer actor: the policy, AdamW, gradient clipping and the configured RL loss.

One :meth:`Trainer.train_step` is one optimizer step over a batch of episodes (split into
micro-batches of ``trainer.micro_batch_size`` sequences with gradient accumulation). After it,
:meth:`Trainer.publish` snapshots the weights for the generator (:mod:`forge_core.weight_sync`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import torch
from monarch.actor import Actor, endpoint

from forge_core.actors import setup_process
from forge_core.episode import Episode, collate
from forge_core.losses import compute_loss
from forge_core.models import load_model, response_logprobs
from forge_core.weight_sync import FlatWeights, WeightHandle

_SUM_KEYS = ("train_tokens",)
_MAX_KEYS = ("ratio_max", "kl_max")
_MIN_KEYS = ("ratio_min",)


def _loss_share(aggregation: str, b, total_rows: int, total_tokens: float) -> float:
    """The weight of a micro-batch's loss in the whole batch's: its share of the tokens
    (``token_mean``), of the non-empty rows (``seq_mean``) or of all rows (``fixed_horizon``)."""
    if aggregation == "token_mean":
        return float(b.response_mask.sum()) / max(total_tokens, 1.0)
    if aggregation == "seq_mean":
        return float((b.response_mask.sum(-1) > 0).sum()) / max(total_rows, 1)
    return b.response_mask.shape[0] / max(total_rows, 1)


def _accumulate(agg: dict, m: dict, share: float) -> None:
    """Fold one micro-batch's metrics into ``agg``: sums, maxima, minima, else share-weighted means."""
    for k, v in m.items():
        v = float(v)
        if k in _SUM_KEYS:
            agg[k] = agg.get(k, 0.0) + v
        elif k in _MAX_KEYS:
            agg[k] = max(agg.get(k, -float("inf")), v)
        elif k in _MIN_KEYS:
            agg[k] = min(agg.get(k, float("inf")), v)
        else:
            agg[k] = agg.get(k, 0.0) + share * v


class Trainer(Actor):
    """Holds the policy (fp32 master weights) and its AdamW state.

    Args:
        cfg: the run's config as a plain dict.
    """

    def __init__(self, cfg: dict):
        from omegaconf import OmegaConf

        self.cfg = OmegaConf.create(cfg)
        setup_process(self.cfg.threads_per_actor, self.cfg.seed)
        self.model = load_model(self.cfg.model)
        self.model.train()
        t = self.cfg.trainer
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=tuple(t.betas),
                                     weight_decay=t.weight_decay)
        self.weights = FlatWeights(self.model, share=False, dtype=getattr(torch, self.cfg.generator.dtype))
        self.version = 0
        self.pad_id = 0
        loss = OmegaConf.to_container(self.cfg.loss)
        if loss["aggregation"] == "fixed_horizon" and loss.get("horizon") is None:
            loss["horizon"] = self.cfg.generator.max_response_tokens  # Dr. GRPO: the generation budget
        self.loss_cfg = OmegaConf.create(loss)
        self.autocast = t.compute_dtype == "bfloat16"

    @endpoint
    async def train_step(self, episodes: list[Episode]) -> dict:
        """One optimizer step on ``episodes`` (which carry advantages, behaviour and ref logprobs).

        Returns metrics: ``loss``, ``grad_norm``, ``kl_mean``, ``kl_max``, ``clip_frac`` (low + high),
        ``ratio_mean/min/max``, ``train_s`` (seconds), ``train_tokens``, ``version`` (after the step).
        Raises:
            FloatingPointError: if the loss or gradient norm is not finite (weights are not updated).
        """
        t0 = time.perf_counter()
        mb = self.cfg.trainer.micro_batch_size
        chunks = [episodes[i:i + mb] for i in range(0, len(episodes), mb)]
        total_rows = sum(1 for e in episodes if e.response_ids)
        total_tokens = float(sum(len(e.response_ids) for e in episodes))
        agg: dict[str, float] = {}
        self.opt.zero_grad(set_to_none=True)
        for chunk in chunks:
            b = collate(chunk, self.pad_id)
            share = _loss_share(self.loss_cfg.aggregation, b, total_rows, total_tokens)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                lp = response_logprobs(self.model, b.input_ids, b.attention_mask, b.prompt_len,
                                       self.cfg.generator.temperature)
            loss, m = compute_loss(self.loss_cfg, lp, b.behaviour_logprobs, b.advantages, b.response_mask,
                                   b.ref_logprobs)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"trainer: non-finite loss {loss.item()} at policy version {self.version}")
            (loss * share).backward()
            m["loss"] = loss.item()
            m["train_tokens"] = float(b.response_mask.sum())
            _accumulate(agg, m, share)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.max_grad_norm)
        if not torch.isfinite(grad_norm):
            self.opt.zero_grad(set_to_none=True)
            raise FloatingPointError(f"trainer: non-finite gradient norm at policy version {self.version}")
        self.opt.step()
        self.version += 1
        agg["clip_frac"] = agg.get("clip_frac_low", 0.0) + agg.get("clip_frac_high", 0.0)
        agg.update(grad_norm=float(grad_norm), train_s=time.perf_counter() - t0, version=self.version)
        return agg

    @endpoint
    async def publish(self) -> WeightHandle:
        """Snapshot the current weights into the staging buffer; a handle to the new version."""
        self.weights.snapshot()
        return self.weights.handle(self.version)

    @endpoint
    async def get_version(self) -> int:
        """Number of optimizer steps applied (the policy version)."""
        return self.version

    @endpoint
    async def weights_digest(self) -> str:
        """sha256 of the live weights (see :meth:`FlatWeights.digest`)."""
        return self.weights.digest()

    @endpoint
    async def state_dict(self) -> dict:
        """The live weights as ``{name: tensor}`` (for tests on small models)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @endpoint
    async def save(self, path: str, optimizer: bool = True) -> None:
        """Write the policy as HF safetensors (``save_pretrained``) into ``path``, plus
        ``optimizer.pt`` (AdamW state, torch RNG state) and ``trainer.json`` (version)."""
        os.makedirs(path, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        if optimizer:
            torch.save({"optimizer": self.opt.state_dict(), "rng": torch.get_rng_state()},
                       os.path.join(path, "optimizer.pt"))
        with open(os.path.join(path, "trainer.json"), "w") as f:
            json.dump({"version": self.version}, f)

    @endpoint
    async def load(self, path: str) -> int:
        """Restore weights, optimizer, RNG and version written by :meth:`save`. Returns the version.

        Raises:
            FileNotFoundError: naming the missing checkpoint file.
        """
        from safetensors.torch import load_file

        st = os.path.join(path, "model.safetensors")
        if not os.path.isfile(st):
            raise FileNotFoundError(f"checkpoint has no weights: {st}")
        missing, unexpected = self.model.load_state_dict(load_file(st), strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
        if missing or unexpected:
            raise ValueError(f"checkpoint {st} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        opt = torch.load(os.path.join(path, "optimizer.pt"), weights_only=False)
        self.opt.load_state_dict(opt["optimizer"])
        torch.set_rng_state(opt["rng"])
        with open(os.path.join(path, "trainer.json")) as f:
            self.version = json.load(f)["version"]
        return self.version


# ---- GPU path: TorchTitan models (device=cuda) ----------------------------------------------

def _dist_setup(gpus: list, per_node: int, rank: int, world: int, port: int) -> "torch.device":
    """Per-process CUDA setup for a GPU actor: its GPU first in ``CUDA_VISIBLE_DEVICES`` (before
    CUDA starts) and, with ``world > 1``, ``torch.distributed`` (NCCL) across the trainer's ranks."""
    from forge_core.gpu_layout import visible_devices

    # several ranks: each sees only its GPU (DTensor RNG and DeviceMesh derive devices from ranks)
    os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices([gpus[rank]], per_node if world == 1 else 0)
    torch.cuda.set_device(0)
    if world > 1:
        import torch.distributed as dist

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
    return torch.device("cuda:0")


class TitanTrainer(Actor):
    """The policy on GPUs (``device=cuda``): a TorchTitan model (:mod:`forge_core.titan`), fp32
    master weights with bf16 compute (autocast on one GPU; FSDP2 mixed precision, bf16 params and
    fp32 reductions, over several), AdamW, optional full activation checkpointing
    (``trainer.activation_checkpointing``), TP of ``trainer.tp``. Same endpoints as :class:`Trainer`.

    One actor per GPU; with several, every rank gets the whole batch, takes its ``rank::world``
    share and scales its loss by its share of the *global* token/row count (TorchTitan turns off
    FSDP's own gradient division), so the reduced gradient is the full-batch gradient. Rank 0 holds
    the published buffer (HF layout, generator dtype, on its GPU) and answers for the mesh.

    Args:
        cfg: the run's config as a plain dict.
        gpus: physical GPU indices (one per rank) on this node.
        per_node: GPUs on this node.
        port: rendezvous port for ``torch.distributed`` (several ranks).
        rdma: also register the published buffer for RDMA (a receiver on another node).
    """

    def __init__(self, cfg: dict, gpus: list, per_node: int = 0, port: int = 29511, rdma: bool = False):
        from monarch.actor import current_rank
        from omegaconf import OmegaConf

        from forge_core import titan
        from forge_core.models import _hf_source
        from forge_core.weight_sync import CudaFlatWeights

        self.cfg = OmegaConf.create(cfg)
        setup_process(max(self.cfg.threads_per_actor, 2), self.cfg.seed)
        self.world = len(gpus)
        self.rank = current_rank().rank if self.world > 1 else 0
        self.device = _dist_setup(gpus, per_node, self.rank, self.world, port)
        t = self.cfg.trainer
        g = self.cfg.generator
        self.seq_len = g.max_prompt_tokens + g.max_response_tokens
        self.spec = titan.titan_model_args(self.cfg.model.name, max_seq_len=max(4096, self.seq_len))
        par = titan.parallelize_fn(self.spec, self.world, t.tp, t.activation_checkpointing, self.seq_len, t.compile)
        self.model = titan.build_model(self.spec, self.device, self.cfg.model.seed, par)
        if self.cfg.model.init == "pretrained":
            titan.load_hf_dir(self.model, self.spec, _hf_source(self.cfg.model.name, self.cfg.model))
        self.model.train()
        self.select = titan.PositionSelect(self.model) if t.tp == 1 else None
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                                     fused=True)
        self.adapter = titan.state_dict_adapter(self.spec)
        self.out_dtype = getattr(torch, g.dtype)
        self.weights = CudaFlatWeights(titan.hf_layout(self.spec), self.out_dtype, self.device) if self.rank == 0 else None
        self.rdma = rdma
        self.version = 0
        loss = OmegaConf.to_container(self.cfg.loss)
        if loss["aggregation"] == "fixed_horizon" and loss.get("horizon") is None:
            loss["horizon"] = g.max_response_tokens
        self.loss_cfg = OmegaConf.create(loss)
        self.autocast = t.compute_dtype == "bfloat16" and self.world == 1
        self.peak_mem_gb = 0.0

    def _reduce(self, agg: dict) -> dict:
        if self.world == 1:
            return agg
        import torch.distributed as dist

        keys = sorted(agg)
        out = {}
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
        """One optimizer step (see :meth:`Trainer.train_step`); adds ``tokens_per_s`` (prompt +
        response tokens through forward and backward, all ranks), ``mfu`` and ``peak_mem_gb``."""
        from forge_core import titan

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mb = self.cfg.trainer.micro_batch_size
        total_rows = sum(1 for e in episodes if e.response_ids)
        total_tokens = float(sum(len(e.response_ids) for e in episodes))
        mine = episodes[self.rank::self.world]
        chunks = [mine[i:i + mb] for i in range(0, len(mine), mb)]
        agg: dict[str, float] = {}
        seq_tokens = 0
        self.opt.zero_grad(set_to_none=True)
        for chunk in chunks:
            b = collate(chunk, 0)
            share = _loss_share(self.loss_cfg.aggregation, b, total_rows, total_tokens)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                lp = titan.response_logprobs(self.model, chunk, b.response_mask.shape[1], self.cfg.generator.temperature,
                                             self.device, self.select)
            dev = lambda x: None if x is None else x.to(self.device, non_blocking=True)
            loss, m = compute_loss(self.loss_cfg, lp, dev(b.behaviour_logprobs), dev(b.advantages), dev(b.response_mask),
                                   dev(b.ref_logprobs))
            (loss * share).backward()
            m["loss"] = loss.item()
            if not m["loss"] == m["loss"] or abs(m["loss"]) == float("inf"):
                raise FloatingPointError(f"trainer: non-finite loss {m['loss']} at policy version {self.version}")
            m["train_tokens"] = float(b.response_mask.sum())
            seq_tokens += sum(len(e.prompt_ids) + len(e.response_ids) for e in chunk)
            _accumulate(agg, m, share)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if not torch.isfinite(grad_norm):
            self.opt.zero_grad(set_to_none=True)
            raise FloatingPointError(f"trainer: non-finite gradient norm at policy version {self.version}")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        agg["seq_tokens"] = float(seq_tokens)
        agg = self._reduce(agg)
        self.version += 1
        self.peak_mem_gb = torch.cuda.max_memory_allocated() / 1e9
        torch.cuda.empty_cache()  # colocated: hand the memory back before the generator wakes
        agg["clip_frac"] = agg.get("clip_frac_low", 0.0) + agg.get("clip_frac_high", 0.0)
        tok_s = agg["seq_tokens"] / dt
        avg_len = agg["seq_tokens"] / max(len(episodes), 1)
        peak = titan.peak_tflops(torch.cuda.get_device_name(0)) * 1e12 * self.world
        agg.update(grad_norm=float(grad_norm), train_s=dt, version=self.version, tokens_per_s=tok_s,
                   mfu=tok_s * titan.flops_per_token(self.spec, int(avg_len)) / peak if peak else 0.0,
                   peak_mem_gb=self.peak_mem_gb)
        return agg

    def _fill(self) -> None:
        from forge_core import titan

        named = titan.named_hf_tensors(self.model, self.spec, self.adapter, dtype=self.out_dtype)
        if self.rank == 0:
            self.weights.fill(named)
        else:
            for _ in named:  # the gathers are collectives: every rank iterates
                pass

    @endpoint
    async def publish(self) -> Optional[WeightHandle]:
        """Cast and gather the weights into the staging buffer (HF layout, generator dtype, on
        rank 0's GPU); rank 0 returns the handle (CUDA IPC, plus RDMA when a receiver is remote)."""
        self._fill()
        return self.weights.handle(self.version, rdma=self.rdma) if self.rank == 0 else None

    @endpoint
    async def get_version(self) -> int:
        """Number of optimizer steps applied (the policy version)."""
        return self.version

    @endpoint
    async def weights_digest(self) -> str:
        """sha256 of the live weights cast to the generator dtype, in HF layout (rank 0)."""
        self._fill()
        return self.weights.digest() if self.rank == 0 else ""

    @endpoint
    async def state_dict(self) -> dict:
        """The live fp32 weights as ``{hf_name: tensor}`` on the CPU (rank 0; for tests)."""
        from forge_core import titan

        out = {k: v.cpu().clone() for k, v in titan.named_hf_tensors(self.model, self.spec, self.adapter)}
        return out if self.rank == 0 else {}

    @endpoint
    async def memory(self) -> dict:
        """``{"allocated_gb", "reserved_gb", "peak_gb"}`` on this rank's GPU."""
        return {"allocated_gb": torch.cuda.memory_allocated() / 1e9, "reserved_gb": torch.cuda.memory_reserved() / 1e9,
                "peak_gb": torch.cuda.max_memory_allocated() / 1e9}

    @endpoint
    async def save(self, path: str, optimizer: bool = True) -> None:
        """HF safetensors (``model.safetensors`` + ``config.json``, fp32, written by rank 0),
        the optimizer state per rank (``optimizer.rank<r>.pt``) and ``trainer.json``."""
        from safetensors.torch import save_file

        from forge_core import titan
        from forge_core.models import hf_config_dict

        sd = {k: v.cpu().contiguous() for k, v in titan.named_hf_tensors(self.model, self.spec, self.adapter)}
        os.makedirs(path, exist_ok=True)
        if self.rank == 0:
            save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
            cfg = hf_config_dict(self.cfg.model.name)
            cfg["torch_dtype"] = "float32"
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(cfg, f, indent=1)
            with open(os.path.join(path, "trainer.json"), "w") as f:
                json.dump({"version": self.version, "world": self.world}, f)
        if optimizer:
            torch.save({"optimizer": self.opt.state_dict(), "rng": torch.get_rng_state(),
                        "cuda_rng": torch.cuda.get_rng_state()}, os.path.join(path, f"optimizer.rank{self.rank}.pt"))

    @endpoint
    async def load(self, path: str) -> int:
        """Restore what :meth:`save` wrote (same number of ranks). Returns the version."""
        from safetensors.torch import load_file

        from forge_core import titan

        st = os.path.join(path, "model.safetensors")
        if not os.path.isfile(st):
            raise FileNotFoundError(f"checkpoint has no weights: {st}")
        titan.load_hf_state_dict(self.model, self.spec, load_file(st))
        opt = torch.load(os.path.join(path, f"optimizer.rank{self.rank}.pt"), weights_only=False)
        self.opt.load_state_dict(opt["optimizer"])
        torch.set_rng_state(opt["rng"])
        torch.cuda.set_rng_state(opt["cuda_rng"])
        with open(os.path.join(path, "trainer.json")) as f:
            self.version = json.load(f)["version"]
        return self.version


class TitanReference(Actor):
    """The frozen initial policy on a GPU (``device=cuda``): a TorchTitan model in the generator
    dtype, taking the trainer's version-0 weights once (CUDA IPC in the node, else RDMA).
    Same endpoints as :class:`forge_core.actors.reference.Reference`."""

    def __init__(self, cfg: dict, gpus: list, per_node: int = 0):
        from omegaconf import OmegaConf

        from forge_core import titan

        self.cfg = OmegaConf.create(cfg)
        setup_process(max(self.cfg.threads_per_actor, 2), self.cfg.seed)
        self.device = _dist_setup(gpus, per_node, 0, 1, 0)
        g = self.cfg.generator
        self.spec = titan.titan_model_args(self.cfg.model.name, max_seq_len=max(4096, g.max_prompt_tokens + g.max_response_tokens))
        self.model = titan.build_model(self.spec, self.device, self.cfg.model.seed, dtype=getattr(torch, g.dtype))
        self.model.requires_grad_(False)
        self.model.eval()
        self.select = titan.PositionSelect(self.model)

    @endpoint
    async def load_initial(self, handle: WeightHandle) -> float:
        """Load the trainer's version-0 weights. Returns seconds."""
        from forge_core import titan
        from forge_core.weight_sync import layout_views, open_ipc

        if handle.version != 0:
            raise ValueError(f"reference model must be the initial policy (version 0), got version {handle.version}")
        t0 = time.perf_counter()
        if handle.same_host():
            flat = open_ipc(handle)
        else:
            flat = torch.empty(handle.nbytes, dtype=torch.uint8, device=self.device)
            await handle.buffer.read_into(flat)
            flat = flat.view(getattr(torch, handle.dtype))
        titan.load_hf_state_dict(self.model, self.spec, dict(layout_views(flat, handle.layout)))
        del flat
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    @endpoint
    async def logprobs(self, episodes: list[Episode]) -> tuple[list[Episode], float]:
        """Fill ``ref_logprobs`` (``[R_i]`` per episode); also returns the seconds spent."""
        from forge_core import titan

        t0 = time.perf_counter()
        mb = self.cfg.trainer.micro_batch_size * 2
        with torch.no_grad():
            for i in range(0, len(episodes), mb):
                chunk = episodes[i:i + mb]
                R = max(len(e.response_ids) for e in chunk)
                lp = titan.response_logprobs(self.model, chunk, max(R, 1), self.cfg.generator.temperature, self.device,
                                             self.select).cpu()
                for e, row in zip(chunk, lp):
                    e.ref_logprobs = row[:len(e.response_ids)].tolist()
        torch.cuda.empty_cache()
        return episodes, time.perf_counter() - t0
