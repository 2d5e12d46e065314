"""SkyPilot adapter: the cluster side of ``recipes/<name>/sky.yaml`` and the client side of ``make sky``.

    python -m launch.sky run                      # the task's run: section, on every node
    python -m launch.sky check [--gpu]            # end of the task's setup: section, on every node
    python -m launch.sky launch RECIPE [options]  # make sky: sky launch -c forge-<recipe> ... (--dry-run)
    python -m launch.sky down RECIPE [--cluster]  # make sky-down: sky down <cluster>

On the cluster (``run``), every node reads ``SKYPILOT_NODE_RANK`` and ``SKYPILOT_NODE_IPS``
(newline-separated, rank order) through :func:`launch.bootstrap.cluster_from_sky`, checks the
config, then hands over to :mod:`launch.node`: node 0 runs a Monarch worker and the controller,
which attaches to every node's worker; every other node runs a worker. A worker node also watches
node 0's worker port and exits (code 3, naming node 0's address) when node 0 never comes up within
``FORGE_ATTACH_TIMEOUT`` seconds, or goes away without shutting the mesh down, so no process is
left behind by a failed controller.

Task environment (declared in every ``sky.yaml``; override with ``--env NAME=VALUE``):

    FORGE_RECIPE          recipe folder (a name under recipes/ or a path in the workdir); see below
    FORGE_ARGS            extra Hydra overrides, e.g. "steps=50 trainer.lr=1e-6" (shell-quoted)
    FORGE_CKPT_DIR        where the checkpoint bucket is mounted (default /checkpoints); when that
                          directory exists the run writes to FORGE_CKPT_DIR/<recipe>/<run id>/
    FORGE_ATTACH_TIMEOUT  seconds node 0 waits for all workers (default 300)
    HF_TOKEN, WANDB_API_KEY  secrets (``--secret NAME``); empty means unset. A WANDB_API_KEY turns
                          wandb logging on (WANDB_MODE=online) unless WANDB_MODE says otherwise.
    FORGE_PYTHON          interpreter of the run: section (default ~/forge-venv/bin/python, the
                          venv that setup: builds)

Run id and recovery: the run id is ``FORGE_RUN_ID``, else ``SKYPILOT_TASK_ID``. SkyPilot keeps
the task id across a managed job's recoveries (``sky jobs launch``), and the controller resumes
from ``<output_dir>/<run id>/checkpoints/`` when it holds a checkpoint, so a recovered job on a new
cluster continues from the last checkpoint in the bucket. Without a bucket the run directory is on
the cluster's own disk (``~/sky_workdir/runs/<recipe>/<run id>``) and a recovery starts over.

Which recipe does a task run? (decision)
    SkyPilot 0.14.1 resolves ``workdir: .`` against the *current directory* of ``sky launch``
    (``Task.expand_and_validate_workdir`` calls ``os.path.abspath``), not against the task file's
    folder, and it sends the cluster the task file's *contents*, never its path (checked in
    sky/task.py, sky/utils/dag_utils.py, sky/backends/task_codegen.py). So ``sky launch`` runs
    from the repository root, the whole repository is the workdir, and the recipe is:

    1. ``FORGE_RECIPE`` when set. ``make sky RECIPE=x`` always sets it; a plain
       ``sky launch recipes/x/sky.yaml`` gets it from the client-side admin policy that the
       project config ``.sky.yaml`` names (:mod:`launch.sky_policy`: the task file's folder,
       read from the command line before the request leaves the client), so an unchanged copy
       (``cp -r recipes/a recipes/b``) runs ``b``; ``--env FORGE_RECIPE=x`` overrides both.
    2. Otherwise (the Python API, a ``sky`` run elsewhere) the recipe folder under ``recipes/``
       (with a config.yaml and a sky.yaml) whose layout, after ``FORGE_ARGS``, matches the cluster
       SkyPilot gave the task (``SKYPILOT_NUM_NODES`` x ``SKYPILOT_NUM_GPUS_PER_NODE``): every
       shipped recipe has its own shape.
    3. Several folders fit (a copy fits wherever its original does) or none: the run stops,
       listing them and saying to pass ``FORGE_RECIPE``. ``setup:`` ends with the same check, so
       this fails before the run starts.

    Rejected: naming the recipe inside sky.yaml (a copy would silently run the original);
    resolving by modification time (silently wrong).
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Mapping, MutableMapping, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRETS = ("HF_TOKEN", "WANDB_API_KEY")
DEFAULT_CKPT_DIR = "/checkpoints"
DEFAULT_ATTACH_TIMEOUT = 300.0

# What setup: must have installed (``check``); torch follows vLLM's pin on GPU nodes.
GPU_VERSIONS = {"vllm": "0.26.0", "torch": "2.11.", "torchmonarch": "0.7.0", "torchtitan": "0.2.2"}
CPU_VERSIONS = {"torch": "2.13.", "torchmonarch": "0.7.0", "torchtitan": "0.2.2"}


class SkyError(RuntimeError):
    """A launch or a task cannot go on; the message says why and what to do."""


# --------------------------------------------------------------------------- recipes


def _recipes_root(root: str = ROOT) -> str:
    return os.path.join(root, "recipes")


def candidate_recipes(root: str = ROOT) -> list[str]:
    """Recipe folders SkyPilot can launch: ``recipes/*`` holding both config.yaml and sky.yaml."""
    base = _recipes_root(root)
    if not os.path.isdir(base):
        return []
    return [os.path.join(base, n) for n in sorted(os.listdir(base))
            if os.path.isfile(os.path.join(base, n, "config.yaml"))
            and os.path.isfile(os.path.join(base, n, "sky.yaml"))]


def _rel(path: str, root: str = ROOT) -> str:
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
            skipped.append(f"{_rel(d, root)} ({str(e)[:200]})")
    shape = f"{nodes} node(s) x {gpus_per_node} GPU(s)"
    how = ("SkyPilot sends the cluster the task file's contents, not its path, and FORGE_RECIPE is "
           "empty: run `sky launch recipes/<folder>/sky.yaml` from the repository root (its "
           ".sky.yaml policy sets FORGE_RECIPE), or `make sky RECIPE=<folder>`, or add "
           "--env FORGE_RECIPE=<folder under recipes/>")
    if len(fits) == 1:
        return fits[0]
    if not fits:
        extra = f"; not loadable: {', '.join(skipped)}" if skipped else ""
        raise SkyError(f"no recipe under {_rel(_recipes_root(root), root)}/ has the layout of this "
                       f"cluster ({shape}){extra}. {how}")
    raise SkyError(f"several recipes fit this cluster ({shape}): "
                   f"{', '.join(_rel(d, root) for d in fits)}. {how}")


def gated_without_token(cfg, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The error message when the recipe's model is gated and HF_TOKEN is missing, else None."""
    from forge_core.models import spec_of

    env = os.environ if env is None else env
    spec = spec_of(cfg.model.name)
    local = cfg.model.path and os.path.isdir(cfg.model.path)
    if not spec.gated or local or env.get("HF_TOKEN"):
        return None
    path = cfg.model.path or spec.path
    return (f"model {path} (recipe {cfg.recipe}) is gated on the HF hub and HF_TOKEN is not set: "
            f"accept its licence on huggingface.co, export HF_TOKEN and launch with --secret HF_TOKEN "
            f"(`make sky` passes it when HF_TOKEN is set)")


# --------------------------------------------------------------------------- cluster side


def _task_env(env: MutableMapping[str, str]) -> None:
    """Normalise the task's secrets and logging switches in place."""
    for k in SECRETS:  # the task file declares them empty so that --secret is optional
        if k in env and not env[k]:
            del env[k]
    if env.get("WANDB_API_KEY") and not env.get("WANDB_MODE"):
        env["WANDB_MODE"] = "online"
    if not env.get("FORGE_RUN_ID") and env.get("SKYPILOT_TASK_ID"):
        env["FORGE_RUN_ID"] = env["SKYPILOT_TASK_ID"].replace("/", "_")


def _port_open(host: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def run_worker_node(cluster, timeout_s: float, grace_s: float = 30.0, poll_s: float = 3.0) -> int:
    """Run this node's Monarch worker until node 0 shuts the mesh down (returns its exit code).

    Exits 3, naming node 0's address, when node 0's worker port does not open within
    ``timeout_s`` seconds, or closes and this worker has not been shut down ``grace_s`` seconds
    later (the controller died): the worker process is terminated first.
    """
    from launch import bootstrap

    head, port = cluster.hosts[0], cluster.port
    proc = bootstrap.start_worker_background(cluster)
    deadline = time.monotonic() + timeout_s
    seen, gone_since, why = False, None, None
    try:
        while True:
            rc = proc.poll()
            if rc is not None:
                return rc
            now = time.monotonic()
            if _port_open(head, port):
                seen, gone_since = True, None
            elif not seen and now > deadline:
                why = (f"the controller node (node 0, {head}:{port}) did not come up within "
                       f"{timeout_s:g} s; see node 0's log")
            elif seen:
                gone_since = gone_since or now
                if now - gone_since > grace_s:
                    why = f"the controller node (node 0, {head}:{port}) went away without shutting the mesh down"
            if why:
                print(f"error: {why}", file=sys.stderr, flush=True)
                return 3
            try:
                proc.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                pass
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run(argv: Sequence[str] = (), env: Optional[MutableMapping[str, str]] = None) -> int:
    """The task's run: section on one node. Returns the exit code.

    0: done; 2: task, recipe or config error (nothing started); 3: nodes could not reach each other.
    """
    from launch import bootstrap

    env = os.environ if env is None else env
    _task_env(env)
    overrides = shlex.split(env.get("FORGE_ARGS", "")) + list(argv)
    try:
        cluster = bootstrap.cluster_from_sky(env)
    except (KeyError, ValueError, OSError) as e:
        print(f"error: not a SkyPilot task node: {e}", file=sys.stderr)
        return 2

    from forge_core.config import ConfigError, load_config

    try:
        recipe = resolve_recipe(cluster.num_nodes, int(env.get("SKYPILOT_NUM_GPUS_PER_NODE") or 0),
                                overrides, env)
        name = os.path.basename(recipe)
        ckpt = env.get("FORGE_CKPT_DIR", DEFAULT_CKPT_DIR)
        if ckpt and os.path.isdir(ckpt) and not any(o.startswith("output_dir=") for o in overrides):
            overrides.append(f"output_dir={os.path.join(ckpt, name)}")
        cfg = load_config(recipe, overrides)  # every node: a bad key fails here, on every node
        gated = gated_without_token(cfg, env)
        if gated:
            raise SkyError(gated)
    except (SkyError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[sky] node {cluster.node_rank}/{cluster.num_nodes} hosts={','.join(cluster.hosts)} "
          f"port={cluster.port} recipe={_rel(recipe)} run_id={env.get('FORGE_RUN_ID', '')} "
          f"output_dir={cfg.output_dir}" + (f" overrides={shlex.join(overrides)}" if overrides else ""),
          flush=True)
    timeout_s = float(env.get("FORGE_ATTACH_TIMEOUT") or DEFAULT_ATTACH_TIMEOUT)
    if not cluster.is_controller:
        return run_worker_node(cluster, timeout_s)
    from launch import node

    return node.main(["--from", "sky", "--attach-timeout", str(timeout_s), recipe, *overrides])


def check(gpu: bool, env: Optional[Mapping[str, str]] = None) -> int:
    """End of setup: the installed versions are the tested ones, the GPUs are there, and the
    recipe this task will run can be found (so a mistake fails before the run). Returns 0 or 1."""
    from importlib.metadata import PackageNotFoundError, version

    env = os.environ if env is None else env
    problems = []
    for pkg, want in (GPU_VERSIONS if gpu else CPU_VERSIONS).items():
        try:
            have = version(pkg)
        except PackageNotFoundError:
            have = None
        ok = have is not None and (have.startswith(want) if want.endswith(".") else
                                   have.split("+")[0] == want)
        print(f"[check] {pkg:13s} {have or 'missing':18s} want {want}{'x' if want.endswith('.') else ''}"
              f"{'' if ok else '   <-- wrong'}", flush=True)
        if not ok:
            problems.append(f"{pkg} {have or 'missing'} (want {want}{'x' if want.endswith('.') else ''})")
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
        r = resolve_recipe(nodes, need, shlex.split(env.get("FORGE_ARGS", "")), env)
        print(f"[check] recipe         {_rel(r)}", flush=True)
    except SkyError as e:
        problems.append(str(e))
    if problems:
        print("error: setup check failed:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------- client side


def _task_file(recipe_or_yaml: str) -> tuple[str, str]:
    """``(recipe folder, its sky.yaml)`` from a recipe name, a folder or a sky.yaml path."""
    from forge_core.config import ConfigError, recipe_dir

    p = recipe_or_yaml
    if p.endswith((".yaml", ".yml")) and os.path.isfile(p):
        folder = os.path.dirname(os.path.abspath(p))
        return folder, os.path.abspath(p)
    try:
        folder = recipe_dir(p)
    except ConfigError as e:
        raise SkyError(str(e)) from None
    yaml_path = os.path.join(folder, "sky.yaml")
    if not os.path.isfile(yaml_path):
        raise SkyError(f"recipe {p!r} has no sky.yaml ({yaml_path})")
    return folder, yaml_path


def cluster_name(recipe: str) -> str:
    """Default cluster name: ``forge-<recipe>`` with ``_`` as ``-`` (valid on every cloud)."""
    return "forge-" + os.path.basename(os.path.abspath(recipe)).replace("_", "-").lower()


def task_config(yaml_path: str, recipe_env: str, bucket: Optional[str] = None,
                forge_args: str = "") -> dict:
    """The task file as a dict with FORGE_RECIPE (and FORGE_ARGS, the bucket mount) filled in.

    Raises:
        SkyError: the file is not a YAML mapping.
    """
    import yaml

    with open(yaml_path) as f:
        cfg = yaml.safe_load(f)
    if not isinstance(cfg, dict):
        raise SkyError(f"{yaml_path}: not a SkyPilot task (a YAML mapping)")
    cfg = copy.deepcopy(cfg)
    envs = dict(cfg.get("envs") or {})
    envs["FORGE_RECIPE"] = recipe_env
    if forge_args:
        envs["FORGE_ARGS"] = forge_args
    cfg["envs"] = envs
    if bucket:
        mount = envs.get("FORGE_CKPT_DIR") or DEFAULT_CKPT_DIR
        fm = dict(cfg.get("file_mounts") or {})
        fm[mount] = {"name": bucket, "mode": "MOUNT"} if "://" not in bucket else {"source": bucket, "mode": "MOUNT"}
        cfg["file_mounts"] = fm
    return cfg


def parse_task(cfg: dict, secrets: Mapping[str, str]):
    """SkyPilot's own parser (offline): a ``sky.Task``, or SkyPilot's error naming the field."""
    import sky

    return sky.Task.from_yaml_config(copy.deepcopy(cfg),
                                     secrets_overrides=list(secrets.items()) or None)


def redacted_yaml(task) -> str:
    """The task as SkyPilot parsed it, as YAML, with secret values shown as ``<redacted>``."""
    import yaml

    cfg = task.to_yaml_config()
    cfg.pop("_user_specified_yaml", None)
    sec = cfg.get("secrets")
    if isinstance(sec, dict):
        cfg["secrets"] = {k: ("<redacted>" if v else v) for k, v in sec.items()}

    class _Dumper(yaml.SafeDumper):  # multi-line scripts as literal blocks, as in the task file
        pass

    def _str(dumper, s):
        style = "|" if "\n" in s else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)

    _Dumper.add_representer(str, _str)
    return yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def _sky_bin() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "sky")
    return here if os.path.exists(here) else (shutil.which("sky") or "sky")


def launch(recipe_or_yaml: str, cluster: Optional[str] = None, bucket: Optional[str] = None,
           managed: bool = False, dry_run: bool = False, forge_args: str = "",
           extra: Sequence[str] = (), env: Optional[Mapping[str, str]] = None) -> int:
    """``make sky``: check locally, then ``sky launch -c CLUSTER TASK --env FORGE_RECIPE=... --secret ...``.

    Local checks, before any cloud call: the recipe's config (with ``forge_args``) composes; a gated
    model has HF_TOKEN; SkyPilot parses the task file. Secrets are passed with ``--secret NAME``
    (value from this environment) only when set here. With ``bucket`` the task gets the checkpoint
    mount (``FORGE_CKPT_DIR``, mode MOUNT) and is launched from a derived task file. ``dry_run``
    prints the command and the task as SkyPilot parsed it (secrets redacted) and launches nothing.
    Returns the exit code.
    """
    from forge_core.config import ConfigError, load_config

    env = os.environ if env is None else env
    yaml_path = recipe_or_yaml
    try:
        folder, yaml_path = _task_file(recipe_or_yaml)
        rel = _rel(folder)
        cfg = load_config(folder, shlex.split(forge_args))
        gated = gated_without_token(cfg, env)
        if gated:
            raise SkyError(gated)
        tcfg = task_config(yaml_path, rel, bucket, forge_args)
        secrets = {k: env[k] for k in SECRETS if env.get(k)}
        task = parse_task(tcfg, secrets)
    except (SkyError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # SkyPilot's own validation errors (ValueError, InvalidSkyPilotConfigError, ...)
        print(f"error: {yaml_path}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    entry = yaml_path
    if bucket:
        import yaml

        fd, entry = tempfile.mkstemp(prefix=f"sky-{os.path.basename(folder)}-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(tcfg, f, sort_keys=False)
    name = cluster or cluster_name(folder)
    cmd = [_sky_bin(), "jobs", "launch", "-n", name] if managed else [_sky_bin(), "launch", "-c", name]
    cmd += [_rel(entry), "--env", f"FORGE_RECIPE={rel}"]
    if forge_args:
        cmd += ["--env", f"FORGE_ARGS={forge_args}"]
    for k in secrets:
        cmd += ["--secret", k]
    cmd += list(extra)
    shown = shlex.join(["sky"] + cmd[1:])
    if dry_run:
        print(f"# recipe {rel}: {cfg.layout.nodes} node(s) x {cfg.layout.gpus_per_node} GPU(s), "
              f"model {cfg.model.name}; secrets passed: {', '.join(secrets) or 'none'}")
        print(f"# command (run from {ROOT}):\n{shown}")
        if bucket:
            print(f"# ({_rel(entry)}: {_rel(yaml_path)} plus the checkpoint bucket mount)")
        print("# task as SkyPilot parsed it:")
        print(redacted_yaml(task), end="")
        if bucket:
            os.unlink(entry)
        return 0
    print(f"+ {shown}", flush=True)
    try:
        return subprocess.call(cmd, cwd=ROOT)  # workdir '.' is the repository root
    finally:
        if bucket:
            os.unlink(entry)


def down(recipe: str, cluster: Optional[str] = None, yes: bool = False) -> int:
    """``make sky-down``: ``sky down CLUSTER`` (default ``forge-<recipe>``)."""
    name = cluster or cluster_name(recipe)
    cmd = [_sky_bin(), "down", name] + (["-y"] if yes else [])
    print(f"+ {shlex.join(['sky'] + cmd[1:])}", flush=True)
    return subprocess.call(cmd)


# --------------------------------------------------------------------------- CLI


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.sky", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the task's run: section (every node)")
    r.add_argument("overrides", nargs="*", help="Hydra overrides (after FORGE_ARGS)")
    c = sub.add_parser("check", help="end of setup: versions, GPUs, recipe")
    c.add_argument("--gpu", action="store_true", help="expect the GPU extra (vLLM, torch 2.11)")
    la = sub.add_parser("launch", help="make sky: sky launch with the recipe and secrets")
    la.add_argument("recipe", help="recipe name, folder, or its sky.yaml")
    la.add_argument("--cluster", default=None, help="cluster (or managed job) name; default forge-<recipe>")
    la.add_argument("--bucket", default=None, help="checkpoint bucket mounted at FORGE_CKPT_DIR (name or s3://, gs://)")
    la.add_argument("--managed", action="store_true", help="sky jobs launch (recovers from preemption)")
    la.add_argument("--dry-run", action="store_true", help="print the command and the parsed task; launch nothing")
    la.add_argument("--args", default="", help="Hydra overrides for the run (FORGE_ARGS)")
    la.add_argument("--sky-args", default="", help="more sky launch options, one shell-quoted string")
    d = sub.add_parser("down", help="make sky-down: sky down the recipe's cluster")
    d.add_argument("recipe")
    d.add_argument("--cluster", default=None)
    d.add_argument("-y", "--yes", action="store_true")
    a = p.parse_args(argv)
    if a.cmd == "run":
        return run(a.overrides)
    if a.cmd == "check":
        return check(a.gpu)
    if a.cmd == "launch":
        return launch(a.recipe, a.cluster, a.bucket, a.managed, a.dry_run, a.args, shlex.split(a.sky_args))
    return down(a.recipe, a.cluster, a.yes)


if __name__ == "__main__":
    sys.exit(main())
