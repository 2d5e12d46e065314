"""``make eval``'s vLLM path against raw vLLM on the same prompts (GPU machine with the gpu extra).

    python -m benchmarks.bench_eval RECIPE [--ckpt DIR] [--repeats 2] [overrides ...]

One engine serves both: the run's vLLM generator built for ``make eval``
(:func:`forge_core.evaluate.eval_generator`). "raw" is ``LLM.generate`` of the held-out prompts'
token ids with the evaluation's sampling settings; "make eval" is :func:`forge_core.evaluate.evaluate`
with that generator: the subset, chat formatting, tokenizing, generation through the actor's code,
decoding and scoring. After one warm-up of each, they alternate ``--repeats`` times.
Prints a table (tok/s = generated tokens per second of the whole call) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--ckpt", default=None)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_intermixed_args(argv)

    import torch
    from vllm.inputs import TokensPrompt

    from forge_core.config import load_config
    from forge_core.data import eval_subset, load_split
    from forge_core.evaluate import eval_config, eval_generator, eval_sampling, evaluate, run_info

    cfg = load_config(a.recipe, a.overrides)
    cfg = eval_config(cfg, "vllm", run_info(a.ckpt).get("generator_dtype"))
    max_tokens = eval_sampling(cfg)["max_tokens"]
    problems = eval_subset(load_split(cfg.data, "test"), cfg.eval.num_questions, cfg.eval.seed)
    gen = eval_generator(cfg, a.ckpt)
    llm = gen.llm
    prompts = [TokensPrompt(prompt_token_ids=x) for x in gen.prompt_ids(problems)]
    sp = gen._sampling(eval_sampling(cfg), seed=cfg.eval.seed)

    def raw() -> dict:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"s": dt, "tokens": n, "tok_s": n / dt}

    def ours() -> dict:
        t0 = time.perf_counter()
        res = evaluate(cfg, a.ckpt, progress=False, gen=gen)
        dt = time.perf_counter() - t0
        n = res["gen_tok_s"] * res["gen_s"]
        return {"s": dt, "tokens": round(n), "tok_s": n / dt, "pass@1": res["pass@1"]}

    raw(), ours()  # warm-up: CUDA graphs, prefix cache of the shared system prompt
    rows = []
    for i in range(a.repeats):
        rows += [dict(raw(), what="raw vLLM", i=i), dict(ours(), what="make eval", i=i)]
    dev = torch.cuda.get_device_name(0)
    print(f"\n{a.recipe}: {len(problems)} questions x {cfg.eval.samples} samples, up to {max_tokens} tokens, "
          f"temperature {cfg.eval.temperature}; {dev}")
    print("| run | seconds | generated tokens | tok/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['what']} #{r['i'] + 1} | {r['s']:.3f} | {r['tokens']} | {r['tok_s']:.0f} |")
    mean = lambda w: sum(r["tok_s"] for r in rows if r["what"] == w) / a.repeats  # noqa: E731
    print(f"make eval / raw vLLM tok/s: {mean('make eval') / mean('raw vLLM'):.3f}")
    print(json.dumps({"recipe": a.recipe, "device": dev, "questions": len(problems), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
