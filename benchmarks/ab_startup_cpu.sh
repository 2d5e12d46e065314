#!/usr/bin/env bash
# A/B of a tiny CPU run's start-up and wall time: OLD (a commit, checked out in a temporary worktree)
# against this checkout, in the order ORDER (alternating, so a drift in the machine's speed hits both).
# Prints one line per run: startup_s (the controller's metrics: spawn to the first step) and the
# process's wall time (s). Usage: OLD=<commit> [ORDER="old new new old old new"] benchmarks/ab_startup_cpu.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OLD_TREE=$(mktemp -d)/old
git -C "$ROOT" worktree add -q --detach "$OLD_TREE" "${OLD:?set OLD to a commit}"
trap 'git -C "$ROOT" worktree remove --force "$OLD_TREE"' EXIT
ARGS="steps=1 prompts_per_step=2 generator.group_size=2 generator.max_response_tokens=16"
for side in ${ORDER:-old new new old old new}; do
  src=$ROOT; [ "$side" = old ] && src=$OLD_TREE
  out=$(mktemp -d)
  t0=$(date +%s.%N)
  (cd "$src" && PYTHONPATH=$src "$ROOT/.venv/bin/python" -m launch.local run smollm2_135m $ARGS output_dir="$out" \
    >"$out/log" 2>&1)
  t1=$(date +%s.%N)
  startup=$(python3 -c "import json,glob; print(round(json.loads(open(glob.glob('$out/*/metrics.jsonl')[0])
    .readline())['startup_s'], 1))")
  echo "$side startup_s=$startup wall_s=$(python3 -c "print(round($t1 - $t0, 1))")"
  rm -rf "$out"
done
