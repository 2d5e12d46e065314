"""The vLLM generator actor (``generator.backend=vllm``, GPU extra): same endpoints as
:class:`forge_core.actors.generator.Generator`.

- vLLM 0.26.0 runs in this actor's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; with
  tensor parallelism its workers are child processes), with ``skip_tokenizer_init``: prompts go in
  as token ids made by our tokenizer, and the model files are only a ``config.json`` written from
  the registry with ``load_format=dummy``. The weights always come from the trainer (version 0 at
  start-up, then every step), so no checkpoint is read twice and a random-init run needs none.
- Sampling: ``n = group_size`` completions per prompt, ``logprobs=0`` (the sampled token's
  logprob) in vLLM's flat container (:func:`sampled_logprobs`), ``logprobs_mode=processed_logprobs``
  (the tempered distribution sampled from).
- Weight updates (:meth:`VllmGenerator.update_weights`) never restart the engine: a same-host
  buffer (the trainer's, or the bytes this process's ``WeightReceiver`` staged from another host)
  is opened through CUDA IPC and fed to the model's ``load_weights`` inside the worker(s)
  (``LLM.apply_model``; bucketed when the buffer is on another GPU). The prefix cache is reset
  after every update (cached KV was computed by the old weights).
- Colocated mode (``layout.gpus_per_node=1``: trainer, reference and generator on one GPU):
  ``enable_sleep_mode``; after each generation the engine sleeps (level 1: weights offloaded to
  host memory, KV cache freed) so the trainer has the memory; an update wakes the weights only;
  the next generation wakes the KV cache. ``generator.sleep_level=0``: the engine never sleeps and
  keeps its share of the GPU, so generation may run while the trainer trains (``max_staleness=1``).
- Continuous rollouts (``rollout.mode=continuous``, :meth:`VllmGenerator.advance`): requests stay in
  the engine across calls and a task of this actor steps it (``LLMEngine.step``) between messages
  (:class:`EngineStream`); a weight update lands between two engine steps and the requests in flight
  go on with their KV cache (PipelineRL's in-flight update), so each group is tagged with the version
  it was submitted under, the oldest weights its tokens came from. Prefix caching is off in this mode:
  a cached prompt block computed by older weights would be older than its new request's tag.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from functools import partial
from typing import TYPE_CHECKING, Optional

from monarch.actor import Actor, endpoint

from forge_core.data import Problem, chat_prompt
from forge_core.episode import Episode
from forge_core.weight_sync import WeightHandle

if TYPE_CHECKING:  # annotations only: the module imports the rest of forge_core where it is used
    from forge_core.config import GeneratorConfig
    from forge_core.models import ModelConfig


def vllm_model_dir(model_name: str, max_len: int) -> str:
    """A directory holding only ``config.json`` for ``model_name`` (from the registry; vLLM reads
    no weights: ``load_format=dummy``), named after its contents: vLLM keys its torch.compile cache
    on the model path, so a respawned engine, and every later run of the same shape on this host,
    loads the compiled graph instead of compiling it again (~25 s on an H100)."""
    from forge_core.models import hf_config_dict

    d = hf_config_dict(model_name)
    d.setdefault("torch_dtype", "bfloat16")
    d["max_position_embeddings"] = max(d.get("max_position_embeddings", 0), max_len)
    text = json.dumps(d, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), f"forge-vllm-{os.getuid()}-{model_name}-{digest}")  # per user
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, f"config.json.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(path, "config.json"))  # atomic: replicas may write it at once
    return path


def make_engine(g, model_name: str, max_len: int, *, tp: int = 1, seed: int = 0, sleep_mode: bool = False,
                prefix_caching: bool = True):
    """The vLLM engine (``vllm.LLM``) of the ``generator`` config ``g`` for ``model_name``, as every
    replica runs it: dummy weights (the trainer's come with the first sync), token-id prompts,
    prefix caching (unless ``prefix_caching`` is False), ``processed_logprobs``, ``g``'s memory share,
    ``max_num_seqs``, dtype, KV cache dtype and ``quantization`` (``fp8``: vLLM's online FP8
    weights). ``max_len`` in tokens.

    Raises:
        ValueError: ``generator.quantization`` set on a GPU without FP8 tensor cores (names the GPU)."""
    from vllm import LLM

    quantized = g.quantization != "none"
    if quantized:
        import torch

        cc = torch.cuda.get_device_capability(0)
        if cc < (8, 9):
            raise ValueError(f"generator.quantization={g.quantization}: {torch.cuda.get_device_name(0)} (compute "
                             f"capability {cc[0]}.{cc[1]}) has no FP8 tensor cores (8.9 or newer: L4, L40S, H100, "
                             f"H200, B200); set generator.quantization=none")
    return LLM(model=vllm_model_dir(model_name, max_len), skip_tokenizer_init=True, load_format="dummy",
               dtype="bfloat16" if g.dtype == "auto" else g.dtype, gpu_memory_utilization=g.gpu_memory_utilization,
               max_model_len=max_len, enable_prefix_caching=prefix_caching, tensor_parallel_size=tp, seed=seed,
               logprobs_mode="processed_logprobs", enable_sleep_mode=sleep_mode, max_num_seqs=g.max_num_seqs,
               kv_cache_dtype=g.kv_cache_dtype, quantization="fp8" if quantized else None)


def sampled_logprobs(completion) -> list:
    """The sampled tokens' logprobs of one vLLM completion: ``[len(completion.token_ids)]`` floats.
    The request asks ``logprobs=0, flat_logprobs=True``, so ``completion.logprobs`` is vLLM's
    ``FlatLogprobs`` (a few flat lists per sequence, where the default container holds a dict and a
    ``Logprob`` object per token that Python's garbage collector walks again and again while the
    engine decodes); vLLM's ``LogprobsProcessor`` puts the sampled token first at each position.

    Raises:
        RuntimeError: the container does not hold the sampled token first at every position."""
    lp, ids = completion.logprobs, completion.token_ids
    first = lp.start_indices
    if len(first) != len(ids) or any(lp.token_ids[i] != t for i, t in zip(first, ids)):
        raise RuntimeError("vLLM returned logprobs that do not start with the sampled token at each position")
    return [lp.logprobs[i] for i in first]


def hf_views_of_vllm(params: dict, layout: list, hf: dict, tp: int = 1) -> list:
    """``[(hf_name, tensor)]``: each published HF tensor's shard located inside one TP rank's vLLM
    parameters, which fuse q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (rows, in that
    order) and split them over ``tp`` ranks (see :func:`expected_shard`); a padded vocabulary is
    cut to the real rows. Used for bit-for-bit checks against the trainer's buffer.

    Args:
        params: vLLM's ``named_parameters()`` of one rank, as a dict.
        layout: ``[(hf_name, shape, numel)]``.
        hf: the HF config fields (head counts, sizes).
        tp: tensor-parallel degree.
    """
    D = hf["hidden_size"]
    hd = hf.get("head_dim") or D // hf["num_attention_heads"]
    kvh = hf["num_key_value_heads"]
    q, I = hf["num_attention_heads"] * hd // tp, hf["intermediate_size"] // tp
    kv = kvh * hd // tp if kvh >= tp else hd
    fused = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, q + kv),
             "v_proj": ("qkv_proj", q + kv, q + 2 * kv), "gate_proj": ("gate_up_proj", 0, I),
             "up_proj": ("gate_up_proj", I, 2 * I)}
    out = []
    for name, shape, _ in layout:
        parts = name.split(".")
        leaf = parts[-2]
        if leaf in fused:
            target, a, b = fused[leaf]
            t = params[".".join(parts[:-2] + [target, parts[-1]])][a:b]
        else:
            t = params[name]
            if leaf in ("embed_tokens", "lm_head"):  # vocabulary rows: this rank's real ones
                per = t.shape[0]
                t = t[:max(0, min(per, shape[0] - _rank(tp) * per))]
        out.append((name, t))
    return out


def _rank(tp: int) -> int:
    if tp == 1:
        return 0
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def expected_shard(name: str, full, hf: dict, tp: int, rank: int, vocab_per_rank: int = 0):
    """The part of HF tensor ``full`` (``name``) that TP rank ``rank`` of ``tp`` holds in vLLM:
    rows of q/k/v (KV heads replicated when fewer than ``tp``), gate and up, and of the vocabulary
    (``vocab_per_rank`` rows each); columns of o_proj and down_proj; norms whole (vLLM's
    Column/RowParallelLinear, QKVParallelLinear and VocabParallelEmbedding)."""
    if tp == 1:
        return full
    leaf = name.split(".")[-2]
    hd = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    kvh = hf["num_key_value_heads"]
    if leaf in ("k_proj", "v_proj") and kvh < tp:
        h = rank // (tp // kvh)
        return full[h * hd:(h + 1) * hd]
    if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return full.chunk(tp, 0)[rank]
    if leaf in ("o_proj", "down_proj"):
        return full.chunk(tp, 1)[rank]
    if leaf in ("embed_tokens", "lm_head"):
        return full[rank * vocab_per_rank:(rank + 1) * vocab_per_rank]
    return full


def _local(handle: WeightHandle) -> WeightHandle:
    """``handle`` without its network parts (RDMA buffer, broadcast group): what a vLLM worker
    needs to open the same-host buffer, and all that is pickled to TP > 1 workers."""
    return dataclasses.replace(handle, rdma=None, group=None)


def _load(model, handle, bucket_bytes, device=None):  # runs in every vLLM worker (TP > 1: pickled: module level)
    from forge_core.weight_sync import load_into_model

    return load_into_model(model, handle, bucket_bytes, device)


def _reload_quantized(worker, handle, bucket_bytes):  # every vLLM worker of a quantised engine
    """The published (bf16) weights into an engine whose linear layers hold FP8 weights and scales:
    vLLM's layerwise reload puts each layer back in its loading format, takes the weights, and
    quantises the layer again once all of its weights arrived (what a start-up load does)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.model_runner.get_model()
    device = next(model.parameters()).device
    initialize_layerwise_reload(model)
    r = _load(model, handle, bucket_bytes, device)
    finalize_layerwise_reload(model, worker.model_runner.model_config)
    return r


def _dequantized(params: dict) -> tuple[dict, set]:
    """``(params, fp8_names)``: ``params`` with each FP8 weight of vLLM's online FP8 (stored
    transposed, [in, out], with one float32 scale) replaced by its value weight * scale in [out, in],
    as the trainer publishes it, and the scales dropped; ``fp8_names`` the weights so replaced."""
    import torch

    out, fp8 = {}, set()
    for name, t in params.items():
        if name.endswith(("weight_scale", "input_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = params[name + "_scale"].float()
            if scale.numel() != 1:
                raise ValueError(f"{name}: {scale.numel()} scales; the FP8 weight check expects one per tensor")
            out[name], _ = (t.float() * scale).t(), fp8.add(name)
        else:
            out[name] = t
    return out, fp8


def _digest(model, layout, hf):
    from forge_core.weight_sync import digest_of

    return digest_of(hf_views_of_vllm(dict(model.named_parameters()), layout, hf))


FP8_REL_ERR = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: rounding moves a normal value by <= 2^-4 of itself


def _mismatches(model, handle, hf, tp):  # runs in every vLLM worker: its shards vs the source bytes
    import torch

    from forge_core.weight_sync import layout_views, open_ipc

    params, fp8 = _dequantized(dict(model.named_parameters()))
    rank = _rank(tp)
    per = params["model.embed_tokens.weight"].shape[0]
    full = dict(layout_views(open_ipc(handle), handle.layout))
    bad = []
    for n, t in hf_views_of_vllm(params, handle.layout, hf, tp):
        want = expected_shard(n, full[n], hf, tp, rank, per).to(t.device)
        if not fp8 or n.rsplit(".", 2)[-2] in ("embed_tokens", "lm_head") or "norm" in n:
            ok = torch.equal(t, want)  # bit for bit
        else:  # an FP8 weight: within e4m3's rounding of the published values
            ok = t.shape == want.shape and float((t - want.float()).norm() / want.float().norm().clamp(min=1e-30)) \
                <= FP8_REL_ERR
        if not ok:
            bad.append(n)
    return bad


def _state_dict(model, layout, hf):
    return {k: v.detach().cpu().clone() for k, v in hf_views_of_vllm(dict(model.named_parameters()), layout, hf)}


class EngineStream:
    """Requests kept in one vLLM engine across actor calls (``rollout.mode=continuous``): a task of
    the actor's event loop runs ``LLMEngine.step`` while any request is unfinished, one step at a
    time under ``lock`` (the actor's: a weight update or another engine call takes it between two
    steps) and yielding to the actor's messages after each. Finished requests wait, with the tag
    they were added with, until :meth:`groups` (tagged rollout groups) or :meth:`run` (untagged
    requests, e.g. a held-out evaluation beside the rollouts) takes them.

    Args:
        llm: a ``vllm.LLM`` (``enqueue``, ``llm_engine.step``), or anything with those two.
        lock: the actor's ``asyncio.Lock`` around engine calls.
    """

    def __init__(self, llm, lock: asyncio.Lock):
        self.llm, self.lock = llm, lock
        self.tags: dict = {}  # request id -> its tag (None: a request of run()), until taken
        self.outputs: dict = {}  # request id -> its finished RequestOutput, until taken
        self.changed = asyncio.Event()
        self.error: Optional[BaseException] = None
        self.task: Optional[asyncio.Task] = None
        self.busy_s = 0.0  # engine-step seconds since take_busy()

    def add(self, prompts: list[list[int]], params, tags: list) -> list[str]:
        """Add one request per token-id prompt (``params``: one ``SamplingParams`` for all) with its
        tag (not None for a rollout group); start stepping. Returns their request ids."""
        # token-id prompts as vllm.inputs.TokensPrompt (a TypedDict); vLLM 0.26's enqueue returns its internal
        # ids, f"{id}-{8 random characters}", and a RequestOutput carries the id alone
        ids = [rid.split("-")[0] for rid in self.llm.enqueue([{"prompt_token_ids": p} for p in prompts], params,
                                                                use_tqdm=False)]
        self.tags.update(zip(ids, tags))
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._step())
        return ids

    async def _step(self) -> None:
        """Step the engine while a request is unfinished; an error is kept for the next taker."""
        try:
            while len(self.outputs) < len(self.tags):
                async with self.lock:
                    t0 = time.perf_counter()
                    outs = self.llm.llm_engine.step()
                    self.busy_s += time.perf_counter() - t0
                for o in outs:
                    if o.finished and o.request_id in self.tags:
                        self.outputs[o.request_id] = o
                        self.changed.set()
                await asyncio.sleep(0)  # the actor's messages (an update, an advance) run between two steps
        except Exception as e:
            self.error = e
            self.changed.set()

    async def _wait(self, timeout: Optional[float]) -> None:
        """Until a request finishes (or ``timeout`` seconds). Raises RuntimeError when stepping failed."""
        if self.error is None:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout)
            except TimeoutError:
                pass
        if self.error is not None:
            raise RuntimeError(f"vLLM engine step failed: {type(self.error).__name__}: {self.error}") from self.error

    def _take(self, rid: str) -> tuple:
        return self.tags.pop(rid), self.outputs.pop(rid)

    async def groups(self, wait_s: float) -> list[tuple]:
        """``[(tag, RequestOutput)]`` of the finished rollout groups (taken out), waiting up to
        ``wait_s`` seconds for one when none is finished and some are generating."""
        deadline = time.monotonic() + wait_s
        while True:
            done = [rid for rid in self.outputs if self.tags[rid] is not None]
            left = deadline - time.monotonic()
            if done or left <= 0 or not self.held():
                return [self._take(rid) for rid in done]
            await self._wait(left)

    async def run(self, prompts: list[list[int]], params) -> list:
        """Generate ``prompts`` beside the requests in flight: their RequestOutputs, in order, once all
        are finished."""
        ids = self.add(prompts, params, [None] * len(prompts))
        while not all(rid in self.outputs for rid in ids):
            await self._wait(None)
        return [self._take(rid)[1] for rid in ids]

    def held(self) -> list[int]:
        """Keys (tag[0]) of the rollout groups still generating."""
        return [t[0] for rid, t in self.tags.items() if t is not None and rid not in self.outputs]

    def take_busy(self) -> float:
        """Engine-step seconds since the last call."""
        busy, self.busy_s = self.busy_s, 0.0
        return busy


class VllmGenerator(Actor):
    """Rollout generation with vLLM (``generator.backend=vllm``).

    Args:
        generator, model, system_prompt, seed, threads, replica: as for
            :class:`~forge_core.actors.generator.Generator`.
        gpus: physical GPU indices of this node for this engine (TP = their number);
            ``CUDA_VISIBLE_DEVICES`` is set from them before CUDA starts.
        colocated: share the GPU with the trainer (colocated mode, see the module docstring).
        per_node: GPUs on this node (the others stay visible, after the engine's own).
        bucket_mb: peer-GPU copy unit of weight updates (``weight_sync.bucket_mb``).
        max_model_len: the engine's longest prompt + response (tokens; 0: the rollout's, from
            ``generator``); held-out evaluation may generate longer responses than rollouts.
        stop_after_answer: accepted for the CPU generator's interface; vLLM runs without a
            detokenizer here, so samples end at EOS or the token budget only.
        env: the ``env`` section: with ``env.fn`` set, episodes are multi-turn
            (:func:`forge_core.rollout.rollout_episodes`; every turn batches the episodes still going).
        continuous: ``rollout.mode=continuous``: an engine without prefix caching, driven by
            :meth:`advance` (see the module docstring).
    """

    def __init__(self, generator: GeneratorConfig, model: ModelConfig, *, system_prompt: str, seed: int, threads: int,
                 replica: str = "generator", gpus: Optional[list] = None, colocated: bool = False, per_node: int = 0,
                 bucket_mb: int = 1024, max_model_len: int = 0, stop_after_answer: bool = False,
                 env: Optional[dict] = None, continuous: bool = False):
        from forge_core.actors.process import setup_process
        from forge_core.layout import visible_devices

        g = self.g = generator
        self.model_name, self.name, self.system_prompt, self.seed = model.name, replica, system_prompt, seed
        self.tp = max(len(gpus or [0]), 1)
        if gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus, per_node)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships a function to TP workers
        # One Triton cache for every engine start: else an engine that loads its compiled graph from vLLM's cache
        # (no inductor run to point TRITON_CACHE_DIR at inductor's) JIT-compiles its sampler kernels again (~20 s)
        home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")  # where Triton's own default cache lies
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(home, ".triton", "cache"))
        setup_process(max(threads, 4), seed)
        from forge_core.models import hf_config_dict, load_tokenizer

        self.hf = hf_config_dict(self.model_name)
        self.tok = load_tokenizer(model)
        self.eos = self.tok.eos_token_id
        from forge_core.rollout import resolve_tool_format
        self.env = dict(env, tool_format=resolve_tool_format(env["tool_format"], self.tok)) if env and env["fn"] else None
        self.colocated, self.sleeps = colocated, colocated and g.sleep_level > 0
        self.max_len = max(max_model_len, g.max_prompt_tokens + g.max_response_tokens)
        t0 = time.perf_counter()
        self.dtype = "bfloat16" if g.dtype == "auto" else g.dtype
        self.quantized = g.quantization != "none"
        self.llm = make_engine(g, self.model_name, self.max_len, tp=self.tp, seed=seed, sleep_mode=self.sleeps,
                               prefix_caching=not continuous)
        self.startup_s = time.perf_counter() - t0
        self.version = 0
        self.awake = {"weights", "kv_cache"}
        self.lock = asyncio.Lock()
        self.stream = EngineStream(self.llm, self.lock) if continuous else None
        self.layout: Optional[list] = None
        self.handle: Optional[WeightHandle] = None
        self.bucket_bytes = int(bucket_mb) << 20
        if self.sleeps:  # asleep until the first rollout, so the trainer starts (compiles) on a free GPU
            self._sleep()

    # ---- sleep / wake (colocated mode) --------------------------------------------------------
    def _wake(self, tags: list) -> float:
        need = [t for t in tags if t not in self.awake]
        if not need:
            return 0.0
        t0 = time.perf_counter()
        self.llm.wake_up(tags=need)
        self.awake.update(need)
        return time.perf_counter() - t0

    def _sleep(self) -> float:
        if not self.sleeps or not self.awake:
            return 0.0
        t0 = time.perf_counter()
        self.llm.sleep(level=self.g.sleep_level)
        self.awake = set()
        return time.perf_counter() - t0

    # ---- generation ---------------------------------------------------------------------------
    def prompt_ids(self, problems: list[Problem]) -> list[list[int]]:
        """Chat-formatted, tokenized prompts, left-truncated to ``generator.max_prompt_tokens``."""
        texts = [chat_prompt(self.tok, p, self.system_prompt) for p in problems]
        return [ids[-self.g.max_prompt_tokens:] for ids in self.tok(texts, add_special_tokens=False).input_ids]

    def _sampling(self, s: dict, ignore_eos: bool = False, seed: Optional[int] = None):
        """vLLM ``SamplingParams`` for the settings ``s`` (:func:`~forge_core.actors.generator.sampling_of`)."""
        from vllm import SamplingParams

        return SamplingParams(n=s["n"], temperature=s["temperature"], top_p=s["top_p"], max_tokens=s["max_tokens"],
                              logprobs=0, flat_logprobs=True, stop_token_ids=[] if ignore_eos else [self.eos],
                              ignore_eos=ignore_eos, detokenize=False, seed=seed)

    def _generate(self, prompts: list[list[int]], sp) -> list:
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)

    @endpoint
    async def generate(self, problems: list[Problem], seed: int,
                       sampling: Optional[dict] = None) -> tuple[list[Episode], dict]:
        """G episodes per problem (problem-major order) and ``{"gen_s", "gen_tokens", "gen_tok_s",
        "wake_s", "sleep_s"}``. vLLM's sampler is seeded once per engine (``seed`` of the run): for
        rollouts, per-request seeds would make its sampler loop over requests, so ``seed`` is recorded
        only. ``sampling`` (held-out evaluation: ``{"n", "temperature", "top_p", "max_tokens"}``, see
        :func:`~forge_core.actors.generator.sampling_of`) makes the requests seeded with ``seed``: the
        evaluation is reproducible and leaves the engine's sampler state, so the rollouts, as they were; it
        starts from an empty prefix cache (cached blocks of earlier rollouts would make its prefill differ
        from ``make eval``'s engine, and greedy bf16 decoding follows such differences)."""
        from forge_core.actors.generator import sampling_of

        if self.stream is not None and not self.env:  # beside the rollouts in flight, through the stepping task
            t0, prompts = time.perf_counter(), self.prompt_ids(problems)
            outs = await self.stream.run(prompts, self._sampling(sampling_of(self.g, sampling),
                                                                  seed=seed if sampling else None))
            dt = time.perf_counter() - t0
            eps = self._episodes(outs, prompts, problems)
            ntok = sum(len(e.response_ids) for e in eps)
            return eps, {"gen_s": dt, "gen_tokens": ntok, "gen_tok_s": ntok / dt, "wake_s": 0.0, "sleep_s": 0.0}
        async with self.lock:
            wake_s = self._wake(["weights", "kv_cache"])
            if sampling:  # an evaluation starts from an empty prefix cache, as make eval's fresh engine does
                self.llm.reset_prefix_cache()
            t0 = time.perf_counter()
            if self.env:
                eps = self._multi_turn(problems, sampling_of(self.g, sampling), seed if sampling else None)
                dt, sleep_s = time.perf_counter() - t0, self._sleep()
                ntok = sum(e.model_tokens() for e in eps)
                return eps, {"gen_s": dt, "gen_tokens": ntok, "gen_tok_s": ntok / dt, "wake_s": wake_s,
                             "sleep_s": sleep_s}
            prompts = self.prompt_ids(problems)
            outs = self._generate(prompts, self._sampling(sampling_of(self.g, sampling),
                                                          seed=seed if sampling else None))
            dt = time.perf_counter() - t0
            sleep_s = self._sleep()
        eps = self._episodes(outs, prompts, problems)
        ntok = sum(len(e.response_ids) for e in eps)
        return eps, {"gen_s": dt, "gen_tokens": ntok, "gen_tok_s": ntok / dt, "wake_s": wake_s, "sleep_s": sleep_s}

    @endpoint
    async def advance(self, submit: list[tuple[int, Problem]], seed: int, wait_s: float
                      ) -> tuple[list[tuple[int, list[Episode]]], list[int], float]:
        """Continuous rollouts (``rollout.mode=continuous``, :mod:`forge_core.rollout_loop`): add the
        groups ``submit`` (``[(key, problem)]``, one request of n = G samples each) to the engine,
        tagged with the version loaded now, and return ``(finished, held, busy_s)`` as soon as a group
        has finished or after ``wait_s`` seconds: ``finished`` = ``[(key, G episodes)]`` (each
        episode's ``policy_version`` its group's tag), ``held`` = keys still generating, ``busy_s`` =
        engine-step seconds since the previous call. vLLM's sampler is seeded per engine: ``seed``
        is recorded only. Raises RuntimeError when the engine failed while stepping."""
        from forge_core.actors.generator import sampling_of

        if self.stream is None:
            raise RuntimeError(f"{self.name}: advance needs rollout.mode=continuous (an engine made for it)")
        if submit:
            prompts = self.prompt_ids([p for _, p in submit])
            self.stream.add(prompts, self._sampling(sampling_of(self.g)),
                            [(key, p, ids, self.version) for (key, p), ids in zip(submit, prompts)])
        done = await self.stream.groups(wait_s)
        out = []
        for (key, problem, ids, version), o in done:
            eps = self._episodes([o], [ids], [problem])
            for e in eps:
                e.policy_version = version
            out.append((key, eps))
        return out, self.stream.held(), self.stream.take_busy()

    def _multi_turn(self, problems: list[Problem], s: dict, seed: Optional[int]) -> list[Episode]:
        """Multi-turn episodes (:func:`forge_core.rollout.rollout_episodes`): each turn is one
        ``LLM.generate`` over the episodes still going, one request each with its own token budget
        (prefix caching keeps the shared prefixes' KV). ``seed`` (evaluation) seeds request ``i`` of
        turn ``t`` with ``seed + 100_003 * t + i``, so the k samples of a question differ."""
        from forge_core.rollout import Sampled, rollout_episodes

        turn = [0]

        def sample(prompts: list[list[int]], budgets: list[int]) -> list[Sampled]:
            sps = [self._sampling(dict(s, n=1, max_tokens=b), seed=None if seed is None else seed + 100_003 * turn[0] + i)
                   for i, b in enumerate(budgets)]
            turn[0] += 1
            return [Sampled(list(o.outputs[0].token_ids), sampled_logprobs(o.outputs[0]),
                            o.outputs[0].finish_reason == "stop") for o in self._generate(prompts, sps)]

        return rollout_episodes(problems, s["n"], tok=self.tok, env_cfg=self.env, system_prompt=self.system_prompt,
                                max_prompt_tokens=self.g.max_prompt_tokens, max_response_tokens=s["max_tokens"],
                                version=self.version, sample=sample)

    def _episodes(self, outs: list, prompts: list, problems: Optional[list] = None) -> list[Episode]:
        eps, vocab = [], len(self.tok)  # once: len() of a HF tokenizer counts its added tokens each call
        for i, o in enumerate(outs):
            p = problems[i] if problems else None
            for c in o.outputs:
                ids = list(c.token_ids)
                text = self.tok.decode([t for t in ids if t < vocab], skip_special_tokens=True) if p else ""
                eps.append(Episode(prompt_id=p.id if p else str(i), group=i, target=p.answer if p else "",
                                   example=p.row if p else {},
                                   prompt_ids=prompts[i], response_ids=ids, text=text, policy_version=self.version,
                                   behaviour_logprobs=sampled_logprobs(c),
                                   truncated=c.finish_reason == "length"))
        return eps

    @endpoint
    async def bench(self, prompts: list[list[int]], n: int, max_tokens: int, episodes: bool = False) -> tuple:
        """``LLM.generate`` on token-id prompts, ``ignore_eos`` (every sample runs ``max_tokens``),
        for the benchmark: ``(episodes or None, {"s", "tokens", "tok_s"})``; ``episodes=False`` is
        the engine's raw throughput, ``True`` adds this actor's episode path (time it from the caller)."""
        async with self.lock:
            self._wake(["weights", "kv_cache"])
            t0 = time.perf_counter()
            outs = self._generate(prompts, self._sampling(dict(n=n, temperature=self.g.temperature, top_p=self.g.top_p,
                                                               max_tokens=max_tokens), ignore_eos=True))
            dt = time.perf_counter() - t0
        ntok = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return (self._episodes(outs, prompts) if episodes else None), {"s": dt, "tokens": ntok, "tok_s": ntok / dt}

    @endpoint
    async def sft_episodes(self, problems: list[Problem], targets: list[str]) -> list[Episode]:
        """The SFT examples ``problems`` with their ``targets`` tokenized
        (:func:`forge_core.actors.generator.sft_episode`)."""
        from forge_core.actors.generator import sft_episode

        g = self.g
        return [sft_episode(self.tok, p, t, self.system_prompt, g.max_prompt_tokens, g.max_response_tokens, self.env)
                for p, t in zip(problems, targets)]

    # ---- weights ------------------------------------------------------------------------------
    @endpoint
    async def update_weights(self, handle: WeightHandle, staged: bool = False) -> dict:
        """Apply weight version ``handle.version`` in place (see the module docstring) from ``handle``'s
        same-host buffer or, with ``staged``, this process's ``WeightReceiver``'s bytes. Returns ``{"version",
        "sync_s" (the load alone: what generation waits; wake-up apart), "sync_gb_s", "mode", "wake_s"}``."""
        from forge_core.weight_sync import RECEIVERS

        if staged:
            handle = RECEIVERS[self.name].handle(handle.version)
        async with self.lock:
            wake_s = self._wake(["weights"])
            t0 = time.perf_counter()
            if self.quantized:
                r = self.llm.collective_rpc(partial(_reload_quantized, handle=_local(handle),
                                                    bucket_bytes=self.bucket_bytes))[0]
            else:
                r = self.llm.apply_model(partial(_load, handle=_local(handle), bucket_bytes=self.bucket_bytes))[0]
            if self.stream is None:  # continuous: no prefix cache; the requests in flight keep their KV cache
                self.llm.reset_prefix_cache()
            dt = time.perf_counter() - t0
            self.version, self.layout, self.handle = handle.version, handle.layout, handle
        return {"version": self.version, "sync_s": dt, "sync_gb_s": handle.nbytes / dt / 1e9, "wake_s": wake_s,
                "mode": ("staged_" if staged else "") + r["mode"]}

    @endpoint
    async def release(self) -> float:
        """Colocated mode: put the engine to sleep now (frees the KV cache). Returns seconds."""
        async with self.lock:
            return self._sleep()

    @endpoint
    async def get_version(self) -> int:
        """The policy version currently loaded."""
        return self.version

    @endpoint
    async def get_dtype(self) -> str:
        """The engine's weight dtype (``auto``: bfloat16): what the trainer publishes."""
        return self.dtype

    @endpoint
    async def tokenizer_files(self) -> dict:
        """The tokenizer as ``{file name: bytes}`` (:func:`forge_core.models.tokenizer_files`)."""
        from forge_core.models import tokenizer_files

        return tokenizer_files(self.tok)

    @endpoint
    async def info(self) -> dict:
        """``{"startup_s", "tp", "device", "colocated"}``."""
        import torch

        return {"startup_s": self.startup_s, "tp": self.tp, "device": torch.cuda.get_device_name(0),
                "colocated": self.colocated}

    @endpoint
    async def weights_digest(self) -> str:
        """sha256 of the loaded weights in the last handle's HF layout (TP=1 and unquantised only; else
        ``""``): equals the trainer's :meth:`weights_digest` when the two hold the same bits."""
        if self.layout is None or self.tp > 1 or self.quantized:
            return ""
        async with self.lock:
            self._wake(["weights"])
            return self.llm.apply_model(partial(_digest, layout=self.layout, hf=self.hf))[0]

    @endpoint
    async def weights_match(self) -> list:
        """HF tensor names whose shard in some TP rank differs, bit for bit, from the last loaded
        handle's bytes (still in place, e.g. right after a sync): ``[]`` when every rank holds
        exactly its share of the trainer's weights. Works for any TP degree. With
        ``generator.quantization=fp8`` the embeddings, norms and LM head are compared bit for bit and
        each FP8 weight as weight * scale against the published values: relative error (Frobenius)
        at most 2^-4, e4m3's rounding bound."""
        async with self.lock:
            self._wake(["weights"])
            per_rank = self.llm.apply_model(partial(_mismatches, handle=_local(self.handle), hf=self.hf, tp=self.tp))
        return sorted({n for names in per_rank for n in names})

    @endpoint
    async def state_dict(self) -> dict:
        """The loaded weights as ``{hf_name: tensor}`` on the CPU (TP=1; for tests on small models)."""
        async with self.lock:
            self._wake(["weights"])
            return self.llm.apply_model(partial(_state_dict, layout=self.layout, hf=self.hf))[0]
