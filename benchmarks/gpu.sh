#!/usr/bin/env bash
# The GPU session's work, run on the device machine from the repository root after the staged
# wheels (.gpu/pNN) were concatenated into /tmp/stage/bundle.tar. Usage: benchmarks/gpu.sh STAGE...
#   install   install the bundle into /tmp/site, unpack GSM8K, rebuild + convert the SmolLM2 GGUF
#   check     python -m benchmarks.gpu_check (smollm2_135m, this machine's GPUs)
#   bench     make bench (qwen3_1_7b shape)
#   bench8    an 8B shape on this machine's GPUs (BENCH_MODEL=qwen3_8b|llama3_8b, BENCH_ARGS=...)
#   smollm2   a real smollm2_135m GRPO run on the GPU (reward curve)
#   qwen      the qwen3_1_7b recipe for a few steps through launch.local (random init)
set -uo pipefail
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 \
  PYTHONUNBUFFERED=1 FORGE_CACHE=/tmp/forge-cache GSM8K_DIR=/tmp/gsm8k FORGE_SMOLLM2_GGUF=/tmp/smollm2.gguf \
  WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NG=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    install)
      test -d /tmp/site/vllm || bash /tmp/tok/install.sh || bash .carry/g1/install.sh || exit 3
      test -d /tmp/site2/omegaconf || python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site2 .whl/* || exit 3
      test -d /tmp/gsm8k || tar -xzf /tmp/gsm8k.tgz -C /tmp
      if test ! -f /tmp/gg00 && test -d /tmp/tok; then  # no GGUF carried: the SmolLM2 tokenizer alone (random-init runs)
        mkdir -p /tmp/forge-cache && cp -r /tmp/tok/smollm2_135m-hf /tmp/forge-cache/; unset FORGE_SMOLLM2_GGUF; continue; fi
      test -f /tmp/smollm2.gguf || cat /tmp/gg00 .carry/g1/gg01 .carry/g1/gg02 > /tmp/smollm2.gguf && ls -la /tmp/smollm2.gguf
      python3 -c "import transformers, vllm, torchtitan, monarch; print('transformers', transformers.__version__, 'vllm', vllm.__version__)"
      time python3 -c "from forge_core.models import converted_smollm2; print(converted_smollm2())" ;;
    check) timeout ${CHECK_TIMEOUT:-600} python3 -m benchmarks.gpu_check --gpus "$NG" ${CHECK_ARGS:-} --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log" | grep -v "^INFO\|^WARNING\|^\[" ;;
    bench) python3 -m benchmarks.bench_gpu --gpus "$NG" --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^INFO\|^(EngineCore\|^\[" | tail -40 ;;
    bench8) M=${BENCH_MODEL:-qwen3_8b}; python3 -m benchmarks.bench_gpu --model $M --gpus "$NG" ${BENCH_ARGS:-} --out "$OUT/bench_$M.json" 2>&1 | tee "$OUT/bench_$M.log" | tail -30 ;;
    smollm2)
      python3 -m launch.local run smollm2_135m device=cuda generator.backend=vllm layout.gpus_per_node=1 max_staleness=0 \
        generator.gpu_memory_utilization=0.3 prompts_per_step=16 generator.group_size=8 generator.max_response_tokens=256 \
        steps=${SMOL_STEPS:-60} checkpoint.every=0 output_dir=/tmp/runs run_id=smol 2>&1 | tee "$OUT/smollm2.log" | grep -v "^INFO\|^\[" | tail -15
      cp /tmp/runs/smol/metrics.jsonl "$OUT/smollm2_metrics.jsonl"; cp /tmp/runs/smol/reward.png "$OUT/smollm2_reward.png" ;;
    qwen)
      python3 -m launch.local run qwen3_1_7b model.init=random layout.gpus_per_node=1 max_staleness=0 \
        generator.gpu_memory_utilization=0.35 trainer.activation_checkpointing=true steps=${QWEN_STEPS:-3} \
        checkpoint.every=0 output_dir=/tmp/runs run_id=qwen 2>&1 | tee "$OUT/qwen.log" | grep -v "^INFO\|^\[" | tail -8
      cp /tmp/runs/qwen/metrics.jsonl "$OUT/qwen_metrics.jsonl" ;;
  esac
done
