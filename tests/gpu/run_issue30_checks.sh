#!/usr/bin/env bash
# Issue 30's GPU figures and checks, one command:
#   COMMIT=<sha> bash tests/gpu/run_issue30_checks.sh [BIN_DIR=.dev/bin] [LOG_DIR=/tmp/ws-i30]
# BIN_DIR holds weightsyncd, weightsync_gpu_worker, weightsync_gpu_engine,
# weightsync_gpu_trainer and weightsyncctl (packed with
# ../shared/tools/device-pack). Three steps, each under `timeout`:
# 1. bench/python_ipc_bench.py (Qwen3-8B bf16 shapes, trainer and engine
#    processes, the IPC data plane on GPU 0): first_update_s is the first
#    Trainer.update() with receipts on right after init_ipc(), which compiles
#    the receipt kernels (weightsync._warm); first_update_prepared_s the same
#    in a second trainer process after init_ipc(tensors=...), which also
#    registers the tensors and builds their receipt tables. The target: at
#    most 2x the steady update. A fresh Triton cache: what a first process
#    on a machine pays.
# 2. tests/gpu/test_registered_source.py: a small transformers model through
#    init_ipc(tensors=the model) + update(), bit-exact, the source registered
#    once, in init.
# 3. tests/gpu/gpu_faults.py --only engine_freed,engine_freed_ipc: an engine
#    that frees its memory under the daemon (VMM, then legacy cudaIpc) is
#    reported lost at the next pause, not READY (NCCL on two GPUs, IPC on one).
# Writes LOG_DIR/python_ipc_issue30.json (copy it to bench/results/) and
# LOG_DIR/summary.txt; exits 1 if a step fails.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/gpu_env.sh"
gpu_env "$repo" "${1:-.dev/bin}" "${2:-/tmp/ws-i30}" || exit 1
nvidia-smi -L
export TRITON_CACHE_DIR="$LOG/triton-cache"
export COMMIT="${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
rc=0
BENCH_REPEATS="${BENCH_REPEATS:-5}" timeout -k 10 300 "$PY" bench/python_ipc_bench.py \
  "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER" "$LOG/python_ipc_issue30.json" \
  >"$LOG/python_ipc_bench.log" 2>&1
bench=$?
tail -22 "$LOG/python_ipc_bench.log" | tee "$LOG/summary.txt"
timeout -k 10 240 "$PY" tests/gpu/test_registered_source.py "$WEIGHTSYNCD" \
  "$WEIGHTSYNC_GPU_WORKER" >"$LOG/registered_source.log" 2>&1
source_rc=$?
grep -E "PASS|FAIL" "$LOG/registered_source.log" | tail -30 | tee -a "$LOG/summary.txt"
timeout -k 10 200 "$PY" tests/gpu/gpu_faults.py "$BIN" "$LOG/faults" \
  --only engine_freed,engine_freed_ipc --json "$LOG/faults_freed.json" \
  >"$LOG/faults.log" 2>&1
faults=$?
tail -8 "$LOG/faults.log" | tee -a "$LOG/summary.txt"
echo "python_ipc_bench rc $bench, test_registered_source rc $source_rc, gpu_faults engine_freed rc $faults" \
  | tee -a "$LOG/summary.txt"
[ "$bench" = 0 ] && [ "$source_rc" = 0 ] && [ "$faults" = 0 ]
