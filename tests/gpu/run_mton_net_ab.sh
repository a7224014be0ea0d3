#!/usr/bin/env bash
# Issue 32: the many senders' chunk size on NCCL's network transport (the
# cross-node code path, over loopback: NCCL_P2P_DISABLE=1
# NCCL_SHM_DISABLE=1), A/B in one call on nvidia-h100-x4 / nvidia-h200-x4:
#   bash tests/gpu/run_mton_net_ab.sh OUTDIR [BIN=.dev/bin] [MODEL=qwen3-1.7b]
# 1. tests/gpu/test_mton_gpu.py, one TP=2 engine, rows / layers / replicas,
#    the daemons' default chunk size (256 MiB for many senders, 64 MiB for
#    one) and 64 MiB asked, receipts on, bit-exact;
# 2. raw send/recv of the same bytes (bench/mton_nccl_bench.py) in 64 and
#    256 MiB messages.
# Prints the tables last; logs and JSON under OUTDIR (logs.tgz). Never name
# the daemon's binary in the command line that starts this script (the
# cleanup's pkill -f would match that shell).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/gpu_env.sh"
gpu_env "$(cd "$here/../.." && pwd)" "${2:-.dev/bin}" "${1:?usage: run_mton_net_ab.sh OUTDIR [BIN] [MODEL]}" \
  || exit 2
out="$LOG" bin="$BIN"
model="${3:-qwen3-1.7b}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
{ date -u; echo "commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"; nvidia-smi -L; } \
  | tee "$out/env.txt"
rc=0
timeout -k 10 "${T_NET:-300}" python3 tests/gpu/test_mton_gpu.py --bin "$bin" --out "$out/net" \
  --model "$model" --layouts tp2 --variants default 64 --reps "${REPS:-3}" 2>&1 \
  | tee "$out/net.txt" | tail -16
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
{ pkill -9 -f test_mton_gpu.py; pkill -9 -f weightsync_gpu_worker; sleep 1; } 2>/dev/null
for msg in 64 256; do
  timeout -k 10 "${T_RAW:-120}" python3 bench/mton_nccl_bench.py --out "$out/rawnet$msg" \
    --model "$model" --reps 3 --msg_mib "$msg" --timeout_s 100 --layouts tp2 \
    >"$out/rawnet$msg.log" 2>&1 || rc=1
  tail -8 "$out/rawnet$msg.log"
done
(cd "$out" && tar czf logs.tgz --exclude=logs.tgz --exclude='*.txt' . && \
  find . -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +)
echo "=== run_mton_net_ab: $([ $rc = 0 ] && echo PASS || echo FAIL) ($out)"
exit $rc
