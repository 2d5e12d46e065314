"""SkyPilot launcher, tested without a cloud: recipes/*/sky.yaml, launch/sky.py (client) and
launch/sky_node.py (cluster side).

The run: section is executed the way SkyPilot 0.14.1 executes it on a cluster node: the script
comes from ``sky.skylet.log_lib.make_task_bash_script`` (sources ~/.bashrc, exports the task's
envs, secrets and the SKYPILOT_* variables, ``cd ~/sky_workdir``), HOME is a temporary "node home"
whose ``sky_workdir`` is a copy of the repository filtered by .gitignore (what ``workdir: .``
rsyncs) and whose ``forge-venv`` is this repository's .venv (what ``setup:`` builds). Nothing
in the run: section is changed for the tests.

Fast tests: validity of every task file (SkyPilot's own parser, offline), recipe resolution
(the client-side policy of .sky.yaml for a plain ``sky launch`` of a copied folder, the cluster's
layout match otherwise), dry run, bad input (malformed file, gated model without HF_TOKEN, an
ambiguous copy launched without the policy).
Slow tests: a copied recipe folder trains with its own config and a second run with the same
SKYPILOT_TASK_ID resumes from its checkpoint (one node, no root needed); two network-namespace
hosts (fr-node3, fr-node4 from cluster/dev/netns.sh, 10.77.0.13-14, root) run one Monarch mesh
across both; a node that never comes up fails with its address and leaves no process.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from helpers import PY, ROOT, TINY_LAUNCHER, netns_nodes, ns_pids, steps, wait_no_pids

sky = pytest.importorskip("sky", reason="skypilot is not installed (pip install -e '.[sky]')")

from launch import sky as ls  # noqa: E402
from launch import sky_node as sn  # noqa: E402
from launch import sky_task as st  # noqa: E402

NS = (3, 4)  # fr-node3, fr-node4: clear of fr-node1/2, which the SLURM dev cluster and test_bootstrap use
IPS = [f"10.77.0.{10 + i}" for i in NS]
TASK_FILES = sorted(glob.glob(str(ROOT / "recipes" / "*" / "sky.yaml")))
RECIPES = [Path(p).parent.name for p in TASK_FILES]
TINY = " ".join(TINY_LAUNCHER)  # FORGE_ARGS
GSM8K = os.environ["GSM8K_DIR"]  # tests/conftest.py: the real copy, or a synthetic one
CACHE = os.environ.get("FORGE_CACHE") or os.path.expanduser("~/.cache/forge-recipes")
IGNORE = shutil.ignore_patterns(".git", ".venv", "runs", "outputs", "__pycache__", "*.pyc",
                                ".pytest_cache", ".cache", ".gpu", ".whl", "*.egg-info")


# --------------------------------------------------------------------------- helpers


def _task(path) -> "sky.Task":
    return sky.Task.from_yaml(str(path))


def make_node_home(tmp: Path, extra_recipes: dict[str, str] | None = None) -> Path:
    """A node's HOME after SkyPilot's workdir sync and our setup: sky_workdir + forge-venv.

    ``extra_recipes`` maps new folder -> folder to copy (``cp -r recipes/SRC recipes/NEW``).
    """
    home = tmp / "home"
    wd = home / "sky_workdir"
    shutil.copytree(ROOT, wd, ignore=IGNORE, symlinks=True)
    for new, src in (extra_recipes or {}).items():
        shutil.copytree(wd / "recipes" / src, wd / "recipes" / new)
    (home / "forge-venv").symlink_to(sys.prefix)  # the venv running these tests
    return home


def run_script(task_file, env_vars: dict[str, str]) -> str:
    """The bash script SkyPilot runs for the task's run: section on a node."""
    from sky.skylet import log_lib

    return log_lib.make_task_bash_script(_task(task_file).run, env_vars=env_vars)


def node_env(task_file, home: Path, rank: int, ips: list[str], task_id: str,
             gpus: int = 0, **envs: str) -> dict[str, str]:
    """Process env + the variables SkyPilot exports on node ``rank`` (task envs, secrets that have
    values, SKYPILOT_*), then ``envs`` as ``--env NAME=VALUE`` would set them."""
    t = _task(task_file)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SKYPILOT_", "FORGE_")) and k not in ("HF_TOKEN", "WANDB_API_KEY")}
    env.update(HOME=str(home), GSM8K_DIR=GSM8K, FORGE_CACHE=CACHE, OMP_NUM_THREADS="1",
               WANDB_MODE="disabled", HF_HOME=str(home / "hf"), PYTHONUNBUFFERED="1")
    task_vars = dict(t.envs)
    task_vars.update({k: v.get_secret_value() for k, v in t.secrets.items()})
    task_vars.update(SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NODE_IPS="\n".join(ips),
                     SKYPILOT_NUM_NODES=str(len(ips)), SKYPILOT_NUM_GPUS_PER_NODE=str(gpus),
                     SKYPILOT_TASK_ID=task_id)
    task_vars.update(envs)
    env["_TASK_VARS"] = json.dumps(task_vars)
    return env


def start_node(task_file, env: dict[str, str], log: Path, ns: int | None = None) -> subprocess.Popen:
    task_vars = json.loads(env.pop("_TASK_VARS"))
    script = log.with_suffix(".sh")
    script.write_text(run_script(task_file, task_vars))
    cmd = ["bash", str(script)]
    if ns is not None:
        cmd = ["nsenter", f"--net=/var/run/netns/fr-node{ns}", "unshare", "--uts", "sh", "-c",
               f"hostname node{ns} && exec bash {script}"]
    out = open(log, "wb")
    try:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        out.close()


def finish(p: subprocess.Popen, log: Path, timeout: float) -> tuple[int, str]:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.wait()
        pytest.fail(f"node did not finish in {timeout:.0f} s:\n{log.read_text()[-4000:]}")
    return rc, log.read_text()


def run_node(task_file, env, log: Path, timeout: float = 240, ns: int | None = None) -> tuple[int, str]:
    return finish(start_node(task_file, env, log, ns), log, timeout)


def recipe_file(name: str) -> Path:
    return ROOT / "recipes" / name / "sky.yaml"


# What `sky launch ARGV` does on the client before anything leaves it: SkyPilot reads the task
# file (with --env/--secret overrides) and applies the client-side admin policy named by the
# project config .sky.yaml of the current directory (launch/sky_policy.py). Run in a subprocess
# whose current directory is the user's clone, as the sky CLI is; one subprocess takes several
# command lines in turn (sys.argv set to each, as the policy reads it), so SkyPilot is imported once.
_CLIENT = """
import contextlib, io, json, sys, traceback
from sky.utils import admin_policy_utils, dag_utils
from sky.server.requests import request_names
for argv in json.loads(sys.argv[1]):
    sys.argv = argv
    entry = next(a for a in argv[2:] if a.endswith('.yaml'))
    pairs = lambda flag: [tuple(argv[i + 1].split('=', 1)) for i, a in enumerate(argv) if a == flag]
    secrets = [(k, v) for k, v in pairs('--secret')]
    err, rc, envs = io.StringIO(), 0, {}
    with contextlib.redirect_stderr(err):
        try:
            dag = dag_utils.load_chain_dag_from_yaml(entry, env_overrides=pairs('--env'),
                                                     secret_overrides=secrets or None)
            dag, _ = admin_policy_utils.apply(dag, request_names.AdminPolicyRequestName.CLUSTER_LAUNCH,
                                              at_client_side=True)
            envs = dag.tasks[0].envs
        except Exception:
            rc = 1
            traceback.print_exc()
    print('RESULT=' + json.dumps([rc, envs, err.getvalue()]), flush=True)
"""


def client_side(workdir: Path, *argvs: list[str]) -> list[tuple[int, dict, str]]:
    """For each command line ``argv`` of ``argvs``, in turn: ``(exit code, task envs after the client
    policy, stderr)`` of ``sky launch *argv`` in ``workdir``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYPILOT_")}
    p = subprocess.run([PY, "-c", _CLIENT, json.dumps([["sky", "launch", *a] for a in argvs])], cwd=workdir,
                       capture_output=True, text=True, env=env, timeout=240)
    got = [tuple(json.loads(l[7:])) for l in p.stdout.splitlines() if l.startswith("RESULT=")]
    assert p.returncode == 0 and len(got) == len(argvs), p.stderr[-3000:]
    return got


# --------------------------------------------------------------------------- fast: task files


def test_every_recipe_has_a_task_file():
    folders = sorted(Path(p).parent.name for p in glob.glob(str(ROOT / "recipes" / "*" / "config.yaml")))
    assert RECIPES == folders, "every recipe folder needs a sky.yaml"


def test_every_task_file_is_what_its_config_gives(tmp_path, capsys):
    """Every shipped sky.yaml is the text launch/sky_task.py writes from its recipe's config.yaml
    (``make sky-yaml``), so they share one shape; ``--check`` names a file that drifted."""
    assert RECIPES == [Path(f).name for f in st.recipe_folders()]
    assert st.main(["--check"]) == 0, capsys.readouterr().err
    copy = tmp_path / "my_exp"
    shutil.copytree(ROOT / "recipes" / "qwen3_8b", copy)
    (copy / "sky.yaml").write_text((copy / "sky.yaml").read_text().replace("disk_size: 512", "disk_size: 100"))
    assert st.main(["--check", str(copy)]) == 1
    assert "sky.yaml differs from what config.yaml gives" in capsys.readouterr().err
    assert st.main([str(copy)]) == 0 and st.stale([str(copy)]) == []


def test_a_copy_changes_its_config_and_gets_its_task_file(tmp_path):
    """What differs between task files comes from config.yaml: a copied folder's layout, accelerator
    types and disk, and a gated model's required HF_TOKEN. Bad values name the key."""
    copy = tmp_path / "my_exp"
    shutil.copytree(ROOT / "recipes" / "qwen3_1_7b", copy)
    shipped = yaml.safe_load((copy / "config.yaml").read_text())

    def edit(model: dict, layout: dict) -> None:  # config.yaml with these keys changed
        cfg = {**shipped, "model": {**shipped["model"], **model}, "layout": {**shipped["layout"], **layout}}
        (copy / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    edit({"name": "llama3_8b"}, {"nodes": 2, "accelerators": ["A100-80GB"], "disk_gb": 300})
    st.write(str(copy))
    t = _task(copy / "sky.yaml")
    assert t.num_nodes == 2 and [(r.accelerators, r.disk_size) for r in t.resources] == [({"A100-80GB": 3}, 300)]
    assert {r.name for r in t.managed_secret_refs} == {"HF_TOKEN"}  # gated: required
    from forge_core.config import ConfigError

    for bad, says in (({"accelerators": []}, "layout.accelerators is empty and layout.gpus_per_node=3"),
                      ({"disk_gb": -1}, "layout.disk_gb must be >= 0")):
        edit({}, bad)
        with pytest.raises(ConfigError, match=re.escape(says)):
            st.task_text(str(copy))


@pytest.mark.parametrize("recipe", RECIPES)
def test_dry_run_of_every_recipe(recipe, monkeypatch, capsys):
    """``make sky RECIPE=<recipe> DRY_RUN=1`` for every shipped recipe: the checks pass, SkyPilot parses
    the task, and the printed task asks for the recipe's layout."""
    from forge_core.config import load_config

    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token_123")  # the gated recipes need one
    assert ls.main(["launch", recipe, "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    cfg = load_config(recipe)
    assert f"sky launch -c {ls.cluster_name(recipe)} recipes/{recipe}/sky.yaml --env FORGE_RECIPE=recipes/{recipe}" in out
    assert f"num_nodes: {cfg.layout.nodes}" in out and "hf_not_a_real_token_123" not in out
    assert out.count("accelerators:") == (2 if cfg.layout.gpus_per_node else 0), out


@pytest.mark.parametrize("task_file", TASK_FILES, ids=RECIPES)
def test_task_file_is_valid_and_complete(task_file):
    from forge_core.config import load_config

    t = _task(task_file)  # SkyPilot's own parser, offline
    name = Path(task_file).parent.name
    cfg = load_config(name)
    text = Path(task_file).read_text()
    assert not any(r in text for r in RECIPES), "the task file must name no recipe (copies would run it)"
    assert t.workdir == "."
    assert t.num_nodes == cfg.layout.nodes
    res = list(t.resources)
    assert all(r.disk_size and r.disk_size >= 64 for r in res)
    accs = sorted(tuple(r.accelerators.items())[0] for r in res if r.accelerators)
    if cfg.layout.gpus_per_node:
        n = cfg.layout.gpus_per_node
        assert accs == [("H100", n), ("H200", n)], f"any_of H100:{n} / H200:{n} expected, got {accs}"
        assert "'.[gpu]'" in t.setup and "gpu-overrides.txt" in t.setup and "check --gpu" in t.setup
    else:
        assert accs == [] and cfg.device == "cpu"
        assert "launch.sky_node check" in t.setup
    # Secrets only under secrets: (a null value is a required one: SkyPilot refuses to launch without it).
    declared = set(t.secrets) | {r.name for r in t.managed_secret_refs}
    assert declared == {"HF_TOKEN", "WANDB_API_KEY"}
    assert not {"HF_TOKEN", "WANDB_API_KEY"} & set(t.envs)
    assert all(not v.get_secret_value() for v in t.secrets.values()), "no secret value in a task file"
    from forge_core.models import spec_of

    assert ("HF_TOKEN" in {r.name for r in t.managed_secret_refs}) == spec_of(cfg.model.name).gated
    assert "launch.sky_node run" in t.run and set(t.envs) >= {"FORGE_RECIPE", "FORGE_ARGS", "FORGE_CKPT_DIR"}
    assert (ROOT / "cluster" / "sky" / "gpu-overrides.txt").is_file()


def test_shipped_recipes_resolve_from_cluster_shape(monkeypatch):
    # A plain `sky launch recipes/<name>/sky.yaml` (no FORGE_RECIPE) finds its recipe when no other
    # shipped recipe has its shape; recipes sharing a shape stop with an error naming each of them.
    # (Each recipe's config is composed once: resolve_recipe reads every recipe's shape at each call.)
    monkeypatch.setattr(sn, "recipe_shape", functools.cache(sn.recipe_shape))
    shapes: dict = {}
    for name in RECIPES:
        shapes.setdefault(sn.recipe_shape(name), []).append(name)
    for (nodes, gpus), names in shapes.items():
        if len(names) == 1:
            assert Path(sn.resolve_recipe(nodes, gpus, env={})).name == names[0]
        else:
            with pytest.raises(sn.SkyError) as e:
                sn.resolve_recipe(nodes, gpus, env={})
            assert all(f"recipes/{n}" in str(e.value) for n in names) and "FORGE_RECIPE" in str(e.value)
    assert Path(sn.resolve_recipe(9, 9, env={"FORGE_RECIPE": "qwen3_8b"})).name == "qwen3_8b"
    assert Path(sn.resolve_recipe(9, 9, env={"FORGE_RECIPE": "recipes/qwen3_8b"})).name == "qwen3_8b"
    with pytest.raises(sn.SkyError, match="FORGE_RECIPE"):
        sn.resolve_recipe(7, 7, env={})
    with pytest.raises(sn.SkyError, match="nope"):
        sn.resolve_recipe(1, 0, env={"FORGE_RECIPE": "nope"})


def test_copy_resolution_is_never_silently_wrong(tmp_path):
    wd = make_node_home(tmp_path, {"my_exp": "qwen3_1_7b"}) / "sky_workdir"
    with pytest.raises(sn.SkyError) as e:
        sn.resolve_recipe(1, 3, env={}, root=str(wd))
    assert "recipes/my_exp" in str(e.value) and "recipes/qwen3_1_7b" in str(e.value)
    assert "--env FORGE_RECIPE=" in str(e.value)


def test_plain_sky_launch_of_a_copy_runs_the_copy(tmp_path):
    # cp -r recipes/qwen3_1_7b recipes/my_exp && sky launch recipes/my_exp/sky.yaml: the project
    # config .sky.yaml makes SkyPilot apply launch/sky_policy.py on the client, which sets
    # FORGE_RECIPE from the task file's folder; the cluster then runs that folder.
    wd = make_node_home(tmp_path, {"my_exp": "qwen3_1_7b", "gated_copy": "llama3_8b"}) / "sky_workdir"
    assert (wd / ".sky.yaml").is_file()
    shutil.copytree(wd / "recipes" / "qwen3_1_7b", tmp_path / "elsewhere")
    stretched = wd / "recipes" / "stretched"  # a copy whose task file asks for another layout
    shutil.copytree(wd / "recipes" / "qwen3_1_7b", stretched)
    (stretched / "sky.yaml").write_text((stretched / "sky.yaml").read_text().replace("num_nodes: 1", "num_nodes: 2"))
    copy, plain, explicit, gated, gated_ok, mismatch, outside = client_side(
        wd, ["-c", "forge", "recipes/my_exp/sky.yaml"],
        ["recipes/qwen3_1_7b/sky.yaml", "--env", "FORGE_ARGS=steps=3"],
        ["recipes/my_exp/sky.yaml", "--env", "FORGE_RECIPE=qwen3_1_7b"],
        ["recipes/gated_copy/sky.yaml"], ["recipes/gated_copy/sky.yaml", "--secret", "HF_TOKEN=hf_x"],
        ["recipes/stretched/sky.yaml"], [str(tmp_path / "elsewhere" / "sky.yaml")])
    rc, envs, err = copy
    assert rc == 0, err
    assert envs["FORGE_RECIPE"] == "recipes/my_exp" and "[forge] recipe recipes/my_exp" in err
    assert Path(sn.resolve_recipe(1, 3, env=envs, root=str(wd))).name == "my_exp"
    rc, envs, err = plain
    assert rc == 0 and envs["FORGE_RECIPE"] == "recipes/qwen3_1_7b" and envs["FORGE_ARGS"] == "steps=3", err
    # An explicit --env FORGE_RECIPE (and make sky, which always sets it) wins.
    rc, envs, err = explicit
    assert rc == 0 and envs["FORGE_RECIPE"] == "qwen3_1_7b" and "[forge]" not in err, err
    # A gated model without --secret HF_TOKEN is refused on the client, before any provisioning.
    rc, envs, err = gated
    assert rc != 0 and "--secret HF_TOKEN" in err and "UserRequestRejectedByPolicy" in err, err
    rc, envs, err = gated_ok
    assert rc == 0 and envs["FORGE_RECIPE"] == "recipes/gated_copy", err
    # So is a task file that does not ask for the recipe's layout (as make sky refuses it).
    rc, envs, err = mismatch
    assert rc != 0 and "num_nodes is 2, layout.nodes is 1" in err and "UserRequestRejectedByPolicy" in err, err
    # A recipe folder outside the workdir would reach the cluster without its config.yaml.
    rc, envs, err = outside
    assert rc != 0 and "not inside the task's workdir" in err and str(tmp_path / "elsewhere") in err, err


def test_plain_sky_launch_of_a_copy_with_a_config_error_is_refused(tmp_path):
    # A typo in a copied gated recipe's config.yaml (or in FORGE_ARGS) is refused on the client,
    # naming the key, with or without HF_TOKEN: nothing is provisioned for the node to fail on.
    wd = make_node_home(tmp_path, {"my_llama": "llama3_8b", "my_exp": "qwen3_1_7b"}) / "sky_workdir"
    cfg = wd / "recipes" / "my_llama" / "config.yaml"
    cfg.write_text(re.sub(r"(?m)^steps:", "stepz:", cfg.read_text()))
    *typo, bad_override, unclosed = client_side(
        wd, ["recipes/my_llama/sky.yaml"], ["recipes/my_llama/sky.yaml", "--secret", "HF_TOKEN=hf_x"],
        ["recipes/my_exp/sky.yaml", "--env", "FORGE_ARGS=stepz=3"],
        ["recipes/my_exp/sky.yaml", "--env", "FORGE_ARGS=steps='3"])
    for rc, envs, err in typo:
        assert rc != 0 and "UserRequestRejectedByPolicy" in err and "unknown key 'stepz'" in err, err
        assert "recipes/my_llama/config.yaml" in err, err
    rc, envs, err = bad_override
    assert rc != 0 and "UserRequestRejectedByPolicy" in err and "override 'stepz=3'" in err, err
    rc, envs, err = unclosed
    assert rc != 0 and "UserRequestRejectedByPolicy" in err and "FORGE_ARGS=\"steps='3\"" in err, err


@pytest.mark.slow
def test_sky_cli_applies_the_recipe_policy(tmp_path):
    # The real `sky launch --dryrun` from a clone with a copied recipe: the CLI loads .sky.yaml and
    # applies the policy before its request leaves the client (offline, the dry run itself then
    # stops at SkyPilot's catalog download or at "no cloud enabled"; neither is tested here).
    wd = make_node_home(tmp_path, {"my_exp": "smollm2_135m"}) / "sky_workdir"
    sky_bin = Path(sys.executable).with_name("sky")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYPILOT_")}
    try:
        p = subprocess.run([str(sky_bin), "launch", "--dryrun", "-y", "-c", "forge-test",
                            "recipes/my_exp/sky.yaml"], cwd=wd, env=env, capture_output=True,
                           text=True, timeout=240)
    finally:
        subprocess.run([str(sky_bin), "api", "stop"], env=env, capture_output=True, timeout=120)
    out = p.stdout + p.stderr
    assert "Applying client admin policy: RecipeFromTaskPath" in out, out[-3000:]
    assert "[forge] recipe recipes/my_exp (from the task file recipes/my_exp/sky.yaml)" in out, out[-3000:]


def test_dry_run_prints_any_of_resources_in_one_order(monkeypatch):
    """SkyPilot keeps a task's ``any_of`` resources in a set; the dry run prints them sorted, so two
    dry runs of one task file print the same text."""
    task = ls.parse_task(ls.task_config(str(recipe_file("qwen3_1_7b")), "recipes/qwen3_1_7b"), {})
    cfg = task.to_yaml_config()
    assert len(cfg["resources"]["any_of"]) == 2
    printed = set()
    for order in (list, reversed):
        monkeypatch.setattr(task, "to_yaml_config",
                            lambda o=order: {**cfg, "resources": {"any_of": list(o(cfg["resources"]["any_of"]))}})
        printed.add(ls.redacted_yaml(task))
    assert len(printed) == 1, printed


def test_bucket_mount_and_dry_run_redacts_secrets(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token_123")
    monkeypatch.setenv("WANDB_API_KEY", "")
    monkeypatch.setattr(ls, "ROOT", str(tmp_path))  # the derived task file goes to ROOT/runs/<recipe>/
    rc = ls.main(["launch", "qwen3_1_7b", "--dry-run", "--bucket", "my-ckpts", "steps=5", "trainer.lr=1e-6"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    out = cap.out
    assert "hf_not_a_real_token_123" not in out + cap.err
    m = re.search(r"^sky launch -c forge-qwen3-1-7b (\S+\.yaml) --env FORGE_RECIPE=recipes/qwen3_1_7b "
                  r"--env 'FORGE_ARGS=steps=5 trainer.lr=1e-6' --secret HF_TOKEN$", out, re.M)
    assert m, out
    # the printed command's task file is there after the dry run: the recipe's task plus the mount
    assert m[1] == str(tmp_path / "runs" / "qwen3_1_7b" / "sky-forge-qwen3-1-7b.yaml")
    derived = yaml.safe_load(Path(m[1]).read_text())
    assert derived["file_mounts"]["/checkpoints"] == {"name": "my-ckpts", "mode": "MOUNT"}
    assert "hf_not_a_real_token_123" not in Path(m[1]).read_text()
    assert "--secret WANDB_API_KEY" not in out  # only secrets that are set
    assert "HF_TOKEN: <redacted>" in out and "mode: MOUNT" in out and "name: my-ckpts" in out
    # The legacy token name alone (the gated check takes it) goes as the HF_TOKEN the task files declare:
    # SkyPilot resolves llama3_8b's required HF_TOKEN from it, and sky gets the value in its environment.
    calls = []
    monkeypatch.setattr(ls.subprocess, "call", lambda cmd, **kw: calls.append((cmd, kw["env"])) or 0)
    legacy = {"PATH": os.environ["PATH"], "HUGGING_FACE_HUB_TOKEN": "hf_legacy_token_456"}
    assert ls.launch("llama3_8b", env=legacy) == 0, capsys.readouterr().err
    cmd, sky_env = calls[0]
    assert cmd[-2:] == ["--secret", "HF_TOKEN"] and sky_env["HF_TOKEN"] == "hf_legacy_token_456"
    assert "hf_legacy_token_456" not in " ".join(cmd) + capsys.readouterr().out
    # The derived task (file + mount) is what SkyPilot parses: valid too.
    cfg = ls.task_config(str(recipe_file("qwen3_1_7b")), "recipes/qwen3_1_7b", "my-ckpts")
    t = ls.parse_task(cfg, {})
    assert "/checkpoints" in t.storage_mounts and t.envs["FORGE_RECIPE"] == "recipes/qwen3_1_7b"
    bad = tmp_path / "sky.yaml"  # a task file that is not YAML: an error naming it and the line
    bad.write_text("resources:\n  accelerators: [H100:8\n")
    with pytest.raises(ls.SkyError, match=re.escape(str(bad)) + ": not valid YAML .*line 3"):
        ls.task_config(str(bad), "recipes/qwen3_1_7b")
    for envs, says in (("envs: [a]", "envs must be a mapping"), ("envs:\n  HF_TOKEN: hf_FAKE123", "envs.HF_TOKEN: "
                                                                  "a secret is declared under secrets:")):
        bad.write_text(recipe_file("qwen3_1_7b").read_text() + envs + "\n")  # (a second envs: replaces the first)
        with pytest.raises(ls.SkyError, match=re.escape(str(bad)) + ": " + says):
            ls.task_config(str(bad), "recipes/qwen3_1_7b")
    with pytest.raises(SystemExit):  # an unclosed quote in --sky-args: argparse's usage error, no traceback
        ls.main(["launch", "qwen3_1_7b", "--dry-run", "--sky-args", "'x"])
    assert "--sky-args \"'x\": No closing quotation" in capsys.readouterr().err
    # make sky passes the same options, and ARGS as make run does: FORGE_ARGS splits (shlex, on the
    # nodes) into the overrides make run would get.
    m = subprocess.run(["make", "--no-print-directory", "-n", "sky", "RECIPE=qwen3_1_7b", "DRY_RUN=1",  # under make
                        "CKPT_BUCKET=my-ckpts",  # (CI's make test) a nested make would print 'make[1]: Leaving ...'
                        "MANAGED=1", "ARGS=steps=5 run_id='a b'"], cwd=ROOT, capture_output=True, text=True)
    line = " ".join(m.stdout.replace("\\\n", " ").split())
    assert "-m launch.sky launch qwen3_1_7b --bucket my-ckpts --managed --dry-run steps=5 run_id='a b'" in line
    got = []
    monkeypatch.setattr(ls, "launch", lambda *a: got.append(a) or 0)
    assert ls.main(shlex.split(line.split("-m launch.sky ", 1)[1])) == 0
    a = got[0]  # recipe, cluster, bucket, managed, dry_run, forge_args, sky args
    assert a[:5] == ("qwen3_1_7b", None, "my-ckpts", True, True) and shlex.split(a[5]) == ["steps=5", "run_id=a b"]


def test_setup_check_versions_gpus_and_recipe(capsys):
    # The last line of setup: on this CPU venv the embedded recipe's check passes ...
    env = {"SKYPILOT_SETUP_NODE_IPS": "10.0.0.1", "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": "0",
           "FORGE_ARGS": "", "FORGE_RECIPE": "smollm2_135m"}  # several shipped recipes have this shape
    assert sn.check(False, env) == 0, capsys.readouterr().err
    assert "recipes/smollm2_135m" in capsys.readouterr().out
    for args, says in (("steps=abc", "steps='abc': expected an integer"), ("'steps=5", "No closing")):
        assert sn.check(False, {**env, "FORGE_RECIPE": "smollm2_135m", "FORGE_ARGS": args}) == 1  # before run:
        assert f"FORGE_ARGS={args!r}: " in (err := capsys.readouterr().err) and says in err, err
    # ... and a GPU recipe's names every missing piece (no vLLM, CPU torch, no GPUs).
    env.update(SKYPILOT_SETUP_NUM_GPUS_PER_NODE="3", FORGE_RECIPE="qwen3_1_7b")
    assert sn.check(True, env) == 1
    err = capsys.readouterr().err
    assert "vllm missing (want 0.26.0)" in err and "torch 2.13" in err and "want 2.11.x" in err
    assert "CUDA GPU(s), the task asks for 3" in err


def test_bad_data_is_refused_by_the_dry_run_setup_and_every_node(capsys):
    """``make sky`` (dry run too), the end of setup: and the run: section of every node check the data
    and the reward as ``make check`` does: a field the rows lack is named with file:line and the
    fields they have, before any cloud call and before any node starts its worker."""
    says = ("recipes/smollm2_135m_arith/data/train.jsonl:1: no field 'qq' (data.prompt_field); the row has "
            "['answer', 'op', 'question']")
    assert ls.main(["launch", "smollm2_135m_arith", "--dry-run", "data.prompt_field=qq"]) == 2
    cap = capsys.readouterr()
    assert says in cap.err and "sky launch" not in cap.out, cap.err
    env = {"SKYPILOT_SETUP_NODE_IPS": "10.0.0.1", "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": "0",
           "FORGE_RECIPE": "smollm2_135m_arith", "FORGE_ARGS": "data.prompt_field=qq"}
    assert sn.check(False, env) == 1
    assert says in capsys.readouterr().err
    node = {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "127.0.0.1", "SKYPILOT_NUM_GPUS_PER_NODE": "0",
            "FORGE_RECIPE": "smollm2_135m_arith", "FORGE_ARGS": "data.prompt_field=qq", "FORGE_CKPT_DIR": ""}
    assert sn.run([], node) == 2
    cap = capsys.readouterr()
    assert says in cap.err and "[sky] node" not in cap.out, cap.out + cap.err


@pytest.mark.parametrize("bad,field", [
    (("disk_size:", "disk_sise:"), "disk_sise"),
    (("num_nodes:", "num_node:"), "num_node"),
])
def test_malformed_task_file_gives_skypilots_error_naming_the_field(tmp_path, capsys, bad, field):
    folder = tmp_path / "broken"
    shutil.copytree(ROOT / "recipes" / "qwen3_1_7b", folder)
    f = folder / "sky.yaml"
    f.write_text(f.read_text().replace(*bad))
    with pytest.raises(Exception) as e:
        sky.Task.from_yaml(str(f))
    assert field in str(e.value)
    assert ls.main(["launch", str(folder), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert field in err and "sky.yaml" in err, err


def test_task_that_does_not_ask_for_the_layout_is_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # an override that changes the layout: the task file (H100:3 / H200:3) no longer matches it
    args = "layout.gpus_per_node=4 layout.reference.gpus=2"
    assert ls.main(["launch", "qwen3_1_7b", "--dry-run", *args.split()]) == 2
    err = capsys.readouterr().err
    assert "recipes/qwen3_1_7b/sky.yaml does not ask for the recipe's layout: resources ask for 3 accelerator(s) " \
           "per node, layout.gpus_per_node is 4; the overrides" in err and "task file must match" in err, err
    assert "make sky-yaml RECIPE=<copy>" in err, err
    # a copied recipe whose sky.yaml was edited: more nodes, or fewer GPUs per node, than the layout
    folder = tmp_path / "my_exp"
    shutil.copytree(ROOT / "recipes" / "qwen3_1_7b", folder)
    text = (folder / "sky.yaml").read_text()
    for old, new, msg in (("num_nodes: 1", "num_nodes: 2", "num_nodes is 2, layout.nodes is 1"),
                          ("H100:3", "H100:2", "2 accelerator(s) per node, layout.gpus_per_node is 3")):
        (folder / "sky.yaml").write_text(text.replace(old, new))
        assert ls.main(["launch", str(folder), "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert f"{folder}/sky.yaml does not ask for the recipe's layout: " in err and msg in err, err
        assert f"write it again from the recipe's config with `make sky-yaml RECIPE={folder}`" in err, err
    (folder / "sky.yaml").write_text(text.replace("H100:3", "H100:8"))  # more GPUs than the layout uses: fine,
    assert ls.main(["launch", str(folder), "--dry-run"]) == 2  # but the cluster gets the repository alone:
    assert f"recipe folder {folder} is outside the repository" in capsys.readouterr().err  # a copy goes in recipes/
    inside = ROOT / "recipes" / f"_test_sky_{os.getpid()}"
    try:
        shutil.copytree(folder, inside)
        assert ls.main(["launch", str(inside), "--dry-run"]) == 0, capsys.readouterr().err
    finally:
        shutil.rmtree(inside, ignore_errors=True)


def test_gated_model_without_token_fails_at_launch(monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert ls.main(["launch", "llama3_8b", "--dry-run"]) == 2
    cap = capsys.readouterr()
    assert "--secret HF_TOKEN" in cap.err and "sky launch" not in cap.out, cap.err
    # A plain `sky launch` of the task is refused by SkyPilot itself, before provisioning: the
    # task declares HF_TOKEN with no value (sky/execution.py resolves such secrets at launch).
    from sky import dag as dag_lib, execution

    if not hasattr(execution, "_resolve_managed_secrets"):
        pytest.skip("this SkyPilot version resolves secrets elsewhere")
    with dag_lib.Dag() as dag:
        dag.add(_task(recipe_file("llama3_8b")))
    with pytest.raises(RuntimeError, match="HF_TOKEN.*--secret"):
        execution._resolve_managed_secrets(dag)


def test_gated_model_without_token_fails_on_every_node_before_download(tmp_path):
    # The llama3_8b task on its 2-node cluster, HF_TOKEN not passed: both nodes stop at once,
    # before any download (the HF cache stays empty) and before any Monarch worker starts.
    home = make_node_home(tmp_path)
    f = recipe_file("llama3_8b")
    procs = []
    t0 = time.monotonic()
    for rank in (0, 1):
        env = node_env(f, home, rank, ["127.0.0.1", "127.0.0.2"], "sky-gated-1", gpus=8,
                       FORGE_MONARCH_PORT="26741")
        log = tmp_path / f"gated{rank}.log"
        procs.append((start_node(f, env, log), log))
    for p, log in procs:
        rc, out = finish(p, log, 120)
        assert rc == 2, out
        assert "--secret HF_TOKEN" in out and "gated" in out, out
        assert "run directory" not in out and "[sky] node" not in out
    assert time.monotonic() - t0 < 90
    assert not (home / "hf").exists() or not any((home / "hf").rglob("*.safetensors"))


def test_ambiguous_copy_without_forge_recipe_fails_fast(tmp_path):
    home = make_node_home(tmp_path, {"my_exp": "smollm2_135m"})
    f = home / "sky_workdir" / "recipes" / "my_exp" / "sky.yaml"
    env = node_env(f, home, 0, ["127.0.0.1"], "sky-amb-1", FORGE_ARGS=TINY)
    rc, out = run_node(f, env, tmp_path / "amb.log", timeout=120)
    assert rc == 2 and "recipes/my_exp" in out and "recipes/smollm2_135m" in out, out
    assert "--env FORGE_RECIPE=" in out


# --------------------------------------------------------------------------- slow: one node


@pytest.fixture(scope="module")
def copied_recipe_runs(tmp_path_factory):
    """`cp -r recipes/smollm2_135m recipes/my_exp`, edit the copy, `sky jobs launch` its task file
    (client side: FORGE_RECIPE from the policy), run it twice with one
    SKYPILOT_TASK_ID (a managed job and its recovery): steps=2, then steps=3; checkpoint bucket
    mounted (FORGE_CKPT_DIR exists)."""
    tmp = tmp_path_factory.mktemp("sky_copy")
    home = make_node_home(tmp, {"my_exp": "smollm2_135m"})
    cfg = home / "sky_workdir" / "recipes" / "my_exp" / "config.yaml"
    cfg.write_text(cfg.read_text() + "seed: 7\ncheckpoint:\n  every: 1\n")
    bucket = tmp / "bucket"
    bucket.mkdir()
    f = home / "sky_workdir" / "recipes" / "my_exp" / "sky.yaml"
    task_id = "sky-managed-2026-11-21-20-00-00-000000_forge-my-exp_7-0"
    run_dir = bucket / "my_exp" / task_id
    # `sky jobs launch recipes/my_exp/sky.yaml` from the clone: the client policy names the folder.
    [(rc, task_envs, err)] = client_side(home / "sky_workdir", ["recipes/my_exp/sky.yaml"])
    assert rc == 0 and task_envs["FORGE_RECIPE"] == "recipes/my_exp", err
    out, after_first = {}, {}
    for i, n_steps in enumerate((2, 3)):
        env = node_env(f, home, 0, ["127.0.0.1"], task_id, FORGE_RECIPE=task_envs["FORGE_RECIPE"],
                       FORGE_ARGS=f"{TINY} steps={n_steps}", FORGE_CKPT_DIR=str(bucket),
                       FORGE_MONARCH_PORT="26731")
        out[i] = run_node(f, env, tmp / f"run{i}.log", timeout=300)
        if i == 0 and out[0][0] == 0:
            after_first = {"metrics": (run_dir / "metrics.jsonl").read_text().splitlines(),
                           "ckpts": sorted(p.name for p in (run_dir / "checkpoints").iterdir())}
    return home, bucket, task_id, out, after_first


@pytest.mark.slow
def test_copied_folder_runs_its_own_config(copied_recipe_runs):
    home, bucket, task_id, out, _ = copied_recipe_runs
    rc, log = out[0]
    assert rc == 0, log[-4000:]
    run_dir = bucket / "my_exp" / task_id
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["recipe"] == "my_exp" and cfg["seed"] == 7 and cfg["checkpoint"]["every"] == 1
    assert cfg["model"]["name"] == "tiny_llama" and cfg["output_dir"] == str(bucket / "my_exp")
    assert not (home / "sky_workdir" / "runs").exists()


@pytest.mark.slow
def test_same_task_id_resumes_from_the_bucket(copied_recipe_runs):
    home, bucket, task_id, out, first = copied_recipe_runs
    assert out[0][0] == 0, out[0][1][-4000:]
    rc, log = out[1]
    assert rc == 0, log[-4000:]
    run_dir = bucket / "my_exp" / task_id
    assert first["ckpts"], "the first run wrote no checkpoint"
    resumed_at = int(first["ckpts"][-1].split("_")[1])
    assert steps(run_dir) == [1, 2, 3]
    # The rows up to the checkpoint are the first run's, byte for byte: the second run resumed
    # from step_<resumed_at> in the bucket instead of starting over.
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert resumed_at >= 1 and lines[:resumed_at] == first["metrics"][:resumed_at]
    assert f"{resumed_at}/3" in log.split("GRPO my_exp:")[1][:40], "progress did not start at the checkpoint"
    assert (run_dir / "final").is_dir()


# --------------------------------------------------------------------------- slow: two hosts


@pytest.fixture(scope="module")
def sky_hosts():
    """fr-node3 and fr-node4 (10.77.0.13, 10.77.0.14); `netns.sh up 4` keeps existing nodes."""
    with netns_nodes(NS):
        yield IPS


class _Watch(threading.Thread):
    """Records the command lines of processes seen in a namespace while a run goes on."""

    def __init__(self, ns: int):
        super().__init__(daemon=True)
        self.ns, self.seen, self.stop = ns, {}, threading.Event()

    def run(self):
        while not self.stop.is_set():
            for pid in ns_pids(self.ns):
                try:
                    self.seen[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    pass
            time.sleep(0.5)


@pytest.mark.slow
def test_two_hosts_one_mesh(sky_hosts, tmp_path):
    # The embedded recipe's task on a 2-node cluster (sky launch --num-nodes 2 ... --env
    # FORGE_ARGS=...), FORGE_RECIPE set as the .sky.yaml policy sets it (two shipped recipes share
    # the shape: test_shipped_recipes_resolve_from_cluster_shape covers resolving by shape).
    home = make_node_home(tmp_path)
    f = recipe_file("smollm2_135m")
    port = "26721"
    args = f"{TINY} steps=2 layout.nodes=2 layout.generator.host=1"
    watch = _Watch(NS[1])
    watch.start()
    procs = []
    try:
        for rank, ns in enumerate(NS):
            env = node_env(f, home, rank, sky_hosts, "sky-2026-11-21-20-00-00-000000_forge-2n_1",
                           FORGE_ARGS=args, FORGE_MONARCH_PORT=port, FORGE_ATTACH_TIMEOUT="120",
                           FORGE_RECIPE="recipes/smollm2_135m")
            log = tmp_path / f"node{rank}.log"
            procs.append((start_node(f, env, log, ns=ns), log))
        results = [finish(p, log, 300) for p, log in procs]
    finally:
        watch.stop.set()
        for p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    (rc0, out0), (rc1, out1) = results
    assert rc0 == 0, out0[-5000:]
    assert rc1 == 0, out1[-3000:]
    assert "recipe=recipes/smollm2_135m" in out0 and f"hosts={','.join(sky_hosts)}" in out0
    m = re.search(r"run directory: (\S+)", out0)
    run_dir = Path(m.group(1))
    assert steps(run_dir) == [1, 2] and (run_dir / "final").is_dir()
    # The mesh spans both hosts: node 1's worker spawned actor processes (the generator) there.
    actor_procs = [c for c in watch.seen.values() if "launch.sky" not in c and "launch.bootstrap" not in c
                   and "bash" not in c.split(" ")[0] and not c.startswith(("sh ", "nsenter", "unshare"))]
    assert actor_procs, f"no actor process ran on node 1 ({sky_hosts[1]}): {watch.seen}"
    placement = run_dir / "actors.json"
    if placement.exists():  # the controller records where each service ran
        where = json.loads(placement.read_text())
        assert sky_hosts[1] in where["generator"]["ips"], where
        assert sky_hosts[0] in where["trainer"]["ips"], where
    assert wait_no_pids(NS[0]) == [] and wait_no_pids(NS[1]) == []


@pytest.mark.slow
def test_node_that_never_comes_up(sky_hosts, tmp_path):
    # (a) node 0 alone: node 1 (10.77.0.14) never starts -> node 0 names it within the timeout.
    # (b) node 1 alone: node 0 (10.77.0.13) never starts -> node 1's worker gives up, naming it.
    home = make_node_home(tmp_path)
    f = recipe_file("smollm2_135m")
    args = f"{TINY} steps=1 layout.nodes=2 layout.generator.host=1"
    timeout_s = 8
    runs = []
    t0 = time.monotonic()
    for rank, ns, port in ((0, NS[0], "26722"), (1, NS[1], "26723")):
        env = node_env(f, home, rank, sky_hosts, "sky-missing-1", FORGE_ARGS=args, FORGE_RECIPE="recipes/smollm2_135m",
                       FORGE_MONARCH_PORT=port, FORGE_ATTACH_TIMEOUT=str(timeout_s))
        log = tmp_path / f"missing{rank}.log"
        runs.append((start_node(f, env, log, ns=ns), log, port))
    (p0, log0, port0), (p1, log1, port1) = runs
    rc0, out0 = finish(p0, log0, 120)
    rc1, out1 = finish(p1, log1, 120)
    elapsed = time.monotonic() - t0
    assert rc0 == 3, out0[-4000:]
    assert f"{sky_hosts[1]}:{port0}" in out0 and "not reachable" in out0, out0[-3000:]
    assert rc1 == 3, out1[-3000:]
    assert f"{sky_hosts[0]}:{port1}" in out1 and "did not come up" in out1, out1[-3000:]
    assert elapsed < timeout_s + 60
    assert wait_no_pids(NS[0]) == [] and wait_no_pids(NS[1]) == [], "a process was left behind"
