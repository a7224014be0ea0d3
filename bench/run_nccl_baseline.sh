#!/usr/bin/env bash
# NCCL baselines on a two-GPU machine (builds nothing; see ../DEVICE.md):
#   bash bench/run_nccl_baseline.sh [BINARY] [OUTDIR] [FLAG...]
# BINARY defaults to .dev/bin/nccl_baseline, OUTDIR to bench/results/gpu;
# extra flags go to both ranks (e.g. --model=qwen3-1.7b --repeats=9).
# Expects LD_LIBRARY_PATH to hold .dev/lib, NCCL's lib and CUDA's lib64.
# Starts rank 1 (engine, GPU 1) and rank 0 (trainer, GPU 0), each under
# `timeout 300`, waits for both, and prints rank 1's table. Writes
# OUTDIR/nccl_baseline.json (rank 1's figures), nccl_baseline.rank0.json and
# both ranks' logs. Exits non-zero if either rank failed.
set -uo pipefail
bin="${1:-.dev/bin/nccl_baseline}"
out="${2:-bench/results/gpu}"
shift $(( $# < 2 ? $# : 2 ))
export NCCL_NVLS_ENABLE=0

[ -x "$bin" ] || { echo "no executable $bin" >&2; exit 2; }
mkdir -p "$out"
iddir="$(mktemp -d /tmp/nccl-baseline.XXXXXX)"
idfile="$iddir/nccl_id"  # fresh: rank 1 must never read a stale id
log0="$out/nccl_baseline.rank0.log"
log1="$out/nccl_baseline.rank1.log"

timeout -k 10 300 "$bin" --rank=1 --device=1 --id_file="$idfile" \
  --json="$out/nccl_baseline.json" "$@" >"$log1" 2>&1 &
p1=$!
timeout -k 10 300 "$bin" --rank=0 --device=0 --id_file="$idfile" \
  --json="$out/nccl_baseline.rank0.json" "$@" >"$log0" 2>&1 &
p0=$!

# Wait for the first to end; if it failed, stop the other (its own watchdog
# would otherwise only fire after --phase_timeout_s).
rc0="" rc1=""
wait -n -p first "$p0" "$p1"; rc=$?
if [ "$first" = "$p0" ]; then rc0=$rc; else rc1=$rc; fi
if [ "$rc" -ne 0 ]; then
  [ -z "$rc0" ] && kill -TERM "$p0" 2>/dev/null
  [ -z "$rc1" ] && kill -TERM "$p1" 2>/dev/null
fi
if [ -z "$rc0" ]; then wait "$p0"; rc0=$?; fi
if [ -z "$rc1" ]; then wait "$p1"; rc1=$?; fi
rm -rf "$iddir"

if [ "$rc0" -ne 0 ] || [ "$rc1" -ne 0 ]; then
  echo "nccl_baseline FAILED: rank 0 rc=$rc0, rank 1 rc=$rc1 (124 = timeout)"
  echo "--- rank 0 ($log0), last lines:"; tail -n 20 "$log0"
  echo "--- rank 1 ($log1), last lines:"; tail -n 20 "$log1"
  exit 1
fi
sed -n '/^=== nccl_baseline table ===$/,/^=== end ===$/p' "$log1" | sed '1d;$d'
echo "json: $out/nccl_baseline.json"
