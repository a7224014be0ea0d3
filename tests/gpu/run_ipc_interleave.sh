#!/usr/bin/env bash
# Issue 31's open question on one GPU: is the IPC update with receipts on
# slower with the client after the restructuring than before it, or was the
# 10% of one after-then-before run noise? bench/python_ipc_bench.py with the
# client of NEW_TREE and of OLD_TREE, interleaved (new, old, new, old, new),
# the same daemon binary throughout:
#   bash tests/gpu/run_ipc_interleave.sh NEW_TREE OLD_TREE BIN_DIR LOG_DIR [PAIRS=2]
# Prints update_s_default and update_s_receipts_off of every run, in order.
set -uo pipefail
NEW="$(cd "$1" && pwd)"
OLD="$(cd "$2" && pwd)"
PAIRS="${5:-2}"
source "$NEW/tests/gpu/gpu_env.sh"
gpu_env "$NEW" "$3" "$4" || exit 2
unset PYTHONPATH   # each tree's bench puts its own client first
export BENCH_REPEATS="${BENCH_REPEATS:-5}"
bench() {  # label tree
  (cd "$2" && timeout -k 5 120 "$PY" bench/python_ipc_bench.py "$WEIGHTSYNCD" \
     "$WEIGHTSYNC_GPU_WORKER" "$LOG/ipc_$1.json") >"$LOG/ipc_$1.log" 2>&1 || echo "$1: exit $?"
  python3 - "$1" "$LOG/ipc_$1.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[2]))
except (OSError, ValueError) as e:
    sys.exit(f"{sys.argv[1]}: no result ({e})")
print(f"{sys.argv[1]:8s} update_s_default {r['update_s_default'] * 1e3:7.2f} ms  "
      f"receipts_off {r['update_s_receipts_off'] * 1e3:7.2f} ms  copy {r['copy_s'] * 1e3:6.2f} ms")
PY
}
for i in $(seq 1 "$PAIRS"); do
  bench "new$i" "$NEW"
  bench "old$i" "$OLD"
done
bench "new$((PAIRS + 1))" "$NEW"
