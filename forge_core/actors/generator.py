"""The generator actor: G sampled completions per prompt, with token ids and per-token logprobs.

Backends: ``hf`` (transformers ``generate``, CPU) here; ``vllm`` (GPU) in
:mod:`forge_core.actors.vllm_generator`. Both expose the same endpoints. The generator holds a
policy version; :meth:`Generator.update_weights` pulls a new version from the trainer
(:mod:`forge_core.weight_sync`) between generations, never during one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import torch
from monarch.actor import Actor, endpoint

from forge_core.actors import setup_process
from forge_core.data import Problem, chat_prompt
from forge_core.episode import Episode
from forge_core.rewards import ANSWER_LINE_RE
from forge_core.models import load_model, load_tokenizer
from forge_core.weight_sync import FlatWeights, WeightHandle


class _StopAfterAnswer:
    """transformers stopping criterion: a row is done once its text holds a full ``#### N`` line.

    Records, per row, the response length (tokens) at which it stopped, so the caller can cut there.
    """

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
                temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                seed: Optional[int] = None, stop_after_answer: bool = True) -> list[dict]:
    """Sample ``n`` completions per prompt with transformers' ``generate``.

    Returns ``len(prompts) * n`` dicts (prompt-major order) with ``prompt_ids``, ``response_ids``
    (cut after the first EOS, which is kept, or after a finished ``#### N`` line when
    ``stop_after_answer``), ``logprobs`` (log-softmax of logits / temperature, i.e. of the
    distribution sampled from, float32), ``text`` and ``truncated`` (hit ``max_new_tokens``).
    """
    from transformers import StoppingCriteriaList

    if seed is not None:
        torch.manual_seed(seed)
    enc = tok(prompts, return_tensors="pt", padding=True, truncation=True, max_length=max_prompt_tokens,
              add_special_tokens=False)
    P = enc.input_ids.shape[1]
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    stop = _StopAfterAnswer(tok, P, len(prompts) * n) if stop_after_answer else None
    out = model.generate(**enc, max_new_tokens=max_new_tokens, num_return_sequences=n, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         stopping_criteria=StoppingCriteriaList([stop]) if stop else None, **sampling)
    seqs = out.sequences[:, P:]
    lps = torch.stack([torch.log_softmax(l.float() / (1.0 if greedy else temperature), -1)
                       .gather(-1, seqs[:, i:i + 1]).squeeze(-1) for i, l in enumerate(out.logits)], dim=1)
    results = []
    for j in range(seqs.shape[0]):
        ids = seqs[j].tolist()
        end = ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else None
        if stop is not None and stop.stop_len[j] is not None and (end is None or stop.stop_len[j] < end):
            end = stop.stop_len[j]
        r = ids[:end] if end is not None else ids
        prompt = enc.input_ids[j // n][enc.attention_mask[j // n].bool()].tolist()
        results.append(dict(prompt_ids=prompt, response_ids=r, logprobs=lps[j, :len(r)].tolist(),
                            text=tok.decode(r, skip_special_tokens=True), truncated=end is None))
    return results


class Generator(Actor):
    """Rollout generation on CPU with transformers (``generator.backend=hf``).

    Args:
        cfg: the run's config (as a plain dict; see :class:`forge_core.config.Config`).
    """

    def __init__(self, cfg: dict):
        from omegaconf import OmegaConf

        self.cfg = OmegaConf.create(cfg)
        setup_process(self.cfg.threads_per_actor, self.cfg.seed)
        self.tok = load_tokenizer(self.cfg.model)
        self.model = load_model(self.cfg.model, dtype=getattr(torch, self.cfg.generator.dtype))
        self.weights = FlatWeights(self.model, share=True)
        self.version = 0
        self.lock = asyncio.Lock()  # generation and weight updates never interleave

    @endpoint
    async def generate(self, problems: list[Problem], seed: int) -> tuple[list[Episode], dict]:
        """G episodes per problem (problem-major order), and ``{"gen_s", "gen_tokens", "gen_tok_s"}``.

        ``seed`` seeds the sampler, so a batch is reproducible from (weights, problems, seed).
        Every episode records ``policy_version`` = the version of the weights that sampled it.
        """
        g = self.cfg.generator
        async with self.lock:
            t0 = time.perf_counter()
            texts = [chat_prompt(self.tok, p.question, self.cfg.data.system_prompt) for p in problems]
            outs = hf_generate(self.model, self.tok, texts, g.group_size, g.max_response_tokens, g.max_prompt_tokens,
                               g.temperature, g.top_p, seed=seed)
            dt = time.perf_counter() - t0
        eps = [Episode(prompt_id=problems[i // g.group_size].id, group=i // g.group_size,
                       target=problems[i // g.group_size].answer, prompt_ids=o["prompt_ids"],
                       response_ids=o["response_ids"], behaviour_logprobs=o["logprobs"], text=o["text"],
                       policy_version=self.version, truncated=o["truncated"]) for i, o in enumerate(outs)]
        ntok = sum(len(e.response_ids) for e in eps)
        return eps, {"gen_s": dt, "gen_tokens": ntok, "gen_tok_s": ntok / dt}

    @endpoint
    async def update_weights(self, handle: WeightHandle) -> dict:
        """Pull weight version ``handle.version`` from the trainer; returns ``{"version", "sync_s", "sync_gb_s"}``."""
        async with self.lock:
            dt = await self.weights.pull(handle)
            self.version = handle.version
        return {"version": self.version, "sync_s": dt, "sync_gb_s": handle.nbytes / dt / 1e9}

    @endpoint
    async def get_version(self) -> int:
        """The policy version currently loaded."""
        return self.version

    @endpoint
    async def weights_digest(self) -> str:
        """sha256 of the loaded weights (see :meth:`FlatWeights.digest`)."""
        return self.weights.digest()

    @endpoint
    async def state_dict(self) -> dict:
        """The loaded weights as ``{name: tensor}`` (for tests on small models)."""
        return {k: v.clone() for k, v in self.model.state_dict().items()}
