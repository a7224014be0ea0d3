#!/usr/bin/env bash
# Issue 32 through the daemons on 4 GPUs (nvidia-h100-x4), building nothing:
#   bash tests/gpu/run_mton_checks.sh OUTDIR [BIN=.dev/bin] [MODEL=qwen3-8b]
# BIN holds weightsyncd and weightsync_gpu_worker (their libraries in
# BIN/../lib, as /work/shared/tools/device-pack lays them out).
# 1. tests/gpu/test_mton_gpu.py on a tiny model (a quick check of every
#    path, the faults included), then on MODEL: two trainer ranks (GPUs 0,
#    1) -> two daemons (GPUs 2, 3), TP=2 and two replicas, cases rows /
#    layers / replicas, bit-exact in every engine, timed against today's
#    single sender in the same run; rank 1 killed mid-update, then repaired.
#    Faults: rank 1 dies at the start, mid-transfer and at the finish (and,
#    on the tiny model, freezes: SIGSTOP), each followed by a repair.
# 2. The raw NCCL send/recv baseline of the same byte patterns
#    (bench/mton_nccl_bench.py) in the same call, in 1 GiB messages and in
#    the nccl default chunk (64 MiB, --nccl_chunk_bytes).
# 3. The cross-node code path (NET=1, the default): NCCL's network
#    transport over loopback (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) for
#    the daemons, the trainers and the raw baseline, on Qwen3-1.7B, TP=2
#    engine, the documented defaults only.
# Knobs: TINY=0 skips 1; FAULTS (default "start mid finish"; empty: none),
# LAYOUTS (tp2 and/or replicas) and VARIANTS (test_mton_gpu.py --variants)
# narrow 1's MODEL step; RAW_MIB the raw message sizes (default "1024 64");
# NET=0 skips 3. Never name the daemon's binary in the command line that
# starts this script: the cleanup's pkill -f would match that shell too.
# Prints the tables last; logs and JSON under OUTDIR.
set -uo pipefail
out="$(mkdir -p "${1:?usage: run_mton_checks.sh OUTDIR [BIN] [MODEL]}" && cd "$1" && pwd)"
cd "$(dirname "$0")/../.." || exit 2
bin="$(cd "${2:-.dev/bin}" && pwd)"
model="${3:-qwen3-8b}"
NCCL_LIB=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "nccl", "lib"))' 2>/dev/null)
export NCCL_LIB
export LD_LIBRARY_PATH="$bin/../lib:${NCCL_LIB:+$NCCL_LIB:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
{
  date -u; echo "commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
rc=0
cleanup() { pkill -9 -f test_mton_gpu.py; pkill -9 -f weightsyncd; pkill -9 -f weightsync_gpu_worker; sleep 1; } 2>/dev/null
if [ "${TINY:-1}" = 1 ]; then   # TINY=0: straight to MODEL (a rerun)
  timeout -k 10 "${T_TINY:-240}" python3 tests/gpu/test_mton_gpu.py --bin "$bin" \
    --out "$out/tiny" --model tiny --reps 2 --faults 2>&1 | tee "$out/tiny.txt" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  cleanup
fi
faults="${FAULTS-start mid finish}" fault_args=()
[ -n "$faults" ] && fault_args=(--faults $faults)
if [ "$rc" = 0 ] || [ -n "${FORCE:-}" ]; then
  timeout -k 10 "${T_MODEL:-300}" python3 tests/gpu/test_mton_gpu.py --bin "$bin" \
    --out "$out/$model" --model "$model" --reps 5 "${fault_args[@]}" \
    ${LAYOUTS:+--layouts $LAYOUTS} ${VARIANTS:+--variants $VARIANTS} 2>&1 | tee "$out/$model.txt" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  # The daemons' own account of each update (pause, begin, transfer, device, receipts, commit).
  grep -h "update.committed" "$out/$model"/d*.log 2>/dev/null | sed 's/^.*update.committed //' \
    >"$out/$model-daemons.txt"
  cleanup
fi
for msg in ${RAW_MIB:-1024 64}; do
  timeout -k 10 "${T_RAW:-70}" python3 bench/mton_nccl_bench.py --out "$out/raw$msg" \
    --model "$model" --reps 3 --msg_mib "$msg" --timeout_s 60 ${LAYOUTS:+--layouts $LAYOUTS} \
    >"$out/raw$msg.log" 2>&1 || rc=1
  tail -16 "$out/raw$msg.log"
done
if [ "${NET:-1}" = 1 ]; then
  net_model="${NET_MODEL:-qwen3-1.7b}"
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout -k 10 "${T_NET:-200}" \
    python3 tests/gpu/test_mton_gpu.py --bin "$bin" --out "$out/net" --model "$net_model" \
    --layouts tp2 --variants default --reps 3 2>&1 | tee "$out/net.txt" | tail -12
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  cleanup
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout -k 10 "${T_RAW:-70}" \
    python3 bench/mton_nccl_bench.py --out "$out/rawnet" --model "$net_model" --reps 3 \
    --msg_mib 64 --timeout_s 60 --layouts tp2 --wire dense fp8 sparse >"$out/rawnet.log" 2>&1 || rc=1
  tail -20 "$out/rawnet.log"
fi
# Few files back from the GPU machine: the logs in one archive.
(cd "$out" && tar czf logs.tgz --exclude=logs.tgz --exclude='*.txt' . && \
  find . -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +)
echo "=== run_mton_checks: $([ $rc = 0 ] && echo PASS || echo FAIL) ($out)"
exit $rc
