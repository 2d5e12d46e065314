"""What a TorchTitan model of a registry entry is, without building it: its model args
(:func:`titan_model_args`, which TorchTitan model serves which architecture: :mod:`forge_core.titan`'s
docstring), its HF state-dict adapter, the published weights' layout (:func:`hf_layout`) and
parameter names without wrapper prefixes. :mod:`forge_core.titan` (building and running models) and
:mod:`forge_core.lora` (adapters on them) both rest on this module, which imports neither.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from forge_core.models import hf_config_dict


def clean_name(name: str) -> str:
    """A parameter name without activation-checkpoint / compile / FSDP wrapper prefixes."""
    for s in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(s, "")
    return name


@dataclass
class TitanSpec:
    """What :func:`build_model` builds: ``family`` (``"qwen3"`` or ``"llama3"``), TorchTitan
    model args, and the HF config fields it mirrors."""

    family: str
    args: Any
    hf: dict


def _llama3_ffn(dim: int, multiple_of: int, mult: Optional[float]) -> int:
    hidden = int(2 * 4 * dim / 3)
    if mult is not None:
        hidden = int(mult * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def titan_model_args(name: str, max_seq_len: int = 4096) -> TitanSpec:
    """TorchTitan model args of registry model ``name`` (see the module docstring).

    Raises:
        ValueError: if the architecture has no TorchTitan counterpart here.
    """
    hf = hf_config_dict(name)
    mt = hf["model_type"]
    scaling = (hf.get("rope_scaling") or {}).get("rope_type")
    if mt == "llama" and scaling == "llama3":
        from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
        dim = hf["hidden_size"]
        for multiple_of, mult in ((1024, 1.3), (256, None), (1024, None), (256, 1.3), (4096, 1.3)):
            if _llama3_ffn(dim, multiple_of, mult) == hf["intermediate_size"]:
                break
        else:
            raise ValueError(f"{name}: intermediate_size {hf['intermediate_size']} not expressible in TorchTitan "
                             "Llama3")
        rs = hf["rope_scaling"]
        args = TransformerModelArgs(
            dim=dim, n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
            n_kv_heads=hf["num_key_value_heads"], vocab_size=hf["vocab_size"], multiple_of=multiple_of,
            ffn_dim_multiplier=mult, norm_eps=hf["rms_norm_eps"], rope_theta=hf["rope_theta"],
            rope_scaling_args=RoPEScalingArgs(scaling_factor=rs["factor"], low_freq_factor=rs["low_freq_factor"],
                                              high_freq_factor=rs["high_freq_factor"],
                                              original_max_position_embeddings=rs["original_max_position_embeddings"]),
            max_seq_len=max_seq_len)
        if hf.get("tie_word_embeddings"):
            raise ValueError(f"{name}: TorchTitan's Llama3 model has no tied embeddings")
        return TitanSpec("llama3", args, hf)
    if mt in ("qwen3", "llama") and not scaling:
        from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
        args = Qwen3ModelArgs(
            dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
            n_kv_heads=hf["num_key_value_heads"], vocab_size=hf["vocab_size"], head_dim=hf["head_dim"],
            hidden_dim=hf["intermediate_size"], norm_eps=hf["rms_norm_eps"], rope_theta=hf["rope_theta"],
            qk_norm=mt == "qwen3", max_seq_len=max_seq_len, enable_weight_tying=bool(hf.get("tie_word_embeddings")))
        return TitanSpec("qwen3", args, hf)
    raise ValueError(f"{name}: model_type={mt!r} rope_scaling={scaling!r} has no TorchTitan model here")


def state_dict_adapter(spec: TitanSpec):
    """TorchTitan's HF state-dict adapter for ``spec`` (``to_hf`` / ``from_hf``)."""
    if spec.family == "llama3":
        from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter as cls
    else:
        from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter as cls
    return cls(spec.args, None)


def hf_layout(h: dict) -> list[tuple[str, tuple, int]]:
    """``[(hf_name, shape, numel)]`` of the published weights of HF config ``h`` (``TitanSpec.hf``,
    :func:`~forge_core.models.hf_config_dict`), in a fixed order (layer by layer, HF's own order),
    tied ``lm_head`` left out. Computed from the config alone (no model, no TorchTitan import)."""
    D, I, V = h["hidden_size"], h["intermediate_size"], h["vocab_size"]
    hd = h.get("head_dim") or D // h["num_attention_heads"]
    q, kv = h["num_attention_heads"] * hd, h["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (V, D))]
    for i in range(h["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, D)), (p + "self_attn.k_proj.weight", (kv, D)),
                (p + "self_attn.v_proj.weight", (kv, D)), (p + "self_attn.o_proj.weight", (D, q))]
        if h["model_type"] == "qwen3":
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        out += [(p + "mlp.gate_proj.weight", (I, D)), (p + "mlp.up_proj.weight", (I, D)),
                (p + "mlp.down_proj.weight", (D, I)), (p + "input_layernorm.weight", (D,)),
                (p + "post_attention_layernorm.weight", (D,))]
    out.append(("model.norm.weight", (D,)))
    if not h.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (V, D)))
    return [(n, s, math.prod(s)) for n, s in out]
