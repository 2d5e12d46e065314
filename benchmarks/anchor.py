"""The anchor: a plain TorchTitan training step on the same tokens, as TorchTitan itself runs it.

    python -m benchmarks.anchor --model qwen3_1_7b --tokens 250000 [--seq-len 2048] [--rows 8] [--steps 3]
    torchrun --nproc-per-node 2 -m benchmarks.anchor --model qwen3_8b --tokens 250000   # FSDP2

TorchTitan's own best settings for a dense model: rows of ``--seq-len`` tokens with causal SDPA
attention, per-block ``torch.compile``, bf16 (autocast on one GPU; FSDP2 mixed precision, bf16 params
and fp32 reductions, over several), full logits and cross-entropy over every position, fused AdamW,
gradient accumulation over micro-batches of ``--rows`` rows, one optimizer step over ``--tokens``
tokens (the RL batch's prompt + response tokens). Prints one JSON line:
``{"anchor_tok_s", "anchor_step_s", "tokens", "world", "peak_mem_gb", "device"}`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def run(model: str, tokens: int, seq_len: int = 2048, rows: int = 8, steps: int = 3, ac: bool = False) -> dict:
    """Time ``steps`` optimizer steps (the best one counts) of ``tokens`` tokens each; returns the
    JSON fields of the module docstring. Needs CUDA; ``torch.distributed`` env for several ranks."""
    import torch

    from forge_core import titan

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl")
    spec = titan.titan_model_args(model, max_seq_len=max(4096, seq_len))
    par = titan.parallelize_fn(spec, world, 1, ac, seq_len, compile=True)
    m = titan.build_model(spec, torch.device("cuda"), 0, par)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-6, fused=True)
    n_rows = -(-tokens // seq_len) // world  # this rank's rows
    V = spec.hf["vocab_size"]
    g = torch.Generator(device="cuda").manual_seed(rank)
    data = torch.randint(0, V, (n_rows, seq_len + 1), device="cuda", generator=g)
    times = []
    for _ in range(steps + 1):  # the first step compiles
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(0, n_rows, rows):
            x, y = data[i:i + rows, :-1], data[i:i + rows, 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=world == 1):
                logits = m(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            (loss * x.shape[0] / n_rows).backward()
            del logits
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    best = min(times[1:])
    total = n_rows * world * seq_len
    return {"anchor_tok_s": total / best, "anchor_step_s": best, "tokens": total, "world": world,
            "compile_step_s": times[0], "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
            "device": f"{torch.cuda.get_device_name(0)} x{world}", "ac": ac}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3_1_7b")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ac", action="store_true")
    a = p.parse_args()
    r = run(a.model, a.tokens, a.seq_len, a.rows, a.steps, a.ac)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
