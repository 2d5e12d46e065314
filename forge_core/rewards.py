"""Reward functions: GSM8K answer extraction, the built-in ``gsm8k`` and ``math`` rewards, a
recipe's own reward function (``reward.fn``), and GSM8K scoring as lm-evaluation-harness does it.

Two extraction modes, as in lm-evaluation-harness' ``gsm8k`` task (strict-match / flexible-extract):

- ``strict``: the number after the last ``####`` marker (the format GSM8K's own solutions use);
- ``flexible``: the last number anywhere in the text.

Both normalise a number the same way: thousands separators (``1,234``), currency signs
(``$``, ``€``, ``£``), a trailing period, a unicode minus, ``+`` signs, and decimals are
canonicalised so that ``$1,200.00`` and ``1200`` compare equal.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Optional

from forge_core import import_source

# A number as models and GSM8K write it: optional sign and currency sign, digits with optional
# thousands separators, optional decimal part; or a bare decimal like ".5".
_NUM = r"(?:[-+\u2212]?\s*[$€£]?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+\u2212]?\s*[$€£]?\s*\.\d+)(?!\d)"
_NUM_RE = re.compile(_NUM)
_STRICT_RE = re.compile(r"####\s*(" + _NUM + r")")
# A finished answer line: generation can stop here (see ``generator.stop_after_answer``).
ANSWER_LINE_RE = re.compile(r"####\s*(?:" + _NUM + r")[^\n]*\n")

MODES = ("strict", "flexible")


def normalize_number(text: str) -> Optional[str]:
    """Canonical string for a number written in free text, or ``None`` if it is not one.

    ``"$1,234.50"`` -> ``"1234.5"``, ``"-3."`` -> ``"-3"``, ``"\u22127"`` -> ``"-7"``,
    ``"12.000"`` -> ``"12"``, ``"+4"`` -> ``"4"``, ``"0.50"`` -> ``"0.5"``; ``None`` too for a
    number of over 1,000 digits (``"1e5000"``: Python's int-to-str limit).
    """
    s = re.sub("[, $€£]", "", text.strip().replace("\u2212", "-")).rstrip(".").removeprefix("+")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    if not d.is_finite() or d.adjusted() > 1000:
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_answer(text: str, mode: str = "strict") -> Optional[str]:
    """The normalised final answer in the response ``text``, or ``None`` if there is none. ``mode``:
    ``"strict"`` (the number after the last ``####``) or ``"flexible"`` (the last number).

    Raises:
        ValueError: for an unknown ``mode``.
    """
    if mode not in MODES:
        raise ValueError(f"reward.mode must be one of {MODES}, got {mode!r}")
    matches = (_STRICT_RE if mode == "strict" else _NUM_RE).findall(text)
    return next((n for n in map(normalize_number, reversed(matches)) if n is not None), None)  # the last parseable


def format_reward(text: str) -> float:
    """1.0 if the response ends its reasoning with a parseable ``#### N`` line, else 0.0."""
    return 1.0 if extract_answer(text, "strict") is not None else 0.0


@dataclass
class RewardConfig:
    """How a response is scored.

    Attributes:
        fn: the reward function. A built-in, ``gsm8k`` (the final number, :func:`gsm8k_components`)
            or ``math`` (a LaTeX/boxed answer checked with the ``math-verify`` library,
            :func:`math_components`), or ``none`` (0: an environment's rewards alone, ``env.fn``); or a recipe's own, ``reward.py:score`` (a ``.py`` file, relative
            to the recipe folder so that a copied folder carries it, or absolute, and a function in
            it) or ``package.module:function``. It is called as ``fn(response: str, example: dict)``
            (``example``: the data row's fields plus ``target``, the mapped answer) and returns a float
            or a dict of named float components, which are logged apart (``reward/<name>``) and summed
            into the reward. A component named ``correct`` decides accuracy and pass@k (> 0: correct);
            without it, a reward > 0 counts as correct.
        mode: the built-in ``gsm8k``'s answer extraction, ``"strict"`` or ``"flexible"``.
        correct: the built-ins' reward for a correct final answer.
        format_weight: the built-ins' reward for a well-formed answer (``#### N`` for ``gsm8k``,
            ``\\boxed{...}`` for ``math``).
    """

    fn: str = "gsm8k"
    mode: str = "strict"
    correct: float = 1.0
    format_weight: float = 0.2


@dataclass
class Score:
    """One response's reward and its parts (``reward = correct * cfg.correct + formatted * cfg.format_weight``)."""

    reward: float
    correct: bool
    formatted: bool


def gsm8k_reward(response: str, target: str, cfg: RewardConfig) -> Score:
    """Score the generated text ``response`` against the GSM8K answer ``target`` (any format
    :func:`normalize_number` accepts, or a GSM8K solution ending in ``#### N``) under ``cfg`` (a
    :class:`RewardConfig` or a DictConfig with its fields).

    Raises:
        ValueError: if ``target`` is not a number, or ``cfg.mode`` is unknown.
    """
    gold = normalize_number(target.rpartition("####")[2])
    if gold is None:
        raise ValueError(f"GSM8K target answer is not a number: {target!r}")
    correct = extract_answer(response, cfg.mode) == gold  # gold is a number, so a missing answer is wrong
    formatted = format_reward(response) > 0
    return Score(reward=cfg.correct * correct + cfg.format_weight * formatted, correct=correct, formatted=formatted)


def gsm8k_components(response: str, example: dict, cfg: RewardConfig) -> dict[str, float]:
    """The built-in ``gsm8k`` reward as components ``{"correct": cfg.correct or 0, "format":
    cfg.format_weight or 0}`` (their sum is :func:`gsm8k_reward`'s reward, bit for bit) against
    ``example["target"]``. Raises ValueError if the target is not a number."""
    s = gsm8k_reward(response, str(example["target"]), cfg)
    return {"correct": cfg.correct * s.correct, "format": cfg.format_weight * s.formatted}


_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def math_components(response: str, example: dict, cfg: RewardConfig) -> dict[str, float]:
    """The built-in ``math`` reward: ``{"correct", "format"}``. The target (``example["target"]``: a
    bare answer such as ``\\frac{1}{2}``, or a solution with a ``\\boxed{...}`` answer, as MATH
    writes them) and the response are parsed with ``math_verify.parse`` (LaTeX and plain
    expressions; the last boxed answer first) and compared with ``math_verify.verify`` (symbolic
    equality: ``0.5`` = ``\\frac{1}{2}``, ``x=2`` = ``2``); ``format`` rewards a ``\\boxed{}`` answer.
    math-verify's timeouts use ``signal.alarm``, which works only in a main thread: elsewhere they
    are off and the actor call's deadline (``fault.call_timeout_s``) bounds a runaway parse.
    Source: HF Math-Verify (https://github.com/huggingface/Math-Verify)."""
    import threading

    from math_verify import parse, verify

    t = 5 if threading.current_thread() is threading.main_thread() else None
    target = str(example["target"])
    math_mode = "boxed" in target or (target.startswith("$") and target.endswith("$") and len(target) > 1)
    gold = parse(target if math_mode else f"${target}$", parsing_timeout=t)
    pred = parse(response, parsing_timeout=t)
    ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=t)
    return {"correct": cfg.correct * ok, "format": cfg.format_weight * bool(_BOXED_RE.search(response))}


def no_reward(response: str, example: dict, cfg: Optional[RewardConfig] = None) -> float:
    """``reward.fn: none``: 0 for every response; an environment's own rewards (``env`` component)
    are then the whole reward."""
    return 0.0


BUILTINS = {"gsm8k": gsm8k_components, "math": math_components, "none": no_reward}


class RewardError(ValueError):
    """A reward function cannot be loaded, has the wrong signature, or returned something that is
    not a finite float or a dict of them; the message names the function (and the example)."""


def load_reward_fn(cfg: Any) -> Callable[[str, dict], Any]:
    """The reward function ``cfg.fn`` names (see :class:`RewardConfig`; a built-in gets ``cfg`` bound).
    A ``.py`` path must be absolute here (the config loader resolves a recipe-relative one).

    Raises:
        RewardError: the file, module or function does not exist, or it does not take
            ``(response, example)`` (the message names ``reward.fn``).
    """
    spec = cfg.fn
    if spec in BUILTINS:
        return functools.partial(BUILTINS[spec], cfg=cfg)
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise RewardError(f"reward.fn={spec!r}: expected a built-in {sorted(BUILTINS)}, 'file.py:function' or "
                          f"'package.module:function'")
    try:
        mod = import_source(where, "forge_reward_")
    except FileNotFoundError:
        raise RewardError(f"reward.fn={spec!r}: no file {where}") from None
    except Exception as e:  # ImportError, a SyntaxError in the file, an error at its import
        raise RewardError(f"reward.fn={spec!r}: cannot import {where}: {type(e).__name__}: {e}") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        have = sorted(n for n, v in vars(mod).items() if callable(v) and not n.startswith("_")
                      and getattr(v, "__module__", None) == mod.__name__)
        raise RewardError(f"reward.fn={spec!r}: {where} has no function {name!r} (its functions: {have})")
    try:
        inspect.signature(fn).bind("response", {"target": ""})
    except TypeError:
        raise RewardError(f"reward.fn={spec!r}: {name}{inspect.signature(fn)} cannot be called as "
                          f"{name}(response: str, example: dict)") from None
    except ValueError:  # no signature (a builtin): let the call tell
        pass
    return fn


def reward_components(fn: Callable, spec: str, response: str, example: dict, where: str) -> dict[str, float]:
    """``fn(response, example)`` as named float components (a plain float: ``{}`` plus the reward
    under ``""``; see :func:`total`).

    Raises:
        RewardError: the call raised, or returned something that is not a finite number or a non-empty
            dict of ``str`` -> finite number; the message names ``spec``, ``where`` (the example) and the value.
    """
    try:
        out = fn(response, example)
    except Exception as e:
        raise RewardError(f"reward.fn={spec!r} raised {type(e).__name__}: {e} on {where}") from None
    items = out.items() if isinstance(out, dict) else [("", out)]
    comps = {}
    for k, v in items:
        if not isinstance(k, str) or isinstance(v, str) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RewardError(f"reward.fn={spec!r} returned {out!r} on {where}: expected a finite float or a dict "
                              f"of str -> finite float")
        comps[k] = float(v)
    if not comps:
        raise RewardError(f"reward.fn={spec!r} returned an empty dict on {where}")
    return comps


def total(components: dict[str, float]) -> float:
    """The reward: the sum of the components, in their order."""
    return sum(components.values())


def is_correct(components: dict[str, float]) -> bool:
    """Correct (accuracy, pass@k): the ``correct`` component > 0 when there is one, else the reward > 0."""
    return components["correct"] > 0 if "correct" in components else total(components) > 0


# ---- GSM8K scoring as lm-evaluation-harness's `gsm8k` task does it (its filters, its exact_match) ----------------
# lm-eval 0.4.13, lm_eval/tasks/gsm8k/gsm8k.yaml: filter "strict-match" = regex `#### (\-?[0-9\.\,]+)`, first
# match, then take_first; "flexible-extract" = regex `(-?[$0-9.,]{2,})|(-?[0-9]+)` with group_select -1 (the last
# match; of its groups the first non-empty), then take_first; a non-match is "[invalid]". The metric exact_match
# (lm_eval/api/metrics.py) removes the regexes ",", "\$", "(?s).*#### ", "\.$" from prediction and reference,
# lower-cases both (ignore_case) and compares the strings.
HARNESS_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
HARNESS_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_HARNESS_IGNORE = (",", "\\$", "(?s).*#### ", "\\.$")


def harness_extract(response: str, filter_name: str) -> str:
    """The answer lm-eval's ``gsm8k`` filter ``filter_name`` (``strict-match`` or
    ``flexible-extract``) takes from ``response``, or ``"[invalid]"`` (see the comment above).

    Raises:
        ValueError: an unknown filter name.
    """
    if filter_name not in ("strict-match", "flexible-extract"):
        raise ValueError(f"filter {filter_name!r}: strict-match or flexible-extract")
    found = (HARNESS_STRICT if filter_name == "strict-match" else HARNESS_FLEXIBLE).findall(response)
    if not found:
        return "[invalid]"
    m = found[0 if filter_name == "strict-match" else -1]
    if isinstance(m, tuple):
        m = next((x for x in m if x), "[invalid]")
    return m.strip()


def harness_exact_match(prediction: str, reference: str) -> bool:
    """lm-eval's ``exact_match`` with the ``gsm8k`` task's settings (see the comment above);
    ``reference`` is GSM8K's full answer field (``... #### 72``)."""
    for rx in _HARNESS_IGNORE:
        prediction, reference = re.sub(rx, "", prediction), re.sub(rx, "", reference)
    return prediction.lower() == reference.lower()
