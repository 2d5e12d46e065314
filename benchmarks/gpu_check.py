"""The GPU check: real actors on this machine's GPU(s), printed as PASS/FAIL lines.

    python -m benchmarks.gpu_check [--model smollm2_135m] [--gpus 1|2|3]
    python -m benchmarks.gpu_check --eval-agreement [--eval-recipe smollm2_135m_gpu1] [--eval-questions 1319]

With one GPU the trainer, reference and vLLM generator share it (colocated, sleep/wake); with
two or more they get their own (CUDA IPC across GPUs, bucketed). Checks: the generator and the
trainer hold bit-identical weights after each sync (sha256 in HF layout, version 0 and 1); G
samples per prompt with one logprob per token; the reference (same weights) agrees with the
generator's logprobs; one GRPO step changes the weights; the version advances everywhere; the
engine keeps generating after an in-place update (prefix cache reset).

``--eval-agreement``: one score per checkpoint. A short run of ``--eval-recipe`` (real weights:
``bash benchmarks/gpu.sh setup`` first) evaluates its last version on ``--eval-questions`` held-out
questions, greedy, on its vLLM generator; then ``make eval``'s path (:func:`forge_core.evaluate.evaluate`)
evaluates the run's ``final/`` on this GPU. PASS when both sampled the same responses
(``responses_digest``) and gave the same pass@1; the figures of both are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time


def overrides(model: str, gpus: int, data_dir: str, extra: tuple = ()) -> list:
    """1 GPU: colocated; 2: generator | trainer + reference; 3+: generator | trainer (FSDP) | reference."""
    if gpus == 1:
        lay = ["layout.gpus_per_node=1", "layout.trainer.gpus=1", "layout.reference.gpus=0", "max_staleness=0"]
    elif gpus == 2:
        lay = ["layout.gpus_per_node=2", "layout.trainer.gpus=1", "layout.reference.gpus=0"]
    else:
        lay = [f"layout.gpus_per_node={gpus}", f"layout.trainer.gpus={gpus - 2}", "layout.reference.gpus=1"]
    return [f"model.name={model}", "device=cuda", "generator.backend=vllm", "prompts_per_step=4",
            "generator.group_size=4", "generator.max_response_tokens=64", "generator.max_prompt_tokens=256",
            "generator.gpu_memory_utilization=0.25", "trainer.micro_batch_size=8", f"data.dir={data_dir}",
            "model.init=random", *lay, *extra]


async def run_checks(model: str = "smollm2_135m", gpus: int = 1, data_dir: str = "", extra: tuple = ()) -> list:
    """Returns ``[(name, ok, detail)]``."""
    import torch

    from forge_core.advantages import compute_advantages
    from forge_core.config import load_config
    from forge_core.data import PromptSource, load_gsm8k
    from forge_core.services import call, spawn_services

    res = []

    def check(name, ok, detail=""):
        res.append((name, bool(ok), detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)

    cfg = load_config("smollm2_135m", overrides(model, gpus, data_dir, extra))
    t0 = time.perf_counter()
    svc = await spawn_services(cfg)
    try:
        src = PromptSource(load_gsm8k("train", data_dir), 0)
        h0 = await call("trainer", svc.trainer.publish)
        check("handle carries CUDA IPC", h0.ipc is not None and h0.nbytes > 0, f"{h0.nbytes / 1e9:.3f} GB {h0.dtype}")
        r0 = await call("generator", svc.generator.update_weights, h0)
        await call("reference", svc.reference.load_initial, h0, "ipc")
        info = await call("generator", svc.generator.info)
        check("engine up, version-0 weights in place", r0["version"] == 0,
              f"startup {time.perf_counter() - t0:.0f}s, sync {r0['sync_s']:.4f}s mode={r0['mode']} {info}")
        fp8 = cfg.generator.quantization != "none"  # FP8 weights: no digest; weights_match checks within rounding
        dt, dg = await call("trainer", svc.trainer.weights_digest), await call("generator", svc.generator.weights_digest)
        if not fp8:
            check("bitwise equal weights v0 (sha256, HF layout)", dt == dg and dt != "", dt[:16])
        bad = await call("generator", svc.generator.weights_match)
        check("every TP rank's shard equals the trainer's bytes" + (" (FP8 weights: within e4m3 rounding, the rest "
              "bit for bit)" if fp8 else ""), not bad, str(bad[:3]))
        d0 = dt
        losses = []
        for step in range(2):
            eps, st = await call("generator", svc.generator.generate, src.next_batch(4), step)
            ok = len(eps) == 16 and all(e.policy_version == step and len(e.behaviour_logprobs) == len(e.response_ids) > 0
                                        for e in eps)
            check(f"generate step {step}: 4 prompts x G=4, logprob per token", ok,
                  f"{st['gen_tokens']} tokens {st['gen_tok_s']:.0f} tok/s sleep {st.get('sleep_s', 0):.2f}s "
                  f"wake {st.get('wake_s', 0):.2f}s; e.g. {eps[0].text[:60]!r}")
            eps, _ = await call("reward", svc.reward.score, eps)
            lists, _ = await call("reference", svc.reference.logprobs, eps)
            for e, lp in zip(eps, lists):
                e.ref_logprobs = lp
            if step == 0:
                diffs = [abs(a - b) for e in eps for a, b in zip(e.behaviour_logprobs, e.ref_logprobs)]
                check("reference logprobs agree with vLLM's (same weights" + (", FP8 in vLLM)" if fp8 else ")"),
                      statistics.fmean(diffs) < (0.2 if fp8 else 0.05),
                      f"mean |diff| {statistics.fmean(diffs):.4f}, max {max(diffs):.3f}")
            adv, _, _ = compute_advantages(torch.tensor([e.reward for e in eps]).view(4, 4), cfg.advantage)
            synthetic = not any(adv.flatten())  # every reward equal (a random model's): no signal to train on
            for e, a in zip(eps, adv.flatten().tolist()):
                e.advantage = (1.0 if e.group % 2 == 0 else -1.0) if synthetic else a
            m = await call("trainer", svc.trainer.train_step, eps)
            losses.append(m["loss"])
            what = "synthetic +-1 advantages (every reward equal)" if synthetic else "the batch's advantages"
            check(f"train step {step} on {what}", m["version"] == step + 1 and m["loss"] == m["loss"],
                  f"loss {m['loss']:.4f} grad_norm {m['grad_norm']:.3f} {m['train_s']:.2f}s peak {m['peak_mem_gb']:.1f} GB")
            h = await call("trainer", svc.trainer.publish)
            r = await call("generator", svc.generator.update_weights, h)
            dt, dg = await call("trainer", svc.trainer.weights_digest), await call("generator", svc.generator.weights_digest)
            same = not await call("generator", svc.generator.weights_match) if fp8 else dt == dg
            check(f"{'FP8-rounded' if fp8 else 'bitwise'} equal weights v{step + 1} after in-place update",
                  same and r["version"] == step + 1,
                  f"sync {r['sync_s']:.4f}s {r['sync_gb_s']:.1f} GB/s mode={r['mode']} wake {r['wake_s']:.2f}s")
            if step == 0:
                check("weights changed by the step", dt != d0)
        versions = [await call("generator", svc.generator.get_version), await call("trainer", svc.trainer.get_version)]
        check("versions advanced to 2", versions == [2, 2], str(versions))
    finally:
        await svc.stop(60)
    return res


def eval_agreement(recipe: str, questions: int, steps: int, out_dir: str, extra: tuple = ()) -> list:
    """One score per checkpoint on this GPU: ``launch.local run RECIPE`` for ``steps`` steps with the
    held-out evaluation (``questions`` questions, the recipe's sampling settings) at its last step, then
    :func:`forge_core.evaluate.evaluate` of its ``final/``. Returns ``[(name, ok, detail)]``: the digests
    of the responses and pass@1 agree."""
    import subprocess

    from forge_core.config import load_config
    from forge_core.evaluate import evaluate
    from forge_core.metrics import read_jsonl

    run_id = f"eval-agreement-{int(time.time())}"
    args = [f"steps={steps}", f"eval.every={steps}", "eval.at_start=false", f"eval.num_questions={questions}",
            "checkpoint.every=0", f"output_dir={out_dir}", f"run_id={run_id}", *extra]
    r = subprocess.run([sys.executable, "-m", "launch.local", "run", recipe, *args], capture_output=True, text=True)
    if r.returncode:
        return [(f"{recipe}: a {steps}-step run with an evaluation at its end", False, r.stderr[-2000:])]
    run = os.path.join(out_dir, run_id)
    row = [x for x in read_jsonl(os.path.join(run, "metrics.jsonl")) if "eval/pass@1" in x][-1]
    res = evaluate(load_config(recipe, args), os.path.join(run, "final"), progress=False, engine="vllm")
    detail = (f"in-run: pass@1 {row['eval/pass@1']:.4f} (version {row['eval/policy_version']}), make eval of "
              f"final/: pass@1 {res['pass@1']:.4f} (version {res['policy_version']}, {res['dtype']}), "
              f"{res['questions']} questions")
    print(json.dumps({"in_run": row, "make_eval": res}), flush=True)
    return [("in-run evaluation and make eval of final/ sampled the same responses",
             row["eval/responses_digest"] == res["responses_digest"], detail),
            ("... and give the same pass@1", row["eval/pass@1"] == res["pass@1"], detail)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--data", default=os.environ.get("GSM8K_DIR", ""))
    p.add_argument("--out", default="")
    p.add_argument("--eval-agreement", action="store_true", help="only the in-run eval vs make eval check")
    p.add_argument("--eval-recipe", default="smollm2_135m_gpu1")
    p.add_argument("--eval-questions", type=int, default=1319)
    p.add_argument("--eval-steps", type=int, default=10)
    p.add_argument("--eval-dir", default="runs/gpu_check")
    p.add_argument("overrides", nargs="*", help="more config overrides, e.g. trainer.tokens_per_micro_batch=1024")
    a = p.parse_args()
    import torch

    print(f"device: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}", flush=True)
    if a.eval_agreement:
        res = eval_agreement(a.eval_recipe, a.eval_questions, a.eval_steps, a.eval_dir, tuple(a.overrides))
        for name, ok, detail in res:
            print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    else:
        res = asyncio.run(run_checks(a.model, a.gpus, a.data, tuple(a.overrides)))
    n_ok = sum(ok for _, ok, _ in res)
    print(f"gpu_check {a.model} gpus={a.gpus}: {n_ok}/{len(res)} passed", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump([{"check": n, "ok": ok, "detail": d} for n, ok, d in res], f, indent=1)
    return 0 if n_ok == len(res) else 1


if __name__ == "__main__":
    sys.exit(main())
