"""Where the generator's time goes: one vLLM engine built as every replica builds it
(:func:`forge_core.actors.vllm_generator.make_engine`), in this process, ``LLM.generate`` on the
GPU benchmark's prompts (16 GSM8K prompts x G=8 x 1,024 new tokens, ``ignore_eos``), under each
condition in turn:

- ``list``: the sampled token's logprob in vLLM's default container (a dict and a ``Logprob``
  object per token, kept alive until the request ends);
- ``flat``: ``flat_logprobs=True`` (a few flat lists per sequence: what the generator actor asks);
- ``none``: no logprobs (the engine's floor; the trainer's corrections need them);
- ``flat+burn``: ``flat`` while ``--burn`` busy-loop processes keep the host's other cores busy;
- ``flat+qos``: ``flat`` while this process holds ``/dev/cpu_dma_latency`` at 0 (no deep idle states;
  needs root: skipped otherwise).

Each condition runs ``--repeat`` times, in rounds (list, flat, none, list, flat, none, ...). Per run:
seconds, tokens/s, this process's CPU seconds (user + system), and Python's garbage collector: pause
seconds and full (generation 2) collections during the call. CPU seconds close to the wall time say
the engine's loop is bound by its host thread. With ``--pyspy S`` (py-spy on PATH), py-spy samples this
process for S seconds of the first ``flat`` run (non-blocking, every thread) into ``OUT.pyspy.txt``
(collapsed stacks; the share of samples in ``Event.synchronize`` is the host waiting for the GPU).

    python -m benchmarks.profile_gen [--model qwen3_1_7b] [--repeat 2] [--burn 8]
                                     [--pyspy 5] [--out gen_profile.json] [overrides ...]
                                     # overrides: e.g. generator.kv_cache_dtype=fp8 generator.quantization=fp8

Prints a markdown table; ``--out`` keeps the rows with the host's CPU model, its cpufreq governor and
cpuidle driver.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import os
import shutil
import struct
import subprocess
import time


def _spin() -> None:  # a busy loop for one core
    while True:
        pass


@contextlib.contextmanager
def burning(n: int):
    """``n`` busy-loop processes for the duration of the block."""
    ps = [mp.get_context("fork").Process(target=_spin, daemon=True) for _ in range(n)]
    for p in ps:
        p.start()
    try:
        yield
    finally:
        for p in ps:
            p.kill()
            p.join()


@contextlib.contextmanager
def no_idle_states():
    """Hold ``/dev/cpu_dma_latency`` at 0 us (the kernel's PM QoS: cores stay out of deep idle states
    while the file is open). Yields False when it cannot be opened (not root)."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError:
        yield False
        return
    try:
        os.write(fd, struct.pack("i", 0))
        yield True
    finally:
        os.close(fd)


def pyspy(seconds: float, path: str):
    """Start py-spy on this process for ``seconds`` (collapsed stacks to ``path``); None without py-spy."""
    exe = shutil.which("py-spy")
    if not exe or seconds <= 0:
        return None
    with contextlib.suppress(Exception):  # Yama ptrace_scope 1: let a child trace its parent
        import ctypes

        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(2**64 - 1), 0, 0, 0)  # PR_SET_PTRACER, ANY
    return subprocess.Popen([exe, "record", "--pid", str(os.getpid()), "--nonblocking", "--threads", "--rate", "200",
                             "--duration", str(int(seconds)), "--format", "raw", "--output", path])


class GcClock:
    """Sum of Python GC pauses (seconds) and count of full collections while installed."""

    def __init__(self):
        self.pause_s, self.full, self._t = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.pause_s += time.perf_counter() - self._t
            self.full += info.get("generation") == 2

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def host_info() -> dict:
    """The CPU (:func:`benchmarks.bench_cpu.cpu_description`), its cpufreq governor and cpuidle
    driver/governor (``""`` where absent)."""
    from benchmarks.bench_cpu import cpu_description

    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return ""

    base = "/sys/devices/system/cpu"
    return dict(cpu=cpu_description(), governor=read(f"{base}/cpu0/cpufreq/scaling_governor"),
                cpuidle_driver=read(f"{base}/cpuidle/current_driver"),
                cpuidle_governor=read(f"{base}/cpuidle/current_governor_ro") or read(f"{base}/cpuidle/current_governor"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3_1_7b")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--burn", type=int, default=max((os.cpu_count() or 2) // 2 - 2, 0))
    ap.add_argument("--pyspy", type=float, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from benchmarks.bench_gpu import overrides, prompts_of
    from forge_core.actors.vllm_generator import make_engine
    from forge_core.config import load_config

    recipe, ov = overrides(a.model, 2, os.environ.get("GSM8K_DIR", ""), a.overrides)
    cfg = load_config(recipe, ov)
    g = cfg.generator
    prompts = prompts_of(cfg, 16)
    llm = make_engine(g, cfg.model.name, g.max_prompt_tokens + g.max_response_tokens, seed=cfg.seed)
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def params(kind: str, tokens: int):
        lp = dict(list=dict(logprobs=0), flat=dict(logprobs=0, flat_logprobs=True), none={})[kind]
        return SamplingParams(n=g.group_size, temperature=g.temperature, top_p=g.top_p, max_tokens=tokens,
                              ignore_eos=True, detokenize=False, **lp)

    llm.generate(ps[:4], params("flat", 32), use_tqdm=False)  # warm-up
    conds = [("list", None), ("flat", None), ("none", None)]
    if a.burn:
        conds.append(("flat", "burn"))
    conds.append(("flat", "qos"))
    rows, spy = [], None
    print("| condition | s | tok/s | process CPU s | GC pause s | full GCs |\n|---|---|---|---|---|---|", flush=True)
    for _ in range(a.repeat):
        for kind, extra in conds:
            with contextlib.ExitStack() as st:
                if extra == "burn":
                    st.enter_context(burning(a.burn))
                if extra == "qos" and not st.enter_context(no_idle_states()):
                    continue
                sp = params(kind, g.max_response_tokens)
                if kind == "flat" and not extra and spy is None:
                    spy = pyspy(a.pyspy, (a.out or "gen_profile") + ".pyspy.txt") or False
                with GcClock() as gcc:
                    c0, t0 = time.process_time(), time.perf_counter()
                    outs = llm.generate(ps, sp, use_tqdm=False)
                    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
                del outs
            name = kind + (f"+{extra}" if extra else "") + (f" ({a.burn})" if extra == "burn" else "")
            rows.append(dict(condition=name, s=dt, tokens=tokens, tok_s=tokens / dt, cpu_s=cpu,
                             gc_pause_s=gcc.pause_s, full_gcs=gcc.full))
            print(f"| {name} | {dt:.3f} | {tokens / dt:,.0f} | {cpu:.2f} | {gcc.pause_s:.3f} | {gcc.full} |", flush=True)
    if spy:
        spy.wait()
    if a.out:
        import torch

        with open(a.out, "w") as f:
            json.dump(dict(rows=rows, device=torch.cuda.get_device_name(0), host=host_info(), overrides=a.overrides), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
