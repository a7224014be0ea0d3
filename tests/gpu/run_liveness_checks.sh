#!/usr/bin/env bash
# Issue 36 on two GPUs (NCCL), one command on a device machine:
#   COMMIT=<sha> KIND=<kind> bash tests/gpu/run_liveness_checks.sh [BIN_DIR=.dev/bin] [LOG_DIR=/tmp/ws-live] [ROUNDS=40]
# 1. tests/gpu/gpu_faults.py trainer_killed at every phase (init, start,
#    mid, finish, pause) with the daemon's DEFAULT --update_idle_timeout_ms
#    (5 min): the trainer's Liveness stream must end its update (or its
#    pause) within 1 s of the SIGKILL (--max_detect_s 1), the engines end
#    READY or DIRTY at v0/v99, the next trainer's update commits verified.
# 2. tests/gpu/run_leak_checks.sh on NCCL, also at the default idle
#    timeout: every 4th trainer dies mid-transfer and the next one's Init
#    must be accepted; PASS/FAIL from leak_figures.py (the last period of
#    4 rounds against the first half after the first period; the NCCL
#    worker settles by round ~16, so 40 rounds) and the metrics.
# Writes LOG_DIR/summary.txt (the tables) and LOG_DIR/logs.tgz; exits 1 if
# either part fails. Every process runs under `timeout`.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BIN="$(cd "${1:-.dev/bin}" && pwd)"
LOG="${2:-/tmp/ws-live}"
ROUNDS="${3:-40}"
mkdir -p "$LOG" && chmod 750 "$LOG"
export NCCL_NVLS_ENABLE=0
nccl=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "nccl", "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH="$BIN/../lib:${nccl:+$nccl:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  echo "# issue 36, $(date -u +%F), kind ${KIND:-unknown}, commit ${COMMIT:-unknown}"
  echo "# COMMIT=${COMMIT:-?} KIND=${KIND:-?} bash tests/gpu/run_liveness_checks.sh BIN LOG $ROUNDS"
  nvidia-smi -L
} | tee "$LOG/summary.txt"
COMMIT="${COMMIT:-unknown}" timeout 150 python3 "$HERE/gpu_faults.py" "$BIN" "$LOG/faults" \
  --only trainer_killed --idle_timeout_ms default --max_detect_s 1 --json "$LOG/faults.json" \
  2>&1 | tee -a "$LOG/summary.txt"
faults=${PIPESTATUS[0]}
echo "== run_leak_checks.sh (NCCL, default --update_idle_timeout_ms), $ROUNDS rounds" \
  | tee -a "$LOG/summary.txt"
timeout 360 bash "$HERE/run_leak_checks.sh" "$BIN" "$LOG/leak" "$ROUNDS" 2>&1 \
  | tail -25 | tee -a "$LOG/summary.txt"
leak=${PIPESTATUS[0]}
grep -h "trainer.gone\|update.failed\|update.abandoned" "$LOG"/faults/*/daemon.log "$LOG"/leak/daemon.log \
  2>/dev/null | cut -c1-300 | tail -20 >"$LOG/daemon_gone_lines.txt"
echo "faults rc $faults, leak rc $leak" | tee -a "$LOG/summary.txt"
tar -czf "$LOG/logs.tgz" -C "$LOG" faults leak 2>/dev/null
[ "$faults" = 0 ] && [ "$leak" = 0 ]
