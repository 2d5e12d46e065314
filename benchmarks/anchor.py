"""The anchor: TorchTitan 0.2.2's own training step on exactly the packed episodes our trainer gets.

    python -m benchmarks.anchor --model qwen3_1_7b --episodes eps.json --tokens-per-micro-batch 16384 [--ac]
    torchrun --nproc-per-node 2 -m benchmarks.anchor --model qwen3_8b --episodes eps.json \\
        --tokens-per-micro-batch 16384 --ac                                              # FSDP2
    python -m benchmarks.anchor --model qwen3_1_7b --synthetic 128 --tokens-per-micro-batch 16384

What TorchTitan's users run for this work, and the same work as :mod:`forge_core.actors.trainer`:

- **Tokens**: the trainer's own micro-batches (:func:`forge_core.actors.trainer.micro_batches`: this
  rank's ``rank::world`` share, first-fit decreasing into rows of ``trainer.tokens_per_micro_batch``
  tokens, dummy micro-batches where a rank has fewer) built by the trainer's own
  :func:`forge_core.packing.pack_batch`: the same token ids, RoPE positions restarting at 0 in each
  episode, padding at the tail of each row.
- **Attention**: TorchTitan's FlexAttention with ``attn_type="flex"``, ``attn_mask_type="block_causal"``
  (the model builds its own ``FlexAttentionWrapper``, compiled with max-autotune), its mask from
  ``model.get_attention_masks`` (causal AND TorchTitan's ``get_document_mask_mod``, compiled
  ``create_block_mask``). TorchTitan 0.2.2 finds document boundaries at ``tokenizer.eos_id`` tokens
  of the input; an episode's prompt holds ``<|im_end|>`` (Qwen3's eos) inside its chat turns, so a
  boundary row goes in its place: 1 at each episode's last token and at every padding token, else 0,
  with ``eos_id = 1``. The documents are then exactly the trainer's (each padding token one of its own).
- **Loss**: TorchTitan's ``cross_entropy_loss`` (``reduction="sum"``, ``ignore_index=-100``) built by
  ``build_cross_entropy_loss`` with ``compile.components = ["model", "loss"]`` (TorchTitan's default:
  the loss goes through ``torch.compile``), labels ``-100`` except at the positions whose next token
  is a response token: the trainer's loss positions, divided by the global count of valid labels as
  TorchTitan's train loop does. The output layer runs on every position (full ``[T, V]`` logits):
  that is how TorchTitan computes the loss; our trainer projects only the response positions.
- **Model and precision**: per-block ``torch.compile(fullgraph=True)`` and FSDP2 (bf16 params, fp32
  reductions) through TorchTitan's ``parallelize_qwen3`` / ``parallelize_llama`` over several GPUs; on
  one GPU the same per-block compile and bf16 autocast (TorchTitan's ``maybe_enable_amp``). Full
  activation checkpointing with ``--ac`` (the trainer's setting: compare like with like), else none.
- **Step**: TorchTitan's ``clip_grad_norm_`` (max norm 1.0, foreach) and fused AdamW. The rows are
  built on the CPU before the clock starts (a prefetching data loader); copying them to the GPU and
  building each mask are timed, as in TorchTitan's ``train_step``.

Prints one JSON line (rank 0): ``anchor_tok_s`` (real prompt + response tokens per second, padding
not counted, as the trainer's ``tokens_per_s``), ``anchor_step_s`` (the best of ``--steps`` steps
after one that compiles), ``tokens``, ``loss_tokens``, ``micro_batches`` (per rank), ``flops``
(:func:`plan_flops`), ``anchor_mfu``, ``world``, ``ac``, ``compile_step_s``, ``peak_mem_gb``, ``device``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal
from typing import Any

from forge_core.titan import step_flops  # the one FLOP formula, shared with the trainer's mfu

IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX (PyTorch's default)
BOUNDARY_ID = 1  # the eos_id of the boundary row (see the module docstring)


@dataclass
class AnchorRow:
    """One micro-batch of the anchor: a single row of ``T`` (the token budget) tokens.

    Attributes:
        tokens: ``[1, T]`` int64 token ids, the trainer's packed row (:func:`forge_core.packing.pack_batch`).
        positions: ``[1, T]`` int64 RoPE positions, 0 at each episode's start (0 on padding).
        labels: ``[1, T]`` int64: ``labels[j]`` = ``tokens[j + 1]`` where that token is a response
            token (the trainer's ``select`` positions), else ``IGNORE_INDEX`` (-100).
        ends: ``[1, T]`` int32 boundary row: 1 at each episode's last token and every padding token.
        n_tokens: prompt + response tokens of the row's episodes (padding not counted).
        n_loss: loss positions (response tokens); both 0 for a dummy row.
        n_pad: padding tokens at the tail.
        dummy: a rank's filler micro-batch (the trainer runs it with its loss times 0, for FSDP).
    """

    tokens: Any
    positions: Any
    labels: Any
    ends: Any
    n_tokens: int
    n_loss: int
    n_pad: int
    dummy: bool

    def doc_lengths(self) -> list[int]:
        """The row's document lengths (tokens), padding tokens as documents of 1, from ``ends``."""
        idx = [j for j, e in enumerate(self.ends[0].tolist()) if e]
        return [b - a for a, b in zip([-1] + idx[:-1], idx)]


def anchor_rows(episodes: list, budget: int, rank: int = 0, world: int = 1) -> list[AnchorRow]:
    """Rank ``rank``'s anchor rows (of ``world`` ranks) for ``episodes`` (objects with ``prompt_ids``
    and ``response_ids``, lists of ints), in the trainer's micro-batch order, on the CPU.

    Raises:
        ValueError: ``budget`` < 1, or an episode longer than ``budget`` (as the trainer's packing:
            the message names ``trainer.tokens_per_micro_batch``).
    """
    import torch

    from forge_core.actors.trainer import micro_batches
    from forge_core.packing import pack_batch

    if budget < 1:
        raise ValueError(f"the anchor packs episodes as the trainer does: trainer.tokens_per_micro_batch={budget} "
                         "must be > 0")
    out = []
    for idx, dummy in micro_batches(episodes, rank, world, 1, budget):
        mb = pack_batch([episodes[i] for i in idx], budget)
        labels = torch.full_like(mb.tokens, IGNORE_INDEX)
        labels[0, mb.select] = mb.targets
        doc = mb.doc_ids[0]
        ends = torch.ones_like(mb.doc_ids)
        ends[0, :-1] = (doc[1:] != doc[:-1]).to(torch.int32)
        n_tokens = budget - mb.n_pad
        out.append(AnchorRow(mb.tokens, mb.positions, labels, ends, 0 if dummy else n_tokens,
                             0 if dummy else int(mb.select.numel()), mb.n_pad, dummy))
    return out


def document_mask_mod(ends):
    """TorchTitan's block-causal mask function for a boundary row ``ends`` (``[B, T]``, 1 at each
    document's last token): ``and_masks(get_causal_mask_mod(), get_document_mask_mod(ends, 1))``,
    what ``Qwen3Model._get_flex_attention_masks`` builds for ``attn_mask_type="block_causal"``
    (torchtitan 0.2.2, ``models/attention.py``). Returns ``mask_mod(b, h, q_idx, kv_idx) -> bool``."""
    from torch.nn.attention.flex_attention import and_masks
    from torchtitan.models.attention import get_causal_mask_mod, get_document_mask_mod

    return and_masks(get_causal_mask_mod(), get_document_mask_mod(ends, BOUNDARY_ID))


class _Boundaries:
    """What ``get_attention_masks`` reads of its ``tokenizer`` argument: the boundary id."""

    eos_id = BOUNDARY_ID


def attention_mask(model, ends):
    """The ``BlockMask`` of boundary row ``ends`` (``[1, T]`` on the model's device): on CUDA
    TorchTitan's own ``model.get_attention_masks`` (its compiled ``create_block_mask``, which 0.2.2
    builds on ``"cuda"`` only); elsewhere the same :func:`document_mask_mod` through
    ``create_block_mask`` on ``ends``' device. ``model`` needs ``attn_type="flex"``,
    ``attn_mask_type="block_causal"`` on CUDA."""
    if ends.device.type == "cuda":
        return model.get_attention_masks(input_batch=ends, tokenizer=_Boundaries())
    from torch.nn.attention.flex_attention import create_block_mask

    T = ends.shape[1]
    return create_block_mask(document_mask_mod(ends), 1, None, T, T, device=ends.device)


def flex_spec(spec):
    """``spec`` (:class:`forge_core.titan.TitanSpec`) with TorchTitan's own FlexAttention and
    block-causal mask switched on in its model args (``attn_type="flex"``, ``attn_mask_type=
    "block_causal"``); the model then builds ``FlexAttentionWrapper`` itself."""
    import dataclasses

    from forge_core.titan import TitanSpec

    return TitanSpec(spec.family, dataclasses.replace(spec.args, attn_type="flex", attn_mask_type="block_causal"),
                     spec.hf)


def plan_flops(spec, episodes: list, budget: int, world: int = 1) -> dict:
    """FLOPs of one optimizer step over ``episodes`` packed into ``budget``-token rows on ``world``
    ranks (:func:`anchor_rows`: the trainer's micro-batches, dummies included), every figure from
    :func:`forge_core.titan.step_flops`, summed over ranks:

    - ``useful``: the episodes' tokens and their response positions (what both sides must compute);
    - ``ours``: what our trainer executes: every row token (padding as 1-token documents, dummy
      rows too) through the layers, the output layer on the response positions only;
    - ``anchor``: the same layers, the output layer on every row position (TorchTitan's loss).

    Also ``tokens`` (prompt + response), ``loss_tokens``, ``micro_batches`` (per rank), ``padding``
    (tokens, all ranks). Units: FLOPs, tokens.

    Raises:
        ValueError: as :func:`anchor_rows`.
    """
    useful = step_flops(spec, [len(e.prompt_ids) + len(e.response_ids) for e in episodes],
                        sum(len(e.response_ids) for e in episodes))
    ours = anchor = 0.0
    n_mb = padding = 0
    for r in range(world):
        rows = anchor_rows(episodes, budget, r, world)
        n_mb = len(rows)
        for row in rows:
            docs = row.doc_lengths()
            loss = row.n_loss if not row.dummy else int((row.labels != IGNORE_INDEX).sum())
            ours += step_flops(spec, docs, loss)
            anchor += step_flops(spec, docs, row.tokens.shape[1])
            padding += row.n_pad
    return {"useful": useful, "ours": ours, "anchor": anchor, "micro_batches": n_mb, "padding": padding,
            "tokens": sum(len(e.prompt_ids) + len(e.response_ids) for e in episodes),
            "loss_tokens": sum(len(e.response_ids) for e in episodes)}


def mfu(flops: float, seconds: float, peak_tflops: float, world: int = 1) -> float:
    """Model FLOPs utilisation: ``flops / seconds / (peak_tflops * 1e12 * world)``; 0.0 when the
    peak is unknown (``peak_tflops`` 0, :func:`forge_core.titan.peak_tflops`) or ``seconds`` <= 0."""
    if peak_tflops <= 0 or seconds <= 0:
        return 0.0
    return flops / seconds / (peak_tflops * 1e12 * world)


def ratio_text(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits, truncated, never rounded up (0.8999 -> ``"0.899"``,
    1.0049 -> ``"1.00"``), from its shortest decimal form; ``"nan"``/``"inf"`` as such, 0 as ``"0"``.

    Raises:
        ValueError: ``x`` < 0 or ``digits`` < 1.
    """
    if digits < 1 or x < 0:
        raise ValueError(f"ratio_text({x!r}, digits={digits}): needs x >= 0 and digits >= 1")
    d = Decimal(repr(float(x)))
    if not d.is_finite():
        return str(float(x))
    if d == 0:
        return "0"
    places = digits - 1 - d.adjusted()  # decimal places that keep `digits` significant ones
    q = d.quantize(Decimal(1).scaleb(-places), rounding=ROUND_DOWN) if places > 0 else \
        d.scaleb(places).to_integral_value(rounding=ROUND_DOWN).scaleb(-places)
    return f"{q:.{max(places, 0)}f}"


def save_episodes(episodes: list, path: str) -> None:
    """Write ``episodes``' token ids to ``path`` (JSON: ``[[prompt_ids, response_ids], ...]``), what
    ``--episodes`` reads."""
    with open(path, "w") as f:
        json.dump([[list(e.prompt_ids), list(e.response_ids)] for e in episodes], f)


@dataclass
class _Ep:
    prompt_ids: list
    response_ids: list


def load_episodes(path: str) -> list:
    """Read :func:`save_episodes`' file: objects with ``prompt_ids`` and ``response_ids``.

    Raises:
        ValueError: not a list of ``[prompt_ids, response_ids]`` pairs of int lists (names the index).
    """
    with open(path) as f:
        data = json.load(f)
    out = []
    for i, pair in enumerate(data if isinstance(data, list) else [None]):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, list) for x in pair)):
            raise ValueError(f"{path}: entry {i} is not [prompt_ids, response_ids]")
        out.append(_Ep(*pair))
    return out


def synthetic(n: int, vocab: int, max_response: int = 1024, seed: int = 0) -> list:
    """``n`` episodes of random token ids in ``[3, vocab)``: prompts of 120-260 tokens, responses of
    200-``max_response`` (the shape of ``benchmarks.bench_gpu.synthetic_episodes`` without a generator)."""
    import random

    rnd = random.Random(seed)
    return [_Ep([rnd.randrange(3, vocab) for _ in range(rnd.randint(120, 260))],
                [rnd.randrange(3, vocab) for _ in range(rnd.randint(200, max_response))]) for _ in range(n)]


def run(model: str, episodes: list, budget: int, steps: int = 3, ac: bool = False) -> dict:
    """Time ``steps`` optimizer steps over ``episodes`` (the best counts; one more first, which
    compiles) as the module docstring says; returns its JSON fields. Needs CUDA; the
    ``torch.distributed`` environment (torchrun) for several ranks.

    Raises:
        ValueError: as :func:`anchor_rows`; torch.OutOfMemoryError when the step does not fit.
    """
    import torch
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.distributed.utils import clip_grad_norm_

    from forge_core import titan

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist = None
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl")
    longest = max(len(e.prompt_ids) + len(e.response_ids) for e in episodes)
    spec = flex_spec(titan.titan_model_args(model, max_seq_len=max(4096, longest)))  # the trainer's RoPE table
    rows = anchor_rows(episodes, budget, rank, world)
    m = titan.build_model(spec, torch.device("cuda"), 0, titan.parallelize_fn(spec, world, 1, ac, budget, compile=True))
    m.train()
    jc = titan.job_config(budget, ac, 1, compile=True)
    jc.compile.components = ["model", "loss"]  # TorchTitan's default: the loss compiled too
    loss_fn = build_cross_entropy_loss(jc)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-6, fused=True)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if world == 1 else contextlib.nullcontext()  # FSDP: its own
    params = list(m.parameters())
    times = []
    for _ in range(steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        valid = torch.tensor(sum(r.n_loss for r in rows), dtype=torch.int64).cuda()
        if dist is not None:
            dist.all_reduce(valid)
        valid = valid.float()
        for r in rows:
            x, pos, y, ends = (t.cuda(non_blocking=True) for t in (r.tokens, r.positions, r.labels, r.ends))
            masks = attention_mask(m, ends)
            with amp:
                pred = m(x, attention_masks=masks, positions=pos)
                loss = loss_fn(pred, y) / valid
            del pred
            (loss * 0.0 if r.dummy else loss).backward()
        clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    best = min(times[1:]) if steps else times[0]
    fl = plan_flops(spec, episodes, budget, world)
    peak = titan.peak_tflops(torch.cuda.get_device_name(0))
    return {"anchor_tok_s": fl["tokens"] / best, "anchor_step_s": best, "tokens": fl["tokens"],
            "loss_tokens": fl["loss_tokens"], "micro_batches": len(rows), "tokens_per_micro_batch": budget,
            "flops": fl, "anchor_mfu": mfu(fl["anchor"], best, peak, world),
            "anchor_useful_mfu": mfu(fl["useful"], best, peak, world), "world": world, "ac": ac,
            "compile_step_s": times[0], "steps_s": times, "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
            "device": f"{torch.cuda.get_device_name(0)} x{world}"}


def main() -> int:
    """Command line (the module docstring); prints the JSON line on rank 0; exit 0, or 2 on bad arguments."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3_1_7b")
    p.add_argument("--episodes", default="", help="JSON [[prompt_ids, response_ids], ...] (bench_gpu writes it)")
    p.add_argument("--synthetic", type=int, default=0, help="without --episodes: this many random episodes")
    p.add_argument("--tokens-per-micro-batch", type=int, required=True, help="the trainer's trainer.tokens_per_micro_batch")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ac", action="store_true", help="full activation checkpointing (as the trainer's setting)")
    a = p.parse_args()
    if bool(a.episodes) == bool(a.synthetic):
        p.error("give --episodes FILE or --synthetic N")
    if a.episodes:
        eps = load_episodes(a.episodes)
    else:
        from forge_core.models import hf_config_dict

        eps = synthetic(a.synthetic, hf_config_dict(a.model)["vocab_size"])
    r = run(a.model, eps, a.tokens_per_micro_batch, a.steps, a.ac)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
