"""Test data: the real GSM8K copy when ``GSM8K_DIR`` names one (CI: ``../shared/data/gsm8k``);
otherwise a small synthetic set in GSM8K's own JSONL format, so a clone without the shared data
still runs every test end to end (the tests use a random tiny model and do not need real questions).
Also the shared skip conditions of the SLURM dev-cluster tests (``slurm_dev_prereqs``)."""

import json
import os
import random
import shutil
import tempfile

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
