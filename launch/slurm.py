"""Launch a recipe on a SLURM cluster through submitit: ``make slurm RECIPE=... [CLUSTER=...] [NODES=n]``.

    python -m launch.slurm submit RECIPE [--cluster PROFILE] [--nodes N] [--dry-run] [overrides ...]
    python -m launch.slurm logs   [JOB_ID] [--no-follow] [--task T]     # default: the last job
    python -m launch.slurm cancel [JOB_ID]
    python -m launch.slurm status [JOB_ID]

The recipe (NODES=n sets layout.nodes) gives nodes, GPUs per node and which node hosts which service;
the profile (cluster/slurm/<profile>.yaml, :class:`Profile`) gives partition, account, time limit, ...
The job is one sbatch allocation, one task per node, each running :class:`NodeTask` (pickled by
submitit), i.e. :func:`launch.node.run_node` ``--from slurm``. The run directory is
``<output_dir>/<SLURM job id>``; submitit's files (sbatch script, pickles, per-task logs) are in its
``slurm/`` folder.

Preemption and time limits: SLURM signals ``USR2`` ``signal_delay_s`` seconds before the time limit
and submitit's interrupt helper sends ``SIGTERM`` + ``USR2``; on rank 0 submitit then calls
:meth:`NodeTask.checkpoint` and ``scontrol requeue``s the job. The requeued job keeps its id, so it
resumes from the newest ``<run>/checkpoints/step_N`` (metrics continue at step N+1), as after a plain
``scontrol requeue`` or a preemption with ``PreemptMode=REQUEUE``. Failures end the allocation: srun
runs with ``--kill-on-bad-exit=1``, so when rank 0 fails the other tasks are killed at once, and with
``SLURM_WAIT`` (srun's ``--wait``: 60 s more than rank 0's wait for a requeue; a profile's setup line
may export another), so tasks that outlive the first one to end (a worker that the controller could not
shut down) are killed that many seconds later instead of holding the nodes until the time limit.

Secrets (:data:`launch.common.SECRETS`) never enter SLURM's state: sbatch runs without them, with
``--export`` naming the other variables, and :func:`submit` writes them to :func:`secrets_file`
(0600 in a 0700 directory; home must be shared with the nodes), which every node's :class:`NodeTask`
reads at start, also after a requeue. The file goes when the job completes and with ``make
slurm-cancel``; a job that fails, runs out of requeues or is ``scancel``-ed directly leaves it until
``make slurm-cancel JOB=<id>``. No value is written into the sbatch script, submitit's pickles, the
config, metrics or logs; submission refuses if one would be.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, MutableMapping, Optional, Sequence, get_args, get_type_hints

from launch.common import SECRETS

ROOT = Path(__file__).resolve().parents[1]
PROFILE_DIR = ROOT / "cluster" / "slurm"
LAST_JOB = Path(os.environ.get("FORGE_SLURM_LAST_JOB", ROOT / "runs" / "slurm_last_job.json"))
SECRETS_ENV = "FORGE_SLURM_SECRETS"  # exported: the directory of the jobs' secrets files
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # an environment variable sbatch can --export


class SlurmError(RuntimeError):
    """A submission problem the user can fix; the message says what and where."""


@dataclass
class Profile:
    """A cluster profile, ``cluster/slurm/<name>.yaml``. Every key is optional; unknown keys fail.

    Attributes:
        partition, account, qos, constraint: ``--partition`` (default: the cluster's default),
            ``--account``, ``--qos``, ``--constraint`` (e.g. ``h100``).
        cpus_per_task: ``--cpus-per-task`` (one task per node, so: CPUs per node).
        mem_gb: ``--mem`` per node in GB (default: the partition's default).
        time_min, exclusive: ``--time`` in minutes; ``--exclusive`` (whole nodes).
        setup: shell lines run by the batch script before ``srun`` (module load, exports, ...).
        python: the interpreter every node runs: a GPU environment (the project with its ``gpu``
            extra) on a filesystem the nodes share; ``~`` and a path relative to the repository are
            resolved here, a bare name (``python3``) on the nodes after ``setup``. Default: the
            interpreter of ``make slurm`` (``.venv``, without vLLM: fine for CPU recipes only).
        signal_delay_s: USR2 this many seconds before the time limit, to requeue in time.
        max_requeues_on_timeout: requeues after hitting the time limit (preemptions do not count).
        attach_timeout_s: seconds rank 0 waits for every node's Monarch worker (then fails, naming them).
        monarch_port: TCP port of the Monarch worker on every node.
        sbatch: extra sbatch options ``{option: value}`` (``true``: a flag; ``false``: not set), e.g.
            ``{reservation: foo}``; not one the launcher or a profile key sets (refused: it would be
            overridden).
    """

    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[float] = None
    time_min: int = 60
    constraint: Optional[str] = None
    exclusive: bool = False
    setup: list = field(default_factory=list)
    python: Optional[str] = None
    signal_delay_s: int = 90
    max_requeues_on_timeout: int = 3
    attach_timeout_s: float = 300.0
    monarch_port: int = 26600
    sbatch: dict = field(default_factory=dict)


# {key: the type(s) a profile value may have}: Optional[X] -> X, float -> int or float
_TYPES = {k: (int, float) if float in (a := get_args(t) or (t,)) else a[0] for k, t in get_type_hints(Profile).items()}


def available_profiles() -> list[str]:
    """Names of the profiles in ``cluster/slurm/``."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")) if PROFILE_DIR.is_dir() else []


def load_profile(name: str) -> tuple[Profile, Path]:
    """Read and check ``cluster/slurm/<name>.yaml``, or ``name`` itself when it is a path to a YAML file.

    Raises:
        SlurmError: the profile does not exist (lists the known ones), a key is unknown (names it,
            with the closest known key), a value has the wrong type or a line break, a number is
            not > 0 and finite (``max_requeues_on_timeout``: >= 0; ``monarch_port``: <= 65535),
            ``signal_delay_s`` is not shorter than ``time_min``, or ``sbatch`` sets an option the
            launcher or a profile key sets (``export``, ``nodes``, ``output``, ``partition``, ...).
    """
    import yaml

    direct = Path(name).suffix in (".yaml", ".yml") and (Path(name).is_file() or os.sep in name)
    path = Path(name).resolve() if direct else PROFILE_DIR / f"{name.removesuffix('.yaml').removesuffix('.yml')}.yaml"
    if not path.is_file():
        raise SlurmError(f"cluster profile {name!r} not found: {path} (profiles in {PROFILE_DIR}: "
                         f"{', '.join(available_profiles()) or 'none'})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise SlurmError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise SlurmError(f"{path}: a profile is a mapping of keys to values, got {type(data).__name__}")
    known = list(_TYPES)
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SlurmError(f"{path}: unknown profile key {key!r}{hint}; known keys: {', '.join(known)}")
        want = _TYPES[key]
        if value is not None and not (isinstance(value, want) and not (want != bool and isinstance(value, bool))):
            raise SlurmError(f"{path}: {key}={value!r} has the wrong type (expected {getattr(want, '__name__', want)})")
        zero_ok = key == "max_requeues_on_timeout"  # every other number (minutes, GB, CPUs, s, port): > 0
        top = 65535 if key == "monarch_port" else math.inf
        if want in (int, (int, float)) and value is not None and not (0 <= value <= top and value != math.inf
                                                                      and (value or zero_ok)):
            raise SlurmError(f"{path}: {key}={value!r} is out of range (must be {'>= 0' if zero_ok else '> 0'}"
                             f"{', <= 65535' if top < math.inf else ', finite'})")
        if isinstance(value, str) and "\n" in value:
            raise SlurmError(f"{path}: {key} holds a line break, which would split its line of the sbatch script")
    prof = Profile(**{k: v for k, v in data.items() if v is not None})
    if not all(isinstance(line, str) for line in prof.setup):
        raise SlurmError(f"{path}: setup must be a list of shell lines (strings)")
    if prof.signal_delay_s >= prof.time_min * 60:
        raise SlurmError(f"{path}: signal_delay_s={prof.signal_delay_s} must be shorter than time_min={prof.time_min} "
                         f"({prof.time_min * 60} s): the requeue signal would come before the job starts")
    prof.sbatch = {str(k).lstrip("-"): v for k, v in prof.sbatch.items() if v is not False}  # false: not set
    if any(k in ("export", "export-file") for k in prof.sbatch):
        raise SlurmError(f"{path}: sbatch.export is set by the launcher (the names of the variables a job needs, never "
                         f"a secret's value) and would be overridden; export other variables in setup: lines instead "
                         f"(e.g. 'export NCCL_DEBUG=WARN')")
    owned = {"nodes": "the recipe's layout.nodes (or NODES=)"}
    owned |= dict.fromkeys(("ntasks-per-node", "signal", "requeue", "output", "error", "open-mode", "chdir"),
                           "the launcher: the requeue and the logs depend on it")
    owned |= {f: f"the profile key {f.replace('-', '_').replace('mem', 'mem_gb').replace('time', 'time_min')}"
              for f in ("partition", "account", "qos", "constraint", "cpus-per-task", "mem", "time", "exclusive")}
    for k, v in prof.sbatch.items():
        if k in owned:
            raise SlurmError(f"{path}: sbatch.{k} is set by {owned[k]}, and would be overridden")
        if not isinstance(v, (str, int, float)) or (isinstance(v, str) and "\n" in v):
            raise SlurmError(f"{path}: sbatch.{k}={v!r} must be one line of text, a number or true")
    return prof, path


def cluster_partitions() -> Optional[list[str]]:
    """The partitions slurmctld reports (``sinfo``), or ``None`` when SLURM cannot be asked."""
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):  # no sinfo here, or it hangs
        return None
    return sorted({line.strip() for line in p.stdout.splitlines() if line.strip()}) if p.returncode == 0 else None


class NodeTask:
    """What every task of the job runs (one task per node); submitit pickles it.

    ``__call__`` runs :func:`launch.node.run_node` with the run id set to the SLURM job id (requeues:
    see the module docstring); ``checkpoint`` is submitit's requeue protocol. ``preempt_grace_s``:
    seconds rank 0 waits for the requeue when it fails after a SIGTERM.
    """

    _signalled_at: Optional[float] = None  # time.monotonic() of this process's SIGTERM; never pickled
    preempt_grace_s = 120.0

    def __init__(self, recipe: str, overrides: Sequence[str], attach_timeout_s: float):
        self.recipe = recipe
        self.overrides = list(overrides)
        self.attach_timeout_s = attach_timeout_s

    def __repr__(self) -> str:
        return (f"NodeTask(recipe={self.recipe!r}, overrides={self.overrides!r}, "
                f"attach_timeout_s={self.attach_timeout_s:g})")

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_signalled_at"}

    def _on_sigterm(self, prev, signum, frame) -> None:
        """Remember when SIGTERM came (preemption, scancel, requeue) and chain to submitit's handler ``prev``."""
        self._signalled_at = time.monotonic()
        print(f"[slurm] SIGTERM on node {os.environ.get('SLURM_NODEID')}: preemption or requeue in progress",
              file=sys.stderr, flush=True)
        if callable(prev):
            prev(signum, frame)

    def __call__(self) -> Optional[dict]:
        import submitit

        from launch.node import run_node

        env = submitit.JobEnvironment()
        os.environ["FORGE_RUN_ID"] = str(env.job_id)  # kept across requeues: resume finds the run
        print(f"[slurm] {env}; restarts so far: {os.environ.get('SLURM_RESTART_COUNT', '0')}", flush=True)
        if names := load_secrets(str(env.job_id)):  # log the names only, never a value
            print(f"[slurm] node {env.node}: {', '.join(names)} set from ${SECRETS_ENV}", flush=True)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, functools.partial(self._on_sigterm, signal.getsignal(signal.SIGTERM)))
        try:
            result = run_node("slurm", self.recipe, self.overrides, self.attach_timeout_s)
            if env.global_rank == 0:  # the job is done: no requeue will read the secrets again
                secrets_file(str(env.job_id), os.environ).unlink(missing_ok=True)
            return result
        except Exception as e:
            print(f"[slurm] error on node {env.node}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if self._signalled_at is not None and env.global_rank == 0:
                # Actors die on the same signal: this failure is the preemption. Give submitit's USR2
                # handler (requeue) or SLURM's kill time to end this process, so no error result is recorded.
                print(f"[slurm] {type(e).__name__} after SIGTERM; waiting up to {self.preempt_grace_s:g} s "
                      f"for the requeue", file=sys.stderr, flush=True)
                time.sleep(self.preempt_grace_s)  # signal handlers run meanwhile
            elif env.global_rank == 0:
                print("[slurm] the job ends now: srun --kill-on-bad-exit stops the other nodes' tasks",
                      file=sys.stderr, flush=True)
            raise

    def checkpoint(self, *args: Any, **kwargs: Any):
        """submitit: called on rank 0 before the requeue; resubmit the same task. In a job, this
        process and the ``scontrol requeue`` it starts next ignore SIGTERM from here on: the kill that
        comes with the requeue (or a preemption) would cut scontrol off mid-request (seen on the
        dev cluster: no requeue, or no result); SLURM's SIGKILL after KillWait still ends them."""
        import submitit

        if os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited across exec, unlike a handler
        print("[slurm] checkpoint(): requeueing; the job resumes from the run's newest checkpoint",
              file=sys.stderr, flush=True)
        return submitit.helpers.DelayedSubmission(self)  # pickled without the SIGTERM time


def secrets_file(job_id: str, env: Optional[Mapping[str, str]] = None) -> Path:
    """The job's secrets file ``DIR/<job_id>.json``: DIR is ``$FORGE_SLURM_SECRETS`` of ``env`` (on a
    node: what submit exported), else ``~/.cache/forge-recipes/slurm-secrets`` (mode 0700)."""
    return Path((env or {}).get(SECRETS_ENV) or Path.home() / ".cache/forge-recipes/slurm-secrets") / f"{job_id}.json"


def load_secrets(job_id: str, env: Optional[MutableMapping[str, str]] = None) -> list[str]:
    """On a node: read the job's secrets file into ``env`` (default ``os.environ``) when submit exported
    ``$FORGE_SLURM_SECRETS``; returns the names set. Raises SlurmError naming the file when it is unreadable."""
    env = os.environ if env is None else env
    if not env.get(SECRETS_ENV):
        return []
    path = secrets_file(job_id, env)
    try:
        values = {k: v for k, v in json.loads(path.read_text()).items() if k in SECRETS}
    except (OSError, ValueError) as e:
        raise SlurmError(f"cannot read the job's secrets file {path} (${SECRETS_ENV}): {type(e).__name__}; make "
                         f"slurm-cancel removes it, and the nodes must share the submitting host's home") from None
    env.update(values)
    return sorted(values)


def _secret_values() -> dict[str, str]:
    """``{name: value}`` of the secrets set here whose value is long enough (6+ characters) to look for."""
    return {k: v for k in SECRETS if len(v := os.environ.get(k, "")) >= 6}


def assert_no_secrets(what: str, text: str) -> None:
    """Raise SlurmError if ``text`` contains the value (6 characters or more) of a secret variable."""
    for name, value in _secret_values().items():
        if value in text:
            raise SlurmError(f"the value of ${name} would be written into {what}; pass secrets only through "
                             f"the environment (they reach the job through its secrets file), never in "
                             f"overrides or setup lines")


@dataclass
class JobSpec:
    """Everything a submission needs (built by :func:`build_job`, printed by a dry run)."""

    cfg: Any
    profile: Profile
    profile_path: Path
    nodes: int
    folder: str  # submitit folder (logs, pickles, the script), with %j
    run_root: str  # <output_dir>; the run directory is <run_root>/<job id> unless run_id is set
    task: NodeTask
    sbatch: dict  # ``#SBATCH`` options {name: value} (True: a flag), e.g. {"nodes": 2, "requeue": True}
    python: str  # the interpreter every node runs (the profile's ``python``)
    data: str = ""  # what the data and reward check said (launch.local.check_task): printed


def build_job(recipe: str, profile_name: str, nodes: Optional[int] = None,
              overrides: Sequence[str] = (), check_cluster: bool = True) -> JobSpec:
    """Compose the recipe config, read the profile and derive the sbatch options.

    Raises:
        ConfigError: bad recipe or override (names the key).
        SlurmError: bad profile, unknown partition (when the cluster can be asked), bad NODES, a gated
            model without HF_TOKEN (as ``make run`` and ``make sky``: before SLURM allocates anything),
            a secret's value in the task's arguments.
        DataError / RewardError: bad data or a failing reward (``make check``'s test,
            :func:`launch.local.check_task`; the message names the file, the line and the row's fields).
    """
    from forge_core.config import load_config, recipe_dir
    from forge_core.models import gated_without_token
    from launch.local import check_task

    prof, ppath = load_profile(profile_name)
    parts = cluster_partitions() if check_cluster else None
    if prof.partition is not None and parts is not None and prof.partition not in parts:
        raise SlurmError(f"partition {prof.partition!r} (from {ppath}) does not exist on this cluster; "
                         f"partitions: {', '.join(parts) or 'none'}")
    overrides = list(overrides)
    if nodes is not None:
        if nodes < 1:
            raise SlurmError(f"NODES={nodes} must be >= 1")
        overrides.append(f"layout.nodes={nodes}")
    cfg = load_config(recipe, overrides)
    run_root = os.path.abspath(cfg.output_dir)
    overrides.append(f"output_dir={run_root}")  # the job must not depend on its working directory
    if cfg.run_id and not any(o.startswith("run_id=") for o in overrides):  # $FORGE_RUN_ID here: resume that run
        overrides.append(f"run_id={cfg.run_id}")  # (the nodes' FORGE_RUN_ID is the job id)
    cfg = load_config(recipe, overrides)  # exactly what node 0 will compose (run_id: the job id)
    if gated := gated_without_token(cfg.model):
        raise SlurmError(gated)
    data = check_task(cfg)
    folder = os.path.join(run_root, "%j", "slurm")
    n = int(cfg.layout.nodes)
    mem = None if prof.mem_gb is None else (f"{int(prof.mem_gb)}GB" if float(prof.mem_gb).is_integer()
                                            else f"{math.ceil(prof.mem_gb * 1024)}MB")  # --mem=0: all of it
    sbatch = {"job-name": f"forge-{cfg.recipe}", "nodes": n, "ntasks-per-node": 1, "time": prof.time_min,
              "cpus-per-task": prof.cpus_per_task, "mem": mem, "gpus-per-node": int(cfg.layout.gpus_per_node) or None,
              "partition": prof.partition, "account": prof.account, "qos": prof.qos, "constraint": prof.constraint,
              "exclusive": prof.exclusive or None, "signal": f"USR2@{prof.signal_delay_s}", "requeue": True,
              "chdir": str(ROOT), "output": f"{folder}/%j_0_log.out", "error": f"{folder}/%j_0_log.err",
              "open-mode": "append", **prof.sbatch}
    sbatch = {k: v for k, v in sbatch.items() if v is not None}
    python = prof.python or sys.executable
    if os.sep in python or python.startswith("~"):  # else a name found on the nodes
        python = str(ROOT / Path(python).expanduser())  # (an absolute path stays as it is)
    task = NodeTask(recipe_dir(recipe), overrides, prof.attach_timeout_s)
    assert_no_secrets("the job's pickled arguments", repr(task))
    return JobSpec(cfg, prof, ppath, n, folder, run_root, task, sbatch, python, data)


def node_python_problem(spec: JobSpec) -> Optional[str]:
    """Why the nodes' interpreter (``spec.python``) cannot run ``spec``'s recipe: it is not an
    executable here (the nodes run it from the same path), or the recipe generates with vLLM and it
    has no ``vllm``. None when it can, or when that cannot be told here (a bare name, ``python3``,
    found on the nodes after ``setup``)."""
    if not os.path.isabs(spec.python):
        return None
    if not (os.path.isfile(spec.python) and os.access(spec.python, os.X_OK)):
        return (f"{spec.profile_path}: python={spec.profile.python!r}: {spec.python} is not an executable here "
                f"(the nodes run it from the same path: a filesystem they share with this host)")
    if spec.cfg.generator.backend == "vllm":
        with contextlib.suppress(OSError, subprocess.SubprocessError):  # cannot be told: None
            p = subprocess.run([spec.python, "-c", "import importlib.util as u; print(u.find_spec('vllm') is None)"],
                               capture_output=True, text=True, timeout=120)
            if p.stdout.strip() == "True":
                return (f"recipe {spec.cfg.recipe} generates with vLLM (generator.backend=vllm), but the nodes would "
                        f"run {spec.python}, which has no vllm: set python: in {spec.profile_path} to a GPU "
                        f"environment on the shared filesystem (the project with its gpu extra; README: SLURM)")
    return None


def sbatch_script(spec: JobSpec) -> str:
    """The batch script of ``spec``, exactly as :func:`submit` submits it (``%j``: the job id).

    submitit 1.5.4 has no public call that returns or takes a script, so this writes the one its
    ``SlurmExecutor`` documents: ``#SBATCH`` options, the setup lines, then srun starting submitit's job
    runner (``python -m submitit.core._submit FOLDER``: loads the pickled task, handles USR2 with
    ``checkpoint`` + ``scontrol requeue``). srun gets ``--export=ALL``, else sbatch's ``--export`` list
    (``SLURM_EXPORT_ENV``) would also drop what the setup lines export, and the profile's
    ``--cpus-per-task`` again (srun of SLURM 22.05-23.02 does not inherit it from sbatch)."""
    opts = [f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={shlex.quote(str(v))}"
            for k, v in sorted(spec.sbatch.items())]
    setup = [f"export PYTHONPATH={shlex.quote(str(ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}",
             f"export FORGE_MONARCH_PORT={spec.profile.monarch_port}",
             f"export SLURM_WAIT={int(NodeTask.preempt_grace_s) + 60}", *spec.profile.setup]
    cpus = [f"--cpus-per-task={spec.profile.cpus_per_task}"] if spec.profile.cpus_per_task else []
    srun = shlex.join(["srun", "--unbuffered", "--output", f"{spec.folder}/%j_%t_log.out", "--error",
                       f"{spec.folder}/%j_%t_log.err", "--kill-on-bad-exit=1", "--export=ALL", *cpus])
    run = f"{srun} {shlex.quote(spec.python)} -u -m submitit.core._submit {shlex.quote(spec.folder)}"
    script = "\n".join(["#!/bin/bash", "", "# Parameters", *opts, "", "# setup", *setup, "", "# command",
                        "export SUBMITIT_EXECUTOR=slurm", run, ""])
    assert_no_secrets("the sbatch script", script)  # a setup line, say (dry runs refuse it too)
    return script


def sbatch_env(secrets: bool) -> dict[str, str]:
    """The environment of the sbatch call: this one less the secrets, any variable holding a secret's
    value (make's ``MAKEFLAGS`` after ``make slurm HF_TOKEN=...``) and the names that are not valid
    identifiers, plus ``$FORGE_SLURM_SECRETS`` when ``secrets``. Its names are sbatch's ``--export`` list."""
    held = _secret_values().values()
    env = {k: v for k, v in os.environ.items()
           if k not in (*SECRETS, SECRETS_ENV) and _NAME.fullmatch(k) and not any(h in v for h in held)}
    return {**env, SECRETS_ENV: str(secrets_file("").parent)} if secrets else env


def submit(spec: JobSpec) -> dict:
    """``sbatch --parsable --export=NAMES`` with :func:`sbatch_script` on stdin, then the secrets file
    (when a secret is set) and submitit's task pickle, which every node waits for (up to 60 s).
    Returns the job record (also saved as the last job).

    Raises:
        SlurmError: a secret's value would be written into the script (:func:`sbatch_script`), sbatch
            is missing, or the nodes' interpreter is missing or lacks vLLM for a vLLM recipe
            (:func:`node_python_problem`).
        subprocess.CalledProcessError: sbatch failed (its message in ``stderr``).
    """
    from submitit.helpers import DelayedSubmission

    if why := node_python_problem(spec):
        raise SlurmError(why)
    script = sbatch_script(spec)
    if not shutil.which("sbatch"):
        raise SlurmError("sbatch is not on PATH: submit from a host of the SLURM cluster")
    values = {k: os.environ[k] for k in SECRETS if os.environ.get(k)}
    env = sbatch_env(bool(values))
    t0 = time.time()
    jid = subprocess.run(["sbatch", "--parsable", f"--export={','.join(sorted(env))}"], input=script, env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip().split(";")[0]
    folder = Path(spec.folder.replace("%j", jid))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{jid}_submission.sh").write_text(script)
    if values:
        path = secrets_file(jid)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # a leftover file of a reused job id may have had other bits
        with os.fdopen(fd, "w") as f:
            json.dump(values, f)
    task = DelayedSubmission(spec.task)
    task.set_timeout(spec.profile.time_min, spec.profile.max_requeues_on_timeout)
    task.dump(folder / f".{jid}_submitted.pkl")
    (folder / f".{jid}_submitted.pkl").rename(folder / f"{jid}_submitted.pkl")  # a node sees all of it or none
    rec = {"job_id": jid, "recipe": spec.cfg.recipe, "nodes": spec.nodes, "profile": str(spec.profile_path),
           "folder": str(folder), "run_dir": os.path.join(spec.run_root, spec.cfg.run_id or jid),
           "log_out": str(folder / f"{jid}_0_log.out"), "log_err": str(folder / f"{jid}_0_log.err"),
           "secrets": sorted(values), "submitted_at": t0}
    LAST_JOB.parent.mkdir(parents=True, exist_ok=True)
    LAST_JOB.write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s ``KEY=VALUE`` fields (``JobState``: ``RUNNING``, ..., ``StdOut``); ``{}`` if unknown."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(t.split("=", 1) for t in out.split() if "=" in t)


def last_job(job_id: Optional[str] = None) -> dict:
    """The record of ``job_id`` (default: the last job submitted from here). For another job id,
    the log folder comes from SLURM (``scontrol show job``: its StdOut path). Raises SlurmError
    when there is no last job, or its record is damaged."""
    try:
        rec = json.loads(LAST_JOB.read_text()) if LAST_JOB.is_file() else None
    except ValueError:  # not JSON, not UTF-8
        rec = {}
    if rec is not None and not (isinstance(rec, dict) and isinstance(rec.get("job_id"), str)):
        raise SlurmError(f"{LAST_JOB} is not a job record (make slurm writes it): delete it, or pass a job id")
    if rec is None and not job_id:
        raise SlurmError(f"no job submitted from here yet ({LAST_JOB} is missing); pass a job id")
    if rec is not None and (not job_id or rec["job_id"] == str(job_id)):
        return rec
    stdout = show_job(job_id).get("StdOut")
    return {"job_id": str(job_id), **({"folder": os.path.dirname(stdout)} if stdout else {})}


ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "RESIZING",
          "SUSPENDED", "STAGE_OUT", "SIGNALING", "PREEMPTED", "REQUEUE_FED")


def follow_logs(rec: dict, task: int = 0, follow: bool = True) -> None:
    """Print task ``task``'s stdout and stderr logs; with ``follow``, keep printing (every second)
    until the job ends."""
    out = sys.stdout
    jid = rec["job_id"]
    if not (folder := rec.get("folder")):
        raise SlurmError(f"job {jid} was not submitted from here: its log folder is unknown")
    files = [os.path.join(folder, f"{jid}_{task}_log.{kind}") for kind in ("out", "err")]
    print(f"job {jid} ({show_job(jid).get('JobState') or 'finished'}): {files[0]}  {files[1]}", file=out, flush=True)
    pos = dict.fromkeys(files, 0)
    while True:
        for f in filter(os.path.exists, files):
            with open(f, "rb") as fh:
                fh.seek(pos[f])
                out.write(fh.read().decode(errors="replace"))
                pos[f] = fh.tell()
            out.flush()
        if not follow or (show_job(jid).get("JobState") or "DONE") not in ACTIVE:
            break
        time.sleep(1.0)


def cancel(job_id: str) -> str:
    """``scancel`` the job if it is still queued or running and delete its secrets file; returns
    what happened. Raises SlurmError for a job id that is not one, and with scancel's message when it
    fails for a job SLURM still knows or when SLURM cannot be reached (the file is kept: a running
    job's requeue needs it); a job SLURM has forgotten (long ended) only loses its secrets file."""
    if not re.fullmatch(r"\d+(_\d+)?", str(job_id)):
        raise SlurmError(f"{job_id!r} is not a SLURM job id (digits; digits_digits for an array task)")
    state = show_job(job_id).get("JobState")
    if state is not None and state not in ACTIVE:
        done = f"job {job_id} already ended ({state}); nothing to cancel"
    else:
        p = subprocess.run(["scancel", str(job_id)], capture_output=True, text=True, timeout=30)
        if p.returncode != 0 and (state is not None or "Invalid job id" not in p.stderr):
            raise SlurmError(f"scancel {job_id}: {p.stderr.strip()} (its secrets file is kept)")
        done = (f"cancelled job {job_id} (was {state or 'unknown'})" if p.returncode == 0 else
                f"job {job_id} is not known to SLURM (scancel: {p.stderr.strip()}); nothing to cancel")
    path = secrets_file(str(job_id))
    if path.exists():
        path.unlink()
        done += f"; removed its secrets file {path}"
    return done


def _print_dry_run(spec: JobSpec) -> None:
    from omegaconf import OmegaConf

    script = sbatch_script(spec)  # first: it refuses a secret's value
    print(f"# recipe {spec.cfg.recipe}: resolved config (what node 0 runs)")
    print(OmegaConf.to_yaml(spec.cfg))
    env = sbatch_env(any(os.environ.get(k) for k in SECRETS))
    print(f"# submitted as: sbatch --parsable --export={','.join(sorted(env))} < SCRIPT\n#   (names only; "
          f"{', '.join(SECRETS)} reach the nodes through {secrets_file('%j')})")
    print(f"# sbatch script (profile {spec.profile_path}); %j is the job id")
    print(script, end="")
    print(f"# every task (one per node) runs, from submitit's pickle in {spec.folder}:")
    print(f"#   {spec.task!r}")
    print("# dry run: nothing submitted")
    if why := node_python_problem(spec):
        print(f"note: a submission would be refused: {why}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the exit code (2: bad recipe, profile, partition, data or reward; 1: SLURM error)."""
    p = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit", help="submit a recipe (or print the job with --dry-run)")
    s.add_argument("--cluster", default=os.environ.get("FORGE_SLURM_PROFILE", "dev"),
                   help="profile name under cluster/slurm/ or a path to a YAML file (default: dev)")
    s.add_argument("--nodes", type=int, default=None, help="override the recipe's layout.nodes")
    s.add_argument("--dry-run", action="store_true", help="print the resolved config and the sbatch script")
    s.add_argument("recipe")
    s.add_argument("overrides", nargs="*", default=[], help="Hydra overrides, e.g. steps=5 layout.generator.host=1")
    for cmd, what in (("logs", "print (and follow) the logs of a job"), ("cancel", "scancel a job"),
                      ("status", "print a job's SLURM state")):
        sub.add_parser(cmd, help=f"{what} (default: the last one)").add_argument("job_id", nargs="?")
    sub.choices["logs"].add_argument("--task", type=int, default=0, help="task (= node rank) whose logs to print")
    sub.choices["logs"].add_argument("--no-follow", dest="follow", action="store_false")
    a, extra = p.parse_known_args(argv)  # overrides may come after the options
    if extra and (a.cmd != "submit" or any(x.startswith("-") for x in extra)):
        p.error(f"unrecognized arguments: {' '.join(extra)}")

    from forge_core.config import ConfigError
    from forge_core.data import DataError
    from forge_core.rewards import RewardError

    try:
        if a.cmd == "submit":
            spec = build_job(a.recipe, a.cluster, a.nodes, a.overrides + extra, check_cluster=True)
            print(spec.data, file=sys.stderr)
            if a.dry_run:
                _print_dry_run(spec)
                return 0
            r = submit(spec)
            print(f"submitted job {r['job_id']}: recipe {r['recipe']}, {r['nodes']} node(s), "
                  f"partition {spec.profile.partition or '(default)'}, profile {spec.profile_path}")
            print(f"  log:     {r['log_out']}  (stderr: {r['log_err']})")
            print(f"  run dir: {r['run_dir']}")
            if r["secrets"]:
                print(f"  secrets: {', '.join(r['secrets'])} in {secrets_file(r['job_id'])} (mode 0600)")
            print("  watch:   make slurm-logs      stop: make slurm-cancel")
            return 0
        rec = last_job(a.job_id)
        if a.cmd == "logs":
            follow_logs(rec, a.task, a.follow)
        elif a.cmd == "cancel":
            print(cancel(rec["job_id"]))
        else:
            print(f"job {rec['job_id']}: {show_job(rec['job_id']).get('JobState') or 'unknown (finished?)'}"
                  + "".join(f"\n  {k}: {rec[k]}" for k in ("run_dir", "log_out", "log_err") if k in rec))
        return 0
    except (ConfigError, SlurmError, DataError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `make slurm-logs | head`
        return 0
    except subprocess.CalledProcessError as e:  # sbatch failed
        print(f"error: {e.cmd[0]} failed: {(e.stderr or e.stdout or '').strip()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
