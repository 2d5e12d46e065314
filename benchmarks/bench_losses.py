"""Benchmark: forward + backward time of every loss in forge_core.losses vs the logprobs.

Run from the repository root::

    python -m benchmarks.bench_losses              # full run (all 64 rows of the logprob reference)
    python -m benchmarks.bench_losses --logprob-rows 8   # quicker: time 8 rows, scale to 64

Each loss runs on [B, T] = [64, 2048] float32 inputs (ragged mask, [B] advantages, reference
logprobs when the loss's default beta > 0) and is timed from the call to ``compute_loss``
through ``loss.backward()``, metrics (one host copy) included; median over repeats.

The yardstick is the computation of those logprobs themselves, for SmolLM2-135M's shapes:
final hidden state [B, T, 576] @ lm-head W [576, 49152] -> log_softmax -> gather of the sampled
token, forward + backward (into both hidden and W), float32. The full [64, 2048, 49152] fp32
logits tensor is 25.8 GB, so it runs in chunks of rows and the chunk times are summed (a first,
untimed chunk warms up the allocator). The budget: each loss < 5% of that time.
Exits with status 1 if a loss is over budget.
"""

import argparse
import platform
import statistics
import sys
import time

from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from forge_core.losses import LOSS_CONFIGS, compute_loss, make_loss_config  # noqa: E402


def _loss_inputs(batch: int, seq: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(batch, seq, generator=g) * 3.0
    old = lp + 0.05 * torch.randn(batch, seq, generator=g)
    ref = lp + 0.05 * torch.randn(batch, seq, generator=g)
    lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    adv = torch.randn(batch, generator=g)
    return lp.to(dtype), old.to(dtype), ref.to(dtype), adv, mask


def time_loss(cfg, batch: int, seq: int, repeats: int, warmup: int, dtype=torch.float32) -> list[float]:
    """Seconds per forward+backward of ``compute_loss`` (list over repeats)."""
    lp, old, ref, adv, mask = _loss_inputs(batch, seq, dtype)
    leaf = lp.clone().requires_grad_(True)
    times = []
    for i in range(warmup + repeats):
        leaf.grad = None
        t0 = time.perf_counter()
        loss, _metrics = compute_loss(cfg, leaf, old, adv, mask, ref_logprobs=ref)
        loss.backward()
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
    return times


def time_logprobs(batch: int, seq: int, hidden: int, vocab: int, chunk_rows: int, rows: int) -> tuple[float, list[float]]:
    """Seconds for fwd+bwd of the logprobs of ``rows`` rows (in chunks), scaled to ``batch`` rows."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(chunk_rows * seq, hidden, generator=g).requires_grad_(True)
    w = (torch.randn(hidden, vocab, generator=g) * hidden**-0.5).requires_grad_(True)
    ids = torch.randint(0, vocab, (chunk_rows * seq, 1), generator=g)

    def chunk() -> float:
        t0 = time.perf_counter()
        logits = h @ w  # [chunk_rows * T, V]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids).squeeze(-1)
        logp.sum().backward()  # accumulates into h.grad and w.grad, as in training
        return time.perf_counter() - t0

    chunk()  # warm-up, not counted
    n_chunks = -(-rows // chunk_rows)
    chunk_times = [chunk() for _ in range(n_chunks)]
    measured_rows = n_chunks * chunk_rows
    return sum(chunk_times) * batch / measured_rows, chunk_times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--chunk-rows", type=int, default=2, help="rows of the logprob reference per chunk")
    p.add_argument("--logprob-rows", type=int, default=None,
                   help="rows of the logprob reference to time (default: all); fewer are scaled to --batch")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--budget", type=float, default=0.05, help="max loss time as a fraction of the logprob time")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T, H, V = args.batch, args.seq, args.hidden, args.vocab
    rows = min(args.logprob_rows or B, B)

    cases = [(name, make_loss_config(name), torch.float32) for name in LOSS_CONFIGS]
    cases.append(("grpo (bf16 inputs)", make_loss_config("grpo"), torch.bfloat16))
    cases.append(("reinforce (TIS C=2)", make_loss_config("reinforce", tis_cap=2.0), torch.float32))
    results = []
    for label, cfg, dtype in cases:
        times = time_loss(cfg, B, T, args.repeats, args.warmup, dtype)
        results.append((label, cfg, statistics.median(times), min(times)))

    lp_total, chunk_times = time_logprobs(B, T, H, V, args.chunk_rows, rows)
    measured = len(chunk_times) * args.chunk_rows

    print(f"forge_core.losses benchmark  torch {torch.__version__}  {platform.processor() or platform.machine()}  "
          f"threads={torch.get_num_threads()}  device=cpu")
    print(f"loss inputs: logprobs/behaviour/ref [{B}, {T}] (fp32 unless noted), advantages [{B}], ragged mask "
          f"(lengths U[{T // 4}, {T}]); fwd+bwd incl. metrics; median (min) of {args.repeats} after {args.warmup} warm-up")
    how = (f"all {B} rows timed" if measured >= B else f"{measured} of {B} rows timed, scaled x{B / measured:g}")
    print(f"logprob reference: hidden [{B}, {T}, {H}] @ W [{H}, {V}] -> log_softmax -> gather, fwd+bwd, fp32; "
          f"in chunks of {args.chunk_rows} rows ({args.chunk_rows * T} tokens, logits [{args.chunk_rows * T}, {V}]), "
          f"chunk times summed ({how}; full fp32 logits [{B}, {T}, {V}] = {B * T * V * 4 / 1e9:.1f} GB)")
    print()
    header = f"{'loss':<22}{'aggregation':<15}{'beta':>6}{'fwd+bwd ms':>13}{'min ms':>10}{'% of logprobs':>15}  {'< ' + format(args.budget, '.0%'):>5}"
    print(header)
    print("-" * len(header))
    ok = True
    for label, cfg, med, best in results:
        frac = med / lp_total
        ok &= frac < args.budget
        print(f"{label:<22}{cfg.aggregation:<15}{cfg.beta:>6g}{med * 1e3:>13.2f}{best * 1e3:>10.2f}{frac:>14.3%}  "
              f"{'yes' if frac < args.budget else 'NO':>5}")
    print("-" * len(header))
    per_chunk = statistics.median(chunk_times)
    print(f"{'logprobs (reference)':<22}{'':<15}{'':>6}{lp_total * 1e3:>13.0f}{'':>10}{'100.000%':>15}  "
          f"({len(chunk_times)} chunks, median {per_chunk:.2f} s/chunk)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
