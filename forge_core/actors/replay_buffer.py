"""The replay buffer actor: bounded, FIFO, and evicts episodes older than the staleness bound."""

from __future__ import annotations

from collections import deque
from typing import Optional

from monarch.actor import Actor, endpoint

from forge_core.episode import Episode


class ReplayBuffer:
    """Episodes waiting to be trained on.

    Args:
        capacity: at most this many episodes are held; adding more evicts the oldest.
        max_staleness: an episode sampled with policy version v may train step s only if
            ``s - v <= max_staleness`` (off-policy staleness bound); older ones are evicted.
        oldest_version_first: :meth:`sample` takes the lowest policy versions first (in the order
            added among equals) instead of the order added: continuous rollouts add groups of
            several versions out of order, and an old group left for the next step might exceed
            the bound there.
    """

    def __init__(self, capacity: int, max_staleness: int, oldest_version_first: bool = False):
        self.capacity, self.max_staleness, self.oldest_version_first = capacity, max_staleness, oldest_version_first
        self.items: deque[Episode] = deque()
        self.evicted_stale = self.evicted_capacity = 0

    def add(self, episodes: list[Episode]) -> None:
        """Append episodes, evicting the oldest beyond ``capacity``."""
        self.items.extend(episodes)
        while len(self.items) > self.capacity:
            self.items.popleft()
            self.evicted_capacity += 1

    def sample(self, n: int, step: int) -> Optional[list[Episode]]:
        """The ``n`` oldest usable episodes for training step ``step`` (removed; the first added, or
        with ``oldest_version_first`` the lowest versions), or ``None`` if fewer than ``n`` are
        usable (nothing is removed then, except stale episodes)."""
        before = len(self.items)
        self.items = deque(e for e in self.items if step - e.policy_version <= self.max_staleness)
        self.evicted_stale += before - len(self.items)
        if len(self.items) < n:
            return None
        if self.oldest_version_first:
            take = set(sorted(range(len(self.items)), key=lambda i: (self.items[i].policy_version, i))[:n])
            out = [e for i, e in enumerate(self.items) if i in take]
            self.items = deque(e for i, e in enumerate(self.items) if i not in take)
            return sorted(out, key=lambda e: e.policy_version)
        return [self.items.popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def stats(self) -> dict:
        """``{"size", "evicted_stale", "evicted_capacity"}``."""
        return {"size": len(self.items), "evicted_stale": self.evicted_stale, "evicted_capacity": self.evicted_capacity}


class ReplayBufferActor(Actor):
    """:class:`ReplayBuffer` as a Monarch actor."""

    def __init__(self, capacity: int, max_staleness: int, oldest_version_first: bool = False):
        self.buf = ReplayBuffer(capacity, max_staleness, oldest_version_first)

    @endpoint
    async def add(self, episodes: list[Episode]) -> int:
        """Add episodes; returns the buffer size."""
        self.buf.add(episodes)
        return len(self.buf)

    @endpoint
    async def sample(self, n: int, step: int) -> Optional[list[Episode]]:
        """See :meth:`ReplayBuffer.sample`."""
        return self.buf.sample(n, step)

    @endpoint
    async def num_episodes(self) -> int:
        """Number of episodes held."""
        return len(self.buf)

    @endpoint
    async def stats(self) -> dict:
        """See :meth:`ReplayBuffer.stats`."""
        return self.buf.stats()

    @endpoint
    async def state(self) -> list[Episode]:
        """All held episodes (for checkpoints)."""
        return list(self.buf.items)

    @endpoint
    async def restore(self, episodes: list[Episode]) -> None:
        """Replace the contents (from a checkpoint)."""
        self.buf.items = deque(episodes)
