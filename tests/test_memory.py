"""The memory estimate of a layout (forge_core/memory.py) and its refusals: the arithmetic of the
trainer's state (16 bytes a parameter, FSDP2-sharded; LoRA's bf16 base), Qwen3-8B's full fine-tune on
2 against 3 trainer GPUs of an H100, every recipe's layout on each GPU its sky.yaml names, a run
refused before anything is written when the GPUs' free memory is short (the measured GPUs stood in),
and ``make check``'s report and refusal."""

import os

import pytest

from forge_core import memory
from forge_core.config import load_config, recipe_dir
from forge_core.models import hf_config_dict
from forge_core.titan_spec import hf_layout
from helpers import ROOT, cli_here

H100 = memory.GPU_MEMORY["H100"]


def _params(model: str) -> int:
    return sum(k for *_, k in hf_layout(hf_config_dict(model)))


def _trainer_gpus(ests):
    return [e for e in ests if any(w.startswith("trainer") for w in e.who)]


def test_the_full_fine_tunes_state_is_16_bytes_a_parameter_sharded_and_loras_base_2():
    """Qwen3-8B's full fine-tune over 2 trainer GPUs: fp32 weights + AdamW (12 bytes) and gradients (4)
    are 16 x P / 2 per GPU, rank 0 adds the bf16 staging buffer (2 P); with LoRA on one GPU the frozen
    base is 2 P (bf16, the GPU compute dtype), 4 P with ``trainer.compute_dtype=float32``."""
    P = _params("qwen3_8b")
    ests = _trainer_gpus(memory.estimate(load_config("qwen3_8b", ["layout.trainer.gpus=2"]), H100))
    assert len(ests) == 2
    for e in ests:
        assert e.resident["trainer weights + AdamW"] + e.step["gradients"] == pytest.approx(16 * P / 2)
    assert ests[0].resident["weight-sync staging"] == 2 * P and "weight-sync staging" not in ests[1].resident
    (lo,) = memory.estimate(load_config("qwen3_8b_lora"), H100)
    (lo32,) = memory.estimate(load_config("qwen3_8b_lora", ["trainer.compute_dtype=float32"]), H100)
    assert lo.resident["LoRA frozen base"] == 2 * P and lo32.resident["LoRA frozen base"] == 4 * P
    assert lo.alternate and lo.engine_frac == 0.3 and "reference" not in lo.resident  # the trainer's base
    assert lo.need(H100) == pytest.approx(sum(lo.resident.values()) + 0.3 * H100)  # asleep while it steps


@pytest.mark.parametrize("gpus,fits", [(2, False), (3, True)])
def test_qwen3_8b_full_fine_tune_on_h100s_needs_3_trainer_gpus(gpus, fits):
    """8B parameters x 16 bytes over 2 GPUs (61 GiB) + the 15 GiB staging buffer and the reference's
    share do not fit an H100; over 3 they do. The refusal names the GPU, the estimate and the setting."""
    cfg = load_config("qwen3_8b", [f"layout.trainer.gpus={gpus}"])
    _, refusals = memory.report(cfg, {"H100": H100})
    assert (not refusals) == fits, refusals
    if not fits:
        assert all(l.startswith("GPU ") and "H100, 79.2 GiB" in l and "needs an estimated" in l
                   and "layout.trainer.gpus" in l for l in refusals)


RECIPES = sorted(n for n in os.listdir(ROOT / "recipes") if os.path.isfile(ROOT / "recipes" / n / "config.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipes_layout_fits_the_gpus_its_sky_yaml_names(recipe):
    """A GPU recipe names, in its sky.yaml, GPUs of a known size, and its layout fits each of them."""
    from launch.local import sky_accelerators

    cfg = load_config(recipe)
    if cfg.device != "cuda":
        assert memory.estimate(cfg) == []
        return
    named = sky_accelerators(recipe_dir(recipe))
    assert named and all(n in memory.GPU_MEMORY for n in named), named
    lines, refusals = memory.report(cfg, {n: memory.GPU_MEMORY[n] for n in named})
    assert lines and not refusals, refusals


def test_a_run_whose_gpus_lack_the_free_memory_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """qwen3_8b_lora on one H100 of which another process holds 60 GiB: the controller refuses it,
    naming the GPU, the estimate, the free memory and the setting, before any actor starts or any
    file is written; with the H100 free it passes (``check_free`` is None)."""
    import asyncio

    from forge_core.controller import Controller, RunFailed

    cfg = load_config("qwen3_8b_lora", [f"output_dir={tmp_path}", "run_id=r"])
    name = "NVIDIA H100 80GB HBM3"
    assert memory.check_free(cfg, [(name, H100, H100)]) is None
    monkeypatch.setattr(memory, "gpu_memory", lambda: [(name, H100 - 60 * memory.GIB, H100)])
    with pytest.raises(RunFailed) as e:
        asyncio.run(Controller(cfg, str(tmp_path / "r")).run())
    msg = str(e.value)
    assert f"GPU 0 of node 0 ({name}, 79.2 GiB, 19.2 GiB free) needs an estimated" in msg, msg
    assert "generator.gpu_memory_utilization" in msg and not (tmp_path / "r").exists()


def test_make_check_prints_the_estimate_and_refuses_a_gpu_too_small():
    """``make check``: the estimate per GPU on stderr; ``--gpu H100`` refuses Qwen3-8B's full fine-tune on
    2 trainer GPUs (exit 2) naming the setting; a size in GiB works; an unknown GPU name is named."""
    r = cli_here("check", "qwen3_8b_lora")
    assert r.returncode == 0 and "memory estimate per GPU" in r.stderr and "fits H100 and H200" in r.stderr, r.stderr
    r = cli_here("check", "qwen3_8b", "layout.trainer.gpus=2", "--gpu", "H100")
    assert r.returncode == 2 and "the layout does not fit" in r.stderr and "layout.trainer.gpus" in r.stderr, r.stderr
    assert cli_here("check", "qwen3_8b", "layout.trainer.gpus=3", "--gpu", "79").returncode == 0
    r = cli_here("check", "qwen3_8b", "--gpu", "H900")
    assert r.returncode == 2 and "--gpu H900" in r.stderr, r.stderr
