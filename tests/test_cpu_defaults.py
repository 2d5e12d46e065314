"""The embedded default on an ordinary CPU: ``dtype: auto`` picks the faster of bf16 and fp32 from a
matmul probe in each actor process; an explicit dtype is never overridden; GPUs keep bf16."""

import pytest
import torch

from forge_core.actors.process import matmul_probe, resolve_dtype
from forge_core.config import load_config


def test_auto_takes_float32_where_bf16_is_slower(capsys):
    assert resolve_dtype("auto", "cpu", 576, "generator", probe=lambda h: (0.060, 0.001)) == torch.float32
    out = capsys.readouterr().out
    assert "generator: dtype auto -> float32" in out and "bf16 60.00 ms" in out and "fp32 1.00 ms" in out


def test_auto_takes_bfloat16_where_it_is_at_least_as_fast(capsys):
    assert resolve_dtype("auto", "cpu", 576, "trainer", probe=lambda h: (0.001, 0.002)) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", 576, "trainer", probe=lambda h: (0.002, 0.002)) == torch.bfloat16
    assert "trainer: dtype auto -> bfloat16" in capsys.readouterr().out


def test_explicit_dtype_is_never_overridden():
    never = lambda h: pytest.fail("the probe must not run for an explicit dtype")  # noqa: E731
    assert resolve_dtype("bfloat16", "cpu", 576, "x", probe=never) == torch.bfloat16
    assert resolve_dtype("float32", "cpu", 576, "x", probe=never) == torch.float32
    assert resolve_dtype("auto", "cuda", 576, "x", probe=never) == torch.bfloat16  # GPUs keep bf16
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16", "cpu", 576, "x")


def test_the_probe_measures_both_dtypes():
    t16, t32 = matmul_probe(64, rows=8, reps=2)
    assert t16 > 0 and t32 > 0


def test_auto_is_the_default_and_a_config_choice():
    cfg = load_config("smollm2_135m")
    assert cfg.generator.dtype == "auto" and cfg.trainer.compute_dtype == "auto"
    assert load_config("smollm2_135m", ["generator.dtype=float32"]).generator.dtype == "float32"
