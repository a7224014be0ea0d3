#!/usr/bin/env bash
# A/B of the daemon waking its GPU worker at StartWeightUpdate (DataPlane::
# Warm, commit after 4299a74) on a GPU machine: bench/run_sparse_breakdown.sh
# run alternately with two daemons that differ only in that, the same
# worker, engine and trainer. Prints each run's breakdown, then the medians
# of Start's parts (ms) per daemon, over every update but each run's first.
#   bash bench/run_warm_ab.sh BIN_AFTER BIN_BEFORE LOG_DIR [ROUNDS=2]
# BIN_BEFORE needs only weightsyncd: the rest is taken from BIN_AFTER.
set -uo pipefail
AFTER="$(cd "$1" && pwd)"
BEFORE="$(cd "$2" && pwd)"
LOG="$3"
ROUNDS="${4:-2}"
HERE="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$LOG"
for f in "$AFTER"/*; do
  [ "$(basename "$f")" = weightsyncd ] || ln -sf "$f" "$BEFORE/" 2>/dev/null
done
for r in $(seq "$ROUNDS"); do
  for which in before after; do
    bin=$AFTER; [ "$which" = before ] && bin=$BEFORE
    out="$LOG/$which-$r.txt"
    # The last run's processes must be gone (their GPU memory with them).
    for _ in $(seq 60); do
      [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && break
      sleep 0.5
    done
    echo "### $which, round $r ($(nvidia-smi --query-gpu=memory.used --format=csv,noheader) in use before)"
    bash "$HERE/run_sparse_breakdown.sh" "$bin" "$LOG/$which-$r" 1024 >"$out" 2>&1
    cat "$out"
    if ! grep -q "trainer rc 0 ===" "$out"; then
      echo "--- trainer.log (tail)"; tail -20 "$LOG/$which-$r/trainer.log"
      echo "--- daemon.log (tail)"; tail -20 "$LOG/$which-$r/daemon.log"
      echo "--- engine.log (tail)"; tail -5 "$LOG/$which-$r/engine.log"
    fi
  done
done
python3 - "$LOG" "$ROUNDS" <<'PY'
import re, statistics, sys
log, rounds = sys.argv[1], int(sys.argv[2])
pat = re.compile(r"(sparse|dense) ms:\s+start ([\d.]+) \(validate ([\d.]+) pause ([\d.]+) begin ([\d.]+)\)")
for which in ("before", "after"):
    rows = {"sparse": [], "dense": []}
    for r in range(1, rounds + 1):
        got = {"sparse": [], "dense": []}
        for m in pat.finditer(open(f"{log}/{which}-{r}.txt").read()):
            got[m.group(1)].append([float(x) for x in m.groups()[1:]])
        for k in got:
            rows[k] += got[k][1:]  # each run's first update: cold process
    for k, v in rows.items():
        if not v:
            print(f"{which:6s} {k:6s}: no updates parsed"); continue
        med = [statistics.median(c) for c in zip(*v)]
        print(f"{which:6s} {k:6s} (n={len(v)}): start {med[0]:.2f} = validate {med[1]:.2f}"
              f" + pause {med[2]:.2f} + begin {med[3]:.2f} ms (medians)")
PY
