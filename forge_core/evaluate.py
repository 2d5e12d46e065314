"""Greedy GSM8K test accuracy on a fixed, seeded subset (``make eval RECIPE=... [CKPT=...]``)."""

from __future__ import annotations

import os
import random
import time
from typing import Any, Optional

from tqdm import tqdm

from forge_core.actors.generator import hf_generate
from forge_core.data import chat_prompt, load_gsm8k
from forge_core.models import (ModelConfig, ModelSourceError, gqa_sdpa, hf_config_dict, load_model,
                               load_tokenizer)
from forge_core.rewards import extract_answer


def evaluate(cfg: Any, ckpt: Optional[str] = None, progress: bool = True) -> dict:
    """Greedy-decode a fixed subset (``eval.num_questions`` test problems drawn with
    ``random.Random(eval.seed)``, in file order) with ``cfg``'s model, data, eval and
    generator.max_prompt_tokens, and score it.
    ``ckpt``: an HF-format checkpoint directory (e.g. ``runs/<recipe>/<run>/final``); ``None``
    evaluates the recipe's base model. Returns ``{"accuracy_strict", "accuracy_flexible",
    "format_rate", "n", "seconds", "model"}``. A checkpoint's own tokenizer files are used when it has
    them (``final/`` does). Raises FileNotFoundError if ``ckpt`` is given but holds no ``config.json``,
    ModelSourceError if it does not load or its vocabulary is smaller than the tokenizer's (the message
    names it)."""
    from forge_core.actors.process import resolve_dtype
    dtype = resolve_dtype(cfg.generator.dtype, "cpu", hf_config_dict(cfg.model.name)["hidden_size"], "eval")
    if ckpt is not None:
        if not os.path.isfile(os.path.join(ckpt, "config.json")):
            raise FileNotFoundError(f"CKPT={ckpt}: not an HF checkpoint directory (no config.json)")
        from transformers import AutoModelForCausalLM
        try:
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation=gqa_sdpa()).eval()
        except Exception as e:  # no weights, a config.json without model_type, a truncated file, ...
            raise ModelSourceError(f"CKPT={ckpt}: cannot load it as an HF checkpoint: {str(e)[:500]}") from None
    else:
        model = load_model(cfg.model, dtype=dtype)
    own = ckpt and os.path.isfile(os.path.join(ckpt, "tokenizer_config.json"))
    tok = load_tokenizer(ModelConfig(name=cfg.model.name, path=ckpt) if own else cfg.model)
    if len(tok) > model.config.vocab_size:
        raise ModelSourceError(f"CKPT={ckpt or cfg.model.name}: a vocabulary of {model.config.vocab_size} ids, "
                               f"fewer than its tokenizer's {len(tok)}: a checkpoint of another model than RECIPE's?")
    test = load_gsm8k("test", cfg.data.dir, cfg.data.hub_id)
    idx = random.Random(cfg.eval.seed).sample(range(len(test)), min(cfg.eval.num_questions, len(test)))
    problems = [test[i] for i in sorted(idx)]
    strict = flexible = fmt = 0
    t0 = time.perf_counter()
    with tqdm(total=len(problems), desc="eval (greedy)", unit="q", disable=not progress) as bar:
        for i in range(0, len(problems), cfg.eval.batch_size):
            chunk = problems[i:i + cfg.eval.batch_size]
            texts = [chat_prompt(tok, p.question, cfg.data.system_prompt) for p in chunk]
            outs = hf_generate(model, tok, texts, 1, cfg.eval.max_response_tokens, cfg.generator.max_prompt_tokens,
                               greedy=True)
            for p, o in zip(chunk, outs):
                s = extract_answer(o["text"], "strict")
                strict += s == p.answer
                fmt += s is not None
                flexible += extract_answer(o["text"], "flexible") == p.answer
            bar.update(len(chunk))
            bar.set_postfix(strict=f"{strict / (i + len(chunk)):.3f}", flexible=f"{flexible / (i + len(chunk)):.3f}")
    n = len(problems)
    return {"model": ckpt or cfg.model.name, "n": n, "accuracy_strict": strict / n, "accuracy_flexible": flexible / n,
            "format_rate": fmt / n, "seconds": time.perf_counter() - t0}
