#!/usr/bin/env bash
# Where an update's time goes, on GPUs (issue 3 profiling), one command:
#   bash bench/run_breakdown.sh [BIN_DIR=.dev/bin] [LOG_DIR=/tmp/ws-breakdown]
# 1. bench/ipc_probe on GPU 0: copies through IPC-opened memory vs local;
# 2. IPC updates (Qwen3-8B, 1 GiB chunks) on GPU 0 with the daemon's phase
#    timings (FinishWeightUpdateResponse.timings) per update;
# 3. NCCL updates GPU 0 -> GPU 1 (Qwen3-1.7B 256 MiB x 4, Qwen3-8B
#    1 GiB x 4) with the same timings. Needs 2 GPUs for part 3.
set -uo pipefail
BIN="$(cd "${1:-.dev/bin}" && pwd)"
LOG="${2:-/tmp/ws-breakdown}"
mkdir -p "$LOG" && chmod 750 "$LOG"  # the socket lives here: weightsyncd refuses an open dir
export NCCL_NVLS_ENABLE=0
pkill -KILL -f "$BIN/weightsync_" 2>/dev/null
sock="$LOG/d.sock"
echo "=== ipc_probe (one GPU, two processes) ==="
timeout 240 "$BIN/ipc_probe" --device=0 --model=qwen3-8b 2>&1 | tee "$LOG/ipc_probe.txt"

run() {  # tag gpu_daemon gpu_engine gpu_trainer backend model chunk_mib [daemon flags]
  local tag=$1 gd=$2 ge=$3 gt=$4 backend=$5 model=$6 chunk=$7; shift 7
  rm -f "$sock"
  timeout 300 "$BIN/weightsyncd" --socket="$sock" --gpu=$gd --gpu_worker="$BIN/weightsync_gpu_worker" \
    --gpu_staging_budget_bytes=$((8<<30)) --max_chunk_bytes=$((1<<30)) "$@" >"$LOG/daemon-$tag.log" 2>&1 &
  local d=$!
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
  timeout 300 "$BIN/weightsync_gpu_engine" --target="unix:$sock" --engine_id=e --model=$model \
    --layout=plain --dtype=bfloat16 --device=$ge --verify=false >"$LOG/engine-$tag.log" 2>&1 &
  local e=$!
  for _ in $(seq 600); do grep -q registered "$LOG/engine-$tag.log" && break; sleep 0.1; done
  timeout 300 "$BIN/weightsync_gpu_trainer" --target="unix:$sock" --backend=$backend --model=$model \
    --dtype=bfloat16 --updates=6 --same_data --chunk_mib=$chunk --device=$gt >"$LOG/trainer-$tag.log" 2>&1
  kill -TERM $e $d 2>/dev/null; sleep 0.5; kill -KILL $e $d 2>/dev/null; wait $e $d 2>/dev/null
  echo "=== $tag ==="
  grep '^update' "$LOG/trainer-$tag.log"
}
run ipc-8b 0 0 0 ipc qwen3-8b 1024
run ipc-8b-sm 0 0 0 ipc qwen3-8b 1024 --ipc_sm_copies
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  run nccl-1.7b 1 1 0 nccl qwen3-1.7b 256 --gpu_staging_buffers=4
  run nccl-8b 1 1 0 nccl qwen3-8b 1024 --gpu_staging_buffers=4
fi
