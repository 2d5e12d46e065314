"""GSM8K answer extraction and reward functions.

Two extraction modes, as in lm-evaluation-harness' ``gsm8k`` task (strict-match / flexible-extract):

- ``strict``: the number after the last ``####`` marker (the format GSM8K's own solutions use);
- ``flexible``: the last number anywhere in the text.

Both normalise a number the same way: thousands separators (``1,234``), currency signs
(``$``, ``€``, ``£``), a trailing period, a unicode minus, ``+`` signs, and decimals are
canonicalised so that ``$1,200.00`` and ``1200`` compare equal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Optional

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
        mode: answer extraction for correctness, ``"strict"`` or ``"flexible"``.
        correct: reward for a correct final answer.
        format_weight: added reward for a well-formed ``#### N`` answer line (format reward).
        fn: an extra reward term, ``"package.module:function"`` taking ``(response, target)`` and
            returning a float that is added to the reward (empty: none). A non-finite value poisons
            its group's advantages, so the trainer skips the step that would train on it.
    """

    mode: str = "strict"
    correct: float = 1.0
    format_weight: float = 0.2
    fn: str = ""


@dataclass
class Score:
    """One response's reward and its parts (``reward = correct * cfg.correct + formatted * cfg.format_weight``)."""

    reward: float
    correct: bool
    formatted: bool


def gsm8k_reward(response: str, target: str, cfg: RewardConfig) -> Score:
    """Score the generated text ``response`` against the GSM8K answer ``target`` (any format
    :func:`normalize_number` accepts) under ``cfg`` (a :class:`RewardConfig` or a DictConfig with its fields).

    Raises:
        ValueError: if ``target`` is not a number, or ``cfg.mode`` is unknown.
    """
    gold = normalize_number(target)
    if gold is None:
        raise ValueError(f"GSM8K target answer is not a number: {target!r}")
    correct = extract_answer(response, cfg.mode) == gold  # gold is a number, so a missing answer is wrong
    formatted = format_reward(response) > 0
    return Score(reward=cfg.correct * correct + cfg.format_weight * formatted, correct=correct, formatted=formatted)
