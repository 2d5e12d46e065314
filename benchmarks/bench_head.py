"""The output layer and the token logprobs alone, forward and backward, at a model's shape: the part
of a training step where the trainer and the anchor (:mod:`benchmarks.anchor`) differ most.

    python -m benchmarks.bench_head [--model qwen3_1_7b] [--positions 11358] [--full 16384] [--repeats 5]
                                    [--out head.json]

bf16 hidden states ``[N, d]`` and output weight ``[V, d]`` (random, the model's d and V), targets at
random, one upstream gradient per position (as a policy-gradient loss gives). Rows, each the median
of ``--repeats`` timed forward + backward passes after two untimed ones:

- ``chunked, eager`` / ``chunked, fused``: :func:`forge_core.packing.chunked_logprobs` on ``N``
  response positions, the element-wise work per chunk as eager ops or as compiled kernels (the
  trainer's default on CUDA);
- ``cut-cross-entropy``: Apple's ``linear_cross_entropy(reduction="none", filter_eps=None)`` (the
  exact gradient) on the same ``N`` positions, if the package is installed;
- ``liger``: Liger Kernel's ``LigerFusedLinearCrossEntropyLoss(reduction="none")`` on the same ``N``
  positions, if installed;
- ``anchor: full logits + compiled cross-entropy``: TorchTitan's way, bf16 logits on all ``--full``
  positions of a micro-batch, then the compiled float32 cross-entropy.

Each row also gives its peak extra memory and its largest logprob difference from a float32
reference on the first 1,024 positions. Needs one CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median seconds of ``fn()`` (after two untimed calls) and its peak extra GPU memory in GB."""
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), (torch.cuda.max_memory_allocated() - base) / 1e9


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3_1_7b")
    p.add_argument("--positions", type=int, default=11358, help="response positions per micro-batch (ours)")
    p.add_argument("--full", type=int, default=16384, help="positions per micro-batch (the anchor's logits)")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="")
    a = p.parse_args()

    import torch
    import torch.nn.functional as F

    from forge_core import titan
    from forge_core.packing import chunked_logprobs

    spec = titan.titan_model_args(a.model)
    d, V = spec.args.dim, spec.args.vocab_size
    dev = torch.device("cuda")
    torch.manual_seed(0)
    N = a.positions
    h = (torch.randn(N, d, device=dev) / 2).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, d, device=dev) * d ** -0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(V, (N,), device=dev)
    up = torch.randn(N, device=dev)
    n_ref = min(N, 1024)
    ref = torch.log_softmax(h[:n_ref].detach().float() @ w.detach().float().T, -1).gather(1, y[:n_ref, None]).squeeze(1)

    def run(lp_fn):
        h.grad = w.grad = None
        lp = lp_fn()
        (lp * up).sum().backward()
        return lp

    rows = []

    def add(name, positions, lp_fn):
        try:
            err = float((run(lp_fn)[:n_ref].detach().float() - ref).abs().max()) if positions == N else float("nan")
            s, mem = timed(lambda: run(lp_fn), a.repeats)
        except Exception as e:  # a missing or failing library: a row saying so
            rows.append(dict(what=name, failed=f"{type(e).__name__}: {str(e)[:200]}"))
            print(f"| {name} | failed: {rows[-1]['failed']} |", flush=True)
            return
        tflop = 6 * d * V * positions / 1e12  # forward 2 d V + backward 4 d V per position
        rows.append(dict(what=name, positions=positions, s=s, tflops=tflop / s, peak_extra_gb=mem, max_abs_err=err))
        print(f"| {name} | {positions:,} | {s * 1e3:.1f} ms | {tflop / s:.0f} TFLOP/s | {mem:.2f} GB | {err:.3g} |",
              flush=True)

    print(f"{a.model}: d={d}, V={V}, {torch.cuda.get_device_name(0)}, torch {torch.__version__}\n"
          "| what | positions | fwd+bwd | TFLOP/s (6 d V N) | peak extra | max abs err vs fp32 |\n|---|---|---|---|---|---|")
    add("chunked, eager element-wise", N, lambda: chunked_logprobs(h, w, y, 1.0, a.chunk, fused=False))
    add("chunked, fused element-wise (compiled)", N, lambda: chunked_logprobs(h, w, y, 1.0, a.chunk, fused=True))
    try:
        from cut_cross_entropy import linear_cross_entropy

        add("cut-cross-entropy (exact gradient)", N,
            lambda: -linear_cross_entropy(h, w, y, reduction="none", filter_eps=None))
    except ImportError as e:
        rows.append(dict(what="cut-cross-entropy", failed=f"not installed ({e})"))
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="none")
        add("liger fused linear cross-entropy", N, lambda: -liger(w, h, y))
    except ImportError as e:
        rows.append(dict(what="liger", failed=f"not installed ({e})"))

    hf = (torch.randn(a.full, d, device=dev) / 2).to(torch.bfloat16).requires_grad_()
    yf = torch.randint(V, (a.full,), device=dev)
    yf[torch.rand(a.full, device=dev) > N / a.full] = -100  # positions outside the loss
    ce = torch.compile(lambda logits, t: F.cross_entropy(logits.float(), t, ignore_index=-100, reduction="sum"))

    def anchor():
        hf.grad = w.grad = None
        ce(hf @ w.T, yf).backward()
        return torch.zeros(N, device=dev)

    try:
        s, mem = timed(anchor, a.repeats)
        tflop = 6 * d * V * a.full / 1e12
        rows.append(dict(what="anchor: full logits + compiled cross-entropy", positions=a.full, s=s,
                         tflops=tflop / s, peak_extra_gb=mem))
        print(f"| anchor: full logits + compiled cross-entropy | {a.full:,} | {s * 1e3:.1f} ms | {tflop / s:.0f} "
              f"TFLOP/s | {mem:.2f} GB | |", flush=True)
    except Exception as e:
        rows.append(dict(what="anchor", failed=f"{type(e).__name__}: {str(e)[:200]}"))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(model=a.model, device=torch.cuda.get_device_name(0), rows=rows), f, indent=1)
    return 1 if any("failed" in r and "not installed" not in r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
