#!/usr/bin/env bash
# GPU benchmark of the NCCL backend, one command on a two-GPU machine:
#   COMMIT=<sha> KIND=nvidia-h200-x2 bash bench/run_gpu_bench.sh [BIN_DIR=.dev/bin] [OUT=bench/results]
# In one run: the baselines (raw NCCL broadcast in 1 GiB messages = the
# ceiling, naive per-parameter broadcast + copy, on-GPU copy) from
# nccl_baseline, then weightsync end to end (Start .. Finish returned, engine
# memory written) for Qwen3-8B and Qwen3-1.7B shapes in bf16, with a sweep
# of chunk size and staging buffer count. Writes OUT/gpu_nccl.json.
set -uo pipefail
BIN="$(cd "${1:-.dev/bin}" && pwd)"
OUT="${2:-bench/results}"
mkdir -p "$OUT"
LOG="$OUT/gpu_bench_logs"; mkdir -p "$LOG"
export NCCL_NVLS_ENABLE=0
here="$(cd "$(dirname "$0")" && pwd)"

pkill -KILL -f "weightsync_" 2>/dev/null; sleep 1
for model in qwen3-8b qwen3-1.7b; do
  bash "$here/run_nccl_baseline.sh" "$BIN/nccl_baseline" "$LOG/base-$model" --model=$model --repeats=5 \
    >"$LOG/base-$model.txt" 2>&1 || echo "baseline $model failed"
done

pkill -KILL -f "weightsync_" 2>/dev/null; sleep 1  # nothing of an earlier run may share the GPUs
sock="$LOG/d.sock"; chmod 750 "$LOG"  # weightsyncd refuses an open socket dir
run_ws() {  # model chunk_mib buffers -> prints median seconds of updates 2..5
  local model=$1 chunk=$2 bufs=$3 tag="$1-c$2-b$3"
  rm -f "$sock"
  timeout 300 "$BIN/weightsyncd" --socket="$sock" --gpu=1 --gpu_worker="$BIN/weightsync_gpu_worker" \
    --gpu_staging_buffers=$bufs --gpu_staging_budget_bytes=$((8<<30)) --max_chunk_bytes=$((1<<30)) \
    >"$LOG/daemon-$tag.log" 2>&1 &
  local d=$!
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
  timeout 300 "$BIN/weightsync_gpu_engine" --target="unix:$sock" --engine_id=e --model=$model \
    --layout=plain --dtype=bfloat16 --device=1 --verify=false >"$LOG/engine-$tag.log" 2>&1 &
  local e=$!
  for _ in $(seq 600); do grep -q registered "$LOG/engine-$tag.log" && break; sleep 0.1; done
  timeout 300 "$BIN/weightsync_gpu_trainer" --target="unix:$sock" --model=$model --dtype=bfloat16 \
    --updates=6 --same_data --chunk_mib=$chunk --device=0 >"$LOG/trainer-$tag.log" 2>&1
  kill -TERM $e $d 2>/dev/null; sleep 0.5; kill -KILL $e $d 2>/dev/null; wait $e $d 2>/dev/null
  # updates 2..6 (the first warms up): median seconds
  grep -o ', [0-9.]* s,' "$LOG/trainer-$tag.log" | tr -d ', s' | tail -n +2 | sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print "nan"}'
}

results="$LOG/ws.tsv"; : >"$results"
for model in qwen3-8b qwen3-1.7b; do
  for chunk in 64 256 1024; do
    for bufs in 2 4; do
      [ $chunk = 1024 ] && [ $bufs = 4 ] && [ $model = qwen3-1.7b ] && continue
      s=$(run_ws $model $chunk $bufs)
      printf '%s\t%s\t%s\t%s\n' $model $chunk $bufs "$s" | tee -a "$results"
    done
  done
done

python3 - "$LOG" "$OUT" "${COMMIT:-unknown}" "${KIND:-unknown}" <<'PY'
import json, sys, datetime, glob, os
log, out, commit, kind = sys.argv[1:5]
rows = [l.split('\t') for l in open(os.path.join(log, 'ws.tsv')).read().split('\n') if l.strip()]
report = {"date": datetime.date.today().isoformat(), "kind": kind, "commit": commit, "models": []}
print("\n=== weightsync NCCL end to end vs the same run's baselines ===")
print(f"{'model':11} {'GB':>6} {'raw 1GiB GB/s':>13} {'naive s':>8} {'best ws s':>9} {'ws GB/s':>8} {'ratio':>6}  best chunk/bufs")
for model in ["qwen3-8b", "qwen3-1.7b"]:
    try:
        base = json.load(open(os.path.join(log, f"base-{model}", "nccl_baseline.json")))
    except Exception as e:
        print(model, "baseline missing", e); continue
    sweep = [{"chunk_MiB": int(c), "staging_buffers": int(b), "weightsync_s": float(s),
              "weightsync_GBps": base["bytes"] / float(s) / 1e9}
             for m, c, b, s in rows if m == model and s != "nan"]
    if not sweep:
        print(model, "no weightsync result"); continue
    best = min(sweep, key=lambda r: r["weightsync_s"])
    entry = {"date": report["date"], "kind": kind, "commit": commit, "model": model,
             "bytes": base["bytes"], "tensors": base["tensors"],
             "baseline_GBps": base["raw_1g_GBps"], "raw_1g_s": base["raw_1g_s"],
             "raw_256m_GBps": base.get("raw_256m_GBps"), "raw_16m_GBps": base.get("raw_16m_GBps"),
             "naive_s": base["naive_s"], "ondevice_copy_GBps": base.get("ondevice_copy_GBps"),
             "weightsync_s": best["weightsync_s"], "weightsync_GBps": best["weightsync_GBps"],
             "ratio": best["weightsync_GBps"] / base["raw_1g_GBps"],
             "best": {"chunk_MiB": best["chunk_MiB"], "staging_buffers": best["staging_buffers"]},
             "sweep": sweep}
    report["models"].append(entry)
    print(f"{model:11} {base['bytes']/1e9:6.2f} {base['raw_1g_GBps']:13.1f} {base['naive_s']:8.4f} "
          f"{best['weightsync_s']:9.4f} {best['weightsync_GBps']:8.1f} {entry['ratio']:6.3f}  "
          f"{best['chunk_MiB']} MiB x{best['staging_buffers']}")
    for r in sweep:
        print(f"    chunk {r['chunk_MiB']:5d} MiB, {r['staging_buffers']} buffers: {r['weightsync_s']:.4f} s, {r['weightsync_GBps']:.1f} GB/s")
json.dump(report, open(os.path.join(out, "gpu_nccl.json"), "w"), indent=2)
PY
