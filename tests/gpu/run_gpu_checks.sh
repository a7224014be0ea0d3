#!/usr/bin/env bash
# GPU proof of the NCCL data plane, on a two-GPU machine, one command:
#   bash tests/gpu/run_gpu_checks.sh [BIN_DIR=.dev/bin] [LOG_DIR=/tmp/ws-gpu]
# BIN_DIR holds weightsyncd, weightsync_gpu_worker, weightsync_gpu_engine,
# weightsync_gpu_trainer and scatter_gpu_test (../shared/tools/device-pack).
# Prints a PASS/FAIL table last; full logs under LOG_DIR.
set -uo pipefail
BIN="$(cd "${1:-.dev/bin}" && pwd)"
LOG="${2:-/tmp/ws-gpu}"
mkdir -p "$LOG" && chmod 750 "$LOG"  # the socket lives here: weightsyncd refuses an open dir
export NCCL_NVLS_ENABLE=0
results=()
record() { results+=("$(printf '%-58s %s' "$1" "$2")"); }
pids=()
stop_all() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; sleep 1;
             for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done; pids=();
             pkill -KILL -f "$BIN/weightsync_" 2>/dev/null; true; }
trap stop_all EXIT
sock="$LOG/d.sock"

start_daemon() {  # extra flags
  rm -f "$sock"
  timeout 600 "$BIN/weightsyncd" --socket="$sock" --gpu=1 --gpu_worker="$BIN/weightsync_gpu_worker" \
    --finish_timeout_ms=20000 --notice_timeout_ms=60000 "$@" >>"$LOG/daemon.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do [ -S "$sock" ] && return 0; sleep 0.1; done
  return 1
}
engine() {  # log name, flags
  local name="$1"; shift
  timeout 600 "$BIN/weightsync_gpu_engine" --target="unix:$sock" --engine_id="$name" "$@" \
    >"$LOG/$name.log" 2>&1 &
  pids+=($!)
}
wait_registered() {  # names...
  for _ in $(seq 600); do
    local ok=1
    for n in "$@"; do grep -q registered "$LOG/$n.log" 2>/dev/null || ok=0; done
    [ $ok = 1 ] && return 0
    sleep 0.1
  done
  return 1
}
count() { local n; n=$(grep -c "$2" "$LOG/$1.log" 2>/dev/null); echo "${n:-0}"; }

# 1. The conversion/copy kernels, bit for bit against the CPU reference.
if timeout 300 "$BIN/scatter_gpu_test" >"$LOG/scatter_gpu_test.log" 2>&1; then
  record "scatter kernels: fp32/bf16/fp16 2-D copies bit-exact" PASS
else record "scatter kernels: fp32/bf16/fp16 2-D copies bit-exact" FAIL; fi

# 2. Three NCCL updates: trainer on GPU 0, daemon rank on GPU 1; a plain
#    bf16 engine on GPU 1 fed float32, and a TP=2 pair (fused qkv/gate_up,
#    row/column shards, padded vocab) with rank 0 on GPU 0 (peer writes).
start_daemon || record "daemon start" FAIL
M=demo
engine plain --model=$M --layout=plain --dtype=bfloat16 --ckpt_dtype=float32 --device=1
engine tp0 --model=$M --layout=tp --tp_rank=0 --tp_size=2 --dtype=bfloat16 --ckpt_dtype=float32 --device=0
engine tp1 --model=$M --layout=tp --tp_rank=1 --tp_size=2 --dtype=float16 --ckpt_dtype=float32 --device=1
wait_registered plain tp0 tp1 || record "engines register (CUDA IPC)" FAIL
sleep 0.5
timeout 300 "$BIN/weightsync_gpu_trainer" --target="unix:$sock" --model=$M --dtype=float32 \
  --updates=3 --chunk_mib=16 --device=0 --finish_timeout_ms=120000 --update_timeout_s=60 >"$LOG/trainer.log" 2>&1
trc=$?
v=$(( $(count plain 'verified') + $(count tp0 'verified') + $(count tp1 'verified') ))
if [ $trc = 0 ] && [ "$v" = 9 ]; then
  record "3 NCCL updates, 3 engines, bit-exact (fp32->bf16/fp16, TP=2)" PASS
else record "3 NCCL updates, 3 engines, bit-exact (fp32->bf16/fp16, TP=2) [$v/9]" FAIL; fi
grep -q "MISMATCH" "$LOG"/plain.log "$LOG"/tp0.log "$LOG"/tp1.log && record "no mismatching parameter" FAIL

# 3. The trainer dies mid-transfer: Finish returns ABORTED within its
#    deadline, the engines are DIRTY, the daemon still answers, and a fresh
#    InitWeightTransfer + update succeeds and cleans them.
timeout 120 "$BIN/weightsync_gpu_trainer" --target="unix:$sock" --model=$M --dtype=float32 \
  --updates=1 --first_version=4 --chunk_mib=16 --device=0 --die_after_chunks=3 \
  >"$LOG/trainer_dies.log" 2>&1
t0=$(date +%s.%N)
timeout 120 "$BIN/weightsync_gpu_trainer" --target="unix:$sock" --finish_only=update-4 \
  --finish_timeout_ms=30000 >"$LOG/finish_after_death.log" 2>&1
t1=$(date +%s.%N)
secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", b - a}')
if grep -q "ABORTED" "$LOG/finish_after_death.log" && grep -q "ENGINE_DIRTY" "$LOG/finish_after_death.log"; then
  record "trainer killed mid-transfer: ABORTED in ${secs}s, engines DIRTY" PASS
else record "trainer killed mid-transfer: ABORTED, engines DIRTY" FAIL; fi
timeout 300 "$BIN/weightsync_gpu_trainer" --target="unix:$sock" --model=$M --dtype=float32 \
  --updates=1 --first_version=5 --chunk_mib=16 --device=0 --finish_timeout_ms=120000 --update_timeout_s=60 >"$LOG/trainer_after.log" 2>&1
trc=$?
v5=$(( $(count plain 'version 5: verified') + $(count tp0 'version 5: verified') + $(count tp1 'version 5: verified') ))
if [ $trc = 0 ] && [ "$v5" = 3 ]; then
  record "after the fault: re-init + update v5 verified on all engines" PASS
else record "after the fault: re-init + update v5 verified [$v5/3]" FAIL; fi
grep -q "restarting GPU worker\|died; starting\|killing it" "$LOG/daemon.log" \
  && record "(GPU worker was killed and respawned during the fault)" info
stop_all

echo
echo "=== GPU checks ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l), $(date -u +%F)) ==="
printf '%s\n' "${results[@]}"
! printf '%s\n' "${results[@]}" | grep -q "FAIL$\|FAIL "
