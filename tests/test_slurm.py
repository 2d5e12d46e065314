"""launch.slurm without a cluster: profiles, dry run, job parameters, secrets, the requeue protocol.

The end-to-end tests on a real (local) SLURM cluster are in tests/test_slurm_cluster.py.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from forge_core.config import ConfigError
from helpers import ROOT, cli
from helpers import TINY_LAUNCHER as TINY
from launch import slurm


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return cli(*args, module="launch.slurm", env=env, timeout=120)


def _profile(tmp_path: Path, text: str) -> str:
    p = tmp_path / "prof.yaml"
    p.write_text(text)
    return str(p)


def test_dry_run_prints_config_and_exact_script_and_submits_nothing(tmp_path):
    last = tmp_path / "last.json"
    r = _cli("submit", "smollm2_135m", "--nodes", "2", "--dry-run", *TINY, "layout.generator.host=1",
             f"output_dir={tmp_path}/runs", env={"FORGE_SLURM_LAST_JOB": str(last)})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # the resolved recipe config, with NODES applied and the layout from the overrides
    assert "recipe: smollm2_135m" in out and "name: tiny_llama" in out
    cfg_part = out.split("#!/bin/bash")[0]
    assert "  nodes: 2\n" in cfg_part and "generator:\n    host: 1" in cfg_part
    # the sbatch script: one task per node, requeue-able, USR2 before the time limit, srun kills
    # the other tasks when one fails or 180 s after one ends; logs and pickles in <output_dir>/<job id>/slurm
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=dev",
                 "#SBATCH --requeue", "#SBATCH --signal=USR2@60", "#SBATCH --time=30",
                 f"#SBATCH --output={tmp_path}/runs/%j/slurm/%j_0_log.out", "export OMP_NUM_THREADS=1",
                 "export SLURM_WAIT=180", "--kill-on-bad-exit=1", "-m submitit.core._submit"):
        assert line in out, line
    assert "NodeTask(recipe=" in out and "'layout.nodes=2'" in out
    assert "nothing submitted" in out
    assert not last.exists() and not (tmp_path / "runs").exists()


def test_make_slurm_passes_cluster_nodes_dry_run_and_args():
    def cmd(*a):
        r = subprocess.run(["make", "-n", "slurm", *a], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return " ".join(r.stdout.replace("\\\n", " ").split())

    out = cmd("RECIPE=llama3_8b", "CLUSTER=example", "NODES=2", "DRY_RUN=1", "ARGS=steps=3")
    assert "-m launch.slurm submit llama3_8b --cluster example --nodes 2 --dry-run steps=3" in out
    assert "--dry-run" not in cmd("RECIPE=llama3_8b", "DRY_RUN=0")
    assert "--cluster dev" in cmd("RECIPE=llama3_8b")


def test_profile_unknown_key_is_named(tmp_path):
    r = _cli("submit", "smollm2_135m", "--dry-run", "--cluster",
             _profile(tmp_path, "partition: dev\npartiton: gpu\n"))
    assert r.returncode == 2
    assert "unknown profile key 'partiton'" in r.stderr and "did you mean 'partition'" in r.stderr


def test_profile_missing_lists_known_ones():
    with pytest.raises(slurm.SlurmError, match=r"'no_such_cluster' not found.*dev.*example"):
        slurm.load_profile("no_such_cluster")


def test_profile_wrong_type_is_named(tmp_path):
    with pytest.raises(slurm.SlurmError, match=r"time_min='soon' has the wrong type"):
        slurm.load_profile(_profile(tmp_path, "time_min: soon\n"))
    for key in ("mem_gb", "attach_timeout_s", "cpus_per_task"):  # YAML's true is no number (mem_gb: true was 1 GB)
        with pytest.raises(slurm.SlurmError, match=rf"{key}=True has the wrong type"):
            slurm.load_profile(_profile(tmp_path, f"{key}: true\n"))


@pytest.mark.parametrize("text", ["time_min: -5", "mem_gb: -1", "cpus_per_task: 0", "signal_delay_s: -1",
                                  "attach_timeout_s: 0.0", "monarch_port: 0", "max_requeues_on_timeout: -1",
                                  "mem_gb: .nan", "mem_gb: .inf", "attach_timeout_s: .nan", "monarch_port: 700000"])
def test_profile_value_out_of_range_is_named(tmp_path, text):
    key, value = text.split(": ")
    with pytest.raises(slurm.SlurmError, match=rf"prof\.yaml: {key}=\S+ is out of range \(must be >"):
        slurm.load_profile(_profile(tmp_path, f"partition: dev\n{text}\n"))
    assert slurm.load_profile(_profile(tmp_path, "max_requeues_on_timeout: 0\nmem_gb: 0.5\n"))[0].mem_gb == 0.5


def test_profile_sbatch_export_is_refused(tmp_path):
    """sbatch's --export is the launcher's (the command line would silently override the profile's)."""
    for key in ("export", "--export", "export-file"):
        with pytest.raises(slurm.SlurmError, match=r"sbatch.export is set by the launcher.*setup: lines"):
            slurm.load_profile(_profile(tmp_path, f"sbatch:\n  {key}: ALL\n"))
    assert slurm.load_profile(_profile(tmp_path, "sbatch:\n  reservation: r1\n"))[0].sbatch == {"reservation": "r1"}


@pytest.mark.parametrize("text, message", [
    ("sbatch:\n  nodes: 5", r"sbatch.nodes is set by the recipe's layout.nodes"),
    ("sbatch:\n  requeue: true", r"sbatch.requeue is set by the launcher"),
    ("sbatch:\n  output: /dev/null", r"sbatch.output is set by the launcher"),
    ("sbatch:\n  --mem: 4G", r"sbatch.mem is set by the profile key mem_gb"),
    ("sbatch:\n  gres: [a, b]", r"sbatch.gres=\['a', 'b'\] must be one line of text, a number or true"),
    ('partition: "dev\\n#SBATCH --uid=0"', r"partition holds a line break"),
    ("time_min: 1\nsignal_delay_s: 3600", r"signal_delay_s=3600 must be shorter than time_min=1 \(60 s\)")])
def test_profile_sbatch_options_the_launcher_sets_and_bad_lines_are_refused(tmp_path, text, message):
    """An sbatch option the launcher or a profile key sets would be overridden (or break the requeue and
    the logs); a value that is not one line would split the script's line."""
    with pytest.raises(slurm.SlurmError, match=message):
        slurm.load_profile(_profile(tmp_path, text + "\n"))
    prof = slurm.load_profile(_profile(tmp_path, "sbatch:\n  --reservation: r1\n  exclusive-user: false\n"))[0]
    assert prof.sbatch == {"reservation": "r1"}  # leading dashes dropped; false: not set


def test_shipped_profiles_load():
    for name in slurm.available_profiles():
        slurm.load_profile(name)
    assert {"dev", "example"} <= set(slurm.available_profiles())


def test_unknown_partition_is_named(monkeypatch):
    monkeypatch.setattr(slurm, "cluster_partitions", lambda: ["dev", "debug"])
    with pytest.raises(slurm.SlurmError, match=r"partition 'gpu' .*example\.yaml.* partitions: dev, debug"):
        slurm.build_job("smollm2_135m", "example")


def test_gated_model_without_token_is_refused_before_submitting(monkeypatch, capsys, tmp_path):
    # as make check / make sky: refused here (also a dry run), not on node 0 after SLURM allocated the job
    monkeypatch.setattr(slurm, "cluster_partitions", lambda: None)
    monkeypatch.setattr(slurm, "LAST_JOB", tmp_path / "last.json")
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for dry in (["--dry-run"], []):
        assert slurm.main(["submit", "llama3_8b", "--cluster", "example", *dry, f"output_dir={tmp_path}"]) == 2
        cap = capsys.readouterr()
        assert "'llama3_8b' (" in cap.err and "HF_TOKEN is not set" in cap.err and "export HF_TOKEN" in cap.err
        assert "#!/bin/bash" not in cap.out and not (tmp_path / "last.json").exists()
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_x")  # the legacy name is enough, as for huggingface_hub
    assert slurm.build_job("llama3_8b", "example", overrides=[f"output_dir={tmp_path}"]).nodes == 2


def test_bad_data_is_refused_before_submitting_and_on_node_0(monkeypatch, capsys, tmp_path):
    """As ``make check``: a field the rows lack is named with file:line and the fields they have, by a
    dry run (before the config's dump), by a submission (before sbatch) and by node 0's entry point
    (before its Monarch worker starts)."""
    says = ("recipes/smollm2_135m_arith/data/train.jsonl:1: no field 'qq' (data.prompt_field); the row has "
            "['answer', 'op', 'question']")
    for dry in (["--dry-run"], []):
        assert slurm.main(["submit", "smollm2_135m_arith", *dry, "data.prompt_field=qq", f"output_dir={tmp_path}"]) == 2
        cap = capsys.readouterr()
        assert says in cap.err and cap.out == "", cap.out[:500] + cap.err
    from launch import bootstrap, node

    for k, v in {"SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "FORGE_NODE_ADDR": ""}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SLURM_STEP_NODELIST", raising=False)
    monkeypatch.setattr(bootstrap, "start_worker_background", lambda cluster: pytest.fail("the worker started"))
    assert node.main(["--from", "slurm", "smollm2_135m_arith", "data.prompt_field=qq", f"output_dir={tmp_path}"]) == 2
    assert says in capsys.readouterr().err


def test_job_parameters_come_from_recipe_and_profile(monkeypatch, tmp_path):
    monkeypatch.setattr(slurm, "cluster_partitions", lambda: None)
    monkeypatch.setenv("HF_TOKEN", "hf_x")  # llama3_8b is gated
    spec = slurm.build_job("llama3_8b", "example", overrides=[f"output_dir={tmp_path}"], check_cluster=True)
    # nodes and GPUs from the recipe's layout; partition, account, ... from the profile
    assert spec.sbatch["nodes"] == 2 and spec.sbatch["gpus-per-node"] == 8
    assert spec.sbatch["ntasks-per-node"] == 1 and spec.sbatch["time"] == 240
    assert spec.sbatch["mem"] == "480GB" and spec.sbatch["cpus-per-task"] == 64
    assert spec.sbatch["partition"] == "gpu" and spec.sbatch["account"] == "my-account"
    assert spec.sbatch["exclusive"] is True
    script = slurm.sbatch_script(spec)
    assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --qos=normal" in script
    assert "export HF_HOME=/shared/cache/huggingface" in script
    # NODES overrides layout.nodes; a CPU recipe asks for no GPUs
    spec = slurm.build_job("smollm2_135m", "dev", nodes=3, overrides=[*TINY, f"output_dir={tmp_path}"])
    assert spec.nodes == 3 and spec.cfg.layout.nodes == 3 and "gpus-per-node" not in spec.sbatch
    assert spec.task.overrides[-2:] == ["layout.nodes=3", f"output_dir={tmp_path}"]


def test_nodes_run_the_profiles_python_with_the_profiles_cpus(monkeypatch, tmp_path):
    """srun asks for the profile's CPUs again (srun of SLURM 22.05-23.02 does not inherit sbatch's) and
    runs the profile's python; one that is not there, or has no vLLM for a vLLM recipe, is refused."""
    monkeypatch.setattr(slurm, "cluster_partitions", lambda: None)
    spec = slurm.build_job("smollm2_135m", "example", overrides=[*TINY, f"output_dir={tmp_path}"])
    srun = next(line for line in slurm.sbatch_script(spec).splitlines() if line.startswith("srun "))
    assert "--cpus-per-task=64" in srun and f"{Path.home()}/forge-venv/bin/python -u -m submitit" in srun
    if not os.path.exists(Path.home() / "forge-venv/bin/python"):
        with pytest.raises(slurm.SlurmError, match=r"example\.yaml: python='~/forge-venv/bin/python': .* not an exec"):
            slurm.submit(spec)
    # By default the nodes run this interpreter (.venv: no vLLM): a CPU recipe runs, a vLLM recipe is refused.
    prof = _profile(tmp_path, "partition: gpu\n")
    spec = slurm.build_job("smollm2_135m", prof, overrides=[*TINY, f"output_dir={tmp_path}"])
    assert f" {sys.executable} -u -m submitit" in slurm.sbatch_script(spec) and slurm.node_python_problem(spec) is None
    spec = slurm.build_job("qwen3_8b", prof, overrides=[f"output_dir={tmp_path}"])
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(slurm.SlurmError, match=r"qwen3_8b generates with vLLM .*has no vllm: set python: in .*prof"):
            slurm.submit(spec)
    # a path relative to the repository is resolved here; a bare name is found on the nodes, after setup:
    spec = slurm.build_job("qwen3_8b", _profile(tmp_path, "python: python3\n"), overrides=[f"output_dir={tmp_path}"])
    assert " python3 -u -m submitit" in slurm.sbatch_script(spec) and slurm.node_python_problem(spec) is None
    spec = slurm.build_job("smollm2_135m", _profile(tmp_path, "python: .venv/bin/python\n"), overrides=[*TINY])
    assert spec.python == str(ROOT / ".venv/bin/python") and slurm.node_python_problem(spec) is None


def test_forge_run_id_at_submission_names_the_run_the_nodes_write(monkeypatch, tmp_path):
    """The nodes set FORGE_RUN_ID to the job id; one set at submission (to resume that run) wins."""
    from forge_core.config import load_config

    monkeypatch.setenv("FORGE_RUN_ID", "myrun")
    spec = slurm.build_job("smollm2_135m", "dev", overrides=[*TINY, f"output_dir={tmp_path}"])
    assert spec.task.overrides[-1] == "run_id=myrun"
    monkeypatch.setenv("FORGE_RUN_ID", "4242")  # a node of job 4242
    assert load_config(spec.task.recipe, spec.task.overrides).run_id == "myrun"
    monkeypatch.delenv("FORGE_RUN_ID")
    assert "run_id=" not in " ".join(slurm.build_job("smollm2_135m", "dev", overrides=TINY).task.overrides)


def test_cancel_of_a_job_slurm_has_forgotten_still_removes_its_secrets_file(monkeypatch, tmp_path):
    """SLURM forgets an ended job after MinJobAge: scontrol knows nothing and scancel fails; the
    secrets file, which make slurm-cancel JOB=<id> is documented to remove, goes all the same."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1\n")
    (bin_dir / "scancel").write_text("#!/bin/sh\necho 'scancel: error: Invalid job id specified' >&2; exit 1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    f = slurm.secrets_file("4242")
    f.parent.mkdir(parents=True)
    f.write_text("{}")
    done = slurm.cancel("4242")
    assert "not known to SLURM" in done and done.endswith(f"removed its secrets file {f}") and not f.exists()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho JobId=4242 JobState=RUNNING\n")  # a known job: scancel's
    with pytest.raises(slurm.SlurmError, match="scancel 4242: scancel: error"):  # failure is an error
        slurm.cancel("4242")
    # SLURM cannot be reached: no job state, and scancel fails for that reason; the file stays
    for cmd in ("scontrol", "scancel"):
        (bin_dir / cmd).write_text(f"#!/bin/sh\necho '{cmd}: fatal: Could not establish a configuration source' >&2\n"
                                   f"exit 1\n")
    f.write_text("{}")
    with pytest.raises(slurm.SlurmError, match="configuration source .its secrets file is kept"):
        slurm.cancel("4242")
    assert f.exists()
    (tmp_path / "victim.json").write_text("{}")  # not a job id: nothing is looked up or removed
    with pytest.raises(slurm.SlurmError, match="is not a SLURM job id"):
        slurm.cancel(os.path.relpath(tmp_path / "victim", f.parent))
    assert (tmp_path / "victim.json").exists()


def test_a_damaged_last_job_record_is_named(tmp_path, monkeypatch, capsys):
    last = tmp_path / "last_job.json"
    monkeypatch.setattr(slurm, "LAST_JOB", last)  # what FORGE_SLURM_LAST_JOB names
    for text in ("{not json", '{"folder": "/x"}', "[1]"):
        last.write_text(text)
        assert slurm.main(["status"]) == 2
        err = capsys.readouterr().err
        assert f"error: {last} is not a job record" in err, err


def test_secrets_are_refused_in_script_or_arguments(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(slurm, "cluster_partitions", lambda: None)
    monkeypatch.setenv("HF_TOKEN", "hf_test_SECRET123")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_test_SECRET456")
    spec = slurm.build_job("smollm2_135m", "dev", overrides=[*TINY, f"output_dir={tmp_path}"])
    script = slurm.sbatch_script(spec)
    assert "SECRET" not in script and "SECRET" not in repr(spec.task)
    assert "SECRET" not in pickle.dumps(spec.task).decode("latin-1")
    # a secret passed where it would be written down is refused before anything is submitted, also
    # through an interpolation, and by a dry run too (which builds the job and its script)
    for value in ("hf_test_SECRET123", "${oc.env:HF_TOKEN}"):
        with pytest.raises(ConfigError, match=r"wandb.project holds the value of \$HF_TOKEN"):
            slurm.build_job("smollm2_135m", "dev",
                            overrides=[*TINY, f"wandb.project={value}", f"output_dir={tmp_path}"])
    prof = _profile(tmp_path, "setup:\n  - export WANDB_API_KEY=wandb_test_SECRET456\n")
    spec = slurm.build_job("smollm2_135m", prof, overrides=[*TINY, f"output_dir={tmp_path}"])
    with pytest.raises(slurm.SlurmError, match=r"\$WANDB_API_KEY would be written into the sbatch script"):
        slurm.sbatch_script(spec)
    capsys.readouterr()
    assert slurm.main(["submit", "smollm2_135m", "--cluster", str(prof), "--dry-run", *TINY,
                       f"output_dir={tmp_path}"]) == 2
    r = capsys.readouterr()
    assert not r.out and "would be written into the sbatch script" in r.err, r.err
    assert "wandb_test_SECRET456" not in r.err


def test_submit_exports_names_only_and_hands_secrets_over_in_a_private_file(monkeypatch, tmp_path):
    # A fake sbatch/scontrol on PATH records what sbatch would get; nothing is submitted.
    import cloudpickle

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/sh\nprintf "%s\\n" "$@" >"$FAKE_OUT/args"; env >"$FAKE_OUT/env"; '
                                    'cat >"$FAKE_OUT/script"; echo "4242;dev"\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho JobId=4242 JobState=FAILED\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_OUT", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_TOKEN", "hf_test_SECRET123")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_test_SECRET456")
    monkeypatch.setenv("BASH_FUNC_x%%", "() { :; }")  # not a variable name: not exported
    monkeypatch.setenv("MAKEFLAGS", " -- HF_TOKEN=hf_test_SECRET123")  # `make slurm HF_TOKEN=...`: not exported
    monkeypatch.setattr(slurm, "LAST_JOB", tmp_path / "last.json")
    monkeypatch.setattr(slurm, "cluster_partitions", lambda: None)
    spec = slurm.build_job("smollm2_135m", "dev", overrides=[*TINY, f"output_dir={tmp_path}/runs"])
    rec = slurm.submit(spec)
    assert rec["job_id"] == "4242" and rec["secrets"] == ["HF_TOKEN", "WANDB_API_KEY"]
    args = (tmp_path / "args").read_text().splitlines()
    export = next(a for a in args if a.startswith("--export="))[len("--export="):].split(",")
    assert {"PATH", "HOME", "FAKE_OUT", "FORGE_SLURM_SECRETS"} <= set(export)
    assert not set(slurm.SECRETS) & set(export) and "BASH_FUNC_x%%" not in export
    sbatch_env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    assert not [v for v in sbatch_env.values() if "hf_test_SECRET123" in v or "wandb_test_SECRET456" in v]  # none
    assert "MAKEFLAGS" not in export
    folder = Path(rec["folder"])
    assert args[0] == "--parsable" and len(args) == 2  # the script comes on stdin: what the dry run prints
    assert (tmp_path / "script").read_text() == (folder / "4242_submission.sh").read_text() == slurm.sbatch_script(spec)
    task = cloudpickle.loads((folder / "4242_submitted.pkl").read_bytes())
    assert repr(task.function) == repr(spec.task) and task._timeout_countdown == spec.profile.max_requeues_on_timeout
    # the secrets file: private, outside every SLURM state; a node reads it into its environment
    f = tmp_path / "home" / ".cache" / "forge-recipes" / "slurm-secrets" / "4242.json"
    assert sbatch_env["FORGE_SLURM_SECRETS"] == str(f.parent)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and stat.S_IMODE(f.parent.stat().st_mode) == 0o700
    node_env = {"FORGE_SLURM_SECRETS": str(f.parent)}
    assert slurm.load_secrets("4242", node_env) == ["HF_TOKEN", "WANDB_API_KEY"]
    assert node_env["HF_TOKEN"] == "hf_test_SECRET123" and node_env["WANDB_API_KEY"] == "wandb_test_SECRET456"
    # make slurm-cancel removes it (here: the job already ended); a node then says which file is missing
    assert slurm.cancel("4242").endswith(f"removed its secrets file {f}") and not f.exists()
    with pytest.raises(slurm.SlurmError, match=r"4242\.json .*FORGE_SLURM_SECRETS"):
        slurm.load_secrets("4242", node_env)
    assert slurm.load_secrets("4242", {}) == []  # no secret was set at submission


def test_node_task_checkpoint_requeues_the_same_task():
    import cloudpickle
    import submitit

    task = slurm.NodeTask("/r/smollm2_135m", ["steps=5"], 42.0)
    task._signalled_at = 1.0
    again = cloudpickle.loads(cloudpickle.dumps(task))
    assert again._signalled_at is None and repr(again) == repr(task)
    d = task.checkpoint()
    assert isinstance(d, submitit.helpers.DelayedSubmission)
    assert isinstance(d.function, slurm.NodeTask) and repr(d.function) == repr(task)
    assert d.args == () and d.kwargs == {}
