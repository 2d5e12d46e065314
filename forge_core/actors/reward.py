"""The reward actor: scores episodes with the GSM8K answer and format rewards."""

from __future__ import annotations

from monarch.actor import Actor, endpoint

from forge_core.episode import Episode
from forge_core.rewards import RewardConfig, gsm8k_reward


class RewardActor(Actor):
    """Fills ``reward``, ``correct`` and ``formatted`` of each episode (:func:`gsm8k_reward`)."""

    def __init__(self, reward_cfg: dict):
        self.cfg = RewardConfig(**reward_cfg)

    @endpoint
    async def score(self, episodes: list[Episode]) -> list[Episode]:
        """The same episodes, scored."""
        for e in episodes:
            s = gsm8k_reward(e.text, e.target, self.cfg)
            e.reward, e.correct, e.formatted = s.reward, s.correct, s.formatted
        return episodes
