"""Prompt sources and chat formatting.

A recipe's ``data`` section (:class:`DataConfig`) names where its prompts come from:

- ``source: gsm8k`` (default): GSM8K, from the HF hub (``openai/gsm8k``) or from a local copy
  (``dir``: ``train.jsonl`` and ``test.jsonl`` in the original format, one ``{"question": ...,
  "answer": "... #### N"}`` object per line); the target is the final number after ``####``.
- ``source: file``: a local ``.jsonl`` or ``.parquet`` file per split (``train``, ``test``: paths,
  relative to the recipe folder so that a copied folder carries its data, or absolute).
- ``source: hub``: an HF hub dataset (``hub_id``, ``hub_config``; ``train``/``test`` are split names).

For ``file`` and ``hub`` a field mapping names the prompt (``prompt_field``, a string; or
``messages_field``, a chat list of ``{"role", "content"}``) and the target (``answer_field``, kept
verbatim as a string; empty: no target). Parquet and hub data are read with HF ``datasets``; JSONL
with the reader here, so that a bad row is named by ``file:line``. Bad rows are errors
(:class:`DataError` naming the file and line, or the dataset and row index), never skips.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from forge_core.rewards import normalize_number

DEFAULT_SYSTEM_PROMPT = (
    "Solve the math problem in a few short steps, then give the final answer on the last line "
    "as '#### <number>'.\n\nExample:\nQuestion: Tom has 3 apples and buys 2 more. How many apples "
    "does he have now?\nAnswer: Tom has 3 + 2 = 5 apples.\n#### 5"
)
SOURCES = ("gsm8k", "file", "hub")


class DataError(ValueError):
    """A data source is missing, unreachable or malformed; the message names the file/line or dataset."""


@dataclass
class DataConfig:
    """Where prompts come from (see the module docstring).

    Attributes:
        source: ``gsm8k``, ``file`` or ``hub``.
        train: the training split: a split name (``gsm8k``, ``hub``) or a ``.jsonl``/``.parquet``
            path (``file``; relative to the recipe folder, resolved when the config loads).
        test: the held-out split for evaluation, as ``train``; empty: none.
        dir: ``gsm8k`` only: a local copy holding ``<split>.jsonl`` (default ``$GSM8K_DIR``;
            ``None``: the HF hub dataset ``hub_id``).
        hub_id, hub_config: the HF hub dataset and its configuration (``gsm8k``: ``openai/gsm8k``, ``main``).
        prompt_field: the row field holding the prompt text (``file``/``hub``).
        messages_field: the row field holding a chat ``messages`` list instead (empty: use ``prompt_field``).
        answer_field: the row field holding the target (empty: none; the reward gets the row).
        system_prompt: the system message put before a prompt that has none.
        seed: the shuffling seed of the prompt order (one permutation per epoch).
    """

    source: str = "gsm8k"
    train: str = "train"
    test: str = "test"
    dir: Optional[str] = "${oc.env:GSM8K_DIR,null}"
    hub_id: str = "openai/gsm8k"
    hub_config: Optional[str] = "main"
    prompt_field: str = "question"
    messages_field: str = ""
    answer_field: str = "answer"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    seed: int = 0


@dataclass(frozen=True)
class Problem:
    """One prompt of a dataset.

    Attributes:
        id: where it comes from (``file:line`` or ``dataset/split[index]``); the G episodes of a group share it.
        prompt: the user turn's text ("" when ``messages`` is given).
        answer: the target as the reward reads it (GSM8K: the normalised final number, e.g. ``"72"``).
        messages: a chat conversation to continue (``messages_field``), else empty.
        row: the data row's fields (what a recipe's reward function gets, plus ``target``).
    """

    id: str
    prompt: str
    answer: str
    messages: tuple = ()
    row: dict = field(default_factory=dict, compare=False)


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
    return Problem(id=where, prompt=row["question"].strip(), answer=final, row=row)


def map_row(row: Any, where: str, prompt_field: str = "prompt", answer_field: str = "answer",
            messages_field: str = "") -> Problem:
    """A :class:`Problem` from one row of a ``file``/``hub`` source through the field mapping.

    Raises:
        DataError: naming ``where`` when the row is not an object, a mapped field is missing (the
            message lists the fields the row has), the prompt is empty or not a string, the messages
            are not a list of ``{"role", "content"}`` strings, or the answer is missing (None).
    """
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object (a JSON dict), got {type(row).__name__}")
    for key, what in ((messages_field or prompt_field, "messages_field" if messages_field else "prompt_field"),
                      (answer_field, "answer_field")):
        if key and key not in row:
            raise DataError(f"{where}: no field {key!r} (data.{what}); the row has {sorted(row)}")
    if messages_field:
        msgs = row[messages_field]
        if not (isinstance(msgs, list) and msgs and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs)):
            raise DataError(f"{where}: field {messages_field!r} must be a non-empty list of "
                            f"{{'role': str, 'content': str}} messages")
        prompt, messages = "", tuple({"role": m["role"], "content": m["content"]} for m in msgs)
    else:
        if not isinstance(row[prompt_field], str) or not row[prompt_field].strip():
            raise DataError(f"{where}: field {prompt_field!r} (the prompt) is empty or not a string")
        prompt, messages = row[prompt_field].strip(), ()
    answer = ""
    if answer_field:
        if row[answer_field] is None:
            raise DataError(f"{where}: field {answer_field!r} (the answer) is null")
        answer = str(row[answer_field]).strip()
    return Problem(id=where, prompt=prompt, answer=answer, messages=messages, row=row)


def jsonl_rows(path: str) -> Iterable[tuple[Any, str]]:
    """``(row, "file:line")`` for every non-blank line of a JSONL file. Raises DataError if the file
    is missing, or a line is not UTF-8 or not valid JSON (naming ``file:line``)."""
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path}")
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                if (line := raw.decode("utf-8")).strip():
                    yield json.loads(line), f"{path}:{i}"
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{i}: not UTF-8 text (byte {e.start + 1} of the line)") from None
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno})") from None


def load_jsonl(path: str) -> list[Problem]:
    """All problems in a GSM8K JSONL file. Raises DataError if the file is missing, or a line is not
    UTF-8, not valid JSON or not a valid row (naming ``file:line``)."""
    if not os.path.isfile(path):
        raise DataError(f"GSM8K file not found: {path} (set data.dir or GSM8K_DIR to a directory "
                        f"holding train.jsonl and test.jsonl)")
    out = [parse_row(row, where) for row, where in jsonl_rows(path)]
    if not out:
        raise DataError(f"{path}: no rows")
    return out


def load_gsm8k(split: str, dir: Optional[str] = None, hub_id: str = "openai/gsm8k") -> list[Problem]:
    """GSM8K ``split`` ("train" or "test") from ``dir`` if given, else from the HF hub. Raises
    DataError for a missing/malformed local file, or when the hub cannot be reached (the message
    says how to point at a local copy)."""
    if dir:
        return load_jsonl(os.path.join(dir, f"{split}.jsonl"))
    ds = _hub(hub_id, "main", split, "GSM8K_DIR=/path/to/gsm8k or data.dir=/path/to/gsm8k (a directory with "
                                     "train.jsonl and test.jsonl)")
    return [parse_row(r, f"{hub_id}/{split}[{i}]") for i, r in enumerate(ds)]


def _hub(hub_id: str, config: Optional[str], split: str, local_hint: str):
    """``datasets.load_dataset(hub_id, config, split=split)``; DataError naming the dataset when it fails."""
    try:
        import datasets
        return datasets.load_dataset(hub_id, config or None, split=split)
    except Exception as e:  # offline, DNS failure, gated, a split or config that does not exist, ...
        raise DataError(f"could not load {hub_id} ({config or 'default'}, split {split!r}) from the HF hub: "
                        f"{type(e).__name__}: {str(e)[:300]}. Without hub access, point at a local copy: "
                        f"{local_hint}") from None


def load_split(data: Any, split: str) -> list[Problem]:
    """The problems of ``split`` (``"train"`` or ``"test"``) of the ``data`` config section.

    ``file`` sources read ``data.train``/``data.test`` (``.jsonl`` here, ``.parquet`` with HF
    ``datasets``), ``hub`` sources ``datasets.load_dataset(hub_id, hub_config, split=...)``, and
    ``gsm8k`` the GSM8K split of that name (:func:`load_gsm8k`).

    Raises:
        DataError: no such split configured (``data.test`` empty), a missing file, an unknown file
            type, an unreachable dataset, a field of the mapping that the data does not have (listing
            the fields it has), a malformed row (naming file:line or dataset/split[index]), or no rows.
    """
    name = data.train if split == "train" else data.test
    if not name:
        raise DataError(f"data.{split} is empty: this recipe has no {split} split")
    if data.source == "gsm8k":
        return load_gsm8k(name, data.dir, data.hub_id)
    keys = dict(prompt_field=data.prompt_field, answer_field=data.answer_field, messages_field=data.messages_field)
    if data.source == "file":
        if name.endswith(".jsonl"):
            out = [map_row(row, where, **keys) for row, where in jsonl_rows(name)]
        elif name.endswith(".parquet"):
            if not os.path.isfile(name):
                raise DataError(f"data.{split}: data file not found: {name}")
            import datasets
            ds = datasets.load_dataset("parquet", data_files=name, split="train")
            _check_columns(ds.column_names, keys, name)
            out = [map_row(r, f"{name}[{i}]", **keys) for i, r in enumerate(ds)]
        else:
            raise DataError(f"data.{split}={name}: a .jsonl or .parquet file is expected")
    else:
        ds = _hub(data.hub_id, data.hub_config, name, "data.source=file with data.train/test = local .jsonl or "
                                                       ".parquet files")
        _check_columns(ds.column_names, keys, f"{data.hub_id}/{name}")
        out = [map_row(r, f"{data.hub_id}/{name}[{i}]", **keys) for i, r in enumerate(ds)]
    if not out:
        raise DataError(f"data.{split}={name}: no rows")
    return out


def _check_columns(columns: list, keys: dict, where: str) -> None:
    for what, key in keys.items():
        if what == "prompt_field" and keys["messages_field"]:
            continue
        if key and key not in columns:
            raise DataError(f"{where}: no field {key!r} (data.{what}); its fields are {sorted(columns)}")


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


_CALCULATOR = re.compile(r"<<[^<>]*>>")


def has_conversation(problem: Problem) -> bool:
    """Whether ``problem``'s messages hold an assistant turn: an SFT run then trains on its
    assistant turns (:func:`forge_core.rollout.sft_conversation`) instead of a target text."""
    return any(m["role"] == "assistant" for m in problem.messages)


def sft_target(problem: Problem, data: Any) -> str:
    """The text an SFT run (``loss=sft``) trains ``problem``'s response on: the data's answer field as
    written (``file``/``hub``: ``answer_field``, e.g. a MATH solution), for GSM8K its worked solution
    ending in ``#### N`` with the calculator annotations (``<<48/2=24>>``) removed.

    A row whose ``messages`` hold assistant turns is a conversation, trained on those turns
    (:func:`forge_core.rollout.sft_conversation`): its target is ``""``.

    Raises:
        DataError: naming the row when the target is missing or empty.
    """
    if has_conversation(problem):
        return ""
    field_ = "answer" if data.source == "gsm8k" else data.answer_field
    text = problem.row.get(field_) if field_ else None
    text = _CALCULATOR.sub("", str(text)).strip() if text is not None else ""
    if not text:
        raise DataError(f"{problem.id}: no SFT target: field {field_ or '(data.answer_field)'!r} is missing or "
                        f"empty; an SFT run trains on the text of data.answer_field")
    return text


def eval_subset(problems: list[Problem], n: int, seed: int) -> list[Problem]:
    """A fixed, seeded subset of ``n`` held-out problems (all when fewer), in data order:
    ``random.Random(seed).sample`` of the indices, sorted."""
    idx = random.Random(seed).sample(range(len(problems)), min(n, len(problems)))
    return [problems[i] for i in sorted(idx)]


def chat_prompt(tokenizer: Any, problem: Any, system_prompt: str) -> str:
    """The chat-formatted prompt text (system + the problem's turns + the assistant header).
    ``problem``: a :class:`Problem` (its ``messages`` when it has them, else one user turn with its
    ``prompt``) or a plain question string. ``system_prompt`` goes first unless the messages bring
    their own system turn or it is empty."""
    if isinstance(problem, str):
        problem = Problem(id="", prompt=problem, answer="")
    return tokenizer.apply_chat_template(chat_messages(problem, system_prompt), tokenize=False,
                                         add_generation_prompt=True)


def chat_messages(problem: Problem, system_prompt: str) -> list[dict]:
    """The conversation a prompt starts: the problem's ``messages`` (copies), or one user turn with its
    ``prompt``, behind ``system_prompt`` unless the messages bring their own system turn or it is empty."""
    messages = [dict(m) for m in problem.messages] or [{"role": "user", "content": problem.prompt}]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages
