"""SkyPilot, client side: ``make sky`` and ``make sky-down`` (the task file checked here first).

    python -m launch.sky launch RECIPE [options] [overrides ...]  # make sky: sky launch -c forge-<recipe> ...
    python -m launch.sky down RECIPE [--cluster]  # make sky-down: sky down <cluster>

What the task runs on the cluster's nodes, its environment and how it finds its recipe:
:mod:`launch.sky_node`. The client-side admin policy of a plain ``sky launch``: :mod:`launch.sky_policy`.
The task files themselves are written from the recipes' configs by :mod:`launch.sky_task` (``make sky-yaml``).
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import shutil
import subprocess
import sys
from typing import Mapping, Optional, Sequence

from launch.common import SECRETS
from launch.sky_node import DEFAULT_CKPT_DIR, ROOT, SkyError, relpath


def cluster_name(recipe: str) -> str:
    """Default cluster name: ``forge-<recipe>`` with ``_`` as ``-`` (valid on every cloud)."""
    return "forge-" + os.path.basename(os.path.abspath(recipe)).replace("_", "-").lower()


def task_config(yaml_path: str, recipe_env: str, bucket: Optional[str] = None,
                forge_args: str = "") -> dict:
    """The task file as a dict with FORGE_RECIPE (and FORGE_ARGS, the bucket mount) filled in.

    Raises:
        SkyError: the file is not valid YAML, or not a YAML mapping; its ``envs`` is no mapping, or
            names a secret (those go under ``secrets:``: SkyPilot keeps ``envs`` in its state).
    """
    import yaml

    try:
        with open(yaml_path) as f:
            cfg = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise SkyError(f"{yaml_path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(cfg, dict):
        raise SkyError(f"{yaml_path}: not a SkyPilot task (a YAML mapping)")
    if not isinstance(cfg.get("envs") or {}, dict):
        raise SkyError(f"{yaml_path}: envs must be a mapping of names to values")
    if secret := next((k for k in SECRETS if k in (cfg.get("envs") or {})), None):
        raise SkyError(f"{yaml_path}: envs.{secret}: a secret is declared under secrets: (its value passed with "
                       f"--secret), never envs:, which SkyPilot keeps in its state and shows")
    envs = cfg["envs"] = {**(cfg.get("envs") or {}), "FORGE_RECIPE": recipe_env,
                          **({"FORGE_ARGS": forge_args} if forge_args else {})}
    if bucket:
        mount = envs.get("FORGE_CKPT_DIR") or DEFAULT_CKPT_DIR
        cfg["file_mounts"] = {**(cfg.get("file_mounts") or {}),
                              mount: {("source" if "://" in bucket else "name"): bucket, "mode": "MOUNT"}}
    return cfg


def parse_task(cfg: dict, secrets: Mapping[str, str]):
    """SkyPilot's own parser (offline): a ``sky.Task``, or SkyPilot's error naming the field."""
    import sky

    return sky.Task.from_yaml_config(copy.deepcopy(cfg),
                                     secrets_overrides=list(secrets.items()) or None)


def layout_mismatch(task, cfg, task_file: str, forge_args: str = "") -> Optional[str]:
    """The error message when ``task`` (a parsed ``sky.Task``) does not ask for config ``cfg``'s layout
    (``forge_args``: the overrides it was composed with): its ``num_nodes`` is not ``layout.nodes``, or
    an option of its ``resources`` has fewer accelerators per node than ``layout.gpus_per_node``; else None."""
    nodes, gpus = int(cfg.layout.nodes), int(cfg.layout.gpus_per_node)
    per_node = min((sum((r.accelerators or {}).values()) for r in task.resources), default=0)
    bad = [f"num_nodes is {task.num_nodes}, layout.nodes is {nodes}"] if task.num_nodes != nodes else []
    if per_node < gpus:
        bad.append(f"resources ask for {per_node:g} accelerator(s) per node, layout.gpus_per_node is {gpus}")
    if not bad:
        return None
    write = f"`make sky-yaml RECIPE={relpath(os.path.dirname(os.path.abspath(task_file)))}`"
    how = (f"the overrides {forge_args!r} change the layout, and the task file must match it (copy the recipe "
           f"folder, set the layout in its config.yaml and write its task file with make sky-yaml RECIPE=<copy>)"
           if "layout" in forge_args else f"write it again from the recipe's config with {write}")
    return f"{relpath(task_file)} does not ask for the recipe's layout: {'; '.join(bad)}; {how}"


def redacted_yaml(task) -> str:
    """The task as SkyPilot parsed it, as YAML, with secret values shown as ``<redacted>``."""
    import yaml

    cfg = task.to_yaml_config()
    cfg.pop("_user_specified_yaml", None)
    if isinstance(res := cfg.get("resources"), dict) and isinstance(res.get("any_of"), list):
        res["any_of"].sort(key=repr)  # SkyPilot keeps them in a set: printed in one order, every time
    sec = cfg.get("secrets")
    if isinstance(sec, dict):
        cfg["secrets"] = {k: ("<redacted>" if v else v) for k, v in sec.items()}

    class _Dumper(yaml.SafeDumper):  # multi-line scripts as literal blocks, as in the task file
        pass

    _Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                                 style="|" if "\n" in s else None))
    return yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def _sky_bin() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "sky")
    return here if os.path.exists(here) else (shutil.which("sky") or "sky")


def launch(recipe_or_yaml: str, cluster: Optional[str] = None, bucket: Optional[str] = None,
           managed: bool = False, dry_run: bool = False, forge_args: str = "",
           extra: Sequence[str] = (), env: Optional[Mapping[str, str]] = None) -> int:
    """``make sky``: check locally, then ``sky launch -c CLUSTER TASK --env FORGE_RECIPE=... --secret ...``.

    Checks first, before any cloud call, that the config (with ``forge_args``) composes, a gated
    model has HF_TOKEN, the data and the reward pass ``make check``'s test
    (:func:`launch.local.check_task`), SkyPilot parses the task file and the task asks for the
    recipe's layout (:func:`layout_mismatch`). Secrets set here go as ``--secret NAME`` (value from
    this environment; the legacy ``HUGGING_FACE_HUB_TOKEN`` goes as ``HF_TOKEN``, the name the task files declare).
    ``bucket``: a derived task file, ``runs/<recipe>/sky-<cluster>.yaml`` (kept), adds the checkpoint
    mount (``FORGE_CKPT_DIR``, mode MOUNT).
    ``dry_run``: print the command and the parsed task (secrets redacted), launch nothing.
    Returns the exit code.
    """
    from forge_core.config import ConfigError, load_config, recipe_dir
    from forge_core.data import DataError
    from forge_core.models import gated_without_token
    from forge_core.rewards import RewardError
    from launch.local import check_task

    env = os.environ if env is None else env
    yaml_path = recipe_or_yaml
    try:
        if recipe_or_yaml.endswith((".yaml", ".yml")) and os.path.isfile(recipe_or_yaml):  # the task file
            yaml_path = os.path.abspath(recipe_or_yaml)
            folder = os.path.dirname(yaml_path)
        else:  # a recipe name or folder: its sky.yaml
            folder = recipe_dir(recipe_or_yaml)
            yaml_path = os.path.join(folder, "sky.yaml")
            if not os.path.isfile(yaml_path):
                raise SkyError(f"recipe {recipe_or_yaml!r} has no sky.yaml ({yaml_path}): write it from its "
                               f"config.yaml with `make sky-yaml RECIPE={relpath(folder)}`")
        rel = relpath(folder)
        cfg = load_config(folder, shlex.split(forge_args))
        if gated := gated_without_token(cfg.model, env):
            raise SkyError(gated)
        print(check_task(cfg), file=sys.stderr)
        tcfg = task_config(yaml_path, rel, bucket, forge_args)
        secrets = {k: env[k] for k in SECRETS if env.get(k)}
        if legacy := secrets.pop("HUGGING_FACE_HUB_TOKEN", None):  # the task files name HF_TOKEN only
            secrets.setdefault("HF_TOKEN", legacy)
        task = parse_task(tcfg, secrets)
        if mismatch := layout_mismatch(task, cfg, yaml_path, forge_args):
            raise SkyError(mismatch)
        if os.path.isabs(rel):
            raise SkyError(f"recipe folder {folder} is outside the repository ({ROOT}), which is all the cluster "
                           f"gets (workdir: .): copy the folder under recipes/")
    except (SkyError, ConfigError, DataError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # SkyPilot's own validation errors (ValueError, InvalidSkyPilotConfigError, ...)
        print(f"error: {yaml_path}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    name, entry = cluster or cluster_name(folder), yaml_path
    if bucket:  # the derived task file stays, so the command printed (also by a dry run) can be run again
        import yaml

        entry = os.path.join(ROOT, "runs", os.path.basename(folder), f"sky-{name}.yaml")
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        with open(entry, "w") as f:
            yaml.safe_dump(tcfg, f, sort_keys=False)
    cmd = [_sky_bin(), "jobs", "launch", "-n", name] if managed else [_sky_bin(), "launch", "-c", name]
    cmd += [relpath(entry), "--env", f"FORGE_RECIPE={rel}"]
    cmd += ["--env", f"FORGE_ARGS={forge_args}"] if forge_args else []
    cmd += [x for k in secrets for x in ("--secret", k)] + list(extra)
    shown = shlex.join(["sky"] + cmd[1:])
    if not dry_run:
        print(f"+ {shown}", flush=True)
        # workdir '.' is the repository root; `--secret NAME` takes the value from sky's environment
        return subprocess.call(cmd, cwd=ROOT, env={**os.environ, **secrets})
    print(f"# recipe {rel}: {cfg.layout.nodes} node(s) x {cfg.layout.gpus_per_node} GPU(s), "
          f"model {cfg.model.name}; secrets passed: {', '.join(secrets) or 'none'}")
    print(f"# command (run from {ROOT}):\n{shown}")
    if bucket:
        print(f"# ({relpath(entry)}: {relpath(yaml_path)} plus the checkpoint bucket mount)")
    print("# task as SkyPilot parsed it:")
    print(redacted_yaml(task), end="")
    return 0


def down(recipe: str, cluster: Optional[str] = None, yes: bool = False) -> int:
    """``make sky-down``: ``sky down CLUSTER`` (default ``forge-<recipe>``)."""
    name = cluster or cluster_name(recipe)
    cmd = [_sky_bin(), "down", name] + (["-y"] if yes else [])
    print(f"+ {shlex.join(['sky'] + cmd[1:])}", flush=True)
    return subprocess.call(cmd)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``launch`` or ``down`` (see the module docstring); returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["run"], ["check"]):  # task files written before the split call launch.sky run|check
        from launch import sky_node

        return sky_node.main(argv)
    p = argparse.ArgumentParser(prog="python -m launch.sky", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launch", help="make sky: sky launch with the recipe and secrets")
    la.add_argument("recipe", help="recipe name, folder, or its sky.yaml")
    la.add_argument("--cluster", default=None, help="cluster (or managed job) name; default forge-<recipe>")
    la.add_argument("--bucket", default=None, help="checkpoint bucket mounted at FORGE_CKPT_DIR (name or s3://, gs://)")
    la.add_argument("--managed", action="store_true", help="sky jobs launch (recovers from preemption)")
    la.add_argument("--dry-run", action="store_true", help="print the command and the parsed task; launch nothing")
    la.add_argument("--sky-args", default="", help="more sky launch options, one shell-quoted string")
    la.add_argument("overrides", nargs="*", default=[], help="Hydra overrides for the run (FORGE_ARGS), e.g. steps=50")
    d = sub.add_parser("down", help="make sky-down: sky down the recipe's cluster")
    d.add_argument("recipe")
    d.add_argument("--cluster", default=None)
    d.add_argument("-y", "--yes", action="store_true")
    a, extra = p.parse_known_args(argv)  # overrides may come after the options, as in make sky
    if extra and (a.cmd != "launch" or any(x.startswith("-") for x in extra)):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if a.cmd == "launch":
        forge_args = shlex.join(a.overrides + extra)  # FORGE_ARGS, split with shlex on the nodes
        try:
            sky_args = shlex.split(a.sky_args)
        except ValueError as e:  # an unclosed quote
            p.error(f"--sky-args {a.sky_args!r}: {e}")
        return launch(a.recipe, a.cluster, a.bucket, a.managed, a.dry_run, forge_args, sky_args)
    return down(a.recipe, a.cluster, a.yes)


if __name__ == "__main__":
    sys.exit(main())
