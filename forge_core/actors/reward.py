"""The reward actor: scores episodes with the recipe's reward function (``reward.fn``)."""

from __future__ import annotations

from typing import Optional

from monarch.actor import Actor, endpoint

from forge_core.episode import Episode
from forge_core.rewards import RewardConfig, RewardError, is_correct, load_reward_fn, reward_components, total


class RewardActor(Actor):
    """Fills ``reward``, ``components``, ``correct`` and ``formatted`` of each episode with
    ``reward.fn`` (:func:`forge_core.rewards.load_reward_fn`) on its (last) response, plus an ``env``
    component in a multi-turn episode: the rewards its environment gave.

    ``reward_cfg``: the ``reward`` config section.

    Raises:
        RewardError: ``reward.fn`` cannot be loaded (names it).
    """

    def __init__(self, reward_cfg: RewardConfig):
        self.cfg = reward_cfg
        self.fn = load_reward_fn(self.cfg)

    @endpoint
    async def score(self, episodes: list[Episode]) -> tuple[list[Episode], Optional[str]]:
        """The same episodes, scored, and ``None``; or, when the reward function raises or returns
        something that is not a finite float or a dict of them, the episodes and the error message
        (naming the function, the example and the value): a deterministic fault of the recipe, which
        the controller stops on instead of respawning this actor."""
        try:
            for i, e in enumerate(episodes):
                comps = reward_components(self.fn, self.cfg.fn, e.text, {**e.example, "target": e.target},
                                          f"example {e.prompt_id} (response {i} of the batch)")
                if e.env_reward is not None:  # a multi-turn episode: the environment's rewards, summed
                    comps["env"] = e.env_reward
                e.reward, e.correct = total(comps), is_correct(comps)
                e.formatted = comps.get("format", 0.0) > 0
                e.components = {k: v for k, v in comps.items() if k}
        except RewardError as err:
            return episodes, str(err)
        return episodes, None
