"""Test data: the real GSM8K copy when ``GSM8K_DIR`` names one (CI: ``../shared/data/gsm8k``);
otherwise a small synthetic set in GSM8K's own JSONL format, so a clone without the shared data
still runs every test end to end (the tests use a random tiny model and do not need real questions).
Also the shared skip conditions of the SLURM dev-cluster tests (``slurm_dev_prereqs``), and the
grouping of the tests that use this machine's one-of-a-kind resources for pytest-xdist."""

import ast
import fcntl
import json
import os
import random
import re
import shutil
import tempfile
import time
from functools import cache
from typing import Optional

import pytest


def _synthetic_gsm8k() -> str:
    d = tempfile.mkdtemp(prefix="forge-gsm8k-")
    rng = random.Random(0)
    for split, n in (("train", 256), ("test", 64)):
        with open(os.path.join(d, f"{split}.jsonl"), "w") as f:
            for _ in range(n):
                a, b = rng.randint(2, 99), rng.randint(2, 99)
                f.write(json.dumps({"question": f"Sam has {a} apples and buys {b} more. How many apples does he have?",
                                    "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}) + "\n")
    return d


if os.path.isdir(os.environ.get("GSM8K_DIR", "")):
    # absolute: the tests' runs start in other directories (a SkyPilot node's home, SLURM jobs)
    os.environ["GSM8K_DIR"] = os.path.abspath(os.environ["GSM8K_DIR"])
else:
    os.environ["GSM8K_DIR"] = _synthetic_gsm8k()
    os.environ["FORGE_SYNTHETIC_GSM8K"] = "1"


@pytest.fixture(scope="session")
def slurm_dev_prereqs():
    """Skip unless the SLURM dev cluster (cluster/dev/up.sh) can start here: root, iproute2, and
    SLURM installed or installable with apt-get."""
    if os.geteuid() != 0:
        pytest.skip("needs root (starts slurmctld/slurmd and creates network namespaces)")
    if not shutil.which("ip"):
        pytest.skip("needs iproute2 (ip)")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("SLURM is not installed and apt-get is not available to install it")


# ---- pytest-xdist: what must not run twice at once -------------------------------------------------
# `make test` runs the suite on two workers (pytest -n 2 --dist loadgroup). The tests that use what
# this machine has only once go to one worker, one after another: the network namespaces fr-node*
# (cluster/dev/netns.sh; the dev cluster's up.sh and `netns.sh down` remove every one of them and
# kill what runs inside, SLURM's daemons included), the SLURM dev cluster (cluster/dev: slurmctld,
# /etc/slurm, /etc/hosts), SkyPilot's local state, fixed Monarch ports. A test module is one of
# them when its source names one of these (a new module that uses them joins by itself).
#
# The group is made by the scheduler below (``pytest_xdist_make_scheduler``), from each test's
# module: xdist's own ``xdist_group`` marks travel to its scheduler as a suffix of the test's node
# id, which pytest 9.2 no longer lets a plugin change: with pytest 9.2 and pytest-xdist 3.8 the marks
# are silently ignored and every test is scheduled alone
# (https://github.com/pytest-dev/pytest-xdist/issues/1386). The tests of a module that use one of its
# module-scoped fixtures (an end-to-end run several tests look at) are one unit of work too, so that
# the run is made once, on one worker (``shared_fixture_users``). A machine-wide module also holds a
# lock file while it runs (``machine_lock``): another pytest run on this machine (another checkout,
# or workers that do not group: ``--dist load``) waits for it instead of taking those resources away
# mid-test.
MACHINE_GROUP = "machine"
MACHINE_LOCK = os.path.join(tempfile.gettempdir(), "forge-recipes-machine-tests.lock")
MACHINE_WIDE = re.compile(r"netns|fr-node|cluster/dev|slurm_dev_prereqs|FORGE_MONARCH_PORT"
                          r"|^\s*(?:import|from) sky\b|importorskip\(\"sky\"", re.MULTILINE)


@cache
def uses_the_machine(path: str) -> bool:
    """Whether the test module at ``path`` names one of this machine's one-of-a-kind resources."""
    try:
        with open(path, encoding="utf-8") as f:
            return bool(MACHINE_WIDE.search(f.read()))
    except OSError:
        return False


def _shared_fixture(f: ast.FunctionDef) -> Optional[bool]:
    """None when ``f`` is no pytest fixture; else whether it outlives a test (module scope or wider)
    without being autouse."""
    for d in f.decorator_list:
        call = d if isinstance(d, ast.Call) else None
        target = call.func if call else d
        if (target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)) != "fixture":
            continue
        kw = {k.arg: k.value for k in (call.keywords if call else [])}
        scope = kw["scope"].value if isinstance(kw.get("scope"), ast.Constant) else "function"
        autouse = isinstance(kw.get("autouse"), ast.Constant) and kw["autouse"].value
        return scope not in ("function", "class") and not autouse
    return None


@cache
def shared_fixture_users(path: str) -> frozenset:
    """The names of the test functions of the module at ``path`` that use one of the module's own
    module-scoped fixtures (autouse ones aside), directly or through another fixture of the module."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return frozenset()
    funcs = [f for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    params = {f.name: {a.arg for a in f.args.args} for f in funcs}
    fixtures = {f.name: s for f in funcs if (s := _shared_fixture(f)) is not None}
    shared = {name for name, s in fixtures.items() if s}
    while grown := {n for n in fixtures if n not in shared and params[n] & shared}:
        shared |= grown
    return frozenset(f.name for f in funcs if f.name.startswith("test") and params[f.name] & shared)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: xdist's load-scope scheduling with every test its own unit of work but
    the machine-wide modules' tests, which are one (the largest unit, so it starts first), and the
    tests of a module that share one of its module-scoped fixtures (``shared_fixture_users``), one
    unit per module."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = str(config.rootpath)

    class MachineGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # an xdist_group suffix (where pytest keeps it)
                return nodeid.split("@")[-1]
            path = os.path.join(root, nodeid.split("::")[0])
            if uses_the_machine(path):
                return MACHINE_GROUP
            test = nodeid.split("::")[-1].split("[")[0]
            return f"{nodeid.split('::')[0]}::shared" if test in shared_fixture_users(path) else nodeid

    return MachineGroupScheduling(config, log)


@pytest.fixture(scope="module", autouse=True)
def machine_lock(request):
    """A machine-wide module (``uses_the_machine``) holds ``MACHINE_LOCK`` from the set-up of its
    first test to the teardown of its module fixtures (an autouse fixture is set up first in its scope,
    torn down last); the other modules pass through."""
    if not uses_the_machine(str(request.path)):
        yield
        return
    with open(MACHINE_LOCK, "a") as f:
        t0 = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX)
        if (waited := time.monotonic() - t0) > 1:
            print(f"\n[tests] {request.module.__name__}: waited {waited:.0f} s for {MACHINE_LOCK} (another test run)")
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
