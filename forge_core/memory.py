"""Will a layout fit its GPUs? A memory estimate of every GPU of a layout, checked before any actor
starts (:meth:`forge_core.controller.Controller.run` against the GPUs' free memory, ``make check``
against the GPUs a recipe's ``sky.yaml`` names), so that a layout that cannot fit is refused with its
numbers and the setting to change, not by vLLM or an out-of-memory error after the trainer allocated.

Units: bytes throughout (messages print GiB, 2^30 bytes, as ``nvidia-smi`` and vLLM do). ``P``: the
model's parameters (:func:`forge_core.titan_spec.hf_layout`, tied embeddings once), ``L`` layers,
``D`` hidden size, ``V`` vocabulary, ``G`` the trainer's GPUs, ``T`` tokens of a micro-batch
(``trainer.tokens_per_micro_batch``, else ``micro_batch_size`` x (prompt + response tokens)). What each
service holds on each of its GPUs (the placement is :func:`forge_core.layout.plan_layout`'s):

trainer rank, held throughout (``resident``)
    full fine-tune: 12 P / G (fp32 parameters 4 + AdamW's two fp32 moments 8, FSDP2-sharded over G);
    LoRA: b P / G for the frozen base (b: 2 in bf16, the GPU compute dtype; 4 in fp32) + 12 A / G for the
    adapters (A: :func:`forge_core.lora.num_params`); rank 0 also holds the staging buffer the weights
    are published from (:class:`forge_core.weight_sync.StagingBuffer`: every HF tensor, unsharded, in
    ``generator.dtype``: 2 P bytes in bf16).
trainer rank, during a step (``step``)
    gradients 4 x (trainable parameters) / G (freed after the step); one block's bf16 parameters
    gathered by FSDP2, 2 P / L (G > 1); activations: 34 D bytes per token and layer without activation
    checkpointing (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models", arXiv:2205.05198, sec. 4.1: 16-bit, no score matrix with flash/flex attention), with it the
    block inputs 2 D T L plus one block's 34 D T; the logits of one block of ``trainer.logprob_chunk``
    response positions, 12 V bytes a position (fp32 logits, their log-softmax and its gradient). A rough
    figure: the allocator's caching and fragmentation come on top.
reference (its own actor: a full fine-tune's), resident
    b P / R on each of its R GPUs (``layout.reference.gpus``, or sharded over the trainer's GPUs), b in
    ``generator.dtype``; its forward adds one logits chunk. With LoRA the trainer's base is the
    reference (nothing more); SFT has none.
generator replica
    ``generator.gpu_memory_utilization`` x the GPU's memory on each of its ``tp`` GPUs: vLLM's budget for
    its weights, KV cache and activations together, which it checks against the free memory at start;
    the budget must hold at least the weights, b P / tp (``generator.quantization: fp8``: P / tp).
    Colocated with the trainer and sleeping (``generator.sleep_level`` > 0), it holds its budget only
    while it generates and 2 GB while it sleeps, and the trainer's step runs while it sleeps: the GPU
    needs ``resident + max(budget, step + 2 GB)``; otherwise ``resident + budget + step``.
every process on a GPU
    its CUDA context, 0.5 GiB (a rough figure for an H100 with lazy module loading); vLLM's is in its budget.

``activation_checkpointing: null`` is estimated as the trainer decides it: off when the GPU fits
without it, else on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

GIB = 2 ** 30
CUDA_CONTEXT_BYTES = GIB // 2
SLEEPING_ENGINE_BYTES = 2e9  # what a vLLM engine asleep at level 1 keeps (CUDA graphs, its allocator's pool)
ADAM_BYTES, GRAD_BYTES = 12, 4  # per trained parameter: fp32 weight + AdamW's exp_avg and exp_avg_sq; fp32 gradient

# GPU memory as CUDA reports it (torch.cuda.get_device_properties(0).total_memory), by the accelerator
# names SkyPilot uses: H100 SXM 80 GB and H200 141 GB as seen on those machines (vLLM's "79.18 GiB",
# torch's 150.1e9 bytes), A100 as its datasheet's 80 / 40 GB less the same 1% CUDA keeps.
GPU_MEMORY = {"H100": 79.18 * GIB, "H200": 139.8 * GIB, "A100-80GB": 79.15 * GIB, "A100": 39.4 * GIB}


@dataclass
class GpuEstimate:
    """What the services placed on one GPU (``node``, ``gpu``: its index on the node) hold: ``resident``
    ``{part: bytes}`` held throughout, ``step`` ``{part: bytes}`` the trainer's step adds, ``engine_frac``
    the vLLM budget's share of the GPU (``generator.gpu_memory_utilization``, 0: no engine), ``alternate``:
    the engine sleeps while the trainer steps (colocated, ``generator.sleep_level`` > 0), ``who``: the
    services on it, ``ac``: the activation checkpointing the estimate assumed (None: no trainer here),
    ``engine_weights``: the engines' weights on it (bytes), which their budget must hold."""

    node: int
    gpu: int
    resident: dict = field(default_factory=dict)
    step: dict = field(default_factory=dict)
    engine_frac: float = 0.0
    alternate: bool = False
    who: list = field(default_factory=list)
    ac: Optional[bool] = None
    engine_weights: float = 0.0

    def need(self, total: float) -> float:
        """Bytes this GPU needs when it has ``total`` bytes (the engine's budget is a share of it)."""
        r, s, e = sum(self.resident.values()), sum(self.step.values()), self.engine_frac * total
        if self.alternate:
            return r + max(e, s + SLEEPING_ENGINE_BYTES)
        return r + e + s

    def min_total(self) -> float:
        """The smallest GPU memory (bytes) this GPU's services fit in (``inf`` when the engine's share is 1)."""
        r, s, f = sum(self.resident.values()), sum(self.step.values()), self.engine_frac
        if f >= 1:
            return float("inf")
        floor = self.engine_weights / f if f else 0.0  # the budget holds the weights
        if self.alternate:
            return max(r + s + SLEEPING_ENGINE_BYTES, r / (1 - f), floor)
        return max((r + s) / (1 - f), floor)

    def parts(self, total: Optional[float] = None) -> str:
        """The parts in GiB, largest first, as one line: ``trainer state 61.0, staging 15.3, ...``."""
        items = sorted({**self.resident, **self.step}.items(), key=lambda kv: -kv[1])
        out = [f"{k} {v / GIB:.1f}" for k, v in items if v >= 0.05 * GIB]
        if self.engine_frac:
            share = f"{self.engine_frac:g} of the GPU" + (f" = {self.engine_frac * total / GIB:.1f}" if total else "")
            out.append(f"vLLM {share}" + (" (asleep while the trainer steps)" if self.alternate else ""))
        return ", ".join(out)


def estimate(cfg: Any, total: Optional[float] = None) -> list[GpuEstimate]:
    """The memory estimate of every GPU of ``cfg``'s layout (see the module docstring), one
    :class:`GpuEstimate` per GPU that holds a service, in (node, GPU) order. ``total``: each GPU's memory
    (bytes), used only to settle ``trainer.activation_checkpointing: null`` (off when the GPU fits
    without it); None: on. ``[]`` for ``device: cpu``.

    Raises:
        ValueError: the model is not in the registry; LayoutError (a ValueError): the layout cannot be placed.
    """
    if cfg.device != "cuda":
        return []
    from forge_core.layout import plan_layout
    from forge_core.lora import LoRAConfig, num_params
    from forge_core.models import hf_config_dict
    from forge_core.titan_spec import hf_layout

    hf = hf_config_dict(cfg.model.name)
    plan = plan_layout(cfg, hf["num_attention_heads"])
    P = sum(k for *_, k in hf_layout(hf))
    V = hf["vocab_size"]
    t, g = cfg.trainer, cfg.generator
    lo = LoRAConfig(**{k: t.lora[k] for k in ("rank", "alpha", "dropout", "target_modules", "save_merged")})
    b = 4 if g.dtype == "float32" else 2  # generator.dtype (auto: bf16 on GPUs)
    base_b = 4 if t.compute_dtype == "float32" else 2  # LoRA's frozen base: the trainer's compute dtype
    G = plan.trainer.ranks
    T = t.tokens_per_micro_batch or t.micro_batch_size * (g.max_prompt_tokens + g.max_response_tokens)
    chunk = 12 * V * min(t.logprob_chunk, T)
    gpus: dict[tuple, GpuEstimate] = {}

    def at(host: int, i: int) -> GpuEstimate:
        return gpus.setdefault((host, i), GpuEstimate(host, i))

    trained = num_params(hf, lo) if lo.rank else None
    for r, i in enumerate(plan.trainer.gpus):
        e = at(plan.trainer.host, i)
        e.who.append(f"trainer rank {r}/{G}")
        res, step = trainer_parts(hf, G, T, True, trained=trained, base_bytes=base_b, staging_bytes=b if r == 0 else 0,
                                  logprob_chunk=t.logprob_chunk)
        e.resident.update(res)
        e.resident["CUDA contexts"] = e.resident.get("CUDA contexts", 0) + CUDA_CONTEXT_BYTES
        e.step.update(step)
    own_ref = cfg.loss.name != "sft" and not lo.rank
    if own_ref:
        for i in plan.reference.gpus:
            e = at(plan.reference.host, i)
            e.who.append("reference")
            e.resident["reference"] = b * P / plan.reference.ranks + chunk
            e.resident["CUDA contexts"] = e.resident.get("CUDA contexts", 0) + CUDA_CONTEXT_BYTES
    for k, s in enumerate(plan.generators):
        for i in s.gpus:
            e = at(s.host, i)
            e.who.append(f"generator {k}" if len(plan.generators) > 1 else "generator")
            e.engine_frac += g.gpu_memory_utilization
            e.engine_weights += (1 if g.quantization == "fp8" else b) * P / len(s.gpus)
            e.alternate = plan.colocated and g.sleep_level > 0 and (s.host, i) in {
                (plan.trainer.host, j) for j in plan.trainer.gpus}
    out = [gpus[k] for k in sorted(gpus)]
    for e in out:
        if any(w.startswith("trainer") for w in e.who):
            ac = t.activation_checkpointing
            if ac is None:  # as the trainer decides: off when the GPU fits without it
                e.step["activations"] = activation_bytes(hf, T, False)
                ac = total is None or e.need(total) > total
            e.ac = bool(ac)
            e.step["activations"] = activation_bytes(hf, T, e.ac)
    return out


def activation_bytes(hf: dict, tokens: int, ac: bool) -> float:
    """Activations of one micro-batch of ``tokens`` tokens through a model of HF config ``hf``
    (bytes): 34 D per token and layer without activation checkpointing (Korthikanti et al. 2022,
    arXiv:2205.05198, sec. 4.1, 16-bit, no score matrix with flash/flex attention); with it the block
    inputs, 2 D per token and layer, plus one block's 34 D per token."""
    D, L = hf["hidden_size"], hf["num_hidden_layers"]
    return 2 * D * tokens * L + 34 * D * tokens if ac else 34 * D * tokens * L


def trainer_parts(hf: dict, world: int, tokens: int, ac: bool, trained: Optional[int] = None, base_bytes: int = 4,
                  staging_bytes: int = 0, logprob_chunk: int = 1024) -> tuple[dict, dict]:
    """``(resident, step)``: ``{part: bytes}`` one trainer rank of ``world`` holds throughout and adds
    during a step (see the module docstring), for a model of HF config ``hf`` and micro-batches of
    ``tokens`` tokens. ``trained``: the trained parameters (LoRA's adapters; None: all of them, the full
    fine-tune, fp32 master weights), the others frozen in ``base_bytes`` a parameter; ``staging_bytes``: a
    parameter of the staging buffer on this rank (rank 0: 2 for bf16; others 0); ``logprob_chunk``:
    ``trainer.logprob_chunk``."""
    from forge_core.titan_spec import hf_layout

    P = sum(k for *_, k in hf_layout(hf))
    n = P if trained is None else trained
    res = {"trainer weights + AdamW" if trained is None else "adapters + AdamW": ADAM_BYTES * n / world}
    if trained is not None:
        res["LoRA frozen base"] = base_bytes * P / world
    if staging_bytes:
        res["weight-sync staging"] = staging_bytes * P
    step = {"gradients": GRAD_BYTES * n / world, "activations": activation_bytes(hf, tokens, ac),
            "logits chunk": 12 * hf["vocab_size"] * min(logprob_chunk, tokens)}
    if world > 1:
        step["gathered block"] = 2 * P / hf["num_hidden_layers"]
    return res, step


# The setting that shrinks each part, for the refusal's message.
_REMEDY = {"trainer weights + AdamW": "layout.trainer.gpus (FSDP2 shards them over more GPUs) or trainer.lora.rank",
           "LoRA frozen base": "layout.trainer.gpus (FSDP2 shards it over more GPUs)",
           "adapters + AdamW": "trainer.lora.rank",
           "gradients": "layout.trainer.gpus (FSDP2 shards them over more GPUs)",
           "weight-sync staging": "layout.trainer.gpus does not shrink it (rank 0 holds the whole model in "
                                  "generator.dtype): free room elsewhere on that GPU",
           "activations": "trainer.tokens_per_micro_batch (or micro_batch_size), or trainer.activation_checkpointing=true",
           "logits chunk": "trainer.logprob_chunk",
           "reference": "layout.reference.gpus (GPUs of its own)",
           "vLLM": "generator.gpu_memory_utilization"}


def misfits(ests: list[GpuEstimate], free: dict, totals: dict, what: str) -> list[str]:
    """One line per GPU of ``ests`` whose estimate exceeds its free memory: ``free[(node, gpu)]`` and
    ``totals[(node, gpu)]`` in bytes (a GPU missing from ``free`` is not checked); ``what``: how the GPUs
    are named in the line (``"an H100"``, ``"NVIDIA H100 80GB HBM3"``). Each line names the GPU, the
    estimate, the free memory, the parts and the setting that shrinks the largest one."""
    out = []
    for e in ests:
        key = (e.node, e.gpu)
        if key not in free:
            continue
        total, have = totals[key], free[key]
        need = e.need(total)
        if e.engine_weights > e.engine_frac * total:
            out.append(f"GPU {e.gpu} of node {e.node} ({what}, {total / GIB:.1f} GiB): vLLM's budget, "
                       f"generator.gpu_memory_utilization={e.engine_frac:g} of it = {e.engine_frac * total / GIB:.1f} "
                       f"GiB, cannot hold the model's weights ({e.engine_weights / GIB:.1f} GiB) and a KV cache: "
                       f"raise generator.gpu_memory_utilization or layout.generator.tp")
        if need <= have:
            continue
        parts = {**e.resident, **e.step, "vLLM": e.engine_frac * total}
        big = max(parts, key=parts.get)
        if big == "weight-sync staging":  # nothing shrinks it: name the next largest
            big = max((k for k in parts if k != big), key=parts.get)
        room = f"{total / GIB:.1f} GiB" + (f", {have / GIB:.1f} GiB free" if have < total else "")
        out.append(f"GPU {e.gpu} of node {e.node} ({what}, {room}) needs an "
                   f"estimated {need / GIB:.1f} GiB for {', '.join(e.who)}: {e.parts(total)}; the largest part is "
                   f"{big}: change {_REMEDY.get(big, big)}")
    return out


def check_free(cfg: Any, gpus: Optional[list] = None) -> Optional[str]:
    """The refusal message when ``cfg``'s layout does not fit this node's GPUs, else None. ``gpus``:
    ``[(name, free_bytes, total_bytes)]`` of node 0's GPUs (default: :func:`gpu_memory`, which measures
    them); the layout's other nodes are taken to have the same GPUs, their whole memory free. None too
    when the GPUs cannot be measured (no CUDA here: the launcher's own check names that)."""
    gpus = gpu_memory() if gpus is None else gpus
    if cfg.device != "cuda" or not gpus:
        return None
    name, _, total = gpus[0]
    ests = estimate(cfg, total)
    free = {(e.node, e.gpu): (gpus[e.gpu][1] if e.node == 0 and e.gpu < len(gpus) else total) for e in ests}
    totals = {(e.node, e.gpu): (gpus[e.gpu][2] if e.node == 0 and e.gpu < len(gpus) else total) for e in ests}
    bad = misfits(ests, free, totals, name)
    if not bad:
        return None
    return (f"the layout of recipe {cfg.recipe} does not fit its GPUs (memory estimate: forge_core/memory.py):\n  - "
            + "\n  - ".join(bad))


def gpu_memory(timeout_s: float = 120.0) -> list[tuple[str, int, int]]:
    """``[(name, free bytes, total bytes)]`` of the CUDA GPUs this process sees, in CUDA's order
    (``torch.cuda.mem_get_info`` in a child process, so this one never starts CUDA: the actors' GPUs
    keep the memory a context here would take); ``[]`` without CUDA or when the child fails."""
    code = ("import json, torch\nn = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
            "print(json.dumps([[torch.cuda.get_device_name(i), *torch.cuda.mem_get_info(i)] for i in range(n)]))")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, "CUDA_MODULE_LOADING": "LAZY"})
        return [tuple(x) for x in json.loads(r.stdout.strip().splitlines()[-1])] if r.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return []


def report(cfg: Any, named: Optional[dict] = None) -> tuple[list[str], list[str]]:
    """``make check``'s view: ``(lines, refusals)``. ``lines``: one per group of GPUs with the same
    estimate, the parts and the smallest GPU that fits them; ``named``: ``{GPU name: bytes}`` to check
    against (the recipe's ``sky.yaml`` accelerators, or a size given on the command line), each GPU
    taken as free; ``refusals``: :func:`misfits`' lines for each named GPU that cannot hold the layout."""
    ests = estimate(cfg)
    if not ests:
        return [], []
    groups: dict[tuple, list] = {}
    for e in ests:
        who = tuple(dict.fromkeys(w.split(" ")[0] for w in e.who))  # "trainer rank 1/4", "generator 2": the service
        groups.setdefault((e.parts(), who, e.node, e.ac), []).append(e)
    lines = []
    for (parts, who, node, ac), es in groups.items():
        ids = ",".join(str(e.gpu) for e in es)
        how = "" if ac is None else f"; activation checkpointing {'on' if ac else 'off'}" + (
            " if needed" if cfg.trainer.activation_checkpointing is None else "")
        lines.append(f"node {node} GPU{'s' if len(es) > 1 else ''} {ids} ({', '.join(who)}): {parts}{how}: "
                     f"fits a GPU of {es[0].min_total() / GIB:.1f} GiB or more")
    refusals = []
    for name, total in (named or {}).items():
        ests = estimate(cfg, total)
        keys = {(e.node, e.gpu): total for e in ests}
        refusals += misfits(ests, keys, keys, name)
    return lines, refusals
