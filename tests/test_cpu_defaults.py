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


def test_the_probe_times_bf16_then_fp32_of_the_named_shape(monkeypatch):
    """``matmul_probe`` returns ``(bf16 s, fp32 s)`` in that order, each the best of ``reps`` timings
    of one ``[rows, hidden] @ [hidden, hidden]`` matmul: a swapped pair would make ``auto`` take the
    slower dtype."""
    from forge_core.actors import process

    seen = []

    def repeat(fn, number, repeat):  # timeit.repeat: runs the timed call once, times by its dtype
        out = fn()
        seen.append((out.dtype, tuple(out.shape), number, repeat))
        unit = 0.001 if out.dtype == torch.bfloat16 else 0.002
        return [unit * (repeat + 1 - k) for k in range(repeat)]  # the best timing is the last one

    monkeypatch.setattr(process.timeit, "repeat", repeat)
    assert matmul_probe(64, rows=8, reps=3) == (0.002, 0.004)
    assert seen == [(torch.bfloat16, (8, 64), 1, 3), (torch.float32, (8, 64), 1, 3)]


def test_auto_on_this_cpu_takes_what_its_probe_measured(monkeypatch, capsys):
    """The real probe on this machine's CPU: ``auto`` takes bf16 exactly when the bf16 matmul was at
    least as fast as the fp32 one, prints both timings, and probes once per process and hidden size
    (a second actor role of that size reuses the choice, silently)."""
    from forge_core.actors import process

    measured = []
    probe = process.matmul_probe
    monkeypatch.setattr(process, "matmul_probe", lambda hidden: measured.append(probe(hidden)) or measured[-1])
    monkeypatch.setattr(process, "_PROBED", {})
    dt = resolve_dtype("auto", "cpu", 576, "generator")
    (t16, t32), = measured
    assert t16 > 0 and t32 > 0
    assert dt == (torch.bfloat16 if t16 <= t32 else torch.float32), (t16, t32, dt)
    name = str(dt).removeprefix("torch.")
    assert f"generator: dtype auto -> {name} (a 64x576 @ 576x576 matmul: bf16 {t16 * 1e3:.2f} ms, fp32 " \
           f"{t32 * 1e3:.2f} ms" in capsys.readouterr().out
    assert resolve_dtype("auto", "cpu", 576, "reference") == dt and len(measured) == 1
    assert capsys.readouterr().out == ""


def test_auto_is_the_default_and_a_config_choice():
    cfg = load_config("smollm2_135m")
    assert cfg.generator.dtype == "auto" and cfg.trainer.compute_dtype == "auto"
    assert load_config("smollm2_135m", ["generator.dtype=float32"]).generator.dtype == "float32"
