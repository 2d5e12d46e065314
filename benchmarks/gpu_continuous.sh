#!/usr/bin/env bash
# Synchronous (rollout.mode=batch) against continuous rollouts, one after the other in one call on the same
# machine, with random-weight Qwen3-1.7B; each run's step parts (generation, reference, training, the trainer's
# wait for rollouts, weight transfer, exposed sync) are printed by benchmarks/summarize_run.py (--skip 2).
#
#   bash benchmarks/gpu_continuous.sh coloc   one GPU: trainer, reference and an awake engine colocated under
#                                             CUDA MPS (recipes/qwen3_1_7b/README.md's overlap), STEPS (8) steps each
#   bash benchmarks/gpu_continuous.sh hosts   two emulated hosts (tests/gpu/two_hosts.sh loopcont; needs 2 GPUs)
#
# ARGS adds overrides to both runs, CONT_ARGS to the continuous one only (say max_staleness=2: three rollout
# batches may be in flight instead of two). Outputs go to $OUT (default /tmp/out), runs to /tmp/runs; the
# environment is benchmarks/gpu.sh's (pip install -e '.[gpu]').
set -uo pipefail
OUT=$(mkdir -p "${OUT:-/tmp/out}" && cd "${OUT:-/tmp/out}" && pwd) || exit 3
cd "$(dirname "$0")/.."
COLOC="model.init=random layout.gpus_per_node=1 layout.trainer.gpus=1 layout.reference.gpus=0 max_staleness=1
  generator.sleep_level=0 generator.gpu_memory_utilization=0.22 generator.kv_cache_dtype=fp8
  trainer.tokens_per_micro_batch=8192 trainer.mps_client_priority=1 loss.rollout_correction=tis steps=${STEPS:-8}"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    coloc)
      export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/forge-mps-pipe} \
        CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/forge-mps-log}
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d && started=1 || { echo "MPS daemon not started (already running?)"; started=0; }
      for mode in batch continuous; do
        extra=""; [ $mode = continuous ] && extra=${CONT_ARGS:-}
        OUT=$OUT RUN_NAME="coloc_$mode" RUN_ARGS="$COLOC ${ARGS:-} rollout.mode=$mode $extra" \
          bash benchmarks/gpu.sh run | tee -a "$OUT/summary.txt"
      done
      [ $started = 1 ] && echo quit | nvidia-cuda-mps-control ;;
    hosts)
      OUT=$OUT LOOP_ARGS="${ARGS:-}" CONT_ARGS="${CONT_ARGS:-}" bash tests/gpu/two_hosts.sh loopcont ;;
    *)
      echo "unknown stage $stage: coloc hosts"; exit 2 ;;
  esac
done
