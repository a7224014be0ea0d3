#!/usr/bin/env bash
# Issue 31's GPU proof in one short device call (two GPUs): the Python
# client after its restructuring (senders, the receipts package, Triton
# kernels at module level) against the GPU regressions, and its benchmarks
# against the client as it was before, in the same run on the same cards.
#
#   bash tests/gpu/run_issue31_checks.sh NEW_TREE OLD_TREE BIN_DIR LOG_DIR [BUDGET_S=200]
#
# NEW_TREE / OLD_TREE: copies of the repository's client/python, examples,
# bench and tests/gpu (the client after and before the change); BIN_DIR: the
# packed weightsyncd and weightsync_gpu_worker (the same daemon for both).
# Steps run in order of what they prove, each under `timeout`, until the
# budget is spent; a step that no longer fits is reported as not run.
# Prints a table last; full logs under LOG_DIR.
set -uo pipefail
NEW="$(cd "$1" && pwd)"
OLD="$(cd "$2" && pwd)"
BUDGET="${5:-200}"
source "$NEW/tests/gpu/gpu_env.sh"
gpu_env "$NEW" "$3" "$4" || exit 2
unset PYTHONPATH   # each tree's scripts put their own client first
export WS_GPUS=2 BENCH_REPEATS="${BENCH_REPEATS:-5}"
results=()
record() { results+=("$(printf '%-44s %s' "$1" "$2")"); }
left() { echo $((BUDGET - SECONDS)); }

run() {  # name seconds tree command...
  local name="$1" secs="$2" tree="$3"; shift 3
  local t
  t=$(left)
  [ "$t" -lt "$secs" ] && secs=$((t - 3))
  if [ "$secs" -lt 15 ]; then record "$name" "NOT RUN (budget spent)"; return; fi
  echo "=== $name ($secs s at most)" >&2
  local t0=$SECONDS
  (cd "$tree" && timeout -k 5 "$secs" "$@") >"$LOG/$name.log" 2>&1
  local rc=$? took=$((SECONDS - t0))
  if [ $rc = 0 ]; then record "$name" "PASS (${took} s)"
  elif [ $rc = 124 ] || [ $rc = 137 ]; then record "$name" "FAIL (timed out, ${took} s)"
  else record "$name" "FAIL (exit $rc, ${took} s)"; fi
  tail -n "${TAIL:-6}" "$LOG/$name.log" >&2
}

{ echo "date: $(date -Is)  commit: ${COMMIT:-?}"; nvidia-smi -L; } | tee "$LOG/env.txt"
# NCCL (one daemon) and IPC senders end to end, receipts on (the Triton
# receipt kernels, now module-level, on the GPU): bit-exact engines.
TAIL=4 run test_torch_gpu 100 "$NEW" "$PY" tests/gpu/test_torch_gpu.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER"
# The IPC registered source's update (Qwen3-8B shapes, one GPU), after then before.
run python_ipc_bench_after 60 "$NEW" "$PY" bench/python_ipc_bench.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER" "$LOG/python_ipc_after.json"
run python_ipc_bench_before 60 "$OLD" "$PY" bench/python_ipc_bench.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER" "$LOG/python_ipc_before.json"
# The Triton receipt kernels against numpy, every dtype pair.
run check_receipts_gpu 60 "$NEW" "$PY" tests/gpu/check_receipts_gpu.py
# The NCCL update (GPU 0 -> engine on GPU 1), after then before.
export BENCH_CHUNKS_MIB="${BENCH_CHUNKS_MIB:-1024}"
run python_bench_after 60 "$NEW" "$PY" bench/python_bench.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER" "$LOG/python_nccl_after.json"
run python_bench_before 60 "$OLD" "$PY" bench/python_bench.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER" "$LOG/python_nccl_before.json"
# FP8 targets: the daemon's quantisation and the trainer's FP8 Triton receipts.
run fp8_exact 120 "$NEW" "$PY" tests/gpu/test_fp8_gpu.py exact "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER"
run test_registered_source 120 "$NEW" "$PY" tests/gpu/test_registered_source.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER"
run rlhf 120 "$NEW" "$PY" examples/rlhf.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER"

echo
echo "=== issue 31 GPU checks ($LOG, ${SECONDS} s)"
for r in "${results[@]}"; do echo "$r"; done
for f in "$LOG"/python_*_*.json; do [ -f "$f" ] && echo "$(basename "$f"): $(head -c 1500 "$f" | tr '\n' ' ')"; done
for r in "${results[@]}"; do case "$r" in *FAIL*) exit 1;; esac; done
exit 0
