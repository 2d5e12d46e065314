"""Prompt sources: GSM8K from the HF hub or from a local copy (a directory of ``train.jsonl`` and
``test.jsonl`` in the original format, one ``{"question": ..., "answer": "... #### N"}`` object per
line; see :class:`DataConfig`), and chat formatting. Bad rows are errors (:class:`DataError` naming
the file and line), not skips.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any, Optional

from forge_core.rewards import normalize_number

DEFAULT_SYSTEM_PROMPT = (
    "Solve the math problem in a few short steps, then give the final answer on the last line "
    "as '#### <number>'.\n\nExample:\nQuestion: Tom has 3 apples and buys 2 more. How many apples "
    "does he have now?\nAnswer: Tom has 3 + 2 = 5 apples.\n#### 5"
)


class DataError(ValueError):
    """A data source is missing, unreachable or malformed; the message names the file/line or dataset."""


@dataclass
class DataConfig:
    """Where prompts come from: ``dir``, a local directory with ``train.jsonl``/``test.jsonl``
    (default ``$GSM8K_DIR``; ``None``: the HF hub dataset ``hub_id``); ``split``, the training split;
    ``system_prompt``, the system message of every chat prompt; ``seed``, the shuffling seed of the
    prompt order (one permutation per epoch)."""

    dir: Optional[str] = "${oc.env:GSM8K_DIR,null}"
    hub_id: str = "openai/gsm8k"
    split: str = "train"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    seed: int = 0


@dataclass(frozen=True)
class Problem:
    """One GSM8K question. ``answer`` is the normalised final number (e.g. ``"72"``)."""

    id: str
    question: str
    answer: str


def parse_row(row: Any, where: str) -> Problem:
    """A :class:`Problem` from one GSM8K row (dict with ``question`` and ``answer``). Raises
    DataError naming ``where`` (``file:line``) if the row is malformed."""
    if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
        raise DataError(f"{where}: expected an object with string fields 'question' and 'answer'")
    if not row["question"].strip():
        raise DataError(f"{where}: the question is empty")
    _, marker, tail = row["answer"].rpartition("####")
    if not marker:
        raise DataError(f"{where}: answer has no '#### N' final-answer line")
    if (final := normalize_number(tail)) is None:
        raise DataError(f"{where}: the text after '####' is not a number: {tail!r}")
    return Problem(id=where, question=row["question"].strip(), answer=final)


def load_jsonl(path: str) -> list[Problem]:
    """All problems in a GSM8K JSONL file. Raises DataError if the file is missing, or a line is not
    UTF-8, not valid JSON or not a valid row (naming ``file:line``)."""
    if not os.path.isfile(path):
        raise DataError(f"GSM8K file not found: {path} (set data.dir or GSM8K_DIR to a directory "
                        f"holding train.jsonl and test.jsonl)")
    out = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                if (line := raw.decode("utf-8")).strip():
                    out.append(parse_row(json.loads(line), f"{path}:{i}"))
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{i}: not UTF-8 text (byte {e.start + 1} of the line)") from None
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not out:
        raise DataError(f"{path}: no rows")
    return out


def load_gsm8k(split: str, dir: Optional[str] = None, hub_id: str = "openai/gsm8k") -> list[Problem]:
    """GSM8K ``split`` ("train" or "test") from ``dir`` if given, else from the HF hub. Raises
    DataError for a missing/malformed local file, or when the hub cannot be reached (the message
    says how to point at a local copy)."""
    if dir:
        return load_jsonl(os.path.join(dir, f"{split}.jsonl"))
    try:
        import datasets
        ds = datasets.load_dataset(hub_id, "main", split=split)
    except Exception as e:  # offline, DNS failure, gated, ...
        raise DataError(
            f"could not load {hub_id} ({split}) from the HF hub: {type(e).__name__}: {str(e)[:200]}. "
            f"Without hub access, point at a local copy: GSM8K_DIR=/path/to/gsm8k or "
            f"data.dir=/path/to/gsm8k (a directory with train.jsonl and test.jsonl)") from None
    return [parse_row(r, f"{hub_id}/{split}[{i}]") for i, r in enumerate(ds)]


class PromptSource:
    """Endless, seeded stream of training problems: a fresh permutation each epoch. Its position
    (``epoch``, ``index``) is part of every checkpoint, so a resumed run sees exactly the batch the
    uninterrupted run would have seen next."""

    def __init__(self, problems: list[Problem], seed: int = 0):
        if not problems:
            raise DataError("the prompt source is empty")
        self.problems = problems
        self.load_state_dict({"seed": seed, "epoch": 0, "index": 0})

    def next_batch(self, n: int) -> list[Problem]:
        """The next ``n`` problems, wrapping into a new epoch (new permutation) when needed."""
        out = []
        while len(out) < n:
            if self.index == len(self._order):
                self.load_state_dict({"seed": self.seed, "epoch": self.epoch + 1, "index": 0})
            out.append(self.problems[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict:
        """``{"epoch", "index", "seed"}``: enough to resume the exact stream."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by :meth:`state_dict`."""
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]
        self._order = list(range(len(self.problems)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(self._order)


def chat_prompt(tokenizer: Any, question: str, system_prompt: str) -> str:
    """The chat-formatted prompt text (system + user turn + assistant header) for ``question``."""
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
