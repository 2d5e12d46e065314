"""GPU benchmark (``make bench``): one table, every row naming the device it ran on.

    python -m benchmarks.bench_gpu [--model qwen3_1_7b] [--gpus 1] [--steps 2] [--out bench.json]

Real actors (:func:`forge_core.controller.spawn_services`), the recipe's shape with random
weights (``model.init=random``), GSM8K prompts, 16 prompts x G=8, up to 1024 new tokens:

- generator tokens/s through our actor (caller-timed: chat-formatted token prompts in, Episode
  objects back over Monarch) against raw ``LLM.generate`` in the same engine on the same prompts
  (``ignore_eos``, so both produce exactly 16 x 8 x 1024 tokens);
- weight sync: trainer publish (cast + copy into the staging buffer) and the generator's in-place
  ``load_weights`` from CUDA IPC (same GPU or peer GPU), seconds and GB/s, bit-for-bit checked;
- trainer tokens/s (prompt + response tokens through forward + backward) and MFU (6N + attention
  FLOPs over the bf16 datasheet peak);
- full GRPO step: generate -> reward -> reference logprobs -> advantages -> train -> publish ->
  sync, as the controller runs it with ``max_staleness=0`` (colocated: with sleep/wake).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time


def cfg_overrides(model: str, gpus: int, data_dir: str, extra: list) -> list:
    if gpus == 1:
        lay = ["layout.gpus_per_node=1", "max_staleness=0", "generator.gpu_memory_utilization=0.35",
               "trainer.activation_checkpointing=true"]
    elif gpus == 2:
        lay = ["layout.gpus_per_node=2", "layout.generator.gpus=1", "layout.trainer.gpus=1", "layout.reference.gpus=0",
               "generator.gpu_memory_utilization=0.8", "max_staleness=0", "trainer.activation_checkpointing=true"]
    else:
        lay = [f"layout.gpus_per_node={gpus}", "layout.generator.gpus=1", f"layout.trainer.gpus={gpus - 2}",
               "layout.reference.gpus=1", "generator.gpu_memory_utilization=0.8", "max_staleness=0",
               "trainer.activation_checkpointing=true"]
    # one node: a multi-node recipe (llama3_8b) is measured with every role on node 0
    lay += ["layout.nodes=1", "layout.generator.host=0", "layout.trainer.host=0", "layout.reference.host=0"]
    return ["model.init=random", "prompts_per_step=16", "generator.group_size=8", "generator.max_response_tokens=1024",
            "generator.max_prompt_tokens=1024", "trainer.micro_batch_size=8", f"data.dir={data_dir}", *lay, *extra]


async def bench(model: str, gpus: int, steps: int, data_dir: str, extra: list) -> list:
    import torch

    from forge_core.config import load_config
    from forge_core.controller import call, spawn_services
    from forge_core.data import PromptSource, chat_prompt, load_gsm8k
    from forge_core.losses import compute_advantages
    from forge_core.models import load_tokenizer

    dev = f"{torch.cuda.get_device_name(0)} x{gpus}"
    rows = []

    def row(what, value, target="", **kw):
        rows.append(dict(what=what, value=value, target=target, device=dev, **kw))
        print(f"| {what} | {value} | {target} | {dev} |", flush=True)

    recipe = model if model in ("qwen3_1_7b", "qwen3_8b", "llama3_8b") else "qwen3_1_7b"
    cfg = load_config(recipe, cfg_overrides(model, gpus, data_dir, [f"model.name={model}"] + extra))
    t0 = time.perf_counter()
    svc = await spawn_services(cfg)
    try:
        h0 = await call("trainer", svc.trainer.publish)
        await call("reference", svc.reference.load_initial, h0)
        await call("generator", svc.generator.update_weights, h0)
        row("start-up (engine, trainer, reference, first sync)", f"{time.perf_counter() - t0:.0f} s")
        tok = load_tokenizer(cfg.model)
        src = PromptSource(load_gsm8k("train", data_dir), 0)
        probs = src.next_batch(16)
        prompts = [tok(chat_prompt(tok, p.question, cfg.data.system_prompt), add_special_tokens=False).input_ids
                   for p in probs]
        G, R = cfg.generator.group_size, cfg.generator.max_response_tokens
        await call("generator", svc.generator.bench_raw, prompts[:4], 2, 32)  # warm-up
        raw, ours = [], []
        for _ in range(int(os.environ.get('BENCH_REPEATS', '2'))):
            raw.append(await call("generator", svc.generator.bench_raw, prompts, G, R))
            ta = time.perf_counter()
            eps, a = await call("generator", svc.generator.bench_actor, prompts, G, R)
            ours.append(a["tokens"] / (time.perf_counter() - ta))
        raw_ts = max(r["tok_s"] for r in raw)
        our_ts = max(ours)
        row(f"generator tok/s, raw vLLM LLM.generate ({len(prompts)}x{G}x{R})", f"{raw_ts:,.0f}", "", tokens=raw[0]["tokens"])
        row("generator tok/s through our actor (same engine, same prompts)", f"{our_ts:,.0f} ({our_ts / raw_ts:.1%} of raw)",
            ">= 90% of raw", ratio=our_ts / raw_ts)
        await call("generator", svc.generator.release)
        # trainer throughput on the generated batch (random advantages, reference = behaviour)
        import random

        rnd = random.Random(0)
        for e in eps:
            e.advantage = rnd.choice([-1.0, 1.0])
            e.ref_logprobs = list(e.behaviour_logprobs)
        ms = []
        for _ in range(int(os.environ.get('BENCH_REPEATS', '2'))):
            ms.append(await call("trainer", svc.trainer.train_step, eps))
        m = ms[-1]
        row(f"trainer tok/s ({len(eps)} seqs, {m['seq_tokens']:.0f} tokens, AC={cfg.trainer.activation_checkpointing})",
            f"{m['tokens_per_s']:,.0f}  MFU {m['mfu']:.1%}  ({m['train_s']:.2f} s/step, peak {m['peak_mem_gb']:.0f} GB)", "")
        # weight sync
        syncs, pubs = [], []
        for _ in range(3):
            tp = time.perf_counter()
            h = await call("trainer", svc.trainer.publish)
            pubs.append(time.perf_counter() - tp)
            ts = time.perf_counter()
            r = await call("generator", svc.generator.update_weights, h)
            syncs.append((r, time.perf_counter() - ts))
        best = min(syncs, key=lambda x: x[0]["sync_s"])
        gb = h.nbytes / 1e9
        row(f"weight sync, {gb:.2f} GB {h.dtype}, {best[0]['mode']}: in-place load_weights + prefix-cache reset",
            f"{best[0]['sync_s']:.3f} s  {gb / best[0]['sync_s']:.2f} GB/s",
            "<= 0.2 s in a node" if best[0]["mode"].startswith("ipc") else "(the cross-node path)")
        row("weight sync end to end (publish: gather+cast+copy; update call incl. wake and actor messages)",
            f"{min(pubs):.3f} s + {min(s for _, s in syncs):.3f} s", "")
        dt, dg = await call("trainer", svc.trainer.weights_digest), await call("generator", svc.generator.weights_digest)
        row("generator weights == trainer weights cast to bf16 (sha256)", "bit-identical" if dt == dg and dt else
            f"DIFFERENT {dt[:8]} {dg[:8]}", "bitwise")
        # full GRPO steps
        times = []
        for k in range(steps):
            parts = {}
            ts = time.perf_counter()
            eps, st = await call("generator", svc.generator.generate, src.next_batch(16), 1000 + k)
            parts["generate"] = time.perf_counter() - ts
            t1 = time.perf_counter()
            eps = await call("reward", svc.reward.score, eps)
            eps, _ = await call("reference", svc.reference.logprobs, eps)
            parts["reward+ref"] = time.perf_counter() - t1
            rewards = torch.tensor([e.reward for e in eps]).view(-1, G)
            adv, _, _ = compute_advantages(rewards, cfg.advantage)
            for e, a in zip(eps, adv.flatten().tolist()):
                e.advantage = a if any(adv.flatten()) else rnd.choice([-1.0, 1.0])  # random weights: no reward signal
            t2 = time.perf_counter()
            m = await call("trainer", svc.trainer.train_step, eps)
            parts["train"] = time.perf_counter() - t2
            t3 = time.perf_counter()
            h = await call("trainer", svc.trainer.publish)
            r = await call("generator", svc.generator.update_weights, h)
            parts["publish+sync"] = time.perf_counter() - t3
            times.append((time.perf_counter() - ts, parts, st, m))
        tot, parts, st, m = min(times, key=lambda x: x[0])
        ntok = st["gen_tokens"]
        row(f"full GRPO step (16 prompts x 8 x up to {R} tokens; {ntok} generated)",
            f"{tot:.1f} s  (" + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + f"; sleep {st['sleep_s']:.1f}, "
            f"wake {st['wake_s'] + r.get('wake_s', 0):.1f})", "<= 20 s on one H100", step_s=tot, parts=parts)
    finally:
        await svc.stop(60)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3_1_7b")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--data", default=os.environ.get("GSM8K_DIR", ""))
    p.add_argument("--out", default="")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    print("| what | value | target | device |\n|---|---|---|---|", flush=True)
    rows = asyncio.run(bench(a.model, a.gpus, a.steps, a.data, a.overrides))
    print(f"\n## bench {a.model} on {a.gpus} GPU(s), {time.strftime('%Y-%m-%d')}\n| what | value | target | device |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['value']} | {r['target']} | {r['device']} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
