"""GPU benchmark (``make bench``): one table, every row naming the device it ran on.

    python -m benchmarks.bench_gpu [--model qwen3_1_7b] [--gpus N] [--sections gen,scale,layouts,train,ref,sync]
                                   [--layouts 1x2,2x1] [--train-gpus N] [--train-ac 0,1] [--train-steps 2] [--anchor 0]
                                   [--out bench.json] [overrides ...]

Real actors (:mod:`forge_core.services`), the recipe's shape with random weights
(``model.init=random``), GSM8K prompts, 16 prompts x G=8, up to 1024 new tokens:

- ``gen``: generator tokens/s through our actor (caller-timed: token prompts in, Episode objects
  back over Monarch) against raw ``LLM.generate`` in the same engine on the same prompts
  (``ignore_eos``: both produce exactly 16 x 8 x 1024 tokens); colocated (1 GPU), also the engine
  right after a sleep and wake, as every colocated step generates.
- ``scale``: generator tok/s over 1, 2, ... replicas of TP=1 (``--gpus`` of them) on the same
  prompts (32 x 8 x 1024), groups spread by the controller's Dispatcher; the scaling efficiency;
  and every ``--layouts`` entry ``RxT`` (R replicas of TP=T) on the same prompts (e.g. ``1x2,2x1``).
- ``train``: our trainer's tokens/s on a batch of generated lengths (16 x 8 episodes, prompt +
  response tokens through forward and backward; packing, chunked logprobs, compile as configured),
  against the anchor (:mod:`benchmarks.anchor`: TorchTitan's own compiled step, FlexAttention
  block-causal and compiled cross-entropy with ``ignore_index``, on the same episodes packed into the
  same micro-batches of ``trainer.tokens_per_micro_batch`` tokens, same GPUs), once per activation
  checkpointing setting (``--train-ac``, both sides alike). MFU of each side from one FLOP formula
  (:func:`forge_core.titan.step_flops`): its executed FLOPs and the useful ones; ``anchor_ratio`` =
  ours / anchor tok/s (three significant digits, truncated). bf16 packed vs unpacked logprobs agree.
- ``ref``: the reference's forward on the same episodes, on a GPU of its own and sharded over the
  trainer's GPUs (where the reference should live).
- ``sync``: weight sync in the node (publish: gather + cast + copy; load: in-place ``load_weights``
  + prefix-cache reset), seconds and GB/s, bit for bit (every TP rank's shard).
The full GRPO step is measured by a real run (``launch.local``, metrics.jsonl): see benchmarks/gpu.sh.
A section that fails leaves a row saying so and the rest of the table goes on; the exit code is
then 1 (0 when every row measured what it names).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

ROWS: list = []


def row(what: str, value: str, target: str = "", **kw) -> None:
    """Print one table row and keep it (``ROWS``); a row whose value starts with "failed" (or with
    ``ok=False``) is a failure, and makes the benchmark exit 1."""
    import torch

    dev = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    ROWS.append(dict(what=what, value=value, target=target, device=dev, **kw))
    print(f"| {what} | {value} | {target} | {dev} |", flush=True)


def overrides(model: str, gpus: int, data_dir: str, extra: list) -> tuple[str, list]:
    """The recipe shape on this machine's ``gpus``: 1 GPU colocated; 2: generator | trainer with the
    reference sharded on it; more: generator | trainer FSDP | reference."""
    if gpus == 1:
        lay = ["layout.gpus_per_node=1", "layout.trainer.gpus=1", "layout.reference.gpus=0", "max_staleness=0",
               "generator.gpu_memory_utilization=0.35"]
    elif gpus == 2:
        lay = ["layout.gpus_per_node=2", "layout.trainer.gpus=1", "layout.reference.gpus=0"]
    else:
        lay = [f"layout.gpus_per_node={gpus}", f"layout.trainer.gpus={gpus - 2}", "layout.reference.gpus=1"]
    lay += ["layout.nodes=1", "layout.generator.host=0", "layout.generator.replicas=1", "layout.generator.tp=1",
            "layout.trainer.host=0", "layout.reference.host=0"]
    recipe = model if model in ("qwen3_1_7b", "qwen3_8b", "llama3_8b") else "qwen3_1_7b"
    return recipe, [f"model.name={model}", "model.init=random", "prompts_per_step=16", "generator.group_size=8",
                    "generator.max_response_tokens=1024", "generator.max_prompt_tokens=1024", f"data.dir={data_dir}",
                    *lay, *extra]


def prompts_of(cfg, n: int) -> list:
    from forge_core.data import PromptSource, chat_prompt, load_gsm8k
    from forge_core.models import load_tokenizer

    tok = load_tokenizer(cfg.model)
    probs = PromptSource(load_gsm8k("train", cfg.data.dir), 0).next_batch(n)
    return [tok(chat_prompt(tok, p, cfg.data.system_prompt), add_special_tokens=False).input_ids for p in probs]


async def gen_rate(gens: list, prompts: list, G: int, R: int) -> tuple[float, int]:
    """Aggregate tok/s of ``gens`` on ``prompts`` (whole groups per replica, the Dispatcher's split)."""
    from forge_core.controller import Dispatcher
    from forge_core.services import call

    plan = Dispatcher(len(gens)).assign(len(prompts), list(range(len(gens))))
    t0 = time.perf_counter()
    res = await asyncio.gather(*(call(gens[r].name, gens[r].bench, [prompts[i] for i in gs], G, R)
                                 for r, gs in plan.items()))
    dt = time.perf_counter() - t0
    tokens = sum(st["tokens"] for _, st in res)
    return tokens / dt, tokens


async def section_gen(cfg, prompts) -> list:
    from forge_core.layout import plan_layout
    from forge_core.services import call, spawn_service

    plan = plan_layout(cfg)
    g = await spawn_service(cfg, "generator", plan.generators[0], plan)
    try:
        G, R = cfg.generator.group_size, cfg.generator.max_response_tokens
        await call("generator", g.bench, prompts[:4], 2, 32)  # warm-up
        raw, ours, eps = [], [], []
        for _ in range(2):
            raw.append((await call("generator", g.bench, prompts, G, R))[1])
            t0 = time.perf_counter()
            eps, st = await call("generator", g.bench, prompts, G, R, True)
            ours.append(st["tokens"] / (time.perf_counter() - t0))
        raw_ts = max(r["tok_s"] for r in raw)
        row(f"generator tok/s, raw vLLM LLM.generate ({len(prompts)}x{G}x{R})", f"{raw_ts:,.0f}")
        row("generator tok/s through our actor (same engine, same prompts)",
            f"{max(ours):,.0f} ({max(ours) / raw_ts:.1%} of raw)", ">= 90% of raw", ratio=max(ours) / raw_ts)
        if (await call("generator", g.info))["colocated"]:  # as every colocated step: asleep, woken, generate
            woke = []
            for _ in range(2):
                await call("generator", g.release)
                woke.append((await call("generator", g.bench, prompts, G, R))[1]["tok_s"])
            row("generator tok/s right after sleep and wake (engine-timed, as each colocated step)",
                f"{max(woke):,.0f} ({max(woke) / raw_ts:.1%} of raw)", "", ratio=max(woke) / raw_ts,
                tok_s=woke)
        return eps
    finally:
        await g.stop(60)


async def section_scale(cfg, prompts, gpus: int, layouts: list, replicas: bool = True, repeats: int = 2) -> None:
    """Replica scaling (TP=1 replicas, 1..gpus) and RxT layouts, generators only (dummy weights).
    Two kinds of scaling: strong (the same ``prompts`` over k replicas) and fixed work per replica
    (the first ``len(prompts) // gpus`` prompts, repeated k times over k replicas: exactly k times
    the one replica's tokens, whatever the prompts' lengths).
    ``replicas=False``: the RxT layouts only. Each figure is the best of ``repeats`` runs."""
    from omegaconf import OmegaConf

    from forge_core.layout import Plan, Slot
    from forge_core.services import call, spawn_service

    G, R = cfg.generator.group_size, cfg.generator.max_response_tokens
    per = len(prompts) // gpus

    async def measure(replicas: int, tp: int, runs: list) -> list:
        """``runs``: (replicas used, number of prompts) pairs, a negative number ``-n`` meaning ``n``
        prompts made of the first ``per`` repeated; the best of ``repeats`` of each."""
        c = OmegaConf.merge(cfg, {"layout": {"gpus_per_node": gpus}})
        slots = [Slot(0, list(range(i * tp, (i + 1) * tp))) for i in range(replicas)]
        plan = Plan(slots, Slot(0, [gpus]), Slot(0, [gpus]), False, gpus)  # generators only
        gens = await asyncio.gather(*(spawn_service(c, "generator", s, plan, name=f"generator_{i}")
                                      for i, s in enumerate(slots)))
        try:
            await asyncio.gather(*(call(g.name, g.bench, prompts[:4], 2, 32) for g in gens))  # warm-up
            best: dict = {}
            for k, n in runs:  # a pair asked twice is measured once
                if (k, n) not in best:
                    ps = prompts[:n] if n > 0 else prompts[:per] * (-n // per)
                    best[k, n] = max([await gen_rate(gens[:k], ps, G, R) for _ in range(repeats)])
            rates = [best[k, n] for k, n in runs]
            if tp > 1:
                try:
                    await tp_weights_check(cfg, gens[0], tp)
                except Exception as e:  # the throughput above still counts: a row saying what failed
                    row(f"TP={tp} engine loads the trainer's bytes", f"failed: {str(e)[-300:]}", "bitwise", tp=tp, ok=False)
            return rates
        finally:
            for g in gens:
                await g.stop(60)

    ks = list(range(1, gpus + 1)) if replicas else []
    rates = [] if not ks else await measure(gpus, 1, [(k, len(prompts)) for k in ks] + [(k, -k * per) for k in ks])
    strong, fixed = rates[:gpus], rates[gpus:]
    for k, (ts, tok) in zip(ks, strong):
        eff = ts / (k * strong[0][0])
        row(f"generator tok/s, {k} replica(s) x TP=1, the same {len(prompts)}x{G}x{R} ({tok} tokens)",
            f"{ts:,.0f} ({eff:.0%} scaling efficiency)", ">= 90% per added replica", replicas=k, tok_s=ts,
            efficiency=eff, scaling="strong", prompts=len(prompts))
    for k, (ts, tok) in zip(ks, fixed):
        eff = ts / (k * fixed[0][0])
        row(f"generator tok/s, {k} replica(s) x TP=1, {per} prompts each ({k * per}x{G}x{R}, {tok} tokens)",
            f"{ts:,.0f} ({eff:.0%} scaling efficiency)", ">= 90% per added replica", replicas=k, tok_s=ts,
            efficiency=eff, scaling="fixed work per replica", prompts=k * per)
    for lay in layouts:
        r, t = (int(x) for x in lay.split("x"))
        ts, tok = (await measure(r, t, [(r, len(prompts))]))[0]
        row(f"generator tok/s, {r} replica(s) x TP={t} ({len(prompts)}x{G}x{R})", f"{ts:,.0f}", layout=lay, tok_s=ts)


async def tp_weights_check(cfg, g, tp: int) -> None:
    """Engine ``g`` of TP=``tp`` loads a version from a buffer of random HF-layout weights on GPU 0
    (this process plays the trainer); then every TP rank's shard is compared bit for bit."""
    import torch

    from forge_core import titan
    from forge_core.services import call
    from forge_core.weight_sync import StagingBuffer

    spec = titan.titan_model_args(cfg.model.name)
    buf = StagingBuffer(titan.hf_layout(spec.hf), torch.bfloat16, torch.device("cuda:0"))
    torch.manual_seed(0)
    buf.flat.normal_(0, 0.02)
    h = buf.handle(1)
    r = await call(g.name, g.update_weights, h)
    bad = await call(g.name, g.weights_match)
    row(f"TP={tp} engine loads {h.nbytes / 1e9:.1f} GB ({r['mode']}, {r['sync_s']:.3f} s); every rank's shard == "
        f"the trainer's bytes", "bit-identical" if not bad else f"DIFFERENT: {bad[:3]}", "bitwise", tp=tp, ok=not bad)
    buf.close()


def synthetic_episodes(cfg, eps_from_gen: list, n: int = 128, response: int = 0) -> list:
    """``n`` episodes with generated (or recipe-typical) lengths, random token ids, random +-1
    advantages and reference = behaviour logprobs. ``response`` > 0: every response that long
    (prompts still recipe-typical, 120-260 tokens)."""
    import random

    from forge_core.episode import Episode

    rnd = random.Random(0)
    V = 49152
    out = []
    for i in range(n):
        if eps_from_gen:
            src = eps_from_gen[i % len(eps_from_gen)]
            p, r = len(src.prompt_ids), len(src.response_ids)
        else:
            p, r = rnd.randint(120, 260), response or rnd.randint(200, cfg.generator.max_response_tokens)
        resp = [rnd.randrange(3, V) for _ in range(r)]
        out.append(Episode(prompt_id=str(i), group=i // cfg.generator.group_size, target="", text="",
                           prompt_ids=[rnd.randrange(3, V) for _ in range(p)], response_ids=resp,
                           behaviour_logprobs=[-2.0] * r, ref_logprobs=[-2.0] * r, policy_version=0,
                           advantage=rnd.choice([-1.0, 1.0])))
    return out


def anchor(model: str, episodes_path: str, budget: int, gpus: list, ac: bool, steps: int = 2,
           timeout: float = 420) -> dict:
    """:mod:`benchmarks.anchor` in a subprocess on ``gpus`` (torchrun over them when several): TorchTitan's
    own compiled step (FlexAttention block-causal, compiled cross-entropy) on the episodes saved at
    ``episodes_path`` (:func:`benchmarks.anchor.save_episodes`), packed as the trainer packs them into
    ``budget``-token rows, full activation checkpointing when ``ac``. Returns its JSON line.

    Raises:
        RuntimeError: the anchor failed or printed no JSON (its stderr's end, e.g. out of memory);
            subprocess.TimeoutExpired after ``timeout`` seconds.
    """
    args = ["-m", "benchmarks.anchor", "--model", model, "--episodes", episodes_path, "--tokens-per-micro-batch",
            str(budget), "--steps", str(steps), *(["--ac"] if ac else [])]
    cmd = [sys.executable, *args]
    if len(gpus) > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={len(gpus)}", *args]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in gpus))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode or not lines:
        err = [l for l in p.stderr.splitlines() if "Error" in l or "error" in l]
        raise RuntimeError(f"anchor failed ({p.returncode}): {(err[-1] if err else p.stderr[-300:])[:300]}")
    return json.loads(lines[-1])


async def section_train(cfg, eps_from_gen: list, train_gpus: int, ac_settings: tuple = (False, True),
                        steps: int = 2, with_anchor: bool = True) -> None:
    """Trainer (alone, on ``train_gpus`` GPUs, or the layout's) against the anchor on the same GPUs,
    once per activation-checkpointing setting (both sides with the same setting).

    The anchor (:mod:`benchmarks.anchor`) gets the trainer's exact episodes (token ids and lengths),
    packed by the trainer's own packing into rows of ``trainer.tokens_per_micro_batch`` tokens
    (the same micro-batches, the same loss positions). Both sides' tok/s count the episodes' prompt +
    response tokens (padding not); both MFUs come from :func:`benchmarks.anchor.plan_flops` (one
    formula, :func:`forge_core.titan.step_flops`): each side's executed FLOPs (ours: the output layer on
    response positions; the anchor: on every position, as TorchTitan's loss) and the useful FLOPs both
    must do. ``anchor_ratio`` = ours / anchor tok/s, printed truncated to three significant digits.
    ``with_anchor`` False: the trainer alone (say, with LoRA, which the anchor has no counterpart of;
    a LoRA row's MFU is the trainer's own, frozen weights counted at 4 N FLOPs a token).
    """
    import tempfile

    import torch
    from omegaconf import OmegaConf

    from benchmarks.anchor import mfu, plan_flops, ratio_text, save_episodes
    from forge_core import titan
    from forge_core.layout import Plan, Slot, plan_layout
    from forge_core.services import call, clip, spawn_service

    eps = synthetic_episodes(cfg, eps_from_gen)
    budget = int(cfg.trainer.tokens_per_micro_batch)
    tgpus = list(range(train_gpus)) if train_gpus else plan_layout(cfg).trainer.gpus
    world = len(tgpus)
    if not budget:
        row("trainer against the anchor", "failed: the anchor packs episodes as the trainer does; set "
            "trainer.tokens_per_micro_batch > 0 (the recipes' 16384)", ok=False)
        return
    spec = titan.titan_model_args(cfg.model.name)
    fl = plan_flops(spec, eps, budget, world)
    peak = titan.peak_tflops(torch.cuda.get_device_name(0))
    d = packed_vs_padded(cfg, eps[:16])
    row("bf16 logprobs, packed (flex, document-causal) vs padded (SDPA causal), same weights, 16 episodes",
        f"mean |diff| {d['mean']:.4f}, max {d['max']:.3f}", "bf16 tolerance (mean < 0.02)",
        ok=d["mean"] < 0.02, **d)
    work = (f"{len(eps)} episodes, {fl['tokens']:,} tokens ({fl['loss_tokens']:,} in the loss), "
            f"{fl['micro_batches']} micro-batch(es) of {budget} per GPU x{world}")
    row(f"FLOPs per step ({work}): 6 N_body tokens + 6 d V logit positions + 12 L H hd sum(doc_len^2)",
        f"useful {fl['useful'] / 1e12:,.0f} TFLOP; executed: ours {fl['ours'] / 1e12:,.0f}, anchor "
        f"{fl['anchor'] / 1e12:,.0f} (full logits); padding {fl['padding']:,} tokens", "", flops=fl)
    n = max(torch.cuda.device_count(), max(tgpus) + 1)
    lora = int(cfg.trainer.lora.rank)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "episodes.json")
        save_episodes(eps, path)
        for ac in ac_settings:
            a = None
            try:
                a = anchor(cfg.model.name, path, budget, tgpus, ac, steps) if with_anchor else None
            except Exception as e:  # e.g. out of memory: a row saying so, the trainer still measured
                row(f"anchor AC {ac}", f"failed: {clip(str(e), 300)}", ac=ac)
            if a is not None:
                row(f"anchor: TorchTitan step, compiled model and loss, flex block_causal, bf16, the same packed "
                    f"episodes, AC {ac} (x{world} GPU)",
                    f"{a['anchor_tok_s']:,.0f} tok/s  MFU {a['anchor_mfu']:.1%} (useful {a['anchor_useful_mfu']:.1%})  "
                    f"{a['anchor_step_s']:.2f} s/step  peak {a['peak_mem_gb']:.0f} GB", "", ac=ac,
                    **{f"anchor_{k}": v for k, v in a.items() if not k.startswith("anchor")},
                    anchor_tok_s=a["anchor_tok_s"], anchor_mfu=a["anchor_mfu"])
            c = OmegaConf.merge(cfg, {"trainer": {"activation_checkpointing": ac}, "layout": {"gpus_per_node": n}})
            plan = Plan([Slot(0, [n])], Slot(0, tgpus), Slot(0, [n]), False, n)  # the trainer alone on its GPUs
            t = await spawn_service(c, "trainer", plan.trainer, plan)
            try:
                ms = [await call("trainer", t.train_step, eps) for _ in range(steps + 1)]
                m = max(ms[1:], key=lambda x: x["tokens_per_s"])  # the best timed step, as the anchor's
                ours_mfu, useful_mfu = (mfu(fl[k], m["train_s"], peak, world) for k in ("ours", "useful"))
                if lora:  # frozen base weights: no weight gradients (4 N), the trainer's own count
                    ours_mfu = useful_mfu = m.get("mfu", 0.0)
                kw = dict(trainer_tok_s=m["tokens_per_s"], mfu=ours_mfu, useful_mfu=useful_mfu, train_s=m["train_s"],
                          peak_mem_gb=m["peak_mem_gb"], ac=ac, compile_s=await call("trainer", t.compile_time))
                value = (f"{m['tokens_per_s']:,.0f} tok/s  MFU {ours_mfu:.1%} (useful {useful_mfu:.1%})  "
                         f"{m['train_s']:.2f} s/step  peak {m['peak_mem_gb']:.0f} GB")
                if a is not None:
                    ratio = m["tokens_per_s"] / a["anchor_tok_s"]
                    value += f"  = {ratio_text(ratio)} of the anchor"
                    kw.update(anchor_ratio=ratio, anchor_ratio_text=ratio_text(ratio), anchor_tok_s=a["anchor_tok_s"])
                row(f"trainer tok/s ({len(eps)} episodes, {m['seq_tokens']:.0f} tokens; packing {budget}, "
                    f"compile {c.trainer.compile}, AC {ac}{f', LoRA rank {lora}' if lora else ''})", value,
                    ">= 0.950 of the anchor" if a is not None else "", lora_rank=lora, **kw)
            except Exception as e:  # e.g. out of memory without AC: a row saying so
                row(f"trainer AC {ac}", f"failed: {clip(str(e), 300)}")
            finally:
                await t.stop(60)
            torch.cuda.empty_cache()


async def section_ref(cfg, eps_from_gen: list, train_gpus: int) -> None:
    """Where the reference lives: its forward (logprobs of the train section's 128 episodes, the
    best of 2 after a warm-up that compiles) on a GPU of its own and sharded (FSDP2) over the
    trainer's GPUs, caller-timed seconds and tok/s. The layout choice weighs the sharded time,
    which the trainer's GPUs spend on top of their training step, against a GPU taken from the
    generator replicas or the trainer."""
    import torch
    from omegaconf import OmegaConf

    from forge_core.layout import Plan, Slot, plan_layout
    from forge_core.services import call_all, clip, spawn_service

    eps = synthetic_episodes(cfg, eps_from_gen)
    tokens = sum(len(e.prompt_ids) + len(e.response_ids) for e in eps)
    tgpus = list(range(train_gpus)) if train_gpus else plan_layout(cfg).trainer.gpus
    n = max(torch.cuda.device_count(), max(tgpus) + 1)
    c = OmegaConf.merge(cfg, {"layout": {"gpus_per_node": n}})
    for gpus in ([tgpus[0]], tgpus) if len(tgpus) > 1 else ([tgpus[0]],):
        slot = Slot(0, gpus)
        plan = Plan([Slot(0, [n])], Slot(0, gpus), slot, False, n)
        r = await spawn_service(c, "reference", slot, plan)
        try:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                await call_all("reference", r.logprobs, eps)
                times.append(time.perf_counter() - t0)
            best = min(times[1:])
            where = "on a GPU of its own" if len(gpus) == 1 else f"sharded over the trainer's {len(gpus)} GPUs"
            row(f"reference forward {where} ({len(eps)} episodes, {tokens} tokens; packing "
                f"{c.trainer.tokens_per_micro_batch or 'off'}, compile {c.trainer.compile})",
                f"{best:.2f} s/step  {tokens / best:,.0f} tok/s (first call {times[0]:.0f} s)", "",
                ref_gpus=len(gpus), ref_s=best, ref_tok_s=tokens / best, first_call_s=times[0])
        except Exception as e:
            row(f"reference on {len(gpus)} GPU(s)", f"failed: {clip(str(e), 300)}", ref_gpus=len(gpus))
        finally:
            await r.stop(60)
        torch.cuda.empty_cache()


def packed_vs_padded(cfg, eps: list) -> dict:
    """Response logprobs of ``eps`` under the same bf16 random weights, packed vs padded, in this
    process (GPU 0): ``{"mean", "max"}`` absolute differences over response tokens."""
    import torch

    from forge_core import titan
    from forge_core.actors.trainer import logprobs_of

    spec = titan.titan_model_args(cfg.model.name)
    dev = torch.device("cuda")
    out = []
    for budget in (cfg.trainer.tokens_per_micro_batch, 0):
        m = titan.build_model(spec, dev, 0, dtype=torch.bfloat16, packed=budget > 0).eval()
        R = max(len(e.response_ids) for e in eps)
        with torch.no_grad():
            lps = []
            for i in range(0, len(eps), 4):
                idx = list(range(i, min(i + 4, len(eps))))
                lps.append(logprobs_of(m, eps, idx, R, temperature=1.0, device=dev, budget=budget, chunk=1024,
                                       select=titan.PositionSelect(m)))
        out.append(torch.cat(lps))
        del m
        torch.cuda.empty_cache()
    mask = torch.zeros_like(out[0], dtype=torch.bool)
    for i, e in enumerate(eps):
        mask[i, :len(e.response_ids)] = True
    d = (out[0] - out[1]).abs()[mask]
    return {"mean": float(d.mean()), "max": float(d.max())}


async def section_sync(cfg) -> None:
    from forge_core.controller import Controller
    from forge_core.services import call, spawn_services

    svc = await spawn_services(cfg)
    try:
        ctl = Controller(cfg, "/tmp/bench-sync", progress=False)
        ctl.svc = svc
        from forge_core.data import PromptSource, load_gsm8k

        ctl.source = PromptSource(load_gsm8k("train", cfg.data.dir), 0)
        t0 = time.perf_counter()
        await ctl.start()
        row("start-up (engine, trainer, reference; version 0 everywhere)", f"{time.perf_counter() - t0:.0f} s")
        best = None
        for _ in range(3):
            await ctl.publish_and_sync()
            if best is None or ctl.last_sync["weight_sync_exposed_s"] < best["weight_sync_exposed_s"]:
                best = dict(ctl.last_sync)
        h = await call("trainer", svc.trainer.publish)
        gb = h.nbytes / 1e9
        row(f"weight sync in the node, {gb:.2f} GB {h.dtype}, {best['weight_sync_mode']}: in-place load_weights + "
            f"prefix-cache reset", f"{best['weight_sync_exposed_s']:.3f} s ({gb / best['weight_sync_exposed_s']:.0f} GB/s); "
            f"publish + load {best['weight_sync_s']:.3f} s", "<= 0.1 s exposed", **best)
        await call("generator", svc.generator.update_weights, h)
        bad = await call("generator", svc.generator.weights_match)
        row(f"generator weights == trainer's cast to {h.dtype}, every TP rank's shard", "bit-identical" if not bad
            else f"DIFFERENT: {bad[:3]}", "bitwise")
    finally:
        await svc.stop(60)


async def bench(a) -> None:
    from forge_core.config import load_config

    recipe, ov = overrides(a.model, a.gpus, a.data, a.overrides)
    cfg = load_config(recipe, ov)
    secs = a.sections.split(",")
    prompts = prompts_of(cfg, 16) if "gen" in secs else []  # the gen section's prompts only
    eps = await section_gen(cfg, prompts) if "gen" in secs else []
    if "scale" in secs or "layouts" in secs:  # layouts: only the --layouts engines, no replica scaling
        layouts = [x for x in a.layouts.split(",") if x]
        await section_scale(cfg, prompts_of(cfg, 16 * a.gpus), a.gpus, layouts, "scale" in secs, a.repeats)
    if "train" in secs:
        await section_train(cfg, eps, a.train_gpus, tuple(x == "1" for x in a.train_ac.split(",")), a.train_steps,
                            bool(a.anchor))
    if "ref" in secs:
        await section_ref(cfg, eps, a.train_gpus)
    if "sync" in secs:
        await section_sync(cfg)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3_1_7b")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--sections", default="gen,train,sync")
    p.add_argument("--layouts", default="")
    p.add_argument("--train-gpus", type=int, default=0, help="train section: the trainer on GPUs 0..N-1 (0: the layout's)")
    p.add_argument("--train-steps", type=int, default=2,
                   help="train section: timed steps per side (the best counts), after one untimed (the anchor's compiles)")
    p.add_argument("--train-ac", default="0,1", help="train section: activation checkpointing settings to run (0/1)")
    p.add_argument("--anchor", type=int, default=1, help="train section: 0 times the trainer alone (no anchor)")
    p.add_argument("--repeats", type=int, default=2, help="scale/layouts sections: each figure the best of this many runs")
    p.add_argument("--data", default=os.environ.get("GSM8K_DIR", ""))
    p.add_argument("--out", default="")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    print("| what | value | target | device |\n|---|---|---|---|", flush=True)
    try:
        asyncio.run(bench(a))
    finally:
        print(f"\n## bench {a.model} on {a.gpus} GPU(s), {time.strftime('%Y-%m-%d')}\n| what | value | target | device |\n"
              f"|---|---|---|---|")
        for r in ROWS:
            print(f"| {r['what']} | {r['value']} | {r['target']} | {r['device']} |")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(ROWS, f, indent=1, default=str)
    failed = [r["what"] for r in ROWS if r.get("ok") is False or str(r["value"]).startswith("failed")]
    if failed:
        print(f"{len(failed)} row(s) failed: {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
