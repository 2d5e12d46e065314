"""The structured config schema every recipe is checked against (Hydra + OmegaConf).

The dataclasses below *are* the base config. A recipe folder holds a ``config.yaml`` with only
its deltas::

    defaults: [base, _self_]
    generator: {group_size: 8}

and :func:`load_config` composes it with command-line overrides (``trainer.lr=1e-6 loss=dapo``).
The schema is strict: a misspelled or unknown key, in the recipe file or an override, fails
here, before any actor starts, with an error naming the key (:class:`ConfigError`).
The loss is a config group: ``loss=dapo`` selects :class:`forge_core.losses.DAPOLossConfig`,
and ``loss.clip_high=0.3`` sets one of its own parameters.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, TypeVar, Union

from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from forge_core import SECRETS
from forge_core.data import SOURCES, DataConfig
from forge_core.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig
from forge_core.environment import TOOL_FORMATS, EnvConfig, EnvError, load_env_class
from forge_core.lora import LoRAConfig, validate as validate_lora
from forge_core.losses import LOSS_CONFIGS, LossConfig, validate_loss
from forge_core.models import ModelConfig
from forge_core.rewards import RewardConfig, RewardError, load_reward_fn


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key (and the recipe file)."""


@dataclass
class GeneratorConfig:
    """Rollout generation. ``backend``: ``"hf"`` (transformers ``generate``, CPU) or ``"vllm"`` (GPU
    extra); ``group_size``: G, completions sampled per prompt; ``max_prompt_tokens``: longer prompts
    are left-truncated (tokens); ``max_response_tokens``: generation budget per completion (tokens);
    ``temperature``: logprobs are of the tempered distribution; ``top_p``: nucleus sampling, 1.0
    keeps the behaviour logprobs exact; ``gpu_memory_utilization``: vLLM's KV-cache share of GPU
    memory; ``dtype``: the generator's (and reference model's) weight dtype, ``bfloat16``,
    ``float32`` or ``auto`` (bf16 on GPUs; on a CPU whichever a matmul probe in each actor's process
    finds faster: bf16 only with hardware support such as AVX-512 BF16 or AMX), what the trainer's
    fp32 master weights are cast to when published; ``max_num_seqs``: vLLM's cap on sequences
    decoded at once (per replica); ``sleep_level``: vLLM sleep level between generations when
    colocated with the trainer (1: weights to host memory, KV cache freed; 2: both freed; 0: never
    sleep: the engine keeps ``gpu_memory_utilization`` of the GPU, so generation can overlap training
    on the shared GPU and ``max_staleness`` may be 1, best under CUDA MPS); ``kv_cache_dtype``:
    vLLM's KV-cache dtype, ``auto`` (the weights') or ``fp8`` (e4m3, unscaled: half the bytes read
    per decoded token, at a small cost in how closely the behaviour logprobs match the trainer's;
    the ``hf`` backend takes ``auto`` only); ``quantization``: the engine's weights, ``none`` (the
    published dtype) or ``fp8`` (vLLM's online FP8: every linear layer's weight quantised to e4m3
    with one scale per tensor at each weight sync, activations quantised dynamically; embeddings,
    norms and the LM head stay in ``dtype``; needs a GPU of compute capability 8.9 or newer, and the
    ``vllm`` backend). Both FP8 settings widen the gap between the sampler's and the trainer's
    log-probs: ``mismatch_kl`` in the metrics measures it, ``loss.rollout_correction`` corrects it."""

    backend: str = "hf"
    group_size: int = 4
    max_prompt_tokens: int = 256
    max_response_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    gpu_memory_utilization: float = 0.5
    dtype: str = "auto"
    max_num_seqs: int = 256
    sleep_level: int = 1
    kv_cache_dtype: str = "auto"
    quantization: str = "none"


@dataclass
class RolloutConfig:
    """How the rollout loop keeps the generator replicas busy (:mod:`forge_core.rollout_loop`).

    ``mode``: ``batch`` (default) generates a rollout batch (``prompts_per_step`` groups) per call
    and starts the next once a replica is free and may generate it; ``continuous`` keeps groups in
    flight across step boundaries (AReaL's asynchronous RL, verl's fully asynchronous mode,
    PipelineRL's in-flight weight updates): a finished group is scored and enters the replay
    buffer at once, a new group is submitted as a slot frees up, and weight updates land while
    groups are in flight (vLLM: between two engine steps, the in-flight requests keep their KV
    cache; the ``hf`` backend: between two generate calls). Each episode's ``policy_version`` is
    the version its group was submitted under, the oldest weights any of its tokens came from, so
    ``max_staleness`` (>= 1 here) holds per group; ``loss.rollout_correction`` weighs the tokens a
    newer version sampled by the trainer-to-sampler ratio as for any stale token. Single-turn
    episodes only (no ``env.fn``); a checkpoint drains the replicas first, so it stays exact, but
    the groups a run trains after it depend on timing (not bit-reproducible).
    ``max_concurrent_groups``: groups in flight per replica in ``continuous`` mode (0: the share
    of ``max_staleness + 1`` rollout batches, at most ``generator.max_num_seqs / group_size``)."""

    mode: str = "batch"
    max_concurrent_groups: int = 0


@dataclass
class TrainerConfig:
    """The policy optimiser: AdamW (``lr``, ``betas``, decoupled ``weight_decay``) with the global
    gradient L2 norm clipped at ``max_grad_norm``. ``micro_batch_size``: sequences per
    forward/backward when not packing (gradient accumulation beyond it; the reference's forward
    takes twice as many on GPUs). ``tokens_per_micro_batch``: sequence packing, episodes (prompt +
    response) packed into micro-batches of this many tokens with document-causal attention (0: no
    packing, pad ``micro_batch_size`` sequences to the longest; a multiple of 128 suits
    FlexAttention). ``logprob_chunk``: response positions per block of the chunked logprobs (no
    ``[tokens, vocab]`` logits are ever held whole; on CUDA each block's element-wise work is one
    compiled kernel). ``compute_dtype``: ``"bfloat16"`` autocast over
    fp32 master weights, ``"float32"``, or ``"auto"`` (as ``generator.dtype``).
    ``activation_checkpointing``: recompute each block in the backward (TorchTitan's full AC),
    ``true``/``false``, or ``null`` (default): on when the trainer's memory estimate without it
    exceeds 85% of the GPU (never on CPU). ``tp``: tensor-parallel degree of the GPU trainer
    (TorchTitan TP; FSDP2 over the rest). ``compile``: ``torch.compile`` each block (TorchTitan's
    per-block compile) in the trainer and the reference; the compile time is reported at start-up.
    ``mps_client_priority``: 1 runs the trainer's and the reference's processes as below-normal
    priority clients under a running CUDA MPS daemon (``CUDA_MPS_CLIENT_PRIORITY``), so that an awake
    colocated engine's (``generator.sleep_level=0``) decoding kernels are scheduled first while
    training overlaps it; 0 (default): normal; ignored without MPS. ``lora``: LoRA adapters instead
    of the full fine-tune (:class:`forge_core.lora.LoRAConfig`; ``rank`` 0: off)."""

    lr: float = 1e-5
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 8
    tokens_per_micro_batch: int = 0
    logprob_chunk: int = 1024
    compute_dtype: str = "auto"
    activation_checkpointing: Optional[bool] = None
    tp: int = 1
    compile: bool = False
    mps_client_priority: int = 0
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class ServiceLayout:
    """Where the trainer or the reference runs: ``host`` is the node index, ``gpus`` its GPU count
    (0 on CPU; for the reference, 0 = sharded over the trainer's GPUs, see :mod:`forge_core.layout`)."""

    host: int = 0
    gpus: int = 0


@dataclass
class GeneratorLayout:
    """Where the generator replicas run: ``replicas`` engines of ``tp`` GPUs each (tensor
    parallel), on node ``host``, or spread in order over ``hosts`` when that list is given."""

    host: int = 0
    hosts: List[int] = field(default_factory=list)
    replicas: int = 1
    tp: int = 1


@dataclass
class LayoutConfig:
    """Placement of services on the allocation (``nodes`` x ``gpus_per_node``). What a cloud task
    asks for besides (``launch/sky_task.py`` writes the recipe's ``sky.yaml`` from them): the GPU types
    a node may have, any one of them (``accelerators``), and each node's disk in GB (``disk_gb``; 0:
    64 on a CPU recipe, 256 with GPUs)."""

    nodes: int = 1
    gpus_per_node: int = 0
    accelerators: List[str] = field(default_factory=lambda: ["H100", "H200"])
    disk_gb: int = 0
    generator: GeneratorLayout = field(default_factory=GeneratorLayout)
    trainer: ServiceLayout = field(default_factory=ServiceLayout)
    reference: ServiceLayout = field(default_factory=ServiceLayout)


@dataclass
class WeightSyncConfig:
    """Trainer -> generator weight transfer (:mod:`forge_core.weight_sync`). ``transport``: ``auto``
    (IPC on the trainer's host; across hosts RDMA where both ends have an ibverbs device, else
    NCCL), or one of ``ipc``, ``nccl`` (gloo on CPU), ``rdma`` (Monarch ``RDMABuffer``; its TCP
    fallback without an ibverbs device). ``bucket_mb``: transfer unit of the NCCL broadcast and of
    peer-GPU copies (MiB). ``timeout_s``: a transfer group that does not form, or a transfer that
    does not finish, within this many seconds fails naming both ends."""

    transport: str = "auto"
    bucket_mb: int = 1024
    timeout_s: float = 300.0


@dataclass
class CheckpointConfig:
    """``every``: steps between checkpoints, and one at the last step (0: none; ``final/`` still holds
    the policy, without optimizer state, so a requeued or resumed run starts over); ``keep``: how many to keep.
    ``final_dtype``: the dtype of ``final/``'s weights (the full model, or LoRA's merged one),
    ``float32`` (the trainer's master weights, exact) or ``bfloat16`` (half the bytes, the dtype
    serving engines load). Checkpoints always hold float32. ``background``: the trainer stages a
    checkpoint in host memory (one more copy of its weights and AdamW state there) and a thread writes
    it while training goes on, so a step waits only for the staging (``checkpoint_exposed_s`` in the
    metrics); ``false``: training waits for the whole write."""

    every: int = 0
    keep: int = 2
    final_dtype: str = "float32"
    background: bool = True


@dataclass
class FaultConfig:
    """Surviving faults inside a run (:mod:`forge_core.controller`). ``max_restarts``: respawns
    allowed per service (a generator replica, reward, reference) within ``restart_window_s`` seconds;
    one more failure stops the run naming the actor. ``call_timeout_s``: deadline of every actor
    call (seconds), plus ``timeout_per_token_s`` per token of its work (generation: prompts x group
    size x max response tokens; reference and trainer: the batch's tokens); a missed deadline counts
    as the actor's death (killed and respawned; the trainer or the replay buffer also takes the run
    back to its last checkpoint, whose later steps are computed again). ``max_bad_steps``: consecutive
    optimizer steps skipped for a non-finite loss or gradient norm before the run stops.
    ``startup_timeout_s``: seconds an actor may take to start and load its first weights (a model
    download, vLLM's compile and KV cache profiling); a miss stops the run naming the actor.
    ``min_replicas``: a generator replica whose restarts are used up is dropped, and its rollouts go
    to the others, while at least this many replicas are left; fewer stop the run naming the actor
    (0, default: every replica of ``layout.generator.replicas`` is needed). At most the layout's replicas."""

    max_restarts: int = 3
    restart_window_s: float = 3600.0
    call_timeout_s: float = 600.0
    timeout_per_token_s: float = 0.05
    max_bad_steps: int = 3
    startup_timeout_s: float = 1800.0
    min_replicas: int = 0


@dataclass
class WandbConfig:
    """wandb logging; ``mode`` follows ``$WANDB_MODE`` and defaults to ``disabled``."""

    project: str = "forge-recipes"
    mode: str = "${oc.env:WANDB_MODE,disabled}"


@dataclass
class EvalConfig:
    """Held-out evaluation: during a run on the generator replicas with the current weights, and by
    ``make eval``. ``every``: steps between evaluations during a run (0: none; when > 0 the last step is
    evaluated too); ``at_start``: also evaluate the initial policy (version 0) before training;
    ``num_questions``: a fixed subset of the held-out split (``data.test``), drawn with ``seed``;
    ``samples``: k responses per question (pass@1 is their mean, pass@k whether any is correct);
    ``temperature`` (0: greedy), ``top_p`` and ``max_response_tokens`` (null: the rollouts') are the
    evaluation's sampling settings; ``batch_size``: questions per batch of ``make eval`` on the CPU."""

    every: int = 0
    at_start: bool = False
    num_questions: int = 200
    samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    max_response_tokens: Optional[int] = None
    seed: int = 1234
    batch_size: int = 32


@dataclass
class Config:
    """The whole run. See the module docstring for how a recipe overrides it.

    Top-level attributes: ``device`` (cpu, cuda), ``steps`` (optimizer steps), ``prompts_per_step``,
    ``max_staleness`` (an episode sampled with policy version v may train step s only if s - v <=
    this), ``buffer_capacity`` (episodes), ``seed``, ``threads_per_actor`` (torch threads of each CPU
    actor; 0: the actors computing at the moment share the host's cores, see
    :class:`forge_core.actors.process.CoreShare`), ``output_dir``, ``run_id`` (resume with the same), ``resume``.
    """

    defaults: List[Any] = field(default_factory=lambda: [{"loss": "grpo"}, "_self_"])
    recipe: str = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = MISSING
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    device: str = "cpu"
    steps: int = 20
    prompts_per_step: int = 8
    max_staleness: int = 1
    buffer_capacity: int = 1024
    seed: int = 0
    threads_per_actor: int = 0
    output_dir: str = "runs/${recipe}"
    run_id: str = "${oc.env:FORGE_RUN_ID,''}"
    resume: bool = True


_T = TypeVar("_T")


def to_dataclass(section: Union[DictConfig, dict], cls: type[_T]) -> _T:
    """The config ``section`` (a resolved DictConfig section such as ``cfg.trainer``, or a plain dict of
    its values) as an instance of its schema dataclass ``cls`` (e.g. :class:`TrainerConfig`), nested
    sections as their own dataclasses (``trainer.lora``: :class:`forge_core.lora.LoRAConfig`), lists as
    lists. The actors get these, not DictConfigs: typed attributes, picklable, and a key the section does
    not set takes the dataclass's default, the one place each default is written. A ``loss`` section
    (``cls`` :class:`~forge_core.losses.LossConfig`) becomes its own loss's subclass
    (:data:`~forge_core.losses.LOSS_CONFIGS` of its ``name``, e.g. :class:`~forge_core.losses.DAPOLossConfig`).

    Raises:
        ConfigError: a key that is no field of ``cls``, or a value of the wrong type (names the key).
    """
    values = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)
    if cls is LossConfig:
        name = values.get("name", LossConfig.name)
        if name not in LOSS_CONFIGS:
            raise ConfigError(f"loss.name={name!r} is not a loss: one of {sorted(LOSS_CONFIGS)}")
        cls = LOSS_CONFIGS[name]
    from omegaconf.errors import OmegaConfBaseException
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{cls.__name__}.{getattr(e, 'full_key', '')}: {str(e).strip().splitlines()[0]}") from None


@functools.cache
def register() -> None:
    """Register the schema (``base``) and the ``loss`` group with Hydra's ConfigStore (once)."""
    from hydra.core.config_store import ConfigStore
    cs = ConfigStore.instance()
    cs.store(name="base", node=Config)
    for name, cls in LOSS_CONFIGS.items():
        cs.store(group="loss", name=name, node=cls)


def _leaves(d: dict, pre: str = ""):
    """``(dotted key, value)`` of every leaf of a nested dict (a list is one leaf)."""
    for k, v in d.items():
        yield from _leaves(v, f"{pre}{k}.") if isinstance(v, dict) else [(pre + k, v)]


def _check(cfg: DictConfig, where: str) -> None:
    held = {n: v for n in SECRETS if len(v := os.environ.get(n, "")) >= 6}  # a shorter value is too common
    for key, v in _leaves(OmegaConf.to_container(cfg)):
        if any(isinstance(x, float) and not math.isfinite(x) for x in (v if isinstance(v, list) else [v])):
            raise ConfigError(f"{where}: {key}={v} must be a finite number")
        if name := next((n for n, s in held.items() if s in str(v)), None):  # e.g. through ${oc.env:...}
            raise ConfigError(f"{where}: {key} holds the value of ${name}: secrets reach the run through the "
                              f"environment only, never through its config (saved with the run)")
    dtypes = ("bfloat16", "float32", "auto")
    choices = {"generator.backend": ("hf", "vllm"), "device": ("cpu", "cuda"), "trainer.compute_dtype": dtypes,
               "generator.dtype": dtypes, "reward.mode": ("strict", "flexible"), "model.init": ("pretrained", "random"),
               "checkpoint.final_dtype": ("float32", "bfloat16"),
               "generator.sleep_level": (0, 1, 2), "weight_sync.transport": ("auto", "ipc", "nccl", "rdma"),
               "advantage.estimator": ADVANTAGE_ESTIMATORS, "trainer.mps_client_priority": (0, 1),
               "data.source": SOURCES, "env.tool_format": TOOL_FORMATS, "rollout.mode": ("batch", "continuous"),
               "generator.kv_cache_dtype": ("auto", "fp8") if cfg.generator.backend == "vllm" else ("auto",),
               "generator.quantization": ("none", "fp8") if cfg.generator.backend == "vllm" else ("none",)}
    for key, allowed in choices.items():
        v = OmegaConf.select(cfg, key)
        if v not in allowed:
            raise ConfigError(f"{where}: {key}={v!r} must be one of {allowed}")
    positive = ("steps", "prompts_per_step", "generator.group_size", "generator.max_response_tokens",
                "trainer.micro_batch_size", "buffer_capacity", "eval.num_questions", "generator.max_num_seqs",
                "weight_sync.bucket_mb", "weight_sync.timeout_s", "fault.call_timeout_s", "fault.max_bad_steps",
                "trainer.logprob_chunk", "generator.max_prompt_tokens", "generator.temperature", "checkpoint.keep",
                "fault.restart_window_s", "eval.samples", "eval.batch_size", "trainer.max_grad_norm",
                "trainer.tp", "layout.nodes", "fault.startup_timeout_s", "layout.generator.replicas",
                "layout.generator.tp", "env.max_turns", "env.tool_timeout_s", "env.max_tool_result_chars",
                "env.python_memory_mb", "env.python_max_processes")
    non_negative = ("threads_per_actor", "checkpoint.every", "fault.max_restarts", "fault.timeout_per_token_s",
                    "fault.min_replicas",
                    "trainer.lr", "trainer.weight_decay", "trainer.tokens_per_micro_batch", "max_staleness",
                    "advantage.eps", "advantage.max_refills", "layout.gpus_per_node", "layout.disk_gb", "layout.trainer.gpus",
                    "layout.reference.gpus", "layout.trainer.host", "layout.reference.host", "layout.generator.host",
                    "eval.every", "eval.temperature", "env.max_turn_tokens", "rollout.max_concurrent_groups")
    fractions = ("generator.top_p", "generator.gpu_memory_utilization", "eval.top_p")
    for keys, ok, what in ((positive, lambda v: v > 0, "> 0"), (non_negative, lambda v: v >= 0, ">= 0"),
                           (fractions, lambda v: 0 < v <= 1, "in (0, 1]")):
        for key in keys:
            if not ok(v := OmegaConf.select(cfg, key)):
                raise ConfigError(f"{where}: {key} must be {what}, got {v}")
    if len(cfg.trainer.betas) != 2 or not all(0 <= b < 1 for b in cfg.trainer.betas):
        raise ConfigError(f"{where}: trainer.betas={list(cfg.trainer.betas)} must be two numbers in [0, 1)")
    if cfg.fault.min_replicas > cfg.layout.generator.replicas:
        raise ConfigError(f"{where}: fault.min_replicas={cfg.fault.min_replicas} is more than the layout's "
                          f"{cfg.layout.generator.replicas} generator replica(s) (layout.generator.replicas): the run "
                          f"could never start; set it to at most {cfg.layout.generator.replicas}")
    try:
        validate_lora(cfg)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    try:
        validate_loss(cfg.loss)
    except ValueError as e:
        raise ConfigError(f"{where}: loss={cfg.loss.name}: {e}") from None
    try:
        load_reward_fn(cfg.reward)
    except RewardError as e:
        raise ConfigError(f"{where}: {e}") from None
    _check_env(cfg, where)
    e = cfg.eval
    if e.max_response_tokens is not None and e.max_response_tokens <= 0:
        raise ConfigError(f"{where}: eval.max_response_tokens must be > 0 (or null: the rollouts'), got "
                          f"{e.max_response_tokens}")
    if e.samples > 1 and e.temperature == 0:
        raise ConfigError(f"{where}: eval.samples={e.samples} with eval.temperature=0 (greedy) gives k identical "
                          f"responses: set eval.temperature > 0 for pass@k, or eval.samples=1")
    if (e.every or e.at_start) and not cfg.data.test:
        raise ConfigError(f"{where}: evaluation is asked for (eval.every={e.every}, eval.at_start={e.at_start}) "
                          f"but data.test is empty: name a held-out split, or set eval.every=0 eval.at_start=false")
    if cfg.loss.name == "sft" and cfg.device == "cuda" and not cfg.layout.trainer.gpus:
        raise ConfigError(f"{where}: loss=sft trains on the trainer's GPUs, and layout.trainer.gpus=0 gives it none of "
                          f"its own (the generator replicas only tokenize and evaluate): set layout.trainer.gpus")
    if cfg.data.source == "file" and not cfg.data.train:
        raise ConfigError(f"{where}: data.source=file needs data.train, a .jsonl or .parquet file")
    if cfg.data.source != "gsm8k" and not (cfg.data.messages_field or cfg.data.prompt_field):
        raise ConfigError(f"{where}: data.prompt_field (or data.messages_field) must name the prompt's field")
    seq = cfg.generator.max_prompt_tokens + max(cfg.generator.max_response_tokens, e.max_response_tokens or 0)
    if cfg.trainer.tokens_per_micro_batch and cfg.trainer.tokens_per_micro_batch < seq:
        raise ConfigError(f"{where}: trainer.tokens_per_micro_batch={cfg.trainer.tokens_per_micro_batch} is smaller "
                          f"than the longest episode (generator.max_prompt_tokens + max_response_tokens = {seq})")
    if cfg.buffer_capacity < (B := cfg.prompts_per_step * cfg.generator.group_size):
        raise ConfigError(f"{where}: buffer_capacity={cfg.buffer_capacity} is smaller than one training batch "
                          f"(prompts_per_step x generator.group_size = {B} episodes): no step could be sampled")
    if cfg.generator.group_size < 2 and cfg.advantage.estimator != "mean":
        raise ConfigError(f"{where}: generator.group_size must be >= 2 for group-normalised advantages")
    if (cfg.device == "cuda") != (cfg.generator.backend == "vllm"):
        raise ConfigError(f"{where}: device={cfg.device} needs generator.backend="
                          f"{'vllm' if cfg.device == 'cuda' else 'hf'} (got {cfg.generator.backend!r})")
    from forge_core.layout import LayoutError, plan_layout
    from forge_core.models import hf_config_dict
    hf = hf_config_dict(cfg.model.name)
    if seq > hf.get("max_position_embeddings", seq):
        raise ConfigError(f"{where}: generator.max_prompt_tokens + max_response_tokens (or eval.max_response_tokens) "
                          f"= {seq} is more than "
                          f"{cfg.model.name}'s {hf['max_position_embeddings']} positions (max_position_embeddings)")
    try:
        plan = plan_layout(cfg, hf.get("num_attention_heads"))
    except (LayoutError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
    _check_rollout(cfg, where, plan.colocated)
    if plan.colocated and cfg.max_staleness != 0 and cfg.generator.sleep_level != 0:
        raise ConfigError(f"{where}: one GPU per node (colocated trainer and generator) needs max_staleness=0: "
                          f"the generator sleeps while the trainer uses the GPU, so the loops must alternate "
                          f"(generator.sleep_level=0 keeps the engine awake and lets them overlap)")
    hosts = {s.host for s in plan.generators}
    if cfg.weight_sync.transport == "ipc" and hosts != {plan.trainer.host}:
        raise ConfigError(f"{where}: weight_sync.transport=ipc needs every generator replica on the trainer's node "
                          f"(layout.trainer.host={plan.trainer.host}; generator nodes {sorted(hosts)}): IPC does not "
                          f"cross hosts; use auto, nccl or rdma")


def _check_rollout(cfg: DictConfig, where: str, colocated: bool) -> None:
    """``rollout.mode=continuous`` (groups stay in flight across weight syncs) needs ``max_staleness``
    >= 1, single-turn episodes and, with one GPU per node, an engine that never sleeps. Raises
    ConfigError naming the key."""
    if cfg.rollout.mode != "continuous":
        return
    if cfg.max_staleness < 1:
        raise ConfigError(f"{where}: rollout.mode=continuous needs max_staleness >= 1: with max_staleness=0 no group "
                          f"may be generating while the trainer steps (it would be a version behind), so generation "
                          f"stops at every step, which is rollout.mode=batch; set max_staleness=1 (every group at most "
                          f"one version behind) or rollout.mode=batch (fully on-policy)")
    if colocated and cfg.generator.sleep_level != 0:
        raise ConfigError(f"{where}: rollout.mode=continuous with one GPU per node needs generator.sleep_level=0: a "
                          f"sleeping engine cannot hold groups in flight while the trainer uses the GPU")
    if cfg.env.fn:
        raise ConfigError(f"{where}: rollout.mode=continuous runs single-turn episodes; env.fn={cfg.env.fn!r} "
                          f"(multi-turn) needs rollout.mode=batch")


def _check_env(cfg: DictConfig, where: str) -> None:
    """``env.*``: the class ``env.fn`` names loads, its built-in tools exist, and the ``python`` tool's
    sandbox (bubblewrap) starts on this node. With ``loss=sft`` the environment gives the prompts
    their tools, and the data rows must be conversations (checked on the data, see
    :func:`forge_core.rollout.sft_conversation`)."""
    if not cfg.env.fn:
        return
    try:
        load_env_class(cfg.env.fn)
    except EnvError as e:
        raise ConfigError(f"{where}: {e}") from None
    from forge_core.environment import BUILTIN_TOOLS
    if bad := [t for t in cfg.env.tools if t not in BUILTIN_TOOLS]:
        raise ConfigError(f"{where}: env.tools={list(cfg.env.tools)}: {bad} not among the built-in tools "
                          f"{sorted(BUILTIN_TOOLS)} (a recipe's own tools go in its environment class's TOOLS)")
    if "python" in cfg.env.tools:
        from forge_core.sandbox import SandboxUnavailable, check_sandbox
        try:
            check_sandbox()
        except SandboxUnavailable as e:
            raise ConfigError(f"{where}: env.tools names python, whose sandbox cannot run on this node: {e}") from None


def _resolve_paths(cfg: DictConfig, d: str) -> None:
    """Make the recipe's own files absolute: ``data.train``/``data.test`` of a ``file`` source and the
    ``.py`` files of ``reward.fn`` and ``env.fn``, when relative, are relative to the recipe folder ``d`` (a copied
    folder carries them)."""
    if cfg.data.source == "file":
        for k in ("train", "test"):
            if cfg.data[k] and not os.path.isabs(os.path.expanduser(cfg.data[k])):
                cfg.data[k] = os.path.join(d, cfg.data[k])
    for key in ("reward", "env"):
        path, sep, name = cfg[key].fn.rpartition(":")
        if sep and path.endswith(".py") and not os.path.isabs(os.path.expanduser(path)):
            cfg[key].fn = f"{os.path.join(d, path)}:{name}"


def _did_you_mean(key: str) -> str:
    """`` (did you mean 'trainer.lr'?)``: the schema's closest dotted key to ``key`` (any loss's), found
    one level at a time, so that a misspelt section is corrected first (``traner.lr``: ``trainer.lr``;
    ``traner``: the section ``trainer``); else the closest whole key; else ''."""
    keys = [k for k, _ in _leaves(OmegaConf.to_container(OmegaConf.structured(Config)))]
    keys += [f"loss.{f.name}" for c in LOSS_CONFIGS.values() for f in dataclasses.fields(c)]
    if key in keys:  # a schema key all the same: another loss's parameter, or `defaults`
        field_ = key.removeprefix("loss.")
        owners = [n for n, c in LOSS_CONFIGS.items() if field_ in {f.name for f in dataclasses.fields(c)}]
        return (f" (a parameter of loss={' or '.join(owners)}: select it too, e.g. loss={owners[0]} {key}=...)"
                if owners else " (it is set in a recipe's config.yaml, not by an override)")
    below: dict[str, set] = {}  # a section ("" for the top) -> the names in it
    for k in keys:
        parts = k.split(".")
        for i in range(len(parts)):
            below.setdefault(".".join(parts[:i]), set()).add(parts[i])
    found = ""
    for part in key.split("."):
        near = difflib.get_close_matches(part, sorted(below.get(found, ())), n=1)
        if not near:  # no close name at this level (or a key below a value): the closest whole key
            near = difflib.get_close_matches(key, keys, n=1)
            return f" (did you mean {near[0]!r}?)" if near else ""
        found = f"{found}.{near[0]}" if found else near[0]
    return f" (did you mean {'the section ' if found in below else ''}{found!r}?)"


# OmegaConf's complaint about a value's type -> what the key takes
_EXPECTED = (("converted to Float", "a float"), ("converted to Integer", "an integer"),
             ("is not a valid bool", "true or false"), ("is not a ListConfig", "a list, e.g. [1, 2]"),
             ("to string", "a string"), ("is not Optional", "a value (not null)"),
             ("is not a subclass of", "a section: set its keys one by one, {key}.<name>=..."))


def _wrong_type(error: BaseException) -> Optional[str]:
    """``trainer.lr='fast': expected a float``: one line for a value of the wrong type (an OmegaConf
    ValidationError naming its key, in ``error``'s chain of causes), or None when it is another error."""
    from omegaconf.errors import ValidationError

    e: Optional[BaseException] = error
    while e is not None and not (isinstance(e, ValidationError) and getattr(e, "full_key", None)):
        e = e.__cause__ or e.__context__
    if e is None:
        return None
    first = str(getattr(e, "msg", e)).strip().splitlines()[0]
    value = "null" if getattr(e, "value", None) is None else repr(e.value)
    what = next((f"expected {w.format(key=e.full_key)}" for pattern, w in _EXPECTED if pattern in first), first)
    return f"{e.full_key}={value}: {what}"


def recipe_dir(recipe: str) -> str:
    """Absolute path of a recipe folder: a name under ``recipes/`` or a path to a folder. Raises
    ConfigError if the folder or its ``config.yaml`` does not exist."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
    named = os.path.join(root, recipe)
    d = os.path.abspath(named if os.sep not in recipe and os.path.isdir(named) else recipe)
    if not os.path.isfile(os.path.join(d, "config.yaml")):
        known = sorted(n for n in (os.listdir(root) if os.path.isdir(root) else [])
                       if os.path.isfile(os.path.join(root, n, "config.yaml")))
        raise ConfigError(f"recipe {recipe!r}: {os.path.join(d, 'config.yaml')} not found (recipes: {known})")
    return d


def load_config(recipe: str, overrides: Optional[List[str]] = None) -> DictConfig:
    """Compose ``recipes/<recipe>/config.yaml`` (``recipe``: a name or a path to a recipe folder; the
    resolved ``recipe`` field is the folder's name, so a copied folder is its own recipe) over the
    base schema, then ``overrides``. Returns a resolved, read-only (struct) DictConfig. Raises
    ConfigError naming the key (or, for a file that is not valid YAML, its line): unknown/misspelled
    key, wrong type, bad value, missing recipe."""
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    register()
    d, overrides = recipe_dir(recipe), list(overrides or [])
    where = os.path.join(d, "config.yaml")
    if bad := [o for o in overrides if o.startswith(("+", "~"))]:
        raise ConfigError(f"override {bad[0]!r}: the schema's keys are fixed (no '+' to add a key, '~' to delete "
                          f"one): set an existing key as key=value (make check lists them)")
    if bad := [o for o in overrides if o.startswith(("hydra.", "hydra/", "recipe="))]:  # accepted, then unused
        raise ConfigError(f"override {bad[0]!r}: not a setting of the run (Hydra's own settings are unused; recipe "
                          f"is the recipe folder's name): copy the folder to make a new recipe")
    try:
        with initialize_config_dir(config_dir=d, version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
        if OmegaConf.get_type(cfg) is not Config:
            raise ConfigError(f"{where}: must start with 'defaults: [base, _self_]' (the schema it overrides)")
        with open_dict(cfg):
            cfg.recipe = os.path.basename(d)
        OmegaConf.resolve(cfg)
        _resolve_paths(cfg, d)
    except ConfigError:
        raise
    except (HydraException, OmegaConfBaseException, yaml.YAMLError, ValueError) as e:  # YAMLError: not YAML, a
        # duplicate key; ValueError: a group override that is no name (loss=5, =5), a file that is not UTF-8
        msg = " ".join(str(x).strip() for x in (e, e.__cause__) if x).replace("\n", " ")
        where += " + overrides" if overrides and "override" in msg else ""
        if (key := re.search(r"full_key: (\S+)", msg)) and re.search(r"Could not override|Key '\w+' not in", msg):
            o = next((o for o in overrides if f"{o.partition('=')[0]}.".startswith(f"{key[1]}.")), "")
            k = o.partition("=")[0] or key[1]
            raise ConfigError(f"{f'override {o!r}' if o else where}: unknown key {k!r}{_did_you_mean(k)}") from None
        if "subclass of LossConfig" in msg:
            msg = "a recipe picks its loss in its defaults list, e.g. defaults: [base, {override loss: dapo}, _self_]"
        elif wrong := _wrong_type(e):  # set by an override (Hydra merges them after the file), or the file
            raise ConfigError(f"override {wrong}" if "merging override" in msg else
                              f"{os.path.join(d, 'config.yaml')}: {wrong}") from None
        raise ConfigError(f"{where}: {msg}") from None
    _check(cfg, f"{where} + overrides" if overrides else where)
    OmegaConf.set_readonly(cfg, True)
    return cfg
