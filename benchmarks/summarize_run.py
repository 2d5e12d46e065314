"""Summarize a run's metrics.jsonl: seconds per step (mean over the steps after the first ``--skip``),
its parts, the weight sync, and the overlap efficiency (gen + ref + train) / step.

    python -m benchmarks.summarize_run runs/<recipe>/<run>/metrics.jsonl [--skip 1] [--name label]

Prints one JSON line (and a markdown row with ``--markdown``).
"""

from __future__ import annotations

import argparse
import json
import statistics

KEYS = ("step_s", "gen_s", "ref_s", "train_s", "wait_for_rollout_s", "weight_transfer_s", "weight_sync_exposed_s",
        "weight_sync_s", "gen_tok_s", "train_tok_s", "mfu", "reward_mean", "format_rate")


def summarize(path: str, skip: int = 1, until: int = 0) -> dict:
    """Means of :data:`KEYS` over steps ``skip+1 .. until`` (``until`` 0: the last; the first steps
    pay start-up and compile), ``overlap`` = (gen + ref + train) / step, the trainer's largest
    ``peak_mem_gb`` (GB; 0 before it was logged, or on a CPU), the step count, the restarts of every
    service, and over all the run's checkpoints the mean ``checkpoint_exposed_s`` and ``checkpoint_s``
    (seconds) and the largest ``checkpoint_bytes``."""
    from forge_core.metrics import read_jsonl

    rows = [r for r in read_jsonl(path) if "step_s" in r]  # step rows (held-out evaluation rows apart)
    use = [r for r in rows[skip:] if not until or r["step"] <= until]
    if not use:
        raise SystemExit(f"{path}: no step after the first {skip} (and up to step {until or 'the last'}) to average")
    out = {k: statistics.fmean(r.get(k, 0.0) for r in use) for k in KEYS}
    out["overlap"] = (out["gen_s"] + out["ref_s"] + out["train_s"]) / max(out["step_s"], 1e-9)
    out.update(peak_mem_gb=max(r.get("peak_mem_gb", 0.0) for r in rows), steps=len(rows), measured_steps=len(use),
               startup_s=rows[0].get("startup_s", 0.0),  # rows is not empty: use is a part of it
               restarts=sum(v for k, v in rows[-1].items() if k.startswith("restarts_")))
    saves, commits = [r for r in rows if r.get("checkpoint_exposed_s")], [r for r in rows if r.get("checkpoint_s")]
    out.update(checkpoints=len(saves),
               checkpoint_exposed_s=statistics.fmean(r["checkpoint_exposed_s"] for r in saves) if saves else 0.0,
               checkpoint_s=statistics.fmean(r["checkpoint_s"] for r in commits) if commits else 0.0,
               checkpoint_bytes=max((r.get("checkpoint_bytes", 0) for r in rows), default=0))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path")
    p.add_argument("--skip", type=int, default=1)
    p.add_argument("--until", type=int, default=0, help="average steps up to this one (0: all)")
    p.add_argument("--name", default="")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args()
    s = summarize(a.path, a.skip, a.until)
    print(json.dumps(dict(s, name=a.name or a.path)))
    if a.markdown:
        print(f"| {a.name} | {s['step_s']:.1f} s | gen {s['gen_s']:.1f} | ref {s['ref_s']:.1f} | train {s['train_s']:.1f} | "
              f"wait {s['wait_for_rollout_s']:.1f} | transfer {s['weight_transfer_s']:.2f} | exposed "
              f"{s['weight_sync_exposed_s']:.3f} | overlap {s['overlap']:.2f} | peak {s['peak_mem_gb']:.0f} GB |"
              + (f" checkpoint exposed {s['checkpoint_exposed_s']:.2f} s of {s['checkpoint_s']:.1f} s, "
                 f"{s['checkpoint_bytes'] / 1e9:.2f} GB |" if s["checkpoints"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
