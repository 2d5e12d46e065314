"""SkyPilot, cluster side: what ``recipes/<name>/sky.yaml`` runs on every node of the cluster.

    python -m launch.sky_node check [--gpu]   # end of the task's setup: section
    python -m launch.sky_node run             # the task's run: section

Every node finds its rank and the node IPs with :func:`launch.bootstrap.cluster_from_sky`, checks
the config, then runs :mod:`launch.node` (node 0: worker and controller) or :func:`run_worker_node`
(the others: a worker that exits, code 3, when node 0 is not up within ``FORGE_ATTACH_TIMEOUT`` seconds
or goes away). The client side (``make sky``) is :mod:`launch.sky`.

Task environment (declared in every ``sky.yaml``; override with ``--env NAME=VALUE``):

    FORGE_RECIPE          recipe folder (a name under recipes/ or a path in the workdir); see below
    FORGE_ARGS            extra Hydra overrides, e.g. "steps=50 trainer.lr=1e-6" (shell-quoted)
    FORGE_CKPT_DIR        where the checkpoint bucket is mounted (default /checkpoints); when that
                          directory exists the run writes to FORGE_CKPT_DIR/<recipe>/<run id>/
    FORGE_ATTACH_TIMEOUT  seconds node 0 waits for all workers (default 300)
    HF_TOKEN, WANDB_API_KEY  secrets (``--secret NAME``); empty means unset. A WANDB_API_KEY turns
                          wandb logging on (WANDB_MODE=online) unless WANDB_MODE says otherwise.
    FORGE_PYTHON          interpreter of the run: section (default ~/forge-venv/bin/python, built by setup:)

Run id and recovery: the run id is ``FORGE_RUN_ID``, else ``SKYPILOT_TASK_ID``, which a managed
job (``sky jobs launch``) keeps across recoveries; the controller resumes from the newest checkpoint
in ``<output_dir>/<run id>/checkpoints/``, so a recovered job continues from the bucket. Without a
bucket the run directory is on the cluster's disk (``~/sky_workdir/runs/<recipe>/<run id>``) and a
recovery starts over.

Which recipe does a task run? (decision)
    SkyPilot 0.14.1 resolves ``workdir: .`` against the *current directory* of ``sky launch``
    (``Task.expand_and_validate_workdir``) and sends the cluster the task file's *contents*, never
    its path (sky/task.py, sky/utils/dag_utils.py, sky/backends/task_codegen.py). So ``sky launch``
    runs from the repository root, the whole repository is the workdir, and the recipe is:

    1. ``FORGE_RECIPE`` when set: by ``make sky RECIPE=x``, by the client-side policy of a plain
       ``sky launch recipes/x/sky.yaml`` (:mod:`launch.sky_policy`), or by ``--env FORGE_RECIPE=x``
       (which wins over both), so an unchanged copy runs itself.
    2. Otherwise (the Python API, a ``sky`` run elsewhere) the recipe folder under ``recipes/``
       (with config.yaml and sky.yaml) whose layout, after ``FORGE_ARGS``, matches the cluster
       (``SKYPILOT_NUM_NODES`` x ``SKYPILOT_NUM_GPUS_PER_NODE``): every shipped recipe has its own shape.
    3. Several folders fit (a copy fits wherever its original does) or none: the run stops, listing
       them and saying to pass ``FORGE_RECIPE``; ``setup:`` ends with the same check.

    Rejected: naming the recipe inside sky.yaml (a copy would silently run the original);
    resolving by modification time (silently wrong).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import subprocess
import sys
import time
from typing import Mapping, MutableMapping, Optional, Sequence

from launch.common import SECRETS, port_open

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CKPT_DIR = "/checkpoints"
DEFAULT_ATTACH_TIMEOUT = 300.0

# What setup: must have installed (``check``); torch follows vLLM's pin on GPU nodes.
GPU_VERSIONS = {"vllm": "0.26.0", "torch": "2.11.", "torchmonarch": "0.7.0", "torchtitan": "0.2.2"}
CPU_VERSIONS = {"torch": "2.13.", "torchmonarch": "0.7.0", "torchtitan": "0.2.2"}


class SkyError(RuntimeError):
    """A launch or a task cannot go on; the message says why and what to do."""


def candidate_recipes(root: str = ROOT) -> list[str]:
    """Recipe folders SkyPilot can launch: ``recipes/*`` holding both config.yaml and sky.yaml."""
    base = os.path.join(root, "recipes")
    if not os.path.isdir(base):
        return []
    return [os.path.join(base, n) for n in sorted(os.listdir(base))
            if os.path.isfile(os.path.join(base, n, "config.yaml"))
            and os.path.isfile(os.path.join(base, n, "sky.yaml"))]


def relpath(path: str, root: str = ROOT) -> str:
    """``path`` relative to the repository root when it is inside it, else unchanged."""
    r = os.path.relpath(path, root)
    return path if r.startswith("..") else r


def recipe_shape(recipe: str, overrides: Sequence[str] = ()) -> tuple[int, int]:
    """``(layout.nodes, layout.gpus_per_node)`` of a recipe after ``overrides``."""
    from forge_core.config import load_config

    cfg = load_config(recipe, list(overrides))
    return int(cfg.layout.nodes), int(cfg.layout.gpus_per_node)


def resolve_recipe(nodes: int, gpus_per_node: int, overrides: Sequence[str] = (),
                   env: Optional[Mapping[str, str]] = None, root: str = ROOT) -> str:
    """The recipe folder a task runs (absolute path); see the module docstring for the rule.

    Raises:
        SkyError: FORGE_RECIPE names no recipe, or zero or several recipe folders fit the cluster.
    """
    from forge_core.config import ConfigError, recipe_dir

    env = os.environ if env is None else env
    named = (env.get("FORGE_RECIPE") or "").strip()
    if named:
        in_root = [c for c in (os.path.join(root, named), os.path.join(root, "recipes", named))
                   if not os.path.isabs(named) and os.path.isdir(c)]
        try:
            return recipe_dir(in_root[0] if in_root else named)
        except ConfigError as e:
            raise SkyError(f"FORGE_RECIPE={named!r}: {e}") from None
    fits, skipped = [], []
    for d in candidate_recipes(root):
        try:
            if recipe_shape(d, overrides) == (nodes, gpus_per_node):
                fits.append(d)
        except ConfigError as e:
            skipped.append(f"{relpath(d, root)} ({str(e)[:200]})")
    shape = f"{nodes} node(s) x {gpus_per_node} GPU(s)"
    how = ("SkyPilot sends the cluster the task file's contents, not its path, and FORGE_RECIPE is "
           "empty: run `sky launch recipes/<folder>/sky.yaml` from the repository root (its "
           ".sky.yaml policy sets FORGE_RECIPE), or `make sky RECIPE=<folder>`, or add "
           "--env FORGE_RECIPE=<folder under recipes/>")
    if len(fits) == 1:
        return fits[0]
    if not fits:
        extra = f"; not loadable: {', '.join(skipped)}" if skipped else ""
        raise SkyError(f"no recipe under recipes/ has the layout of this cluster ({shape}){extra}. {how}")
    raise SkyError(f"several recipes fit this cluster ({shape}): "
                   f"{', '.join(relpath(d, root) for d in fits)}. {how}")


def run_worker_node(cluster, timeout_s: float, grace_s: float = 30.0, poll_s: float = 3.0) -> int:
    """Run this node's Monarch worker until node 0 shuts the mesh down (returns its exit code).

    Exits 3 when this node's worker port is taken; or, naming node 0's address, when node 0's worker
    port does not open within ``timeout_s`` seconds, or closes and this worker has not been shut down
    ``grace_s`` seconds later (the controller died): the worker process is terminated first.
    """
    from launch import bootstrap

    head, port = cluster.hosts[0], cluster.port
    try:
        proc = bootstrap.start_worker_background(cluster)
    except bootstrap.PortInUse as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    deadline, seen, gone_since = time.monotonic() + timeout_s, False, None
    try:
        while (rc := proc.poll()) is None:
            now = time.monotonic()
            if port_open(head, port):
                seen, gone_since = True, None
            elif seen:
                gone_since = gone_since or now
            if (not seen and now > deadline) or (gone_since is not None and now - gone_since > grace_s):
                why = ("went away without shutting the mesh down" if seen else
                       f"did not come up within {timeout_s:g} s; see node 0's log")
                print(f"error: the controller node (node 0, {head}:{port}) {why}", file=sys.stderr, flush=True)
                return 3
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=poll_s)
        return rc
    finally:
        bootstrap.stop(proc)


def run(argv: Sequence[str] = (), env: Optional[MutableMapping[str, str]] = None) -> int:
    """The task's run: section on one node. Returns the exit code.

    0: done; 2: task, recipe or config error (nothing started); 3: nodes could not reach each other.
    """
    from launch import bootstrap

    env = os.environ if env is None else env
    for k in [k for k in SECRETS if k in env and not env[k]]:  # declared empty: --secret is optional
        del env[k]
    if env.get("WANDB_API_KEY") and not env.get("WANDB_MODE"):
        env["WANDB_MODE"] = "online"
    if not env.get("FORGE_RUN_ID") and env.get("SKYPILOT_TASK_ID"):
        env["FORGE_RUN_ID"] = env["SKYPILOT_TASK_ID"].replace("/", "_")
    overrides = shlex.split(env.get("FORGE_ARGS", "")) + list(argv)
    try:
        cluster = bootstrap.cluster_from_sky(env)
    except (KeyError, ValueError, OSError) as e:
        print(f"error: not a SkyPilot task node: {e}", file=sys.stderr)
        return 2

    from forge_core.config import ConfigError, load_config
    from forge_core.data import DataError
    from forge_core.models import gated_without_token
    from forge_core.rewards import RewardError
    from launch.local import check_task

    try:
        recipe = resolve_recipe(cluster.num_nodes, int(env.get("SKYPILOT_NUM_GPUS_PER_NODE") or 0),
                                overrides, env)
        ckpt = env.get("FORGE_CKPT_DIR", DEFAULT_CKPT_DIR)
        if ckpt and os.path.isdir(ckpt) and not any(o.startswith("output_dir=") for o in overrides):
            overrides.append(f"output_dir={os.path.join(ckpt, os.path.basename(recipe))}")
        cfg = load_config(recipe, overrides)  # every node: a bad key fails here, on every node
        if gated := gated_without_token(cfg.model, env):
            raise SkyError(gated)
        check_task(cfg)  # and bad data or a failing reward (node 0 prints what it loaded: launch.node)
    except (SkyError, ConfigError, DataError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[sky] node {cluster.node_rank}/{cluster.num_nodes} hosts={','.join(cluster.hosts)} "
          f"port={cluster.port} recipe={relpath(recipe)} run_id={env.get('FORGE_RUN_ID', '')} "
          f"output_dir={cfg.output_dir}" + (f" overrides={shlex.join(overrides)}" if overrides else ""),
          flush=True)
    timeout_s = float(env.get("FORGE_ATTACH_TIMEOUT") or DEFAULT_ATTACH_TIMEOUT)
    if not cluster.is_controller:
        return run_worker_node(cluster, timeout_s)
    from launch import node

    return node.main(["--from", "sky", "--attach-timeout", str(timeout_s), recipe, *overrides])


def check(gpu: bool, env: Optional[Mapping[str, str]] = None) -> int:
    """End of setup: the installed versions are the tested ones, the GPUs are there, and the
    recipe this task will run can be found, its config composes and its data and reward pass
    (:func:`launch.local.check_task`), so a mistake fails before the run. Returns 0 or 1."""
    from importlib.metadata import PackageNotFoundError, version

    from forge_core.config import load_config
    from forge_core.data import DataError
    from forge_core.rewards import RewardError
    from launch.local import check_task

    env = os.environ if env is None else env
    problems = []
    for pkg, want in (GPU_VERSIONS if gpu else CPU_VERSIONS).items():
        try:
            have = version(pkg)
        except PackageNotFoundError:
            have = None
        ok = have is not None and (have.startswith(want) if want.endswith(".") else have.split("+")[0] == want)
        want += "x" if want.endswith(".") else ""
        print(f"[check] {pkg:13s} {have or 'missing':18s} want {want}{'' if ok else '   <-- wrong'}", flush=True)
        if not ok:
            problems.append(f"{pkg} {have or 'missing'} (want {want})")
    need = int(env.get("SKYPILOT_SETUP_NUM_GPUS_PER_NODE") or env.get("SKYPILOT_NUM_GPUS_PER_NODE") or 0)
    if gpu or need:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"[check] CUDA GPUs      {have} (task asks for {need})", flush=True)
        if have < need:
            problems.append(f"torch sees {have} CUDA GPU(s), the task asks for {need}")
    ips = [l for l in (env.get("SKYPILOT_SETUP_NODE_IPS") or "").splitlines() if l.strip()]
    nodes = len(ips) or int(env.get("SKYPILOT_NUM_NODES") or 1)
    try:
        overrides = shlex.split(env.get("FORGE_ARGS", ""))
        r = resolve_recipe(nodes, need, overrides, env)
        cfg = load_config(r, overrides)  # a bad FORGE_ARGS key fails here, before run:
        print(f"[check] recipe         {relpath(r)}", flush=True)
        print(f"[check] {check_task(cfg)}", flush=True)
    except (SkyError, DataError, RewardError) as e:
        problems.append(str(e))
    except ValueError as e:  # a ConfigError, or FORGE_ARGS with an unclosed quote
        problems.append(f"FORGE_ARGS={env.get('FORGE_ARGS', '')!r}: {e}")
    if problems:
        print("error: setup check failed:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``run`` or ``check`` (see the module docstring); returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m launch.sky_node", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the task's run: section (every node)")
    r.add_argument("overrides", nargs="*", default=[], help="Hydra overrides (after FORGE_ARGS)")
    c = sub.add_parser("check", help="end of setup: versions, GPUs, recipe")
    c.add_argument("--gpu", action="store_true", help="expect the GPU extra (vLLM, torch 2.11)")
    a = p.parse_args(argv)
    return run(a.overrides) if a.cmd == "run" else check(a.gpu)


if __name__ == "__main__":
    sys.exit(main())
