"""What the test modules share: the repository root, the tiny-model overrides, the CLI runners, the
readers of a run's JSONL files and the network-namespace helpers of the multi-host tests
(cluster/dev/netns.sh: fr-node<i> at 10.77.0.(10+i), hostname node<i>).

Imported as ``helpers`` (pytest puts tests/ on sys.path; a child process that imports test modules
gets it through PYTHONPATH, see :func:`child_env`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PY = sys.executable
NETNS = ROOT / "cluster" / "dev" / "netns.sh"

# The tiny random Llama (model.name=tiny_llama), two prompts a step, no held-out evaluation: what
# every test run trains; the lists below add the sizes of their kind of run.
TINY_MODEL = ["model.name=tiny_llama", "prompts_per_step=2", "eval.every=0", "eval.at_start=false"]
# Local runs (launch.local, actors in this machine's processes): groups of 4, 12 response tokens.
TINY = ["model.name=tiny_llama", "prompts_per_step=2", "generator.group_size=4", "generator.max_response_tokens=12",
        "generator.max_prompt_tokens=128", "trainer.micro_batch_size=4", "trainer.lr=1e-3",
        "eval.every=0", "eval.at_start=false"]
# Launcher runs (SLURM jobs, SkyPilot nodes): groups of 2, 8 response tokens.
TINY_LAUNCHER = ["model.name=tiny_llama", "prompts_per_step=2", "generator.group_size=2",
                 "generator.max_response_tokens=8", "trainer.micro_batch_size=4", "eval.every=0", "eval.at_start=false"]


# --------------------------------------------------------------------------- CLI runs


def child_env(*pythonpath, **extra: str) -> dict:
    """This process's environment for a child: W&B off, unbuffered output, ``pythonpath`` entries
    put before PYTHONPATH's, ``extra`` on top."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (*pythonpath, env.get("PYTHONPATH")) if p)
    return {**env, **extra}


def cli(*args, module: str = "launch.local", env: dict | None = None, timeout: float = 600
        ) -> subprocess.CompletedProcess:
    """``python -m <module> ARGS`` from the repository root; stdout and stderr captured (text)."""
    return subprocess.run([PY, "-m", module, *map(str, args)], cwd=ROOT, env=child_env(**(env or {})),
                          capture_output=True, text=True, timeout=timeout)


def cli_here(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """:func:`cli` of ``launch.local`` in this process (``launch.local.main``, from the repository root,
    with ``env`` on top of this process's environment and output captured): for a command that ends
    before any actor starts (a refusal, ``check``, ``eval`` on the CPU), without a new interpreter's
    seconds of imports. An exception that escapes ``main`` fails the test with its traceback."""
    import contextlib
    import io

    from launch import local

    out, err, saved, cwd = io.StringIO(), io.StringIO(), dict(os.environ), os.getcwd()
    os.environ.update(child_env(**(env or {})))
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = local.main([str(a) for a in args])
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
        os.chdir(cwd)
    return subprocess.CompletedProcess(["launch.local", *map(str, args)], code, out.getvalue(), err.getvalue())


def run_cmd(out, *args: str, recipe: str = "smollm2_135m") -> list[str]:
    """The command line of a tiny local run writing under ``out``: ``launch.local run RECIPE TINY ARGS``."""
    return [PY, "-m", "launch.local", "run", recipe, *TINY, f"output_dir={out}", *args]


def start_run(args: list, run_id: str, out, **popen) -> subprocess.Popen:
    """A tiny local run (:func:`run_cmd`) as run ``run_id``, stdout and stderr together in a pipe (text)."""
    return subprocess.Popen(run_cmd(out, *args), cwd=ROOT, env=child_env(FORGE_RUN_ID=run_id), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def run(args: list, run_id: str, out, timeout: float = 600) -> tuple[int, str]:
    """A tiny local run to its end: ``(exit code, stdout and stderr together)``."""
    return finish(start_run(args, run_id, out), timeout, f"run {run_id}")


def finish(p: subprocess.Popen, timeout: float = 600, what: str = "the run") -> tuple[int, str]:
    """Wait for :func:`start_run`'s process: ``(exit code, its output)``; killed, and the test failed
    with the output's end, after ``timeout`` seconds."""
    try:
        output, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        output, _ = p.communicate()
        pytest.fail(f"{what} did not finish in {timeout:.0f} s:\n{output[-4000:]}")
    return p.returncode, output


# --------------------------------------------------------------------------- a run's JSONL files


def _jsonl(path) -> Path:
    path = Path(path)
    return path / "metrics.jsonl" if path.is_dir() else path


def rows(path) -> list[dict]:
    """The rows of a finished run's JSONL file (``path``, or a run directory's metrics.jsonl): every
    line must parse."""
    return [json.loads(line) for line in _jsonl(path).read_text().splitlines() if line.strip()]


def live_rows(path) -> list[dict]:
    """The rows written so far to a file a run may still be writing: [] before it exists; only whole
    lines (a line being written has no newline yet), and each of those must parse."""
    try:
        text = _jsonl(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def steps(path) -> list[int]:
    """The ``step`` of each row of :func:`rows`."""
    return [r["step"] for r in rows(path)]


# --------------------------------------------------------------------------- network namespaces


def need_root_netns(monarch: bool = False) -> None:
    """Skip unless network namespaces can be made here (root, iproute2, util-linux) and, with
    ``monarch``, torchmonarch is installed."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (cluster/dev/netns.sh)")
    if not shutil.which("ip") or not shutil.which("nsenter") or not shutil.which("unshare"):
        pytest.skip("needs iproute2 (ip) and util-linux (nsenter, unshare)")
    if monarch:
        pytest.importorskip("monarch.actor", reason="torchmonarch is not installed")


def ns_exists(i: int) -> bool:
    return Path(f"/var/run/netns/fr-node{i}").exists()


def ns_pids(i: int) -> list[str]:
    """The processes living in namespace fr-node<i>."""
    return subprocess.run(["ip", "netns", "pids", f"fr-node{i}"], capture_output=True, text=True).stdout.split()


def wait_no_pids(i: int, timeout_s: float = 20) -> list[str]:
    """Wait up to ``timeout_s`` for namespace fr-node<i> to be empty; the processes still there."""
    deadline = time.monotonic() + timeout_s
    while (pids := ns_pids(i)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


def in_ns(i: int, cmd: str) -> list[str]:
    """The command line running shell command ``cmd`` in namespace fr-node<i> with hostname node<i>
    (as slurmd runs there in cluster/dev)."""
    return ["nsenter", f"--net=/var/run/netns/fr-node{i}", "unshare", "--uts",
            "sh", "-c", f"hostname node{i} && exec {cmd}"]


@contextmanager
def netns_nodes(nodes: tuple[int, ...]):
    """Namespaces fr-node1..fr-node<max(nodes)> for a test module (``netns.sh up`` keeps existing ones);
    skipped when one of ``nodes`` already runs processes (the SLURM dev cluster uses fr-node1/2: the
    multi-host tests check that nothing of theirs is left there). Removed at the end if made here and
    no namespace runs a process then."""
    need_root_netns(monarch=True)
    created = not all(ns_exists(i) for i in nodes)
    if created:
        subprocess.run([str(NETNS), "up", str(max(nodes))], check=True, capture_output=True)
    if busy := [i for i in nodes if ns_pids(i)]:
        pytest.skip(f"fr-node{busy[0]} already runs processes (is the SLURM dev cluster up?)")
    try:
        yield
    finally:
        if created and not any(ns_pids(i) for i in range(1, max(nodes) + 1)):
            subprocess.run([str(NETNS), "down"], check=False, capture_output=True)


# --------------------------------------------------------------------------- data


def gsm8k_batch(n: int, seed: int = 0) -> list:
    """``n`` problems of GSM8K's train split (``GSM8K_DIR``: tests/conftest.py sets it), as a run's
    prompt source with ``seed`` deals them."""
    from forge_core.data import PromptSource, load_gsm8k

    return PromptSource(load_gsm8k("train", os.environ["GSM8K_DIR"]), seed).next_batch(n)
