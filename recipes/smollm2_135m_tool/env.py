"""This recipe's environment: the built-in tool environment with the calculator, plus a small
reward for a well-formed calculator call (a format reward, as GSM8K's ``####``: SmolLM2-135M rarely
writes the call at first, so the call itself is what GRPO can reinforce first).

A recipe environment is a skyrl-gym ``BaseTextEnv``; subclassing ``forge_core.environment.ToolEnv``
keeps its tool-call parsing, limits and error messages. Named in config.yaml as
``env.fn: env.py:MultiplyEnv``.
"""

from forge_core.environment import ToolEnv


class MultiplyEnv(ToolEnv):
    """:class:`ToolEnv` with ``env.tools`` (the calculator); a step whose tool calls all ran without
    error, the first such step of the episode, earns ``CALL_REWARD``."""

    CALL_REWARD = 0.2

    def __init__(self, env_config=None, extras=None):
        super().__init__(env_config, extras)
        self.rewarded = False

    def step(self, action: str):
        """The tool environment's step, with the call reward added (see the class docstring)."""
        out = super().step(action)
        m = out["metadata"]
        if m["tool_calls"] and not m["tool_errors"] and not self.rewarded:
            self.rewarded = True
            out["reward"] += self.CALL_REWARD
        return out
