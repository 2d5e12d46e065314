"""Where the trainer's and the reference's GPU time goes: one training step and one reference
forward on the recipe's shape, in this process (no Monarch), under ``torch.profiler``.

    python -m benchmarks.profile_train [--model qwen3_1_7b] [--episodes 128] [--response 1024] [overrides ...]

Prints, for each of the two: wall seconds, tokens per second, the share of the wall time some CUDA
kernel was running (``gpu_busy``: below 1.0 the GPU waits for the host), and the kernels that take
the most time. One JSON line per part at the end (``{"part", "wall_s", "tok_s", "gpu_busy", "top"}``).
Needs one CUDA GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


def profiled(fn, tokens: int, top: int = 15) -> dict:
    """Run ``fn()`` once under the profiler; ``{"wall_s", "tok_s", "gpu_busy", "top"}``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, end = 0, None
    for a, b in spans:  # union of kernel intervals (us)
        if end is None or a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    span = (spans[-1][1] - spans[0][0]) if spans else 1
    rows = sorted(prof.key_averages(), key=lambda k: -k.device_time_total)[:top]
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=top, max_name_column_width=70), flush=True)
    return {"wall_s": wall, "tok_s": tokens / wall, "gpu_busy": busy / span, "gpu_span_s": span / 1e6,
            "top": [[r.key[:80], r.device_time_total / 1e6, r.count] for r in rows]}


def main() -> int:
    """Parse the command line, profile, print the tables and JSON lines; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3_1_7b")
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--response", type=int, default=0,
                   help="response tokens of every episode (0: the bench's synthetic lengths, 200-1024)")
    p.add_argument("--steps", type=int, default=2, help="warm-up steps before the profiled one")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()

    from benchmarks.bench_gpu import overrides, synthetic_episodes
    from forge_core.actors.reference import Reference
    from forge_core.actors.trainer import Trainer
    from forge_core.config import TrainerConfig, load_config, to_dataclass
    from forge_core.losses import LossConfig
    from forge_core.models import ModelConfig

    recipe, ov = overrides(a.model, 1, "", a.overrides)
    cfg = load_config(recipe, ov)
    seq = cfg.generator.max_prompt_tokens + cfg.generator.max_response_tokens
    eps = synthetic_episodes(cfg, [], a.episodes, a.response)
    tokens = sum(len(e.prompt_ids) + len(e.response_ids) for e in eps)
    results = []

    t = Trainer.__new__(Trainer)
    Trainer.__init__(t, to_dataclass(cfg.trainer, TrainerConfig), to_dataclass(cfg.model, ModelConfig),
                     to_dataclass(cfg.loss, LossConfig), device="cuda", publish_dtype="bfloat16",
                     temperature=cfg.generator.temperature, max_response_tokens=cfg.generator.max_response_tokens,
                     seq_len=seq, seed=0, threads=4, gpus=[0], per_node=1)
    for _ in range(a.steps):
        m = t._train_step(eps)
        print(f"train step {m['train_s']:.2f} s, {m['tokens_per_s']:,.0f} tok/s, MFU {m['mfu']:.1%}", flush=True)
    results.append(dict(part="train", **profiled(lambda: t._train_step(eps), tokens)))
    del t
    import torch

    torch.cuda.empty_cache()
    r = Reference.__new__(Reference)
    Reference.__init__(r, to_dataclass(cfg.model, ModelConfig), device="cuda", dtype="bfloat16",
                       temperature=cfg.generator.temperature,
                       micro_batch_size=cfg.trainer.micro_batch_size, seq_len=seq, seed=0, threads=4, gpus=[0],
                       per_node=1, tokens_per_micro_batch=cfg.trainer.tokens_per_micro_batch,
                       logprob_chunk=cfg.trainer.logprob_chunk, compile=cfg.trainer.compile)
    fwd = Reference.__dict__["logprobs"]._method
    for _ in range(a.steps):
        print(f"reference {asyncio.run(fwd(r, eps))[1]:.2f} s", flush=True)
    results.append(dict(part="reference", **profiled(lambda: asyncio.run(fwd(r, eps)), tokens)))
    for res in results:
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
