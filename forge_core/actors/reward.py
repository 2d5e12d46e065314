"""The reward actor: scores episodes with the GSM8K answer and format rewards."""

from __future__ import annotations

import importlib

from monarch.actor import Actor, endpoint

from forge_core.episode import Episode
from forge_core.rewards import RewardConfig, gsm8k_reward


class RewardActor(Actor):
    """Fills ``reward``, ``correct`` and ``formatted`` of each episode (:func:`gsm8k_reward`).

    Raises:
        ValueError: ``reward.fn`` cannot be imported (names it).
    """

    def __init__(self, reward_cfg: dict):
        self.cfg = RewardConfig(**reward_cfg)
        self.extra = None
        if self.cfg.fn:
            mod, _, name = self.cfg.fn.partition(":")
            try:
                self.extra = getattr(importlib.import_module(mod), name)
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(f"reward.fn={self.cfg.fn!r}: cannot import it ({e}); "
                                 f"expected 'package.module:function'")

    @endpoint
    async def score(self, episodes: list[Episode]) -> list[Episode]:
        """The same episodes, scored (plus ``reward.fn``'s term when set)."""
        for e in episodes:
            s = gsm8k_reward(e.text, e.target, self.cfg)
            e.reward, e.correct, e.formatted = s.reward, s.correct, s.formatted
            if self.extra is not None:
                e.reward += float(self.extra(e.text, e.target))
        return episodes
