#!/usr/bin/env bash
# One-GPU proof of FP8 on the wire (issue 32, item 3), on nvidia-h200 or
# nvidia-h100-x1, one command (binaries packed into .dev elsewhere):
#   COMMIT=<sha> bash tests/gpu/run_wire_fp8_checks.sh [BIN_DIR=.dev/bin] [LOG_DIR=/tmp/ws-wire]
# 1. tests/gpu/check_wire_fp8_gpu.py: the trainer's GPU quantisation (the
#    Triton kernels, and torch ops) byte-equal to the host path, and their
#    time; then tests/gpu/check_fp8_triton_gpu.py (the receipts' kernels,
#    whose encoder the wire's tile kernel shares);
# 2. tests/gpu/run_fp8_checks.sh: every one-GPU FP8 path bit for bit, now
#    with update(fp8_on_wire=True) rounds (streaming and staged), and the
#    FP8 model's greedy generation;
# 3. bench/fp8_bench.py (Qwen3-8B shapes): the FP8 engine's update with the
#    daemon quantising (the default) and with fp8_on_wire=True, bytes and
#    time, receipts on and off, against the bf16 engine, in one run
#    (LOG_DIR/fp8_wire.json).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
bin="${1:-.dev/bin}"
log="${2:-/tmp/ws-wire}"
. "$here/gpu_env.sh"
gpu_env "$repo" "$bin" "$log" || exit 2
rc=0
echo "=== check_wire_fp8_gpu"
timeout -k 10 240 "$PY" tests/gpu/check_wire_fp8_gpu.py >"$LOG/wire.txt" 2>&1 || rc=1
grep -E '^(FAIL|TIME)' "$LOG/wire.txt"; echo "$(grep -c '^PASS' "$LOG/wire.txt") PASS"
echo "=== check_fp8_triton_gpu (the receipt kernels share the wire's encoder)"
timeout -k 10 300 "$PY" tests/gpu/check_fp8_triton_gpu.py >"$LOG/triton.txt" 2>&1 || rc=1
grep -E '^FAIL' "$LOG/triton.txt"; tail -n 4 "$LOG/triton.txt"
echo "=== run_fp8_checks"
timeout -k 10 600 bash tests/gpu/run_fp8_checks.sh "$BIN" "$LOG/fp8" >"$LOG/fp8_checks.txt" 2>&1 || rc=1
grep -E 'wire|FAIL|^fp8_' "$LOG/fp8_checks.txt"
echo "=== fp8_bench (${BENCH_MODEL:-qwen3-8b})"
timeout -k 10 "${BENCH_TIMEOUT:-420}" "$PY" bench/fp8_bench.py "$WEIGHTSYNCD" \
  "$WEIGHTSYNC_GPU_WORKER" "$LOG/fp8_wire.json" >"$LOG/bench.txt" 2>&1 || rc=1
tail -n 16 "$LOG/bench.txt"
echo "rc=$rc"
exit $rc
