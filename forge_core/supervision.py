"""Fault supervision of the controller's actor calls: deadlines from the work a call carries; the
respawn of a generator replica, the reward or the reference that died or missed its deadline (with
its state brought back); a replica given up once its restarts are used up while ``fault.min_replicas``
others are left (:meth:`Supervision._drop`, its work re-dispatched by :meth:`Supervision._spread`);
and the in-run recovery of the trainer and the replay buffer (:meth:`Supervision.recover`: respawn,
back to the last checkpoint, every replica at that version). Each is counted against
``fault.max_restarts`` and recorded in ``faults.jsonl``. :class:`Supervision` is a part of
:class:`~forge_core.controller.Controller` (its ``cfg``, ``svc``, ``out_dir``, ``step``,
``sync_lock``, the loops' tasks); see that module's docstring for what each fault leads to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from typing import Any, Awaitable, Callable, Optional

from forge_core import checkpoint
from forge_core.services import ActorFailed, BaseModelReference, RunFailed, Service, call, call_all, clip

RECOVERED = ("trainer", "replay_buffer")  # the services whose failure rolls the run back to a checkpoint


class ReplicaDropped(Exception):
    """A generator replica was given up (its restarts used up, ``fault.min_replicas`` others left):
    its work goes to the other replicas (:meth:`Supervision._spread`)."""


class Supervision:
    """The supervision methods of :class:`~forge_core.controller.Controller`."""

    def _deadline(self, tokens: float) -> float:
        """Seconds a call carrying ``tokens`` tokens of work may take (``fault.*``)."""
        return self.cfg.fault.call_timeout_s + self.cfg.fault.timeout_per_token_s * tokens

    def _count_restart(self, name: str, error: BaseException) -> None:
        f, now = self.cfg.fault, time.monotonic()
        recent = [t for t in self.restart_times.get(name, []) if now - t < f.restart_window_s]
        if len(recent) >= f.max_restarts:
            raise ActorFailed(f"actor '{name}' failed {len(recent) + 1} times within {f.restart_window_s:g} s "
                              f"(fault.max_restarts={f.max_restarts}); last error: {clip(str(error), 1500)}") from error
        self.restart_times[name] = recent + [now]

    def _record_fault(self, name: str, error: BaseException, t0: float, note: str = "", respawned: bool = True,
                      **extra: Any) -> None:
        """Count a respawn of ``name`` (``restarts[role]``; not when ``respawned`` is false: a replica
        dropped), write its ``faults.jsonl`` line (``service``, ``step``, ``error``, ``recover_s``: seconds
        since ``t0``, ``restarts``, ``time``, and ``extra``) and a warning (``note`` appended)."""
        role = "generator" if name.startswith("generator") else name
        self.restarts[role] += respawned
        self.svc.write_placement(os.path.join(self.out_dir, "actors.json"))
        rec = {"service": name, "step": self.step, "error": clip(str(error), 500), "recover_s": time.perf_counter() - t0,
               "restarts": self.restarts[role], "time": time.time(), **extra}
        with open(os.path.join(self.out_dir, "faults.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        what = f"respawned and back in {rec['recover_s']:.1f} s" if respawned else "dropped"
        checkpoint.warn(f"{name} failed ({_brief(error)}); {what}{note}")

    def _current(self, name: str) -> Service:
        return next(s for s in self.svc.all() if s.name == name)

    async def _revive(self, failed: Service, error: BaseException) -> None:
        """Respawn the reward, the reference or generator replica ``failed`` and restore its state
        (see the module docstring); nothing when it was already replaced since. Raises ReplicaDropped
        for a replica given up (:meth:`_drop`), ActorFailed when the restarts are used up otherwise, and
        ActorFailed naming the trainer for a reference the trainer serves (LoRA: :meth:`recover` acts)."""
        name, generator = failed.name, failed.name.startswith("generator")
        if isinstance(failed, BaseModelReference):  # (LoRA) the trainer's processes failed: recover() acts
            raise ActorFailed(f"{error} (the reference is the trainer's base model, trainer.lora)", "trainer") from error
        async with self.sync_lock if generator else contextlib.nullcontext():
            if any(self.svc.generators[i].name == name for i in self.dropped):
                raise ReplicaDropped(name) from error
            if self._current(name) is not failed:
                return  # the weight sync already respawned it
            if not await self._count_or_drop(failed, error):
                raise ReplicaDropped(name) from error
            t0 = time.perf_counter()
            await self.svc.respawn(name)
            if generator:
                self.generation += 1
                await self._sync_locked()
            elif name == "reference":
                digest = await call(name, self.svc.reference.rebuild_initial,  # waits for its start-up too
                                    timeout_s=self.cfg.weight_sync.timeout_s + self.cfg.fault.call_timeout_s)
                if digest != self.ref_digest:
                    raise ActorFailed(f"actor 'reference' respawned but its rebuilt initial policy differs from "
                                      f"version 0 (digest {digest[:12]} != {self.ref_digest[:12]}): a sharded random "
                                      f"init cannot be rebuilt; resume the run from its last checkpoint")
        self._record_fault(name, error, t0)

    async def _count_or_drop(self, failed: Service, error: BaseException) -> bool:
        """Count a failure of ``failed`` against ``fault.max_restarts``: True when it may be respawned;
        False when it is a generator replica whose restarts are used up and that was dropped (:meth:`_drop`,
        under the sync lock). Raises ActorFailed when its restarts are used up and it cannot be dropped."""
        try:
            self._count_restart(failed.name, error)
            return True
        except ActorFailed as exhausted:
            if failed.name.startswith("generator") and await self._drop(failed, exhausted):
                return False
            raise

    def _live(self) -> list[int]:
        """The generator replicas not dropped, by index."""
        return [i for i in range(len(self.svc.generators)) if i not in self.dropped]

    async def _drop(self, failed: Service, error: BaseException) -> bool:
        """Give up generator replica ``failed`` (its restarts used up: ``error``) when at least
        ``fault.min_replicas`` others are left (0: every replica is needed): stop its processes, route
        the weight syncs around it (a new nccl group) and record it in ``faults.jsonl``
        (``dropped: true``, ``replicas_left``). Call under the sync lock. False when it cannot be dropped."""
        from forge_core.controller import sync_routes  # (the controller imports this module)
        i, left = self.svc.generators.index(failed), len(self._live()) - 1
        if left < (self.cfg.fault.min_replicas or len(self.svc.generators)) or left < 1:
            return False
        t0 = time.perf_counter()
        self.dropped.add(i)
        await failed.stop(10, kill=True)
        self.routes = sync_routes(self.svc, self.cfg.weight_sync.transport, self.dropped)
        self.generation += 1
        self._record_fault(failed.name, error, t0, respawned=False, dropped=True, replicas_left=left,
                           note=f": {left} replica(s) go on (fault.min_replicas={self.cfg.fault.min_replicas}); "
                                f"its rollouts go to them")
        return True

    async def _spread(self, n: int, replicas: list[int], again: Callable[[], list[int]],
                      work: Callable[[int, list[int]], Awaitable[Any]]) -> list[tuple[int, list[int], Any]]:
        """Run ``work(replica, items)`` over the ``replicas`` for ``n`` items (whole items each, as the
        Dispatcher plans them) and record each replica's speed. The items of a replica dropped meanwhile
        (ReplicaDropped) are planned again over ``again()`` (the replicas eligible then). Returns
        ``(replica, items, result)`` per piece of work done, in plan order."""

        async def one(r: int, idx: list[int]) -> list[tuple[int, list[int], Any]]:
            ta = time.perf_counter()
            try:
                got = await work(r, idx)
            except ReplicaDropped:
                self.dispatcher.done(r, len(idx), 0.0)
                plan = self.dispatcher.assign(len(idx), again())
                parts = await asyncio.gather(*(one(q, [idx[j] for j in sub]) for q, sub in plan.items()))
                return [p for part in parts for p in part]
            self.dispatcher.done(r, len(idx), time.perf_counter() - ta)
            return [(r, idx, got)]

        parts = await asyncio.gather(*(one(r, idx) for r, idx in self.dispatcher.assign(n, replicas).items()))
        return [p for part in parts for p in part]

    # ---- the trainer and the replay buffer: back to the last checkpoint ----------------------------
    async def recover(self, error: BaseException) -> None:
        """In-run recovery of the trainer or the replay buffer (``error.actor``) that died or missed
        its deadline: count it against ``fault.max_restarts``; stop the loops' tasks (rollouts, weight
        sync and evaluation, a checkpoint being written); respawn it on the same node and GPUs; roll
        the run back to the newest checkpoint, or the one before it when that one is damaged (its
        manifest does not verify or it does not load), or to the run's start when there is none
        (:meth:`_roll_back`); bring every generator replica to that version (checked) and go on. The
        steps since are computed again: the same batches (data position, buffer, replicas' version)
        and, with ``max_staleness=0``, the same losses. Fault counters are kept (not rolled back).
        ``faults.jsonl`` records it (``rollback_to``, ``steps_recomputed``, ``checkpoint``).

        Raises:
            error: it is not the trainer's or the replay buffer's (or its restarts are used up), or
                the run had not started (:meth:`~forge_core.controller.Controller.start` not done).
            RunFailed: the newest checkpoint and the one before it are both damaged (names both).
        """
        name = getattr(error, "actor", "")
        if not self.started or name not in RECOVERED or getattr(self.svc, "buffer" if name == "replay_buffer" else name) is None:
            raise error
        self._count_restart(name, error)
        t0, from_step = time.perf_counter(), self.step
        checkpoint.warn(f"{name} failed ({_brief(error)}) at step {from_step + 1}: respawning it and going back to "
                        f"the last checkpoint")
        await self._stop_loops()
        await self.svc.respawn(name)
        kept = dict(self.restarts), self.checkpoint_failures  # fault counters go on; everything else goes back
        path = await self._roll_back(name)
        self.restarts, self.checkpoint_failures = kept
        self.generation += 1  # a new trainer: a new nccl group
        self.rolled_back += 1
        await self.publish_and_sync()
        if wrong := {self.svc.generators[i].name: self.versions[i] for i in self._live() if self.versions[i] != self.step}:
            raise RunFailed(f"after going back to step {self.step}, generator replicas hold other versions: {wrong}")
        self._record_fault(name, error, t0, rollback_to=self.step, steps_recomputed=from_step - self.step,
                           checkpoint=path or "",
                           note=f"; back to step {self.step} ({path or 'the start of the run'}), "
                                f"{from_step - self.step} step(s) to compute again")

    async def _stop_loops(self) -> None:
        """Cancel the rollout loop, the weight sync (and evaluation) and a checkpoint being written,
        wait until they are done, drop unfinished checkpoint directories and reset the loops' state."""
        tasks = [t for t in (self.rollout_task, self.sync_task, self.ckpt_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.rollout_task = self.sync_task = self.ckpt_task = None
        for d in os.listdir(self.ckpt_root) if os.path.isdir(self.ckpt_root) else []:
            if d.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.ckpt_root, d), ignore_errors=True)
        self.rollouts_in_flight, self.paused, self.loading, self.background_error = 0, False, False, None
        self.rollout_stats, self.ckpt_figures = [], {}
        self.dispatcher.outstanding = [0] * len(self.dispatcher.outstanding)

    async def _roll_back(self, failed: str) -> Optional[str]:
        """Restore the newest checkpoint that verifies and loads, trying the newest and the one before
        it (each one skipped is named in a warning); with fewer than two, the run's start (step 0, an
        empty buffer: a new trainer holds the initial policy) comes after them. Returns the path (None:
        the start). Raises RunFailed naming both when neither checkpoint can be used."""
        points: list = checkpoint.complete(self.ckpt_root)[-2:][::-1]
        if len(points) < 2:
            points.append(None)
        bad, fresh = [], failed == "trainer"  # fresh: the trainer is new and nothing was loaded into it
        for path in points:
            if path is None:
                if not fresh:
                    await self.svc.respawn("trainer")
                self.load_state_dict(self.initial_state)
                if self.svc.buffer is not None:
                    await call("replay_buffer", self.svc.buffer.restore, [], timeout_s=self._deadline(0))
                self.buffered = 0
                version = await call("trainer", self.svc.trainer.get_version, timeout_s=self.cfg.fault.call_timeout_s)
                if version != 0:
                    raise RunFailed(f"a new trainer holds policy version {version}, not the initial policy")
                return None
            why = checkpoint.verify(path)
            if why is None:
                fresh = False
                try:
                    await self.restore(path)
                    return path
                except (ActorFailed, OSError, ValueError, RuntimeError, KeyError) as e:
                    why = f"it does not load: {_brief(e, 300)}"
            bad.append(f"{path} ({why})")
            checkpoint.warn(f"checkpoint {path} is damaged ({why}); "
                            + ("falling back to the one before it" if path != points[-1] else "no other to go back to"))
        raise RunFailed(f"the {failed} failed and no checkpoint to go back to can be used: {'; '.join(bad)}")

    async def _supervised(self, name: str, endpoint: str, *args: Any, tokens: float = 0,
                          all_ranks: bool = False) -> Any:
        """Call ``endpoint`` of the service ``name`` (the reward, the reference or a generator replica)
        with a deadline for ``tokens`` tokens of work; on a death or a missed deadline, respawn it
        (:meth:`_revive`: a replica with the current weights) and make the same call again."""
        while True:
            svc = self._current(name)
            try:
                fn = call_all if all_ranks else call
                return await fn(name, getattr(svc, endpoint), *args, timeout_s=self._deadline(tokens))
            except ActorFailed as e:
                await self._revive(svc, e)


def _brief(error: BaseException, limit: int = 400) -> str:
    """The gist of an actor's error for a one-line warning: its last non-empty line (an actor's error
    ends with its exception after the traceback), cut at ``limit`` characters on a word boundary."""
    lines = [l.strip() for l in str(error.__cause__ or error).splitlines() if l.strip()] or [repr(error)]
    last = lines[-1]
    return last if len(last) <= limit else last[:limit].rsplit(" ", 1)[0] + " ..."
