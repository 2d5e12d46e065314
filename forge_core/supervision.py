"""Fault supervision of the controller's actor calls: deadlines from the work a call carries, and the
respawn of a generator replica, the reward or the reference that died or missed its deadline (with
its state brought back), counted against ``fault.max_restarts`` and recorded in ``faults.jsonl``.
:class:`Supervision` is a part of :class:`~forge_core.controller.Controller` (its ``cfg``, ``svc``,
``out_dir``, ``step``, ``sync_lock``); see that module's docstring for what each fault leads to.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from forge_core import checkpoint
from forge_core.services import ActorFailed, Service, call, call_all, clip


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

    def _record_fault(self, name: str, error: BaseException, t0: float) -> None:
        role = "generator" if name.startswith("generator") else name
        self.restarts[role] += 1
        self.svc.write_placement(os.path.join(self.out_dir, "actors.json"))
        rec = {"service": name, "step": self.step, "error": clip(str(error), 500), "recover_s": time.perf_counter() - t0,
               "restarts": self.restarts[role], "time": time.time()}
        with open(os.path.join(self.out_dir, "faults.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        checkpoint.warn(f"{name} failed ({_brief(error)}); respawned and back in {rec['recover_s']:.1f} s")

    def _current(self, name: str) -> Service:
        return next(s for s in self.svc.all() if s.name == name)

    async def _revive(self, failed: Service, error: BaseException) -> None:
        """Respawn the reward, the reference or generator replica ``failed`` and restore its state
        (see the module docstring); nothing when it was already replaced since. Raises ActorFailed
        when its restarts are used up."""
        name, generator = failed.name, failed.name.startswith("generator")
        async with self.sync_lock if generator else contextlib.nullcontext():
            if self._current(name) is not failed:
                return  # the weight sync already respawned it
            self._count_restart(name, error)
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
