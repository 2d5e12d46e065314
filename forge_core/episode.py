"""The unit of RL data: one prompt, one sampled response, its reward, logprobs and policy version."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # torch is imported where collate runs: the reward and buffer processes never load it
    import torch


@dataclass
class Episode:
    """One rollout.

    Attributes:
        prompt_id: id of the source problem (``file:line``); the G episodes of a group share it.
        group: index of its group within the rollout batch.
        target: the reference answer (the data's ``answer_field``; GSM8K: the final number).
        example: the data row the prompt came from (what a recipe's reward function reads).
        prompt_ids: prompt tokens (unpadded), ``[P_i]``.
        response_ids: response tokens up to and including EOS (unpadded), ``[R_i]``.
        behaviour_logprobs: the generator's logprobs of ``response_ids``, ``[R_i]``.
        text: the decoded response.
        policy_version: the generator's weight version that sampled it.
        replica: the generator replica that sampled it.
        truncated: hit the response-token budget without EOS.
        reward, correct, formatted: filled by the reward actor; ``components``: the reward's named
            parts (``reward.fn`` returning a dict; their sum is ``reward``).
        ref_logprobs: the reference model's logprobs of ``response_ids``, ``[R_i]``.
        advantage: the group-normalised advantage (a scalar per episode).
    """

    prompt_id: str
    group: int
    target: str
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    text: str
    policy_version: int
    replica: int = 0
    truncated: bool = False
    reward: float = 0.0
    correct: bool = False
    formatted: bool = False
    components: dict = field(default_factory=dict)
    example: dict = field(default_factory=dict)
    ref_logprobs: Optional[list[float]] = None
    advantage: float = 0.0


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class Batch:
    """Episodes laid out as the generator lays them out: left-padded prompts, right-padded responses.

    Attributes (``B`` episodes, ``P`` prompt columns, ``R`` response columns):
        input_ids: ``[B, P + R]`` int64.
        attention_mask: ``[B, P + R]`` int64, 1 on real tokens.
        prompt_len: ``P``.
        response_mask: ``[B, R]`` float32, 1 on response tokens.
        behaviour_logprobs, ref_logprobs: ``[B, R]`` float32 (ref is None if absent).
        advantages: ``[B]`` float32.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    response_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    ref_logprobs: Optional[torch.Tensor]
    advantages: torch.Tensor


def collate(episodes: list[Episode], pad_id: int, pad_to: int = 32) -> Batch:
    """Pad ``episodes`` into a :class:`Batch`. ``P`` and ``R`` are rounded up to ``pad_to`` so that
    CPU kernels see few distinct shapes (oneDNN compiles one kernel per shape).

    Raises:
        ValueError: if ``episodes`` is empty.
    """
    import torch

    if not episodes:
        raise ValueError("collate: no episodes")
    B = len(episodes)
    P = _round_up(max(len(e.prompt_ids) for e in episodes), pad_to)
    R = _round_up(max(max(len(e.response_ids) for e in episodes), 1), pad_to)
    ids, att = torch.full((B, P + R), pad_id, dtype=torch.long), torch.zeros((B, P + R), dtype=torch.long)
    rmask, beh = torch.zeros((B, R)), torch.zeros((B, R))
    ref = torch.zeros((B, R)) if all(e.ref_logprobs is not None for e in episodes) else None
    for i, e in enumerate(episodes):
        p, r = len(e.prompt_ids), len(e.response_ids)
        ids[i, P - p:P] = torch.tensor(e.prompt_ids)
        att[i, P - p:P] = 1
        if r:
            ids[i, P:P + r] = torch.tensor(e.response_ids)
            att[i, P:P + r] = 1
            rmask[i, :r] = 1
            beh[i, :r] = torch.tensor(e.behaviour_logprobs)
            if ref is not None:
                ref[i, :r] = torch.tensor(e.ref_logprobs)
    adv = torch.tensor([e.advantage for e in episodes], dtype=torch.float32)
    return Batch(ids, att, P, rmask, beh, ref, adv)
