#!/usr/bin/env bash
# The 8B recipes' layouts on a 4-GPU machine (random weights, GSM8K prompts), each stage in one call:
#   bash benchmarks/gpu_8b.sh scale    generator tok/s of Qwen3-8B's shape over 1..4 TP=1 replicas (the same prompts,
#                                      and fixed work per replica), and 2 engines of TP=2 against 4 of TP=1
#   bash benchmarks/gpu_8b.sh layout4  recipes/qwen3_8b scaled to 4 GPUs: 1 vLLM replica (GPU 0), the trainer FSDP
#                                      over GPUs 1-3 with the reference sharded on them; STEPS (6) steps, its summary
#   bash benchmarks/gpu_8b.sh hosts    recipes/llama3_8b's two nodes as two emulated hosts of 2 GPUs each
#                                      (tests/gpu/two_hosts.sh loop8b, GPUS_PER_HOST=2), NCCL over sockets between them
# A run with no step logged after DUMP_AT (400) s gets its Python stacks dumped (py-spy, where on PATH or in
# /tmp/site/bin) into $OUT before it is stopped. Needs what benchmarks/gpu.sh needs; run from the repository root.
set -uo pipefail
OUT=$(mkdir -p "${OUT:-/tmp/out}" && cd "${OUT:-/tmp/out}" && pwd) || exit 3
cd "$(dirname "$0")/.."
R=/tmp/runs
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
  VLLM_ENABLE_V1_MULTIPROCESSING=0 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)

gpumem() {  # every 10 s: per-GPU memory used (MiB), into $1
  while true; do echo "$(date +%T) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | tr '\n' ' ')"; sleep 10; done > "$1"
}

watch_run() {  # name pid limit_s: wait for the run; dump stacks if no step by DUMP_AT; stop it at limit_s
  local name=$1 pid=$2 limit=$3 t0=$SECONDS dumped=0
  while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "$limit" ]; do
    sleep 5
    if [ $dumped = 0 ] && [ $((SECONDS - t0)) -ge "${DUMP_AT:-400}" ] && ! grep -q '"step"' "$R/$name/metrics.jsonl" 2>/dev/null; then
      dumped=1
      for p in $(pgrep -f python); do echo "=== pid $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-200)"; timeout 20 "$SPY" dump --pid "$p" 2>&1; done > "$OUT/$name.stacks.txt"
      echo "$name: no step after ${DUMP_AT:-400} s: stacks in $name.stacks.txt"
    fi
  done
  kill "$pid" 2>/dev/null; sleep 5; pkill -9 -f "launch.local run" 2>/dev/null; wait "$pid" 2>/dev/null
  echo "$name: ended after $((SECONDS - t0)) s"
}

for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    scale)
      timeout 560 python3 -m benchmarks.bench_gpu --model qwen3_8b --gpus 4 --sections scale --layouts 2x2 --repeats 1 \
        --out "$OUT/scale_8b.json" 2>&1 | tee "$OUT/scale_8b.log" | grep "^|\|Error" ;;
    layout4)
      name=qwen3_8b_4gpu
      rm -rf "${R:?}/$name"; mkdir -p $R
      gpumem "$OUT/$name.gpumem.txt" & m=$!
      python3 -m launch.local run qwen3_8b model.init=random steps=${STEPS:-6} layout.gpus_per_node=4 \
        layout.generator.replicas=1 layout.trainer.gpus=3 checkpoint.every=0 output_dir=$R run_id=$name \
        ${LAYOUT_ARGS:-} > "$OUT/$name.log" 2>&1 &
      watch_run $name $! "${LIMIT_S:-560}"
      kill $m
      grep -E "weight sync:|compile|Error|error" "$OUT/$name.log" | grep -v "^INFO" | head -20
      cp "$R/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null &&
        python3 -m benchmarks.summarize_run "$OUT/$name.metrics.jsonl" --skip 2 --name $name --markdown
      awk '{for (i = 2; i <= NF; i++) if ($i > m[i]) m[i] = $i} END {printf "peak MiB per GPU:"; for (i = 2; i <= NF; i++) printf " %s", m[i]; print ""}' "$OUT/$name.gpumem.txt" ;;
    hosts)
      GPUS_PER_HOST=2 bash tests/gpu/two_hosts.sh loop8b ;;
    *) echo "usage: $0 scale|layout4|hosts ..."; exit 2 ;;
  esac
done
