"""Where the actors go: the layout checks (each error names its keys), the colocated trainer's
arguments computed without TorchTitan in the controller, a TP generator replica as one process, and
GPU actors that pick their GPU before importing TorchTitan's models."""

import asyncio
import subprocess

import pytest
import torch

from forge_core.config import ConfigError, load_config
from helpers import PY, ROOT, TINY


def test_layout_errors_name_the_key():
    with pytest.raises(ConfigError) as e:  # 3 replicas + trainer + reference on a 3-GPU node
        load_config("qwen3_1_7b", ["layout.generator.replicas=3"])
    msg = str(e.value)
    assert "node 0 has 3 GPUs" in msg and "layout.gpus_per_node" in msg and "layout.generator.replicas" in msg, msg
    with pytest.raises(ConfigError, match=r"node 1 has 8 GPUs.*layout\.generator\.replicas x layout\.generator\.tp = 2 x 8"):
        load_config("llama3_8b", ["layout.generator.replicas=2", "layout.generator.tp=8"])  # 2 x tp 8 on node 1 (8 GPUs)
    with pytest.raises(ConfigError, match=r"layout\.generator\.tp=3 must divide the model's 16 attention heads"):
        load_config("qwen3_1_7b", ["layout.generator.tp=3", "layout.gpus_per_node=8"])
    with pytest.raises(ConfigError, match=r"layout\.generator\.host: node 1 is outside layout\.nodes=1"):
        load_config("smollm2_135m", ["layout.generator.host=1"])
    with pytest.raises(ConfigError, match=r"layout\.generator\.hosts: node 2 is outside layout\.nodes=2"):
        load_config("qwen3_1_7b", ["layout.nodes=2", "layout.generator.hosts=[0,2]", "layout.generator.replicas=2"])
    with pytest.raises(ConfigError, match=r"weight_sync\.transport=ipc") as e:
        load_config("smollm2_135m", ["layout.nodes=2", "layout.generator.host=1", "weight_sync.transport=ipc"])
    assert "node" in str(e.value)
    # what does fit passes
    load_config("smollm2_135m", ["layout.nodes=2", "layout.generator.host=1"])
    load_config("qwen3_1_7b", ["layout.gpus_per_node=8", "layout.generator.replicas=3", "layout.generator.tp=2"])
    load_config("smollm2_135m", ["layout.generator.replicas=3"])  # CPU: no GPU count


def test_colocated_trainer_kwargs_import_no_torchtitan_in_the_controller():
    """One GPU for all (colocated, the engine asleep between rollouts): the trainer's ``shared_gb``
    is the sleeping engine's 2 GB plus the reference's bf16 weights (2 bytes x 134.5M parameters of
    SmolLM2-135M), computed from the HF config alone: the controller never imports TorchTitan
    (about 11 s between the engine's start and the trainer's spawn, with the event loop blocked)."""
    code = ("import sys; from forge_core.config import load_config; from forge_core.layout import plan_layout;"
            "from forge_core.services import actor_kwargs;"
            "cfg = load_config('smollm2_135m', sys.argv[1:]); plan = plan_layout(cfg);"
            "print(plan.colocated, actor_kwargs(cfg, 'trainer', plan.trainer, plan)['shared_gb'],"
            " 'torchtitan' in sys.modules)")
    args = ["device=cuda", "generator.backend=vllm", "layout.gpus_per_node=1", "layout.trainer.gpus=1",
            "layout.reference.gpus=0", "max_staleness=0"]
    out = subprocess.run([PY, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=True)
    colocated, shared_gb, titan_imported = out.stdout.split()
    assert colocated == "True" and titan_imported == "False", out.stdout
    assert abs(float(shared_gb) - (2.0 + 2 * 134.5e6 / 1e9)) < 0.001, out.stdout


def test_a_tp_replica_is_one_process():
    """A generator replica on several GPUs (TP > 1) is ONE process: vLLM starts its own TP workers.
    (One process per GPU, as for the trainer, would start one whole TP engine per GPU, all on the
    same GPUs: the first TP=2 run on 2 x H200 ran 4,441 tok/s that way.) Checked on CPU with a
    2-GPU slot, which the CPU generator ignores."""
    from forge_core.layout import plan_layout, Slot
    from forge_core.services import call, spawn_service

    cfg = load_config("smollm2_135m", TINY + ["generator.dtype=float32"])

    async def go():
        svc = await spawn_service(cfg, "generator", Slot(0, [0, 1]), plan_layout(cfg), name="generator_tp2")
        try:
            assert svc.ranks == 1 and len(svc.where) == 1, svc.where
            assert await call(svc.name, svc.get_version) == 0
        finally:
            await svc.stop(30)

    asyncio.run(go())


@pytest.mark.parametrize("cls", ["trainer.Trainer", "reference.Reference"])
def test_gpu_actors_pick_their_gpu_before_importing_torchtitan_models(monkeypatch, cls):
    """Importing TorchTitan's models starts CUDA, after which CUDA_VISIBLE_DEVICES is ignored: a
    sharded reference built its model spec first, and both ranks landed on GPU 0 (NCCL: 'Duplicate
    GPU detected', 2 x H200). The trainer and the reference must call init_device first."""
    import importlib

    from forge_core import titan
    from forge_core.config import TrainerConfig, to_dataclass
    from forge_core.losses import LossConfig
    from forge_core.models import ModelConfig

    mod_name, name = cls.split(".")
    mod = importlib.import_module(f"forge_core.actors.{mod_name}")
    order = []

    class Stop(Exception):
        pass

    def fake_init_device(*a, **k):
        order.append("init_device")
        return torch.device("cpu")

    def fake_spec(*a, **k):
        order.append("titan_model_args")
        raise Stop

    monkeypatch.setattr(mod, "init_device", fake_init_device)
    monkeypatch.setattr(titan, "titan_model_args", fake_spec)
    actor = object.__new__(getattr(mod, name))
    kw = dict(model=ModelConfig("smollm2_135m"), device="cpu", temperature=1.0, seq_len=64, seed=0, threads=1)
    if name == "Reference":
        kw.update(dtype="float32", micro_batch_size=1)
    else:
        cfg = load_config("smollm2_135m", [])
        kw.update(trainer=to_dataclass(cfg.trainer, TrainerConfig), loss=to_dataclass(cfg.loss, LossConfig),
                  publish_dtype="float32", max_response_tokens=32)
    with pytest.raises(Stop):
        type(actor).__init__(actor, **kw)
    assert order == ["init_device", "titan_model_args"]
