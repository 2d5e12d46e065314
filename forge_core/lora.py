"""LoRA on the trainer's TorchTitan model (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
Language Models", arXiv:2106.09685): a frozen linear ``W`` [out, in] plus a trainable product,

    y = x W^T + (alpha / r) * dropout(x) A^T B^T,      A: [r, in],  B: [out, r]

with ``B`` zero at the start, so the adapted model starts as the base model (the paper, sec. 4.1).
Only ``A`` and ``B`` get gradients and AdamW state, in float32; the frozen base is held in the
trainer's compute dtype (bf16 on GPUs: 2 bytes a parameter instead of the full fine-tune's float32
master copy), and the trainer publishes the merged weight
``W + (alpha / r) * B @ A`` (:func:`merged_weight`), so generators (vLLM or transformers) load an
ordinary checkpoint through the usual weight sync, as many bytes as a full fine-tune's (an
adapter-only path, vLLM's ``LoRARequest`` with ``r (in + out)`` values a layer, moves far fewer bytes
but generated at 0.72 of the merged engine's speed on the Qwen3-8B shape: ``benchmarks/bench_lora.py``); the
reference model is the same module with its adapters switched off (:func:`adapters_off`): no second
copy of the base weights.

Why a hand-written wrapper: TorchTitan 0.2.2 has no LoRA component (its ``components`` are
checkpoint, dataloader, ft, loss, lr_scheduler, metrics, optimizer, quantization, tokenizer,
validate; the DESIGN notes say newer TorchTitan versions add one). PEFT wraps transformers modules
by their HF names, while the trainer holds TorchTitan modules (``attention.wq``, ``feed_forward.w1``,
...) under FSDP2, per-block compile and activation checkpointing. :class:`LoRALinear` is an
``nn.Linear`` subclass that keeps ``weight`` under its own name (so FSDP2, TorchTitan's state-dict
adapters and the checkpoint code see the base weight as before) and adds two parameters.

Targets use HF names (what PEFT users write): :data:`TARGETS`. ``final/adapter/`` holds the adapter
in PEFT's format (:func:`save_peft`), loadable with ``peft.PeftModel.from_pretrained``.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from forge_core.titan_spec import clean_name, hf_layout, state_dict_adapter

# HF module name -> (TorchTitan attribute path inside a block, HF parent inside a layer)
TARGETS = {"q_proj": ("attention.wq", "self_attn"), "k_proj": ("attention.wk", "self_attn"),
           "v_proj": ("attention.wv", "self_attn"), "o_proj": ("attention.wo", "self_attn"),
           "gate_proj": ("feed_forward.w1", "mlp"), "up_proj": ("feed_forward.w3", "mlp"),
           "down_proj": ("feed_forward.w2", "mlp")}
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
CHECKPOINT_FILE = "adapter.safetensors"  # a checkpoint's adapters, TorchTitan names (with the optimizer state)
PEFT_DIR = "adapter"  # final/adapter/: adapter_config.json + adapter_model.safetensors (PEFT)


@dataclass
class LoRAConfig:
    """``trainer.lora``: LoRA on the trainer (:mod:`forge_core.lora`). ``rank``: r, the adapters'
    inner dimension (0: off, the full fine-tune, today's code path); ``alpha``: the adapter output is
    scaled by ``alpha / rank`` (the paper's alpha); ``dropout``: on the adapter's input only, as
    PEFT's ``lora_dropout`` (0 keeps the trainer's logprobs deterministic, which the policy ratio
    assumes; > 0 is noise in the ratio); ``target_modules``: HF names of the adapted linear layers of
    every block (``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``; the default: all of
    them); ``save_merged``: ``final/`` also holds the merged model in HF safetensors (as a full
    fine-tune's), beside the adapter in ``final/adapter/``."""

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: List[str] = field(default_factory=lambda: list(TARGETS))
    save_merged: bool = True


def validate(cfg: Any) -> None:
    """Check ``cfg.trainer.lora`` against the rest of the run config ``cfg``.

    Raises:
        ValueError: naming the key: ``rank`` not an integer >= 0, ``alpha`` <= 0, ``dropout``
            outside [0, 1), a ``target_modules`` name that is no linear layer of the model (the
            message lists those that exist) or an empty list; with LoRA on, ``trainer.tp`` > 1
            (TorchTitan's TP plan would shard the adapters as if they were the base weights), or a
            reference placed apart from the trainer (``layout.reference.gpus`` > 0 or another
            ``layout.reference.host``): the reference is the trainer's base model.
    """
    lo = cfg.trainer.lora
    if isinstance(lo.rank, bool) or not isinstance(lo.rank, int) or lo.rank < 0:
        raise ValueError(f"trainer.lora.rank={lo.rank!r} must be an integer >= 0 (0: no LoRA)")
    if not lo.alpha > 0:
        raise ValueError(f"trainer.lora.alpha={lo.alpha} must be > 0 (the adapter is scaled by alpha / rank)")
    if not 0 <= lo.dropout < 1:
        raise ValueError(f"trainer.lora.dropout={lo.dropout} must be in [0, 1)")
    if not list(lo.target_modules):
        raise ValueError(f"trainer.lora.target_modules is empty: name some of {list(TARGETS)}")
    if bad := [m for m in lo.target_modules if m not in TARGETS]:
        raise ValueError(f"trainer.lora.target_modules: {bad[0]!r} matches no module of {cfg.model.name}; its linear "
                         f"layers are {list(TARGETS)} (HF names; the embedding and lm_head are not adapted)")
    if not lo.rank:
        return
    if cfg.trainer.tp > 1:
        raise ValueError(f"trainer.lora.rank={lo.rank} with trainer.tp={cfg.trainer.tp}: TorchTitan's TP plan shards "
                         f"every parameter of a linear layer, the adapters too; use trainer.tp=1 (FSDP2 shards them)")
    r, t = cfg.layout.reference, cfg.layout.trainer
    if (cfg.device == "cuda" and r.gpus) or r.host != t.host:
        raise ValueError(f"trainer.lora.rank={lo.rank}: the reference is the trainer's base model with its adapters "
                         f"off (no second copy), so layout.reference.gpus={r.gpus} / layout.reference.host={r.host} "
                         f"would hold nothing: set layout.reference.gpus=0 and layout.reference.host="
                         f"layout.trainer.host ({t.host})")


class LoRALinear(nn.Linear):
    """A bias-free ``nn.Linear`` (``weight`` [out, in], frozen) with a LoRA adapter: ``lora_A``
    [r, in], ``lora_B`` [out, r], output ``x W^T + scale * dropout(x) A^T B^T`` with ``scale =
    alpha / r`` (Hu et al. 2021, eq. 3 and sec. 4.1). With ``adapter_on`` false the output is
    exactly ``nn.Linear``'s. Build it with :func:`apply_lora`; the adapter's values come from
    :func:`init_adapters` (``A`` Gaussian, ``B`` zero)."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__(in_features, out_features, bias=False, device="meta")
        self.rank, self.scale = rank, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, device="meta"))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank, device="meta"))
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.adapter_on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., in] -> [..., out]."""
        y = F.linear(x, self.weight)
        if not self.adapter_on:
            return y
        return y + self.scale * F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)

    def extra_repr(self) -> str:
        """``nn.Linear``'s summary plus the rank and the scale."""
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}"


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Replace the ``cfg.target_modules`` linear layers of every block of a TorchTitan model (before
    FSDP2, compile or AC wrap it; on the meta device or materialised) by :class:`LoRALinear` s that
    keep the same ``weight`` parameter, and freeze every parameter but the adapters'. The adapters
    are float32 whatever the base's dtype (a bf16 base keeps fp32 adapters, gradients and AdamW
    state), on ``weight``'s device, uninitialised (:func:`init_adapters`). Returns the adapted
    modules' names (TorchTitan's, e.g. ``layers.0.attention.wq``).

    Raises:
        ValueError: a target names no linear layer (a model without that module), or one with a bias.
    """
    paths = [TARGETS[m][0] for m in cfg.target_modules]
    done = []
    for bname, block in model.layers.named_children():
        for path in paths:
            parent_path, _, attr = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            old = getattr(parent, attr, None)
            if not isinstance(old, nn.Linear) or isinstance(old, LoRALinear):
                raise ValueError(f"trainer.lora.target_modules: layers.{bname}.{path} is not a linear layer of this "
                                 f"model ({type(old).__name__})")
            if old.bias is not None:
                raise ValueError(f"trainer.lora.target_modules: layers.{bname}.{path} has a bias (not supported)")
            new = LoRALinear(old.in_features, old.out_features, cfg.rank, cfg.alpha, cfg.dropout)
            new.weight = old.weight
            dev = old.weight.device
            new.lora_A = nn.Parameter(torch.empty(cfg.rank, old.in_features, device=dev, dtype=torch.float32))
            new.lora_B = nn.Parameter(torch.empty(old.out_features, cfg.rank, device=dev, dtype=torch.float32))
            setattr(parent, attr, new)
            done.append(f"layers.{bname}.{path}")
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(ADAPTER_SUFFIXES))
    return done


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """``{TorchTitan module name: LoRALinear}`` of ``model`` (wrapper prefixes of compile, AC and
    FSDP removed), in module order; empty without LoRA."""

    return {clean_name(n): m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter's (``...lora_A`` / ``...lora_B``)."""
    return name.endswith(ADAPTER_SUFFIXES)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP/TP-sharded DTensor) parameter: a collective for DTensors."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _set_full(p: nn.Parameter, full: torch.Tensor) -> None:
    """Copy ``full`` (the whole tensor, any device) into parameter ``p`` (plain or DTensor: its shard)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(p, DTensor):
            src = distribute_tensor(full.to(p.device_mesh.device_type, p.dtype), p.device_mesh, p.placements)
            p.to_local().copy_(src.to_local())
        else:
            p.copy_(full.to(p.device, p.dtype))


def init_adapters(model: nn.Module, seed: int) -> None:
    """Initialise every adapter of ``model``: ``B`` zero and ``A`` Gaussian (Hu et al. 2021, sec. 4.1:
    "a random Gaussian initialization for A and zero for B, so dW = BA is zero at the beginning"),
    with standard deviation ``1 / r`` (the paper gives none; PEFT's ``init_lora_weights="gaussian"``
    uses 1 / r). Drawn on the CPU from a generator seeded with ``seed``, module by module in order,
    so every device and sharding gets the same values."""
    g = torch.Generator().manual_seed(seed)
    for m in lora_modules(model).values():
        A = torch.randn(tuple(m.lora_A.shape), generator=g, dtype=torch.float32) / m.rank
        _set_full(m.lora_A, A)
        _set_full(m.lora_B, torch.zeros(tuple(m.lora_B.shape)))


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within the block every :class:`LoRALinear` of ``model`` computes its base ``nn.Linear``
    alone: ``model`` is the base model (the reference), bit for bit."""
    mods = list(lora_modules(model).values())
    for m in mods:
        m.adapter_on = False
    try:
        yield
    finally:
        for m in mods:
            m.adapter_on = True


def merged_weight(m: LoRALinear) -> torch.Tensor:
    """The merged weight ``W + (B @ A) * scale`` [out, in] of ``m``, whole (FSDP/TP shards gathered:
    every rank must call), computed and returned in float32 whatever ``W``'s dtype (a bf16 base is
    exact in float32; the update ``B @ A`` keeps its float32 bits until the caller casts), detached.
    The order of operations is PEFT's ``merge`` (``delta = B @ A * scaling``; ``W + delta``)."""
    W, A, B = _full(m.weight), _full(m.lora_A), _full(m.lora_B)
    return W.float() + (B.float() @ A.float()) * m.scale


def num_params(hf: dict, cfg: LoRAConfig) -> int:
    """Adapter parameters of a model of HF config ``hf`` (:func:`forge_core.models.hf_config_dict`):
    ``r * (in + out)`` per adapted linear layer, from the config alone."""

    names = tuple(f".{m}.weight" for m in cfg.target_modules)
    return sum(cfg.rank * (shape[0] + shape[1]) for n, shape, _ in hf_layout(hf) if n.endswith(names))


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{TorchTitan parameter name: whole tensor on the CPU}`` of every adapter (``...wq.lora_A`` [r,
    in], ``...wq.lora_B`` [out, r]); a collective under FSDP (every rank must call)."""
    out = {}
    for name, m in lora_modules(model).items():
        out[f"{name}.lora_A"] = _full(m.lora_A).cpu().contiguous()
        out[f"{name}.lora_B"] = _full(m.lora_B).cpu().contiguous()
    return out


def load_adapter_state(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Load :func:`adapter_state`'s tensors into ``model``'s adapters.

    Raises:
        ValueError: names missing or unexpected, or a shape that differs (names the tensor).
    """
    want = {}
    for name, m in lora_modules(model).items():
        want[f"{name}.lora_A"], want[f"{name}.lora_B"] = m.lora_A, m.lora_B
    missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or unexpected:
        raise ValueError(f"LoRA adapters do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for k, p in want.items():
        if tuple(sd[k].shape) != tuple(p.shape):
            raise ValueError(f"LoRA adapter {k}: shape {tuple(sd[k].shape)} in the checkpoint, {tuple(p.shape)} here")
        _set_full(p, sd[k])


def peft_key(hf_module: str) -> str:
    """PEFT's name prefix of the adapters of HF linear layer ``hf_module`` (``model.layers.0.self_attn.q_proj``):
    ``base_model.model.<hf_module>``; its tensors are ``<prefix>.lora_A.weight`` and ``<prefix>.lora_B.weight``."""
    return f"base_model.model.{hf_module}"


def peft_state_dict(model: nn.Module, spec: Any) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's key names for the HF model (``base_model.model.model.layers.{i}
    .self_attn.q_proj.lora_A.weight`` [r, in], ``...lora_B.weight`` [out, r]), fp32 on the CPU. For
    TorchTitan's Llama 3 (``spec.family == "llama3"``) the rows of q/k ``B`` are permuted as TorchTitan's
    state-dict adapter permutes ``wq``/``wk`` into HF's rotary layout, so that HF's ``W + s B A`` is
    the TorchTitan merge permuted. A collective under FSDP (every rank must call)."""

    adapter = state_dict_adapter(spec) if spec.family == "llama3" else None
    by_path = {path: (hf, parent) for hf, (path, parent) in TARGETS.items()}
    out = {}
    for name, m in lora_modules(model).items():
        _, layer, path = name.split(".", 2)  # layers.<i>.attention.wq
        hf, parent = by_path[path]
        A, B = _full(m.lora_A).float().cpu(), _full(m.lora_B).float().cpu()
        if adapter is not None and hf in ("q_proj", "k_proj"):
            heads = spec.args.n_heads if hf == "q_proj" else (spec.args.n_kv_heads or spec.args.n_heads)
            B = adapter._permute(B, heads, B.shape[0], B.shape[1])
        key = peft_key(f"model.layers.{layer}.{parent}.{hf}")
        out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = A.contiguous(), B.contiguous()
    return out


def peft_config(cfg: LoRAConfig, base: Optional[str]) -> dict:
    """PEFT's ``adapter_config.json`` for ``cfg`` (a ``LoraConfig``: ``r``, ``lora_alpha``,
    ``lora_dropout``, ``target_modules``, causal LM; PEFT fills in its defaults for the rest);
    ``base``: the base model's HF directory or hub id (None for a random initialisation)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
            "target_modules": sorted(cfg.target_modules), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "inference_mode": True, "init_lora_weights": "gaussian", "modules_to_save": None}


def save_peft(path: str, tensors: dict[str, torch.Tensor], cfg: LoRAConfig, base: Optional[str]) -> None:
    """Write ``path/adapter_config.json`` (:func:`peft_config`) and ``path/adapter_model.safetensors``
    (``tensors``: :func:`peft_state_dict`), PEFT's adapter format: ``PeftModel.from_pretrained(base
    model, path)`` loads it."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(peft_config(cfg, base), f, indent=1)


def describe(cfg: LoRAConfig, model: nn.Module) -> str:
    """A one-line summary: rank, alpha, targets, trainable and total parameters (``model``: the
    trainer's, counted locally: per rank under FSDP)."""
    n = sum(p.numel() for p in model.parameters())
    k = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (f"LoRA rank {cfg.rank}, alpha {cfg.alpha:g} (scale {cfg.alpha / cfg.rank:g}), dropout {cfg.dropout:g} on "
            f"{','.join(cfg.target_modules)}: {k:,} trainable parameters of {n:,} ({k / max(n, 1):.2%})")


def meta(cfg: LoRAConfig) -> dict:
    """What a checkpoint records of ``cfg`` and must match on resume: rank, alpha, dropout, targets."""
    return {"rank": cfg.rank, "alpha": float(cfg.alpha), "dropout": float(cfg.dropout),
            "target_modules": sorted(cfg.target_modules)}


def resume_mismatch(saved: dict, cfg: LoRAConfig) -> list[str]:
    """The ``trainer.lora.*`` keys whose value in ``cfg`` differs from the checkpoint's ``saved``
    (:func:`meta`), as ``"key=<checkpoint's> (here <this run's>)"``."""
    now = meta(cfg)
    return [f"trainer.lora.{k}={saved.get(k)!r} (this run: {now[k]!r})" for k in now if saved.get(k) != now[k]]


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that get gradients and optimizer state, in ``parameters()`` order: all of
    them without LoRA (the full fine-tune), the adapters with it."""
    return [p for p in model.parameters() if p.requires_grad]
