"""Client-side SkyPilot admin policy: a task file's folder is its recipe.

A task file's path is only known where ``sky launch`` runs (why that matters: the decision in
:mod:`launch.sky_node`). The project config ``.sky.yaml`` names this policy; SkyPilot applies it to
every ``sky launch``, ``sky exec`` and ``sky jobs launch`` before the request leaves the client and
strips it from the config it sends, so no API server ever imports this module.

For a task whose ``FORGE_RECIPE`` is empty (an explicit ``--env FORGE_RECIPE=x``, or ``make sky``,
always wins) launched from a task file (:func:`task_file_from_argv`) in a recipe folder (one holding
``config.yaml``) inside the task's workdir, it sets ``FORGE_RECIPE`` to the folder relative to the
workdir (``recipes/my_exp``) and prints one line saying so. It rejects the request, before anything
is provisioned, when the folder is outside the workdir (the cluster would not get its config), its
config with the task's ``FORGE_ARGS`` does not load (the ConfigError, naming the key), its model is
gated and no ``HF_TOKEN`` secret is given (``--secret HF_TOKEN``), or the task does not ask for the
recipe's layout (:func:`launch.sky.layout_mismatch`). Other tasks (other projects', the Python API,
``make sky``'s derived files) pass through unchanged; the cluster side then falls back to the
layout match in :func:`launch.sky_node.resolve_recipe`.

Imports only the standard library and SkyPilot at module level, so any Python that has SkyPilot
and this repository on its path (``make venv-extras``; or ``pip install --no-deps -e .``) can load it.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Optional, Sequence

import sky
from sky import exceptions


def task_file_from_argv(argv: Sequence[str], run: Optional[str]) -> Optional[str]:
    """The task file named on the command line (absolute path), or None.

    A candidate is an argument naming an existing ``*.yaml``/``*.yml`` file that parses to a
    mapping whose ``run`` is ``run`` (the parsed task's; SkyPilot re-dumps the YAML text, so the
    text itself cannot be compared). None unless exactly one file qualifies.
    """
    import yaml

    found = []
    for a in argv[1:]:
        if a.startswith("-") or not a.endswith((".yaml", ".yml")) or not os.path.isfile(a):
            continue
        try:
            with open(a, encoding="utf-8") as f:
                cfg = yaml.safe_load(f)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        if isinstance(cfg, dict) and cfg.get("run") == run and os.path.abspath(a) not in found:
            found.append(os.path.abspath(a))
    return found[0] if len(found) == 1 else None


def _recipe_problem(folder: str, task, path: str) -> Optional[str]:
    """What is wrong with launching the recipe in ``folder``, or None: a ``FORGE_ARGS`` that does not
    split as shell words, the ConfigError of its config (naming the key), then
    forge_core.models.gated_without_token for its model (the task's secrets as the env), then
    launch.sky.layout_mismatch of the task file ``path``. None also when the project's dependencies
    are not importable here (the cluster then checks)."""
    try:
        from forge_core.config import ConfigError, load_config
        from forge_core.models import gated_without_token
        from launch.sky import layout_mismatch
    except ImportError:
        return None
    forge_args = (task.envs or {}).get("FORGE_ARGS", "")
    try:
        overrides = shlex.split(forge_args)
    except ValueError as e:
        return f"FORGE_ARGS={forge_args!r}: {e}"
    try:
        cfg = load_config(folder, overrides)
    except ConfigError as e:
        return str(e)  # names the file or override and the key
    secrets = {k: str(v.get_secret_value() if hasattr(v, "get_secret_value") else v)
               for k, v in (task.secrets or {}).items() if v}
    return gated_without_token(cfg.model, secrets) or layout_mismatch(task, cfg, path, forge_args)


class RecipeFromTaskPath(sky.AdminPolicy):
    """Set ``FORGE_RECIPE`` from the launched task file's folder; see the module docstring.

    Raises:
        sky.exceptions.UserRequestRejectedByPolicy: the recipe folder is outside the workdir, its
            config (with ``FORGE_ARGS``) has an error (the message names the key), its model is gated
            and the task has no ``HF_TOKEN`` secret, or the task does not ask for its layout.
    """

    @classmethod
    def validate_and_mutate(cls, user_request: sky.UserRequest) -> sky.MutatedUserRequest:
        """SkyPilot's hook: the request with ``FORGE_RECIPE`` set, or unchanged (see the class docstring)."""
        task = user_request.task
        out = sky.MutatedUserRequest(task=task, skypilot_config=user_request.skypilot_config)  # task: changed in place
        envs = task.envs or {}
        if not user_request.at_client_side or "FORGE_RECIPE" not in envs or envs["FORGE_RECIPE"]:
            return out
        path = task_file_from_argv(sys.argv, task.run)
        folder = os.path.dirname(path or "")
        if path is None or not os.path.isfile(os.path.join(folder, "config.yaml")):
            return out
        workdir = task.workdir if isinstance(task.workdir, str) else None
        rel = os.path.relpath(folder, os.path.abspath(workdir)) if workdir else None
        if rel is None or rel == os.curdir or rel.startswith(os.pardir):
            raise exceptions.UserRequestRejectedByPolicy(
                f"recipe folder {folder} is not inside the task's workdir "
                f"({workdir or 'none'}), so the cluster would not get its config.yaml: "
                f"run sky launch from the repository root with the folder under recipes/")
        if problem := _recipe_problem(folder, task, path):
            raise exceptions.UserRequestRejectedByPolicy(problem)
        task.update_envs({"FORGE_RECIPE": rel})
        print(f"[forge] recipe {rel} (from the task file {os.path.relpath(path)}): "
              f"FORGE_RECIPE={rel}", file=sys.stderr, flush=True)
        return out
