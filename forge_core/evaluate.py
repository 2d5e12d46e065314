"""Held-out evaluation of a checkpoint on this machine's engine (``make eval RECIPE=... [CKPT=...]``).

vLLM on a machine with a CUDA GPU and the ``gpu`` extra (any recipe, any checkpoint: ``final/`` or
``checkpoints/step_N/``), transformers' ``generate`` on the CPU otherwise. The questions are the
recipe's held-out split (``data.test``), a fixed subset of ``eval.num_questions`` drawn with
``eval.seed``; each is answered ``eval.samples`` times with the evaluation's sampling settings
(``eval.temperature`` 0: greedy) and scored by the recipe's reward function (``reward.fn``), as the
evaluation during a run is. For the built-in ``gsm8k`` reward it also reports our strict and flexible
answer extraction and lm-evaluation-harness's ``strict-match`` and ``flexible-extract``
(:func:`forge_core.rewards.harness_extract`; the prompt here is the recipe's chat prompt, not the
harness's 5-shot one, so the scoring is comparable, the prompting is the recipe's). A recipe with an
environment (``env.fn``) is evaluated on multi-turn episodes through it, as during a run, and also
reports ``turns_mean``, ``tool_calls_mean`` and ``tool_error_rate``.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Optional

from tqdm import tqdm

from forge_core.data import chat_prompt, eval_subset, load_split
from forge_core.models import ModelConfig, ModelSourceError, hf_config_dict, load_tokenizer, pretrained_dir
from forge_core.rewards import (extract_answer, harness_exact_match, harness_extract, is_correct, load_reward_fn,
                                reward_components, total)


def pick_engine(engine: str = "auto") -> str:
    """``"vllm"`` when ``engine`` is ``vllm``, or ``auto`` on a machine with a CUDA GPU and vLLM
    installed; else ``"hf"``. Raises ModelSourceError for ``vllm`` without a GPU or vLLM."""
    import importlib.util

    import torch

    usable = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None
    if engine == "vllm" and not usable:
        raise ModelSourceError("engine vllm needs a CUDA GPU and the gpu extra (pip install -e '.[gpu]')")
    return "vllm" if engine == "vllm" or (engine == "auto" and usable) else "hf"


def evaluate(cfg: Any, ckpt: Optional[str] = None, progress: bool = True, engine: str = "auto",
             llm: Any = None) -> dict:
    """Evaluate ``ckpt`` (an HF-format checkpoint directory: ``config.json`` + ``model.safetensors``,
    e.g. ``runs/<recipe>/<run>/final``; ``None``: the recipe's base model) on ``cfg``'s held-out subset
    (see the module docstring) with ``engine`` (``auto``, ``vllm`` or ``hf``, :func:`pick_engine`).
    A checkpoint's own tokenizer files are used when it has them (``final/`` does). ``llm``: a vLLM
    engine of that checkpoint to use (:func:`vllm_engine`; a benchmark reuses one), else one is built.

    Returns ``{"model", "engine", "questions", "k", "pass@1", "pass@k" (k > 1), "reward_mean",
    "reward/<component>", "format_rate", "response_len_mean", "truncated_frac", "gen_s" (seconds of
    generation, the model's loading apart), "gen_tok_s" (generated tokens per second), "seconds" (all)}`` plus, for the ``gsm8k``
    reward, ``"accuracy_strict"``, ``"accuracy_flexible"``, ``"lm_eval_strict_match"`` and
    ``"lm_eval_flexible_extract"`` (means over all samples).

    Raises:
        FileNotFoundError: ``ckpt`` holds no ``config.json``.
        ModelSourceError: the checkpoint does not load, or its vocabulary is smaller than the tokenizer's.
        DataError: the held-out split does not load (``data.test``).
        RewardError: the reward function fails (names it and the example).
    """
    t0 = time.perf_counter()
    e = cfg.eval
    if ckpt is not None and not os.path.isfile(os.path.join(ckpt, "config.json")):
        raise FileNotFoundError(f"CKPT={ckpt}: not an HF checkpoint directory (no config.json)")
    own = ckpt and os.path.isfile(os.path.join(ckpt, "tokenizer_config.json"))
    tok = load_tokenizer(ModelConfig(name=cfg.model.name, path=ckpt) if own else cfg.model)
    problems = eval_subset(load_split(cfg.data, "test"), e.num_questions, e.seed)
    texts = [chat_prompt(tok, p, cfg.data.system_prompt) for p in problems]
    max_tokens = e.max_response_tokens or cfg.generator.max_response_tokens
    engine = "vllm" if llm is not None else pick_engine(engine)
    if engine == "vllm":
        llm = llm or vllm_engine(cfg, ckpt, max_tokens)
        tg = time.perf_counter()
        outs = (_episodes(cfg, tok, problems, max_tokens, _vllm_sampler(cfg, llm, tok)) if cfg.env.fn else
                vllm_generate(cfg, llm, tok, texts, max_tokens, progress))
    else:
        model = _hf_model(cfg, ckpt, tok)
        tg = time.perf_counter()
        outs = (_episodes(cfg, tok, problems, max_tokens, _hf_sampler(cfg, model, tok)) if cfg.env.fn else
                _hf_generate(cfg, model, tok, texts, max_tokens, progress))
    gen_s = time.perf_counter() - tg
    fn, k = load_reward_fn(cfg.reward), e.samples
    scored = []
    for i, o in enumerate(outs):
        p = problems[i // k]
        scored.append(reward_components(fn, cfg.reward.fn, o["text"], {**p.row, "target": p.answer}, f"example {p.id}"))
        if "env_reward" in o:  # a multi-turn episode: its environment's rewards, as during a run
            scored[-1]["env"] = o["env_reward"]
    correct = [is_correct(c) for c in scored]
    per_q = [any(correct[i:i + k]) for i in range(0, len(correct), k)]
    names = sorted({n for c in scored for n in c if n})
    res = {"model": ckpt or cfg.model.name, "engine": engine, "questions": len(problems), "k": k,
           "pass@1": statistics.fmean(correct), **({f"pass@{k}": statistics.fmean(per_q)} if k > 1 else {}),
           "reward_mean": statistics.fmean(map(total, scored)),
           **{f"reward/{n}": statistics.fmean(c.get(n, 0.0) for c in scored) for n in names},
           "format_rate": statistics.fmean(c.get("format", 0.0) > 0 for c in scored),
           "response_len_mean": statistics.fmean(len(o["response_ids"]) for o in outs),
           "truncated_frac": statistics.fmean(o["truncated"] for o in outs)}
    if cfg.reward.fn == "gsm8k":
        golds = [problems[i // k] for i in range(len(outs))]
        ref = [str(p.row.get("answer", p.answer)) if cfg.data.source == "gsm8k" else p.answer for p in golds]
        res.update(
            accuracy_strict=statistics.fmean(extract_answer(o["text"], "strict") == p.answer for o, p in zip(outs, golds)),
            accuracy_flexible=statistics.fmean(extract_answer(o["text"], "flexible") == p.answer
                                               for o, p in zip(outs, golds)),
            lm_eval_strict_match=statistics.fmean(harness_exact_match(harness_extract(o["text"], "strict-match"), r)
                                                  for o, r in zip(outs, ref)),
            lm_eval_flexible_extract=statistics.fmean(
                harness_exact_match(harness_extract(o["text"], "flexible-extract"), r) for o, r in zip(outs, ref)))
    if cfg.env.fn:
        calls = sum(o["tool_calls"] for o in outs)
        res.update(turns_mean=statistics.fmean(o["turns"] for o in outs), tool_calls_mean=calls / len(outs),
                   tool_error_rate=sum(o["tool_errors"] for o in outs) / calls if calls else 0.0)
    ntok = sum(len(o["response_ids"]) for o in outs)
    res.update(gen_s=gen_s, gen_tok_s=ntok / gen_s, seconds=time.perf_counter() - t0)
    return res


def _episodes(cfg: Any, tok: Any, problems: list, max_tokens: int, sample: Any) -> list[dict]:
    """Multi-turn episodes through the recipe's environment (``env.fn``, :func:`forge_core.rollout.rollout_episodes`),
    ``eval.samples`` per question, ``eval.batch_size`` questions at a time, as dicts: ``response_ids``
    (every token after the prompt), ``truncated``, ``text`` (the last model turn), ``env_reward``,
    ``turns``, ``tool_calls``, ``tool_errors``."""
    import torch
    from omegaconf import OmegaConf

    from forge_core.rollout import resolve_tool_format, rollout_episodes

    env = dict(OmegaConf.to_container(cfg.env, resolve=True), tool_format=resolve_tool_format(cfg.env.tool_format, tok))
    out, b = [], cfg.eval.batch_size
    for i in range(0, len(problems), b):
        torch.manual_seed(cfg.eval.seed + i)
        eps = rollout_episodes(problems[i:i + b], cfg.eval.samples, tok=tok, env_cfg=env,
                               system_prompt=cfg.data.system_prompt, max_prompt_tokens=cfg.generator.max_prompt_tokens,
                               max_response_tokens=max_tokens, version=0, sample=sample)
        out += [{"response_ids": e.response_ids, "truncated": e.truncated, "text": e.text, "env_reward": e.env_reward,
                 "turns": e.turns, "tool_calls": e.tool_calls, "tool_errors": e.tool_errors} for e in eps]
    return out


def _hf_sampler(cfg: Any, model: Any, tok: Any) -> Any:
    """One model turn per prompt with transformers (:func:`forge_core.actors.generator.hf_sample`), the
    evaluation's temperature (0: greedy) and top_p."""
    from forge_core.actors.generator import hf_sample

    e = cfg.eval
    return lambda prompts, budgets: hf_sample(model, tok, prompts, budgets, e.temperature or 1.0, e.top_p,
                                              greedy=e.temperature == 0)


def _vllm_sampler(cfg: Any, llm: Any, tok: Any) -> Any:
    """One model turn per prompt with vLLM: request ``i`` of each call seeded ``eval.seed + i`` (+ the
    turn), so the k samples of a question differ and a rerun repeats them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from forge_core.actors.vllm_generator import sampled_logprobs
    from forge_core.rollout import Sampled

    e, turn = cfg.eval, [0]

    def sample(prompts: list, budgets: list) -> list:
        sps = [SamplingParams(n=1, temperature=e.temperature, top_p=e.top_p, max_tokens=m, logprobs=0,
                              flat_logprobs=True, stop_token_ids=[tok.eos_token_id], detokenize=False,
                              seed=e.seed + 100_003 * turn[0] + i) for i, m in enumerate(budgets)]
        turn[0] += 1
        res = llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], sps, use_tqdm=False)
        return [Sampled(list(o.outputs[0].token_ids), sampled_logprobs(o.outputs[0]),
                        o.outputs[0].finish_reason == "stop") for o in res]

    return sample


def _sampling(cfg: Any, max_tokens: int) -> dict:
    e = cfg.eval
    return {"n": e.samples, "temperature": e.temperature, "top_p": e.top_p, "max_tokens": max_tokens}


def _hf_model(cfg: Any, ckpt: Optional[str], tok: Any) -> Any:
    """The checkpoint (or the recipe's model) for transformers on the CPU, in ``generator.dtype``."""
    import torch

    from forge_core.actors.process import resolve_dtype
    from forge_core.models import gqa_sdpa, load_model

    torch.set_num_threads(os.cpu_count() or 1)
    dtype = resolve_dtype(cfg.generator.dtype, "cpu", hf_config_dict(cfg.model.name)["hidden_size"], "eval")
    if ckpt is not None:
        from transformers import AutoModelForCausalLM
        try:
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation=gqa_sdpa()).eval()
        except Exception as err:  # no weights, a config.json without model_type, a truncated file, ...
            raise ModelSourceError(f"CKPT={ckpt}: cannot load it as an HF checkpoint: {str(err)[:500]}") from None
    else:
        model = load_model(cfg.model, dtype=dtype)
    if len(tok) > model.config.vocab_size:
        raise ModelSourceError(f"CKPT={ckpt or cfg.model.name}: a vocabulary of {model.config.vocab_size} ids, "
                               f"fewer than its tokenizer's {len(tok)}: a checkpoint of another model than RECIPE's?")
    return model


def _hf_generate(cfg: Any, model: Any, tok: Any, texts: list[str], max_tokens: int, progress: bool) -> list:
    """Batches of ``eval.batch_size`` prompts through transformers' ``generate`` on the CPU, with a tqdm bar."""
    from forge_core.actors.generator import hf_generate

    s, out = _sampling(cfg, max_tokens), []
    with tqdm(total=len(texts), desc="eval", unit="q", disable=not progress) as bar:
        for i in range(0, len(texts), cfg.eval.batch_size):
            chunk = texts[i:i + cfg.eval.batch_size]
            out += hf_generate(model, tok, chunk, s["n"], max_tokens, cfg.generator.max_prompt_tokens,
                               s["temperature"] or 1.0, s["top_p"], greedy=s["temperature"] == 0,
                               seed=cfg.eval.seed + i, stop_after_answer=cfg.reward.fn == "gsm8k")
            bar.update(len(chunk))
    return out


def vllm_engine(cfg: Any, ckpt: Optional[str], max_tokens: int) -> Any:
    """A vLLM engine of checkpoint ``ckpt`` (``None``: the recipe's pretrained weights) for
    evaluation: bf16, ``skip_tokenizer_init`` (the recipe's tokenizer makes the prompts), room for
    ``generator.max_prompt_tokens + max_tokens``, ``generator.gpu_memory_utilization`` of the GPU.
    Raises ModelSourceError when there are no weights (random init) or vLLM cannot load them."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as the generator's
    from vllm import LLM

    path = ckpt or pretrained_dir(cfg.model)
    if path is None:
        raise ModelSourceError(f"model {cfg.model.name} has random weights (model.init=random): nothing to evaluate")
    try:
        return LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16",
                   max_model_len=cfg.generator.max_prompt_tokens + max_tokens,
                   gpu_memory_utilization=cfg.generator.gpu_memory_utilization, seed=cfg.eval.seed)
    except Exception as err:
        raise ModelSourceError(f"CKPT={path}: vLLM cannot load it: {type(err).__name__}: {str(err)[:500]}") from None


def vllm_prompts(cfg: Any, tok: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of the chat-formatted ``texts``, left-truncated to ``generator.max_prompt_tokens``."""
    return [x[-cfg.generator.max_prompt_tokens:] for x in tok(texts, add_special_tokens=False).input_ids]


def vllm_sampling(cfg: Any, tok: Any, max_tokens: int) -> Any:
    """The evaluation's ``SamplingParams``: ``eval.samples`` per prompt, ``eval.temperature`` (0:
    greedy) and ``top_p``, EOS stops, token ids only, seeded with ``eval.seed``."""
    from vllm import SamplingParams

    s = _sampling(cfg, max_tokens)
    return SamplingParams(n=s["n"], temperature=s["temperature"], top_p=s["top_p"], max_tokens=max_tokens,
                          stop_token_ids=[tok.eos_token_id], detokenize=False, seed=cfg.eval.seed)


def vllm_generate(cfg: Any, llm: Any, tok: Any, texts: list[str], max_tokens: int, progress: bool) -> list:
    """All prompts in one ``LLM.generate`` (vLLM batches and schedules them; its own progress bar),
    token ids in and out; the responses decoded with the recipe's tokenizer."""
    from vllm.inputs import TokensPrompt

    res = llm.generate([TokensPrompt(prompt_token_ids=x) for x in vllm_prompts(cfg, tok, texts)],
                       vllm_sampling(cfg, tok, max_tokens), use_tqdm=progress)
    out, vocab = [], len(tok)  # once: len() of a HF tokenizer counts its added tokens each call
    for o in res:
        for c in o.outputs:
            r = list(c.token_ids)
            out.append({"response_ids": r, "truncated": c.finish_reason == "length",
                        "text": tok.decode([t for t in r if t < vocab], skip_special_tokens=True)})
    return out
