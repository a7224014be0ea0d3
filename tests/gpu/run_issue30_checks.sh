#!/usr/bin/env bash
# Issue 30's GPU figures on ONE GPU, one command:
#   bash tests/gpu/run_issue30_checks.sh [BIN_DIR=.dev/bin] [LOG_DIR=/tmp/ws-i30]
# BIN_DIR holds weightsyncd and weightsync_gpu_worker (packed with
# ../shared/tools/device-pack). Runs bench/python_ipc_bench.py (Qwen3-8B bf16
# shapes, trainer and engine processes, the IPC data plane): its
# first_update_s is the first Trainer.update() with receipts on right after
# init_ipc(), which compiles the receipt kernels (weightsync._warm); the
# target is at most 2x the steady update_s_default. Writes
# LOG_DIR/python_ipc_issue30.json; copy it to bench/results/ to record it.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/gpu_env.sh"
gpu_env "$repo" "${1:-.dev/bin}" "${2:-/tmp/ws-i30}" || exit 1
nvidia-smi -L
# A fresh Triton cache: the run shows what a first process on a machine pays.
export TRITON_CACHE_DIR="$LOG/triton-cache"
BENCH_REPEATS="${BENCH_REPEATS:-5}" timeout -k 10 420 "$PY" bench/python_ipc_bench.py \
  "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER" "$LOG/python_ipc_issue30.json" \
  >"$LOG/python_ipc_bench.log" 2>&1
rc=$?
tail -20 "$LOG/python_ipc_bench.log"
echo "python_ipc_bench exit $rc"
exit $rc
