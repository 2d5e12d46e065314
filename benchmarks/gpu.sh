#!/usr/bin/env bash
# The GPU session's work, run on the device machine from the repository root, after the staged
# wheels were concatenated into /tmp/stage/bundle.tar (../shared/gpu/stage-wheels prints those calls).
# Usage: benchmarks/gpu.sh STAGE...   (each stage's logs and JSON go to $OUT, default /tmp/out)
#   install  the bundle into /tmp/site (.gpu/install.sh), GSM8K and SmolLM2's tokenizer files from .carry/
#   check    python -m benchmarks.gpu_check on this machine's GPUs ($CHECK_ARGS)
#   bench    python -m benchmarks.bench_gpu --model $BENCH_MODEL --gpus <all> $BENCH_ARGS
#   run      a real GRPO run: python -m launch.local run $RUN_RECIPE $RUN_ARGS (run id $RUN_NAME), then its
#            summary (benchmarks/summarize_run.py); KILL_AT=n kills the generator's process KILL_DELAY (3) s
#            after step n
#   hosts    tests/gpu/two_hosts.sh $HOSTS (two emulated hosts, one GPU each)
#   profile  python -m benchmarks.profile_train $PROFILE_ARGS (trainer step and reference forward under
#            torch.profiler); PROFILE_SRC=dir runs that tree's forge_core instead (an A/B against a copy)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 \
  PYTHONUNBUFFERED=1 FORGE_CACHE=/tmp/forge-cache GSM8K_DIR=/tmp/gsm8k WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NG=$(python3 -c 'import torch; print(torch.cuda.device_count())')
quiet() { grep -v "^INFO\|^(EngineCore\|^WARNING\|^\[rank\|^\[W\|^I1\|^W1" ; }
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    install)
      test -d /tmp/site/vllm || bash .gpu/install.sh || exit 3
      test -d /tmp/gsm8k || tar -xzf .carry/gsm8k.tgz -C /tmp
      mkdir -p /tmp/forge-cache && cp -r .carry/tok/smollm2_135m-hf /tmp/forge-cache/
      python3 -c "import vllm, torchtitan, monarch, hydra; print('vllm', vllm.__version__, 'torch', __import__('torch').__version__)" ;;
    check)
      timeout ${CHECK_TIMEOUT:-500} python3 -m benchmarks.gpu_check --gpus "$NG" ${CHECK_ARGS:-} --out "$OUT/gpu_check.json" \
        2>&1 | tee "$OUT/gpu_check.log" | grep "PASS\|FAIL\|passed\|Error\|error" ;;
    bench)
      M=${BENCH_MODEL:-qwen3_1_7b}
      timeout ${BENCH_TIMEOUT:-560} python3 -m benchmarks.bench_gpu --model "$M" --gpus "$NG" ${BENCH_ARGS:-} \
        --out "$OUT/bench_${M}.json" 2>&1 | tee "$OUT/bench_${M}.log" | grep "^|\|Error\|error" ;;
    run)
      name=${RUN_NAME:-run}
      timeout ${RUN_TIMEOUT:-560} python3 -m launch.local run ${RUN_RECIPE:-qwen3_1_7b} output_dir=/tmp/runs \
        run_id="$name" ${RUN_ARGS:-} > "$OUT/$name.log" 2>&1 &
      P=$!
      if [ -n "${KILL_AT:-}" ]; then
        until grep -q "\"step\": $KILL_AT," "/tmp/runs/$name/metrics.jsonl" 2>/dev/null || ! kill -0 $P 2>/dev/null; do sleep 1; done
        sleep ${KILL_DELAY:-3}  # past the weight transfer that starts with each step, into generation
        G=$(python3 -c "import json; print(json.load(open('/tmp/runs/$name/actors.json'))['generator']['pid'])")
        echo "kill -9 generator pid $G after step $KILL_AT at $(date +%T)"; kill -9 "$G"
      fi
      wait $P; echo "run $name exit $?"
      grep "\[forge\]\|error" "$OUT/$name.log" | head -12
      cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
      cp "/tmp/runs/$name/faults.jsonl" "$OUT/$name.faults.jsonl" 2>/dev/null && cat "$OUT/$name.faults.jsonl" | cut -c1-300
      python3 -m benchmarks.summarize_run "$OUT/$name.metrics.jsonl" --skip ${SKIP:-2} --name "$name" --markdown ;;
    hosts)
      OUT=$OUT bash tests/gpu/two_hosts.sh ${HOSTS:-loop sync} ;;
    profile)
      name=${PROFILE_NAME:-profile}
      PYTHONPATH=${PROFILE_SRC:+$PROFILE_SRC:}$PYTHONPATH timeout ${PROFILE_TIMEOUT:-400} python3 -m benchmarks.profile_train \
        ${PROFILE_ARGS:-} > "$OUT/$name.log" 2>&1; echo "profile $name exit $?"
      grep "^train step\|^reference\|^{" "$OUT/$name.log" | cut -c1-1500 ;;
  esac
done
