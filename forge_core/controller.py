"""The controller: the rollout and training loops, the staleness bound, metrics and checkpoints.

Two asyncio loops run concurrently on the controller; every arrow is a Monarch actor call::

    rollout loop (batch k = 0, 1, ...)                 training loop (step s = start .. steps-1)
    ----------------------------------                 -----------------------------------------
    wait until the buffer holds less than one batch    wait until buffer.sample(B, s) returns B
      and a generator replica has version >= k - d - S   episodes with s - version <= S
      (and k < steps + d: no batch beyond the last step)
    problems  = source.next_batch(prompts_per_step)    metrics = trainer.train_step(episodes)
    groups -> replicas (Dispatcher: whole groups,      wait for the previous weight sync, then
      to the replica expected to finish first)           handle = trainer.publish()   (version s+1)
    episodes  = replica.generate(its groups) (G each)    sync in the background:
    episodes  = reward.score(episodes)                     receivers fetch over the network
    ref       = reference.logprobs(episodes)               (other nodes; generation goes on), then
    advantages within each group (z-score/mean/RLOO)       every replica loads between two generate
    buffer.add(episodes)                                   calls (IPC from the trainer or its node's
                                                           staged copy)
                                                       log one JSONL line, checkpoint every N steps

S = ``max_staleness``; d = batches dropped so far (skipped steps), so batch k trains at step k - d.
With ``advantage.drop_zero_variance`` (DAPO's dynamic sampling) the groups of batch k whose rewards
are all equal are dropped, and new prompts for them are the next generation (batch k+1 may be underway).
With S=1 (default) rollout k+1 overlaps training step k; with 0 the loops alternate (fully
on-policy). Batch k's reward, reference and advantages run while batch k+1 generates (when its
replicas are eligible), so the reference's forward is off the rollout path. A checkpoint is taken at
a quiet point (no batch generating or being finished, sync done), so a resumed run sees exactly the
batch the uninterrupted run would have seen. With ``rollout.mode=continuous`` the left column works
on groups instead of batches: each replica keeps groups in flight across step boundaries and a
finished group goes to the buffer at once (drawn in :mod:`forge_core.rollout_loop`); a checkpoint
drains the replicas first. The rollout loop is :mod:`forge_core.rollout_loop` (the
rollout of one episode, single- or multi-turn, happens in a generator replica: :mod:`forge_core.rollout`);
fault supervision :mod:`forge_core.supervision`; both are parts of :class:`Controller`. Spawning and
placing the actors is :mod:`forge_core.services`; the weight transports :mod:`forge_core.weight_sync`;
checkpoint files :mod:`forge_core.checkpoint`; the metrics row :func:`forge_core.metrics.step_row`.

This module reads top-down: :meth:`Controller.run` and the training loop (``_run``, and ``_run_sft``
for SFT: each gives its step's batch and row to the one loop, ``_loop``), then their helpers in the
order the loop uses them (start, next batch, weight sync, evaluation, checkpoints); the module's
helper functions last.

Faults inside a run (``fault.*``): every actor call has a deadline from the work it carries; a
generator replica, the reward or the reference that dies or misses its deadline is killed, respawned
on the same node and GPUs, brought back (current weights; the reference's version 0, checked by
digest) and the call is repeated, so no batch is lost or trained twice (``faults.jsonl`` records
each). A trainer or replay buffer that dies or misses its deadline is respawned too, and the run
goes back to its last checkpoint (:meth:`Supervision.recover`: weights, optimizer, RNG, data position,
buffer, every replica at that version) and recomputes the steps since, the same batches as before.
A service that fails more than ``fault.max_restarts`` times in ``fault.restart_window_s`` ends the
run (SLURM/SkyPilot resume it from the last checkpoint), except a generator replica while at least
``fault.min_replicas`` others are left: it is dropped and its groups go to the others.
A non-finite loss or gradient norm skips the optimizer step and the batch; ``fault.max_bad_steps``
in a row end the run. Checkpoints are staged in host memory and written in the background
(``checkpoint.background``): training waits only for the staging (``checkpoint_exposed_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from typing import Any, Awaitable, Callable, Optional

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from forge_core import checkpoint, memory
from forge_core.data import DataError, Problem, PromptSource, eval_subset, has_conversation, load_split, sft_target
from forge_core.episode import Episode
from forge_core.evaluate import RUN_INFO, eval_calls, eval_sampling, held_out_scores
from forge_core.metrics import MetricsLog, batch_hash, batch_stats, plot_rewards, sft_row, step_row
from forge_core.rewards import load_reward_fn, reward_components
from forge_core.rollout import check_env
from forge_core.rollout_loop import Dispatcher, RolloutLoop
from forge_core.services import ActorFailed, RunFailed, Services, call, call_all, spawn_services
from forge_core.supervision import ReplicaDropped, Supervision, _brief
from forge_core.weight_sync import choose_transport

__all__ = ["Controller", "Dispatcher", "RunFailed", "load_task", "sync_routes", "_brief"]


class Controller(RolloutLoop, Supervision):
    """Runs a recipe: spawns the actors, runs both loops, logs, checkpoints, saves the final model.
    ``cfg``: the resolved run config (:mod:`forge_core.config`); ``out_dir``: the run directory
    (metrics.jsonl, reward.png, checkpoints/, final/); ``hosts``: an optional multi-host Monarch
    ``HostMesh`` (node-rank order) from a launcher; ``progress``: a tqdm progress bar on the console."""

    def __init__(self, cfg: DictConfig, out_dir: str, hosts: Any = None, progress: bool = True):
        self.cfg, self.out_dir, self.hosts, self.progress = cfg, out_dir, hosts, progress
        self.ckpt_root = os.path.join(out_dir, "checkpoints")
        self.B = cfg.prompts_per_step * cfg.generator.group_size
        self.batches_made = self.step = 0  # the rollout batch counter k; the training step
        self.lost_batches = 0  # batches the buffer evicted (stale): made again, beyond steps + skipped_batches
        self.refills: list[list[int]] = []  # [k, groups, round]: new prompts for groups batch k lost (dynamic sampling)
        self.versions: list[int] = []  # per generator replica
        self.rollout_stats: list[dict] = []  # stats of rollouts finished since the last step's log line
        self.last_rollouts: list[dict] = []  # the ones the last log line reported (reused while none finish)
        self.changed = asyncio.Condition()
        self.buffered = 0
        self.rollouts_in_flight = 0  # batches (continuous mode: groups) generating or being finished
        self.paused = False  # set while a checkpoint is written
        self.loading = False  # set while the replicas load a new version (rollouts wait: see rollout_loop)
        self.sync_task: Optional[asyncio.Task] = None
        self.rollout_task: Optional[asyncio.Task] = None
        self.ckpt_task: Optional[asyncio.Task] = None  # a checkpoint's background write and commit
        self.ckpt_figures: dict = {}  # checkpoint_exposed_s, checkpoint_s, checkpoint_bytes: for the next row
        self.background_error: Optional[Exception] = None  # a failed rollout or weight sync: the training loop raises it
        self.last_sync: dict = {}
        self.svc: Optional[Services] = None
        self.sync_lock = asyncio.Lock()  # publish + loads of one version; respawns that reload weights
        self.generation = 0  # of the nccl weight-transfer group; a new one after a member is respawned
        self.restart_times: dict[str, list] = {}
        self.restarts = {"generator": 0, "reward": 0, "reference": 0, "trainer": 0, "replay_buffer": 0}
        self.dropped: set[int] = set()  # generator replicas given up (fault.min_replicas)
        self.initial_state: dict = {}  # state_dict() at step 0: in-run recovery's point before the first checkpoint
        self.rolled_back = 0  # in-run recoveries of the trainer or the replay buffer
        self.skipped_batches = self.bad_in_a_row = self.checkpoint_failures = 0  # bad_in_a_row: skips in a row
        self.ref_digest = ""
        self.tokenizer_files: dict = {}  # for final/, from a replica at the start (no later call)
        self.held_out: list[Problem] = []  # the held-out evaluation subset (eval.*)
        self.mlog: Optional[MetricsLog] = None
        self.last_eval: dict = {}
        self.startup_s = 0.0  # seconds from the start of run() to the first weights everywhere
        self.started = False  # start() done: from then on the trainer and the replay buffer are recovered

    # ---- the run: set-up, the training loop, the end ------------------------------------------
    async def run(self) -> dict:
        """Run the recipe to ``cfg.steps``; returns the last step's metrics. Raises ActorFailed when an
        actor call fails (the message names the actor); checkpoints and metrics written so far stay intact.
        Raises RunFailed before anything starts when ``resume=false`` finds an earlier run in ``out_dir``
        or the layout does not fit the GPUs' free memory (:func:`forge_core.memory.check_free`: the
        message names the GPU, the estimate, the free memory and the setting to change), and DataError
        or RewardError (:func:`load_task`) before anything is written."""
        cfg = self.cfg
        if not cfg.resume and (os.path.exists(os.path.join(self.out_dir, "metrics.jsonl"))
                               or checkpoint.complete(self.ckpt_root)):
            raise RunFailed(f"{self.out_dir} holds an earlier run (metrics.jsonl, checkpoints/): resume=false would "
                            f"overwrite its metrics and mix its checkpoints with this run's; set another run_id, or "
                            f"resume=true to go on from its last checkpoint")
        train, self.held_out = load_task(cfg)  # bad data or reward: an error before anything is written
        if cfg.device == "cuda" and (why := memory.check_free(cfg)):  # before any actor allocates
            raise RunFailed(why)
        os.makedirs(self.out_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(self.out_dir, "config.yaml"))
        self.source = PromptSource(train, cfg.data.seed)
        t_start = time.perf_counter()
        try:
            self.svc = await spawn_services(cfg, self.hosts)
            self.svc.write_placement(os.path.join(self.out_dir, "actors.json"))
            while True:
                try:
                    return await (self._run_sft(t_start) if cfg.loss.name == "sft" else self._run(t_start))
                except ActorFailed as e:  # the trainer or the replay buffer: back to the last checkpoint, go on
                    await self.recover(e)  # (anything else: raised again)
        finally:
            await self.shutdown()

    async def _run(self, t_start: float) -> dict:
        """The training loop (the module docstring's right column) in :meth:`_loop`: take a batch from
        the replay buffer, train one step, start the new version's weight sync (and its evaluation when
        due) in the background, log one metrics row. The rollout loop (:meth:`rollout_loop`) runs beside
        it as a task; its failures are raised here. Returns the last step's row."""
        wait: dict = {}  # seconds the step waited for its batch

        async def batch(t0: float) -> list[Episode]:
            episodes = await self._next_batch()
            wait["s"] = time.perf_counter() - t0
            if self.rollout_task.done():
                self.rollout_task.result()  # re-raise a rollout failure
            return episodes

        async def trained(episodes: list[Episode], tm: dict, t0: float) -> dict:
            stats = {"batch_hash": batch_hash(episodes), **batch_stats(episodes, self.step)}  # of a trained batch
            if self.sync_task is not None:
                await self.sync_task  # receivers may still read the buffer publish overwrites
            prev_sync = dict(self.last_sync)
            self.sync_task = asyncio.create_task(self.publish_and_sync(evaluate=self._eval_due(self.step + 1)))
            self.step += 1
            finished, self.rollout_stats = self.rollout_stats, []
            # timings: of the rollouts finished during this step, else of the latest one (a row
            # never reports a 0 s generation because the next rollout is still running)
            self.last_rollouts = finished or self.last_rollouts
            return step_row(self.step, tm, stats, prev_sync, state=self.state_dict(), rollouts=finished,
                            reported=self.last_rollouts, checkpoint=self._ckpt_row(),
                            timings={"wait_for_rollout_s": wait["s"], "step_s": time.perf_counter() - t0,
                                     "elapsed_s": time.perf_counter() - t_start, "startup_s": self.startup_s})

        def shown(row: dict) -> dict:
            return {"reward": f"{row['reward_mean']:.3f}", "acc": f"{row['accuracy']:.2f}",
                    "loss": f"{row['loss']:.4f}", "sync": f"{row['weight_sync_exposed_s']:.2f}s"}

        return await self._loop(t_start, "GRPO", batch, trained, shown, background=self.rollout_loop)

    async def _run_sft(self, t_start: float) -> dict:
        """The SFT loop (``loss=sft``) in :meth:`_loop`: take ``prompts_per_step`` examples, have
        generator replica 0 tokenize them with their targets (:func:`forge_core.data.sft_target`), train
        one step on the targets' cross-entropy; publish the weights to the replicas only to evaluate
        them (``eval.*``, as in GRPO); log a row. No rollouts, reference or replay buffer. Returns the
        last step's row."""
        cfg, s = self.cfg, self.svc

        async def batch(t0: float) -> list[Episode]:
            problems = self.source.next_batch(cfg.prompts_per_step)
            self.batches_made += 1
            targets = [sft_target(p, cfg.data) for p in problems]
            return await call(s.generator.name, s.generator.sft_episodes, problems, targets,
                              timeout_s=self._deadline(0))

        async def trained(episodes: list[Episode], tm: dict, t0: float) -> dict:
            self.step += 1
            if self._eval_due(self.step):  # the replicas get this version to evaluate it
                if self.sync_task is not None:
                    await self.sync_task
                self.sync_task = asyncio.create_task(self.publish_and_sync(evaluate=True))
            return sft_row(self.step, tm, episodes, state=self.state_dict(),
                           timings={"step_s": time.perf_counter() - t0, "elapsed_s": time.perf_counter() - t_start,
                                    "startup_s": self.startup_s})

        return await self._loop(t_start, "SFT", batch, trained, lambda row: {"loss": f"{row['loss']:.4f}"})

    async def _loop(self, t_start: float, title: str, batch: Callable[[float], Awaitable[list[Episode]]],
                    trained: Callable[[list[Episode], dict, float], Awaitable[dict]], shown: Callable[[dict], dict],
                    background: Optional[Callable[[], Awaitable[None]]] = None) -> dict:
        """The loop both modes share, after :meth:`start` (called here unless already done: after an
        in-run recovery it is called again from the checkpoint's step). Per step until ``cfg.steps``:
        ``batch(t0)`` gives the step's episodes (``t0``: :func:`time.perf_counter` at the step's start),
        the trainer trains one step on them (a non-finite one is skipped, :meth:`_skip`), ``trained(episodes,
        train metrics, t0)`` counts the step and returns its metrics row; the row is logged, a checkpoint is
        written every ``checkpoint.every`` steps and at the last, ``shown(row)`` goes on the progress bar
        (``title`` and the recipe). ``background``: a coroutine function run as :attr:`rollout_task`
        beside the loop (GRPO's rollout loop), cancelled at the end. At the end the last weight sync
        (and evaluation) is awaited, the last checkpoint's write, and ``final/`` is saved. ``t_start``:
        :func:`time.perf_counter` at the start of :meth:`run`. Returns the last step's row (empty when
        no step was left)."""
        cfg = self.cfg
        if not self.started:  # (after an in-run recovery: started, the state restored)
            await self.start()
            self.startup_s = time.perf_counter() - t_start
        # Rows 1..step were logged before checkpoint step_<step> was written: keep them, drop later ones.
        mlog = self.mlog = MetricsLog(os.path.join(self.out_dir, "metrics.jsonl"), self.step + 1, cfg.wandb,
                                      os.path.basename(self.out_dir), config=OmegaConf.to_container(cfg))
        if cfg.eval.at_start and self.step == 0 and not self.rolled_back:  # version 0, beside the first rollout
            self.sync_task = asyncio.create_task(self.publish_and_sync(sync=False, evaluate=True))
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"{title} {cfg.recipe}", unit="step", dynamic_ncols=True,
                   disable=not self.progress)
        task = self.rollout_task = asyncio.create_task(background()) if background else None
        row: dict = {}
        figures: dict = {}  # the last step's figures on the progress bar
        try:
            while self.step < cfg.steps:
                t0 = time.perf_counter()
                episodes = await batch(t0)
                tokens = sum(len(e.prompt_ids) + len(e.response_ids) for e in episodes)
                tm = await call("trainer", self.svc.trainer.train_step, episodes, timeout_s=self._deadline(tokens))
                if tm["skipped"]:
                    self._skip(tm)
                    continue
                self.bad_in_a_row = 0
                row = await trained(episodes, tm, t0)
                mlog.log(row)  # before the checkpoint: a resume keeps this row (no gap)
                if cfg.checkpoint.every and (self.step % cfg.checkpoint.every == 0 or self.step == cfg.steps):
                    await self.save_checkpoint()
                figures = shown(row)
                self._show(bar, figures)
                bar.update(1)
            if task is not None:
                task.cancel()
            if self.sync_task is not None:
                await self.sync_task
                self._show(bar, figures)  # the last evaluation finishes after the last step
            await self._checkpoint_written()
            await self.save_final()
        except Exception as e:  # the run ends or goes back to a checkpoint: the one being written first
            await self._settle_checkpoint(e)
            raise
        finally:
            if task is not None:
                task.cancel()
            for t in (task, self.sync_task, self.ckpt_task):  # retrieve a failure already raised elsewhere
                if t is not None and t.done() and not t.cancelled():
                    t.exception()
            bar.close()
            mlog.close()
        return row

    def _show(self, bar: tqdm, shown: dict) -> None:
        """Put ``shown`` (the last step's figures) on the progress bar, and the pass@1 of the last
        held-out evaluation to finish (``eval=``)."""
        bar.set_postfix(shown, **({"eval": f"{self.last_eval['eval/pass@1']:.3f}"} if self.last_eval else {}))

    async def start(self) -> None:
        """Load the initial weights everywhere (resuming from the newest checkpoint when
        ``cfg.resume``): the reference takes the trainer's version 0 bit for bit, before a
        checkpoint overwrites the trainer's weights; every replica then loads the trainer's
        current version. Every call has ``fault.startup_timeout_s`` (a miss raises ActorFailed naming the actor)."""
        s, t = self.svc, self.cfg.fault.startup_timeout_s
        self.routes = sync_routes(s, self.cfg.weight_sync.transport)
        if self.cfg.device == "cpu":
            n = self.cfg.threads_per_actor
            print(f"[forge] threads per actor: {n} (threads_per_actor={n})" if n else
                  f"[forge] threads per actor: shared (threads_per_actor=0): the actors computing at the moment "
                  f"split this host's {len(os.sched_getaffinity(0))} cores", file=sys.stderr, flush=True)
        self.versions = [0] * len(s.generators)
        self.dispatcher = Dispatcher(len(s.generators))
        self.initial_state = json.loads(json.dumps(self.state_dict()))  # (a copy) what step 0 was
        dtypes = {await call(g.name, g.get_dtype, timeout_s=t) for g in s.generators}  # each resolved its `auto`
        if len(dtypes) > 1:
            raise RunFailed(f"generator replicas resolved generator.dtype=auto differently ({sorted(dtypes)}): "
                            f"their hosts' CPUs differ; set generator.dtype explicitly")
        ckpt = checkpoint.resume_point(self.ckpt_root) if self.cfg.resume else None  # the newest that verifies
        s.dtypes["generator"] = dtypes.pop()  # what the trainer publishes; respawns keep it
        if s.reference is not None and not s.reference_in_trainer:  # (SFT: none; LoRA: the trainer's base model)
            remote = s.reference.slot.host != s.trainer.slot.host
            s.dtypes["reference"] = await call("reference", s.reference.get_dtype, timeout_s=t)
            h0 = await call("trainer", s.trainer.publish, remote, 0, 0, s.dtypes["reference"], timeout_s=t)
            await call("reference", s.reference.load_initial, h0, "rdma" if remote else "ipc", timeout_s=t)
            self.ref_digest = await call("reference", s.reference.digest, timeout_s=t)
        self.tokenizer_files = await call(s.generator.name, s.generator.tokenizer_files, timeout_s=t)
        if ckpt:
            await self.restore(ckpt)
        await self.publish_and_sync()
        self.started = True

    async def shutdown(self) -> None:
        """Stop every actor process (idempotent; nothing to do when spawning failed)."""
        if self.svc is not None:
            await self.svc.stop()

    async def save_final(self) -> None:
        """Write ``final/`` (the policy in HF safetensors, without optimizer state, the tokenizer's files
        and ``forge.json``: the dtype the generators sampled in and the policy version, which ``make eval``
        evaluates it with) and ``reward.png``. Raises ActorFailed when the trainer's save fails, OSError on a write."""
        final = os.path.join(self.out_dir, "final")
        await call("trainer", self.svc.trainer.save, final, False, self.cfg.checkpoint.final_dtype,
                   timeout_s=self.cfg.fault.call_timeout_s)
        for name, data in self.tokenizer_files.items():
            with open(os.path.join(final, name), "wb") as f:
                f.write(data)
        with open(os.path.join(final, RUN_INFO), "w") as f:  # for make eval: the generators' dtype (auto resolved)
            json.dump({"generator_dtype": self.svc.dtypes["generator"], "policy_version": self.step}, f)
        what = "SFT" if self.cfg.loss.name == "sft" else "GRPO"
        plot_rewards(self.mlog.path, os.path.join(self.out_dir, "reward.png"), f"{what} {self.cfg.recipe}")

    # ---- the training loop's helpers --------------------------------------------------------
    async def _next_batch(self) -> list[Episode]:
        """The ``B`` episodes step ``self.step`` trains on, waiting for the rollouts as long as it takes.
        Raises a failure of the rollout loop or of a weight sync (``background_error``)."""
        while True:
            batch = await call("replay_buffer", self.svc.buffer.sample, self.B, self.step, timeout_s=self._deadline(0))
            async with self.changed:  # the size read under the lock: an add is in it, or wakes the wait below
                self.buffered = await call("replay_buffer", self.svc.buffer.num_episodes, timeout_s=self._deadline(0))
                if batch is not None:
                    self.changed.notify_all()
                    return batch
                if self._nothing_on_the_way():
                    self.lost_batches += 1  # and the buffer evicted (part of) a batch: one more is made
                self.changed.notify_all()
                # woken when a batch may be there, or when the last rollout on the way has come in short
                # of one (the buffer evicted a stale group): then the check above asks for another batch
                await self.changed.wait_for(lambda: self.buffered >= self.B or self.background_error is not None
                                            or self._nothing_on_the_way())
            if self.background_error is not None:
                raise self.background_error

    def _nothing_on_the_way(self) -> bool:
        """No rollout in flight, no group owed to a batch and every wanted batch made."""
        return not self.rollouts_in_flight and not self.refills and self.batches_made >= self._batches_wanted()

    def _batches_wanted(self) -> int:
        """Rollout batches the run trains on: one per step, plus the ones skipped or lost."""
        return self.cfg.steps + self.skipped_batches + self.lost_batches

    def _skip(self, tm: dict) -> None:
        """A step the trainer skipped (non-finite loss or gradient norm): the batch is dropped and
        counted, the step is taken again with the next batch. Raises RunFailed at
        ``fault.max_bad_steps`` skips in a row."""
        self.skipped_batches += 1
        self.bad_in_a_row += 1
        checkpoint.warn(f"step {self.step + 1}: non-finite loss ({tm.get('loss')}) or gradient norm "
                        f"({tm.get('grad_norm')}); optimizer step skipped, batch dropped "
                        f"({self.bad_in_a_row} in a row, fault.max_bad_steps={self.cfg.fault.max_bad_steps})")
        if self.bad_in_a_row >= self.cfg.fault.max_bad_steps:
            raise RunFailed(f"training stopped: {self.bad_in_a_row} steps in a row had a non-finite loss or gradient "
                            f"norm (fault.max_bad_steps={self.cfg.fault.max_bad_steps}); the last good step is "
                            f"{self.step}: lower trainer.lr, check the rewards, or resume from a checkpoint")

    # ---- weight sync -------------------------------------------------------------------------
    async def publish_and_sync(self, sync: bool = True, evaluate: bool = False) -> None:
        """Publish the trainer's current weights and bring every replica to them (under the sync lock);
        then, with ``evaluate``, evaluate that version (:meth:`evaluate`), outside the lock, so that the
        rollouts and a respawn go on meanwhile. The next version is published only once this task is
        done (the training loop awaits it first), so the replicas hold the evaluated version throughout,
        and training waits for an evaluation only when it outlasts the training step beside it.
        A failure also becomes ``background_error``: the training loop may be waiting for a batch that
        only the new version can generate (``max_staleness=0``)."""
        try:
            if sync:
                async with self.sync_lock:
                    await self._sync_locked()
            if evaluate:
                await self.evaluate()
        except Exception as e:
            await self._set(background_error=e)
            raise

    async def _sync_locked(self) -> None:
        """Publish (starting the nccl broadcast when a route needs it), fetch and load one version (see
        the module docstring; routes: :func:`sync_routes`). A replica that dies or hangs meanwhile is
        respawned and the whole version published and loaded again (a new nccl group)."""
        cfg, gens, routes = self.cfg, self.svc.generators, self.routes
        nccl = sum(t == "nccl" for t, _ in routes)  # group members besides the trainer
        handle = await call("trainer", self.svc.trainer.publish, any(t == "rdma" for t, _ in routes),
                            nccl + 1 if nccl else 0, self.generation, self.svc.dtypes["generator"],
                            timeout_s=cfg.fault.call_timeout_s)
        t0 = time.perf_counter()
        timeout = cfg.weight_sync.timeout_s + cfg.fault.call_timeout_s  # a network transfer
        # a load is a local copy, queued behind at most one generate call (a whole batch) of its replica
        load_timeout = self._deadline(self.episodes_per_call() * cfg.generator.max_response_tokens) \
            + cfg.fault.call_timeout_s
        failed: dict[int, ActorFailed] = {}  # replica -> its failed call of this sync
        staged = {}  # node leader -> a same-host handle of its staged copy, for its node's followers

        async def guard(i: int, what: Any) -> Any:
            try:
                return await what
            except ActorFailed as e:
                failed[i] = e

        async def load(i: int) -> dict:
            t, j = routes[i]
            args = (staged[j],) if t == "follow" else (handle, t in ("nccl", "rdma"))
            r = await call(gens[i].name, gens[i].update_weights, *args, timeout_s=load_timeout)
            self.versions[i] = r["version"]
            await self._set()
            return r

        fetch = [i for i, (t, _) in enumerate(routes) if t in ("nccl", "rdma")]  # (dropped replicas: "none")
        got = await asyncio.gather(*(guard(i, call(f"receiver_{gens[i].name}", gens[i].receiver.fetch, handle,
                                                   *routes[i], timeout_s=timeout)) for i in fetch))
        if not failed:
            for j in sorted({r for t, r in routes if t == "follow"}):
                staged[j] = await guard(j, call(f"receiver_{gens[j].name}", gens[j].receiver.staged, handle.version,
                                                timeout_s=cfg.fault.call_timeout_s))
        if not failed:
            await self._set(loading=True)
            try:
                loaded = await asyncio.gather(*(guard(i, load(i)) for i in self._live()))
            finally:
                await self._set(loading=False)
        if failed:
            for i, e in sorted(failed.items()):
                if not await self._count_or_drop(gens[i], e):
                    continue  # dropped (fault.min_replicas): the routes go around it now
                ta = time.perf_counter()
                await self.svc.respawn(gens[i].name)
                self._record_fault(gens[i].name, e, ta)
            self.generation += 1
            return await self._sync_locked()
        transfer_s = max((f["transfer_s"] for f in got), default=0.0)
        exposed = max(r["sync_s"] for r in loaded)
        self.last_sync = {"weight_sync_s": time.perf_counter() - t0, "weight_transfer_s": transfer_s,
                          "weight_sync_exposed_s": exposed,
                          "weight_sync_gb_s": handle.nbytes / max(transfer_s or exposed, 1e-9) / 1e9,
                          "weight_sync_bytes": handle.nbytes,
                          "weight_sync_mode": loaded[0].get("mode", "")}

    # ---- held-out evaluation -----------------------------------------------------------------
    def _eval_due(self, version: int) -> bool:
        """Whether policy version ``version`` (after that many steps) is evaluated: every ``eval.every``
        steps and the last step (version 0, ``eval.at_start``, is started by the run itself)."""
        every = self.cfg.eval.every
        return every > 0 and (version % every == 0 or version == self.cfg.steps)

    async def evaluate(self) -> dict:
        """Evaluate the policy the replicas hold on the held-out subset and log it (one ``metrics.jsonl``
        row with ``eval/...`` keys, ``step`` = the version evaluated). The generate calls, their seeds and
        sampling settings and the scores are :mod:`forge_core.evaluate`'s, the ones ``make eval`` makes of
        a checkpoint (:func:`~forge_core.evaluate.eval_calls`: call ``i`` to the ``i % n``-th of the ``n`` replicas going,
        another one when that one is dropped meanwhile;
        :func:`~forge_core.evaluate.eval_sampling`; :func:`~forge_core.evaluate.held_out_scores`: pass@1,
        pass@k, the means, ``responses_digest``), scored by the reward actor. Runs between two syncs (see
        :meth:`publish_and_sync`), so every sample comes from the version evaluated (recorded as
        ``eval/policy_version``). Returns the row."""
        e, gens, t0 = self.cfg.eval, self.svc.generators, time.perf_counter()
        sampling, calls, live = eval_sampling(self.cfg), eval_calls(self.cfg, len(self.held_out)), self._live()

        async def one(k: int) -> list[tuple[int, list[Episode]]]:
            out = []
            for i in range(k, len(calls), len(live)):
                start, end, seed = calls[i]
                r = live[k]
                while True:
                    try:
                        eps, _ = await self._supervised(gens[r].name, "generate", self.held_out[start:end], seed,
                                                        sampling, tokens=(end - start) * e.samples * sampling["max_tokens"])
                        break
                    except ReplicaDropped:  # its restarts used up: the call goes to a replica still going
                        r = self._live()[0]
                out.append((i, eps))
            return out

        parts = await asyncio.gather(*(one(k) for k in range(len(live))))
        got = sorted((x for part in parts for x in part), key=lambda x: x[0])  # question order
        gen_s = time.perf_counter() - t0
        episodes = await self._score([ep for _, eps in got for ep in eps])
        versions = sorted({ep.policy_version for ep in episodes})
        if len(versions) > 1:  # a replica respawned during the evaluation got the trainer's newer weights
            checkpoint.warn(f"held-out evaluation mixed policy versions {versions} (a replica was respawned)")
        ntok = sum(len(ep.response_ids) for ep in episodes)
        row = {"step": versions[0], "eval/policy_version": versions[0],
               **{f"eval/{k}": v for k, v in held_out_scores(episodes, e.samples).items()},
               "eval/s": time.perf_counter() - t0, "eval/gen_s": gen_s, "eval/gen_tok_s": ntok / gen_s}
        self.mlog.log(row)
        self.last_eval = row
        return row

    # ---- checkpoints -------------------------------------------------------------------------
    async def save_checkpoint(self) -> None:
        """At a quiet point (the weight sync done, rollouts paused and none in flight), take the
        checkpoint ``checkpoints/step_NNNNNN``: the trainer stages its files in host memory, the replay
        buffer's episodes and the controller's state are copied; then the rollouts and training go on
        while the files are written and committed (:meth:`_commit`; in the background with
        ``checkpoint.background``, one at a time: the next save, the end of the run or a recovery waits
        for it). The seconds training waited are ``checkpoint_exposed_s`` (next metrics row). A full
        disk leaves the previous checkpoint as it was and says so; other errors (ActorFailed, OSError,
        RuntimeError) raise."""
        await self._checkpoint_written()
        if self.sync_task is not None:
            await self.sync_task
        async with self.changed:
            self.paused = True
            await self.changed.wait_for(lambda: not self.rollouts_in_flight)
        t0 = time.perf_counter()
        tmp = os.path.join(self.ckpt_root, f"step_{self.step:06d}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        background = self.cfg.checkpoint.background
        try:
            await call("trainer", self.svc.trainer.save, tmp, True, "float32", background,
                       timeout_s=self.cfg.fault.call_timeout_s)
            held = [] if self.svc.buffer is None else await call("replay_buffer", self.svc.buffer.state,
                                                                     timeout_s=self._deadline(0))
            state = json.loads(json.dumps(self.state_dict()))  # a copy: the loops change it from now on
        except (ActorFailed, OSError, RuntimeError) as e:
            self._checkpoint_failed(e, tmp)
        else:
            commit = self._commit(tmp, state, held, t0)
            if background:
                self.ckpt_task = asyncio.create_task(commit)
            else:
                await commit
        finally:
            self.ckpt_figures["checkpoint_exposed_s"] = time.perf_counter() - t0
            await self._set(paused=False)

    async def _commit(self, tmp: str, state: dict, held: list, t_save: float) -> None:
        """Finish checkpoint ``tmp`` once the trainer's files are on disk (polled: the trainer trains
        meanwhile): the buffer's episodes ``held``, the controller's ``state`` and the manifest
        (:func:`forge_core.checkpoint.write_state`, in a thread: it hashes every file), then the rename
        and rotation (:func:`forge_core.checkpoint.commit`; the newest ``checkpoint.keep`` stay).
        Records ``checkpoint_s`` (seconds from the save's start, ``t_save``, to the commit: staging,
        writing, manifest) and ``checkpoint_bytes``. Raises as :meth:`save_checkpoint`."""
        limit = self.cfg.fault.call_timeout_s
        try:
            deadline = time.perf_counter() + limit
            while None in await call_all("trainer", self.svc.trainer.saved, timeout_s=limit):
                if time.perf_counter() > deadline:
                    raise ActorFailed(f"actor 'trainer' did not write checkpoint {tmp} within {limit:.0f} s (hung?)",
                                      "trainer")
                await asyncio.sleep(0.05)
            await asyncio.to_thread(checkpoint.write_state, tmp, state, held)
        except (ActorFailed, OSError, RuntimeError) as e:
            self._checkpoint_failed(e, tmp)
            return
        path = checkpoint.commit(tmp, self.cfg.checkpoint.keep)
        self.ckpt_figures.update(checkpoint_s=time.perf_counter() - t_save,
                                 checkpoint_bytes=sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)))

    def _checkpoint_failed(self, e: BaseException, tmp: str) -> None:
        """A checkpoint's save failed with ``e``: on a full disk, remove ``tmp``, count it and say that
        the previous checkpoint is intact; anything else raises ``e``."""
        if not checkpoint.disk_full(e, self.ckpt_root):
            raise e
        shutil.rmtree(tmp, ignore_errors=True)
        self.checkpoint_failures += 1
        prev = checkpoint.complete(self.ckpt_root)
        checkpoint.warn(f"checkpoint at step {int(os.path.basename(tmp)[5:11])} not written: the disk is full "
                        f"({_brief(e, 200)}); "
                        + (f"the previous checkpoint {prev[-1]} is intact" if prev else "no earlier checkpoint"))

    async def _checkpoint_written(self) -> None:
        """Wait for the checkpoint being written in the background, if any (raises its failure)."""
        task, self.ckpt_task = self.ckpt_task, None
        if task is not None:
            await task

    async def _settle_checkpoint(self, error: BaseException) -> None:
        """The training loop stops with ``error``: a checkpoint being written is finished first (the run
        ends, or goes back to that checkpoint), unless the trainer failed (its files may never be
        complete: the checkpoint is given up). A failure of the write itself is dropped."""
        task, self.ckpt_task = self.ckpt_task, None
        if task is not None and getattr(error, "actor", "") != "trainer":
            with contextlib.suppress(Exception):
                await task
        elif task is not None:
            task.cancel()

    def _ckpt_row(self) -> dict:
        """The checkpoint figures for the next metrics row (0 when none since the previous row)."""
        out, self.ckpt_figures = self.ckpt_figures, {}
        return out

    def state_dict(self) -> dict:
        """The controller's part of a checkpoint (``controller.json``): ``step``, ``batches_made`` (the
        rollout batch counter), ``refills`` (``[k, groups, round]`` still owed), ``source`` (the prompt
        stream's position), ``generator_version`` (the oldest version a replica holds, informative),
        ``skipped_batches``, ``checkpoint_failures`` and ``restarts`` (``{role: count}``). JSON-ready;
        the lists and dicts are the controller's own (serialise them before the next ``await``)."""
        return {"step": self.step, "batches_made": self.batches_made, "refills": self.refills,
                "source": self.source.state_dict(), "generator_version": min(self.versions[i] for i in self._live()),
                "skipped_batches": self.skipped_batches, "checkpoint_failures": self.checkpoint_failures,
                "restarts": self.restarts}

    def load_state_dict(self, state: dict) -> None:
        """Go on from ``state`` (:meth:`state_dict`); ``refills`` and the fault counters default to none
        (older checkpoints). Raises KeyError when ``step``, ``batches_made`` or ``source`` is missing."""
        self.step, self.batches_made, self.refills = state["step"], state["batches_made"], state.get("refills", [])
        # the metrics' fault counters go on from the checkpoint's (older checkpoints: from 0)
        self.skipped_batches = state.get("skipped_batches", 0)
        self.checkpoint_failures = state.get("checkpoint_failures", 0)
        self.restarts.update(state.get("restarts", {}))
        self.source.load_state_dict(state["source"])

    async def restore(self, path: str) -> None:
        """Resume from a checkpoint written by :meth:`save_checkpoint` (at the start, or when an in-run
        recovery goes back to it): the trainer's weights, optimizer and RNG state, the controller's state
        (:meth:`load_state_dict`) and the replay buffer's episodes (replacing what it holds). Raises
        RuntimeError when the trainer's version and the checkpoint's step disagree, ActorFailed when the
        trainer cannot load it."""
        version = await call("trainer", self.svc.trainer.load, path, timeout_s=self.cfg.fault.startup_timeout_s)
        state, held = checkpoint.read_state(path)
        self.load_state_dict(state)
        if self.svc.buffer is not None:
            await call("replay_buffer", self.svc.buffer.restore, held, timeout_s=self._deadline(0))
            self.buffered = len(held)
        if version != self.step:
            raise RuntimeError(f"checkpoint {path}: trainer version {version} != step {self.step}")

    # ---- the loops' shared state -------------------------------------------------------------
    async def _set(self, **attrs: Any) -> None:
        """Set the loops' shared state ``attrs`` (none: just a change) and wake every waiter on it."""
        async with self.changed:
            for k, v in attrs.items():
                setattr(self, k, v)
            self.changed.notify_all()


# ---- module helpers, in the order the run uses them ------------------------------------------
def load_task(cfg: DictConfig) -> tuple[list[Problem], list[Problem]]:
    """The run's training problems and its held-out evaluation subset (empty when ``eval.every`` is 0
    and ``eval.at_start`` false), checked before anything starts or is written: both splits load
    through the field mapping, one batch's worth of distinct prompts exists, every training example has
    an SFT target when ``loss=sft`` (:func:`forge_core.data.sft_target`), the reward function
    answers one training example (its target as the response) with a finite float or a dict of them,
    and with ``env.fn`` its environment takes one reset and one step on that example.

    Raises:
        DataError: a split that does not load (file, field, row: the message names them), or
            ``prompts_per_step`` beyond the training rows.
        RewardError: ``reward.fn`` cannot be loaded, raises, or returns something else (names it).
        EnvError: ``env.fn`` cannot start an episode from the first training row or step it (names both).
    """
    train = load_split(cfg.data, "train")
    if len(train) < cfg.prompts_per_step:
        raise DataError(f"prompts_per_step={cfg.prompts_per_step} is more than the {len(train)} training prompts "
                        f"of data.train={cfg.data.train}: one batch would repeat prompts")
    if cfg.loss.name == "sft":
        for p in train:  # every example has a target to train on (the first without one is named)
            if cfg.env.fn and not has_conversation(p):
                raise DataError(f"{p.id}: no assistant turn in its messages: with env.fn, SFT trains on "
                                f"conversations (data.messages_field) and their assistant turns")
            sft_target(p, cfg.data)
    e = cfg.eval
    held = eval_subset(load_split(cfg.data, "test"), e.num_questions, e.seed) if e.every or e.at_start else []
    p = train[0]
    reward_components(load_reward_fn(cfg.reward), cfg.reward.fn, p.answer, {**p.row, "target": p.answer},
                      f"example {p.id} (its target as the response, a check before the run)")
    if cfg.env.fn:
        check_env(OmegaConf.to_container(cfg.env), p, cfg.data.system_prompt)
    return train, held


def sync_routes(svc: Services, setting: str, dropped: frozenset = frozenset()) -> list[tuple[str, int]]:
    """How each generator replica gets new weights: ``(transport, rank)`` for ``ipc`` (the trainer's
    host) and for a node's first replica on another host (``nccl`` group member ``rank`` or
    ``rdma``), or ``("follow", i)``: the node's other replicas load replica ``i``'s staged copy;
    ``("none", 0)`` for the replicas in ``dropped`` (indices). Prints every choice. Raises ValueError
    for an impossible explicit transport (``ipc`` across hosts)."""
    t = svc.trainer
    routes, leader, rank = [], {}, 0
    for i, g in enumerate(svc.generators):
        if i in dropped:
            routes.append(("none", 0))
            continue
        same = g.slot.host == t.slot.host
        if not same and g.slot.host in leader:
            src = svc.generators[leader[g.slot.host]]
            how, why = "follow", "loads its staged copy over ipc: the bytes cross to a node once"
            routes.append((how, leader[g.slot.host]))
        else:
            src = t
            how, why = choose_transport(setting, same, t.where[0]["ibverbs"] and g.where[0]["ibverbs"])
            rank += how == "nccl"
            routes.append((how, rank if how == "nccl" else 0))
            if not same:
                leader[g.slot.host] = i
        print(f"[forge] weight sync: {g.name} (node {g.slot.host}) <- {src.name} (node {src.slot.host}): "
              f"{how} ({why})", file=sys.stderr, flush=True)
    return routes
