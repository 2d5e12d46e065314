"""The controller's rollout loop: rollout batches generated over the generator replicas, then scored,
given reference logprobs and group advantages, and put into the replay buffer (the left column of
:mod:`forge_core.controller`'s drawing). :class:`RolloutLoop` is a part of
:class:`~forge_core.controller.Controller` (its state: ``cfg``, ``svc``, the batch counters, the
``changed`` condition); the rollout of one episode, single- or multi-turn, happens inside a generator
replica (:mod:`forge_core.rollout`). :class:`Dispatcher` spreads a batch's groups over the replicas.

``rollout.mode=continuous`` (:meth:`RolloutLoop.continuous_loop`) replaces the batches by groups
kept in flight on every replica across step boundaries::

    per replica r, until cancelled:
      wait until r has a free slot and a group it may start (or groups in flight)
      submit = groups for free slots: the lost ones first, then those still owed to open batches
        (``refills``), then a new batch; batch k's groups only while versions[r] >= k - d - S
      finished, held = r.advance(submit)        (returns once a group finished, or after WAIT_S)
      groups r neither returned nor holds (a respawned replica) are submitted again
      finished groups -> reward, reference, advantages -> buffer   (a task; the loop goes on)

A group's episodes carry the version it was submitted under. A checkpoint stops new submissions and
waits until every group in flight is in the buffer (``paused``), so it holds no group half-made.
"""

from __future__ import annotations

import asyncio
import collections
import math
import statistics
import time
from typing import Optional

import torch

from forge_core.advantages import compute_advantages
from forge_core.episode import Episode
from forge_core.services import ActorFailed, RunFailed, call

WAIT_S = 0.25  # continuous mode: the longest an advance call waits for a finished group (seconds); a weight
# update for that replica waits at most this long behind it


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
        A failure is handed to the training loop (``background_error``), which raises it.
        ``rollout.mode=continuous``: :meth:`continuous_loop` instead."""
        if self.cfg.rollout.mode == "continuous":
            return await self.continuous_loop()
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
                    finishing = asyncio.create_task(self._finish(episodes, gen, [(k, rnd)] * len(problems)))
            finally:
                if finishing is not None and not finishing.done():
                    finishing.cancel()
                    await asyncio.wait([finishing])  # its clean-up (the in-flight count) ends before this loop does
                elif finishing is not None and not finishing.cancelled():
                    finishing.exception()  # retrieved: its failure reached the training loop as background_error
        except Exception as e:
            await self._set(background_error=e)
            raise

    async def _finish(self, episodes: list[Episode], gen: dict, origin: list[tuple[int, int]], done: int = 1) -> None:
        """Reward, reference logprobs and group advantages of generated groups (``episodes``, G per
        group, group ``g``'s in ``episodes[g*G:(g+1)*G]``; ``origin[g]`` = its ``(batch k, refill
        round)``), then into the replay buffer; ``done`` is taken off ``rollouts_in_flight`` at the
        end. With ``advantage.drop_zero_variance``, groups whose rewards are all equal are dropped and
        as many new prompts queued for their batch (``refills``), up to ``advantage.max_refills``
        rounds; then they are kept (advantage 0). A failure becomes ``background_error`` (the
        training loop raises it)."""
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
            G = cfg.generator.group_size
            rewards = torch.tensor([e.reward for e in episodes]).view(-1, G)
            finite = torch.isfinite(rewards).all(1, keepdim=True)
            adv, keep, adv_m = compute_advantages(rewards.where(finite, 0.0), cfg.advantage)
            adv = adv.where(finite, float("nan"))  # a non-finite reward poisons its group: the step is skipped
            for e, a in zip(episodes, adv.flatten().tolist()):
                e.advantage = a
            lost = collections.Counter(origin[g] for g in range(len(origin)) if not keep[g])
            refill = {o for o in lost if o[1] < cfg.advantage.max_refills}  # the others are kept (advantage 0)
            if lost:
                episodes = [e for j, e in enumerate(episodes) if keep[j // G] or origin[j // G] not in refill]
                self.refills += [[k, lost[(k, rnd)], rnd + 1] for k, rnd in lost if (k, rnd) in refill]
                adv_m["dropped_groups"] = float(sum(lost[o] for o in refill))
            size = await call("replay_buffer", s.buffer.add, episodes, timeout_s=self._deadline(0))
            self.rollout_stats.append(dict(gen, reward_s=reward_s, ref_s=max(secs for _, secs in ranks), **adv_m))
            await self._set(buffered=size)
        except Exception as e:
            await self._set(background_error=e)
            raise
        finally:
            async with self.changed:  # read and written under the lock: _admit adds to it meanwhile
                self.rollouts_in_flight -= done
                self.changed.notify_all()

    # ---- rollout.mode=continuous ----------------------------------------------------------------
    def slots(self) -> int:
        """Groups a replica holds in flight in continuous mode: ``rollout.max_concurrent_groups``, or
        (0) its share of ``max_staleness + 1`` rollout batches, at most ``generator.max_num_seqs /
        group_size`` (what the engine decodes at once), at least 1."""
        cfg, r = self.cfg, len(self.svc.generators)
        share = (cfg.max_staleness + 1) * math.ceil(cfg.prompts_per_step / r)
        engine = cfg.generator.max_num_seqs // cfg.generator.group_size
        return cfg.rollout.max_concurrent_groups or max(1, min(share, engine))

    def episodes_per_call(self) -> int:
        """The most episodes one generator call carries: a rollout batch, or in continuous mode a
        replica's :meth:`slots` groups when more (a weight load may queue behind one such call)."""
        if self.cfg.rollout.mode != "continuous":
            return self.B
        return max(self.B, self.slots() * self.cfg.generator.group_size)

    async def continuous_loop(self) -> None:
        """``rollout.mode=continuous`` (the module docstring's drawing): one feeding task per replica
        (:meth:`_feed`) until cancelled; finished groups are finished (:meth:`_finish`) in tasks of
        their own. A failure is handed to the training loop (``background_error``), which raises it."""
        n = len(self.svc.generators)
        self.live: dict[int, dict] = {}  # group key -> {"k", "rnd", "problem", "replica", "t0"}, while in flight
        self.lost: list[int] = []  # keys of groups a replica lost (respawned): submitted again first
        self.inflight, self.keys, self.finishing = [0] * n, 0, set()
        feeds = [asyncio.create_task(self._feed(r)) for r in range(n)]
        try:
            await asyncio.gather(*feeds)
        except Exception as e:
            await self._set(background_error=e)
            raise
        finally:
            for t in feeds + list(self.finishing):
                t.cancel()

    def _admit(self, r: int, take: bool = True) -> list[int]:
        """Keys of the groups replica ``r`` starts now, its free slots filled with lost groups first,
        then with groups owed to an open batch (``refills``: ``[k, groups, round]``) or of a new batch
        ``k`` (while ``k`` is below :meth:`~forge_core.controller.Controller._batches_wanted`), a group
        of batch ``k`` only while ``versions[r] >= k - skipped_batches - max_staleness``; each new group
        takes its prompt from the source now. Nothing new while a checkpoint waits (``paused``); lost
        groups still go (the checkpoint waits for them). ``take`` False: a non-empty list when it
        could start any, changing nothing."""
        room = self.slots() - self.inflight[r]
        out = self.lost[:max(room, 0)]
        ok = lambda k: self.versions[r] >= k - self.skipped_batches - self.cfg.max_staleness  # noqa: E731
        while len(out) < room and not self.paused:
            owed = next((x for x in self.refills if ok(x[0])), None)
            if owed is None and (self.batches_made >= self._batches_wanted() or not ok(self.batches_made)):
                break
            if not take:
                return [0]
            if owed is None:  # a new batch
                owed = [self.batches_made, self.cfg.prompts_per_step, 0]
                self.refills.append(owed)
                self.batches_made += 1
            owed[1] -= 1
            if not owed[1]:
                self.refills.remove(owed)
            self.keys += 1
            self.live[self.keys] = {"k": owed[0], "rnd": owed[2], "problem": self.source.next_batch(1)[0]}
            self.rollouts_in_flight += 1  # until finished; a lost group stays counted
            out.append(self.keys)
        if take:
            del self.lost[:min(len(self.lost), len(out))]
            for key in out:
                self.live[key].update(replica=r, t0=time.perf_counter())
            self.inflight[r] += len(out)
        return out

    async def _feed(self, r: int) -> None:
        """Keep replica ``r`` busy (see the module docstring): submit what :meth:`_admit` gives,
        collect finished groups with ``advance``, finish them in a task. A replica that dies or
        misses its deadline is respawned (:meth:`_revive`) and its groups submitted again. The
        rollout stats of a finished set: ``gen_s`` its groups' mean seconds from submission to
        return, ``gen_tok_s`` its response tokens over the engine's busy seconds since the replica's
        previous set."""
        cfg, calls, busy = self.cfg, 0, 0.0
        while True:
            async with self.changed:
                await self.changed.wait_for(lambda: not self.loading and (self.inflight[r] or self._admit(r, False)))
                submit = self._admit(r)
            gen, calls = self.svc.generators[r], calls + 1
            tokens = len(submit) * cfg.generator.group_size * cfg.generator.max_response_tokens
            try:
                got, held, busy_s = await call(gen.name, gen.advance, [(k, self.live[k]["problem"]) for k in submit],
                                               cfg.seed * 100_003 + r * 1_009 + calls * 1_000_003, WAIT_S,
                                               timeout_s=self._deadline(tokens) + WAIT_S)
            except ActorFailed as e:
                await self._revive(gen, e)
                got, held, busy_s = [], [], 0.0
            now, busy = time.perf_counter(), busy + busy_s
            async with self.changed:
                back = {key for key, _ in got} | set(held)
                gone = sorted(key for key, g in self.live.items() if g.get("replica") == r and key not in back)
                for key in gone:
                    self.live[key]["replica"] = None
                self.lost += gone
                self.inflight[r] -= len(got) + len(gone)
                groups = [(self.live.pop(key), eps) for key, eps in got]
                self.changed.notify_all()
            if not groups:
                continue
            episodes = []
            for i, (_, eps) in enumerate(groups):
                for e in eps:
                    e.group, e.replica = i, r
                episodes += eps
            tokens = sum(len(e.response_ids) for e in episodes)
            stats = {"gen_s": statistics.fmean(now - g["t0"] for g, _ in groups), "gen_tokens": tokens,
                     "gen_tok_s": tokens / max(busy, 1e-9), "gen_replicas": 1}
            busy = 0.0
            task = asyncio.create_task(self._finish(episodes, stats, [(g["k"], g["rnd"]) for g, _ in groups],
                                                    done=len(groups)))
            self.finishing.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        """A finishing task ended: forget it; its failure already reached ``background_error``."""
        self.finishing.discard(task)
        if not task.cancelled():
            task.exception()

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
