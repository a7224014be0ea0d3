#!/usr/bin/env bash
# Where a 1% sparse update's time goes (issue 5), one command on a GPU
# machine, without the rest of tests/gpu/run_issue5_checks.sh:
#   [SETTLE_MS=200] bash bench/run_sparse_breakdown.sh [BIN_DIR=.dev/bin] [LOG_DIR=/tmp/ws-sparse] [SPARSE_CHUNK_MIB=1024]
# A daemon (GLOG_v=1: it and its GPU worker log each BeginUpdate's parts)
# and one engine (Qwen3-8B shapes, bf16, VMM memory) on the last GPU; the
# trainer on GPU 0 (NCCL with two GPUs, IPC with one) sends four 1% sparse
# updates, each followed by the same weights dense. Prints the trainer's
# per-step lines (bytes, times, start/transfer/commit breakdown) and the
# daemon's and worker's BeginUpdate lines. Every process runs under
# `timeout`.
set -uo pipefail
BIN="$(cd "${1:-.dev/bin}" && pwd)"
LOG="${2:-/tmp/ws-sparse}"
CHUNK="${3:-1024}"
SETTLE="${SETTLE_MS:-200}"  # idle before each update, sparse and dense alike
mkdir -p "$LOG" && chmod 750 "$LOG"
rm -f "$LOG"/*.log
export NCCL_NVLS_ENABLE=0
NGPU=$(nvidia-smi -L | wc -l)
if [ "$NGPU" -ge 2 ]; then DEV_D=1 BACKEND=nccl; else DEV_D=0 BACKEND=ipc; fi
sock="$LOG/d.sock"
rm -f "$sock"
pids=()
source "$(dirname "$0")/../tests/gpu/stop_all.sh"
trap stop_all EXIT
GLOG_v=1 timeout 300 "$BIN/weightsyncd" --socket="$sock" --gpu=$DEV_D \
  --gpu_worker="$BIN/weightsync_gpu_worker" --notice_timeout_ms=60000 \
  --finish_timeout_ms=60000 --max_chunk_bytes=$((1 << 30)) \
  --gpu_staging_budget_bytes=$((24 << 30)) >"$LOG/daemon.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
timeout 300 "$BIN/weightsync_gpu_engine" --target="unix:$sock" --engine_id=bench \
  --model=qwen3-8b --layout=plain --dtype=bfloat16 --ckpt_dtype=bfloat16 \
  --device=$DEV_D --verify=false --memory=vmm >"$LOG/engine.log" 2>&1 &
pids+=($!)
for _ in $(seq 900); do grep -q registered "$LOG/engine.log" 2>/dev/null && break; sleep 0.1; done
timeout 240 "$BIN/weightsync_gpu_trainer" --target="unix:$sock" --device=0 --backend=$BACKEND \
  --model=qwen3-8b --dtype=bfloat16 --updates=1 --first_version=31 --chunk_mib=1024 \
  --sparse_chunk_mib="$CHUNK" --settle_ms="$SETTLE" --sparse_densities=0.01,0.01,0.01,0.01 \
  --finish_timeout_ms=120000 --update_timeout_s=200 >"$LOG/trainer.log" 2>&1
rc=$?
echo "=== sparse breakdown: $BACKEND, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$NGPU, patches in ${CHUNK} MiB chunks, ${SETTLE} ms idle before each update, $(date -u +%F), commit ${COMMIT:-unknown}, trainer rc $rc ==="
grep "sparse step:" "$LOG/trainer.log" | sed 's/.*sparse_s \([0-9.]*\) dense_s \([0-9.]*\) (\([0-9.]*%\)).*sparse ms: \(.*\); dense ms: \(.*\)/sparse_s \1 dense_s \2 (\3)\n  sparse ms: \4\n  dense ms:  \5/'
echo "--- BeginUpdate, in update order (daemon: request + RPC; worker: its parts)"
grep -h -o "begin: request.*\|begin update (.*\|BeginUpdate answers.*\|update enqueued.*" "$LOG/daemon.log" | tail -32
