"""The generator actor: G sampled completions per prompt, with token ids and per-token logprobs.

Backends: ``hf`` (transformers ``generate``, CPU) here; ``vllm`` (GPU) in
:mod:`forge_core.actors.vllm_generator`. Both expose the same endpoints. The generator holds a
policy version; :meth:`Generator.update_weights` loads a new version (from the trainer's buffer
over IPC, or from bytes a ``WeightReceiver`` of this process staged, see :mod:`forge_core.weight_sync`)
between generations, never during one: Monarch runs one message of an actor at a time.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Optional

import torch
from monarch.actor import Actor, endpoint

from forge_core.actors.process import CoreShare, resolve_dtype, setup_process
from forge_core.config import GeneratorConfig
from forge_core.data import Problem, chat_prompt, has_conversation
from forge_core.episode import Episode
from forge_core.rewards import ANSWER_LINE_RE
from forge_core.rollout import Sampled, resolve_tool_format, rollout_episodes, sft_conversation
from forge_core.models import ModelConfig, hf_config_dict, load_model, load_tokenizer, tokenizer_files
from forge_core.weight_sync import RECEIVERS, WeightHandle, digest_of, layout_views, open_ipc


class _StopAfterAnswer:
    """transformers stopping criterion: a row is done once its text holds a full ``#### N`` line.
    Records, per row, the response length (tokens) at which it stopped, so the caller can cut there."""

    def __init__(self, tok, prompt_len: int, rows: int):
        self.tok, self.P = tok, prompt_len
        self.stop_len = [None] * rows

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        n = input_ids.shape[1] - self.P
        for i in range(input_ids.shape[0]):
            if self.stop_len[i] is None:
                # the answer line is a few tokens: it lies in the tail when its newline arrives
                tail = self.tok.decode(input_ids[i, max(self.P, input_ids.shape[1] - 16):])
                if "\n" in tail and ANSWER_LINE_RE.search(tail):
                    self.stop_len[i] = n
            done[i] = self.stop_len[i] is not None
        return done


@torch.no_grad()
def hf_generate(model, tok, prompts: list[str], n: int, max_new_tokens: int, max_prompt_tokens: int,
                temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False, seed: Optional[int] = None,
                stop_after_answer: bool = True, every16: Optional[Any] = None) -> list[dict]:
    """Sample ``n`` completions per prompt with transformers' ``generate``.

    Returns ``len(prompts) * n`` dicts (prompt-major order) with ``prompt_ids``, ``response_ids``
    (cut after the first EOS, which is kept, or after a finished ``#### N`` line when
    ``stop_after_answer``), ``logprobs`` (log-softmax of logits / temperature, i.e. of the
    distribution sampled from, float32), ``text`` and ``truncated`` (hit ``max_new_tokens``).
    ``every16`` is called every 16 decode steps (the actor resizes its thread pool there).
    """
    from transformers import DynamicCache, StoppingCriteriaList

    if seed is not None:
        torch.manual_seed(seed)
    enc = tok(prompts, return_tensors="pt", padding=True, truncation=True, max_length=max_prompt_tokens,
              add_special_tokens=False)
    P = enc.input_ids.shape[1]
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    stop = _StopAfterAnswer(tok, P, len(prompts) * n) if stop_after_answer else None

    def tick(input_ids: torch.Tensor, scores: Any, **kwargs) -> torch.Tensor:  # a criterion that never stops
        if (input_ids.shape[1] - P) % 16 == 0:
            every16()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    criteria = [c for c in (stop, tick if every16 else None) if c is not None]
    ids, mask = enc.input_ids.repeat_interleave(n, 0), enc.attention_mask.repeat_interleave(n, 0)
    cache = {}
    if n > 1 and P > 1:  # the prompt's KV cache once per group, not once per sample
        # keyword `cache` where the model takes it (transformers 5.24 deprecates past_key_values; 5.17 lacks cache)
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        cache = {key: DynamicCache()}
        m = enc.attention_mask[:, :-1]
        model(input_ids=enc.input_ids[:, :-1], attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0),
              use_cache=True, logits_to_keep=1, **cache)  # positions as generate's (left padding)
        cache[key].batch_repeat_interleave(n)
    out = model.generate(input_ids=ids, attention_mask=mask, **cache, max_new_tokens=max_new_tokens,
                         output_logits=True, return_dict_in_generate=True, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, stopping_criteria=StoppingCriteriaList(criteria), **sampling)
    seqs = out.sequences[:, P:]
    lps = torch.stack([torch.log_softmax(l.float() / (1.0 if greedy else temperature), -1)
                       .gather(-1, seqs[:, i:i + 1]).squeeze(-1) for i, l in enumerate(out.logits)], dim=1)
    results = []
    for j in range(seqs.shape[0]):
        ids = seqs[j].tolist()
        end = ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else None
        if stop is not None and stop.stop_len[j] is not None and (end is None or stop.stop_len[j] < end):
            end = stop.stop_len[j]
        r = ids[:end]
        prompt = enc.input_ids[j // n][enc.attention_mask[j // n].bool()].tolist()
        results.append(dict(prompt_ids=prompt, response_ids=r, logprobs=lps[j, :len(r)].tolist(),
                            text=tok.decode(r, skip_special_tokens=True), truncated=end is None))
    return results


@torch.no_grad()
def hf_sample(model, tok, prompts: list[list[int]], budgets: list[int], temperature: float = 1.0, top_p: float = 1.0,
              greedy: bool = False, every16: Optional[Any] = None) -> list[Sampled]:
    """One model turn for each of ``prompts`` (token ids, unpadded) with transformers' ``generate``:
    up to ``budgets[i]`` new tokens each, ending at EOS (kept). Returns a
    :class:`~forge_core.rollout.Sampled` per prompt: ids ``[T_i]``, logprobs ``[T_i]`` (of logits /
    temperature, the distribution sampled from, float32) and whether it stopped at EOS. The caller
    seeds torch's generator. ``every16`` is called every 16 decode steps (the actor's thread pool)."""
    from transformers import StoppingCriteriaList

    B, P = len(prompts), max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids, mask = torch.full((B, P), pad, dtype=torch.long), torch.zeros((B, P), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)

    def tick(input_ids: torch.Tensor, scores: Any, **kwargs) -> torch.Tensor:
        if every16 is not None and (input_ids.shape[1] - P) % 16 == 0:
            every16()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(budgets), output_logits=True,
                         return_dict_in_generate=True, eos_token_id=tok.eos_token_id, pad_token_id=pad,
                         stopping_criteria=StoppingCriteriaList([tick]), **sampling)
    seqs = out.sequences[:, P:]
    lps = torch.stack([torch.log_softmax(l.float() / (1.0 if greedy else temperature), -1)
                       .gather(-1, seqs[:, i:i + 1]).squeeze(-1) for i, l in enumerate(out.logits)], dim=1)
    turns = []
    for j in range(B):
        row = seqs[j, :budgets[j]].tolist()
        eos = tok.eos_token_id in row
        end = row.index(tok.eos_token_id) + 1 if eos else len(row)
        turns.append(Sampled(row[:end], lps[j, :end].tolist(), eos))
    return turns


def sampling_of(g: Any, sampling: Optional[dict] = None) -> dict:
    """The sampling settings of a generate call: the rollout's (``generator`` section ``g``: group size,
    temperature, top_p, max response tokens) as ``{"n", "temperature", "top_p", "max_tokens"}``, with
    ``sampling``'s entries in their place (held-out evaluation). Raises KeyError for an unknown key."""
    s = {"n": g.group_size, "temperature": g.temperature, "top_p": g.top_p, "max_tokens": g.max_response_tokens}
    for k, v in (sampling or {}).items():
        if k not in s:
            raise KeyError(f"sampling key {k!r}: one of {sorted(s)}")
        s[k] = v
    return s


def sft_episode(tok: Any, problem: Problem, target: str, system_prompt: str, max_prompt_tokens: int,
                max_response_tokens: int, env_cfg: Optional[dict] = None) -> Episode:
    """An SFT example as an :class:`Episode`: the chat-formatted prompt (left-truncated to
    ``max_prompt_tokens``) and the ``target`` text's tokens plus EOS as the response (cut to
    ``max_response_tokens``; then ``truncated``), advantage 1, behaviour log-probs 0 (unused by
    ``loss=sft``). Shapes: ``prompt_ids`` [P], ``response_ids`` [R] token ids. A row whose messages
    hold assistant turns is a conversation: :func:`forge_core.rollout.sft_conversation` (masked to
    its assistant turns; the tools of ``env_cfg``'s environment, when set, and then every row must be
    one: DataError otherwise)."""
    if has_conversation(problem) or env_cfg:
        return sft_conversation(tok, problem, system_prompt, env_cfg, max_prompt_tokens, max_response_tokens)
    prompt = tok(chat_prompt(tok, problem, system_prompt), add_special_tokens=False).input_ids[-max_prompt_tokens:]
    response = tok(target, add_special_tokens=False).input_ids + [tok.eos_token_id]
    cut = response[:max_response_tokens]
    return Episode(prompt_id=problem.id, group=0, target=problem.answer, example=problem.row, prompt_ids=prompt,
                   response_ids=cut, behaviour_logprobs=[0.0] * len(cut), text=target, policy_version=0,
                   truncated=len(response) > max_response_tokens, advantage=1.0)


def flatten_parameters(model: torch.nn.Module) -> tuple[torch.Tensor, list]:
    """Re-point every parameter of ``model`` at a view of one new flat buffer (same dtype), so that
    writing the buffer updates the model. Returns ``(flat, layout)`` with ``layout`` =
    ``[(name, shape, numel)]`` in ``named_parameters`` order (tied weights once, as HF names them).

    Raises:
        ValueError: the parameters do not share one dtype.
    """
    params = list(model.named_parameters())
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) != 1:
        raise ValueError(f"weight sync needs one parameter dtype, found {dtypes}")
    layout = [(n, tuple(p.shape), p.numel()) for n, p in params]
    flat = torch.empty(sum(k for *_, k in layout), dtype=dtypes.pop())
    for (_, p), (_, view) in zip(params, layout_views(flat, layout)):
        view.copy_(p.detach())
        p.data = view
    return flat, layout


class Generator(Actor):
    """Rollout generation on CPU with transformers (``generator.backend=hf``).

    Args:
        generator: the ``generator`` config section (:class:`forge_core.config.GeneratorConfig`).
        model: the ``model`` config section (:class:`forge_core.models.ModelConfig`).
        system_prompt: the chat system message.
        seed, threads: process seed and torch threads.
        replica: this replica's name (``generator`` or ``generator_<i>``); its staged weights are
            registered under it (:data:`forge_core.weight_sync.RECEIVERS`).
        cores_dir: with ``threads`` 0, the run's :class:`~forge_core.actors.process.CoreShare` directory.
        stop_after_answer: end a sample after a finished ``#### N`` line (the ``gsm8k`` reward reads
            nothing beyond it; the tokens after it would only cost time).
        env: the ``env`` section (:class:`forge_core.environment.EnvConfig`): with ``env.fn`` set,
            episodes are multi-turn (:func:`forge_core.rollout.rollout_episodes`).
    """

    def __init__(self, generator: GeneratorConfig, model: ModelConfig, *, system_prompt: str, seed: int, threads: int,
                 replica: str = "generator", cores_dir: str = "", stop_after_answer: bool = False,
                 env: Optional[dict] = None):
        self.g = generator
        self.name, self.system_prompt, self.stop_after_answer = replica, system_prompt, stop_after_answer
        setup_process(threads, seed)
        self.cores = CoreShare(cores_dir, replica, threads)
        self.tok = load_tokenizer(model)
        self.dtype = resolve_dtype(self.g.dtype, "cpu", hf_config_dict(model.name)["hidden_size"], replica)
        self.model = load_model(model, dtype=self.dtype)
        self.flat, self.layout = flatten_parameters(self.model)
        self.version = 0
        self.env = dict(env, tool_format=resolve_tool_format(env["tool_format"], self.tok)) if env and env["fn"] else None

    @endpoint
    async def generate(self, problems: list[Problem], seed: int,
                       sampling: Optional[dict] = None) -> tuple[list[Episode], dict]:
        """G episodes per problem (problem-major order), and ``{"gen_s", "gen_tokens", "gen_tok_s"}``.

        ``seed`` seeds the sampler, so a batch is reproducible from (weights, problems, seed).
        ``sampling`` overrides the rollout's ``{"n", "temperature", "top_p", "max_tokens"}`` (held-out
        evaluation; ``temperature`` 0: greedy). Every episode records ``policy_version`` = the version of
        the weights that sampled it.
        """
        return self._rollout(problems, seed, sampling)

    def _rollout(self, problems: list[Problem], seed: int, sampling: Optional[dict] = None
                 ) -> tuple[list[Episode], dict]:
        """:meth:`generate`'s work, in this process."""
        s = sampling_of(self.g, sampling)
        t0 = time.perf_counter()
        if self.env:
            greedy = s["temperature"] == 0
            with self.cores:
                torch.manual_seed(seed)
                eps = rollout_episodes(problems, s["n"], tok=self.tok, env_cfg=self.env, system_prompt=self.system_prompt,
                                       max_prompt_tokens=self.g.max_prompt_tokens, max_response_tokens=s["max_tokens"],
                                       version=self.version, sample=lambda prompts, budgets: hf_sample(
                                           self.model, self.tok, prompts, budgets, s["temperature"] or 1.0, s["top_p"],
                                           greedy, every16=self.cores.refresh))
            dt = time.perf_counter() - t0
            ntok = sum(e.model_tokens() for e in eps)
            return eps, {"gen_s": dt, "gen_tokens": ntok, "gen_tok_s": ntok / dt}
        texts = [chat_prompt(self.tok, p, self.system_prompt) for p in problems]
        with self.cores:
            outs = hf_generate(self.model, self.tok, texts, s["n"], s["max_tokens"], self.g.max_prompt_tokens,
                               s["temperature"] or 1.0, s["top_p"], greedy=s["temperature"] == 0, seed=seed,
                               stop_after_answer=self.stop_after_answer, every16=self.cores.refresh)
        dt = time.perf_counter() - t0
        eps = [Episode(prompt_id=problems[i // s["n"]].id, group=i // s["n"], target=problems[i // s["n"]].answer,
                       example=problems[i // s["n"]].row, prompt_ids=o["prompt_ids"], response_ids=o["response_ids"],
                       behaviour_logprobs=o["logprobs"], text=o["text"], policy_version=self.version,
                       truncated=o["truncated"]) for i, o in enumerate(outs)]
        ntok = sum(len(e.response_ids) for e in eps)
        return eps, {"gen_s": dt, "gen_tokens": ntok, "gen_tok_s": ntok / dt}

    @endpoint
    async def advance(self, submit: list[tuple[int, Problem]], seed: int, wait_s: float = 0.0
                      ) -> tuple[list[tuple[int, list[Episode]]], list[int], float]:
        """Continuous rollouts (``rollout.mode=continuous``, :mod:`forge_core.rollout_loop`): start
        the groups ``submit`` (``[(key, problem)]``) and return ``(finished, held, busy_s)``:
        ``finished`` the groups done, ``[(key, G episodes)]``, ``held`` the keys still generating,
        ``busy_s`` the seconds spent generating. Here an engine step is one ``generate`` over the
        groups submitted (seeded with ``seed``), so every group finishes in the call that starts it
        (``held`` is empty, ``wait_s`` unused) and weight updates land between groups: each episode
        comes from the version it is tagged with."""
        if not submit:
            return [], [], 0.0
        G = self.g.group_size
        eps, st = self._rollout([p for _, p in submit], seed)
        return [(key, eps[i * G:(i + 1) * G]) for i, (key, _) in enumerate(submit)], [], st["gen_s"]

    @endpoint
    async def sft_episodes(self, problems: list[Problem], targets: list[str]) -> list[Episode]:
        """The SFT examples ``problems`` with their ``targets`` tokenized (:func:`sft_episode`)."""
        g = self.g
        return [sft_episode(self.tok, p, t, self.system_prompt, g.max_prompt_tokens, g.max_response_tokens, self.env)
                for p, t in zip(problems, targets)]

    @endpoint
    async def update_weights(self, handle: WeightHandle, staged: bool = False) -> dict:
        """Load weight version ``handle.version``: from ``handle``'s buffer over IPC, or, with
        ``staged``, from what this process's ``WeightReceiver`` fetched. Returns ``{"version",
        "sync_s" (seconds generation waited: the copy), "sync_gb_s", "mode"}``.

        Raises:
            ValueError: the sender's layout or dtype differs from this model's.
        """
        if staged:
            handle = RECEIVERS[self.name].handle(handle.version)
        if [tuple(x[:2]) for x in handle.layout] != [tuple(x[:2]) for x in self.layout] or \
                handle.dtype != str(self.flat.dtype).removeprefix("torch."):
            bad = next(((a, b) for a, b in zip(handle.layout + [None], self.layout + [None]) if a != b), handle.dtype)
            raise ValueError(f"weight layout mismatch between trainer and {self.name} at {bad}")
        t0 = time.perf_counter()
        self.flat.copy_(open_ipc(handle))
        dt = time.perf_counter() - t0
        self.version = handle.version
        return {"version": self.version, "sync_s": dt, "sync_gb_s": handle.nbytes / max(dt, 1e-9) / 1e9,
                "mode": "staged" if staged else "ipc"}

    @endpoint
    async def get_version(self) -> int:
        """The policy version currently loaded."""
        return self.version

    @endpoint
    async def get_dtype(self) -> str:
        """The weight dtype (``generator.dtype``, resolved when ``auto``): what the trainer publishes."""
        return str(self.dtype).removeprefix("torch.")

    @endpoint
    async def tokenizer_files(self) -> dict:
        """The tokenizer as ``{file name: bytes}`` (:func:`forge_core.models.tokenizer_files`)."""
        return tokenizer_files(self.tok)

    @endpoint
    async def weights_digest(self) -> str:
        """sha256 of the loaded weights in layout order (equals the trainer's for the same bits)."""
        return digest_of(layout_views(self.flat, self.layout))

    @endpoint
    async def state_dict(self) -> dict:
        """The loaded weights as ``{name: tensor}`` (for tests on small models)."""
        return {k: v.clone() for k, v in self.model.state_dict().items()}
