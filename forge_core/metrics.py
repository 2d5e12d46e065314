"""Per-step metrics: a JSONL file (one line per step), optional wandb, and the end-of-run plot."""

from __future__ import annotations

import json
import os
from typing import Any, Optional


class MetricsLog:
    """Appends one JSON object per training step to ``path`` (flushed and fsynced per line, so a
    killed run keeps every finished step) and mirrors it to wandb when enabled. An existing file is
    kept and appended to (resume), after dropping lines for steps ``>= start_step`` so a resumed run
    has no duplicates. ``wandb_cfg``: ``{"project", "mode"}``, mode ``disabled`` (default) skips
    wandb entirely; ``run_name``: the wandb run name / id (resumes the same wandb run); ``config``:
    the resolved config, stored with the wandb run."""

    def __init__(self, path: str, start_step: int = 0, wandb_cfg: Optional[Any] = None,
                 run_name: str = "", config: Optional[dict] = None):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
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
                                    resume="allow", config=config)

    def log(self, row: dict) -> None:
        """Write one step's metrics (a flat dict of numbers; must contain ``step``)."""
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())
        if self.wandb is not None:
            self.wandb.log(row, step=row["step"])

    def close(self) -> None:
        """Close the file and finish the wandb run."""
        self.f.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_jsonl(path: str) -> list[dict]:
    """All complete JSON lines of ``path`` (a torn last line from a crash is ignored)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def plot_rewards(metrics_path: str, png_path: str, title: str = "") -> str:
    """Plot the training batches' reward mean (with its std band), accuracy and format rate per step,
    and the held-out pass@1 (``eval/pass@1`` rows, at the version evaluated) when the run evaluated,
    from the JSONL file into a PNG. Returns ``png_path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_rows = read_jsonl(metrics_path)
    rows = [r for r in all_rows if "reward_mean" in r]  # step rows (eval rows carry eval/... keys)
    evals = [r for r in all_rows if "eval/pass@1" in r]
    steps, mean, std = [r["step"] for r in rows], [r["reward_mean"] for r in rows], [r["reward_std"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, mean, label="reward mean", color="C0")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                    color="C0", alpha=0.15)
    ax.plot(steps, [r["accuracy"] for r in rows], label="accuracy (training batches)", color="C1")
    ax.plot(steps, [r.get("format_rate", 0.0) for r in rows], label="format rate", color="C2", linestyle="--")
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
