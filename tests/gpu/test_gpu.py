"""GPU tests (marker ``gpu``): the checks of :mod:`benchmarks.gpu_check` through real actors.
Skipped, with the reason, on machines without a CUDA GPU or without vLLM (the GPU extra)."""

import asyncio
import importlib.util
import os

import pytest
import torch

GSM8K_DIR = os.environ.get("GSM8K_DIR", "")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (GPU path: vLLM + TorchTitan)"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM 0.26.0 (pip install '.[gpu]')"),
    pytest.mark.skipif(not os.path.isdir(GSM8K_DIR), reason="GSM8K_DIR must name a local GSM8K copy"),
]


@pytest.mark.parametrize("gpus", [1, 2])
def test_gpu_actors_sync_bitwise_and_train(gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}")
    from benchmarks.gpu_check import run_checks

    res = asyncio.run(run_checks("smollm2_135m", gpus, GSM8K_DIR))
    failed = [(n, d) for n, ok, d in res if not ok]
    assert not failed, failed
