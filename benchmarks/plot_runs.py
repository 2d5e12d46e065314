"""Several runs' curves side by side: one panel per metric, one line per run.

    python -m benchmarks.plot_runs --out cmp.png --metrics eval/pass@1,reward_mean,mismatch_kl \\
        NAME=runs/<recipe>/<run>/metrics.jsonl ...

Rows without a metric are skipped for that panel (held-out rows carry ``eval/*``, training rows the
rest), so training and held-out curves mix freely. Writes a PNG (matplotlib, Agg backend).

Raises:
    SystemExit: a run argument that is not ``NAME=PATH`` or a file that does not exist.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--metrics", default="eval/pass@1,reward_mean,format_rate")
    p.add_argument("--log", default="", help="metrics drawn on a log scale, comma-separated")
    p.add_argument("runs", nargs="+", help="NAME=metrics.jsonl")
    a = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics, logs = a.metrics.split(","), set(filter(None, a.log.split(",")))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
    for spec in a.runs:
        name, sep, path = spec.partition("=")
        if not sep or not os.path.isfile(path):
            sys.exit(f"run {spec!r}: expected NAME=PATH to an existing metrics.jsonl")
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for ax, m in zip(axes[0], metrics):
            pts = [(r["step"], r[m]) for r in rows if m in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 20 else None, label=name, linewidth=1)
    for ax, m in zip(axes[0], metrics):
        ax.set_title(m)
        ax.set_xlabel("step")
        if m in logs:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=90)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
