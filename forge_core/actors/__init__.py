"""Monarch actors: generator, reward, reference model, trainer, replay buffer, each in its own process
(:mod:`.process` sets one up). This package imports no torch: the reward and buffer processes never load it."""
