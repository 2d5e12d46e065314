"""Held-out evaluation: the requests and scores of both paths, the evaluation during a run
(:meth:`forge_core.controller.Controller.evaluate`) and ``make eval RECIPE=... [CKPT=...]``
(:func:`evaluate`), so that both give one score per checkpoint.

One code path by construction. ``make eval`` builds the run's own generator actor class in this
process (:func:`eval_generator`: vLLM's :class:`~forge_core.actors.vllm_generator.VllmGenerator` on a
machine with a CUDA GPU and the ``gpu`` extra, the CPU :class:`~forge_core.actors.generator.Generator`
otherwise), with the run's generator settings (engine limits such as ``generator.max_num_seqs``, the
dtype the run's generators resolved, recorded in ``final/forge.json``), loads the checkpoint through
the weight sync's own load (a staging buffer cast to that dtype, as the trainer publishes), and asks
it for the same generate calls as the run does (:func:`eval_calls`: the same questions in the same
calls, the same seeds, :func:`eval_sampling`'s settings), then scores them with the reward actor's
code and the same formulas (:func:`held_out_scores`). Greedy bf16 decoding is not batch-invariant: an
engine with other limits (vLLM's own defaults: 1,024 sequences at once on an 80 GB GPU, against the
run's 256) batches the questions otherwise and decodes other tokens, which is what made the two
scores of one checkpoint differ. ``responses_digest`` (sha256 of every response's token ids, in
question order) shows whether both paths sampled the same responses.

The questions are the recipe's held-out split (``data.test``), a fixed subset of ``eval.num_questions``
drawn with ``eval.seed``; each is answered ``eval.samples`` times (``eval.temperature`` 0: greedy) and
scored by the recipe's reward function (``reward.fn``). For the built-in ``gsm8k`` reward ``make eval``
also reports our strict and flexible answer extraction and lm-evaluation-harness's ``strict-match`` and
``flexible-extract`` (:func:`forge_core.rewards.harness_extract`; the prompt here is the recipe's chat
prompt, not the harness's 5-shot one, so the scoring is comparable, the prompting is the recipe's). A
recipe with an environment (``env.fn``) is evaluated on multi-turn episodes through it, as during a run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import hashlib
import json
import os
import statistics
import time
from typing import Any, Optional

from forge_core.data import eval_subset, load_split
from forge_core.models import ModelSourceError, hf_config_dict, pretrained_dir
from forge_core.rewards import RewardConfig, RewardError, extract_answer, harness_exact_match, harness_extract

RUN_INFO = "forge.json"  # in final/: what the run's generators were (their resolved dtype) and the version


def pick_engine(engine: str = "auto") -> str:
    """``"vllm"`` when ``engine`` is ``vllm``, or ``auto`` on a machine with a CUDA GPU and vLLM
    installed; else ``"hf"``. Raises ModelSourceError for ``vllm`` without a GPU or vLLM."""
    import importlib.util

    import torch

    usable = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None
    if engine == "vllm" and not usable:
        raise ModelSourceError("engine vllm needs a CUDA GPU and the gpu extra (pip install -e '.[gpu]')")
    return "vllm" if engine == "vllm" or (engine == "auto" and usable) else "hf"


def eval_sampling(cfg: Any) -> dict:
    """The evaluation's sampling settings, both paths: ``{"n": eval.samples, "temperature":
    eval.temperature (0: greedy), "top_p": eval.top_p, "max_tokens": eval.max_response_tokens or the
    rollouts' generator.max_response_tokens}`` (what a generator's ``generate`` takes as ``sampling``)."""
    from forge_core.services import eval_max_tokens

    e = cfg.eval
    return {"n": e.samples, "temperature": e.temperature, "top_p": e.top_p, "max_tokens": eval_max_tokens(cfg)}


def eval_calls(cfg: Any, n: int) -> list[tuple[int, int, int]]:
    """The generate calls of an evaluation of ``n`` questions, both paths: ``[(start, end, seed)]``,
    questions ``start:end`` in one call seeded ``eval.seed + start``. vLLM (``generator.backend``):
    one call per generator replica (``layout.generator.replicas`` contiguous blocks), so the engine
    batches and schedules them as it does during the run; transformers: ``eval.batch_size`` questions a
    call. During a run call ``i`` goes to replica ``i % replicas``; ``make eval`` makes them in order."""
    reps = max(int(cfg.layout.generator.replicas), 1)
    per = max(-(-n // reps) if cfg.generator.backend == "vllm" else int(cfg.eval.batch_size), 1)
    return [(s, min(s + per, n), int(cfg.eval.seed) + s) for s in range(0, n, per)]


def responses_digest(episodes: list) -> str:
    """sha256 of the episodes' response token ids, in order: equal when two evaluations sampled the
    same responses to the same questions."""
    h = hashlib.sha256()
    for e in episodes:
        h.update(json.dumps(list(e.response_ids)).encode())
    return h.hexdigest()


def held_out_scores(episodes: list, k: int) -> dict:
    """The scores of scored held-out ``episodes`` (question-major, ``k`` samples each), both paths:
    ``pass@1`` (the mean correctness of all samples), ``pass@k`` with k > 1 (the fraction of questions
    with at least one correct sample: the unbiased estimator of Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code", eq. 1, with n = k), ``questions``, ``k``,
    :func:`forge_core.metrics.batch_stats`' means (``reward_mean``, ``reward/<component>``,
    ``format_rate``, ``response_len_mean``, ``truncated_frac``, ``entropy``, ...; not ``accuracy``,
    which is pass@1) and ``responses_digest``."""
    from forge_core.metrics import batch_stats

    correct = [bool(e.correct) for e in episodes]
    per_q = [any(correct[i:i + k]) for i in range(0, len(correct), k)]
    stats = {key: v for key, v in batch_stats(episodes).items() if key != "accuracy"}
    return {"pass@1": statistics.fmean(correct), **({f"pass@{k}": statistics.fmean(per_q)} if k > 1 else {}),
            "questions": len(per_q), "k": k, **stats, "responses_digest": responses_digest(episodes)}


def evaluate(cfg: Any, ckpt: Optional[str] = None, progress: bool = True, engine: str = "auto",
             gen: Any = None) -> dict:
    """Evaluate ``ckpt`` (an HF-format checkpoint directory: ``config.json`` + ``*.safetensors``, e.g.
    ``runs/<recipe>/<run>/final``; ``None``: the recipe's base model) on ``cfg``'s held-out subset as
    the run evaluates (see the module docstring) with ``engine`` (``auto``, ``vllm`` or ``hf``,
    :func:`pick_engine`). ``gen``: a generator of :func:`eval_generator` to use (a benchmark reuses one).

    Returns ``{"model", "engine", "policy_version" (from ``final/forge.json``, else None), "dtype"}``,
    :func:`held_out_scores`' keys (``pass@1``, ``pass@k`` with k > 1, ``questions``, ``k``,
    ``reward_mean``, ``reward/<component>``, ``format_rate``, ``response_len_mean``, ``truncated_frac``,
    ``responses_digest``, ...), ``gen_s`` (seconds of generation, the model's loading apart),
    ``gen_tok_s`` (generated tokens per second), ``seconds`` (all), plus, for the ``gsm8k`` reward,
    ``accuracy_strict``, ``accuracy_flexible``, ``lm_eval_strict_match`` and ``lm_eval_flexible_extract``
    (means over all samples); with an environment also ``turns_mean``, ``tool_calls_mean`` and
    ``tool_error_rate``.

    Raises:
        FileNotFoundError: ``ckpt`` holds no ``config.json``.
        ModelSourceError: the checkpoint does not load (names the tensor or the file), or there are no
            weights to evaluate (a random-init model on vLLM).
        DataError: the held-out split does not load (``data.test``).
        RewardError: the reward function fails (names it and the example).
    """
    from forge_core.actors.reward import RewardActor
    from forge_core.config import to_dataclass

    t0 = time.perf_counter()
    e = cfg.eval
    if ckpt is not None and not os.path.isfile(os.path.join(ckpt, "config.json")):
        raise FileNotFoundError(f"CKPT={ckpt}: not an HF checkpoint directory (no config.json)")
    problems = eval_subset(load_split(cfg.data, "test"), e.num_questions, e.seed)
    engine = "vllm" if gen is not None and type(gen).__name__ == "VllmGenerator" else pick_engine(engine)
    cfg = eval_config(cfg, engine, run_info(ckpt).get("generator_dtype"))
    gen = gen or eval_generator(cfg, ckpt)
    tg, episodes = time.perf_counter(), []
    from tqdm import tqdm
    calls = eval_calls(cfg, len(problems))
    with tqdm(total=len(problems), desc="eval", unit="q", disable=not progress) as bar:
        for start, end, seed in calls:
            got, _ = local_call(gen, "generate", problems[start:end], seed, eval_sampling(cfg))
            episodes += got
            bar.update(end - start)
    gen_s = time.perf_counter() - tg
    episodes, error = local_call(RewardActor(to_dataclass(cfg.reward, RewardConfig)), "score", episodes)
    if error:
        raise RewardError(error)
    info = run_info(ckpt)
    res = {"model": ckpt or cfg.model.name, "engine": engine, "policy_version": info.get("policy_version"),
           "dtype": local_call(gen, "get_dtype"), **held_out_scores(episodes, e.samples)}
    if cfg.reward.fn == "gsm8k":
        golds = [problems[i // e.samples] for i in range(len(episodes))]
        ref = [str(p.row.get("answer", p.answer)) if cfg.data.source == "gsm8k" else p.answer for p in golds]
        texts = [ep.text for ep in episodes]
        res.update(
            accuracy_strict=statistics.fmean(extract_answer(t, "strict") == p.answer for t, p in zip(texts, golds)),
            accuracy_flexible=statistics.fmean(extract_answer(t, "flexible") == p.answer for t, p in zip(texts, golds)),
            lm_eval_strict_match=statistics.fmean(harness_exact_match(harness_extract(t, "strict-match"), r)
                                                  for t, r in zip(texts, ref)),
            lm_eval_flexible_extract=statistics.fmean(
                harness_exact_match(harness_extract(t, "flexible-extract"), r) for t, r in zip(texts, ref)))
    ntok = sum(len(ep.response_ids) for ep in episodes)
    res.update(gen_s=gen_s, gen_tok_s=ntok / gen_s, seconds=time.perf_counter() - t0)
    return res


def local_call(actor: Any, endpoint: str, *args: Any) -> Any:
    """Run endpoint ``endpoint`` of an actor built in this process (not spawned) with ``args``."""
    return asyncio.run(getattr(type(actor), endpoint)._method(actor, *args))


def run_info(ckpt: Optional[str]) -> dict:
    """``final/forge.json`` of checkpoint ``ckpt``: ``{"generator_dtype": the dtype the run's generators
    resolved and sampled in, "policy_version": the version saved}``; ``{}`` without one (a base model,
    ``checkpoints/step_N/``, a checkpoint of another tool)."""
    path = os.path.join(ckpt, RUN_INFO) if ckpt else ""
    if not path or not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def eval_config(cfg: Any, engine: str, dtype: Optional[str]) -> Any:
    """``cfg`` for ``engine`` (``vllm``: ``device=cuda``, ``generator.backend=vllm``; ``hf``: the CPU
    backend), with ``generator.dtype`` the run's resolved ``dtype`` when ``auto`` and one is known."""
    from omegaconf import OmegaConf

    g = {"backend": engine}
    if dtype and cfg.generator.dtype == "auto":
        g["dtype"] = dtype
    out = OmegaConf.merge(cfg, {"device": "cuda" if engine == "vllm" else "cpu", "generator": g})
    OmegaConf.set_readonly(out, True)
    return out


def eval_generator(cfg: Any, ckpt: Optional[str]) -> Any:
    """The run's generator actor for ``cfg.generator.backend`` (``vllm`` or ``hf``), built in this
    process with the run's own constructor arguments (:func:`forge_core.services.actor_kwargs`: the
    ``generator`` section, the data's system prompt, the ``env`` section; vLLM on GPUs ``0..tp-1`` of
    this machine, awake, room for the evaluation's tokens) and holding ``ckpt``'s weights (or the
    recipe's pretrained ones), loaded as a weight sync loads them (:func:`load_checkpoint`). Its
    tokenizer is the checkpoint's own when it has one (``final/`` does), else the recipe's.

    Raises:
        ModelSourceError: no weights to evaluate on vLLM (a random-init model), or the checkpoint's do not load.
    """
    from forge_core.layout import Plan, Slot
    from forge_core.services import actor_kwargs

    vllm = cfg.generator.backend == "vllm"
    if ckpt is not None:
        from transformers import AutoConfig
        try:
            conf = AutoConfig.from_pretrained(ckpt)
        except Exception as err:  # a config.json without model_type, not JSON, ...
            raise ModelSourceError(f"CKPT={ckpt}: cannot load it as an HF checkpoint: {str(err)[:500]}") from None
    src = ckpt or pretrained_dir(cfg.model)
    if src is None and vllm:
        raise ModelSourceError(f"model {cfg.model.name} has random weights (model.init=random): nothing to evaluate")
    if vllm:
        import torch

        slot = Slot(0, list(range(int(cfg.layout.generator.tp))))
        plan = Plan([slot], Slot(0, []), Slot(0, []), False, torch.cuda.device_count())
    else:
        slot = Slot(0)
        plan = Plan([slot], Slot(0), Slot(0))
    kw = actor_kwargs(cfg, "generator", slot, plan, name="generator")
    if ckpt and os.path.isfile(os.path.join(ckpt, "tokenizer_config.json")):
        kw["model"] = dataclasses.replace(kw["model"], path=ckpt)  # its tokenizer (on the CPU, its architecture too)
    if vllm:
        from forge_core.actors.vllm_generator import VllmGenerator as cls
    else:
        from forge_core.actors.generator import Generator as cls
        kw["cores_dir"] = ""  # alone here: every core
    try:
        gen = cls(**kw)
    except Exception as err:  # transformers reading a checkpoint's files (CPU): truncated, not safetensors, ...
        if vllm or kw["model"].path != ckpt:
            raise
        raise ModelSourceError(f"CKPT={ckpt}: cannot load it as an HF checkpoint: {str(err)[:500]}") from None
    if ckpt is not None and len(gen.tok) > conf.vocab_size:
        raise ModelSourceError(f"CKPT={ckpt}: a vocabulary of {conf.vocab_size} ids, fewer than its tokenizer's "
                               f"{len(gen.tok)}: a checkpoint of another model than RECIPE's?")
    if not vllm:
        import torch

        torch.set_num_threads(len(os.sched_getaffinity(0)))
    if src is not None:
        load_checkpoint(gen, cfg, src)
    return gen


def load_checkpoint(gen: Any, cfg: Any, src: str) -> None:
    """Load the HF weights of ``src`` (a checkpoint directory or hub id) into generator ``gen`` as a
    weight sync does: every published tensor (the model's HF layout,
    :func:`forge_core.titan_spec.hf_layout`) cast into a staging buffer of the generator's dtype
    (:class:`forge_core.weight_sync.StagingBuffer`: the same cast as the trainer's publish), then the
    generator's ``update_weights`` (vLLM: its ``load_weights`` in the engine; transformers: a copy).

    Raises:
        ModelSourceError: no safetensors in ``src``, or a tensor of the layout missing from them or of
            another shape (names it).
    """
    import torch
    from safetensors import safe_open

    from forge_core.titan_spec import hf_layout
    from forge_core.weight_sync import StagingBuffer

    path = src
    if not os.path.isdir(path):  # a hub id
        from huggingface_hub import snapshot_download
        path = snapshot_download(src, allow_patterns=["*.safetensors", "*.json"])
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelSourceError(f"CKPT={src}: no *.safetensors weights")
    layout = hf_layout(hf_config_dict(cfg.model.name))
    dtype = getattr(torch, local_call(gen, "get_dtype"))
    device = "cuda" if cfg.generator.backend == "vllm" else "cpu"
    buf = StagingBuffer(layout, dtype, device)
    want = {n for n, *_ in layout}

    def tensors():
        for f in files:
            with safe_open(f, "pt") as st:
                for name in st.keys():
                    if name in want:
                        yield name, st.get_tensor(name).to(device)

    try:
        try:
            buf.fill(tensors())
        except ValueError as err:
            raise ModelSourceError(f"CKPT={src}: not a checkpoint of {cfg.model.name}: {err}") from None
        except Exception as err:  # safetensors: a truncated or damaged file
            raise ModelSourceError(f"CKPT={src}: cannot load it as an HF checkpoint: {str(err)[:500]}") from None
        version = run_info(src if os.path.isdir(src) else None).get("policy_version", 0)
        local_call(gen, "update_weights", buf.handle(version))
    finally:
        buf.close()
