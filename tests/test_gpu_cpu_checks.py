"""The GPU path's CPU-checkable parts: config validation, GPU layout planning, TorchTitan model
args and HF state-dict name mapping (through TorchTitan's adapters) on tiny models, the vLLM
fused-parameter view mapping and the weight-sync bucketing. No GPU, no vLLM needed."""


import pytest
import torch

from forge_core.config import ConfigError, load_config
from forge_core.layout import plan_layout, visible_devices
from forge_core.models import ModelConfig, hf_config_dict, load_model
from hf_reference import response_logprobs


def test_gpu_config_validation():
    with pytest.raises(ConfigError, match="generator.backend"):
        load_config("smollm2_135m", ["device=cuda"])
    with pytest.raises(ConfigError, match="generator.backend"):
        load_config("qwen3_1_7b", ["device=cpu"])
    with pytest.raises(ConfigError, match="trainer.tp"):
        load_config("qwen3_8b", ["trainer.tp=3"])
    with pytest.raises(ConfigError, match="max_staleness=0"):
        load_config("qwen3_1_7b", ["layout.gpus_per_node=1"])
    with pytest.raises(ConfigError, match="generator.sleep_level=3"):
        load_config("qwen3_1_7b", ["generator.sleep_level=3"])
    with pytest.raises(ConfigError, match="generator.kv_cache_dtype='fp8'"):  # vLLM only
        load_config("smollm2_135m", ["generator.kv_cache_dtype=fp8"])
    with pytest.raises(ConfigError, match="generator.kv_cache_dtype='int4'"):
        load_config("qwen3_1_7b", ["generator.kv_cache_dtype=int4"])
    assert load_config("qwen3_1_7b", ["generator.kv_cache_dtype=fp8"]).generator.kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="generator.quantization='fp8'"):  # vLLM only
        load_config("smollm2_135m", ["generator.quantization=fp8"])
    with pytest.raises(ConfigError, match="generator.quantization='int8'"):
        load_config("qwen3_1_7b", ["generator.quantization=int8"])
    assert load_config("qwen3_1_7b", ["generator.quantization=fp8"]).generator.quantization == "fp8"
    with pytest.raises(ConfigError, match="correction_cap must be > 0"):
        load_config("qwen3_1_7b", ["loss.rollout_correction=tis", "loss.correction_cap=0"])
    with pytest.raises(ConfigError, match="rollout_correction='is'"):
        load_config("smollm2_135m", ["loss.rollout_correction=is"])
    assert load_config("smollm2_135m", ["loss=dapo", "loss.rollout_correction=mis"]).loss.rollout_correction == "mis"
    with pytest.raises(ConfigError, match="trainer.mps_client_priority=2"):
        load_config("qwen3_1_7b", ["trainer.mps_client_priority=2"])
    with pytest.raises(ConfigError, match="checkpoint.final_dtype='float16'"):
        load_config("smollm2_135m", ["checkpoint.final_dtype=float16"])
    awake = load_config("qwen3_1_7b", ["layout.gpus_per_node=1", "generator.sleep_level=0",  # overlap on one GPU
                                       "generator.gpu_memory_utilization=0.3"])
    plan = plan_layout(awake)
    assert plan.colocated and awake.max_staleness == 1
    from forge_core.services import actor_kwargs  # the trainer's memory estimate counts the awake engine's share

    assert actor_kwargs(awake, "trainer", plan.trainer, plan)["shared_frac"] == 0.3
    low = load_config("qwen3_1_7b", ["layout.gpus_per_node=1", "max_staleness=0", "trainer.mps_client_priority=1"])
    lplan = plan_layout(low)  # both the trainer's and the reference's processes get it
    assert actor_kwargs(low, "reference", lplan.trainer, lplan)["mps_priority"] == 1
    assert actor_kwargs(low, "trainer", lplan.trainer, lplan)["trainer"].mps_client_priority == 1
    asleep = load_config("qwen3_1_7b", ["layout.gpus_per_node=1", "max_staleness=0"])
    assert actor_kwargs(asleep, "trainer", plan_layout(asleep).trainer, plan_layout(asleep))["shared_frac"] == 0.0
    with pytest.raises(ConfigError, match="node 0 has 3 GPUs"):
        load_config("qwen3_1_7b", ["layout.trainer.gpus=2"])
    cfg = load_config("qwen3_1_7b", ["model.init=random"])
    assert cfg.trainer.activation_checkpointing is None and cfg.trainer.tp == 1  # None: from the memory estimate


def _gpus(plan):
    return {"generator": plan.generators[0].gpus, "trainer": plan.trainer.gpus, "reference": plan.reference.gpus}


def test_layout_planning():
    one = plan_layout(load_config("qwen3_1_7b", ["layout.gpus_per_node=1", "max_staleness=0"]))
    assert one.colocated and _gpus(one) == {"generator": [0], "trainer": [0], "reference": [0]}
    three = plan_layout(load_config("qwen3_1_7b"))
    assert not three.colocated and _gpus(three) == {"generator": [0], "trainer": [1], "reference": [2]}
    eight = plan_layout(load_config("qwen3_8b", ["layout.generator.tp=2", "layout.generator.replicas=1",
                                                 "layout.trainer.gpus=4", "layout.reference.gpus=2"]))
    assert _gpus(eight) == {"generator": [0, 1], "trainer": [2, 3, 4, 5], "reference": [6, 7]}
    two_nodes = plan_layout(load_config("llama3_8b", ["layout.generator.tp=8", "layout.generator.replicas=1",
                                                      "layout.trainer.gpus=6", "layout.reference.gpus=2"]))
    assert two_nodes.generators[0].gpus == list(range(8)) and two_nodes.reference.gpus == [6, 7]
    assert all(not s.gpus for s in [*plan_layout(load_config("smollm2_135m")).generators])
    assert visible_devices([2], 4, inherited="") == "2,0,1,3" and visible_devices([1, 2], 3, inherited="") == "1,2,0"


def test_registry_architectures_offline():
    from forge_core import titan

    q = titan.titan_model_args("qwen3_1_7b")
    n = sum(k for *_, k in titan.hf_layout(q.hf))
    assert q.family == "qwen3" and q.args.enable_weight_tying and abs(n / 1e9 - 1.72) < 0.01  # Qwen3-1.7B: 1.72B
    q8 = titan.titan_model_args("qwen3_8b")
    assert abs(sum(k for *_, k in titan.hf_layout(q8.hf)) / 1e9 - 8.19) < 0.01  # Qwen3-8B: 8.19B
    ll = titan.titan_model_args("llama3_8b")
    assert ll.family == "llama3" and titan._llama3_ffn(4096, ll.args.multiple_of, ll.args.ffn_dim_multiplier) == 14336
    assert abs(sum(k for *_, k in titan.hf_layout(ll.hf)) / 1e9 - 8.03) < 0.01  # Llama-3.1-8B: 8.03B
    s = titan.titan_model_args("smollm2_135m")
    assert s.family == "qwen3" and not s.args.qk_norm and s.args.head_dim == 64
    assert abs(sum(k for *_, k in titan.hf_layout(s.hf)) / 1e6 - 134.5) < 0.5
    cfg = hf_config_dict("qwen3_1_7b")
    assert cfg["rope_parameters"]["rope_theta"] == 1e6 and cfg["architectures"] == ["Qwen3ForCausalLM"]


def _episodes(tok_ids, lens):
    from forge_core.episode import Episode

    g = torch.Generator().manual_seed(0)
    eps = []
    for i, (p, r) in enumerate(lens):
        ids = torch.randint(3, tok_ids, (p + r,), generator=g).tolist()
        eps.append(Episode(prompt_id=str(i), group=0, target="", prompt_ids=ids[:p], response_ids=ids[p:],
                           behaviour_logprobs=[0.0] * r, text="", policy_version=0))
    return eps


def test_vllm_model_dir_is_named_after_its_config():
    """The same shape gives the same directory (vLLM's compile cache is keyed on it: a respawned
    engine reuses the compiled graph), another shape another one; config.json is the registry's."""
    import json

    from forge_core.actors.vllm_generator import vllm_model_dir

    a, b = vllm_model_dir("qwen3_1_7b", 2048), vllm_model_dir("qwen3_1_7b", 2048)
    assert a == b and a != vllm_model_dir("qwen3_8b", 2048) != vllm_model_dir("qwen3_8b", 100_000)
    with open(f"{a}/config.json") as f:
        assert json.load(f)["hidden_size"] == hf_config_dict("qwen3_1_7b")["hidden_size"]


def test_sampled_logprobs_read_vllms_flat_container():
    """The generator asks vLLM for FlatLogprobs (``logprobs=0, flat_logprobs=True``): the sampled
    token's logprob is the first entry at each position; anything else is refused, not misread."""
    from types import SimpleNamespace as NS

    from forge_core.actors.vllm_generator import sampled_logprobs

    # 3 positions; the middle one also carries a second-ranked token (as logprobs=1 would)
    lp = NS(start_indices=[0, 1, 3], token_ids=[7, 9, 4, 2], logprobs=[-0.1, -0.2, -3.0, -0.3])
    assert sampled_logprobs(NS(token_ids=[7, 9, 2], logprobs=lp)) == [-0.1, -0.2, -0.3]
    with pytest.raises(RuntimeError, match="sampled token"):
        sampled_logprobs(NS(token_ids=[7, 4, 2], logprobs=lp))  # the sampled token is not first
    with pytest.raises(RuntimeError, match="sampled token"):
        sampled_logprobs(NS(token_ids=[7, 9], logprobs=lp))  # one position too many


def test_titan_matches_hf_through_the_state_dict_adapter():
    """HF weights -> TorchTitan (from_hf) give the same response logprobs as transformers
    (right-padded causal rows vs the generator's left-padded layout); to_hf gives back the same
    tensors, names in hf_layout order."""
    from forge_core import titan
    from forge_core.episode import collate

    torch.manual_seed(0)
    hf = load_model(ModelConfig("tiny_llama", init="random"))
    spec = titan.titan_model_args("tiny_llama", max_seq_len=256)
    m = titan.build_model(spec, torch.device("cpu"))
    sd = hf.state_dict()
    titan.load_hf_state_dict(m, spec, sd)
    eps = _episodes(49152, [(7, 5), (3, 9), (12, 1)])
    b = collate(eps, 0)
    ref = response_logprobs(hf, b.input_ids, b.attention_mask, b.prompt_len)
    got = titan.response_logprobs(m, eps, b.response_mask.shape[1], 1.0, torch.device("cpu"), titan.PositionSelect(m))
    mask = b.response_mask.bool()
    assert torch.allclose(got[mask], ref[mask], atol=1e-4), (got[mask] - ref[mask]).abs().max()
    assert (got[~mask] == 0).all()
    named = list(titan.named_hf_tensors(m, spec))
    assert sorted(n for n, _ in named) == sorted(n for n, *_ in titan.hf_layout(spec.hf))
    for n, t in named:
        assert torch.equal(t, sd[n]), n


def test_llama3_adapter_round_trip_permutes_back():
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    from forge_core import titan

    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32,
                                rope_theta=500000, max_seq_len=64)
    hfd = dict(model_type="llama", hidden_size=64, intermediate_size=_ffn(64, 32), num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    spec = titan.TitanSpec("llama3", args, hfd)
    m = titan.build_model(spec, torch.device("cpu"))
    named = dict(titan.named_hf_tensors(m, spec))
    assert sorted(named) == sorted(n for n, *_ in titan.hf_layout(spec.hf))
    assert all(tuple(named[n].shape) == s for n, s, _ in titan.hf_layout(spec.hf))
    wq = dict(m.named_parameters())["layers.0.attention.wq.weight"]
    assert not torch.equal(named["model.layers.0.self_attn.q_proj.weight"], wq)  # permuted to HF's rope layout
    m2 = titan.build_model(spec, torch.device("cpu"), seed=1)
    titan.load_hf_state_dict(m2, spec, named)
    for (n, a), (_, b2) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b2), n


def _ffn(dim, multiple_of):
    from forge_core.titan import _llama3_ffn

    return _llama3_ffn(dim, multiple_of, None)


def test_vllm_fused_views_recover_hf_tensors():
    from forge_core import titan
    from forge_core.actors.vllm_generator import hf_views_of_vllm

    hf = hf_config_dict("tiny_llama")
    sd = load_model(ModelConfig("tiny_llama", init="random")).state_dict()
    fused = {}
    for k, v in sd.items():  # what vLLM's Llama/Qwen3 modules hold
        if ".q_proj." in k:
            fused[k.replace("q_proj", "qkv_proj")] = torch.cat([v, sd[k.replace("q_proj", "k_proj")], sd[k.replace("q_proj", "v_proj")]])
        elif ".gate_proj." in k:
            fused[k.replace("gate_proj", "gate_up_proj")] = torch.cat([v, sd[k.replace("gate_proj", "up_proj")]])
        elif not any(s in k for s in (".k_proj.", ".v_proj.", ".up_proj.")):
            fused[k] = v
    spec = titan.titan_model_args("tiny_llama")
    layout = titan.hf_layout(spec.hf)
    for name, t in hf_views_of_vllm(fused, layout, hf):
        assert torch.equal(t, sd[name]), name


def test_weight_sync_buckets_and_flat_layout():
    from forge_core.weight_sync import ipc_buckets, layout_views

    layout = [("a", (4, 4), 16), ("b", (100,), 100), ("c", (8,), 8), ("d", (30,), 30)]
    b = ipc_buckets(layout, 40)
    assert [(s, e) for s, e, _ in b] == [(0, 16), (16, 116), (116, 154)]
    assert sum(len(x) for *_, x in b) == 4
    flat = torch.arange(154.0)
    views = dict(layout_views(flat, layout))
    assert views["b"][0] == 16 and views["d"][-1] == 153 and views["a"].shape == (4, 4)


@pytest.mark.parametrize("tp", [2, 4])
def test_vllm_tp_shards_recover_hf_slices(tp, monkeypatch):
    """Each TP rank's fused vLLM parameters, built the way vLLM shards them (q/k/v and gate/up rows,
    o/down columns, vocabulary rows, KV heads replicated when fewer than TP), seen through
    hf_views_of_vllm, equal expected_shard of the full HF tensors."""
    from forge_core import titan
    from forge_core.actors import vllm_generator as vg

    hf = hf_config_dict("tiny_llama")  # 4 heads, 2 KV heads: TP=4 replicates KV heads
    sd = load_model(ModelConfig("tiny_llama", init="random")).state_dict()
    layout = titan.hf_layout(titan.titan_model_args("tiny_llama").hf)
    hd, kvh = hf["hidden_size"] // hf["num_attention_heads"], hf["num_key_value_heads"]
    per = -(-hf["vocab_size"] // 64) * 64 // tp
    for rank in range(tp):
        def kv_rows(t):
            return t.chunk(tp)[rank] if kvh >= tp else t[(rank // (tp // kvh)) * hd:(rank // (tp // kvh) + 1) * hd]
        params = {}
        for k, v in sd.items():
            if ".q_proj." in k:
                params[k.replace("q_proj", "qkv_proj")] = torch.cat([
                    v.chunk(tp)[rank], kv_rows(sd[k.replace("q_proj", "k_proj")]), kv_rows(sd[k.replace("q_proj", "v_proj")])])
            elif ".gate_proj." in k:
                params[k.replace("gate_proj", "gate_up_proj")] = torch.cat([v.chunk(tp)[rank], sd[k.replace("gate_proj", "up_proj")].chunk(tp)[rank]])
            elif ".o_proj." in k or ".down_proj." in k:
                params[k] = v.chunk(tp, 1)[rank]
            elif "embed_tokens" in k:
                params[k] = torch.nn.functional.pad(v, (0, 0, 0, per * tp - v.shape[0]))[rank * per:(rank + 1) * per]
            elif not any(s in k for s in (".k_proj.", ".v_proj.", ".up_proj.", "lm_head")):
                params[k] = v
        monkeypatch.setattr(vg, "_rank", lambda _tp, r=rank: r)
        for name, t in vg.hf_views_of_vllm(params, layout, hf, tp):
            assert torch.equal(t, vg.expected_shard(name, sd[name], hf, tp, rank, per)), (name, rank)
