"""The unit of RL data: one prompt, one sampled response (or, in a multi-turn episode, every turn
after the prompt: the model's turns and the environment's tool messages), its reward, logprobs and
policy version."""

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
        response_ids: response tokens up to and including EOS (unpadded), ``[R_i]``; in a multi-turn
            episode every token after the first prompt, in order: each model turn as sampled and the
            template and tool-message tokens between turns (never re-tokenised:
            :mod:`forge_core.rollout`).
        behaviour_logprobs: the generator's logprobs of ``response_ids``, ``[R_i]`` (0.0 where
            ``loss_mask`` is 0: tokens the policy did not sample).
        loss_mask: ``[R_i]`` 0/1, 1 on tokens the policy sampled (the loss and KL see only these);
            None: every response token (single-turn).
        text: the decoded response (multi-turn: the last model turn's text, what ``reward.fn`` reads).
        turns, tool_calls, tool_errors: model turns, tool calls made, and those that failed (a raised,
            timed-out or over-long tool, a malformed or unknown call); ``tool_s``: seconds in tools.
        env_reward: the environment's rewards summed over the episode's steps (None: no environment).
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
    loss_mask: Optional[list[int]] = None
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    env_reward: Optional[float] = None

    def model_tokens(self) -> int:
        """Tokens of ``response_ids`` the policy sampled (all of them without ``loss_mask``)."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class Batch:
    """Episodes laid out as the generator lays them out: left-padded prompts, right-padded responses.

    Attributes (``B`` episodes, ``P`` prompt columns, ``R`` response columns):
        input_ids: ``[B, P + R]`` int64.
        attention_mask: ``[B, P + R]`` int64, 1 on real tokens.
        prompt_len: ``P``.
        response_mask: ``[B, R]`` float32, 1 on response tokens the policy sampled (an episode's
            ``loss_mask``; 0 on tool and template tokens of a multi-turn episode and on padding).
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
            mask = getattr(e, "loss_mask", None)  # (episode-like objects without one: single-turn)
            rmask[i, :r] = 1 if mask is None else torch.tensor(mask, dtype=torch.float32)
            beh[i, :r] = torch.tensor(e.behaviour_logprobs)
            if ref is not None:
                ref[i, :r] = torch.tensor(e.ref_logprobs)
    adv = torch.tensor([e.advantage for e in episodes], dtype=torch.float32)
    return Batch(ids, att, P, rmask, beh, ref, adv)
