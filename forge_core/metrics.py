"""Per-step metrics: a training step's row (:func:`step_row`), a JSONL file (one line per step),
optional wandb, and the end-of-run plot."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from typing import Any, Optional

from forge_core.episode import Episode


def step_row(step: int, trainer: dict, batch: dict, sync: dict, *, state: dict, rollouts: list[dict],
             reported: list[dict], timings: dict, checkpoint: Optional[dict] = None) -> dict:
    """One training step's ``metrics.jsonl`` row: a flat dict, its keys in this order.

    Args:
        step: the steps taken so far (1-based: the step just trained).
        trainer: the trainer's ``train_step`` metrics: ``version``, ``loss``, ``clip_frac``,
            ``grad_norm``, ``train_s``; ``kl_mean``, ``kl_max``, ``clip_frac_low``, ``clip_frac_high``,
            ``ratio_mean``, ``tokens_per_s``, the train-inference mismatch ``mismatch_kl``,
            ``mismatch_max``, ``is_ratio_mean``, ``is_ratio_max``, ``is_corrected_frac``
            (:func:`forge_core.losses.compute_loss`) where the loss reports them (else 0, ratios 1);
            on GPUs ``mfu`` (useful FLOPs over seconds and the datasheet peak) and ``peak_mem_gb``
            (rank 0's most allocated GPU memory so far, GB), logged as 0 on a CPU.
        batch: the trained batch's ``batch_hash`` (:func:`batch_hash`) and :func:`batch_stats`.
        sync: the previous weight sync's figures: ``weight_sync_s``, ``weight_transfer_s``,
            ``weight_sync_exposed_s`` (seconds), ``weight_sync_gb_s`` (GB/s), ``weight_sync_bytes``
            (the published weights' bytes, the merged model's with LoRA); 0 when absent.
        state: the controller's state (``Controller.state_dict``); its ``generator_version``,
            ``skipped_batches``, ``checkpoint_failures`` and ``restarts`` (``{role: n}``, logged as
            ``restarts_<role>``) are logged.
        rollouts: the stats of the rollouts finished during this step; their ``zero_variance_groups``
            and ``dropped_groups`` are summed.
        reported: the rollouts whose timings the row reports, as means: ``gen_tok_s``, ``gen_s``,
            ``reward_s``, ``ref_s`` and ``gen_replicas`` (0 when none).
        timings: ``wait_for_rollout_s``, ``step_s``, ``elapsed_s``, ``startup_s`` (seconds).
        checkpoint: figures of the checkpoints since the previous row, 0 when none:
            ``checkpoint_exposed_s`` (seconds training waited for a save: the staging in host memory,
            or the whole write without ``checkpoint.background``), ``checkpoint_s`` (seconds from a
            save's start to its commit) and ``checkpoint_bytes`` (the committed directory's bytes).

    Raises:
        KeyError: a required key missing from a piece (the ones read without a default above).
    """
    tm, mean = trainer, lambda k: statistics.fmean(r[k] for r in reported) if reported else 0.0  # noqa: E731
    return {"step": step, "policy_version": tm["version"], **batch,
            "loss": tm["loss"], "kl_mean": tm.get("kl_mean", 0.0), "kl_max": tm.get("kl_max", 0.0),
            "clip_frac": tm["clip_frac"], "clip_frac_low": tm.get("clip_frac_low", 0.0),
            "clip_frac_high": tm.get("clip_frac_high", 0.0), "ratio_mean": tm.get("ratio_mean", 1.0),
            **{k: tm.get(k, 0.0) for k in ("mismatch_kl", "mismatch_max", "is_corrected_frac")},
            **{k: tm.get(k, 1.0) for k in ("is_ratio_mean", "is_ratio_max")},
            "grad_norm": tm["grad_norm"], "gen_tok_s": mean("gen_tok_s"), "gen_s": mean("gen_s"),
            "reward_s": mean("reward_s"), "ref_s": mean("ref_s"), "train_s": tm["train_s"],
            "train_tok_s": tm.get("tokens_per_s", 0.0), "mfu": tm.get("mfu", 0.0), "peak_mem_gb": tm.get("peak_mem_gb", 0.0),
            "wait_for_rollout_s": timings["wait_for_rollout_s"],
            **{k: sync.get(k, 0.0) for k in ("weight_sync_s", "weight_transfer_s", "weight_sync_exposed_s",
                                             "weight_sync_gb_s", "weight_sync_bytes")},
            "generator_version": state["generator_version"], "gen_replicas": mean("gen_replicas"),
            "skipped_batches": state["skipped_batches"], "checkpoint_failures": state["checkpoint_failures"],
            **{f"restarts_{k}": v for k, v in state["restarts"].items()},
            **{k: (checkpoint or {}).get(k, 0.0) for k in ("checkpoint_exposed_s", "checkpoint_s", "checkpoint_bytes")},
            **{k: sum(r.get(k, 0) for r in rollouts) for k in ("zero_variance_groups", "dropped_groups")},
            **{k: timings[k] for k in ("step_s", "elapsed_s", "startup_s")}}


def sft_row(step: int, trainer: dict, episodes: list[Episode], *, state: dict, timings: dict) -> dict:
    """One SFT step's ``metrics.jsonl`` row: ``step``, ``policy_version``, ``batch_hash``, ``loss``
    (the target tokens' mean cross-entropy, nats), ``grad_norm``, ``target_tokens`` (the tokens the
    loss sees: a conversation's assistant turns) and ``seq_tokens`` (tokens through forward and
    backward), ``target_len_mean``, ``truncated_frac`` (targets cut at
    ``generator.max_response_tokens``), ``train_s``, ``train_tok_s``, ``skipped_batches``,
    ``checkpoint_failures`` and ``timings``' ``step_s``, ``elapsed_s``, ``startup_s`` (seconds). Raises
    KeyError for a missing trainer key (``version``, ``loss``, ``grad_norm``, ``train_s``)."""
    return {"step": step, "policy_version": trainer["version"], "batch_hash": batch_hash(episodes),
            "loss": trainer["loss"], "grad_norm": trainer["grad_norm"],
            "target_tokens": sum(e.model_tokens() for e in episodes), "seq_tokens": trainer.get("seq_tokens", 0.0),
            "target_len_mean": statistics.fmean(e.model_tokens() for e in episodes),
            "truncated_frac": statistics.fmean(e.truncated for e in episodes), "train_s": trainer["train_s"],
            "train_tok_s": trainer.get("tokens_per_s", 0.0), "skipped_batches": state["skipped_batches"],
            "checkpoint_failures": state["checkpoint_failures"],
            **{k: timings[k] for k in ("step_s", "elapsed_s", "startup_s")}}


def batch_hash(episodes: list[Episode]) -> int:
    """A 52-bit fingerprint (a JSON-exact integer) of a training batch: prompt and response token
    ids, prompt ids and policy versions, in order. Equal hashes at a step = the same batch."""
    key = json.dumps([[e.prompt_id, e.prompt_ids, e.response_ids, e.policy_version] for e in episodes])
    return int(hashlib.sha256(key.encode()).hexdigest()[:13], 16)


def batch_stats(episodes: list[Episode], step: Optional[int] = None, prefix: str = "") -> dict:
    """Means over scored ``episodes``: reward (and its std), each reward component (``reward/<name>``),
    accuracy, format rate, response length, truncation, the policy's entropy (below) and, with
    ``step``, the off-policy staleness. ``entropy``: the mean over response tokens of ``-log pi(y_t)``
    under the sampling policy (the behaviour logprobs): a Monte-Carlo estimate of the per-token entropy
    of the tempered distribution sampled from (``E_{y~pi}[-log pi(y)] = H(pi)``), cheap and exact in
    expectation; it falls as the policy collapses onto few continuations (tokens the policy sampled
    only). Multi-turn episodes (an environment's, with a ``loss_mask``) add ``turns_mean``,
    ``tool_calls_mean`` (per episode), ``tool_error_rate`` (failed calls over calls, 0 without calls),
    ``tool_s`` (seconds in tools, summed over the batch) and ``masked_frac`` (response tokens the loss
    does not see: tool and template tokens). Keys get ``prefix``."""
    rewards, lens = [e.reward for e in episodes], [len(e.response_ids) for e in episodes]
    masks = [getattr(e, "loss_mask", None) or [1] * len(e.response_ids) for e in episodes]
    lps = [lp for e, mask in zip(episodes, masks) for lp, m in zip(e.behaviour_logprobs, mask) if m]
    comps = sorted({k for e in episodes for k in e.components})
    out = {"reward_mean": statistics.fmean(rewards), "reward_std": statistics.pstdev(rewards),
           **{f"reward/{k}": statistics.fmean(e.components.get(k, 0.0) for e in episodes) for k in comps},
           "accuracy": statistics.fmean(e.correct for e in episodes),
           "format_rate": statistics.fmean(e.formatted for e in episodes),
           "response_len_mean": statistics.fmean(lens), "response_len_max": max(lens),
           "truncated_frac": statistics.fmean(e.truncated for e in episodes),
           "entropy": -statistics.fmean(lps) if lps else 0.0}
    if any(getattr(e, "loss_mask", None) is not None for e in episodes):
        calls = sum(e.tool_calls for e in episodes)
        out.update(turns_mean=statistics.fmean(e.turns for e in episodes),
                   tool_calls_mean=calls / len(episodes),
                   tool_error_rate=sum(e.tool_errors for e in episodes) / calls if calls else 0.0,
                   tool_s=sum(e.tool_s for e in episodes),
                   masked_frac=1.0 - sum(e.model_tokens() for e in episodes) / max(sum(lens), 1))
    if step is not None:
        stale = [step - e.policy_version for e in episodes]
        out.update(staleness_mean=statistics.fmean(stale), staleness_max=max(stale))
    return {prefix + k: v for k, v in out.items()}


class MetricsLog:
    """Appends one JSON object per training step to ``path`` (flushed and fsynced per line, so a
    killed run keeps every finished step) and mirrors it to wandb when enabled. An existing file is
    kept and appended to (resume), after dropping lines for steps ``>= start_step`` so a resumed run
    has no duplicates. ``wandb_cfg``: ``{"project", "mode"}``, mode ``disabled`` (default) skips
    wandb entirely; ``run_name``: the wandb run name / id (resumes the same wandb run); ``config``:
    the resolved config, stored with the wandb run. wandb's own files go in ``wandb/`` beside ``path``
    (the run directory), not in the working directory. wandb's charts use the row's ``step`` as their
    x-axis; a step computed again (in-run recovery, resume) is logged again beside the first one."""

    def __init__(self, path: str, start_step: int = 0, wandb_cfg: Optional[Any] = None,
                 run_name: str = "", *, config: Optional[dict] = None):
        self.path = path
        run_dir = os.path.dirname(os.path.abspath(path))
        os.makedirs(run_dir, exist_ok=True)
        if os.path.exists(path):
            keep = [l for l in read_jsonl(path) if l.get("step", -1) < start_step]
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(l) + "\n" for l in keep)
            os.replace(tmp, path)
        self.f = open(path, "a")
        self.wandb = None
        if wandb_cfg is not None and wandb_cfg.mode != "disabled":
            import wandb
            self.wandb = wandb.init(project=wandb_cfg.project, mode=wandb_cfg.mode, name=run_name, id=run_name or None,
                                    resume="allow", config=config, dir=run_dir)
            # Charts are plotted against the training step, a metric of each row, and wandb's own step
            # counts the rows: the steps a run computes again (after an in-run recovery, or a resume
            # from a checkpoint older than its last logged step) are kept, where wandb.log(step=)
            # would drop every row whose step is not above the last one.
            self.wandb.define_metric("step")
            self.wandb.define_metric("*", step_metric="step")

    def log(self, row: dict) -> None:
        """Write one step's metrics (a flat dict of numbers, and the held-out evaluation's
        ``eval/responses_digest`` string; must contain ``step``)."""
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())
        if self.wandb is not None:
            self.wandb.log(row)

    def close(self) -> None:
        """Close the file and finish the wandb run."""
        self.f.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_jsonl(path: str) -> list[dict]:
    """The JSON objects of ``path``, one a line (blank lines skipped). A last line that does not parse
    was torn by a crash mid-write and is dropped. Raises ValueError naming the file and the line
    (1-based) for one that does not parse anywhere else: the file is damaged, not torn."""
    with open(path) as f:
        lines = f.read().split("\n")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if any(l.strip() for l in lines[n:]):
                raise ValueError(f"{path}, line {n}: not a JSON line ({e}); only a torn last line is "
                                 f"dropped, this one has lines after it: the file is damaged") from e
    return out


def plot_rewards(metrics_path: str, png_path: str, title: str = "") -> str:
    """Plot the training batches' reward mean (with its std band), accuracy and format rate per step
    (an SFT run: its loss), and the held-out pass@1 (``eval/pass@1`` rows, at the version evaluated)
    when the run evaluated, from the JSONL file into a PNG. Returns ``png_path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_rows = read_jsonl(metrics_path)
    rows = [r for r in all_rows if "reward_mean" in r]  # step rows (eval rows carry eval/... keys)
    evals = [r for r in all_rows if "eval/pass@1" in r]
    steps, mean, std = [r["step"] for r in rows], [r["reward_mean"] for r in rows], [r["reward_std"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    if not rows:  # an SFT run: its loss per step (and the held-out curve beside it)
        sft = [r for r in all_rows if "target_tokens" in r]
        ax.plot([r["step"] for r in sft], [r["loss"] for r in sft], label="loss (target cross-entropy)", color="C0")
        ax.set(ylabel="nats per target token")
        if evals:
            ax2 = ax.twinx()
            ax2.plot([r["step"] for r in evals], [r["eval/pass@1"] for r in evals], label="held-out pass@1",
                     color="C3", marker="o")
            ax2.set(ylabel="held-out pass@1")
            ax2.legend(loc="upper right")
        ax.set(xlabel="training step", title=title)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(png_path, dpi=110)
        plt.close(fig)
        return png_path
    ax.plot(steps, mean, label="reward mean", color="C0")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                    color="C0", alpha=0.15)
    ax.plot(steps, [r["accuracy"] for r in rows], label="accuracy (training batches)", color="C1")
    if any(r.get("format_rate", 0.0) for r in rows):  # a reward with a format part (gsm8k, math)
        ax.plot(steps, [r["format_rate"] for r in rows], label="format rate", color="C2", linestyle="--")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/pass@1"] for r in evals], label="held-out pass@1", color="C3",
                marker="o")
    ax.set(xlabel="training step", ylabel="per rollout batch", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
