#!/usr/bin/env bash
# Several daemons on GPUs (issue 20), one command, on a machine with N + 1
# GPUs (N >= 2: one daemon per GPU 0..N-1, the trainer on GPU N), torch
# (CUDA), grpcio and protobuf installed:
#   bash tests/gpu/run_multi_daemon.sh [BIN_DIR=.dev/bin] [LOG_DIR=/tmp/ws-multi]
# BIN_DIR holds weightsyncd and weightsync_gpu_worker (built as for
# run_gpu_checks.sh, bench/RESULTS.md "Rerunning the GPU figures").
# Runs tests/gpu/test_multi_daemon_gpu.py: a model split by pipeline stage
# over the daemons (TP=2 per daemon, engines registered in place), three
# versions by NCCL with receipts, every engine bit-exact, an unused tensor
# refused, a daemon killed between prepare and commit and the repair.
# NOT RUN YET: no machine with three or more GPUs has been available
# (docs/integration.md, 2.7). Prints PASS/FAIL last; logs under LOG_DIR.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
BIN="$(cd "${1:-.dev/bin}" && pwd)"
LOG="${2:-/tmp/ws-multi}"
mkdir -p "$LOG"
LOG="$(cd "$LOG" && pwd)"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export PYTHONPATH="$repo/client/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
cd "$repo"
{
  echo "date: $(date -Is)  commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  "$PY" -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())'
  nvidia-smi -L
} >"$LOG/env.txt" 2>&1
cat "$LOG/env.txt"
timeout -k 10 "${T_TEST:-900}" "$PY" tests/gpu/test_multi_daemon_gpu.py \
  "$BIN/weightsyncd" "$BIN/weightsync_gpu_worker" 2>&1 | tee "$LOG/test_multi_daemon_gpu.log"
rc=${PIPESTATUS[0]}
echo "=== several daemons on GPUs: $( [ "$rc" = 0 ] && echo PASS || echo "FAIL (exit $rc)") ($LOG)"
exit "$rc"
