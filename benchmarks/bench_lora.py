"""LoRA vs the full fine-tune on one GPU: the trainer's peak memory and step time, and the weight sync
(merged adapters vs full weights), as a table and JSON.

    python -m benchmarks.bench_lora [--model qwen3_8b] [--small qwen3_8b_8l] [--rank 16] [--sections train,sync | vllm | vllm_lora]
                                    [--episodes 64] [--ac 1] [--out bench_lora.json] [overrides ...]
    python -m benchmarks.bench_lora --device cpu --model tiny_llama --small ""   # a smoke test on a CPU

On one H100 the two sections took more than 10 minutes together (2026-11-26): run them as two calls
(``--sections train``, then ``--sections sync``) where a call has a time limit.

Real actors (:mod:`forge_core.services`), random weights of the model's shape (``model.init=random``),
recipe ``qwen3_8b_lora``'s settings (packing 16,384 tokens per micro-batch, compile) with ``--rank``
and ``trainer.lora.rank=0`` for the full fine-tune; every trainer runs alone on GPU 0.

- ``train``: ``--episodes`` synthetic episodes (prompts 120-260 tokens, responses up to
  ``generator.max_response_tokens``, +-1 advantages; the same for every row), three optimizer steps,
  the best of the last two: seconds per step, tokens/s and the process's peak GPU memory
  (``torch.cuda.max_memory_allocated``), for ``--model`` and for ``--small`` (the same layer shapes with
  fewer layers, where the full fine-tune's AdamW state fits one GPU: Qwen3-8B's full fine-tune needs
  16 bytes a parameter, 131 GB, before activations). Activation checkpointing ``--ac`` for every row.
  A trainer that runs out of memory is a row saying so (not a failure of the benchmark).
- ``sync``: a generator (vLLM on GPU 0, colocated as recipe qwen3_8b_lora) and a trainer; three
  syncs: ``publish`` (gather, merge ``W + scale * B @ A`` with LoRA, cast to bf16 into the staging
  buffer; caller-timed) and the engine's load (``update_weights``' own ``sync_s``), seconds and bytes
  moved; the adapters' own bytes in the same dtype beside (what an adapter-only path moves).
- ``vllm`` and ``vllm_lora`` (one per process: each holds an engine): what an adapter-only sync would
  cost instead: raw vLLM generation tok/s without LoRA (the engine the merged sync feeds) and with a
  LoRA adapter (``enable_lora``), and the seconds to write and load a new adapter per policy version.

A row whose value starts with "failed" makes the exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time

ROWS: list = []


def device_name() -> str:
    """``<GPU name> x<count>`` or, without CUDA, the CPU's model name and core count."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    try:
        model = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "CPU"
    return f"{model} ({len(os.sched_getaffinity(0))} cores)"


def row(what: str, value: str, **kw) -> None:
    """Print one table row and keep it (``ROWS``)."""
    ROWS.append(dict(what=what, value=value, device=device_name(), **kw))
    print(f"| {what} | {value} | {ROWS[-1]['device']} |", flush=True)


def config(a, model: str, rank: int, extra: tuple = ()):
    """The run config of ``model`` (random weights) with LoRA of ``rank`` (0: the full fine-tune)."""
    from forge_core.config import load_config

    if a.device == "cpu":
        recipe, ov = "smollm2_135m", ["generator.max_response_tokens=64", "generator.max_prompt_tokens=256",
                                      "trainer.micro_batch_size=8", "generator.dtype=float32"]
    else:
        recipe, ov = "qwen3_8b_lora", [f"trainer.activation_checkpointing={bool(a.ac)}",
                                       "generator.gpu_memory_utilization=0.3"]
    return load_config(recipe, [f"model.name={model}", "model.init=random", f"trainer.lora.rank={rank}",
                                f"trainer.lora.alpha={2 * rank or 1}", f"data.dir={a.data}", *ov, *extra, *a.overrides])


async def train_rows(a, model: str) -> None:
    """The ``train`` section for ``model``: LoRA of ``--rank``, then the full fine-tune."""
    import torch

    from forge_core.layout import plan_layout
    from forge_core.services import call, spawn_service
    from benchmarks.bench_gpu import synthetic_episodes

    for rank in (a.rank, 0):
        cfg = config(a, model, rank)
        eps = synthetic_episodes(cfg, [], n=a.episodes, response=32 if a.device == "cpu" else 0)
        tokens = sum(len(e.prompt_ids) + len(e.response_ids) for e in eps)
        what = f"{model} trainer, {'LoRA rank ' + str(rank) if rank else 'full fine-tune'}"
        t = None
        try:
            t = await spawn_service(cfg, "trainer", plan_layout(cfg).trainer, plan_layout(cfg))
            ms = [await call("trainer", t.train_step, eps) for _ in range(3)]
            m = min(ms[1:], key=lambda x: x["train_s"])
            peak = m.get("peak_mem_gb")
            row(f"{what} ({len(eps)} episodes, {tokens} tokens a step)",
                f"{m['train_s']:.2f} s/step  {m['tokens_per_s']:,.0f} tok/s"
                + (f"  peak {peak:.1f} GB" if peak is not None else ""),
                section="train", model=model, lora_rank=rank, step_s=m["train_s"], tok_s=m["tokens_per_s"],
                peak_mem_gb=peak, tokens=tokens, steps_s=[x["train_s"] for x in ms], mfu=m.get("mfu"))
        except Exception as e:
            msg = str(e)
            at = max(msg.rfind(k) for k in ("out of GPU memory", "OutOfMemory", "CUDA out of memory"))
            row(what, f"does not fit: {msg[at:at + 200]}" if at >= 0 else f"failed: {msg[-300:]}",
                section="train", model=model, lora_rank=rank, oom=at >= 0)
        finally:
            if t is not None:
                await t.stop(60)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


async def sync_rows(a, model: str) -> None:
    """The ``sync`` section for ``model``: merged LoRA weights, then the full fine-tune's."""
    import torch

    from forge_core import lora
    from forge_core.layout import plan_layout
    from forge_core.models import hf_config_dict
    from forge_core.services import call, clip, spawn_service

    for rank in (a.rank, 0):
        cfg = config(a, model, rank, ("trainer.compile=false",))  # no training here: no compile to wait for
        plan = plan_layout(cfg)
        what = f"{model} weight sync, {'LoRA rank ' + str(rank) + ' merged' if rank else 'full fine-tune'}"
        g = t = None
        try:
            g = await spawn_service(cfg, "generator", plan.generators[0], plan)  # the engine first (colocated)
            t = await spawn_service(cfg, "trainer", plan.trainer, plan)
            dtype = await call("generator", g.get_dtype)
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                h = await call("trainer", t.publish, False, 0, 0, dtype)
                pub = time.perf_counter() - t0
                r = await call("generator", g.update_weights, h)
                runs.append((pub, r["sync_s"], h.nbytes))
            if await call("generator", g.weights_digest) != await call("trainer", t.weights_digest):
                raise RuntimeError("the generator's weights differ from the trainer's published ones")
            pub, load, nbytes = min(runs, key=lambda x: x[0] + x[1])
            size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            adapter_bytes = lora.num_params(hf_config_dict(model), cfg.trainer.lora) * size if rank else 0
            row(what, f"publish {pub:.3f} s + load {load:.3f} s, {nbytes / 1e9:.3f} GB {dtype} moved"
                + (f" (the adapters alone: {adapter_bytes / 1e6:.2f} MB)" if rank else ""),
                section="sync", model=model, lora_rank=rank, publish_s=pub, load_s=load, bytes=nbytes,
                adapter_bytes=adapter_bytes, runs=runs)
        except Exception as e:
            row(what, f"failed: {clip(str(e), 300)}", section="sync", model=model, lora_rank=rank)
        finally:
            for s in (t, g):
                if s is not None:
                    await s.stop(60)


def random_peft_adapter(model: str, cfg, path: str, seed: int) -> int:
    """Write a PEFT adapter of ``cfg.trainer.lora`` for ``model``'s HF layout to ``path`` (A as LoRA's
    initialisation, B non-zero so that the adapter changes the outputs), bf16; returns its bytes."""
    import torch

    from forge_core import lora
    from forge_core.models import hf_config_dict
    from forge_core.titan import hf_layout

    g = torch.Generator().manual_seed(seed)
    r, tensors = cfg.trainer.lora.rank, {}
    for name, shape, _ in hf_layout(hf_config_dict(model)):
        m = name.rsplit(".", 2)
        if len(m) == 3 and m[1] in cfg.trainer.lora.target_modules and m[2] == "weight":
            key = lora.peft_key(name[:-len(".weight")])
            tensors[f"{key}.lora_A.weight"] = (torch.randn(r, shape[1], generator=g) * shape[1] ** -0.5).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(shape[0], r, generator=g) * 1e-3).bfloat16()
    lora.save_peft(path, tensors, cfg.trainer.lora, None)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def vllm_rows(a, model: str, adapters: bool) -> None:
    """The ``vllm`` / ``vllm_lora`` sections: raw ``LLM.generate`` tok/s of one engine on ``model``'s shape
    (dummy weights, ``--prompts`` x 8 samples x 1,024 new tokens, ``ignore_eos``), without LoRA (what the
    merged sync serves) or, with ``adapters``, an engine with ``enable_lora`` serving a new rank-``--rank``
    adapter per policy version: the seconds to write the adapter (PEFT safetensors) and to load it
    (``add_lora``), and the tok/s with it. Run the two as separate processes (one engine per process)."""
    import tempfile

    import torch
    from vllm import LLM, SamplingParams

    from forge_core.actors.vllm_generator import vllm_model_dir

    cfg = config(a, model, a.rank)
    kw = dict(enable_lora=True, max_lora_rank=a.rank, max_loras=1) if adapters else {}
    llm = LLM(model=vllm_model_dir(model, 2048), skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
              gpu_memory_utilization=0.85, max_model_len=2048, seed=0, **kw)
    g = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [{"prompt_token_ids": torch.randint(100, vocab - 100, (256,), generator=g).tolist()}
               for _ in range(a.prompts)]
    sp = SamplingParams(n=8, temperature=1.0, max_tokens=1024, ignore_eos=True)
    what = f"{model} raw vLLM generation ({a.prompts}x8x1024)"

    def rate(req=None, warm: bool = False) -> float:
        """Tokens per second of one ``generate`` of every prompt (after a short untimed one if ``warm``)."""
        if warm:
            llm.generate(prompts[:2], SamplingParams(max_tokens=16), lora_request=req, use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, lora_request=req, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t0)

    if not adapters:
        runs = [rate(warm=True), rate()]
        row(f"{what}, no LoRA (merged weights)", f"{max(runs):,.0f} tok/s", section="vllm", model=model,
            tok_s=max(runs), runs=runs)
        return
    from vllm.lora.request import LoRARequest

    runs, loads, writes = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for version in (1, 2, 3):  # a new adapter id per policy version, as a sync would load it
            path = os.path.join(tmp, f"v{version}")
            t0 = time.perf_counter()
            nbytes = random_peft_adapter(model, cfg, path, version)
            writes.append(time.perf_counter() - t0)
            req = LoRARequest(f"policy-v{version}", version, path)
            t0 = time.perf_counter()
            llm.llm_engine.add_lora(req)
            loads.append(time.perf_counter() - t0)
            runs.append(rate(req, warm=version == 1))
            if version > 1:
                llm.llm_engine.remove_lora(version - 1)
    row(f"{what}, LoRA rank {a.rank} adapter (enable_lora)",
        f"{max(runs):,.0f} tok/s; adapter write {min(writes):.3f} s + add_lora {min(loads):.3f} s, "
        f"{nbytes / 1e6:.1f} MB", section="vllm_lora", model=model, tok_s=max(runs), runs=runs,
        load_s=loads, write_s=writes, adapter_bytes=nbytes)


async def bench(a) -> None:
    """The ``--sections`` asked for: ``train`` for ``--model`` and ``--small``, ``sync``, ``vllm`` and
    ``vllm_lora`` for ``--model``."""
    secs = a.sections.split(",")
    for model in [m for m in (a.model, a.small) if m]:
        if "train" in secs:
            await train_rows(a, model)
    if "sync" in secs:
        await sync_rows(a, a.model)
    for sec in ("vllm", "vllm_lora"):
        if sec in secs:
            try:
                vllm_rows(a, a.model, sec == "vllm_lora")
            except Exception as e:
                row(f"{a.model} {sec}", f"failed: {type(e).__name__}: {str(e)[:300]}", section=sec, model=a.model)


def main() -> int:
    """Parse the arguments, run :func:`bench`, print the table, write ``--out``. Returns the exit code:
    1 when a row failed (out of memory is a result, not a failure)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3_8b")
    p.add_argument("--small", default="qwen3_8b_8l", help="a shape whose full fine-tune fits one GPU ('' : none)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--sections", default="train,sync")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--prompts", type=int, default=16, help="vllm sections: prompts (x 8 samples x 1,024 tokens)")
    p.add_argument("--ac", type=int, default=1, help="activation checkpointing for every trainer row (GPU)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--data", default=os.environ.get("GSM8K_DIR", ""))
    p.add_argument("--out", default="")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    if bad := sorted(set(a.sections.split(",")) - {"train", "sync", "vllm", "vllm_lora"}):
        p.error(f"--sections: {', '.join(bad)} is not one of train, sync, vllm, vllm_lora")
    print("| what | value | device |\n|---|---|---|", flush=True)
    try:
        asyncio.run(bench(a))
    finally:
        print(f"\n## bench_lora {a.model} (rank {a.rank}) on one {a.device.upper()}, {time.strftime('%Y-%m-%d')}\n"
              f"| what | value | device |\n|---|---|---|")
        for r in ROWS:
            print(f"| {r['what']} | {r['value']} | {r['device']} |")
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"args": vars(a), "rows": ROWS}, f, indent=1, default=str)
    failed = [r["what"] for r in ROWS if str(r["value"]).startswith("failed")]
    if failed:
        print(f"{len(failed)} row(s) failed: {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
