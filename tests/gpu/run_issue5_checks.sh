#!/usr/bin/env bash
# Issue 5 on GPUs (receipts, staged mode and sparse patches), on a
# two-GPU machine (NCCL backend), one command:
#   COMMIT=<sha> KIND=<kind> bash tests/gpu/run_issue5_checks.sh [BIN_DIR=.dev/bin] [LOG_DIR=/tmp/ws-issue5]
# BIN_DIR holds weightsyncd, weightsync_gpu_worker, weightsync_gpu_engine and
# weightsync_gpu_trainer. Trainer on GPU 0, daemon rank on GPU 1. On a
# machine with one GPU everything runs on GPU 0 and the trainer uses the IPC
# backend instead (the daemon reads its shared buffer; the trainer that dies
# mid-transfer shares a ring of 2 chunk slots so that it can die between
# chunks); the labels and the JSON files say which backend ran.
# (a) NCCL updates with receipts ON (computed on the GPU by the daemon's
#     worker) into a plain engine and a TP=2 pair: the trainer checks them
#     against what it sent, the engines compare every parameter bit for bit;
# (b) the trainer corrupts one byte of its broadcast (not of its host copy):
#     the receipt check must fail with DATA_LOSS naming an engine, then a
#     clean update passes again;
# (c) staged updates while an engine keeps reading its weights in a loop
#     (each snapshot must be one whole version); the pause covers only the
#     commit; the staging budget refuses (RESOURCE_EXHAUSTED) or falls back
#     to streaming; a trainer dying mid-staged-transfer leaves the engine
#     untouched (not dirty, old version);
# (e) sparse patches on a plain engine and a TP=2 pair (float32 checkpoint
#     into bfloat16 and float16 parameters): per density 0.1%, 1%, 10% the
#     trainer changes its weights, diffs them on the GPU, sends the patch,
#     then the same weights dense; every engine's memory hash must be equal
#     after both (and differ from before); a patch with an index outside its
#     tensor, sent staged, is refused with the engines untouched; a staged
#     sparse update then works;
# (d) benchmark, Qwen3-8B bf16, 1 GiB chunks: the staged pause per update
#     against a plain on-GPU copy of the same bytes on the engine's GPU
#     (goal <= 1.5x); the receipts' cost as the difference between updates
#     with and without them (goal <= 5%); a 1% sparse update's bytes and
#     time against the dense update of the same weights (goals <= 3% and
#     <= 10%). Writes LOG_DIR/staged.json, receipts.json and sparse.json.
# Every process runs under `timeout`. Prints the figures and a PASS/FAIL
# table last; full logs under LOG_DIR.
set -uo pipefail
BIN="$(cd "${1:-.dev/bin}" && pwd)"
LOG="${2:-/tmp/ws-issue5}"
mkdir -p "$LOG" && chmod 750 "$LOG"  # the socket lives here: weightsyncd refuses an open dir
rm -f "$LOG"/*.log "$LOG"/*.json
export NCCL_NVLS_ENABLE=0
results=()
record() { results+=("$(printf '%-66s %s' "$1" "$2")"); }
pids=()
# SIGTERM, then up to 10 s for everything to exit (the daemon has a 2 s
# shutdown grace and kills its GPU worker; an engine prints its read-loop
# counts), then SIGKILL.
source "$(dirname "$0")/stop_all.sh"
trap stop_all EXIT
sock=""
T0=$(date +%s)
NGPU=$(nvidia-smi -L | wc -l)
if [ "$NGPU" -ge 2 ]; then DEV_T=0 DEV_D=1 BACKEND=nccl DIE_RING=""
else DEV_T=0 DEV_D=0 BACKEND=ipc DIE_RING="--ipc_ring_slots=2"; fi
B=${BACKEND^^}

start_daemon() {  # tag, extra flags
  local tag="$1"; shift
  sock="$LOG/$tag.sock"  # one per daemon: an old one exiting can't unlink it
  rm -f "$sock"
  timeout 300 "$BIN/weightsyncd" --socket="$sock" --gpu=$DEV_D --gpu_worker="$BIN/weightsync_gpu_worker" \
    --notice_timeout_ms=60000 --max_chunk_bytes=$((1<<30)) "$@" >>"$LOG/daemon-$tag.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do [ -S "$sock" ] && return 0; sleep 0.1; done
  record "daemon start ($tag)" FAIL
  return 1
}
engine() {  # log name, flags
  local name="$1"; shift
  timeout 300 "$BIN/weightsync_gpu_engine" --target="unix:$sock" --engine_id="$name" "$@" \
    >"$LOG/$name.log" 2>&1 &
  pids+=($!)
}
wait_registered() {  # names...
  for _ in $(seq 900); do
    local ok=1
    for n in "$@"; do grep -q registered "$LOG/$n.log" 2>/dev/null || ok=0; done
    [ $ok = 1 ] && return 0
    sleep 0.1
  done
  record "engines register: $*" FAIL
  return 1
}
count() { local n; n=$(grep -c "$2" "$LOG/$1.log" 2>/dev/null); echo "${n:-0}"; }
trainer() {  # log name, time limit, flags
  local name="$1" limit="$2"; shift 2
  timeout "$limit" "$BIN/weightsync_gpu_trainer" --target="unix:$sock" --device=$DEV_T --backend=$BACKEND "$@" \
    >"$LOG/$name.log" 2>&1
}

# ---------------------------------------------------------------- (a) (b)
M=demo
start_daemon receipts --finish_timeout_ms=20000
engine plain --model=$M --layout=plain --dtype=bfloat16 --ckpt_dtype=float32 --device=$DEV_D
engine tp0 --model=$M --layout=tp --tp_rank=0 --tp_size=2 --dtype=bfloat16 --ckpt_dtype=float32 --device=0
engine tp1 --model=$M --layout=tp --tp_rank=1 --tp_size=2 --dtype=float16 --ckpt_dtype=float32 --device=$DEV_D
wait_registered plain tp0 tp1
sleep 0.5
trainer trainer-receipts 120 --model=$M --dtype=float32 --updates=3 --chunk_mib=16 \
  --receipts --finish_timeout_ms=60000 --update_timeout_s=60
trc=$?
r=$(count trainer-receipts 'receipts ok (3 engines)')
v=$(( $(count plain 'verified') + $(count tp0 'verified') + $(count tp1 'verified') ))
if [ $trc = 0 ] && [ "$r" = 3 ] && [ "$v" = 9 ]; then
  record "(a) 3 $B updates, receipts ON: trainer checks 3x3, engines 9/9" PASS
else record "(a) 3 $B updates, receipts ON [receipts $r/3, engines $v/9, rc $trc]" FAIL; fi

trainer trainer-corrupt 60 --model=$M --dtype=float32 --updates=1 --first_version=4 --chunk_mib=16 \
  --receipts --corrupt_version=4 --finish_timeout_ms=60000 --update_timeout_s=50
trc=$?
named=$(grep -o "DATA_LOSS: engine '[^']*'" "$LOG/trainer-corrupt.log" | head -1)
if [ $trc = 5 ] && [ -n "$named" ]; then
  record "(b) one corrupted byte -> ${named}" PASS
else record "(b) one corrupted byte -> DATA_LOSS naming an engine [rc $trc]" FAIL; fi
mism=$(( $(count plain 'version 4: MISMATCH') + $(count tp0 'version 4: MISMATCH') + $(count tp1 'version 4: MISMATCH') ))
record "    (engines' own check of v4: $mism engine(s) report MISMATCH)" info
trainer trainer-after-corrupt 60 --model=$M --dtype=float32 --updates=1 --first_version=5 --chunk_mib=16 \
  --receipts --finish_timeout_ms=60000 --update_timeout_s=50
trc=$?
if [ $trc = 0 ] && [ "$(count trainer-after-corrupt 'receipts ok (3 engines)')" = 1 ]; then
  record "(b) next clean update v5: receipts ok on 3 engines" PASS
else record "(b) next clean update v5: receipts ok [rc $trc]" FAIL; fi
stop_all

# ---------------------------------------------------------------- (c)
start_daemon staged --finish_timeout_ms=20000 --gpu_staging_budget_bytes=$((2<<30))
engine reader --model=$M --layout=plain --dtype=bfloat16 --ckpt_dtype=bfloat16 --device=$DEV_D --read_loop
wait_registered reader
sleep 1
trainer trainer-staged 150 --model=$M --dtype=bfloat16 --updates=5 --chunk_mib=16 \
  --mode=staged --finish_timeout_ms=60000 --update_timeout_s=60
trc=$?
st=$(grep -c "mode staged" "$LOG/trainer-staged.log")
vs=$(count reader 'verified')
if [ $trc = 0 ] && [ "$st" = 5 ] && [ "$vs" = 5 ]; then
  record "(c) 5 staged $B updates, engine bit-exact after each" PASS
else record "(c) 5 staged $B updates [staged $st/5, verified $vs/5, rc $trc]" FAIL; fi
# One staged update with receipts as well (they run inside the commit pause).
trainer trainer-staged-receipts 60 --model=$M --dtype=bfloat16 --updates=1 --first_version=6 \
  --chunk_mib=16 --mode=staged --receipts --finish_timeout_ms=60000 --update_timeout_s=50
trc=$?
if [ $trc = 0 ] && [ "$(count trainer-staged-receipts 'receipts ok (1 engines)')" = 1 ]; then
  record "(c) staged update v6 with receipts: receipts ok" PASS
else record "(c) staged update v6 with receipts [rc $trc]" FAIL; fi
# The trainer dies mid-transfer: Finish fails, the engine is untouched.
trainer trainer-staged-dies 60 --model=$M --dtype=bfloat16 --updates=1 --first_version=7 \
  --chunk_mib=16 --mode=staged --die_after_chunks=3 $DIE_RING
trainer finish-staged-dies 60 --finish_only=update-7 --finish_timeout_ms=30000
if grep -q "ABORTED" "$LOG/finish-staged-dies.log" && grep -q "engines untouched" "$LOG/finish-staged-dies.log" \
   && grep -q "engine reader: ENGINE_READY, version 6" "$LOG/finish-staged-dies.log"; then
  record "(c) trainer dies mid-staged-transfer: ABORTED, engine READY at v6" PASS
else record "(c) trainer dies mid-staged-transfer: ABORTED, engine untouched" FAIL; fi
trainer trainer-staged-after 90 --model=$M --dtype=bfloat16 --updates=1 --first_version=7 \
  --chunk_mib=16 --mode=staged --finish_timeout_ms=60000 --update_timeout_s=60
trc=$?
if [ $trc = 0 ] && [ "$(count reader 'version 7: verified')" = 1 ]; then
  record "(c) after it: re-init + staged update v7 verified" PASS
else record "(c) after it: re-init + staged update v7 verified [rc $trc]" FAIL; fi
stop_all   # the reader prints its final counts on SIGTERM
final=$(grep "read_loop final" "$LOG/reader.log" | tail -1)
mixed=$(echo "$final" | sed -n 's/.*mixed \([0-9]*\).*/\1/p')
nver=$(echo "$final" | grep -o "v[0-9]*=[0-9]*" | wc -l)
if [ -n "$mixed" ] && [ "$mixed" = 0 ] && [ "$nver" -ge 3 ] && [ "$(count reader MIXED)" = 0 ]; then
  record "(c) read loop during staged updates: only whole versions" PASS
else record "(c) read loop during staged updates: only whole versions [$final]" FAIL; fi
record "    ${final#*] }" info
# Staging budget: 64 MiB can't hold the demo model.
start_daemon budget --finish_timeout_ms=20000 --gpu_staging_budget_bytes=$((64<<20))
engine reader2 --model=$M --layout=plain --dtype=bfloat16 --ckpt_dtype=bfloat16 --device=$DEV_D
wait_registered reader2
trainer trainer-over-budget 60 --model=$M --dtype=bfloat16 --updates=1 --chunk_mib=16 --mode=staged
if grep -q "start failed: RESOURCE_EXHAUSTED" "$LOG/trainer-over-budget.log"; then
  record "(c) over the GPU staging budget: RESOURCE_EXHAUSTED at Start" PASS
else record "(c) over the GPU staging budget: RESOURCE_EXHAUSTED at Start" FAIL; fi
trainer trainer-fallback 60 --model=$M --dtype=bfloat16 --updates=1 --chunk_mib=16 --mode=staged \
  --allow_streaming_fallback --finish_timeout_ms=60000 --update_timeout_s=50
trc=$?
if [ $trc = 0 ] && grep -q "mode streaming" "$LOG/trainer-fallback.log" \
   && [ "$(count reader2 'version 1: verified')" = 1 ]; then
  record "(c) ... with allow_streaming_fallback: streamed, verified" PASS
else record "(c) ... with allow_streaming_fallback: streamed, verified [rc $trc]" FAIL; fi
stop_all

# ---------------------------------------------------------------- (e)
start_daemon sparse --finish_timeout_ms=20000
for e in "plain --layout=plain --dtype=bfloat16 --device=$DEV_D" \
         "tp0 --layout=tp --tp_rank=0 --tp_size=2 --dtype=bfloat16 --device=0" \
         "tp1 --layout=tp --tp_rank=1 --tp_size=2 --dtype=float16 --device=$DEV_D"; do
  # shellcheck disable=SC2086
  engine sp-$e --model=$M --ckpt_dtype=float32 --verify=false --hash
done
wait_registered sp-plain sp-tp0 sp-tp1
sleep 0.5
# Steps: 0.1% (v2 sparse, v3 dense), 1% (v4, v5), 10% (v6, v7), 1% with a
# bad index, staged (v8 refused, v9 dense), 1% staged (v10, v11).
trainer trainer-sparse 150 --model=$M --dtype=float32 --updates=1 --chunk_mib=16 \
  --sparse_densities=0.001,0.01,0.1,0.01,0.01 --sparse_staged_steps=3,4 --sparse_corrupt_step=3 \
  --finish_timeout_ms=60000 --update_timeout_s=120
trc=$?
hash_of() { sed -n "s/.*version $2 hash \([0-9a-f]*\).*/\1/p" "$LOG/$1.log" | tail -1; }
for pair in "0.1% 1 2 3" "1% 3 4 5" "10% 5 6 7" "1% staged 9 10 11"; do
  set -- $pair
  label="$1"; [ "$2" = staged ] && { label="$1 staged"; shift; }
  ok=1; detail=""
  for e in sp-plain sp-tp0 sp-tp1; do
    before=$(hash_of $e "$2"); sparse=$(hash_of $e "$3"); dense=$(hash_of $e "$4")
    if [ -z "$sparse" ] || [ "$sparse" != "$dense" ] || [ "$sparse" = "$before" ]; then
      ok=0; detail="$detail $e:[$before $sparse $dense]"
    fi
  done
  if [ $trc = 0 ] && [ $ok = 1 ]; then
    record "(e) sparse $label: v$3 (patch) == v$4 (dense) != v$2 on 3 engines" PASS
  else record "(e) sparse $label: patch == dense on 3 engines [rc $trc$detail]" FAIL; fi
done
grep "sparse step:" "$LOG/trainer-sparse.log" | sed 's/.*sparse step: /    /' | cut -c1-110 | while read -r l; do record "    $l" info; done
if grep -q "refused: .*sparse index" "$LOG/trainer-sparse.log" \
   && grep -q "engines untouched" "$LOG/trainer-sparse.log" \
   && [ "$(grep -c 'ENGINE_READY, version 7' "$LOG/trainer-sparse.log")" = 3 ]; then
  record "(e) bad index, staged: refused naming the tensor, 3 engines READY at v7" PASS
else record "(e) bad index, staged: refused, engines untouched" FAIL; fi
stop_all

# ---------------------------------------------------------------- (d)
# BENCH_MEMORY: how the engine shares its memory (vmm or ipc).
MEM="${BENCH_MEMORY:-vmm}"
start_daemon bench --finish_timeout_ms=60000 --gpu_staging_budget_bytes=$((24<<30))
engine bench --model=qwen3-8b --layout=plain --dtype=bfloat16 --ckpt_dtype=bfloat16 --device=$DEV_D \
  --verify=false --time_copy --memory="$MEM"
wait_registered bench
trainer bench-staged 150 --model=qwen3-8b --dtype=bfloat16 --updates=6 --same_data --chunk_mib=1024 \
  --mode=staged --finish_timeout_ms=120000 --update_timeout_s=120 \
  || record "(d) staged benchmark ran" FAIL
trainer bench-receipts 150 --model=qwen3-8b --dtype=bfloat16 --updates=6 --first_version=11 --same_data \
  --chunk_mib=1024 --receipts --check_receipts=false --finish_timeout_ms=120000 --update_timeout_s=120 \
  || record "(d) receipts benchmark ran" FAIL
# The same updates without receipts: their cost is the difference.
trainer bench-plain 150 --model=qwen3-8b --dtype=bfloat16 --updates=6 --first_version=21 --same_data \
  --chunk_mib=1024 --finish_timeout_ms=120000 --update_timeout_s=120 \
  || record "(d) streaming (no receipts) benchmark ran" FAIL
# Sparse at 1%: four steps, each a sparse update and the same weights dense,
# each after 200 ms idle (the sparse one used to follow seconds of trainer
# work while the dense one followed it at once: cold against warm calls).
# On NCCL the patches travel in 64 MiB chunks (SPARSE_CHUNK_MIB), so that
# the daemon applies chunk k while chunk k+1 is on the wire; the dense
# updates keep 1 GiB chunks. IPC copies from the trainer's buffer: no wire.
SPARSE_CHUNK_MIB=${SPARSE_CHUNK_MIB:-$([ "$BACKEND" = nccl ] && echo 64 || echo 1024)}
trainer bench-sparse 240 --model=qwen3-8b --dtype=bfloat16 --updates=1 --first_version=31 \
  --chunk_mib=1024 --sparse_chunk_mib="$SPARSE_CHUNK_MIB" --settle_ms=200 --sparse_densities=0.01,0.01,0.01,0.01 \
  --finish_timeout_ms=120000 --update_timeout_s=200 \
  || record "(d) sparse benchmark ran" FAIL
stop_all

figures=$(timeout 60 python3 - "$LOG" "${COMMIT:-unknown}" "${KIND:-unknown}" "$MEM" "$BACKEND" "$SPARSE_CHUNK_MIB" <<'PY'
import json, re, sys, datetime, statistics, os
log, commit, kind, mem, backend = sys.argv[1:6]
sparse_chunk_bytes = int(sys.argv[6]) << 20
def read(name):
    try:
        return open(os.path.join(log, name + ".log")).read()
    except OSError:
        return ""
pat = re.compile(r"update v\d+: \d+ tensors, ([0-9.]+) MB, .* device ([0-9.]+) commit [0-9.]+; "
                 r"receipts [0-9.]+; mode (\w+) pause_seconds ([0-9.]+) receipts_s ([0-9.]+) seconds ([0-9.]+) bytes (\d+)")
def rows(name):  # the first update warms up: dropped
    return [dict(mb=float(m[0]), device_s=float(m[1]) / 1e3, mode=m[2], pause_s=float(m[3]),
                 receipts_s=float(m[4]), seconds=float(m[5]), bytes=int(m[6]))
            for m in pat.findall(read(name))][1:]
base = re.search(r"copy baseline: (\d+) bytes, ([0-9.]+) s", read("bench"))
today = datetime.date.today().isoformat()
out = []
staged, rec, plain = rows("bench-staged"), rows("bench-receipts"), rows("bench-plain")
if staged and base:
    nbytes = staged[0]["bytes"]
    copy_s = float(base.group(2))
    pause = statistics.median(r["pause_s"] for r in staged)
    r = {"date": today, "kind": kind, "commit": commit, "model": "qwen3-8b", "bytes": nbytes,
         "engine_memory": mem, "chunk_bytes": 1 << 30, "backend": backend,
         "baseline": "plain on-GPU copy (cudaMemcpy D2D) of the engine's parameter bytes on the engine's GPU",
         "copy_s": copy_s, "copy_bytes": int(base.group(1)),
         "pause_s_median": pause, "pause_over_copy": pause / copy_s, "goal_pause_over_copy": 1.5,
         "commit_device_s_median": statistics.median(r["device_s"] for r in staged),
         "update_s_median": statistics.median(r["seconds"] for r in staged),
         "streaming_pause_s_median": statistics.median(r["pause_s"] for r in plain) if plain else None,
         "samples_pause_s": [r["pause_s"] for r in staged], "modes": sorted({r["mode"] for r in staged})}
    json.dump(r, open(os.path.join(log, "staged.json"), "w"), indent=2)
    out.append(f"STAGED qwen3-8b bf16 ({mem}): pause {pause*1e3:.2f} ms (commit on GPU {r['commit_device_s_median']*1e3:.2f} ms) "
               f"vs on-GPU copy {copy_s*1e3:.2f} ms: {pause/copy_s:.2f}x (goal <= 1.5x); update {r['update_s_median']:.3f} s"
               + (f"; streaming pause {r['streaming_pause_s_median']*1e3:.1f} ms" if plain else ""))
else:
    out.append("STAGED: no figures")
if rec and plain:
    nbytes = rec[0]["bytes"]
    with_s = statistics.median(r["seconds"] for r in rec)
    without_s = statistics.median(r["seconds"] for r in plain)
    frac = (with_s - without_s) / with_s
    r = {"date": today, "kind": kind, "commit": commit, "model": "qwen3-8b", "bytes": nbytes,
         "engine_memory": mem, "chunk_bytes": 1 << 30, "mode": "streaming, " + backend,
         "method": "receipts are summed on the GPU chunk by chunk as the update goes; their cost is "
                   "the median update time with VERIFY_ON minus the median without (same daemon, same run)",
         "update_s_median": with_s, "update_s_median_without_receipts": without_s,
         "receipts_fraction": frac, "goal_fraction": 0.05,
         "receipts_s_median_after_drain": statistics.median(r["receipts_s"] for r in rec),
         "samples_s": [r["seconds"] for r in rec], "samples_s_without": [r["seconds"] for r in plain]}
    json.dump(r, open(os.path.join(log, "receipts.json"), "w"), indent=2)
    out.append(f"RECEIPTS qwen3-8b bf16: update {with_s*1e3:.2f} ms with, {without_s*1e3:.2f} ms without: "
               f"{frac*100:.2f}% (goal <= 5%)")
else:
    out.append("RECEIPTS: no figures")
sp = re.compile(r"sparse step: density ([0-9.e-]+) mode (\w+) sparse v\d+ dense v\d+: (\d+) of (\d+) tensors sparse, "
                r"nnz (\d+), bytes (\d+) of (\d+) \([0-9.]+%\), sparse_s ([0-9.]+) dense_s ([0-9.]+) \([0-9.]+%\), "
                r"diff_pack_s ([0-9.]+) .* sparse_device_s ([0-9.]+) dense_device_s ([0-9.]+)")
steps = [dict(density=float(m[0]), sparse_tensors=int(m[2]), tensors=int(m[3]), nnz=int(m[4]),
              sparse_bytes=int(m[5]), dense_bytes=int(m[6]), sparse_s=float(m[7]), dense_s=float(m[8]),
              diff_pack_s=float(m[9]), sparse_device_s=float(m[10]), dense_device_s=float(m[11]))
         for m in sp.findall(read("bench-sparse"))][1:]  # the first step warms up
# Where each update's time went (ms), when the trainer printed it.
bd = re.compile(r"sparse ms: start ([0-9.]+) \(validate ([0-9.]+) pause ([0-9.]+) begin ([0-9.]+)\) "
                r"transfer ([0-9.]+) device ([0-9.]+) commit ([0-9.]+); dense ms: start ([0-9.]+) "
                r"\(validate ([0-9.]+) pause ([0-9.]+) begin ([0-9.]+)\) transfer ([0-9.]+) device ([0-9.]+) "
                r"commit ([0-9.]+)")
keys = ["start", "validate", "pause", "begin", "transfer", "device", "commit"]
for s, m in zip(steps, bd.findall(read("bench-sparse"))[1:]):
    s["sparse_ms"] = dict(zip(keys, map(float, m[:7])))
    s["dense_ms"] = dict(zip(keys, map(float, m[7:])))
if steps:
    med = lambda k: statistics.median(s[k] for s in steps)
    bytes_frac = med("sparse_bytes") / med("dense_bytes")
    time_frac = statistics.median(s["sparse_s"] / s["dense_s"] for s in steps)
    with_diff = statistics.median((s["sparse_s"] + s["diff_pack_s"]) / s["dense_s"] for s in steps)
    r = {"date": today, "kind": kind, "commit": commit, "model": "qwen3-8b", "checkpoint_dtype": "bfloat16",
         "engine": "plain bfloat16, " + mem, "chunk_bytes": 1 << 30, "sparse_chunk_bytes": sparse_chunk_bytes,
         "settle_ms": 200,
         "backend": backend + ", streaming", "density": steps[0]["density"], "index_bytes": 4,
         "baseline": "the dense update of the same weights, sent right after each sparse one (same run)",
         "sparse_bytes_median": med("sparse_bytes"), "dense_bytes": steps[0]["dense_bytes"],
         "bytes_fraction": bytes_frac, "goal_bytes_fraction": 0.03,
         "sparse_s_median": med("sparse_s"), "dense_s_median": med("dense_s"),
         "time_fraction": time_frac, "goal_time_fraction": 0.10,
         "trainer_diff_pack_s_median": med("diff_pack_s"), "time_fraction_with_trainer_diff": with_diff,
         "sparse_device_s_median": med("sparse_device_s"), "dense_device_s_median": med("dense_device_s"),
         "sparse_tensors": steps[0]["sparse_tensors"], "tensors": steps[0]["tensors"], "steps": steps}
    if all("sparse_ms" in s for s in steps):
        r["sparse_ms_median"] = {k: statistics.median(s["sparse_ms"][k] for s in steps) for k in keys}
        r["dense_ms_median"] = {k: statistics.median(s["dense_ms"][k] for s in steps) for k in keys}
        out.append("SPARSE breakdown, ms (sparse / dense): " + ", ".join(
            f"{k} {r['sparse_ms_median'][k]:.2f} / {r['dense_ms_median'][k]:.2f}" for k in keys))
    json.dump(r, open(os.path.join(log, "sparse.json"), "w"), indent=2)
    out.append(f"SPARSE qwen3-8b bf16 1%: {r['sparse_bytes_median']/1e6:.1f} MB of {r['dense_bytes']/1e6:.1f} MB "
               f"= {bytes_frac*100:.2f}% (goal <= 3%); {r['sparse_s_median']*1e3:.2f} ms vs dense "
               f"{r['dense_s_median']*1e3:.2f} ms = {time_frac*100:.2f}% (goal <= 10%); with the trainer's GPU diff "
               f"+ pack ({r['trainer_diff_pack_s_median']*1e3:.2f} ms) {with_diff*100:.2f}%")
else:
    out.append("SPARSE: no figures")
print("\n".join(out))
PY
)
if [ -s "$LOG/staged.json" ]; then record "(d) staged benchmark figures (staged.json)" PASS
else record "(d) staged benchmark figures (staged.json)" FAIL; fi
if [ -s "$LOG/receipts.json" ]; then record "(d) receipts benchmark figures (receipts.json)" PASS
else record "(d) receipts benchmark figures (receipts.json)" FAIL; fi
if [ -s "$LOG/sparse.json" ]; then record "(d) sparse benchmark figures (sparse.json)" PASS
else record "(d) sparse benchmark figures (sparse.json)" FAIL; fi

echo
echo "$figures"
echo
echo "=== issue 5 GPU checks ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l), $(date -u +%F), commit ${COMMIT:-unknown}, $(( $(date +%s) - T0 )) s) ==="
printf '%s\n' "${results[@]}"
! printf '%s\n' "${results[@]}" | grep -q "FAIL$\|FAIL "
