#!/usr/bin/env bash
# Where the FP8 update's time goes, on one GPU (issue 17), one command:
#   COMMIT=<sha> bash bench/run_fp8_probe.sh [BIN_DIR=.dev/bin] [OUT_DIR=/tmp/ws-fp8-probe]
# BIN_DIR holds gpu_kernels_bench, weightsyncd and weightsync_gpu_worker
# (packed with ../shared/tools/device-pack). Runs, each under `timeout`:
#   1. gpu_kernels_bench --sections=fp8: the direct kernels and the probe
#      variants (bench/fp8_probe.h) over Qwen3-8B's linear weights against
#      a cudaMemcpy of their bf16 bytes, and the receipt pass over the FP8
#      bytes;
#   2. tests/gpu/check_fp8_triton_gpu.py: the trainer's FP8 expectation
#      (tile and general Triton kernels) against numpy, and its time;
#   3. bench/fp8_bench.py: the update from where the user stands (bf16 vs
#      FP8 engine, receipts on and off), into OUT_DIR/fp8.json.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
. "$repo/tests/gpu/gpu_env.sh"
gpu_env "$repo" "${1:-.dev/bin}" "${2:-/tmp/ws-fp8-probe}" || exit 2
OUT="$LOG"
{ echo "date: $(date -Is) commit: ${COMMIT:-?}"; nvidia-smi -L; } | tee "$OUT/env.txt"
echo "=== kernels"
timeout -k 5 120 "$BIN/gpu_kernels_bench" --sections=fp8 --repeats="${REPEATS:-5}" \
  2>&1 | tee "$OUT/kernels.txt"
echo "=== triton expectation"
timeout -k 5 70 python3 tests/gpu/check_fp8_triton_gpu.py >"$OUT/triton.txt" 2>&1
grep -E '^(FAIL|TIME|ALL)|FAIL' "$OUT/triton.txt" | head -20
if [ "${SKIP_E2E:-0}" != 1 ]; then
  echo "=== update (fp8_bench)"
  BENCH_REPEATS="${BENCH_REPEATS:-3}" timeout -k 10 400 python3 bench/fp8_bench.py \
    "$BIN/weightsyncd" "$BIN/weightsync_gpu_worker" "$OUT/fp8.json" >"$OUT/fp8_bench.txt" 2>&1
  echo "rc $?"; tail -n 25 "$OUT/fp8_bench.txt"
fi
