"""Benchmark: the embedded default's pieces on this CPU (``make bench-cpu``), as a table.

Run from the repository root::

    python -m benchmarks.bench_cpu                      # SmolLM2-135M, 4 prompts x 4 x 128 tokens
    python -m benchmarks.bench_cpu --prompts 8 --threads 1 2 --json /tmp/cpu.json

Rows, for each thread count (``torch.set_num_threads``):

- the dtype probe of :func:`forge_core.actors.process.matmul_probe` (``[64, 576] @ [576, 576]``, bf16 vs
  fp32, best of 5) and what ``dtype: auto`` picks from it;
- one decode step's attention in one layer, bf16 and fp32, SDPA's masked ``enable_gqa`` against query
  heads folded into their KV head's rows (:func:`decode_attention_ms`);
- generation (:func:`forge_core.actors.generator.hf_generate`: SDPA with ``enable_gqa`` under the
  padding mask, each prompt prefilled once per group) against transformers' plain path (its
  ``sdpa`` attention, which copies K/V per head group when a mask is present, and
  ``num_return_sequences``, which prefills every sample's prompt), same prompts, same seed,
  greedy=False, in the dtype ``auto`` picked: seconds and response tokens per second;
- the reference's logprobs (no grad) and the trainer's step (forward, backward, AdamW) on the
  generated episodes, padded micro-batches of 8 as the CPU trainer runs them: prompt + response
  tokens per second.

Prompts are GSM8K train questions when ``GSM8K_DIR`` names a local copy, else a fixed question.
Prints the CPU model and the flags that matter (avx2, avx512_bf16, amx_bf16) above the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from forge_core import titan
from forge_core.actors.process import matmul_probe
from forge_core.actors.generator import hf_generate
from forge_core.actors.trainer import logprobs_of, micro_batches
from forge_core.data import DEFAULT_SYSTEM_PROMPT, chat_prompt, load_jsonl
from forge_core.episode import Episode
from forge_core.models import GQA_SDPA, ModelConfig, load_model, load_tokenizer, pretrained_dir


def cpu_description() -> str:
    """``model name`` from /proc/cpuinfo and which of avx2 / avx512_bf16 / amx_bf16 it has."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512_bf16", "amx_bf16"))
    return f"{model} ({os.cpu_count()} cores; {have})"


def plain_generate(model, tok, prompts: list[str], n: int, max_new: int, temperature: float, seed: int) -> int:
    """transformers' own path: ``sdpa`` attention and ``num_return_sequences``. Returns tokens."""
    torch.manual_seed(seed)
    model.set_attn_implementation("sdpa")
    try:
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new, num_return_sequences=n, do_sample=True,
                                 temperature=temperature, top_k=0, pad_token_id=tok.pad_token_id)
        resp = out[:, enc.input_ids.shape[1]:]
        return int(((resp != tok.pad_token_id) & (resp != tok.eos_token_id)).sum())
    finally:
        model.set_attn_implementation(GQA_SDPA)


def decode_attention_ms(dtype: torch.dtype, fold: bool, batch: int = 16, keys: int = 300, reps: int = 50) -> float:
    """ms of one decode step's attention in one SmolLM2 layer (9 query heads over 3 KV heads, head dim
    64, ``keys`` cached positions, 20 of them padding): SDPA with ``enable_gqa``, or with each KV head's
    query heads folded into its rows (what :func:`forge_core.models.sdpa_gqa_attention` does in bf16)."""
    F = torch.nn.functional
    q, k, v = (torch.randn(batch, h, n, 64, dtype=dtype) for h, n in ((9, 1), (3, keys), (3, keys)))
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
    mask[..., :20] = False
    if fold:
        def step(): return F.scaled_dot_product_attention(q.reshape(batch, 3, 3, 64), k, v, attn_mask=mask)
    else:
        def step(): return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-response-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--skip-plain", action="store_true", help="no transformers-plain generation row")
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args()

    mc = ModelConfig(name="smollm2_135m")
    tok = load_tokenizer(mc)
    gsm = os.environ.get("GSM8K_DIR")
    questions = ([p.prompt for p in load_jsonl(os.path.join(gsm, "train.jsonl"))[:a.prompts]] if gsm else
                 ["Tom has 3 apples and buys 2 more. How many apples does he have now?"] * a.prompts)
    prompts = [chat_prompt(tok, q, DEFAULT_SYSTEM_PROMPT) for q in questions]
    print(f"CPU: {cpu_description()}; torch {torch.__version__}")
    rows = []

    def row(what: str, threads: int, value: str, **extra) -> None:
        rows.append(dict(what=what, threads=threads, value=value, **extra))
        print(f"| {what:<58} | {threads:>7} | {value:<44} |", flush=True)

    print(f"| {'what':<58} | threads | {'value':<44} |\n|{'-' * 60}|{'-' * 9}|{'-' * 46}|")
    for th in a.threads:
        torch.set_num_threads(th)
        bf16_s, fp32_s = matmul_probe(576)
        dtype = torch.bfloat16 if bf16_s <= fp32_s else torch.float32
        row("dtype probe 64x576 @ 576x576 (bf16 / fp32)", th,
            f"{bf16_s * 1e3:.2f} ms / {fp32_s * 1e3:.2f} ms -> {str(dtype).removeprefix('torch.')}",
            bf16_ms=bf16_s * 1e3, fp32_ms=fp32_s * 1e3)
        att = {(d, f): decode_attention_ms(d, f) for d in (torch.bfloat16, torch.float32) for f in (False, True)}
        row("decode attention 16x300 keys, enable_gqa / fold", th,
            f"bf16 {att[torch.bfloat16, False]:.2f} / {att[torch.bfloat16, True]:.2f} ms, "
            f"fp32 {att[torch.float32, False]:.2f} / {att[torch.float32, True]:.2f} ms",
            attention_ms={f"{str(d).removeprefix('torch.')}_{'fold' if f else 'gqa'}": ms for (d, f), ms in att.items()})
        model = load_model(mc, dtype=dtype)
        shape = f"{a.prompts}x{a.group_size}x{a.max_response_tokens}"
        t0 = time.perf_counter()
        outs = hf_generate(model, tok, prompts, a.group_size, a.max_response_tokens, 256, 0.7, seed=0,
                           stop_after_answer=False)
        dt = time.perf_counter() - t0
        ntok = sum(len(o["response_ids"]) for o in outs)
        row(f"generate {shape}, ours", th, f"{dt:.1f} s  {ntok / dt:.1f} tok/s", gen_s=dt, tok_s=ntok / dt)
        if not a.skip_plain:
            t0 = time.perf_counter()
            n = plain_generate(model, tok, prompts, a.group_size, a.max_response_tokens, 0.7, 0)
            dt2 = time.perf_counter() - t0
            row(f"generate {shape}, transformers sdpa + num_return_sequences", th,
                f"{dt2:.1f} s  {n / dt2:.1f} tok/s ({dt2 / dt:.1f}x ours)", gen_s=dt2, tok_s=n / dt2)
        del model
        eps = [Episode(prompt_id=str(i // a.group_size), group=i // a.group_size, target="",
                       prompt_ids=o["prompt_ids"], response_ids=o["response_ids"],
                       behaviour_logprobs=o["logprobs"], text="", policy_version=0) for i, o in enumerate(outs)]
        tokens = sum(len(e.prompt_ids) + len(e.response_ids) for e in eps)
        R = max(len(e.response_ids) for e in eps)
        spec = titan.titan_model_args("smollm2_135m")
        net = titan.build_model(spec, torch.device("cpu"), 0, None)
        if pretrained_dir(mc):
            titan.load_hf_dir(net, spec, pretrained_dir(mc))
        select = titan.PositionSelect(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-6)
        batches = micro_batches(eps, 0, 1, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            t0 = time.perf_counter()
            with torch.no_grad():
                for idx, _ in batches:
                    logprobs_of(net, eps, idx, R, temperature=0.7, device=torch.device("cpu"), budget=0, chunk=1024,
                                select=select)
            ref_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for idx, _ in batches:
                logprobs_of(net, eps, idx, R, temperature=0.7, device=torch.device("cpu"), budget=0, chunk=1024,
                            select=select).sum().backward()
        opt.step()
        train_s = time.perf_counter() - t0
        row(f"reference logprobs, {len(eps)} episodes ({tokens} tokens)", th,
            f"{ref_s:.1f} s  {tokens / ref_s:.0f} tok/s", ref_s=ref_s, tok_s=tokens / ref_s)
        row(f"trainer step (fwd+bwd+AdamW), {len(eps)} episodes", th,
            f"{train_s:.1f} s  {tokens / train_s:.0f} tok/s", train_s=train_s, tok_s=tokens / train_s)
        del net, opt
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(cpu=cpu_description(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
