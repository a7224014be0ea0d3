#!/usr/bin/env bash
# Issue 32's GPU runs on 4 GPUs (nvidia-h100-x4), building nothing:
#   bash bench/run_mton.sh OUTDIR [raw|full] [BIN]
# full (BIN: mton_worker_bench, weightsync_gpu_worker and their libraries in
# BIN/../lib, as /work/shared/tools/device-pack lays them out): the proof's
# same-run table. Over NVLink, Qwen3-8B: the raw NCCL baselines in 256 MiB
# messages (the chunk size weightsync uses), then every case and layout
# through weightsync_gpu_worker (bench/mton_run.py: today's broadcast, one
# sender, two senders; 3+ versions each, bit-exact); then the same over
# NCCL's network transport for Qwen3-1.7B; then the two-sender faults
# (one sender killed or frozen at the start, middle and end of an update).
# raw: the raw NCCL baselines of the M->N byte patterns
# (bench/mton_nccl_bench.py): Qwen3-8B over NVLink in 1 GiB messages (every
# case and layout), the TP=2 rows in 256 MiB messages, and NCCL's network
# transport over loopback (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) for
# Qwen3-1.7B, dense / fp8 / sparse 0.3% bytes. Writes OUTDIR/mton_raw_*.json,
# OUTDIR/topo.txt and OUTDIR/mton_logs.tgz (every rank's log); prints the
# tables last. Every process is bounded (the bench's own --timeout_s and
# `timeout` here).
set -uo pipefail
out="$(mkdir -p "${1:?usage: run_mton.sh OUTDIR [raw]}" && cd "$1" && pwd)"
what="${2:-raw}"
cd "$(dirname "$0")/.." || exit 2
bin="$(cd "${3:-.dev/bin}" 2>/dev/null && pwd)"
NCCL_LIB=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "nccl", "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH="${bin:+$bin/../lib:}${NCCL_LIB:+$NCCL_LIB:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
work="$(mktemp -d /tmp/mton.XXXXXX)"
rc=0
{
  date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
} >"$out/topo.txt" 2>&1
cat "$out/topo.txt"

run() {  # NAME ARGS...: one bench run, its json to OUTDIR
  local name="$1"; shift
  timeout -k 10 420 python3 bench/mton_nccl_bench.py --out "$work/$name" "$@" \
    >"$work/$name.log" 2>&1
  local r=$?
  [ -f "$work/$name/mton_raw.json" ] && cp "$work/$name/mton_raw.json" "$out/mton_raw_$name.json"
  [ $r -ne 0 ] && { echo "run $name FAILED rc=$r"; rc=1; }
  return 0
}

if [ "$what" = raw ]; then
  run nvlink --model qwen3-8b --reps 5 --msg_mib 1024
  run nvlink256 --model qwen3-8b --reps 5 --msg_mib 256 --layouts tp2
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 run net --model qwen3-1.7b --reps 3 --msg_mib 256 \
    --wire dense fp8 sparse --timeout_s 400
fi

worker() {  # NAME ARGS...: bench/mton_run.py, its json to OUTDIR
  local name="$1"; shift
  timeout -k 10 500 python3 bench/mton_run.py --bin "$bin" --out "$work/$name" "$@" \
    >"$work/$name.log" 2>&1
  local r=$?
  [ -f "$work/$name/mton_worker.json" ] && cp "$work/$name/mton_worker.json" "$out/mton_worker_$name.json"
  [ $r -ne 0 ] && { echo "worker run $name FAILED rc=$r"; rc=1; }
  return 0
}

if [ "$what" = full ]; then
  [ -x "$bin/mton_worker_bench" ] || { echo "no $bin/mton_worker_bench"; exit 2; }
  run nvlink --model qwen3-8b --reps 5 --msg_mib 256
  worker w_nvlink --model qwen3-8b --reps 5 --raw "$work/nvlink/mton_raw.json" --label nvlink
  export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
  run net --model qwen3-1.7b --reps 3 --msg_mib 256 --timeout_s 300
  worker w_net --model qwen3-1.7b --reps 3 --raw "$work/net/mton_raw.json" \
    --label "network transport" --timeout_s 200
  unset NCCL_P2P_DISABLE NCCL_SHM_DISABLE
  timeout -k 10 300 python3 bench/mton_run.py --bin "$bin" --out "$work/faults" \
    --model qwen3-1.7b --faults >"$work/faults.log" 2>&1 || { echo "faults FAILED"; rc=1; }
  [ -f "$work/faults/mton_faults.json" ] && cp "$work/faults/mton_faults.json" "$out/"
fi

tar -czf "$out/mton_logs.tgz" -C "$work" --exclude='*.plan' . 2>/dev/null
for f in "$work"/*.log; do
  echo "=== $(basename "$f")"; sed -n '/^=== /,$p' "$f"; grep -m3 -i "error\|FAILED" "$f"
done
exit $rc
