"""The controller: the rollout and training loops, the staleness bound, metrics and checkpoints.

Two asyncio loops run concurrently on the controller; every arrow is a Monarch actor call::

    rollout loop (batch k = 0, 1, ...)                 training loop (step s = start .. steps-1)
    ----------------------------------                 -----------------------------------------
    wait until the buffer holds less than one batch    wait until buffer.sample(B, s) returns B
      and generator version >= k - max_staleness         episodes with s - version <= max_staleness
    problems  = source.next_batch(prompts_per_step)    metrics = trainer.train_step(episodes)
    episodes  = generator.generate(problems)  (G each) handle  = trainer.publish()        (version s+1)
    episodes  = reward.score(episodes)                 wait for the previous sync to finish, then
    episodes  = reference.logprobs(episodes)             generator.update_weights(handle)  (background)
    advantages within each group (z-score / mean / RLOO) log one JSONL line, checkpoint every N steps
    buffer.add(episodes)

With ``max_staleness=1`` (default) rollout k+1 overlaps training step k; with 0 the loops
alternate (fully on-policy). Weight sync runs while the next step trains; the generator applies it
between two generations, never during one. A checkpoint is taken at a quiet point (no rollout in
flight, sync done), so a resumed run sees exactly the batch the uninterrupted run would have seen.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from forge_core.actors.generator import Generator
from forge_core.actors.placement import Placement
from forge_core.actors.reference import Reference
from forge_core.actors.replay_buffer import ReplayBufferActor
from forge_core.actors.reward import RewardActor
from forge_core.actors.trainer import Trainer
from forge_core.data import PromptSource, load_gsm8k
from forge_core.episode import Episode
from forge_core.losses import compute_advantages
from forge_core.metrics import MetricsLog, plot_rewards


class ActorFailed(RuntimeError):
    """An actor call failed or its process died; the message names the actor."""


SHUTTING_DOWN = False  # set while Controller.shutdown stops the actor processes
LAST_FAULT: Optional[str] = None  # Monarch's report of the last unhandled actor failure


def _fault_hook(failure: Any) -> None:
    """Monarch's ``unhandled_fault_hook``: instead of exiting the controller, record the report
    (ignored while stopping the actors, where a busy actor misses its cleanup deadline); the next
    call to the failed actor raises :class:`ActorFailed` naming it, and the run stops cleanly."""
    global LAST_FAULT
    if not SHUTTING_DOWN:
        LAST_FAULT = failure.report()
    # Dropped either way: a call to the failed actor raises, and ActorFailed names it.


def install_fault_hook() -> None:
    """Route Monarch's unhandled actor failures through :func:`_fault_hook`."""
    import monarch.actor

    monarch.actor.unhandled_fault_hook = _fault_hook


@dataclass
class Services:
    """Handles to the spawned actors (each a one-actor mesh in its own process)."""

    generator: Any
    reward: Any
    reference: Any
    trainer: Any
    buffer: Any
    procs: list
    by_name: dict = field(default_factory=dict)  # service name -> its proc mesh

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every actor process, each within ``timeout_s`` seconds. Errors while stopping
        (an actor still busy with a cancelled call misses its deadline) are ignored."""
        for p in self.procs:
            try:
                await asyncio.wait_for(p.stop(), timeout=timeout_s)
            except Exception:
                pass


def _host_for(hosts: Any, index: int):
    from monarch.actor import this_host

    if hosts is None:
        return this_host()
    from launch.bootstrap import host_slice  # only multi-host launchers pass a mesh

    return host_slice(hosts, index)


async def spawn_services(cfg: DictConfig, hosts: Any = None) -> Services:
    """Spawn every actor in its own process, on the node the recipe's ``layout`` names.

    ``device=cuda`` selects the GPU actors (vLLM generator, TorchTitan trainer and reference) and
    places them on GPUs (:func:`forge_core.gpu_layout.plan_gpus`); a trainer of several GPUs is a
    mesh of one actor per GPU (FSDP2), answered for by rank 0 (:class:`_Rank0`). Colocated (one
    GPU): the generator starts first, so vLLM sizes its KV cache before the others allocate.

    Args:
        cfg: the resolved run config.
        hosts: a multi-host ``HostMesh`` (node-rank order) or ``None`` for this host only.
    """
    plain = OmegaConf.to_container(cfg, resolve=True)
    procs = []

    by_name = {}

    def spawn(name: str, host_index: int, cls, *args, n: int = 1):
        p = _host_for(hosts, host_index).spawn_procs(per_host={"procs": n})
        procs.append(p)
        by_name[name] = p
        return p.spawn(name, cls, *args)

    if cfg.device == "cuda":
        from forge_core.actors.trainer import TitanReference, TitanTrainer
        from forge_core.actors.vllm_generator import VllmGenerator
        from forge_core.gpu_layout import plan_gpus

        plan = plan_gpus(cfg)
        L = cfg.layout
        gen = spawn("generator", L.generator.host, VllmGenerator, plain, plan.gpus["generator"], plan.colocated,
                    plan.per_node)
        if plan.colocated:
            await call("generator", gen.get_version)  # engine up before the others allocate
        from forge_core.weight_sync import force_rdma

        rdma = L.generator.host != L.trainer.host or L.reference.host != L.trainer.host or force_rdma()
        port = 29500 + (os.getpid() % 2000)
        nt = len(plan.gpus["trainer"])
        trainer = spawn("trainer", L.trainer.host, TitanTrainer, plain, plan.gpus["trainer"], plan.per_node, port, rdma,
                        n=nt)
        if nt > 1:
            trainer = _Rank0(trainer)
        ref = spawn("reference", L.reference.host, TitanReference, plain, plan.gpus["reference"][:1], plan.per_node)
    else:
        gen = spawn("generator", cfg.layout.generator.host, Generator, plain)
        ref = spawn("reference", cfg.layout.reference.host, Reference, plain)
        trainer = spawn("trainer", cfg.layout.trainer.host, Trainer, plain)
    reward = spawn("reward", 0, RewardActor, plain["reward"])
    buf = spawn("replay_buffer", 0, ReplayBufferActor, cfg.buffer_capacity, cfg.max_staleness)
    return Services(gen, reward, ref, trainer, buf, procs, by_name)


class _Rank0:
    """An actor mesh of several ranks seen as one actor: ``x.endpoint.call_one(*a)`` calls every
    rank (their collectives need all of them) and returns rank 0's answer."""

    def __init__(self, mesh: Any):
        self._mesh = mesh

    def __getattr__(self, name: str):
        ep = getattr(self._mesh, name)

        class _Ep:
            async def call_one(self, *args):
                vm = await ep.call(*args)
                for point, v in vm.items():
                    if point.rank == 0:
                        return v
                return next(iter(vm.values()))

        return _Ep()


async def record_placement(svc: Services, path: str) -> dict:
    """Ask a :class:`Placement` actor in each service's process where it runs; write ``path`` (JSON).

    Returns ``{service: {"hostname", "ips", "pid"}}``.
    """
    where = {}
    for name, p in svc.by_name.items():
        where[name] = await call(name, p.spawn(f"placement_{name}", Placement).where)
    with open(path, "w") as f:
        json.dump(where, f, indent=1)
    return where


async def call(actor_name: str, endpoint, *args):
    """``await endpoint.call_one(*args)``, turning any failure into :class:`ActorFailed` naming the actor."""
    try:
        return await endpoint.call_one(*args)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise ActorFailed(f"actor '{actor_name}' failed: {type(e).__name__}: {str(e)[:2000]}") from e


def batch_hash(episodes: list[Episode]) -> int:
    """A 52-bit fingerprint (a JSON-exact integer) of a training batch: prompt and response token
    ids, prompt ids and policy versions, in order. Equal hashes at a step = the same batch."""
    key = json.dumps([[e.prompt_id, e.prompt_ids, e.response_ids, e.policy_version] for e in episodes])
    return int(hashlib.sha256(key.encode()).hexdigest()[:13], 16)


def _batch_stats(episodes: list[Episode], step: int) -> dict:
    rewards = [e.reward for e in episodes]
    lens = [len(e.response_ids) for e in episodes]
    stale = [step - e.policy_version for e in episodes]
    return {
        "reward_mean": statistics.fmean(rewards), "reward_std": statistics.pstdev(rewards),
        "accuracy": statistics.fmean(e.correct for e in episodes),
        "format_rate": statistics.fmean(e.formatted for e in episodes),
        "response_len_mean": statistics.fmean(lens), "response_len_max": max(lens),
        "truncated_frac": statistics.fmean(e.truncated for e in episodes),
        "staleness_mean": statistics.fmean(stale), "staleness_max": max(stale),
    }


class Controller:
    """Runs a recipe: spawns the actors, runs both loops, logs, checkpoints, saves the final model.

    Args:
        cfg: the resolved run config (see :mod:`forge_core.config`).
        out_dir: run directory (metrics.jsonl, reward.png, checkpoints/, final/).
        hosts: optional multi-host mesh from :mod:`launch.bootstrap`.
        progress: show a tqdm progress bar on the console.
    """

    def __init__(self, cfg: DictConfig, out_dir: str, hosts: Any = None, progress: bool = True):
        self.cfg = cfg
        self.out_dir = out_dir
        self.hosts = hosts
        self.progress = progress
        self.B = cfg.prompts_per_step * cfg.generator.group_size
        self.batches_made = 0  # rollout batch counter k
        self.gen_version = 0
        self.step = 0
        self.rollout_stats: list[dict] = []
        self.changed = asyncio.Condition()
        self.buffered = 0
        self.rollout_busy = False
        self.paused = False  # set while a checkpoint is written
        self.sync_task: Optional[asyncio.Task] = None
        self.rollout_error: Optional[Exception] = None
        self.last_sync: dict = {}

    # ---- checkpoints -------------------------------------------------------------------------
    @property
    def ckpt_root(self) -> str:
        return os.path.join(self.out_dir, "checkpoints")

    def latest_checkpoint(self) -> Optional[str]:
        """Path of the newest complete checkpoint, or ``None``."""
        if not os.path.isdir(self.ckpt_root):
            return None
        done = sorted(d for d in os.listdir(self.ckpt_root) if d.startswith("step_") and not d.endswith(".tmp")
                      and os.path.isfile(os.path.join(self.ckpt_root, d, "controller.json")))
        return os.path.join(self.ckpt_root, done[-1]) if done else None

    async def save_checkpoint(self) -> str:
        """Write ``checkpoints/step_NNNNNN`` atomically (temp dir, then rename); keep the newest N."""
        s = self.svc
        final = os.path.join(self.ckpt_root, f"step_{self.step:06d}")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        await call("trainer", s.trainer.save, tmp, True)
        held = await call("replay_buffer", s.buffer.state)
        torch.save({"episodes": held}, os.path.join(tmp, "buffer.pt"))
        with open(os.path.join(tmp, "controller.json"), "w") as f:
            json.dump({"step": self.step, "batches_made": self.batches_made, "source": self.source.state_dict(),
                       "generator_version": self.gen_version}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        kept = sorted(d for d in os.listdir(self.ckpt_root) if d.startswith("step_") and not d.endswith(".tmp"))
        for d in kept[:-max(self.cfg.checkpoint.keep, 1)]:
            shutil.rmtree(os.path.join(self.ckpt_root, d), ignore_errors=True)
        return final

    async def restore(self, path: str) -> None:
        """Resume from a checkpoint written by :meth:`save_checkpoint`."""
        s = self.svc
        version = await call("trainer", s.trainer.load, path)
        with open(os.path.join(path, "controller.json")) as f:
            st = json.load(f)
        self.step, self.batches_made = st["step"], st["batches_made"]
        self.source.load_state_dict(st["source"])
        held = torch.load(os.path.join(path, "buffer.pt"), weights_only=False)["episodes"]
        await call("replay_buffer", s.buffer.restore, held)
        self.buffered = len(held)
        if version != self.step:
            raise RuntimeError(f"checkpoint {path}: trainer version {version} != step {self.step}")

    # ---- the two loops -----------------------------------------------------------------------
    async def rollout_loop(self) -> None:
        """Produce rollout batches until cancelled (see the module docstring). A failure is
        handed to the training loop (``rollout_error``), which raises it."""
        try:
            await self._rollouts()
        except Exception as e:
            async with self.changed:
                self.rollout_error = e
                self.changed.notify_all()
            raise

    async def _rollouts(self) -> None:
        cfg, s = self.cfg, self.svc
        while True:
            async with self.changed:
                await self.changed.wait_for(
                    lambda: not self.paused and self.buffered < self.B
                    and self.gen_version >= self.batches_made - cfg.max_staleness)
                self.rollout_busy = True
                problems = self.source.next_batch(cfg.prompts_per_step)
                k = self.batches_made
                self.batches_made += 1
            try:
                episodes, gen = await call("generator", s.generator.generate, problems, cfg.seed * 100_003 + k)
                t0 = time.perf_counter()
                episodes = await call("reward", s.reward.score, episodes)
                reward_s = time.perf_counter() - t0
                episodes, ref_s = await call("reference", s.reference.logprobs, episodes)
                rewards = torch.tensor([e.reward for e in episodes]).view(-1, cfg.generator.group_size)
                adv, keep, adv_m = compute_advantages(rewards, cfg.advantage)
                for e, a in zip(episodes, adv.flatten().tolist()):
                    e.advantage = a
                if cfg.advantage.drop_zero_variance:
                    episodes = [e for e in episodes if bool(keep[e.group])]
                size = await call("replay_buffer", s.buffer.add, episodes)
            finally:
                async with self.changed:
                    self.rollout_busy = False
                    self.changed.notify_all()
            async with self.changed:
                self.buffered = size
                self.rollout_stats.append(dict(gen, reward_s=reward_s, ref_s=ref_s, **adv_m))
                self.changed.notify_all()

    async def _sync(self, handle) -> None:
        r = await call("generator", self.svc.generator.update_weights, handle)
        async with self.changed:
            self.gen_version = r["version"]
            self.last_sync = r
            self.changed.notify_all()

    async def _next_batch(self) -> list[Episode]:
        while True:
            batch = await call("replay_buffer", self.svc.buffer.sample, self.B, self.step)
            size = await call("replay_buffer", self.svc.buffer.num_episodes)
            async with self.changed:
                self.buffered = size
                self.changed.notify_all()
                if batch is not None:
                    return batch
                await self.changed.wait_for(lambda: self.buffered >= self.B or self.rollout_error is not None)
            if self.rollout_error is not None:
                raise self.rollout_error

    async def run(self) -> dict:
        """Run the recipe to ``cfg.steps``; returns the last step's metrics.

        Raises:
            ActorFailed: an actor call failed (the message names the actor); checkpoints and the
                metrics file written so far stay intact.
        """
        cfg = self.cfg
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(cfg))
        self.source = PromptSource(load_gsm8k(cfg.data.split, cfg.data.dir, cfg.data.hub_id), cfg.data.seed)
        t_start = time.perf_counter()
        install_fault_hook()
        self.svc = await spawn_services(cfg, self.hosts)
        try:
            await record_placement(self.svc, os.path.join(self.out_dir, "actors.json"))
            return await self._run(t_start)
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        """Stop every actor process (idempotent). Faults Monarch reports while stopping (an actor
        still busy with a cancelled call misses its cleanup deadline) are expected and ignored."""
        global SHUTTING_DOWN
        SHUTTING_DOWN = True
        try:
            svc = getattr(self, "svc", None)  # absent when spawning failed
            if svc is not None:
                await svc.stop()
        finally:
            SHUTTING_DOWN = False

    async def _run(self, t_start: float) -> dict:
        cfg, s = self.cfg, self.svc
        ckpt = self.latest_checkpoint() if cfg.resume else None
        # The reference is the trainer's initial policy (version 0) bit for bit, in a resumed run
        # too: take it before the checkpoint overwrites the trainer's weights (a reference loaded
        # from the source in another dtype would differ slightly, and so would the KL term).
        handle = await call("trainer", s.trainer.publish)
        await call("reference", s.reference.load_initial, handle)
        if ckpt:
            await self.restore(ckpt)
            handle = await call("trainer", s.trainer.publish)
        await self._sync(handle)
        startup_s = time.perf_counter() - t_start
        # Rows 1..step were logged before checkpoint step_<step> was written: keep them, drop later ones.
        log = MetricsLog(os.path.join(self.out_dir, "metrics.jsonl"), self.step + 1, cfg.wandb,
                         os.path.basename(self.out_dir), OmegaConf.to_container(cfg))
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.step, desc=f"GRPO {cfg.recipe}", unit="step", dynamic_ncols=True)
        rollouts = asyncio.create_task(self.rollout_loop())
        row: dict = {}
        try:
            while self.step < cfg.steps:
                t0 = time.perf_counter()
                episodes = await self._next_batch()
                wait_s = time.perf_counter() - t0
                if rollouts.done():
                    rollouts.result()  # re-raise a rollout failure
                stats = _batch_stats(episodes, self.step)
                tm = await call("trainer", s.trainer.train_step, episodes)
                handle = await call("trainer", s.trainer.publish)
                if self.sync_task is not None:
                    await self.sync_task
                prev_sync = dict(self.last_sync)
                self.sync_task = asyncio.create_task(self._sync(handle))
                self.step += 1
                ro, self.rollout_stats = self.rollout_stats, []
                mean = lambda k: statistics.fmean(r[k] for r in ro) if ro else 0.0
                row = {"step": self.step, "policy_version": tm["version"], "batch_hash": batch_hash(episodes), **stats,
                       "loss": tm["loss"], "kl_mean": tm.get("kl_mean", 0.0), "kl_max": tm.get("kl_max", 0.0),
                       "clip_frac": tm["clip_frac"], "clip_frac_low": tm.get("clip_frac_low", 0.0),
                       "clip_frac_high": tm.get("clip_frac_high", 0.0), "ratio_mean": tm.get("ratio_mean", 1.0),
                       "grad_norm": tm["grad_norm"], "gen_tok_s": mean("gen_tok_s"), "gen_s": mean("gen_s"),
                       "reward_s": mean("reward_s"), "ref_s": mean("ref_s"), "train_s": tm["train_s"],
                       "wait_for_rollout_s": wait_s, "weight_sync_s": prev_sync.get("sync_s", 0.0),
                       "weight_sync_gb_s": prev_sync.get("sync_gb_s", 0.0), "generator_version": self.gen_version,
                       "zero_variance_groups": sum(r.get("zero_variance_groups", 0) for r in ro),
                       "dropped_groups": sum(r.get("dropped_groups", 0) for r in ro),
                       "step_s": time.perf_counter() - t0, "elapsed_s": time.perf_counter() - t_start,
                       "startup_s": startup_s}
                log.log(row)  # before the checkpoint: a resume keeps this row (no gap)
                if cfg.checkpoint.every and (self.step % cfg.checkpoint.every == 0 or self.step == cfg.steps):
                    await self._quiesce()
                    await self.save_checkpoint()
                    async with self.changed:
                        self.paused = False
                        self.changed.notify_all()
                if bar is not None:
                    bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.2f}",
                                    loss=f"{row['loss']:.4f}", sync=f"{row['weight_sync_s']:.2f}s")
                    bar.update(1)
            if self.sync_task is not None:
                await self.sync_task
            rollouts.cancel()
            await self._quiesce(cancel=True)
            final = os.path.join(self.out_dir, "final")
            await call("trainer", s.trainer.save, final, False)
            from forge_core.models import load_tokenizer

            load_tokenizer(cfg.model).save_pretrained(final)
            self.step = cfg.steps
            plot_rewards(log.path, os.path.join(self.out_dir, "reward.png"), f"GRPO {cfg.recipe}")
        finally:
            rollouts.cancel()
            for t in (rollouts, self.sync_task):  # retrieve a failure already raised elsewhere
                if t is not None and t.done() and not t.cancelled():
                    t.exception()
            if bar is not None:
                bar.close()
            log.close()
        return row

    async def _quiesce(self, cancel: bool = False) -> None:
        """Pause rollouts; wait until none is in flight and the weight sync is done."""
        if self.sync_task is not None:
            await self.sync_task
        if cancel:
            return
        async with self.changed:
            self.paused = True
            await self.changed.wait_for(lambda: not self.rollout_busy)
