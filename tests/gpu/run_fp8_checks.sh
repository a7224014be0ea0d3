#!/usr/bin/env bash
# One-GPU proof of FP8 targets on the GPU backends (issue 17), on
# nvidia-h200 or nvidia-h100-x1, one command (binaries built elsewhere and
# packed into .dev with ../shared/tools/device-pack):
#   COMMIT=<sha> bash tests/gpu/run_fp8_checks.sh [BIN_DIR=.dev/bin] [LOG_DIR=/tmp/ws-fp8]
# BIN_DIR holds weightsyncd and weightsync_gpu_worker. Runs
# tests/gpu/test_fp8_gpu.py twice: `exact` (FP8 bytes and scales bit for bit
# against weightsync.fp8 through ipc source / packed / staged / ring, and
# nccl from GPU 1 where a second GPU is visible) and `model` (a small
# transformers model served in e4m3 + 128x128 block scales; greedy
# generation equal to the reference-quantised trainer model). Every process
# runs under `timeout`; prints a PASS/FAIL table last; full logs under
# LOG_DIR.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/gpu_env.sh"
gpu_env "$repo" "${1:-.dev/bin}" "${2:-/tmp/ws-fp8}" || exit 2
export WS_LOG_DIR="$LOG"
results=()
record() { results+=("$(printf '%-48s %s' "$1" "$2")"); }
run() {  # name seconds command...
  local name="$1" secs="$2"; shift 2
  echo "=== $name" >&2
  timeout -k 10 "$secs" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  grep -E '^(PASS|FAIL|SKIP) ' "$LOG/$name.log" | sed "s/^/  [$name] /"
  tail -n "${TAIL:-14}" "$LOG/$name.log" | grep -vE '^(PASS|FAIL|SKIP) ' | sed "s/^/  [$name] /"
  if [ $rc = 0 ]; then record "$name" PASS
  elif [ $rc = 124 ] || [ $rc = 137 ]; then record "$name (timed out after ${secs}s)" FAIL
  else record "$name (exit $rc)" FAIL; fi
}
{ echo "date: $(date -Is) commit: ${COMMIT:-?}"; nvidia-smi -L
  "$PY" -c 'import torch, transformers, numpy; print("torch", torch.__version__, "transformers", transformers.__version__, "numpy", numpy.__version__, "gpus", torch.cuda.device_count())'; } \
  >"$LOG/env.txt" 2>&1
cat "$LOG/env.txt"
for b in "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER"; do
  [ -x "$b" ] || { echo "missing $b (pack it: ../shared/tools/device-pack .dev bazel-bin/daemon/weightsyncd bazel-bin/backends/cuda/weightsync_gpu_worker)"; exit 2; }
done
# The numpy reference and the receipts' FP8 part first, without a GPU.
run fp8_python_test 60 "$PY" client/python/tests/test_fp8.py
run fp8_exact 300 "$PY" tests/gpu/test_fp8_gpu.py exact "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER"
run fp8_model 220 "$PY" tests/gpu/test_fp8_gpu.py model "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER"
echo
echo "=== FP8 GPU checks ($LOG)"
for r in "${results[@]}"; do echo "$r"; done
for r in "${results[@]}"; do case "$r" in *FAIL) exit 1;; esac; done
exit 0
