"""The controller's rollout loop: rollout batches generated over the generator replicas, then scored,
given reference logprobs and group advantages, and put into the replay buffer (the left column of
:mod:`forge_core.controller`'s drawing). :class:`RolloutLoop` is a part of
:class:`~forge_core.controller.Controller` (its state: ``cfg``, ``svc``, the batch counters, the
``changed`` condition); the rollout of one episode, single- or multi-turn, happens inside a generator
replica (:mod:`forge_core.rollout`). :class:`Dispatcher` spreads a batch's groups over the replicas.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Optional

import torch

from forge_core.advantages import compute_advantages
from forge_core.episode import Episode
from forge_core.services import RunFailed, call


class RolloutLoop:
    """The rollout loop's methods of :class:`~forge_core.controller.Controller`, in the order a batch
    goes through them: which replicas may generate it, generating it, finishing it (reward,
    reference, advantages, buffer)."""

    def _eligible(self, k: int) -> list[int]:
        """Replicas that may generate batch ``k``: policy version >= the step it will train at
        (``k`` less the batches dropped so far) - S; none given up (``fault.min_replicas``)."""
        return [i for i, v in enumerate(self.versions)
                if v >= k - self.skipped_batches - self.cfg.max_staleness and i not in self.dropped]

    async def _generate(self, problems: list, k: int, replicas: list[int], rnd: int = 0) -> tuple[list[Episode], dict]:
        """Generate batch ``k`` (refill round ``rnd``) over ``replicas`` (whole groups each; the groups of
        a replica dropped meanwhile go to the others); episodes in problem order."""
        cfg, G = self.cfg, self.cfg.generator.group_size
        t0 = time.perf_counter()

        async def one(r: int, groups: list[int]) -> tuple[list[Episode], dict]:
            return await self._supervised(self.svc.generators[r].name, "generate", [problems[i] for i in groups],
                                          cfg.seed * 100_003 + k * 1_009 + r + rnd * 1_000_003,
                                          tokens=len(groups) * G * cfg.generator.max_response_tokens)

        out: list[Optional[Episode]] = [None] * (len(problems) * G)
        got = await self._spread(len(problems), replicas, lambda: self._eligible(k), one)
        for r, groups, (eps, _) in got:
            for j, e in enumerate(eps):
                g = groups[j // G]
                e.group, e.replica = g, r
                out[g * G + j % G] = e
        dt = time.perf_counter() - t0
        tokens = sum(st["gen_tokens"] for *_, (_, st) in got)
        return out, {"gen_s": dt, "gen_tokens": tokens, "gen_tok_s": tokens / dt,
                     "gen_replicas": len({r for r, *_ in got})}

    async def rollout_loop(self) -> None:
        """Produce rollout batches until cancelled (see the module docstring), finishing one at a time
        in a task, in order, so the buffer sees the same batches in the same order. New prompts for
        groups a batch lost (``advantage.drop_zero_variance``) come first, with that batch's replicas.
        A failure is handed to the training loop (``background_error``), which raises it."""
        finishing: Optional[asyncio.Task] = None
        try:
            try:
                while True:
                    async with self.changed:
                        await self.changed.wait_for(lambda: not self.paused and not self.loading and (
                            self.refills or self.buffered < self.B and self._eligible(self.batches_made)
                            and self.batches_made < self._batches_wanted()))
                        # (not while loading, else the first replica to load the new version takes every group;
                        # none beyond the last step: no generation competes with the last step or is cut at exit)
                        self.rollouts_in_flight += 1
                        if self.refills:
                            k, n, rnd = self.refills.pop(0)
                        else:
                            k, n, rnd = self.batches_made, self.cfg.prompts_per_step, 0
                            self.batches_made += 1
                        problems = self.source.next_batch(n)
                        replicas = self._eligible(k)
                    try:
                        episodes, gen = await self._generate(problems, k, replicas, rnd)
                        if finishing is not None:
                            await finishing
                    except BaseException:
                        await self._set(rollouts_in_flight=self.rollouts_in_flight - 1)
                        raise
                    finishing = asyncio.create_task(self._finish(episodes, gen, k, rnd))
            finally:
                if finishing is not None and not finishing.done():
                    finishing.cancel()
                    await asyncio.wait([finishing])  # its clean-up (the in-flight count) ends before this loop does
                elif finishing is not None and not finishing.cancelled():
                    finishing.exception()  # retrieved: its failure reached the training loop as background_error
        except Exception as e:
            await self._set(background_error=e)
            raise

    async def _finish(self, episodes: list[Episode], gen: dict, k: int = 0, rnd: int = 0) -> None:
        """Reward, reference logprobs and group advantages of one generated batch (``k``, refill round
        ``rnd``), then into the replay buffer. With ``advantage.drop_zero_variance``, groups whose
        rewards are all equal are dropped and as many new prompts queued for batch ``k`` (``refills``),
        up to ``advantage.max_refills`` rounds; then they are kept (advantage 0). A failure becomes
        ``background_error`` (the training loop raises it)."""
        cfg, s = self.cfg, self.svc
        try:
            t0 = time.perf_counter()
            episodes = await self._score(episodes)
            reward_s = time.perf_counter() - t0
            tokens = sum(len(e.prompt_ids) + len(e.response_ids) for e in episodes)
            ranks = await self._supervised("reference", "logprobs", episodes, tokens=tokens, all_ranks=True)
            for lists, _ in ranks:
                for e, lp in zip(episodes, lists):
                    if lp is not None:
                        e.ref_logprobs = lp
            rewards = torch.tensor([e.reward for e in episodes]).view(-1, cfg.generator.group_size)
            finite = torch.isfinite(rewards).all(1, keepdim=True)
            adv, keep, adv_m = compute_advantages(rewards.where(finite, 0.0), cfg.advantage)
            adv = adv.where(finite, float("nan"))  # a non-finite reward poisons its group: the step is skipped
            for e, a in zip(episodes, adv.flatten().tolist()):
                e.advantage = a
            if lost := int((~keep).sum()):
                if rnd < cfg.advantage.max_refills:
                    episodes = [e for e in episodes if bool(keep[e.group])]
                    self.refills.append([k, lost, rnd + 1])
                else:
                    adv_m["dropped_groups"] = 0.0
            size = await call("replay_buffer", s.buffer.add, episodes, timeout_s=self._deadline(0))
            self.rollout_stats.append(dict(gen, reward_s=reward_s, ref_s=max(secs for _, secs in ranks), **adv_m))
            await self._set(buffered=size)
        except Exception as e:
            await self._set(background_error=e)
            raise
        finally:
            await self._set(rollouts_in_flight=self.rollouts_in_flight - 1)

    async def _score(self, episodes: list[Episode]) -> list[Episode]:
        """``episodes`` scored by the reward actor. Raises RunFailed when the recipe's reward function
        raised or returned something that is not a finite float or a dict of them (a fault of the recipe,
        not of the actor: no respawn; the message names the function, the example and the value)."""
        episodes, error = await self._supervised("reward", "score", episodes)
        if error:
            raise RunFailed(f"{error}; the run stops after step {self.step}")
        return episodes


class Dispatcher:
    """Spreads the prompt groups of a rollout batch over ``replicas`` generator replicas. A group is
    never split; each goes to the replica expected to finish it first, from its outstanding groups
    and measured speed (an exponential moving average of groups per second, the newest measurement
    weighted ``alpha``), so a slow replica gets less work. Pure bookkeeping, no actor calls."""

    def __init__(self, replicas: int, alpha: float = 0.5):
        self.rate: list[Optional[float]] = [None] * replicas  # groups / s
        self.outstanding, self.alpha = [0] * replicas, alpha

    def assign(self, n_groups: int, eligible: list[int]) -> dict[int, list[int]]:
        """``{replica: [group indices]}`` for ``n_groups`` groups over the ``eligible`` replicas
        (their outstanding counts grow by what they get). Raises ValueError when none is eligible."""
        if not eligible:
            raise ValueError("no generator replica is eligible (all too stale)")
        known = [r for r in self.rate if r]
        default = statistics.fmean(known) if known else 1.0
        out: dict[int, list[int]] = {r: [] for r in eligible}
        for g in range(n_groups):
            best = min(eligible, key=lambda r: ((self.outstanding[r] + 1) / (self.rate[r] or default), r))
            out[best].append(g)
            self.outstanding[best] += 1
        return {r: gs for r, gs in out.items() if gs}

    def done(self, replica: int, groups: int, seconds: float) -> None:
        """Record that ``replica`` finished ``groups`` groups in ``seconds``."""
        self.outstanding[replica] -= groups
        if groups and seconds > 0:
            r, old = groups / seconds, self.rate[replica]
            self.rate[replica] = r if old is None else self.alpha * r + (1 - self.alpha) * old
