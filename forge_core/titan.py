"""TorchTitan models for the GPU path: the registry's architectures as TorchTitan 0.2.2 modules,
HF safetensors in and out through TorchTitan's state-dict adapters, FSDP2 / TP / activation
checkpointing through TorchTitan's own ``parallelize_*`` functions, and response logprobs.

Which TorchTitan model serves which registry entry (:func:`titan_model_args`):

- Qwen3 (``model_type=qwen3``): ``torchtitan.models.qwen3.Qwen3Model`` with the source's sizes.
- Llama with plain RoPE (SmolLM2-135M: tied embeddings, head_dim 64): also ``Qwen3Model``, with
  ``qk_norm=False``: without q/k norms TorchTitan's Qwen3 block *is* the HF Llama block (rotate-half
  RoPE, no biases, SwiGLU, RMSNorm), with the tied embeddings TorchTitan's Llama3 lacks; the Qwen3
  adapter's HF names are Llama's names.
- Llama 3.1 (``rope_scaling.rope_type=llama3``): ``torchtitan.models.llama3.Transformer`` (its
  RoPE scaling) with ``Llama3StateDictAdapter`` (which permutes wq/wk between the layouts).

TorchTitan 0.2.2, as 0.3.0 imports ``DataParallelMeshDims``, which the GPU image's torch 2.11 lacks,
and on CPU offers only flex/varlen attention (no CPU backward). Published weights are in HF names and
layout (what vLLM's ``load_weights`` takes), in :func:`hf_layout` order; tied embeddings appear once
(``model.embed_tokens.weight``).
"""

from __future__ import annotations

import glob
import os
from typing import Any, Iterable, Optional

import torch

from forge_core.lora import apply_lora, init_adapters, is_adapter, lora_modules, merged_weight
from forge_core.titan_spec import (TitanSpec, _llama3_ffn, clean_name, hf_layout,  # noqa: F401 (re-exported)
                                 state_dict_adapter, titan_model_args)


def build_model(spec: TitanSpec, device: torch.device, seed: int = 0, parallelize=None,
                dtype: torch.dtype = torch.float32, packed: bool = False, lora: Any = None) -> torch.nn.Module:
    """The TorchTitan model on ``device``: built on the meta device, document-causal attention for
    packed sequences switched on when ``packed`` (:func:`forge_core.packing.enable_packed_attention`:
    FlexAttention on CUDA, SDPA with a dense mask on CPU), LoRA adapters added when ``lora`` (a
    :class:`forge_core.lora.LoRAConfig` with rank > 0; only they stay trainable), ``parallelize(model)``
    applied there (FSDP / TP / AC / compile, optional), then ``to_empty`` and ``init_weights``
    (seeded), in ``dtype``; the adapters then get :func:`forge_core.lora.init_adapters` (``B`` zero).
    With LoRA, ``dtype`` is the frozen base's (the trainer passes its compute dtype: a bf16 base is
    2 bytes a parameter) and the adapters are float32 whatever it is; the base is initialised in
    ``dtype`` directly (no float32 copy is ever materialised)."""
    if spec.family == "llama3":
        from torchtitan.models.llama3.model.model import Transformer as cls
    else:
        from torchtitan.models.qwen3.model.model import Qwen3Model as cls
    with torch.device("meta"):
        model = cls(spec.args)
    if dtype != torch.float32:
        model.to(dtype)
    if packed:
        from forge_core.packing import enable_packed_attention
        cuda = torch.device(device).type == "cuda"
        if cuda:  # flex attention is autotuned per shape: keep inductor's report of it off the console
            import torch._inductor.config as inductor
            for key, off in (("max_autotune_report_choices_stats", False), ("autotune_num_choices_displayed", 0)):
                if hasattr(inductor, key):
                    setattr(inductor, key, off)
        enable_packed_attention(model, "flex" if cuda else "sdpa")
    if lora is not None and lora.rank:
        apply_lora(model, lora)
    if parallelize is not None:
        model = parallelize(model) or model
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    if lora is not None and lora.rank:
        init_adapters(model, seed)
    return model


def named_hf_tensors(model: torch.nn.Module, spec: TitanSpec, adapter=None,
                     dtype: Optional[torch.dtype] = None) -> Iterable[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every parameter, converted by the state-dict adapter (one
    parameter at a time, so at most one full tensor is alive). With FSDP/TP (DTensor parameters)
    every rank must iterate (each ``full_tensor`` is a collective). ``dtype`` casts before gathering.
    With LoRA (:mod:`forge_core.lora`) an adapted layer's weight is the merged one, gathered in fp32,
    merged, then cast, and the adapters themselves are not yielded: the model the generators run."""
    from torch.distributed.tensor import DTensor

    adapter, seen = adapter or state_dict_adapter(spec), set()
    adapted = {f"{n}.weight": m for n, m in lora_modules(model).items()}  # empty without LoRA
    for name, p in model.named_parameters():
        name = clean_name(name)
        if adapted and is_adapter(name):
            continue
        if name in adapted:
            t = merged_weight(adapted[name])
            t = t if dtype is None else t.to(dtype)
        else:
            t = p.detach() if dtype is None else p.detach().to(dtype)
        if isinstance(t, DTensor):
            t = t.full_tensor()
        for k, v in adapter.to_hf({name: t}).items():
            if k not in seen:
                seen.add(k)
                yield k, v


def load_hf_state_dict(model: torch.nn.Module, spec: TitanSpec, hf_sd: dict) -> None:
    """Load HF-named full tensors into ``model`` (plain or FSDP/TP-sharded) through the adapter; LoRA
    adapters (:mod:`forge_core.lora`) are not among them and keep their values. A sharded parameter
    takes its values from rank 0's tensor (``distribute_tensor`` scatters from ``src_data_rank=0``):
    the other ranks may pass ``meta`` tensors of the same shapes, and then read nothing.

    Raises:
        ValueError: naming missing or unexpected keys.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    sd = state_dict_adapter(spec).from_hf(dict(hf_sd))
    params = {clean_name(n): p for n, p in model.named_parameters(remove_duplicate=False)
              if not is_adapter(clean_name(n))}
    missing = [n for n in params if n not in sd]
    unexpected = [n for n in sd if n not in params]
    if missing or unexpected:
        raise ValueError(f"HF weights do not match the TorchTitan model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    with torch.no_grad():
        for n, p in params.items():
            if isinstance(p, DTensor):
                t, dev = sd[n], p.device_mesh.device_type
                t = torch.empty(t.shape, dtype=p.dtype, device=dev) if t.is_meta else t.to(dev).to(p.dtype)
                src = distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=0)
                p.to_local().copy_(src.to_local())
            else:
                p.copy_(sd[n].to(p.device, p.dtype))


def load_hf_dir(model: torch.nn.Module, spec: TitanSpec, path: str) -> None:
    """Load ``*.safetensors`` of an HF checkpoint directory into ``model``."""
    from safetensors.torch import load_file
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    load_hf_state_dict(model, spec, {k: v for f in files for k, v in load_file(f).items()})


def job_config(seq_len: int, ac: bool, tp: int = 1, compile: bool = False):
    """A TorchTitan ``JobConfig`` holding only what ``parallelize_*`` reads here: bf16 params with
    fp32 reductions (FSDP2 mixed precision), full activation checkpointing or none, compile, TP."""
    from torchtitan.config import JobConfig
    jc = JobConfig()
    jc.training.seq_len = seq_len
    jc.training.mixed_precision_param = "bfloat16"
    jc.training.mixed_precision_reduce = "float32"
    jc.activation_checkpoint.mode = "full" if ac else "none"
    jc.compile.enable = compile
    jc.compile.components = ["model"] if compile else []
    jc.parallelism.tensor_parallel_degree = tp
    jc.parallelism.disable_loss_parallel = True  # logits come back whole: logprobs gather over the vocab
    return jc


def parallelize_fn(spec: TitanSpec, world_size: int, tp: int, ac: bool, seq_len: int, compile: bool = False):
    """A ``model -> model`` function applying TorchTitan's own parallelisation for ``spec``:
    FSDP2 over ``world_size // tp`` ranks (bf16 params, fp32 reduce), TP of ``tp``, full AC.
    Needs ``torch.distributed`` initialised when ``world_size > 1``. ``None`` when nothing applies."""
    if world_size == 1 and not ac and not compile:
        return None
    jc = job_config(seq_len, ac, tp, compile)
    if world_size == 1:
        def one(model):
            if ac:
                from torchtitan.distributed.activation_checkpoint import apply_ac
                apply_ac(model, jc.activation_checkpoint)
            if compile:
                for name, block in model.layers.named_children():
                    model.layers.register_module(name, torch.compile(block, fullgraph=True))
            return model

        return one
    from torchtitan.distributed import ParallelDims
    if world_size % tp:
        raise ValueError(f"trainer.tp={tp} must divide the trainer's {world_size} GPUs")
    pd = ParallelDims(dp_replicate=1, dp_shard=world_size // tp, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=world_size)
    pd.build_mesh()
    if spec.family == "llama3":
        from torchtitan.models.llama3.infra.parallelize import parallelize_llama as fn
    else:
        from torchtitan.models.qwen3.infra.parallelize import parallelize_qwen3 as fn
    return lambda model: fn(model, pd, jc)


class PositionSelect:
    """A forward pre-hook on the output layer that keeps only the hidden states at the given flat
    positions, so the vocabulary projection runs on response tokens alone (saves ~P/(P+R) of it
    and the [B, T, V] logits). Inert while ``idx`` is ``None``."""

    def __init__(self, model: torch.nn.Module):
        self.idx: Optional[torch.Tensor] = None
        self.handle = model.output.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if self.idx is None:
            return None
        h = args[0]
        return (h.reshape(-1, h.shape[-1]).index_select(0, self.idx),)


def response_logprobs(model: torch.nn.Module, episodes: list, R: int, temperature: float, device: torch.device,
                      select: Optional[PositionSelect] = None) -> torch.Tensor:
    """``[B, R]`` float32 logprobs of each episode's response tokens (columns ``0..R_i-1``, as in
    :func:`forge_core.episode.collate`), under a TorchTitan model.

    TorchTitan's SDPA attention is causal with no padding mask, so rows are laid out
    *right*-padded (prompt, response, padding): real tokens never attend to padding, and
    positions start at 0 in every row, as in the generator. Only response positions reach the
    output layer when ``select`` (a :class:`PositionSelect` on this model) is given.
    """
    B, m = len(episodes), 64 if torch.device(device).type == "cuda" else 8  # CPU: less padding
    T = -(-max(len(e.prompt_ids) + len(e.response_ids) for e in episodes) // m) * m  # rounded up to m
    ids = torch.zeros((B, T), dtype=torch.long)  # padding: token 0
    rows, flat, tgt, outc = [], [], [], []
    for i, e in enumerate(episodes):
        p, r = len(e.prompt_ids), len(e.response_ids)
        ids[i, :p + r] = torch.tensor(list(e.prompt_ids) + list(e.response_ids), dtype=torch.long)
        rows += [i] * r
        flat += range(i * T + p - 1, i * T + p + r - 1)
        outc += range(r)
        tgt += e.response_ids
    ids = ids.to(device, non_blocking=True)
    flat = torch.tensor(flat, dtype=torch.long).to(device)
    target = torch.tensor(tgt, dtype=torch.long).to(device)
    if select is not None:
        select.idx = flat
        try:
            logits = model(ids)
        finally:
            select.idx = None
    else:
        logits = model(ids)
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, flat)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lp = logits.gather(-1, target[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    out = torch.zeros(B, R, device=device, dtype=torch.float32)
    return out.index_put((torch.tensor(rows, device=device), torch.tensor(outc, device=device)), lp)


def step_flops(spec: TitanSpec, doc_lengths: list[int], logit_positions: int, frozen: bool = False) -> float:
    """Training FLOPs (forward + backward, matmuls, multiply-add = 2) of one pass over documents
    of ``doc_lengths`` tokens with the output layer on ``logit_positions`` positions:

        c * N_body * sum(n) + c * d * V * logit_positions + 12 * L * H * hd * sum(n^2)

    ``c`` = 6 (forward 2, backward 4), or 4 when ``frozen`` (LoRA: the backward computes input
    gradients but no weight gradients; the adapters' own FLOPs are left out). ``N_body``: every
    parameter but the embedding table and the output head (the layers and the final norm); ``d``,
    ``V``: hidden size and vocabulary (the output head, tied or not); the attention term is
    TorchTitan's (``get_dense_model_nparams_and_flops``: QK^T and AV, 3x forward for the backward, the
    whole ``n x n`` square, causal sparsity not discounted, recomputation not counted) per document.
    Used by the trainer's ``mfu`` and by the benchmarks' anchor (:mod:`benchmarks.anchor`). Units: FLOPs."""
    h = spec.hf
    D, V, L, H = h["hidden_size"], h["vocab_size"], h["num_hidden_layers"], h["num_attention_heads"]
    hd = h.get("head_dim") or D // H
    body = sum(k for name, _, k in hf_layout(h) if name not in ("model.embed_tokens.weight", "lm_head.weight"))
    c = 4.0 if frozen else 6.0
    return c * body * sum(doc_lengths) + c * D * V * logit_positions + 12.0 * L * H * hd * sum(n * n for n in doc_lengths)


def peak_tflops(device_name: str) -> float:
    """Dense bf16 datasheet peak (TFLOP/s) of a GPU named like ``NVIDIA H100 80GB HBM3`` (0 if unknown)."""
    peaks = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}
    return next((v for k, v in peaks.items() if k in device_name), 0.0)
