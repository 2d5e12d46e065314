"""Sequence packing, document-causal attention and chunked logprobs for the TorchTitan trainer
and reference model: each micro-batch is one row of ``budget`` tokens holding several episodes,
attention is causal within each episode, RoPE positions restart at 0 in each, and the vocabulary
projection runs on response positions only, a chunk of rows at a time (no ``[T, V]`` logits).

Usage (trainer or reference actor; ``episodes`` a list of :class:`forge_core.episode.Episode`)::

    model = titan.build_model(spec, device, parallelize=fn)
    enable_packed_attention(model)              # once, before the first forward
    batch = collate(episodes, pad_id)           # the step's [B, R] logprobs, mask; [B] advantages
    R = batch.response_mask.shape[1]
    for idx in pack_episodes([len(e.prompt_ids) + len(e.response_ids) for e in episodes], budget):
        mb = pack_batch([episodes[i] for i in idx], budget, pad_id).to(device)
        lp = packed_response_logprobs(model, mb, R, temperature)            # [len(idx), R]
        loss, metrics = compute_loss(cfg, lp, batch.behaviour_logprobs[idx].to(device), ...)
        (loss * share).backward()  # share: this micro-batch's weight in the step's aggregate
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch
import torch.nn.functional as F

TOKENS_FIELD = "trainer.tokens_per_micro_batch"


def pack_episodes(lengths: list[int], budget: int) -> list[list[int]]:
    """Group episode indices (``lengths``: prompt + response tokens of each) into micro-batches of
    at most ``budget`` tokens by first-fit decreasing (longest first, ties by index, each into the
    first micro-batch with room). Deterministic; returns micro-batches in creation order, each a
    sorted index list, every index exactly once.

    Raises:
        ValueError: ``budget < 1``, or an episode longer than ``budget`` (or negative); the message
            names ``trainer.tokens_per_micro_batch``, the budget and the episode's length.
    """
    if budget < 1:
        raise ValueError(f"{TOKENS_FIELD}={budget} must be >= 1")
    bins, room = [], []  # index lists, and the tokens left in each
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n < 0 or n > budget:
            raise ValueError(f"episode {i} has {n} tokens (prompt + response), which does not fit "
                             f"{TOKENS_FIELD}={budget}; raise it or lower the prompt/response limits")
        j = next((j for j, r in enumerate(room) if r >= n), len(bins))
        if j == len(bins):
            bins.append([])
            room.append(budget)
        bins[j].append(i)
        room[j] -= n
    return [sorted(b) for b in bins]


@dataclass
class PackedBatch:
    """One packed micro-batch: ``B`` episodes laid end to end in a single row of ``T = budget``
    tokens, padded at the tail (one static shape for every micro-batch). ``N`` response tokens.

    Attributes:
        tokens: ``[1, T]`` int64 token ids (prompt_i, response_i, ..., padding).
        positions: ``[1, T]`` int64 RoPE positions, 0 at the start of each episode (0 on padding).
        doc_ids: ``[1, T]`` int32 document id: episode ``i`` is ``i``; padding token ``j`` is ``B + j``
            (a document of its own, so the padding costs FlexAttention one diagonal, not a square).
        cu_seqlens: ``[D + 1]`` int32 document starts and ``T`` (``D`` = B, +1 with padding: the
            dense-mask and varlen paths treat the padding as one document).
        select: ``[N]`` int64 flat positions in the row whose *next* token is a response token.
        targets: ``[N]`` int64 those response tokens.
        rows, cols: ``[N]`` int64 where each logprob goes in the ``[B, R]`` output (as ``collate``).
        n_episodes: ``B``; max_len, max_response: the longest episode and response (python ints);
        n_pad: padding tokens at the tail.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    select: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    n_episodes: int
    max_len: int
    max_response: int
    n_pad: int

    def to(self, device) -> "PackedBatch":
        """A copy with every tensor on ``device`` (copied with ``non_blocking=True``)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device, non_blocking=True)
                                for f in fields(self) if torch.is_tensor(getattr(self, f.name))})


def pack_batch(episodes: list, budget: int, pad_id: int = 0) -> PackedBatch:
    """Build the :class:`PackedBatch` of ``episodes`` (fields ``prompt_ids``, ``response_ids``:
    lists of ints) in the given order, on the CPU (move it with :meth:`PackedBatch.to`).

    Raises:
        ValueError: no episodes, total tokens over ``budget`` (names ``trainer.tokens_per_micro_batch``),
            or an episode with a response but an empty prompt (its first token has no context).
    """
    if not episodes:
        raise ValueError("pack_batch: no episodes")
    lens = [len(e.prompt_ids) + len(e.response_ids) for e in episodes]
    if sum(lens) > budget:
        raise ValueError(f"{len(episodes)} episodes hold {sum(lens)} tokens, over {TOKENS_FIELD}={budget}")
    toks, pos, doc, starts, sel, tgt, rows, cols = [], [], [], [], [], [], [], []
    for i, e in enumerate(episodes):
        p, r, o = len(e.prompt_ids), len(e.response_ids), len(toks)
        if r and not p:
            raise ValueError(f"episode {i}: empty prompt, so its first response token has no logprob")
        starts.append(o)
        toks += list(e.prompt_ids) + list(e.response_ids)
        pos += range(p + r)
        doc += [i] * (p + r)
        sel += range(o + p - 1, o + p + r - 1)
        tgt += e.response_ids
        rows += [i] * r
        cols += range(r)
    pad = budget - len(toks)
    if pad:
        starts.append(len(toks))
    toks, pos, doc = toks + [pad_id] * pad, pos + [0] * pad, doc + list(range(len(episodes), len(episodes) + pad))
    long = lambda x: torch.tensor(x, dtype=torch.long)
    return PackedBatch(long(toks)[None], long(pos)[None], torch.tensor(doc, dtype=torch.int32)[None],
                       torch.tensor(starts + [budget], dtype=torch.int32), long(sel), long(tgt), long(rows),
                       long(cols), len(episodes), max(lens), max(len(e.response_ids) for e in episodes), pad)


class DocumentCausalSDPA(torch.nn.Module):
    """Inner attention for TorchTitan's ``attn_type="varlen"`` branch: SDPA with a dense block-diagonal
    causal boolean mask (``T^2`` per layer) from the metadata's ``cu_seq_q``, as ``varlen_attn`` computes.
    q ``[b, H, T, hd]``, k/v ``[b, H_kv, T, hd]`` -> ``[b, T, H, hd]``. Plain tensors only (not TP's DTensors)."""

    def forward(self, q, k, v, meta, scale: Optional[float] = None) -> torch.Tensor:
        """Attention of ``q``/``k``/``v`` within each document of ``meta`` (shapes: the class docstring)."""
        b, _, T, _ = q.shape
        doc = torch.searchsorted(meta.cu_seq_q[1:], torch.arange(b * T, device=q.device), right=True).view(b, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = (doc[:, :, None] == doc[:, None, :]) & causal
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).contiguous()


def _attention_modules(model: torch.nn.Module) -> list:
    """TorchTitan ``Attention`` modules (anything with ``attn_type`` and ``inner_attention``),
    found through FSDP / checkpoint / compile wrappers by ``model.modules()``."""
    return [m for m in model.modules() if hasattr(m, "attn_type") and hasattr(m, "inner_attention")]


def enable_packed_attention(model: torch.nn.Module, backend: Optional[str] = None) -> str:
    """Switch every attention layer of a TorchTitan 0.2.2 model (``Qwen3Model``, Llama3
    ``Transformer``) to document-causal attention in place; returns the backend used.

    Sets each ``Attention.attn_type`` and swaps its parameter-free ``inner_attention``: ``"flex"``
    -> ``FlexAttentionWrapper``; ``"varlen"`` -> ``VarlenAttentionWrapper``; ``"sdpa"`` ->
    :class:`DocumentCausalSDPA` under the varlen branch (the CPU path: CPU FlexAttention has no
    backward; ``"varlen"`` is not verified here). ``None``: ``"flex"`` on CUDA (a parameter's device;
    CUDA availability on the meta device), else ``"sdpa"``. Call it before the first forward, best
    before ``parallelize`` (compiled blocks would otherwise recompile once).

    Raises:
        ValueError: an unknown backend, or no TorchTitan attention module in ``model``.
    """
    from torchtitan.models.attention import FlexAttentionWrapper, VarlenAttentionWrapper
    if backend is None:
        dev = next(model.parameters()).device
        cuda = dev.type == "cuda" or (dev.type == "meta" and torch.cuda.is_available())
        backend = "flex" if cuda else "sdpa"
    make = {"flex": ("flex", FlexAttentionWrapper), "varlen": ("varlen", VarlenAttentionWrapper),
            "sdpa": ("varlen", DocumentCausalSDPA)}
    if backend not in make:
        raise ValueError(f"unknown packed attention backend {backend!r}; expected one of {sorted(make)}")
    if not (mods := _attention_modules(model)):
        raise ValueError("enable_packed_attention: no TorchTitan Attention module (attn_type) in the model")
    attn_type, cls = make[backend]
    for m in mods:
        m.attn_type = attn_type
        if type(m.inner_attention) is not cls:
            m.inner_attention = cls()
    return backend


def packed_attention_mask(model: torch.nn.Module, mb: PackedBatch):
    """The model's ``attention_masks`` argument for ``mb``, on ``mb``'s device: for ``"flex"`` a
    ``BlockMask`` (``q >= kv and doc[q] == doc[kv]``, B=1, all heads; TorchTitan's compiled
    ``create_block_mask`` on CUDA), else TorchTitan's ``VarlenMetadata`` (``cu_seqlens``, longest
    segment). Each padding token attends to itself at least, so no query row is fully masked.

    Raises:
        ValueError: the model was not prepared by :func:`enable_packed_attention`.
    """
    mods = _attention_modules(model)
    kind = mods[0].attn_type if mods else None
    if kind == "flex":
        from torch.nn.attention.flex_attention import create_block_mask
        from torchtitan.models.attention import create_attention_mask
        doc, T = mb.doc_ids, mb.tokens.shape[1]

        def document_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

        build = create_attention_mask if doc.device.type == "cuda" else create_block_mask  # compiled on CUDA
        return build(document_causal, 1, None, T, T, device=doc.device)
    if kind == "varlen":
        from torchtitan.models.attention import VarlenMetadata
        longest = max(mb.max_len, mb.n_pad)
        return VarlenMetadata(mb.cu_seqlens, mb.cu_seqlens, longest, longest)
    raise ValueError(f"attention type {kind!r}: call enable_packed_attention(model) before packed forwards")


def _lse_and_logprob(z: torch.Tensor, targets: torch.Tensor, temperature: float):
    """``([C], [C])`` float32 ``logsumexp(z / T)`` and ``z[y] / T - logsumexp`` of one chunk's logits
    ``z`` ``[C, V]`` (the matmul's dtype): the eager path's math, written to be fused by ``torch.compile``."""
    zf = z.float() / temperature
    lse = torch.logsumexp(zf, dim=-1)
    return lse, zf.gather(1, targets[:, None]).squeeze(1) - lse


def _logit_grad(z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor,
                temperature: float) -> torch.Tensor:
    """``[C, V]`` gradient of ``sum(grad * lp)`` w.r.t. one chunk's logits ``z``, in ``z``'s dtype:
    ``grad / T * (onehot(y) - softmax(z / T))``, written to be fused by ``torch.compile``."""
    hit = torch.arange(z.shape[1], device=z.device)[None] == targets[:, None]
    p = torch.exp(z.float() / temperature - lse[:, None])
    return ((hit.float() - p) * (grad.float() / temperature)[:, None]).to(z.dtype)


@functools.cache
def _compiled(fn):
    """``fn`` under ``torch.compile`` (wrapped once per process, dynamic in the chunk length)."""
    return torch.compile(fn, dynamic=True)


class _ChunkedLogprobs(torch.autograd.Function):
    """See :func:`chunked_logprobs`. Saves hidden, weight, targets and the ``[N]`` logsumexp."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, fused):
        dev = hidden.device.type
        dt = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
              else torch.promote_types(hidden.dtype, weight.dtype))
        N = hidden.shape[0]
        out = torch.empty(N, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        with torch.autocast(dev, enabled=False):
            w = weight.to(dt)
            for s in range(0, N, chunk_size):
                if fused:  # one compiled kernel reads the [C, V] logits once
                    lse[s:s + chunk_size], out[s:s + chunk_size] = _compiled(_lse_and_logprob)(
                        hidden[s:s + chunk_size].to(dt) @ w.T, targets[s:s + chunk_size], temperature)
                    continue
                z = (hidden[s:s + chunk_size].to(dt) @ w.T).float().div_(temperature)  # [C, V] float32
                lse[s:s + chunk_size] = torch.logsumexp(z, dim=-1)
                out[s:s + chunk_size] = z.gather(1, targets[s:s + chunk_size, None]).squeeze(1) - lse[s:s + chunk_size]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.dt, ctx.temperature, ctx.chunk_size, ctx.fused = dt, temperature, chunk_size, fused
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        dt, t, C = ctx.dt, ctx.temperature, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[:2]
        gh = torch.empty_like(hidden) if need_h else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dt)
            gw = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
            for s in range(0, hidden.shape[0], C):
                h = hidden[s:s + C].to(dt)
                if ctx.fused:
                    dz = _compiled(_logit_grad)(h @ w.T, lse[s:s + C], targets[s:s + C], grad[s:s + C], t)
                else:
                    g = grad[s:s + C].float()[:, None] / t
                    # d lp / d logits = (onehot(target) - softmax(logits / T)) / T, scaled by the upstream grad
                    dz = (h @ w.T).float().div_(t).sub_(lse[s:s + C, None]).exp_().mul_(-g)
                    dz = dz.scatter_add_(1, targets[s:s + C, None], g).to(dt)
                if need_h:
                    gh[s:s + C] = dz @ w
                if need_w:
                    gw.addmm_(dz.T, h)  # fp32 accumulate inside each GEMM, one rounding to dt per chunk
        return gh, gw.to(weight.dtype) if need_w else None, None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     temperature: float = 1.0, chunk_size: int = 1024, fused: Optional[bool] = None) -> torch.Tensor:
    """``[N]`` float32 logprob of each target under ``softmax(hidden @ weight.T / temperature)``,
    holding at most one ``[chunk_size, V]`` block of logits at a time, in forward and backward:
    ``lp_n = z_n[y_n] - logsumexp(z_n)``, ``z_n = hidden_n @ weight.T / temperature`` in float32
    (``torch.logsumexp`` subtracts the row max: the logsumexp trick). The backward recomputes each
    chunk's logits and uses ``d lp / d z = onehot(y) - softmax(z)``; prior art: Liger-Kernel's
    fused linear cross-entropy (own code here). Matmuls run in the autocast dtype when autocast is
    on, else in the inputs' common dtype; softmax math is float32. ``weight`` may be tied to the
    embedding. Its gradient accumulates over chunks in the compute dtype (bf16: one rounding per
    chunk, as Liger). Shapes: hidden ``[N, D]`` (after the final norm), weight ``[V, D]``, targets
    ``[N]`` int64 in ``[0, V)``; ``temperature`` as the generator's; peak extra memory about
    ``3 * chunk_size * V * 4`` bytes. Differentiable w.r.t. ``hidden`` and ``weight``.

    ``fused`` (default: on CUDA tensors): the element-wise work on each chunk's logits (upcast,
    temperature, logsumexp and target in the forward; softmax, one-hot and the upstream gradient in the
    backward) runs as one ``torch.compile``-generated kernel each, which reads the ``[C, V]`` logits
    once instead of once per eager op; the math is the same, the float32 rounding of the reductions may
    differ in the last bits. Off: the eager in-place ops (CPU's default, bit for bit as before).

    Raises:
        ValueError: bad shapes, ``temperature <= 0`` or ``chunk_size < 1``.
    """
    if (hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]
            or targets.shape != hidden.shape[:1]):
        raise ValueError(f"chunked_logprobs: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                         f"targets {tuple(targets.shape)}: expected [N, D], [V, D], [N]")
    if not temperature > 0 or chunk_size < 1:
        raise ValueError(f"chunked_logprobs: temperature={temperature} must be > 0, chunk_size={chunk_size} >= 1")
    fused = hidden.is_cuda if fused is None else bool(fused)
    return _ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk_size), fused)


def packed_response_logprobs(model: torch.nn.Module, mb: PackedBatch, R: int, temperature: float = 1.0,
                             chunk_size: int = 1024, attention_masks=None) -> torch.Tensor:
    """``[B, R]`` float32 logprobs of the response tokens of ``mb``'s episodes (row ``i`` =
    episode ``i``, columns ``0..R_i-1``, zeros elsewhere: ``collate``'s layout, so
    :func:`forge_core.losses.compute_loss` takes it unchanged); differentiable.

    Runs ``model(mb.tokens, attention_masks, mb.positions)`` (``model`` prepared by
    :func:`enable_packed_attention`, ``mb`` on its device) with ``model.output.forward`` replaced by
    an instance attribute during the call (FSDP2's hooks still run and unshard the weight): it
    takes the ``N`` response positions and returns :func:`chunked_logprobs`, or ``[N, V]`` logits
    for a DTensor (TP) weight. ``attention_masks``: a prebuilt :func:`packed_attention_mask`.

    Raises:
        ValueError: ``R`` too small, a document longer than ``model_args.max_seq_len`` (RoPE
            table), or the model not prepared.
    """
    if mb.max_response > R:
        raise ValueError(f"R={R} is shorter than the longest response ({mb.max_response} tokens)")
    max_seq = getattr(getattr(model, "model_args", None), "max_seq_len", None)
    if max_seq is not None and mb.max_len > max_seq:
        raise ValueError(f"a packed document has {mb.max_len} tokens, over the model's max_seq_len={max_seq}")
    if attention_masks is None:
        attention_masks = packed_attention_mask(model, mb)
    out_mod = model.output

    def output_forward(h: torch.Tensor) -> torch.Tensor:
        idx = mb.select
        if hasattr(h, "device_mesh"):  # TP: the index as a replicated DTensor (forward and backward)
            from torch.distributed.tensor import DTensor, Replicate
            idx = DTensor.from_local(idx, h.device_mesh, [Replicate()] * h.device_mesh.ndim)
        h = h.reshape(-1, h.shape[-1]).index_select(0, idx)
        if hasattr(out_mod.weight, "device_mesh"):  # DTensor (TP): full logits of the selected rows
            return type(out_mod).forward(out_mod, h)
        return chunked_logprobs(h, out_mod.weight, mb.targets, temperature, chunk_size)

    mesh = getattr(out_mod.weight, "device_mesh", None)
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):  # TorchTitan's TP mesh dim
        from torch.distributed.tensor.experimental import implicit_replication as context  # plain positions
    else:
        context = contextlib.nullcontext
    if "forward" in out_mod.__dict__:
        raise RuntimeError("model.output.forward is already replaced (nested packed_response_logprobs?)")
    out_mod.forward = output_forward
    try:
        with context():
            y = model(mb.tokens, attention_masks=attention_masks, positions=mb.positions)
    finally:
        del out_mod.forward
    if y.dim() == 2:  # tensor-parallel fallback
        if hasattr(y, "full_tensor"):
            y = y.full_tensor()
        z = y.float() / temperature
        y = z.gather(1, mb.targets[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1)
    out = torch.zeros(mb.n_episodes, R, dtype=torch.float32, device=y.device)
    return out.index_put((mb.rows, mb.cols), y)
