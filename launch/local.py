"""Run a recipe on this machine: ``python -m launch.local run|eval|check RECIPE [overrides ...]``.

``make run`` and ``make eval`` call this. Every actor runs in its own local process. The config
is composed and checked, and a pre-flight check (GPU, model and data sources) runs, before any
actor starts, so a wrong key or an impossible recipe fails in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import sys
import time
from typing import Any, Callable, Optional, Sequence

from launch.common import port_open


class PreflightError(RuntimeError):
    """The recipe cannot run here; the message lists every reason."""


def preflight(cfg: Any, command: str = "run", ckpt: Optional[str] = None) -> None:
    """Fail fast, naming every reason, if ``command`` (``run``; ``eval``: on CPU, the test split, of
    checkpoint ``ckpt`` if given, not the recipe's model) cannot run the recipe on this machine.

    Checks: ``device=cuda`` needs CUDA GPUs (as many as the layout asks for on this node); a
    model from the hub needs hub access (or ``model.path`` = a local HF-format dir with a config.json); a gated
    model needs ``HF_TOKEN``; the data's splits (``data.train``; ``data.test`` too for eval and for a
    run that evaluates) must exist: a ``file`` source's files, a ``hub`` source's hub access, GSM8K's
    hub access or ``GSM8K_DIR``/``data.dir`` holding ``<split>.jsonl``; ``output_dir`` must be creatable
    (what exists of it a writable directory).
    Raises:
        PreflightError: listing the reasons.
    """
    import torch

    from forge_core.models import gated_without_token, spec_of

    evaluates = command == "eval" or cfg.eval.every > 0 or cfg.eval.at_start
    reasons, splits = [], ["test"] if command == "eval" else ["train"] + (["test"] if evaluates else [])
    if cfg.device == "cuda" and command == "run":
        need = cfg.layout.gpus_per_node
        have = torch.cuda.device_count()
        if have < max(need, 1):
            reasons.append(f"recipe {cfg.recipe} needs device=cuda with {need} GPU(s) per node "
                           f"(layout: {cfg.layout.nodes} node(s)); this machine has {have}")
    spec = spec_of(cfg.model.name)
    hub = _hub_probe()
    random_ok = cfg.model.init == "random" and spec.arch
    if (spec.source == "hf" or cfg.model.path) and (spec.config is None or cfg.model.path) and not random_ok and not ckpt:
        path = cfg.model.path or spec.path
        if unfinished := unfinished_run(path):
            reasons.append(unfinished)
        elif os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            reasons.append(f"model.path={path} has no config.json: not an HF-format checkpoint directory "
                           f"(config.json, the weights, the tokenizer's files)")
        elif path.startswith(("/", ".")) and not os.path.isdir(path):
            reasons.append(f"model.path={path} is not a directory")
        elif not os.path.isdir(path):
            if gated := gated_without_token(cfg.model):
                reasons.append(gated)
            if not hub():
                reasons.append(f"model weights {path} come from the HF hub, which is not reachable from here: "
                               f"set model.path=/local/copy, or model.init=random for same-shape random weights "
                               f"(the config still needs the hub or a local copy)")
    reasons += data_unreadable(cfg, splits, hub)
    top = os.path.abspath(cfg.output_dir)  # its first part that exists must be a writable directory
    while not os.path.exists(top):
        top = os.path.dirname(top)
    if not (os.path.isdir(top) and os.access(top, os.W_OK)):
        reasons.append(f"output_dir={cfg.output_dir}: {top} is {'not writable' if os.path.isdir(top) else 'a file'}")
    if reasons:
        raise PreflightError("cannot run here:\n  - " + "\n  - ".join(reasons))


def _hub_probe() -> Callable[[], bool]:
    """Whether the HF hub is reachable from here (never with ``HF_HUB_OFFLINE=1``), probed when first asked."""
    return functools.cache(lambda: os.environ.get("HF_HUB_OFFLINE") != "1" and port_open("huggingface.co", 443, 3.0))


def data_unreadable(cfg: Any, splits: Sequence[str], hub: Optional[Callable[[], bool]] = None) -> list[str]:
    """Why the data's ``splits`` (``train``, ``test``) cannot be read from this machine: a ``file``
    source's missing file; a ``hub`` source, or GSM8K without ``GSM8K_DIR``/``data.dir``, with the HF
    hub out of reach (``hub()``, default: a probe of huggingface.co); a ``data.dir`` that is not a
    directory or lacks ``<split>.jsonl``. Empty when every split can be read."""
    hub = hub or _hub_probe()
    reasons, d = [], cfg.data
    for key in splits:
        name = d[key]
        if d.source == "file":
            if not os.path.isfile(name):
                reasons.append(f"data.{key}={name}: no such file")
        elif d.source == "hub" or not d.dir:
            if not hub():
                reasons.append(f"data.{key} comes from the HF hub ({d.hub_id}), which is not reachable: "
                               + ("set GSM8K_DIR=/path/to/gsm8k or data.dir=... (train.jsonl, test.jsonl)"
                                  if d.source == "gsm8k" else "use data.source=file with local .jsonl/.parquet files"))
                break
        elif not os.path.isdir(d.dir):
            reasons.append(f"data.dir={d.dir} (GSM8K_DIR) is not a directory")
            break
        elif not os.path.isfile(os.path.join(d.dir, f"{name}.jsonl")):
            reasons.append(f"data.dir={d.dir} (GSM8K_DIR) has no {name}.jsonl")
    return reasons


def check_task(cfg: Any) -> str:
    """The check of a composed config's data and reward that ``make check`` runs, and with it every
    launcher before it starts or submits anything: ``make sky`` and ``make slurm`` (dry runs too) on
    the submitting machine, :mod:`launch.sky_node` on every node, :func:`launch.node.run_node` on node 0
    (``make run`` runs the same :func:`forge_core.controller.load_task` at its start). The data loads
    through the field mapping and the reward function answers one example (``load_task``). GSM8K or a
    hub dataset that this machine cannot read (:func:`data_unreadable`: no hub, no ``GSM8K_DIR``) is
    not loaded here; the recipe's own files always are. Returns the line to print: what was loaded, or
    why nothing was.

    Raises:
        DataError: a split that does not load (the message names the file and line, and the fields the
            row has), or fewer training rows than ``prompts_per_step``.
        RewardError: the reward function fails on the example or returns something else (names it).
    """
    from forge_core.controller import load_task

    splits = ["train"] + (["test"] if cfg.eval.every > 0 or cfg.eval.at_start else [])
    if cfg.data.source != "file" and (why := data_unreadable(cfg, splits)):
        return f"data: not loaded here ({'; '.join(why)}); the machine that runs the recipe loads it first"
    train, held = load_task(cfg)
    return (f"data: {len(train)} training prompts ({cfg.data.train})"
            + (f", {len(held)} held-out questions ({cfg.data.test})" if held else "")
            + f"; reward.fn={cfg.reward.fn} scored {train[0].id}")


def sky_accelerators(recipe_folder: str) -> list[str]:
    """The GPU names the recipe folder's ``sky.yaml`` asks for (``resources.accelerators``, or each
    option of ``resources.any_of`` / ``ordered``; written ``H100:8``, ``{H100: 8}`` or a list of
    those), in file order, once each; ``[]`` without the file or an accelerator."""
    import yaml

    path = os.path.join(recipe_folder, "sky.yaml")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        res = (yaml.safe_load(f) or {}).get("resources") or {}
    out: list[str] = []
    for opt in [res, *(res.get("any_of") or []), *(res.get("ordered") or [])]:
        acc = opt.get("accelerators") if isinstance(opt, dict) else None
        for a in acc if isinstance(acc, (list, set)) else [acc] if acc else []:
            out += [str(k) for k in a] if isinstance(a, dict) else [str(a).split(":")[0].strip()]
    return list(dict.fromkeys(out))


def memory_check(cfg: Any, recipe: str, gpu: Optional[str] = None) -> list[str]:
    """``make check``'s memory estimate of ``cfg``'s layout (:mod:`forge_core.memory`): prints one line
    per GPU (what it holds, the smallest GPU that fits) to stderr and returns the refusals: one line per
    GPU that cannot hold its services on ``gpu`` (``--gpu``: a name of
    :data:`forge_core.memory.GPU_MEMORY` or a size in GiB) or, without it, on each GPU the recipe's
    ``sky.yaml`` names. Nothing for a CPU recipe.

    Raises:
        PreflightError: ``gpu`` is neither a known GPU name nor a number of GiB.
    """
    from forge_core import memory
    from forge_core.config import recipe_dir

    if cfg.device != "cuda":
        return []
    known = {k.lower(): (k, v) for k, v in memory.GPU_MEMORY.items()}
    if gpu:
        try:
            named = {f"a GPU of {float(gpu):g} GiB": float(gpu) * memory.GIB}
        except ValueError:
            if gpu.lower() not in known:
                raise PreflightError(f"--gpu {gpu}: one of {sorted(memory.GPU_MEMORY)} or a size in GiB") from None
            named = dict([known[gpu.lower()]])
    else:
        names = sky_accelerators(recipe_dir(recipe))
        named = dict(known[n.lower()] for n in names if n.lower() in known)
        if unknown := [n for n in names if n.lower() not in known]:
            print(f"memory: not checked on {', '.join(unknown)} (sky.yaml): its size is not in "
                  f"forge_core.memory.GPU_MEMORY; pass --gpu <GiB>", file=sys.stderr)
    lines, refusals = memory.report(cfg, named)
    print("memory estimate per GPU (GiB; forge_core/memory.py):\n  " + "\n  ".join(lines), file=sys.stderr)
    if named and not refusals:
        print(f"memory: the layout fits {' and '.join(named)}", file=sys.stderr)
    return refusals


def unfinished_run(path: str) -> Optional[str]:
    """When ``model.path`` names a run (or its ``final/``) that did not finish, e.g. an SFT run to start
    GRPO from: the message saying what the run has (its last logged step, its checkpoints) and how to
    finish it; else None."""
    run = os.path.dirname(path.rstrip("/")) if os.path.basename(path.rstrip("/")) == "final" else path
    if os.path.isfile(os.path.join(path, "config.json")) or not (
            os.path.isfile(os.path.join(run, "metrics.jsonl")) or os.path.isdir(os.path.join(run, "checkpoints"))):
        return None
    ckpts = sorted(os.listdir(os.path.join(run, "checkpoints"))) if os.path.isdir(os.path.join(run, "checkpoints")) else []
    steps = []
    if os.path.isfile(os.path.join(run, "metrics.jsonl")):
        with open(os.path.join(run, "metrics.jsonl")) as f:
            steps = [json.loads(l).get("step") for l in f if l.strip().startswith("{") and l.strip().endswith("}")]
    return (f"model.path={path}: {run} is a run that did not finish (no final/; metrics up to step "
            f"{max((x for x in steps if x is not None), default=0)}, checkpoints: {ckpts or 'none'}): run it again with "
            f"the same run_id (output_dir and FORGE_RUN_ID) to finish it and write final/, then point model.path there")


def run_dir(cfg: Any) -> str:
    """``<output_dir>/<run_id>``; a new timestamped run id when ``run_id`` is empty."""
    rid = cfg.run_id or time.strftime("%Y%m%d-%H%M%S")
    return os.path.abspath(os.path.join(cfg.output_dir, rid))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the exit code (2 for config/pre-flight errors)."""
    p = argparse.ArgumentParser(prog="python -m launch.local", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["run", "eval", "check"])
    p.add_argument("recipe", help="recipe name under recipes/ or a path to a recipe folder")
    p.add_argument("overrides", nargs="*", default=[], help="Hydra overrides, e.g. trainer.lr=1e-6 steps=5 loss=dapo")
    p.add_argument("--ckpt", default=None, help="eval: an HF checkpoint directory (default: the base model)")
    p.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"],
                   help="eval: vllm (a CUDA GPU with the gpu extra; auto picks it there) or hf (CPU)")
    p.add_argument("--gpu", default=None, help="check: the GPU to check the layout's memory estimate against "
                   "(H100, H200, A100-80GB, A100, or a size in GiB; default: the ones the recipe's sky.yaml names)")
    a = p.parse_intermixed_args(argv)  # --ckpt before or after the overrides
    if a.ckpt and a.command != "eval":
        p.error("--ckpt is eval's (to train from a checkpoint: model.path=DIR)")
    if a.engine != "auto" and a.command != "eval":
        p.error("--engine is eval's")
    if a.gpu and a.command != "check":
        p.error("--gpu is check's (a run measures its GPUs' free memory)")

    from forge_core.config import ConfigError, load_config
    from forge_core.controller import Controller, RunFailed
    from forge_core.data import DataError
    from forge_core.models import ModelSourceError
    from forge_core.rewards import RewardError

    try:
        cfg = load_config(a.recipe, a.overrides)
        if a.command == "check":  # the config, its data and reward, and whether this machine could run it
            from omegaconf import OmegaConf

            data = check_task(cfg)  # a bad field or reward: its error alone, before the config's dump
            print(OmegaConf.to_yaml(cfg))
            try:
                preflight(cfg)
            except PreflightError as e:  # this machine's limits (no GPU, no hub): the config itself is valid
                print(f"note: the config is valid, but it {e}", file=sys.stderr)
            print(data, file=sys.stderr)
            if refusals := memory_check(cfg, a.recipe, a.gpu):
                raise PreflightError("the layout does not fit:\n  - " + "\n  - ".join(refusals))
            return 0
        preflight(cfg, a.command, a.ckpt)
    except (ConfigError, PreflightError, DataError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if a.command == "eval":
            from forge_core.evaluate import evaluate

            res = evaluate(cfg, a.ckpt, engine=a.engine)
            print(json.dumps(res, indent=2))
            if a.ckpt:
                try:
                    with open(os.path.join(a.ckpt, "eval.json"), "w") as f:
                        json.dump(res, f, indent=2)
                except OSError as e:  # the figures are printed above all the same
                    print(f"warning: {a.ckpt}/eval.json not written: {e}", file=sys.stderr)
            return 0
        out = run_dir(cfg)
        print(f"run directory: {out}", flush=True)
        # Ctrl-C stops the run (asyncio turns SIGINT into a cancel) even if this process was started
        # with SIGINT ignored or blocked, which a parent's settings pass on (seen under pytest in CI)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        row = asyncio.run(Controller(cfg, out).run())
        print(json.dumps({k: row[k] for k in ("step", "reward_mean", "accuracy", "loss", "elapsed_s") if k in row}))
        print(f"metrics: {out}/metrics.jsonl  plot: {out}/reward.png  final checkpoint: {out}/final")
        return 0
    except (DataError, RewardError, ModelSourceError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:  # an actor that failed beyond recovery (ActorFailed), diverged training, ...
        print(f"error: {e}\ncheckpoints and metrics written so far are intact", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: actors stopped; checkpoints and metrics written so far are intact", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
