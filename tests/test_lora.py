"""LoRA on the trainer (forge_core.lora, trainer.lora.*): the adapters' gradients against a float64
reference; rank 0 and zero-initialised adapters give the base model bit for bit, and so does the
model with its adapters off (the reference); the merged weights (what generators get) and PEFT's
format of ``final/adapter/`` (loaded with ``peft``); FSDP2 on two gloo ranks; the trainer's optimizer
holds the adapters only; checkpoints resume exactly and refuse another LoRA setting; bad input names
the key. The slow test runs real actors: a generator after a sync holds the trainer's merged model. A
LoRA run through the CLI, resumed from its checkpoint, is one of tests/test_e2e.py's shared runs."""

import asyncio
import json
import os
import random
from types import SimpleNamespace

import pytest
import torch

import helpers
from forge_core import lora, titan
from forge_core.config import ConfigError, load_config
from forge_core.losses import compute_loss, make_loss_config

CPU = torch.device("cpu")
TINY = [*helpers.TINY, "generator.dtype=float32", "trainer.compute_dtype=float32"]  # fp32: exact comparisons
SHAPES = [(5, 1), (17, 9), (3, 20), (11, 4), (8, 13)]  # (prompt, response) tokens, ragged


def _spec(kind: str):
    """TorchTitan specs: the tiny test model (Qwen3Model without q/k norms, tied embeddings) and a tiny
    TorchTitan Llama 3 (whose HF layout permutes wq/wk rows)."""
    if kind == "tiny_llama":
        return titan.titan_model_args("tiny_llama", max_seq_len=256)
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, multiple_of=32,
                                rope_theta=500000, max_seq_len=256)
    return titan.TitanSpec("llama3", args, {})


def _episodes(vocab: int, seed: int = 0) -> list:
    g = random.Random(seed)
    return [SimpleNamespace(prompt_ids=[g.randrange(vocab) for _ in range(p)],
                            response_ids=[g.randrange(vocab) for _ in range(r)],
                            behaviour_logprobs=[-g.random() * 5 for _ in range(r)],
                            ref_logprobs=[-g.random() * 5 for _ in range(r)],
                            advantage=g.gauss(0, 1)) for p, r in SHAPES]


def _logprobs(model, eps, temperature: float = 0.8) -> torch.Tensor:
    return titan.response_logprobs(model, eps, max(len(e.response_ids) for e in eps), temperature, CPU)


def _randomise_B(model, seed: int = 1, std: float = 0.02) -> None:
    """Non-zero ``B`` (as after some training), so that the adapters change the model."""
    g = torch.Generator().manual_seed(seed)
    for m in lora.lora_modules(model).values():
        lora._set_full(m.lora_B, torch.randn(tuple(m.lora_B.shape), generator=g) * std)  # (a shard of it under FSDP)


# ---- the adapter itself --------------------------------------------------------------------------


@pytest.mark.parametrize("base", ["fp32", "bf16"], ids=["fp32-base", "bf16-base"])
@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
@pytest.mark.parametrize("kind", ["tiny_llama", "llama3"])
def test_lora_gradients_equal_a_float64_reference(kind, multi_turn, base):
    """GRPO loss gradients of ``A`` and ``B`` (fp32 LoRA modules) equal those of a float64 reference
    that merges ``W + (B @ A) * alpha / r`` explicitly into a plain model (``torch.func``), and the
    base weights get none; also with multi-turn loss masks (a tool block of masked tokens inside the
    response). ``bf16-base``: the GPU trainer's LoRA model, a frozen bf16 base (what the trainer builds
    with ``trainer.compute_dtype`` bf16) under bf16 autocast, against the float64 reference of the same
    (bf16-valued) weights: adapters, their gradients and AdamW's inputs stay float32, within bf16
    compute's rounding (2^-8 relative a value) of the exact gradient."""
    spec = _spec(kind)
    cfg = lora.LoRAConfig(rank=4, alpha=8.0)
    bf16 = base == "bf16"
    m = titan.build_model(spec, CPU, seed=0, lora=cfg, dtype=torch.bfloat16 if bf16 else torch.float32)
    assert all(p.dtype == (torch.float32 if lora.is_adapter(n) or not bf16 else torch.bfloat16)
               for n, p in m.named_parameters())
    _randomise_B(m)
    eps = _episodes(spec.args.vocab_size)
    b = _batch(eps)
    if multi_turn:
        b["mask"][:, 2:5] = 0  # the tool message and the template between two model turns
        assert b["mask"].sum() > 0
    loss_cfg = make_loss_config("grpo", beta=0.04)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        lp32 = _logprobs(m, eps)
    loss, _ = compute_loss(loss_cfg, lp32, b["old"], b["adv"], b["mask"], b["ref"])
    loss.backward()
    assert all(p.grad is None for n, p in m.named_parameters() if not lora.is_adapter(n))
    assert all(p.grad.dtype == torch.float32 for n, p in m.named_parameters() if lora.is_adapter(n))

    plain = titan.build_model(spec, CPU, seed=0).double()
    base = {n: p.detach().double() for n, p in m.named_parameters() if not lora.is_adapter(n)}
    leaves = {n: p.detach().double().requires_grad_() for n, p in m.named_parameters() if lora.is_adapter(n)}
    weights = dict(base)
    for name, mod in lora.lora_modules(m).items():
        A, B = leaves[f"{name}.lora_A"], leaves[f"{name}.lora_B"]
        weights[f"{name}.weight"] = base[f"{name}.weight"] + (B @ A) * mod.scale
    b64 = {k: v.double() for k, v in b.items()}
    lp = titan.response_logprobs(_Functional(plain, weights), eps, b["mask"].shape[1], 0.8, CPU)
    ref, _ = compute_loss(loss_cfg, lp.double(), b64["old"], b64["adv"], b64["mask"], b64["ref"])
    ref.backward()
    tol = 0.05 if bf16 else 1e-5  # bf16 compute: 8 mantissa bits through a few layers, against exact
    for n, p in m.named_parameters():
        if lora.is_adapter(n):
            g64 = leaves[n].grad
            assert g64.abs().max() > 0, n
            assert (p.grad.double() - g64).abs().max() <= tol * g64.abs().max() + 1e-9, n


class _Functional(torch.nn.Module):
    """``plain`` run with ``weights`` in place of its parameters (``torch.func.functional_call``),
    keeping its ``output`` attribute for :func:`forge_core.titan.response_logprobs`."""

    def __init__(self, plain, weights):
        super().__init__()
        self.plain, self.weights, self.output = plain, weights, plain.output

    def forward(self, ids):
        from torch.func import functional_call
        return functional_call(self.plain, self.weights, (ids,))


def _batch(eps) -> dict:
    R = max(len(e.response_ids) for e in eps)
    out = {k: torch.zeros(len(eps), R) for k in ("old", "ref", "mask")}
    for i, e in enumerate(eps):
        r = len(e.response_ids)
        out["old"][i, :r] = torch.tensor(e.behaviour_logprobs)
        out["ref"][i, :r] = torch.tensor(e.ref_logprobs)
        out["mask"][i, :r] = 1
    out["adv"] = torch.tensor([e.advantage for e in eps])
    return out


@pytest.mark.parametrize("kind", ["tiny_llama", "llama3"])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-base"])
def test_zero_B_rank_0_and_adapters_off_give_the_base_model_bit_for_bit(kind, mode):
    """Zero-initialised ``B``: the same base weights as a model without LoRA (same seed) and the same
    logprobs bit for bit (fp32, and under bf16 autocast; ``bf16-base``: the GPU trainer's frozen bf16
    base with fp32 adapters, under autocast, against the plain model in bf16); rank 0 adds no module at
    all; with non-zero ``B`` the model differs, and with its adapters off (the reference) it is the base
    model again."""
    spec = _spec(kind)
    autocast, dt = mode != "fp32", torch.bfloat16 if mode == "bf16-base" else torch.float32
    plain = titan.build_model(spec, CPU, seed=0, dtype=dt)
    m = titan.build_model(spec, CPU, seed=0, lora=lora.LoRAConfig(rank=8), dtype=dt)
    base = dict(plain.named_parameters())
    assert {n for n, _ in m.named_parameters() if not lora.is_adapter(n)} == set(base)
    assert all(torch.equal(p, base[n]) for n, p in m.named_parameters() if not lora.is_adapter(n))
    assert all(torch.count_nonzero(x.lora_B) == 0 and torch.count_nonzero(x.lora_A) > 0
               for x in lora.lora_modules(m).values())
    none = titan.build_model(spec, CPU, seed=0, lora=lora.LoRAConfig(rank=0), dtype=dt)
    assert not lora.lora_modules(none) and [n for n, _ in none.named_parameters()] == list(base)
    eps = _episodes(spec.args.vocab_size)

    def lp(model):  # one autocast region per forward (autocast caches its casts of trainable weights)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return _logprobs(model, eps)

    want = lp(plain)
    assert torch.equal(lp(m), want) and torch.equal(lp(none), want)
    _randomise_B(m)
    assert not torch.equal(lp(m), want)
    with lora.adapters_off(m):
        assert torch.equal(lp(m), want)
    assert not torch.equal(lp(m), want)  # back on


@pytest.mark.parametrize("kind", ["tiny_llama", "llama3"])
def test_merged_weights_and_the_peft_layout(kind):
    """The published (merged) HF weights give the LoRA model's logprobs; each adapted HF weight is the
    base's plus ``scale * B @ A`` of the PEFT tensors (Llama 3: B's q/k rows in HF's rotary order);
    the other weights are the base's."""
    spec = _spec(kind)
    m = titan.build_model(spec, CPU, seed=0, lora=lora.LoRAConfig(rank=4, alpha=16.0))
    _randomise_B(m)
    merged = dict(titan.named_hf_tensors(m, spec))
    plain = titan.build_model(spec, CPU, seed=5)
    titan.load_hf_state_dict(plain, spec, merged)
    eps = _episodes(spec.args.vocab_size)
    assert (_logprobs(plain, eps) - _logprobs(m, eps)).abs().max() < 1e-5
    with lora.adapters_off(m):  # the base weights in HF layout: a plain model of the same init
        base = dict(titan.named_hf_tensors(titan.build_model(spec, CPU, seed=0), spec))
    peft = lora.peft_state_dict(m, spec)
    assert len(peft) == 2 * 7 * spec.args.n_layers
    adapted = set()
    for k, A in peft.items():
        if k.endswith("lora_A.weight"):
            hf = k.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            B = peft[k.replace("lora_A", "lora_B")]
            assert (merged[hf] - base[hf] - 4.0 * B @ A).abs().max() < 1e-6, hf
            adapted.add(hf)
    assert all(torch.equal(merged[k], v) for k, v in base.items() if k not in adapted)


def _fsdp_worker(rank, init_file, base="fp32"):
    """One of 2 gloo ranks: TorchTitan's FSDP2 (fp32 params) over a LoRA model vs an unsharded copy:
    same logprobs, same adapter gradients, no base gradient, same merged HF weights and adapters.
    ``base="bf16"``: the GPU trainer's LoRA model, a frozen bf16 base with fp32 adapters under FSDP2's
    bf16 mixed precision (bf16 compute, fp32 gradient reduction), against the unsharded bf16-base
    model under bf16 autocast: FSDP2 takes the two dtypes (only trainable parameters must share one),
    and the results agree within bf16 rounding."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as pdm
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    pdm.device_type = "cpu"
    spec, cfg = _spec("llama3"), lora.LoRAConfig(rank=4)
    jc = titan.job_config(128, ac=False)
    bf16 = base == "bf16"
    dt = torch.bfloat16 if bf16 else torch.float32
    jc.training.mixed_precision_param = "bfloat16" if bf16 else "float32"
    pd = pdm.ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
    pd.build_mesh()
    ref = titan.build_model(spec, CPU, seed=0, lora=cfg, dtype=dt)
    m = titan.build_model(spec, CPU, seed=0, lora=cfg, dtype=dt, parallelize=lambda mm: parallelize_llama(mm, pd, jc))
    _randomise_B(ref)
    sd = dict(ref.named_parameters())
    for n, p in m.named_parameters():  # the same weights (a sharded random init draws other values)
        lora._set_full(p, sd[titan.clean_name(n)].detach())
    for mod in m.modules():
        if isinstance(mod, FSDPModule):
            mod.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    eps = _episodes(spec.args.vocab_size)
    up = torch.randn(len(eps), 20, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        a = _logprobs(ref, eps)
    b = _logprobs(m, eps)
    (a * up).sum().backward()
    (b * up).sum().backward()
    tol = 0.05 if bf16 else 1e-5  # bf16: autocast and FSDP's casts round alike, sums in other orders
    assert (a - b).abs().max() < (0.1 if bf16 else 1e-5), float((a - b).abs().max())
    for n, p in m.named_parameters():
        n = titan.clean_name(n)
        if lora.is_adapter(n):
            g, want = p.grad.full_tensor() / 2, sd[n].grad  # FSDP summed 2 equal grads
            assert g.dtype == torch.float32 and (g - want).abs().max() <= tol * want.abs().max() + 1e-7, n
        else:
            assert p.grad is None and not p.requires_grad, n
    merged = dict(titan.named_hf_tensors(m, spec))  # every rank iterates (collectives)
    want = dict(titan.named_hf_tensors(ref, spec))
    assert all(merged[k].dtype == v.dtype and (merged[k].float() - v.float()).abs().max() < 1e-6 for k, v in want.items())
    got, exp = lora.adapter_state(m), lora.adapter_state(ref)
    assert all(torch.equal(got[k], v) for k, v in exp.items())
    dist.destroy_process_group()


@pytest.mark.parametrize("base", ["fp32", "bf16"])
def test_fsdp2_over_lora_adapters_on_two_gloo_ranks(tmp_path, base):
    """FSDP2 shards the adapters with their blocks; the frozen base weights get no gradient; also with
    the frozen base in bf16 (the GPU trainer's) and fp32 adapters."""
    torch.multiprocessing.spawn(_fsdp_worker, args=(str(tmp_path / "init"), base), nprocs=2)


def test_memory_estimate_counts_the_staging_buffer_and_the_bf16_base():
    """qwen3_8b_lora's trainer rank (forge_core.memory.trainer_parts, what the trainer's activation
    checkpointing decision sums): the bf16 staging buffer the merged weights are published into is 2
    bytes a parameter on rank 0 (without it the estimate let an H200 run out of memory), and the frozen
    base is 2 bytes a parameter in bf16 (the GPU trainer's), 4 in fp32: 16 GB saved on the 8B model."""
    from forge_core import memory

    spec = titan.titan_model_args("qwen3_8b")
    cfg = lora.LoRAConfig(rank=32, alpha=64, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"])
    n = sum(k for *_, k in titan.hf_layout(spec.hf))
    total = lambda parts: sum(v for d in parts for v in d.values())
    kw = dict(world=1, tokens=16384, ac=False, trained=lora.num_params(spec.hf, cfg))
    bf16, fp32 = memory.trainer_parts(spec.hf, base_bytes=2, **kw), memory.trainer_parts(spec.hf, base_bytes=4, **kw)
    staged = memory.trainer_parts(spec.hf, base_bytes=2, staging_bytes=2, **kw)
    assert total(staged) - total(bf16) == pytest.approx(2 * n) and total(fp32) - total(bf16) == pytest.approx(2 * n)
    assert bf16[0]["adapters + AdamW"] == 12 * lora.num_params(spec.hf, cfg) and "trainer weights + AdamW" not in bf16[0]


@pytest.mark.slow
def test_activation_checkpointing_and_per_block_compile_keep_the_adapters():
    """The GPU trainer's wrappers on the CPU: TorchTitan's full activation checkpointing and per-block
    ``torch.compile`` (fullgraph) over a LoRA model give the eager model's logprobs and adapter gradients,
    and switching the adapters off inside the compiled blocks gives the base model (a recompile)."""
    spec = _spec("tiny_llama")
    cfg = lora.LoRAConfig(rank=4)
    eager = titan.build_model(spec, CPU, seed=0, lora=cfg)
    wrapped = titan.build_model(spec, CPU, seed=0, lora=cfg, parallelize=titan.parallelize_fn(spec, 1, 1, True, 128,
                                                                                               compile=True))
    for m in (eager, wrapped):
        _randomise_B(m)
    assert set(lora.lora_modules(wrapped)) == set(lora.lora_modules(eager))
    eps = _episodes(spec.args.vocab_size)
    a, b = _logprobs(eager, eps), _logprobs(wrapped, eps)
    assert (a - b).abs().max() < 1e-4
    a.sum().backward()
    b.sum().backward()
    ge = {titan.clean_name(n): p.grad for n, p in eager.named_parameters() if p.requires_grad}
    gw = {titan.clean_name(n): p.grad for n, p in wrapped.named_parameters() if p.requires_grad}
    assert set(ge) == set(gw) and all(lora.is_adapter(n) for n in gw)
    assert all((ge[n] - gw[n]).abs().max() <= 1e-4 * ge[n].abs().max() + 1e-7 for n in ge)
    base = titan.build_model(spec, CPU, seed=0)
    with torch.no_grad(), lora.adapters_off(wrapped):
        assert (_logprobs(wrapped, eps) - _logprobs(base, eps)).abs().max() < 1e-4


# ---- the trainer (in this process) --------------------------------------------------------------


def _trainer(*overrides: str):
    from forge_core.actors.trainer import Trainer
    from forge_core.layout import plan_layout
    from forge_core.services import actor_kwargs

    cfg = load_config("smollm2_135m", [*TINY, *overrides])
    plan = plan_layout(cfg)
    return Trainer(**actor_kwargs(cfg, "trainer", plan.trainer, plan)), cfg


def _call(actor, endpoint: str, *args):
    """Run an actor's endpoint in this process (the actor built directly, not spawned)."""
    return asyncio.run(getattr(type(actor), endpoint)._method(actor, *args))


def _grpo_episodes(n: int = 8, seed: int = 0) -> list:
    from forge_core.episode import Episode

    g = random.Random(seed)
    out = []
    for i in range(n):
        r = g.randint(3, 10)
        out.append(Episode(prompt_id=str(i // 4), group=i // 4, target="", text="", policy_version=0,
                           prompt_ids=[g.randrange(3, 2000) for _ in range(g.randint(4, 12))],
                           response_ids=[g.randrange(3, 2000) for _ in range(r)], behaviour_logprobs=[-7.0] * r,
                           ref_logprobs=[-7.0] * r, advantage=(1.0 if i % 2 else -1.0)))
    return out


def test_trainer_trains_the_adapters_only_and_serves_the_reference():
    """A LoRA trainer's AdamW holds state for the adapters only; a step changes them and nothing
    else; its reference logprobs (adapters off) after the step equal a reference actor's holding the
    version-0 weights it published, and the same rows as a full fine-tune's trainer gives at
    version 0 (the same base)."""
    from forge_core.actors.reference import Reference
    from forge_core.layout import plan_layout
    from forge_core.services import actor_kwargs

    t, cfg = _trainer("trainer.lora.rank=4")
    n_adapters = len(lora.lora_modules(t.model)) * 2
    assert len(t.trainable) == n_adapters == 2 * 7 * 2
    plan = plan_layout(cfg)
    ref = Reference(**actor_kwargs(cfg, "reference", plan.reference, plan))
    _call(ref, "load_initial", _call(t, "publish", False, 0, 0, "float32"))
    eps = _grpo_episodes()
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    m = _call(t, "train_step", eps)
    assert m["version"] == 1 and m["skipped"] == 0 and m["grad_norm"] > 0
    assert len(t.opt.state) == n_adapters and all(p in t.opt.state for p in t.trainable)
    for n, p in t.model.named_parameters():  # B moved; A's first gradient is 0 (it is B^T ... with B = 0)
        assert torch.equal(p, before[n]) == (not n.endswith("lora_B")), n
    got, _ = _call(t, "reference_logprobs", eps)
    want, _ = _call(ref, "logprobs", eps)
    assert got == want
    full, _ = _trainer()
    assert _call(full, "state_dict").keys() == _call(t, "state_dict").keys()
    with torch.no_grad():
        lp = titan.response_logprobs(full.model, eps, 10, cfg.generator.temperature, CPU)
    for row, e, g in zip(lp, eps, got):
        assert max(abs(a - b) for a, b in zip(row[:len(e.response_ids)].tolist(), g)) < 1e-5


def test_bf16_frozen_base_trains_fp32_adapters_and_its_reference_is_the_initial_policy():
    """``trainer.compute_dtype=bfloat16`` (what ``auto`` is on GPUs) with LoRA: the frozen base is held
    in bf16 (2 bytes a parameter, no fp32 master copy), the adapters and AdamW's moments in fp32; only
    the adapters can get gradients; every RMSNorm's weight has its input's dtype (the fused kernel; an
    fp32 weight under bf16 autocast made torch warn ``Mismatch dtype between input and weight``); a step
    moves ``B`` alone, and the reference (adapters off) afterwards gives the initial policy's logprobs
    (version 0, adapters on with ``B`` = 0) bit for bit."""
    t, cfg = _trainer("trainer.lora.rank=4", "trainer.compute_dtype=bfloat16")
    assert t.autocast and t.compute == torch.bfloat16
    for n, p in t.model.named_parameters():
        assert (p.dtype, p.requires_grad) == ((torch.float32, True) if lora.is_adapter(n) else (torch.bfloat16, False)), n
    norms = [mod for mod in t.model.modules() if isinstance(mod, torch.nn.RMSNorm)]
    seen = []
    for mod in norms:
        mod.register_forward_pre_hook(lambda mod, args: seen.append((args[0].dtype, mod.weight.dtype)))
    eps = _grpo_episodes()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        initial = titan.response_logprobs(t.model, eps, 10, cfg.generator.temperature, CPU)
    assert norms and seen and all(a == w == torch.bfloat16 for a, w in seen), set(seen)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    m = _call(t, "train_step", eps)
    assert m["version"] == 1 and m["skipped"] == 0 and m["grad_norm"] > 0
    assert len(t.opt.state) == len(t.trainable) and all(
        v.dtype == torch.float32 for st in t.opt.state.values() for k, v in st.items() if k != "step")
    for n, p in t.model.named_parameters():
        assert torch.equal(p, before[n]) == (not n.endswith("lora_B")), n
    ref, _ = _call(t, "reference_logprobs", eps)
    assert all(r == row[:len(e.response_ids)].tolist() for r, row, e in zip(ref, initial, eps))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        after = titan.response_logprobs(t.model, eps, 10, cfg.generator.temperature, CPU)
    assert not torch.equal(after, initial)  # the adapters moved the policy


def test_checkpoint_round_trip_and_resume_mismatches_are_named(tmp_path):
    """A LoRA checkpoint holds the adapters (no model weights) and the adapters' AdamW state; loading
    it restores them exactly; a full fine-tune's trainer refuses it naming trainer.lora.rank, a LoRA
    trainer refuses a full fine-tune's checkpoint, and another rank or base model is named."""
    t, _ = _trainer("trainer.lora.rank=4")
    _call(t, "train_step", _grpo_episodes())
    ck = str(tmp_path / "ck")
    _call(t, "save", ck, True)
    assert sorted(os.listdir(ck)) == ["adapter.safetensors", "optimizer.rank0.pt", "trainer.json"]
    info = json.loads(open(os.path.join(ck, "trainer.json")).read())
    assert info["lora"]["rank"] == 4 and info["base"]["name"] == "tiny_llama" and info["version"] == 1
    saved = lora.adapter_state(t.model)
    t2, _ = _trainer("trainer.lora.rank=4")
    assert _call(t2, "load", ck) == 1
    assert all(torch.equal(v, lora.adapter_state(t2.model)[k]) for k, v in saved.items())
    assert len(t2.opt.state) == len(t.opt.state)
    m1, m2 = _call(t, "train_step", _grpo_episodes(seed=1)), _call(t2, "train_step", _grpo_episodes(seed=1))
    assert m1["loss"] == m2["loss"] and m1["grad_norm"] == m2["grad_norm"]
    assert all(torch.equal(v, lora.adapter_state(t2.model)[k]) for k, v in lora.adapter_state(t.model).items())

    full, _ = _trainer()
    with pytest.raises(ValueError, match=r"holds LoRA adapters \(trainer.lora.rank=4.*this run has trainer.lora.rank=0"):
        _call(full, "load", ck)
    fck = str(tmp_path / "full")
    _call(full, "save", fck, True)
    with pytest.raises(ValueError, match=r"is a full fine-tune's .* this run has trainer.lora.rank=4: resume it with "
                                         r"trainer.lora.rank=0"):
        _call(t2, "load", fck)
    t8, _ = _trainer("trainer.lora.rank=8")
    with pytest.raises(ValueError, match=r"other LoRA settings: trainer.lora.rank=4 \(this run: 8\)"):
        _call(t8, "load", ck)
    other, _ = _trainer("trainer.lora.rank=4", "model.seed=3")
    with pytest.raises(ValueError, match=r"another base model: model.seed=0 \(this run: 3\)"):
        _call(other, "load", ck)


def test_final_adapter_loads_with_peft_and_equals_the_merged_model(tmp_path):
    """``final/`` of a LoRA trainer: ``adapter/`` in PEFT's format, which ``peft`` loads onto the base
    HF model (written by a full fine-tune's trainer of the same init) with the logits of the merged
    model beside it; without ``save_merged`` only the adapter."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    t, _ = _trainer("trainer.lora.rank=4", "trainer.lora.target_modules=[q_proj,v_proj,down_proj]")
    _randomise_B(t.model, std=0.05)
    final, base = str(tmp_path / "final"), str(tmp_path / "base")
    _call(t, "save", final, False)
    full, _ = _trainer()
    _call(full, "save", base, False)
    assert sorted(os.listdir(os.path.join(final, "adapter"))) == ["adapter_config.json", "adapter_model.safetensors"]
    conf = json.loads(open(os.path.join(final, "adapter", "adapter_config.json")).read())
    assert conf["r"] == 4 and conf["lora_alpha"] == 32.0 and conf["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    with_adapter = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), os.path.join(final, "adapter"))
    ids = torch.tensor([[5, 17, 300, 42, 7, 1000, 3, 99]])
    with torch.no_grad():
        a, b = merged(ids).logits, with_adapter.eval()(ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base)(ids).logits
    assert (a - b).abs().max() < 1e-4 and (a - base_logits).abs().max() > 1e-3
    unmerged = with_adapter.merge_and_unload().state_dict()
    from safetensors.torch import load_file
    for k, v in load_file(os.path.join(final, "model.safetensors")).items():
        assert (unmerged[k] - v).abs().max() < 1e-6, k

    t2, _ = _trainer("trainer.lora.rank=4", "trainer.lora.save_merged=false")
    _call(t2, "save", str(tmp_path / "only"), False)
    assert sorted(os.listdir(tmp_path / "only")) == ["adapter", "trainer.json"]


def test_final_merged_model_in_bfloat16(tmp_path):
    """``checkpoint.final_dtype=bfloat16``: ``final/``'s merged weights are the float32 ones rounded to
    bf16 (half the bytes) and ``config.json`` says so; a checkpoint (with optimizer state) refuses it."""
    from safetensors.torch import load_file

    t, _ = _trainer("trainer.lora.rank=4")
    _randomise_B(t.model, std=0.05)
    f32, b16 = tmp_path / "f32", tmp_path / "b16"
    _call(t, "save", str(f32), False)
    _call(t, "save", str(b16), False, "bfloat16")
    want, got = load_file(f32 / "model.safetensors"), load_file(b16 / "model.safetensors")
    assert want.keys() == got.keys() and all(v.dtype == torch.bfloat16 for v in got.values())
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    assert json.loads((b16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (b16 / "model.safetensors").stat().st_size < 0.55 * (f32 / "model.safetensors").stat().st_size
    with pytest.raises(ValueError, match="float32 master weights"):
        _call(t, "save", str(tmp_path / "ck"), True, "bfloat16")


def test_bad_lora_input_is_named():
    """rank < 0 or not an integer, an unknown target (the message lists those that exist), LoRA with
    TP and a reference placed apart from the trainer: each fails naming the key."""
    for bad, msg in (("trainer.lora.rank=-1", r"trainer.lora.rank=-1 must be an integer >= 0"),
                     ("trainer.lora.rank=1.5", r"trainer.lora.rank"),
                     ("trainer.lora.rank=two", r"trainer.lora.rank"),
                     ("trainer.lora.alpha=0", r"trainer.lora.alpha=0.0 must be > 0"),
                     ("trainer.lora.dropout=1", r"trainer.lora.dropout=1.0 must be in \[0, 1\)"),
                     ("trainer.lora.target_modules=[q_proj,qkv_proj]",
                      r"'qkv_proj' matches no module of smollm2_135m; its linear layers are \['q_proj', 'k_proj', "
                      r"'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'\]"),
                     ("trainer.lora.target_modules=[]", r"trainer.lora.target_modules is empty")):
        with pytest.raises(ConfigError, match=msg):
            load_config("smollm2_135m", ["trainer.lora.rank=8", bad])
    with pytest.raises(ConfigError, match=r"trainer.lora.rank=8 with trainer.tp=2"):
        load_config("qwen3_1_7b", ["trainer.lora.rank=8", "trainer.tp=2", "layout.trainer.gpus=2"])
    with pytest.raises(ConfigError, match=r"layout.reference.gpus=1 .* set layout.reference.gpus=0"):
        load_config("qwen3_1_7b", ["trainer.lora.rank=8"])  # its reference has a GPU of its own
    assert load_config("qwen3_8b_lora").trainer.lora.rank > 0 and load_config("llama3_8b_lora").trainer.lora.rank > 0


# ---- real actors (slow) -------------------------------------------------------------------------


@pytest.mark.slow
def test_generator_after_a_sync_holds_the_trainers_merged_model():
    """Actors as a run spawns them with LoRA: no reference process (the trainer serves it), a step
    with +-1 advantages moves the adapters; after the sync the CPU generator's weights are the
    trainer's merged weights bit for bit, and its greedy answers and their logprobs are those of an HF
    model holding the merged weights; the reference logprobs stay the base model's."""
    from forge_core.data import PromptSource, load_gsm8k
    from forge_core.services import BaseModelReference, call, spawn_services

    async def go():
        cfg = load_config("smollm2_135m", [*TINY, "trainer.lora.rank=4"])
        svc = await spawn_services(cfg)
        try:
            assert isinstance(svc.reference, BaseModelReference) and svc.reference.where == svc.trainer.where
            src = PromptSource(load_gsm8k("train", os.environ["GSM8K_DIR"]), 0)
            await call("generator", svc.generator.update_weights, await call("trainer", svc.trainer.publish))
            eps, _ = await call("generator", svc.generator.generate, src.next_batch(2), 0)
            ref0, _ = await call("reference", svc.reference.logprobs, eps)
            for e, lp, i in zip(eps, ref0, range(len(eps))):
                e.ref_logprobs, e.advantage = lp, (1.0 if i % 2 else -1.0)
            await call("trainer", svc.trainer.train_step, eps)
            h = await call("trainer", svc.trainer.publish)
            assert h.version == 1
            await call("generator", svc.generator.update_weights, h)
            merged, gen_w = await call("trainer", svc.trainer.state_dict), await call("generator", svc.generator.state_dict)
            assert all(torch.equal(gen_w[k], v) for k, v in merged.items())
            assert await call("generator", svc.generator.weights_digest) == await call("trainer", svc.trainer.weights_digest)
            problems = src.next_batch(2)
            greedy, _ = await call("generator", svc.generator.generate, problems, 7, {"n": 1, "temperature": 0})
            ref1, _ = await call("reference", svc.reference.logprobs, eps)
            return cfg, merged, problems, greedy, ref0, ref1
        finally:
            await svc.stop()

    cfg, merged, problems, greedy, ref0, ref1 = asyncio.run(go())
    assert ref0 == ref1  # adapters moved, the reference did not
    from forge_core.actors.generator import hf_generate
    from forge_core.data import chat_prompt
    from forge_core.models import load_model, load_tokenizer

    model, tok = load_model(cfg.model), load_tokenizer(cfg.model)
    model.load_state_dict(merged, strict=False)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in merged.items())
    texts = [chat_prompt(tok, p, cfg.data.system_prompt) for p in problems]
    outs = hf_generate(model, tok, texts, 1, cfg.generator.max_response_tokens, cfg.generator.max_prompt_tokens,
                       greedy=True, seed=7, stop_after_answer=True)  # as the actor for the gsm8k reward
    assert [o["response_ids"] for o in outs] == [e.response_ids for e in greedy]
    for o, e in zip(outs, greedy):
        assert max(abs(a - b) for a, b in zip(o["logprobs"], e.behaviour_logprobs)) < 1e-4
