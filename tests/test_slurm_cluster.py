"""``make slurm`` end to end on the local dev cluster (cluster/dev): two nodes, requeue, failures, secrets.

Slow and root-only. The module brings the dev cluster up with 2 nodes (reusing one that is already
up and idle) and takes it down at the end if it started it. Every job is submitted with the
command line users run (``python -m launch.slurm submit``, what ``make slurm`` calls), the
embedded recipe with the tiny random Llama, and fake secrets in the environment.

Figures are printed (``pytest -s``): submit -> first training step, requeue -> resumed step, and
the secrets search (files scanned, files holding a secret's value).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from forge_core import checkpoint as ckpt
from helpers import PY, ROOT, TINY_LAUNCHER, child_env, live_rows

DEV = ROOT / "cluster" / "dev"

pytestmark = pytest.mark.slow

SECRETS = {"HF_TOKEN": "hf_test_SECRET123", "WANDB_API_KEY": "wandb_test_SECRET456"}
NODE_IPS = ["10.77.0.11", "10.77.0.12"]
STATE = Path(os.environ.get("FR_SLURM_STATE", "/var/lib/forge-dev-slurm"))  # cluster/dev/up.sh
SECRETS_DIR = Path.home() / ".cache" / "forge-recipes" / "slurm-secrets"
# A test-only sitecustomize for a profile's setup: lines: the task on node 1 never starts its worker
# and, like a task inside submitit (whose handler bypasses SIGTERM), only SLURM's SIGKILL ends it.
HANG_NODE1 = """import os, signal, sys, time
if os.environ.get("SLURM_NODEID") == "1" and "submitit.core._submit" in sys.orig_argv:
    print("[test] node 1 hangs before its worker starts", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(3600)
"""
# Another for a profile's setup: the task on node 1 outlives node 0's (as a worker the controller could
# not shut down would): after its worker returns, it ignores SIGTERM and sleeps.
OUTLIVE_NODE1 = """import atexit, os, signal, sys, time
def _outlive():
    print("[test] node 1 outlives node 0", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(3600)
if os.environ.get("SLURM_NODEID") == "1" and "submitit.core._submit" in sys.orig_argv:
    atexit.register(_outlive)
"""
# The embedded recipe, tiny: 12 steps, a checkpoint every 3, the generator on node 1 (2nd node).
TINY = [*TINY_LAUNCHER, "steps=12", "checkpoint.every=3", "checkpoint.keep=10", "layout.generator.host=1"]
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED")
FIGURES: dict = {}
SUBMITTED: list[str] = []  # job ids this module submitted; a test's leftovers are cancelled after it


def _cluster_is_up() -> bool:
    try:
        conf = Path("/etc/slurm/slurm.conf").read_text()
        out = subprocess.run(["sinfo", "-h", "-N", "-p", "dev", "-t", "idle", "-o", "%N"], capture_output=True,
                             text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return False
    return "forge-dev-slurm" in conf and {"node1", "node2"} <= set(out)


@pytest.fixture(scope="module")
def dev_cluster(slurm_dev_prereqs):
    pytest.importorskip("monarch.actor")
    started = not _cluster_is_up()
    if started:
        p = subprocess.run([str(DEV / "up.sh"), "2"], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"up.sh failed\n{p.stdout}\n{p.stderr}"
    yield
    if FIGURES:
        print("\n[figures] " + json.dumps({k: round(v, 1) for k, v in FIGURES.items()}))
    if started:
        p = subprocess.run([str(DEV / "down.sh")], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"down.sh failed\n{p.stdout}\n{p.stderr}"


@pytest.fixture(scope="module")
def work(tmp_path_factory, dev_cluster):
    return tmp_path_factory.mktemp("slurm")


def _env(work: Path, **extra: str) -> dict:
    env = child_env(**SECRETS, FORGE_SLURM_LAST_JOB=str(work / "last_job.json"), **extra)
    env.pop("FORGE_RUN_ID", None)
    return env


def _submit(work: Path, name: str, *args: str, **env: str) -> dict:
    """``python -m launch.slurm submit smollm2_135m ...``; returns the job record (+ ``stdout``)."""
    p = subprocess.run([PY, "-m", "launch.slurm", "submit", "smollm2_135m", "--nodes", "2", *args,
                        f"output_dir={work / name}"], cwd=ROOT, env=_env(work, **env), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    rec = json.loads((work / "last_job.json").read_text())
    SUBMITTED.append(rec["job_id"])
    assert f"submitted job {rec['job_id']}" in p.stdout and rec["log_out"] in p.stdout
    return {**rec, "stdout": p.stdout}


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs():
    """After each test, ``scancel`` the jobs it submitted that are still active and wait for them to
    end: a failed assertion must not leave a job holding the nodes' Monarch port for the next test."""
    n = len(SUBMITTED)
    yield
    left = [j for j in SUBMITTED[n:] if _show(j).get("JobState") in ACTIVE]
    if left:
        subprocess.run(["scancel", *left], check=False, timeout=20)
        _wait(lambda: all(_show(j).get("JobState") not in ACTIVE for j in left), 120, f"jobs {left} to end", 0.5)


def _show(jid: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", jid], capture_output=True, text=True,
                         timeout=20).stdout
    return dict(t.split("=", 1) for t in out.split() if "=" in t)


def _wait(pred, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def _wait_done(rec: dict, timeout_s: float = 300) -> str:
    jid = rec["job_id"]
    try:
        _wait(lambda: _show(jid).get("JobState") not in ACTIVE, timeout_s, f"job {jid} to end", 0.5)
    except AssertionError:
        subprocess.run(["scancel", jid], check=False)
        raise AssertionError(f"job {jid} still {_show(jid).get('JobState')} after {timeout_s} s\n{_logs(rec)}")
    return _show(jid)["JobState"]


def _logs(rec: dict) -> str:
    out = []
    for p in sorted(Path(rec["folder"]).glob("*_log.*")):
        out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}")
    return "\n".join(out)


def _job_procs(jid: str) -> list[dict]:
    """``{node, cmd, env}`` of every live process of job ``jid`` (read from /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
        if env.get("SLURM_JOB_ID") == jid and "SLURM_NODEID" in env and "SLURM_STEP_ID" in env:
            found.append({"node": env["SLURM_NODEID"], "cmd": cmd, "env": env})
    return found


def _scan(files: list[Path], job_ids: set[str]) -> tuple[int, list[str]]:
    """``(files scanned, "file: NAME" for each secret value found)``. Files of other jobs' state
    folders (``hash.N/job.N``, ``spool/node*/jobNNNNN``: earlier users of the dev cluster) are skipped."""
    n, leaks = 0, []
    for p in files:
        m = re.search(r"/job\.?0*(\d+)/", str(p))
        if not p.is_file() or (m and m.group(1) not in job_ids):
            continue
        n += 1
        data = p.read_bytes()
        leaks += [f"{p}: {k}" for k, v in SECRETS.items() if v.encode() in data]
    return n, leaks


def _slurm_state_files() -> list[Path]:
    """slurmctld's StateSaveLocation and the slurmd spool dirs (cluster/dev/slurm.conf.in)."""
    return [*(STATE / "ctld").rglob("*"), *(STATE / "spool").rglob("*")]


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- the uninterrupted run


@pytest.fixture(scope="module")
def two_node_run(work):
    rec = _submit(work, "plain", *TINY)
    t0 = rec["submitted_at"]
    _wait(lambda: live_rows(rec["run_dir"]), 240, "the first training step")
    FIGURES["submit_to_first_step_s"] = time.time() - t0
    rec["procs"] = _job_procs(rec["job_id"])  # the job is running: its processes' environment ...
    state_files = _slurm_state_files()  # ... and SLURM's state of it
    rec["scan_running"] = _scan(state_files, {rec["job_id"]})
    env_file = next(p for p in state_files if p.name == "environment" and f"job.{rec['job_id']}" in str(p))
    rec["env_file_has_exported_value"] = str(work / "last_job.json").encode() in env_file.read_bytes()
    rec["state"] = _wait_done(rec)
    return rec


def test_two_nodes_actors_on_both_addresses_steps_and_metrics(two_node_run, work):
    rec = two_node_run
    assert rec["state"] == "COMPLETED", _logs(rec)
    run = Path(rec["run_dir"])
    assert run.name == rec["job_id"]  # run id = SLURM job id
    where = json.loads((run / "actors.json").read_text())
    assert where["generator"]["ips"] == [NODE_IPS[1]] and where["generator"]["hostname"] == "node2"
    for svc in ("trainer", "reference", "reward", "replay_buffer"):
        assert where[svc]["ips"] == [NODE_IPS[0]] and where[svc]["hostname"] == "node1", svc
    # each node's actors know its launcher's address (the trainer's is where weight transfers connect)
    assert where["generator"]["addr"] == NODE_IPS[1] and where["trainer"]["addr"] == NODE_IPS[0]
    rows = live_rows(str(run))
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(r["policy_version"] == r["step"] for r in rows)
    assert (run / "reward.png").stat().st_size > 0 and (run / "final" / "model.safetensors").is_file()
    folder = Path(rec["folder"])
    assert f"worker tcp://{NODE_IPS[1]}:26600 (node 1/2)" in (folder / f"{rec['job_id']}_1_log.out").read_text()
    assert f"controller on {NODE_IPS[0]}" in (folder / f"{rec['job_id']}_0_log.out").read_text()
    # the dry run prints exactly the script that was submitted
    p = subprocess.run([PY, "-m", "launch.slurm", "submit", "smollm2_135m", "--nodes", "2",
                        "--dry-run", *TINY, f"output_dir={work / 'plain'}"], cwd=ROOT, env=_env(work),
                       capture_output=True, text=True, timeout=120)
    script = p.stdout[p.stdout.index("#!/bin/bash"):p.stdout.index("# every task")]
    assert script == (folder / f"{rec['job_id']}_submission.sh").read_text()


# --------------------------------------------------------------------------- requeue


def test_requeue_resumes_from_checkpoint_with_identical_batches(two_node_run, work):
    from submitit.slurm.slurm import SlurmJob

    ref = {r["step"]: r for r in live_rows(two_node_run["run_dir"])}
    rec = _submit(work, "requeue", *TINY)
    jid, run = rec["job_id"], Path(rec["run_dir"])
    metrics = run / "metrics.jsonl"
    # step 4 logged and the step-3 checkpoint committed (it is written in the background: on a busy
    # machine step 4 can come first, and a checkpoint still being written is lost to the interrupt)
    _wait(lambda: len(live_rows(str(run))) >= 4 and ckpt.complete(str(run / "checkpoints")), 240,
          "step 4 and a committed checkpoint before the interrupt")
    ino = metrics.stat().st_ino
    t_int = time.time()
    # submitit's interrupt helper: SIGTERM + USR2, what a preemption looks like -> checkpoint() + requeue
    SlurmJob(folder=rec["folder"], job_id=jid, tasks=[0, 1])._interrupt()
    info = _wait(lambda: (lambda s: s if s.get("JobState") == "PENDING" else None)(_show(jid)), 60,
                 "the requeued job to be pending", 0.2)
    t_pending = time.time()
    assert info["Restarts"] == "1" and info["Reason"] == "BeginTime", info
    # SLURM holds a requeued job for a while (EligibleTime); release it now to keep the test short.
    FIGURES["slurm_requeue_hold_s"] = (time.mktime(time.strptime(info["EligibleTime"], "%Y-%m-%dT%H:%M:%S"))
                                       - time.mktime(time.strptime(info["SubmitTime"], "%Y-%m-%dT%H:%M:%S")))
    subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"], check=True, timeout=20)
    _wait(lambda: _show(jid).get("JobState") == "RUNNING", 120, "the requeued job to start", 0.2)
    t_restart = time.time()
    ckpts = [Path(p).name for p in ckpt.complete(str(run / "checkpoints"))]
    resumed_from = int(ckpts[-1].split("_")[1])
    assert 3 <= resumed_from < 12, ckpts

    def resumed_step():
        try:
            return metrics.stat().st_ino != ino and any(r["step"] == resumed_from + 1 for r in live_rows(str(run)))
        except FileNotFoundError:
            return False

    _wait(resumed_step, 240, f"step {resumed_from + 1} after the resume")
    t_step = time.time()
    rec["scan_running"] = _scan(_slurm_state_files(), {jid})  # the requeued job, running
    FIGURES.update(interrupt_to_pending_s=t_pending - t_int, restart_to_first_resumed_step_s=t_step - t_restart,
                   interrupt_to_first_resumed_step_without_hold_s=(t_pending - t_int) + (t_step - t_restart))
    assert _wait_done(rec) == "COMPLETED", _logs(rec)
    assert _show(jid)["Restarts"] == "1"

    rows = live_rows(str(run))
    # step counter and metrics continue without a gap or a duplicate ...
    assert [r["step"] for r in rows] == list(range(1, 13))
    # ... and every step trained exactly the batch the uninterrupted run trained, to the same loss
    for r in rows:
        assert r["batch_hash"] == ref[r["step"]]["batch_hash"], f"step {r['step']}"
        assert r["loss"] == ref[r["step"]]["loss"] and r["kl_mean"] == ref[r["step"]]["kl_mean"], f"step {r['step']}"
    assert _sha(run / "final" / "model.safetensors") == _sha(Path(two_node_run["run_dir"]) / "final" / "model.safetensors")
    assert (run / "reward.png").is_file()
    log0 = "".join((Path(rec["folder"]) / f"{jid}_0_log.{k}").read_text() for k in ("out", "err"))
    assert "Calling checkpoint method" in log0 and f"Requeued job {jid}" in log0  # submitit's protocol
    assert "restarts so far: 1" in log0
    # the requeued job read the secrets file again (names only in the log); completion removed it
    assert log0.count("[slurm] node 0: HF_TOKEN, WANDB_API_KEY set from $FORGE_SLURM_SECRETS") == 2, log0[-3000:]
    assert not (SECRETS_DIR / f"{jid}.json").exists()
    rec["state"] = "COMPLETED"
    work.joinpath("requeue.json").write_text(json.dumps(rec))


# --------------------------------------------------------------------------- bad input


def test_unknown_partition_fails_before_submitting(work):
    prof = work / "nopart.yaml"
    prof.write_text("partition: gpu-h100\n")
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    p = subprocess.run([PY, "-m", "launch.slurm", "submit", "smollm2_135m", "--cluster", str(prof),
                        *TINY], cwd=ROOT, env=_env(work), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "partition 'gpu-h100'" in p.stderr and "partitions: dev" in p.stderr and str(prof) in p.stderr
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == before


def test_unknown_profile_key_fails_before_submitting(work):
    prof = work / "badkey.yaml"
    prof.write_text("partition: dev\nqueue: fast\n")
    p = subprocess.run([PY, "-m", "launch.slurm", "submit", "smollm2_135m", "--cluster", str(prof)],
                       cwd=ROOT, env=_env(work), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown profile key 'queue'" in p.stderr


def _hooked_profile(work: Path, name: str, sitecustomize: str, extra: str = "", setup: str = "") -> Path:
    """A dev-partition profile (10 min limit) whose setup puts a test-only sitecustomize on the nodes'
    PYTHONPATH; ``extra``: more profile lines, ``setup``: more setup lines (each ``  - ...\\n``)."""
    hook = work / name
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(sitecustomize)
    prof = work / f"{name}.yaml"
    prof.write_text(f"partition: dev\ncpus_per_task: 1\ntime_min: 10\n{extra}"
                    f"setup:\n  - export PYTHONPATH={hook}:$PYTHONPATH\n{setup}")
    return prof


def test_dead_worker_fails_within_timeout_naming_host_and_ends_allocation(work):
    prof = _hooked_profile(work, "hang_node1", HANG_NODE1, extra="attach_timeout_s: 15\n")
    rec = _submit(work, "deadworker", "--cluster", str(prof), *TINY)
    t0 = time.time()
    state = _wait_done(rec, 180)
    elapsed = time.time() - rec["submitted_at"]
    FIGURES["dead_worker_submit_to_job_end_s"] = elapsed
    assert state == "FAILED", state  # ended by srun --kill-on-bad-exit, not by the time limit
    assert elapsed < 15 + 90, elapsed
    err = (Path(rec["folder"]) / f"{rec['job_id']}_0_log.err").read_text()
    assert f"Monarch workers not reachable within 15 s: {NODE_IPS[1]}:26600" in err
    assert "[test] node 1 hangs" in (Path(rec["folder"]) / f"{rec['job_id']}_1_log.out").read_text()
    assert rec["job_id"] not in subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    # nothing of the job is left on node2 (only its slurmd lives in the namespace)
    time.sleep(max(0.0, 2 - (time.time() - t0)))
    pids = subprocess.run(["ip", "netns", "pids", "fr-node2"], capture_output=True, text=True).stdout.split()
    comms = [Path(f"/proc/{p}/comm").read_text().strip() for p in pids if Path(f"/proc/{p}/comm").exists()]
    assert set(comms) <= {"slurmd"}, comms
    # a failed job leaves its secrets file; make slurm-cancel removes it
    assert (SECRETS_DIR / f"{rec['job_id']}.json").is_file()
    p = subprocess.run([PY, "-m", "launch.slurm", "cancel", rec["job_id"]], cwd=ROOT, env=_env(work),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "removed its secrets file" in p.stdout, p.stdout + p.stderr
    assert not (SECRETS_DIR / f"{rec['job_id']}.json").exists()
    work.joinpath("deadworker.json").write_text(json.dumps(rec))


def test_a_task_that_outlives_node_0_is_ended_by_srun_wait(work):
    """srun's --wait (SLURM_WAIT, here 20 s from the profile's setup) ends a worker node's task that
    is still there after node 0's ended, instead of leaving it until the job's time limit (10 min)."""
    prof = _hooked_profile(work, "outlive_node1", OUTLIVE_NODE1, setup="  - export SLURM_WAIT=20\n")
    rec = _submit(work, "outlive", "--cluster", str(prof), *[a for a in TINY if not a.startswith("steps=")],
                  "steps=2")
    out1 = Path(rec["folder"]) / f"{rec['job_id']}_1_log.out"
    _wait(lambda: out1.exists() and "[test] node 1 outlives node 0" in out1.read_text(), 300,
          "node 1's task to outlive node 0's")
    t_outlive = time.time()
    state = _wait_done(rec, 150)
    FIGURES["outliving_task_ended_after_s"] = time.time() - t_outlive
    assert state != "TIMEOUT" and time.time() - t_outlive < 20 + 90, (state, time.time() - t_outlive)
    assert len(live_rows(rec["run_dir"])) == 2 and "Job completed successfully" in _logs(rec), _logs(rec)
    assert rec["job_id"] not in subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout


# --------------------------------------------------------------------------- secrets


def test_secrets_reach_the_nodes_but_no_slurm_state_and_no_file(two_node_run, work):
    rec = two_node_run
    # every node set them from the job's secrets file (the log names them, never their values) ...
    for task in (0, 1):
        out = (Path(rec["folder"]) / f"{rec['job_id']}_{task}_log.out").read_text()
        assert f"[slurm] node {task}: HF_TOKEN, WANDB_API_KEY set from $FORGE_SLURM_SECRETS" in out, out[-2000:]
    # ... the processes srun started did not get them from SLURM, the processes they started have them
    procs = rec["procs"]
    assert {p["node"] for p in procs} == {"0", "1"}, procs
    for p in procs:
        if "submitit.core._submit" in p["cmd"]:
            assert not set(SECRETS) & set(p["env"]), f"node {p['node']}: a secret came through SLURM"
    for node in ("0", "1"):
        assert any(all(p["env"].get(k) == v for k, v in SECRETS.items()) for p in procs if p["node"] == node), node
    assert not (SECRETS_DIR / f"{rec['job_id']}.json").exists()  # the job completed: its file is gone
    # no value in SLURM's state (slurmctld's StateSaveLocation: the saved job environment and script;
    # slurmd spool dirs) while the jobs ran and now, nor in any file the jobs wrote: scripts,
    # pickles, logs, configs, metrics, checkpoints, Monarch's log
    assert rec["env_file_has_exported_value"], "the grep would not see an exported value in the job's environment"
    job_ids = {json.loads(p.read_text())["job_id"] for p in work.glob("*.json") if p.name != "last_job.json"}
    files = [p for p in work.rglob("*") if p.is_file()]
    monarch_log = Path(f"/tmp/{os.environ.get('USER', 'root')}/monarch_log.log")
    files += [monarch_log] if monarch_log.is_file() else []
    assert any(p.name.endswith("_submission.sh") for p in files)
    assert any(p.name.endswith("_submitted.pkl") for p in files)
    assert any(p.name.startswith("optimizer.rank") for p in files)  # a checkpoint is among the files scanned
    scans = [rec["scan_running"], _scan(_slurm_state_files(), job_ids | {rec["job_id"]}), _scan(files, set())]
    req = work / "requeue.json"
    scans += [tuple(json.loads(req.read_text())["scan_running"])] if req.is_file() else []
    scanned, leaks = sum(n for n, _ in scans), [x for _, lk in scans for x in lk]
    print(f"\n[secrets] scanned {scanned} files (SLURM state: {scans[0][0]} while the 2-node job ran"
          f"{f', {scans[3][0]} while the requeued one ran' if len(scans) > 3 else ''}, {scans[1][0]} after; "
          f"job folders and Monarch log: {scans[2][0]}): {len(set(leaks))} hold a secret's value")
    assert not leaks, leaks
