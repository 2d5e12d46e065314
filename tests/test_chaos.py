"""Chaos: faults injected from outside into real CPU runs of the tiny model (``make chaos``).

kill -9 of the generator, reward and reference processes at seeded random points, a hang
(SIGSTOP), a NaN loss (a reward beyond float32's range, once), damaged checkpoints before a
resume (a truncated newest one, one without a manifest), a full disk during a save (a small tmpfs)
and the bad input of ``fault.max_restarts`` used up. Every surviving run must log steps 1..N
exactly once, and its restart counters (faults.jsonl, the last metrics row) must match what was
injected. The trainer and the replay buffer, killed or stopped at seeded random points (once with
the newest checkpoint damaged), take the run back to a checkpoint: the steps computed again must
equal an uninterrupted run's (batch hashes and losses); both checkpoints damaged ends the run
naming both; a generator replica whose restarts are used up is dropped (``fault.min_replicas``).
With ``pytest -s`` the suite ends with a table; ``FORGE_CHAOS_SEED`` picks the points.
Also a direct test of the trainer's non-finite guard and background save through the real trainer actor.
"""

import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections import Counter

import psutil
import pytest
import torch

from forge_core import checkpoint
from forge_core.config import load_config
from helpers import ROOT, TINY, child_env, live_rows, run_cmd

# short deadlines, so that a hang is caught in ~10-20 s: call_timeout_s plus 0.01 s per token of work
FAST_FAULTS = ["fault.call_timeout_s=10", "fault.timeout_per_token_s=0.01", "weight_sync.timeout_s=10"]
SEED = int(os.environ.get("FORGE_CHAOS_SEED", "1234"))
SERVICES = ("generator", "reward", "reference")

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

RESULTS: list[dict] = []  # one per trial: fault, survived, lost, repeated, recover_s (list), recomputed, equal


@pytest.fixture(scope="module", autouse=True)
def chaos_table():
    t0 = time.perf_counter()
    yield
    if not RESULTS:
        return
    rows, order = {}, []
    for r in RESULTS:
        if r["fault"] not in rows:
            order.append(r["fault"])
            rows[r["fault"]] = {"trials": 0, "survived": 0, "lost": 0, "repeated": 0, "recover": [], "wall": [],
                                "runs": set(), "recomputed": 0, "equal": set()}
        a = rows[r["fault"]]
        a["trials"] += 1
        a["survived"] += bool(r["survived"])
        if r["run"] not in a["runs"]:  # run-level figures once per run
            a["runs"].add(r["run"])
            a["lost"] += r["lost"]
            a["repeated"] += r["repeated"]
        a["recover"] += r.get("recover_s", [])
        a["wall"] += r.get("wall_s", [])
        a["recomputed"] += r.get("recomputed", 0)
        if "equal" in r:
            a["equal"].add(r["equal"])
    head = (f"{'fault':<44} {'trials':>6} {'survived':>9} {'steps lost':>10} {'steps repeated':>14} "
            f"{'time to recover':>16} {'fault to recovered':>19} {'recomputed':>10} {'= uninterrupted':>15}")
    print(f"\n\nchaos (seed {SEED}, {time.perf_counter() - t0:.0f} s)\n{head}\n{'-' * len(head)}")
    for f in order:
        a = rows[f]
        mean = lambda xs: f"{sum(xs) / len(xs):.1f} s" if xs else "-"
        equal = {frozenset(): "-", frozenset({True}): "yes"}.get(frozenset(a["equal"]), "no")
        print(f"{f:<44} {a['trials']:>6} {a['survived']:>9} {a['lost']:>10} {a['repeated']:>14} "
              f"{mean(a['recover']):>16} {mean(a['wall']):>19} {a['recomputed']:>10} {equal:>15}")
    print("survived: the run finished every configured step (for a bad input: it stopped as it should, "
          "naming the actor or the checkpoints, outputs intact). steps repeated: trained twice (a resume from an older checkpoint). "
          "time to recover: mean recover_s of faults.jsonl (respawn + state); fault to recovered: from the signal to "
          "that faults.jsonl line (detection included: a hang waits for its call's deadline). recomputed: steps "
          "computed again after the trainer or the replay buffer took the run back to a checkpoint (steps_recomputed "
          "of faults.jsonl); = uninterrupted: every step's batch hash and loss equal an undisturbed run's")


# ---- helpers -----------------------------------------------------------------------------------

class Run:
    """A CLI run in a subprocess (own session), its output in a log file."""

    def __init__(self, tmp_path, run_id: str, args: list, out_dir=None, pythonpath: str = ""):
        self.dir = os.path.join(str(out_dir or tmp_path), run_id)
        self.log_path = os.path.join(str(tmp_path), f"{run_id}.log")
        env = child_env(*filter(None, (pythonpath, ROOT)), FORGE_RUN_ID=run_id)
        self.t0 = time.perf_counter()
        self.log = open(self.log_path, "a")
        self.p = subprocess.Popen(run_cmd(out_dir or tmp_path, *args), cwd=ROOT, env=env, stdout=self.log,
                                  stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read().replace("\r", "\n")

    def rows(self) -> list[dict]:
        return live_rows(os.path.join(self.dir, "metrics.jsonl"))

    def faults(self) -> list[dict]:
        return live_rows(os.path.join(self.dir, "faults.jsonl"))

    def pid(self, service: str) -> int:
        for _ in range(50):  # rewritten after every respawn: retry a half-written file
            try:
                with open(os.path.join(self.dir, "actors.json")) as f:
                    return json.load(f)[service]["pid"]
            except (OSError, ValueError):
                time.sleep(0.1)
        raise AssertionError("actors.json unreadable")

    def wait_for(self, what: str, pred, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while not pred():
            if self.p.poll() is not None:
                raise AssertionError(f"run exited ({self.p.returncode}) while waiting for {what}:\n{self.output()[-4000:]}")
            if time.time() > deadline:
                self.kill()
                raise AssertionError(f"timed out waiting for {what}:\n{self.output()[-4000:]}")
            time.sleep(0.2)

    def finish(self, timeout: float = 300) -> int:
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"run did not finish in {timeout} s:\n{self.output()[-4000:]}")
        self.log.close()
        self.seconds = time.perf_counter() - self.t0
        return rc

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _steps_check(rows: list[dict], n: int) -> tuple[int, int]:
    """(steps lost, steps logged twice) of a run configured for ``n`` steps."""
    steps = [r["step"] for r in rows]
    c = Counter(steps)
    return len(set(range(1, n + 1)) - set(steps)), sum(v - 1 for v in c.values())


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _shm_left(pids: list) -> list:
    """Shared-memory weight buffers (forge_core.weight_sync.StagingBuffer files) of ``pids`` still in /dev/shm."""
    if not os.path.isdir("/dev/shm"):
        return []
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"forge-weights-{p}-") for p in pids)]


def _plan(rng: random.Random, services: list, first: int, gap: int) -> list[tuple[int, str, float]]:
    """(step threshold, service, extra delay s) per fault: thresholds ``gap`` or more steps apart."""
    out, step = [], first
    for s in services:
        out.append((step, s, rng.uniform(0.0, 1.5)))
        step += gap
    return out


# ---- kills and a hang ------------------------------------------------------------------------------

def _inject(run: Run, plan: list, sig: dict, damage: tuple = ()) -> list[dict]:
    """Inject each fault of ``plan`` once its step is logged (after a random delay), waiting for the
    previous one to be recovered (its faults.jsonl line). For the faults listed in ``damage`` the
    service is stopped first, the newest checkpoint truncated (``damaged``: its path), then the
    signal sent. Returns one record per fault."""
    out = []
    for i, (step, service, delay) in enumerate(plan):
        run.wait_for(f"step {step}", lambda: len(run.rows()) >= step)
        time.sleep(delay)
        n_faults = len(run.faults())
        pid = run.pid(service)
        s = sig.get(i, signal.SIGKILL)
        damaged = ""
        if i in damage:  # stopped, no checkpoint can be committed (none is written without the trainer)
            os.kill(pid, signal.SIGSTOP)
            time.sleep(1.0)  # a commit whose files were already written ends
            damaged = checkpoint.complete(os.path.join(run.dir, "checkpoints"))[-1]
            weights = os.path.join(damaged, "model.safetensors")
            os.truncate(weights, os.path.getsize(weights) // 2)
        t_inject = time.perf_counter()
        os.kill(pid, s)
        run.wait_for(f"recovery from {s.name} of {service} (pid {pid})", lambda: len(run.faults()) > n_faults)
        rec = run.faults()[n_faults]
        detected_s = time.perf_counter() - t_inject
        assert rec["service"] == service, rec
        if s == signal.SIGSTOP:
            assert "did not answer within" in rec["error"], rec  # caught by the deadline
        new_pid = run.pid(service)
        assert new_pid != pid
        run.wait_for(f"the stopped/killed pid {pid} to be gone", lambda: _dead(pid), timeout=30)
        out.append({"service": service, "signal": s.name, "at_step": len(run.rows()), "pid": pid, "new_pid": new_pid,
                    "recover_s": rec["recover_s"], "wall_s": detected_s, "record": rec, "damaged": damaged})
    return out


def _check_survivor(run: Run, steps: int, injected: list[dict], label: str) -> tuple[int, int]:
    rc = run.finish()
    out = run.output()
    assert rc == 0, out[-4000:]
    rows = run.rows()
    lost, twice = _steps_check(rows, steps)
    assert (lost, twice) == (0, 0) and [r["step"] for r in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]
    want = Counter(f["service"] for f in injected)
    got = Counter(f["service"] for f in run.faults())
    assert got == want, (got, want)  # one respawn per injected fault, none other
    last = rows[-1]
    for s in SERVICES:
        assert last[f"restarts_{s}"] == want.get(s, 0), (s, last)
    assert last["policy_version"] == steps and all(r["staleness_max"] <= 1 for r in rows)
    assert out.count("respawned and back in") == len(injected)
    for role in ("generator", "reference"):  # dtype auto: probed at the start only, a respawn keeps the result
        assert out.count(f"[forge] {role}: dtype auto ->") == 1, role
    print(f"\n[chaos] {label}: {len(injected)} faults in {run.seconds:.0f} s: " + ", ".join(
        f"{f['signal'][3:].lower()} {f['service']} @step {f['at_step']} -> {f['recover_s']:.1f} s" for f in injected))
    return lost, twice


def test_kill_services_at_random_points(tmp_path):
    """One run with a kill -9 of every service at seeded random points (in a seeded order), a second
    kill of one of them (its respawned process) after its first, and a stop of the generator
    (SIGSTOP: a hang; its calls have the most deadlines: generate, weight loads) at a random position
    among the kills. Each fault is respawned, no step lost or repeated, counters exact."""
    rng = random.Random(SEED * 10)
    services = list(SERVICES)
    rng.shuffle(services)
    again = rng.randrange(len(services))
    services.insert(rng.randint(again + 1, len(services)), services[again])
    hang_at = rng.randrange(len(services) + 1)
    services.insert(hang_at, "generator")
    sig = {hang_at: signal.SIGSTOP}
    plan = _plan(rng, services, first=2, gap=2)
    # every service is called again after the last fault, even when each recovery lets the run move
    # on by up to four steps before the next fault goes in (a tiny step takes well under a second,
    # and the next batch may already be generated while the previous is being scored)
    steps = plan[-1][0] + 4 + 4 * len(plan)
    run = Run(tmp_path, "kill", [f"steps={steps}", "fault.max_restarts=10", *FAST_FAULTS])
    try:
        injected = _inject(run, plan, sig)
        pids = [run.pid(s) for s in (*SERVICES, "trainer", "replay_buffer")] + [f["pid"] for f in injected]
        lost, twice = _check_survivor(run, steps, injected, f"{len(plan)} faults ({steps} steps)")
    finally:
        run.kill()
    assert not _shm_left(pids), _shm_left(pids)  # the trainer's staging buffer, killed processes' buffers
    for f in injected:
        fault = "hang (SIGSTOP) " + f["service"] if f["signal"] == "SIGSTOP" else "kill -9 " + f["service"]
        RESULTS.append({"fault": fault, "run": run.dir, "survived": True, "lost": lost, "repeated": twice,
                        "recover_s": [f["recover_s"]], "wall_s": [f["wall_s"]]})


MULTI_TURN = ["env.fn=skyrl_gym.envs.gsm8k.multi_turn_env:GSM8kMultiTurnEnv", "env.max_turns=2", "env.max_turn_tokens=12",
              "generator.max_response_tokens=80", "reward.fn=none"]


def test_generator_killed_in_the_middle_of_a_conversation(tmp_path):
    """Multi-turn episodes (two turns each: the tiny model never answers right): kill -9 of the
    generator at two seeded random points while it rolls out a batch's conversations. The respawned
    replica generates the batch's groups again from their first turn; no step is lost or trained twice
    (every batch hash differs), and every trained episode has both turns."""
    rng = random.Random(SEED * 10 + 7)
    plan = _plan(rng, ["generator", "generator"], first=2, gap=2)
    steps = plan[-1][0] + 4 + 4 * len(plan)
    run = Run(tmp_path, "multiturn", [f"steps={steps}", "fault.max_restarts=10", *FAST_FAULTS, *MULTI_TURN])
    try:
        injected = _inject(run, plan, {})
        lost, twice = _check_survivor(run, steps, injected, f"multi-turn ({steps} steps)")
        rows = run.rows()
        assert len({r["batch_hash"] for r in rows}) == len(rows) and all(r["turns_mean"] > 1.5 for r in rows)
    finally:
        run.kill()
    RESULTS.append({"fault": "kill -9 generator, multi-turn", "run": run.dir, "survived": True, "lost": lost,
                    "repeated": twice, "recover_s": [f["recover_s"] for f in injected],
                    "wall_s": [f["wall_s"] for f in injected]})


def test_max_restarts_exhausted_stops_naming_the_actor(tmp_path):
    """Bad input: fault.max_restarts=1 and two kills of the reward: the CLI exits non-zero naming the
    actor and its last error; metrics and checkpoints stay intact; no actor process is left."""
    run = Run(tmp_path, "exhaust", ["steps=30", "checkpoint.every=1", "checkpoint.keep=2", "fault.max_restarts=1",
                                    *FAST_FAULTS])
    try:
        first = _inject(run, [(2, "reward", 0.3)], {})
        run.wait_for("step 3", lambda: len(run.rows()) >= 3)
        pids = [run.pid(s) for s in ("generator", "reward", "reference", "trainer", "replay_buffer")]
        os.kill(run.pid("reward"), signal.SIGKILL)
        rc = run.finish(timeout=120)
    finally:
        run.kill()
    out = run.output()
    assert rc == 1, out[-3000:]
    err = [l for l in out.splitlines() if l.startswith("error:")]
    assert err and "actor 'reward' failed 2 times" in err[0] and "fault.max_restarts=1" in err[0], out[-3000:]
    # the second kill is seen as the process's death or, on a loaded machine, as the call's missed deadline
    assert re.search(r"last error: actor 'reward' (failed|did not answer)", err[0]), out[-3000:]
    assert "Killed(sig=9)" in out, out[-3000:]
    assert "checkpoints and metrics written so far are intact" in out
    rows = run.rows()
    assert len(rows) >= 3 and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert [f["service"] for f in run.faults()] == ["reward"]  # the second failure is not a respawn
    ckpts = checkpoint.complete(os.path.join(run.dir, "checkpoints"))
    assert ckpts and all(checkpoint.verify(c) is None and checkpoint.has_manifest(c) for c in ckpts)
    assert int(os.path.basename(ckpts[-1])[5:]) >= 3
    time.sleep(2)
    assert all(_dead(p) for p in pids), [p for p in pids if not _dead(p)]  # no orphan actor process
    RESULTS.append({"fault": "max_restarts exhausted (bad input)", "run": run.dir, "survived": True, "lost": 0,
                    "repeated": 0, "recover_s": [first[0]["recover_s"]], "wall_s": [first[0]["wall_s"]]})


# ---- the trainer and the replay buffer: back to a checkpoint, the same steps again --------------------

LEN_REWARD = '''
"""Chaos test reward: the response's length mod 7, over 7, so a group's rewards differ and every step has a
loss that is not 0 (what the comparison of a recovered run with an uninterrupted one needs)."""


def score(response, example):
    return (len(response) % 7) / 7
'''
# fully on-policy: no batch is generated ahead of a checkpoint, so a run taken back to one makes the same batches
# (and a shorter deadline per token: a stopped trainer is found in 12 s, not 21)
RECOVERY = ["max_staleness=0", "reward.fn=chaos_len_reward:score", *FAST_FAULTS, "fault.timeout_per_token_s=0.002"]
RECOVERY_STEPS = 14


@pytest.fixture(scope="module")
def reward_mod(tmp_path_factory) -> str:
    """A directory holding the chaos_len_reward module (for PYTHONPATH)."""
    mod = tmp_path_factory.mktemp("mod")
    (mod / "chaos_len_reward.py").write_text(LEN_REWARD)
    return str(mod)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, reward_mod) -> list[dict]:
    """The metrics rows of an undisturbed run with the recovery test's settings."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run = Run(tmp, "whole", [f"steps={RECOVERY_STEPS}", "checkpoint.every=2", *RECOVERY], pythonpath=reward_mod)
    assert run.finish() == 0, run.output()[-4000:]
    rows = run.rows()
    assert [r["step"] for r in rows] == list(range(1, RECOVERY_STEPS + 1))
    assert all(r["loss"] != 0.0 for r in rows), [r["loss"] for r in rows]
    return rows


def test_trainer_and_replay_buffer_recover_to_the_same_steps(tmp_path, reward_mod, uninterrupted):
    """kill -9 and SIGSTOP (a hang past its deadline) of the trainer and of the replay buffer at seeded
    random points, in a seeded order, then a kill -9 of the trainer with the newest checkpoint truncated:
    each fault respawns the actor and takes the run back to the newest checkpoint that verifies (the one
    before the damaged one, named in a warning). Every step's batch hash and loss equal the
    uninterrupted run's; restarts_trainer and restarts_replay_buffer count the faults."""
    rng = random.Random(SEED * 10 + 11)
    faults = [("trainer", signal.SIGKILL), ("replay_buffer", signal.SIGKILL), ("trainer", signal.SIGSTOP),
              ("replay_buffer", signal.SIGSTOP)]
    rng.shuffle(faults)
    faults.append(("trainer", signal.SIGKILL))  # the newest checkpoint damaged first
    plan = _plan(rng, [f for f, _ in faults], first=2, gap=2)
    assert plan[-1][0] + 2 <= RECOVERY_STEPS
    sig = {i: s for i, (_, s) in enumerate(faults)}
    run = Run(tmp_path, "recover", [f"steps={RECOVERY_STEPS}", "checkpoint.every=2", "fault.max_restarts=10",
                                    *RECOVERY], pythonpath=reward_mod)
    try:
        injected = _inject(run, plan, sig, damage=(len(plan) - 1,))
        pids = [run.pid(s) for s in (*SERVICES, "trainer", "replay_buffer")] + [f["pid"] for f in injected]
        lost, twice = _check_survivor(run, RECOVERY_STEPS, injected, f"trainer and replay buffer ({RECOVERY_STEPS} steps)")
    finally:
        run.kill()
    assert not _shm_left(pids), _shm_left(pids)
    rows, out = run.rows(), run.output()
    assert rows[-1]["restarts_trainer"] == 3 and rows[-1]["restarts_replay_buffer"] == 2, rows[-1]
    for f in injected:
        rec = f["record"]
        assert 0 <= rec["rollback_to"] <= rec["rollback_to"] + rec["steps_recomputed"] <= RECOVERY_STEPS, rec
        assert rec["checkpoint"] == "" or rec["checkpoint"].endswith(f"step_{rec['rollback_to']:06d}"), rec
    damaged = injected[-1]["damaged"]
    assert injected[-1]["record"]["checkpoint"] not in ("", damaged), (damaged, injected[-1]["record"])
    assert f"checkpoint {damaged} is damaged (model.safetensors has" in out and "falling back to the one before it" in out
    different = [(a["step"], a["loss"], b["loss"]) for a, b in zip(uninterrupted, rows)
                 if (a["batch_hash"], a["loss"]) != (b["batch_hash"], b["loss"])]
    assert not different, different
    for f in injected:
        what = f"{'hang (SIGSTOP)' if f['signal'] == 'SIGSTOP' else 'kill -9'} {f['service']}"
        RESULTS.append({"fault": what + (", newest checkpoint damaged" if f["damaged"] else ""), "run": run.dir,
                        "survived": True, "lost": lost, "repeated": twice, "recover_s": [f["recover_s"]],
                        "wall_s": [f["wall_s"]], "recomputed": f["record"]["steps_recomputed"], "equal": not different})


def test_both_checkpoints_damaged_at_recovery_ends_the_run_naming_both(tmp_path, reward_mod):
    """Bad input: the trainer dies while its two checkpoints are both truncated: the run cannot go back
    to either and stops (exit 1) naming both; the rows logged so far stay; no actor process is left."""
    run = Run(tmp_path, "bothbad", ["steps=40", "checkpoint.every=1", *RECOVERY], pythonpath=reward_mod)
    try:
        run.wait_for("step 3", lambda: len(run.rows()) >= 3)
        pids = [run.pid(s) for s in (*SERVICES, "trainer", "replay_buffer")]
        os.kill(run.pid("trainer"), signal.SIGSTOP)
        time.sleep(1.0)
        both = checkpoint.complete(os.path.join(run.dir, "checkpoints"))[-2:]
        for c in both:
            os.truncate(os.path.join(c, "optimizer.rank0.pt"), 100)
        os.kill(run.pid("trainer"), signal.SIGKILL)
        rc = run.finish(timeout=120)
    finally:
        run.kill()
    out = run.output()
    assert rc == 1, out[-3000:]
    err = [l for l in out.splitlines() if l.startswith("error:")]
    assert err and "the trainer failed and no checkpoint to go back to can be used" in err[0], out[-3000:]
    assert all(f"{c} (optimizer.rank0.pt has 100 bytes" in err[0] for c in both), err[0]
    rows = run.rows()
    assert len(rows) >= 3 and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    time.sleep(2)
    assert all(_dead(p) for p in pids), [p for p in pids if not _dead(p)]
    RESULTS.append({"fault": "trainer killed, both checkpoints damaged (bad input)", "run": run.dir, "survived": True, "lost": 0,
                    "repeated": 0})


def test_a_replica_whose_restarts_are_used_up_is_dropped(tmp_path):
    """Two generator replicas, fault.max_restarts=0 and fault.min_replicas=1: a kill -9 of one replica
    drops it (faults.jsonl: dropped, replicas_left 1; no respawn) and the other one generates every
    batch after it, so the run logs every step once."""
    run = Run(tmp_path, "drop", ["steps=8", "layout.generator.replicas=2", "fault.max_restarts=0",
                                 "fault.min_replicas=1", *FAST_FAULTS])
    try:
        run.wait_for("step 2", lambda: len(run.rows()) >= 2)
        time.sleep(random.Random(SEED).uniform(0.0, 1.0))
        pid, t0 = run.pid("generator_1"), time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        run.wait_for("the replica dropped", lambda: len(run.faults()) == 1)
        wall = time.perf_counter() - t0
        rc = run.finish()
    finally:
        run.kill()
    out = run.output()
    assert rc == 0, out[-4000:]
    (rec,) = run.faults()
    assert rec["service"] == "generator_1" and rec["dropped"] and rec["replicas_left"] == 1, rec
    assert "generator_1 failed" in out and "dropped: 1 replica(s) go on (fault.min_replicas=1)" in out
    rows = run.rows()
    assert [r["step"] for r in rows] == list(range(1, 9)) and rows[-1]["restarts_generator"] == 0
    assert all(r["gen_replicas"] == 1 for r in rows if r["step"] > rec["step"] + 1), [r["gen_replicas"] for r in rows]
    RESULTS.append({"fault": "kill -9 of 1 of 2 replicas, restarts used up", "run": run.dir, "survived": True,
                    "lost": _steps_check(rows, 8)[0], "repeated": _steps_check(rows, 8)[1], "recover_s": [],
                    "wall_s": [wall]})


# ---- NaN loss, damaged checkpoints -----------------------------------------------------------------

NAN_REWARD = '''
"""Chaos test reward: the built-in gsm8k reward, plus 1e39 for the 10th call ever (the run's check
before it starts, then the 1st episode of batch 2; counted in a file beside this module, so a respawned
reward actor does not reset the count). 1e39 is a finite float (the reward passes the reward checks)
beyond float32's range: the advantages overflow to inf and the loss of that batch is not finite."""
import fcntl
import os

from forge_core.rewards import RewardConfig, gsm8k_components

COUNT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scored.count")


def nan_once(response, example):
    with open(COUNT, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = int(f.read() or 0) + 1
        f.seek(0)
        f.truncate()
        f.write(str(n))
    return dict(gsm8k_components(response, example, RewardConfig()), overflow=1e39 if n == 10 else 0.0)
'''


def test_nan_loss_then_damaged_checkpoints_on_resume(tmp_path):
    """1) A reward beyond float32 for one episode (batch 2) makes the loss not finite: the trainer skips that step:
    skipped_batches == 1, steps 1..3 logged once. 2) The newest checkpoint (step 3) is truncated and
    the one before (step 2) loses its manifest: the rerun to 4 steps falls back to step 2 with a
    warning naming each, and logs steps 1..4 exactly once (step 3 trained again)."""
    mod = tmp_path / "mod"
    mod.mkdir()
    (mod / "chaos_nan_reward.py").write_text(NAN_REWARD)
    args = ["checkpoint.every=1", "checkpoint.keep=3", "reward.fn=chaos_nan_reward:nan_once", *FAST_FAULTS]
    run = Run(tmp_path, "nan", ["steps=3", *args], pythonpath=str(mod))
    rc = run.finish()
    out = run.output()
    assert rc == 0, out[-4000:]
    rows = run.rows()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["skipped_batches"] for r in rows] == [0, 1, 1], [r["skipped_batches"] for r in rows]
    assert "step 2: non-finite loss" in out and "optimizer step skipped" in out
    assert all(r["loss"] == r["loss"] and r["reward_mean"] == r["reward_mean"] for r in rows)  # trained batches: finite
    assert int((mod / "scored.count").read_text()) >= 10
    RESULTS.append({"fault": "NaN loss (a reward beyond float32, one episode)", "run": run.dir, "survived": True,
                    "lost": _steps_check(rows, 3)[0], "repeated": _steps_check(rows, 3)[1]})

    root = os.path.join(run.dir, "checkpoints")
    ckpts = [os.path.basename(c) for c in checkpoint.complete(root)]
    assert ckpts == ["step_000001", "step_000002", "step_000003"]
    newest = os.path.join(root, "step_000003", "model.safetensors")
    os.truncate(newest, os.path.getsize(newest) // 2)
    os.remove(os.path.join(root, "step_000002", "manifest.json"))
    before = rows
    run = Run(tmp_path, "nan", ["steps=4", *args], pythonpath=str(mod))
    rc = run.finish()
    out = run.output()
    assert rc == 0, out[-4000:]
    warnings = [l for l in out.splitlines() if l.startswith("[forge] warning: checkpoint")]
    assert any("step_000003 is damaged (model.safetensors has" in w and "falling back" in w for w in warnings), warnings
    assert any("step_000002 has no manifest" in w and "without verifying" in w for w in warnings), warnings
    rows = run.rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[:2] == before[:2]  # kept from the first run: it resumed from step 2 ...
    assert rows[2]["startup_s"] != before[2]["startup_s"]  # ... and trained step 3 again
    assert rows[-1]["policy_version"] == 4
    assert [r["skipped_batches"] for r in rows] == [0, 1, 1, 1]  # the counter goes on from the checkpoint
    assert checkpoint.verify(os.path.join(root, "step_000004")) is None
    lost, twice = _steps_check(rows, 4)
    assert (lost, twice) == (0, 0)
    for fault in ("truncated newest checkpoint", "checkpoint without manifest"):
        RESULTS.append({"fault": fault + " (resume)", "run": run.dir, "survived": True, "lost": lost,
                        "repeated": twice + 1})  # step 3 trained twice


# ---- a full disk during a save -----------------------------------------------------------------------

def test_full_disk_during_checkpoint(tmp_path):
    """output_dir on a 64 MB tmpfs: the step-1 checkpoint (~39 MB: fp32 weights + AdamW state)
    fits, the next ones cannot: the run goes on, counts checkpoint_failures, says the previous
    checkpoint is intact, and that checkpoint still verifies."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root and mount (a small tmpfs)")
    disk = tmp_path / "disk"
    disk.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip()}")
    try:
        run = Run(tmp_path, "disk", ["steps=3", "checkpoint.every=1", "checkpoint.keep=3", *FAST_FAULTS], out_dir=disk)
        rc = run.finish()
        out = run.output()
        assert rc == 0, out[-4000:]
        rows = run.rows()
        assert [r["step"] for r in rows] == [1, 2, 3]
        # step 2's failed after row 2 was logged, seen before or after row 3 (its write is in the background)
        assert [r["checkpoint_failures"] for r in rows][:2] == [0, 0] and rows[2]["checkpoint_failures"] <= 1
        root = os.path.join(run.dir, "checkpoints")
        assert sorted(os.listdir(root)) == ["step_000001"]  # no half-written .tmp left
        assert checkpoint.verify(os.path.join(root, "step_000001")) is None
        warn = [l[l.index("[forge] warning: checkpoint at step"):] for l in out.splitlines()
                if "[forge] warning: checkpoint at step" in l]  # after the progress bar's text
        assert len(warn) == 2 and warn[0].startswith("[forge] warning: checkpoint at step 2 not written: the disk "
                                                     "is full ("), out[-3000:]
        assert "No space left on device" in warn[0], warn
        assert warn[0].endswith(f"the previous checkpoint {root}/step_000001 is intact"), warn
        assert os.path.isfile(os.path.join(run.dir, "final", "model.safetensors"))
        RESULTS.append({"fault": "full disk during checkpoint save", "run": run.dir, "survived": True, "lost": 0,
                        "repeated": 0})
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_skipped_step_keeps_the_staleness_bound(tmp_path):
    """A dropped batch must not shift the rollout gate: with ``max_staleness=0`` the batch made
    after it is the next step's, so a replica at the trainer's version may generate it (the gate
    counted batches, not steps, and waited for a version only that batch could produce: the run
    hung). Fully on-policy after the skip: staleness 0 on every step."""
    mod = tmp_path / "mod"
    mod.mkdir()
    (mod / "chaos_nan_reward.py").write_text(NAN_REWARD)
    run = Run(tmp_path, "nan0", ["steps=3", "max_staleness=0", "checkpoint.every=0",
                                 "reward.fn=chaos_nan_reward:nan_once", *FAST_FAULTS], pythonpath=str(mod))
    rc = run.finish(timeout=240)
    out = run.output()
    assert rc == 0, out[-4000:]
    rows = run.rows()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["skipped_batches"] for r in rows] == [0, 1, 1]
    assert all(r["staleness_max"] == 0 for r in rows), [r["staleness_max"] for r in rows]


# ---- the trainer's non-finite guard, through the real actor ------------------------------------------

def test_trainer_skips_a_non_finite_step(tmp_path):
    """The non-finite guard through the real actor; then its checkpoint loads back, and one of an older
    trainer or of another number of ranks is refused, saying why."""
    from forge_core.episode import Episode
    from forge_core.layout import plan_layout
    from forge_core.services import ActorFailed, call, spawn_service

    cfg = load_config("smollm2_135m", TINY)
    g = torch.Generator().manual_seed(0)

    def episodes(adv: list) -> list:
        out = []
        for i, a in enumerate(adv):
            P, R = 5 + i % 3, 4 + i % 5
            lp = (-torch.rand(R, generator=g) * 3).tolist()
            out.append(Episode(prompt_id=f"p{i // 4}", group=i // 4, target="1",
                               prompt_ids=torch.randint(3, 1000, (P,), generator=g).tolist(),
                               response_ids=torch.randint(3, 1000, (R,), generator=g).tolist(),
                               behaviour_logprobs=lp, text="", policy_version=0, ref_logprobs=lp, advantage=a))
        return out

    async def go():
        plan = plan_layout(cfg)
        t = await spawn_service(cfg, "trainer", plan.trainer, plan)
        try:
            w0 = await call("trainer", t.state_dict)
            bad = episodes([1.0, -1.0, float("nan"), 0.5, -0.5, 1.0, -1.0, 0.0])
            m = await call("trainer", t.train_step, bad)
            assert m["skipped"] == 1.0 and m["version"] == 0, m
            assert await call("trainer", t.get_version) == 0
            w1 = await call("trainer", t.state_dict)
            assert w1.keys() == w0.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)  # bit-identical
            m = await call("trainer", t.train_step, episodes([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25]))
            assert m["skipped"] == 0.0 and m["version"] == 1 and m["loss"] == m["loss"], m
            assert 0 < m["grad_norm"] < float("inf")
            w2 = await call("trainer", t.state_dict)
            assert all(torch.isfinite(v).all() for v in w2.values())
            assert sum(not torch.equal(w0[k], w2[k]) for k in w0) == len(w0)  # AdamW moved every tensor
            ckpt = str(tmp_path / "step_000001")
            os.makedirs(ckpt)
            assert await call("trainer", t.save, ckpt) > 0
            staged = str(tmp_path / "staged")  # the same files, written by the trainer's thread after the call
            await call("trainer", t.save, staged, True, "float32", True)
            while (write_s := await call("trainer", t.saved)) is None:
                await asyncio.sleep(0.05)
            assert write_s > 0 and sorted(os.listdir(staged)) == sorted(os.listdir(ckpt))
            for name in os.listdir(ckpt):
                with open(os.path.join(ckpt, name), "rb") as a, open(os.path.join(staged, name), "rb") as b:
                    assert a.read() == b.read(), name
            assert await call("trainer", t.load, ckpt) == 1
            os.rename(os.path.join(ckpt, "optimizer.rank0.pt"), os.path.join(ckpt, "optimizer.pt"))  # older format
            with pytest.raises(ActorFailed, match="no optimizer.rank<r>.pt .* cannot be resumed"):
                await call("trainer", t.load, ckpt)
            for r in (0, 1):  # two ranks' state, this trainer has one
                shutil.copy(os.path.join(ckpt, "optimizer.pt"), os.path.join(ckpt, f"optimizer.rank{r}.pt"))
            with pytest.raises(ActorFailed, match="optimizer state of 2 trainer rank.*has 1: resume with the "
                                                  "layout.trainer.gpus"):
                await call("trainer", t.load, ckpt)
        finally:
            await t.stop()

    asyncio.run(go())


# A sitecustomize for every process of a run: the generator's constructor sleeps (a hung model load).
HUNG_GENERATOR = '''
import importlib.abc, importlib.machinery, sys, time


class HangGenerator(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "forge_core.actors.generator":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.Generator.__init__ = lambda self, *a, **k: time.sleep(3600)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, HangGenerator())
'''


def test_an_actor_that_never_starts_stops_the_run_naming_it(tmp_path):
    """The generator's constructor hangs: the run stops at fault.startup_timeout_s with an error
    naming the actor and the key (it used to wait forever), and writes no metrics."""
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "sitecustomize.py").write_text(HUNG_GENERATOR)
    run = Run(tmp_path, "nostart", ["steps=2", "fault.startup_timeout_s=20"], pythonpath=str(tmp_path / "mod"))
    try:
        rc = run.finish(timeout=240)
    finally:
        run.kill()
    out = run.output()
    assert rc == 1, out[-3000:]
    err = [l for l in out.splitlines() if l.startswith("error:")]
    assert err and "actor 'generator' did not answer within 20 s" in err[0], out[-3000:]
    assert "at startup: fault.startup_timeout_s=20" in err[0] and "Traceback" not in out, out[-3000:]
    assert not os.path.exists(os.path.join(run.dir, "metrics.jsonl"))
