#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, clang) and runs each from an
# empty corpus: bash tools/run_fuzzers.sh [SEED=1] [SCALE=1] [SECONDS]
# Each runs its base number of inputs (about 30 s each on a 2-core VM)
# times SCALE, or, with SECONDS, for that long. Prints one
# line per fuzzer (runs, seconds, coverage, corpus); exits non-zero on the
# first finding, leaving the crashing input in the working directory.
set -euo pipefail
cd "$(dirname "$0")/.."
SEED="${1:-1}" SCALE="${2:-1}" SECS="${3:-}"
FUZZERS=(update_fuzzer proto_fuzzer)
declare -A BASE_RUNS=([update_fuzzer]=300000 [proto_fuzzer]=3000000)
bazel build --config=fuzz "${FUZZERS[@]/#///tests/fuzz:}"
for f in "${FUZZERS[@]}"; do
  corpus="$(mktemp -d /tmp/ws-fuzz.XXXXXX)"
  limit=(-runs=$(( BASE_RUNS[$f] * SCALE ))); [ -n "$SECS" ] && limit=(-max_total_time="$SECS")
  t0=$(date +%s)
  if ! "bazel-bin/tests/fuzz/$f" -seed="$SEED" "${limit[@]}" -rss_limit_mb=2048 \
       -timeout=10 -print_final_stats=1 "$corpus" > "$corpus.log" 2>&1; then
    tail -n 40 "$corpus.log"
    echo "FUZZ FINDING: $f (seed $SEED); input above and in ./crash-* / ./oom-* / ./timeout-*" >&2
    exit 1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$corpus.log")
  cov=$(grep -o 'cov: [0-9]*' "$corpus.log" | tail -1)
  echo "fuzz $f: $runs runs in $(( $(date +%s) - t0 )) s, seed $SEED, $cov, corpus $(ls "$corpus" | wc -l) inputs, no findings"
  rm -rf "$corpus" "$corpus.log"
done
