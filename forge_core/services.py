"""Spawning and placing the actors of a run, their lifetimes and faults: one object the controller holds.

Every service is a Monarch proc mesh on one node, one process per rank (one per GPU on CUDA), with
one actor per process; the generator is one such service per replica. The plan of which node and
GPUs each gets is :func:`forge_core.layout.plan_layout`; the class playing each role on each device
is in :data:`ROLES` (the generator: HF on CPU, vLLM on CUDA; trainer and reference: TorchTitan,
FSDP2 over several GPUs). Next to each service's actor runs a
:class:`~forge_core.actors.placement.Placement` actor (where the process runs, a free port from the
OS for ``torch.distributed``), and next to each generator replica a
:class:`~forge_core.actors.weight_receiver.WeightReceiver` (network weight transfers while it
generates). Actors get their own config section plus named fields, never the whole config. With
LoRA on the trainer (``trainer.lora.rank`` > 0) the reference is no actor of its own: the
``reference`` service is the trainer's processes (:class:`BaseModelReference`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import json
import os
import shutil
import signal
import socket
import tempfile
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from forge_core.config import GeneratorConfig, TrainerConfig, WeightSyncConfig, to_dataclass
from forge_core.layout import Plan, Slot, plan_layout
from forge_core.losses import LossConfig
from forge_core.models import ModelConfig
from forge_core.rewards import RewardConfig

ROLES = {
    "generator": ("forge_core.actors.generator:Generator", "forge_core.actors.vllm_generator:VllmGenerator"),
    "trainer": ("forge_core.actors.trainer:Trainer",) * 2,
    "reference": ("forge_core.actors.reference:Reference",) * 2,
    "reward": ("forge_core.actors.reward:RewardActor",) * 2,
    "replay_buffer": ("forge_core.actors.replay_buffer:ReplayBufferActor",) * 2,
}


class RunFailed(RuntimeError):
    """The run cannot go on (an actor failed beyond recovery, training diverged); the message says
    why. Checkpoints and metrics written so far stay intact."""


class ActorFailed(RunFailed):
    """An actor call failed, timed out, or its process died; the message names the actor. ``actor``:
    the service whose call failed (``"trainer"``, ``"generator_1"``, ...; what in-run recovery acts
    on), or ``""`` when the run cannot go on whatever the actor (its restarts used up)."""

    def __init__(self, message: str, actor: str = ""):
        super().__init__(message)
        self.actor = actor


async def call(actor_name: str, endpoint: Any, *args: Any, timeout_s: Optional[float] = None) -> Any:
    """``await endpoint.call_one(*args)``, turning any failure (and a missed ``timeout_s`` deadline,
    in seconds) into :class:`ActorFailed` naming the actor (and, for a deadline, the seconds waited).
    A cancellation (Ctrl-C) always propagates (Python 3.11's ``asyncio.wait_for`` could swallow it)."""
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            return await endpoint.call_one(*args)
    except Exception as e:
        if isinstance(e, TimeoutError) and deadline.expired():  # not a TimeoutError the actor raised
            raise ActorFailed(f"actor '{actor_name}' did not answer within {timeout_s:.0f} s (hung?)", actor_name) from None
        raise ActorFailed(f"actor '{actor_name}' failed: {type(e).__name__}: {clip(str(e))}", actor_name) from e


def clip(text: str, n: int = 2000) -> str:
    """``text`` cut to about ``n`` characters by dropping its middle: a remote actor's error carries
    its traceback, whose last lines (the exception itself, say a CUDA out-of-memory) matter most."""
    if len(text) <= n:
        return text
    head = n // 4
    return f"{text[:head]} [... {len(text) - n:,} characters ...] {text[-(n - head):]}"


async def call_all(actor_name: str, endpoint: "_Endpoint", *args: Any, timeout_s: Optional[float] = None) -> list:
    """Like :func:`call`, for every rank of a service: the answers in rank order."""
    return await call(actor_name, SimpleNamespace(call_one=endpoint.call_all), *args, timeout_s=timeout_s)


class _Endpoint:
    """One endpoint of every rank of a service (``mesh``: its actor mesh, one process per rank along
    ``procs``): ``call_one`` calls all ranks (their collectives need all of them) and returns rank 0's
    answer; ``call_all`` returns every rank's, in rank order."""

    def __init__(self, mesh: Any, name: str, ranks: int):
        self.mesh, self.name, self.ranks = mesh, name, ranks

    async def call_one(self, *args: Any) -> Any:
        """Call every rank; rank 0's answer."""
        return (await self.call_all(*args))[0]

    async def call_all(self, *args: Any) -> list:
        """Call every rank; the answers in rank order. Each rank is called on its own, so the first
        rank that raises ends the call at once with its error, while the others may still wait in a
        collective for it (a call of the whole mesh would wait for every rank: until the caller's
        deadline). Raises what the first failing rank raised."""
        if self.ranks == 1:
            return [await getattr(self.mesh, self.name).call_one(*args)]
        tasks = [asyncio.ensure_future(getattr(self.mesh.slice(procs=r), self.name).call_one(*args))
                 for r in range(self.ranks)]
        try:
            return list(await asyncio.gather(*tasks))  # raises the first error as it comes
        finally:
            for t in tasks:
                t.cancel()


@dataclass
class Service:
    """A spawned service: its slot (node, GPUs), proc mesh, actor mesh and where each rank runs.
    ``svc.trainer.publish`` is an endpoint of every rank (see :class:`_Endpoint`)."""

    name: str
    slot: Slot
    procs: Any
    actor: Any
    where: list = field(default_factory=list)  # per rank: Placement.where's {"hostname", "ips", "addr", ...}
    receiver: Any = None  # generator replicas: the WeightReceiver of the same process

    @property
    def ranks(self) -> int:
        """Processes of the service (one per entry of ``where``; a vLLM replica has one whatever its TP)."""
        return len(self.where) or 1

    def __getattr__(self, endpoint: str) -> _Endpoint:
        if endpoint.startswith("_"):
            raise AttributeError(endpoint)
        return _Endpoint(self.actor, endpoint, self.ranks)

    async def stop(self, timeout_s: float = 30.0, kill: bool = False) -> None:
        """Stop the service's processes within ``timeout_s`` seconds; errors are ignored (an actor
        still busy with a cancelled call misses its deadline). With ``kill`` (a failed service being
        replaced), its processes on this host get SIGKILL first: a hung (e.g. stopped) process would
        only let the stop run into its timeout. Shared-memory weight buffers the processes of this
        host left in /dev/shm are removed (a process killed or stopped never removes its own)."""
        from forge_core.weight_sync import remove_shm_buffers
        local = [w["pid"] for w in self.where if w["hostname"] == socket.gethostname()]
        if kill:
            for pid in local:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.procs.stop(), timeout=timeout_s)
        for pid in local:
            remove_shm_buffers(pid)


@dataclass
class BaseModelReference(Service):
    """The ``reference`` service when LoRA is on: the trainer's own processes and actor, whose base
    model with the adapters off is the initial policy (:meth:`forge_core.actors.trainer.Trainer
    .reference_logprobs` answers ``logprobs``). It holds no weights of its own, needs no loading, and
    cannot be respawned apart from the trainer; stopping it is the trainer's business."""

    def __getattr__(self, endpoint: str) -> _Endpoint:
        """The trainer's endpoint: ``logprobs`` is its ``reference_logprobs``, the others keep their names."""
        return super().__getattr__({"logprobs": "reference_logprobs"}.get(endpoint, endpoint))

    async def stop(self, timeout_s: float = 30.0, kill: bool = False) -> None:
        """Nothing: these are the trainer's processes, stopped with it."""


@dataclass
class Services:
    """Every service of a run: ``plan`` is the placement they were spawned from."""

    generators: list  # one Service per generator replica
    reward: Service
    reference: Optional[Service]  # None in an SFT run (loss=sft): no reference, no replay buffer
    trainer: Service
    buffer: Optional[Service]
    plan: Plan
    cfg: Any = None
    hosts: Any = None
    dtypes: dict = field(default_factory=dict)  # "generator"/"reference": the dtype they resolved; respawns keep it

    @property
    def generator(self) -> Service:
        """The first generator replica."""
        return self.generators[0]

    @property
    def reference_in_trainer(self) -> bool:
        """Whether the trainer serves the reference (LoRA: :class:`BaseModelReference`)."""
        return isinstance(self.reference, BaseModelReference)

    def all(self) -> list[Service]:
        """Every service."""
        return [s for s in (*self.generators, self.reward, self.reference, self.trainer, self.buffer) if s is not None]

    def write_placement(self, path: str) -> None:
        """Write ``{service: {"hostname", "ips", "pid", ...}}`` of rank 0 of each service to ``path``
        (JSON: actors.json)."""
        with open(path, "w") as f:
            json.dump({s.name: s.where[0] for s in self.all()}, f, indent=1)

    async def respawn(self, name: str) -> Service:
        """Replace the service ``name`` (``generator[_i]``, ``reward``, ``reference``, ``trainer`` or
        ``replay_buffer``) with a new one on the same node and GPUs: the old processes are stopped
        (killed if they hang). Returns the new service, already in place; its weights and state are the
        caller's business (a new trainer holds the initial policy, version 0; a new replay buffer is
        empty). It gets the dtype its role resolved at the start (``dtypes``): a new ``auto`` probe could
        pick another one than the weights the trainer publishes. With LoRA the ``reference`` is the new
        trainer's base model. Raises ActorFailed when the new actor's constructor fails, or, naming the
        trainer (``actor="trainer"``), for a reference the trainer serves (LoRA: the trainer failed)."""
        old = next(s for s in self.all() if s.name == name)
        if isinstance(old, BaseModelReference):
            raise ActorFailed("actor 'reference' is the trainer's base model (trainer.lora), and the trainer failed: "
                              "the trainer is respawned with it", actor="trainer")
        await old.stop(10, kill=True)
        with contextlib.suppress(OSError):  # its CoreShare mark, if it died busy (the others kept half the cores)
            os.unlink(os.path.join(cores_dir(), name))
        role = "generator" if name.startswith("generator") else name
        new = await spawn_service(self.cfg, role, old.slot, self.plan, self.hosts, name, self.dtypes.get(role))
        if role == "generator":
            self.generators[self.generators.index(old)] = new
        else:
            setattr(self, "buffer" if role == "replay_buffer" else role, new)
        if role == "trainer" and self.reference_in_trainer:
            self.reference = BaseModelReference("reference", new.slot, new.procs, new.actor, new.where)
        return new

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every actor process (idempotent), the services at once, each within ``timeout_s`` seconds."""
        await asyncio.gather(*(s.stop(timeout_s) for s in self.all()))
        shutil.rmtree(cores_dir(), ignore_errors=True)


def eval_max_tokens(cfg: DictConfig) -> int:
    """The held-out evaluation's response budget (tokens): ``eval.max_response_tokens``, or the rollouts'."""
    return cfg.eval.max_response_tokens or cfg.generator.max_response_tokens


def actor_kwargs(cfg: DictConfig, role: str, slot: Slot, plan: Plan, port: int = 0, addr: str = "127.0.0.1",
                 name: str = "", dtype: Optional[str] = None) -> dict:
    """The constructor arguments of ``role``'s actor: its own config sections as their schema dataclasses
    (:func:`forge_core.config.to_dataclass`: ``model`` a :class:`~forge_core.models.ModelConfig`,
    ``generator`` a :class:`~forge_core.config.GeneratorConfig`, ``trainer`` a
    :class:`~forge_core.config.TrainerConfig`, ``loss`` its loss's :class:`~forge_core.losses.LossConfig`
    subclass, ...; ``env`` stays a dict, what an environment's constructor is given) plus named fields;
    ``dtype`` (a respawn's) replaces ``generator.dtype`` for the generator and the reference."""
    if role == "reward":
        return {"reward_cfg": to_dataclass(cfg.reward, RewardConfig)}
    if role == "replay_buffer":
        return {"capacity": cfg.buffer_capacity, "max_staleness": cfg.max_staleness,
                "oldest_version_first": cfg.rollout.mode == "continuous"}
    gpu = cfg.device == "cuda"
    kw = dict(seed=cfg.seed, threads=max(cfg.threads_per_actor, 4) if gpu else cfg.threads_per_actor,
              model=to_dataclass(cfg.model, ModelConfig),
              **({"gpus": list(slot.gpus), "per_node": plan.gpus_per_node} if gpu else {"cores_dir": cores_dir()}))
    if role == "generator":
        kw.update(generator=dataclasses.replace(to_dataclass(cfg.generator, GeneratorConfig),
                                                dtype=dtype or cfg.generator.dtype),
                  system_prompt=cfg.data.system_prompt, replica=name, stop_after_answer=cfg.reward.fn == "gsm8k",
                  env=OmegaConf.to_container(cfg.env, resolve=True))
        if gpu:
            g = cfg.generator
            kw.update(colocated=slot.host == plan.trainer.host and bool(set(slot.gpus) & set(plan.trainer.gpus)),
                      bucket_mb=cfg.weight_sync.bucket_mb, continuous=cfg.rollout.mode == "continuous",
                      max_model_len=g.max_prompt_tokens + max(g.max_response_tokens, eval_max_tokens(cfg)))
        return kw
    kw.update(device=cfg.device, temperature=cfg.generator.temperature, port=port,
              seq_len=cfg.generator.max_prompt_tokens + cfg.generator.max_response_tokens)
    if role == "trainer":
        return dict(kw, trainer=to_dataclass(cfg.trainer, TrainerConfig), loss=to_dataclass(cfg.loss, LossConfig),
                    publish_dtype=cfg.generator.dtype, max_response_tokens=cfg.generator.max_response_tokens, addr=addr,
                    weight_sync=to_dataclass(cfg.weight_sync, WeightSyncConfig), shared_gb=_shared_gb(cfg, plan),
                    shared_frac=cfg.generator.gpu_memory_utilization if plan.colocated and not cfg.generator.sleep_level
                    else 0.0)
    t = cfg.trainer  # the reference
    return dict(kw, dtype=dtype or cfg.generator.dtype, micro_batch_size=t.micro_batch_size * (2 if gpu else 1),
                tokens_per_micro_batch=t.tokens_per_micro_batch, logprob_chunk=t.logprob_chunk, compile=t.compile,
                mps_priority=t.mps_client_priority)


def cores_dir() -> str:
    """Where this run's CPU actors share each host's cores (:class:`forge_core.actors.process.CoreShare`):
    a directory named after the controller's process, in /dev/shm (or the temp dir)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"forge-cores-{os.getpid()}")


def _shared_gb(cfg: DictConfig, plan: Plan) -> float:
    """GB that others hold on a trainer GPU: a reference sharded over the trainer's GPUs (its
    weights' share), and a colocated engine asleep (about 2 GB it keeps; an engine that never
    sleeps is the trainer's ``shared_frac``)."""
    if cfg.device != "cuda":
        return 0.0
    gb = 2.0 if plan.colocated and cfg.generator.sleep_level else 0.0
    if plan.reference.host == plan.trainer.host and set(plan.reference.gpus) & set(plan.trainer.gpus) \
            and not cfg.trainer.lora.rank:  # (with LoRA the reference is the trainer's own base model)
        from forge_core import titan  # torch only: TorchTitan itself is imported by the actors
        from forge_core.models import hf_config_dict
        n = sum(k for *_, k in titan.hf_layout(hf_config_dict(cfg.model.name)))
        gb += 2 * n / plan.reference.ranks / 1e9
    return gb


async def spawn_service(cfg: DictConfig, role: str, slot: Slot, plan: Plan, hosts: Any = None,
                        name: str = "", dtype: Optional[str] = None) -> Service:
    """Spawn ``role`` on ``slot`` (one process per GPU; a generator replica is one process whatever
    its GPUs, as vLLM starts its own TP workers) with a Placement actor beside each process; a
    generator replica also gets its WeightReceiver. ``dtype``: see :func:`actor_kwargs`. Waits until
    the actor is constructed. Raises ActorFailed when the actor's constructor fails or misses
    ``fault.startup_timeout_s`` (the message names it)."""
    from monarch.actor import this_host
    from forge_core.actors.placement import Placement
    name = name or role
    host = this_host() if hosts is None else hosts.slice(hosts=slot.host)  # one node, or node slot.host of hosts
    ranks = 1 if role == "generator" else slot.ranks
    procs = host.spawn_procs(per_host={"procs": ranks})
    placement = procs.spawn(f"placement_{name}", Placement)
    start_s = cfg.fault.startup_timeout_s
    where = await call_all(f"placement_{name}", _Endpoint(placement, "where", ranks), timeout_s=start_s)
    addr = where[0]["addr"] if hosts is not None and where[0]["addr"] else "127.0.0.1"
    mod, cls = ROLES[role][cfg.device == "cuda"].split(":")  # imported on demand: vLLM only on GPUs
    actor = procs.spawn(name, getattr(importlib.import_module(mod), cls),
                        **actor_kwargs(cfg, role, slot, plan, where[0]["free_port"], addr, name, dtype))
    svc = Service(name, slot, procs, actor, where)
    if role in ("generator", "trainer"):  # a failing constructor surfaces here, naming the actor
        try:
            await call(name, svc.get_version, timeout_s=start_s)
        except BaseException as e:
            await svc.stop(10)
            if isinstance(e, ActorFailed) and e.__cause__ is None:  # the deadline (not an error it raised)
                raise ActorFailed(f"{e} at startup: fault.startup_timeout_s={start_s:g}, if it only needs longer")
            raise
    if role == "generator":
        from forge_core.actors.weight_receiver import WeightReceiver
        svc.receiver = procs.spawn(f"receiver_{name}", WeightReceiver, name, cfg.device,
                                   to_dataclass(cfg.weight_sync, WeightSyncConfig))
    return svc


async def spawn_services(cfg: DictConfig, hosts: Any = None) -> Services:
    """Spawn every service of ``cfg`` where its layout places it (see the module docstring); an SFT run
    (``loss=sft``) has no reference and no replay buffer (its generator replicas tokenize the targets
    and serve the held-out evaluation); with LoRA (``trainer.lora.rank`` > 0) the trainer serves the
    reference (:class:`BaseModelReference`), no reference actor is spawned.
    Colocated with the trainer, the generator starts first, so vLLM sizes its KV cache before the
    others allocate. ``hosts``: a multi-host ``HostMesh`` (node-rank order) or None for this host.
    Raises ActorFailed when an actor's constructor fails; the services already started are stopped."""
    import monarch.actor
    monarch.actor.unhandled_fault_hook = _on_fault
    plan = plan_layout(cfg)
    started: list[Service] = []

    async def spawn(*jobs: tuple) -> list[Service]:  # (role, slot, name) each, concurrently
        got = await asyncio.gather(*(spawn_service(cfg, r, s, plan, hosts, n) for r, s, n in jobs),
                                   return_exceptions=True)
        started.extend(g for g in got if isinstance(g, Service))
        errors = [g for g in got if isinstance(g, BaseException)]
        if errors:
            for s in started:
                await s.stop(10)
            raise errors[0]
        return got

    n, sft = len(plan.generators), cfg.loss.name == "sft"  # SFT: no reference, no replay buffer
    own_ref = not sft and not cfg.trainer.lora.rank  # LoRA: the trainer's base model is the reference
    jobs = [*(("generator", s, "generator" if n == 1 else f"generator_{i}") for i, s in enumerate(plan.generators)),
            ("trainer", plan.trainer, ""), ("reward", Slot(0), ""),
            *([("reference", plan.reference, "")] if own_ref else []),
            *([] if sft else [("replay_buffer", Slot(0), "")])]
    got = await spawn(jobs[0]) + await spawn(*jobs[1:]) if plan.colocated else await spawn(*jobs)  # the engine first
    rest = got[n:]
    trainer, reward = rest[:2]
    reference = rest.pop(2) if own_ref else None
    buf = rest[2] if len(rest) > 2 else None
    if not sft and reference is None:
        reference = BaseModelReference("reference", trainer.slot, trainer.procs, trainer.actor, trainer.where)
    return Services(got[:n], reward=reward, reference=reference, trainer=trainer, buffer=buf, plan=plan, cfg=cfg,
                    hosts=hosts)


def _on_fault(failure: Any) -> None:
    """Monarch's ``unhandled_fault_hook``, which by default exits the controller when an actor fails
    (also when a busy one misses its cleanup deadline as it is stopped): nothing, as the next call to
    the failed actor raises :class:`ActorFailed` naming it."""
