#!/usr/bin/env bash
# GPU proof of the Python client (issue 4), on a two-GPU machine with torch
# (CUDA), transformers, grpcio and protobuf installed, one command:
#   bash tests/gpu/run_python_checks.sh [BIN_DIR=.dev/bin] [LOG_DIR=/tmp/ws-py]
# BIN_DIR holds weightsyncd and weightsync_gpu_worker. Runs the two examples
# (examples/rlhf.py, examples/rlhf_async.py), the torch GPU test
# (tests/gpu/test_torch_gpu.py) and the Python benchmark
# (bench/python_bench.py -> LOG_DIR/python_nccl.json; copy it to
# bench/results/ to record it). Every process runs under `timeout`. Prints a
# PASS/FAIL table last; full logs under LOG_DIR.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
BIN="$(cd "${1:-.dev/bin}" && pwd)"
LOG="${2:-/tmp/ws-py}"
mkdir -p "$LOG"
LOG="$(cd "$LOG" && pwd)"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
# The packed binaries' libraries (device-pack's BIN/../lib) and NCCL's: the
# daemon exited 127 without them (2026-11-28).
nccl=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "nccl", "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH="$BIN/../lib:${nccl:+$nccl:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$repo/client/python${PYTHONPATH:+:$PYTHONPATH}"
export WEIGHTSYNCD="$BIN/weightsyncd" WEIGHTSYNC_GPU_WORKER="$BIN/weightsync_gpu_worker"
export WS_LOG_DIR="$LOG"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
cd "$repo"

results=()
record() { results+=("$(printf '%-64s %s' "$1" "$2")"); }

{
  echo "date: $(date -Is)  commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  "$PY" -c 'import torch, grpc, google.protobuf as pb, transformers as t; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "| grpcio", grpc.__version__, "| protobuf", pb.__version__, "| transformers", t.__version__)'
  "$PY" -c 'import weightsync.nccl as n; n.load(); print("nccl", n.version(), n._lib._name)'
  nvidia-smi -L
} >"$LOG/env.txt" 2>&1
cat "$LOG/env.txt"

run() {  # name seconds command...
  local name="$1" secs="$2"; shift 2
  echo "=== $name" >&2
  timeout -k 10 "$secs" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  grep -E '^(PASS|FAIL)' "$LOG/$name.log" | sed "s/^/  [$name] /"
  if [ $rc = 0 ]; then record "$name" PASS
  elif [ $rc = 124 ] || [ $rc = 137 ]; then record "$name (timed out after ${secs}s)" FAIL
  else record "$name (exit $rc)" FAIL; fi
}

# One GPU: the examples and the benchmark need NCCL between two GPUs; the
# torch test sends every version by IPC instead (WS_GPUS=1).
export WS_GPUS="${WS_GPUS:-$(nvidia-smi -L | wc -l)}"
run gpu_logic_test 120 "$PY" client/python/tests/test_gpu_logic.py
if [ "$WS_GPUS" -ge 2 ]; then
  run rlhf "${T_EXAMPLE:-600}" "$PY" examples/rlhf.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER"
  run rlhf_async "${T_EXAMPLE:-600}" "$PY" examples/rlhf_async.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER"
fi
run test_torch_gpu "${T_TEST:-900}" "$PY" tests/gpu/test_torch_gpu.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER"
if [ "$WS_GPUS" -ge 2 ]; then
  run python_bench "${T_BENCH:-1500}" "$PY" bench/python_bench.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER" \
    "$LOG/python_nccl.json"
  [ -f "$LOG/python_nccl.json" ] && tail -n 30 "$LOG/python_bench.log"
fi

echo
echo "=== Python client GPU checks ($LOG)"
for r in "${results[@]}"; do echo "$r"; done
for r in "${results[@]}"; do case "$r" in *FAIL) exit 1;; esac; done
exit 0
