#!/usr/bin/env bash
# FP8 targets end to end with the C++ tools (docs/protocol.md, "FP8
# targets"): the real weightsyncd, three engine processes holding FP8
# engines of the tiny synthetic model (weightsync_engine --fp8: plain e4m3
# in 16 x 16 blocks, a TP=2 pair of e4m3 in 16 x 16 blocks, plain e5m2 with
# one scale per row; norms, embeddings and lm_head bfloat16) and trainer
# processes sending bfloat16, float32 and float16 checkpoints in chunks
# that cut blocks. After every update the trainer reads each engine's
# memory and compares every byte, FP8 weights and scales included, with
# the reference quantisation (tools/synthetic/fp8_layout.h), and checks the
# receipts of every engine (client/fp8_receipts.h).
set -euo pipefail
root="${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-weightsync}"
daemon="$root/daemon/weightsyncd"
engine="$root/tools/weightsync_engine"
trainer="$root/tools/weightsync_trainer"
dir="$(mktemp -d /tmp/ws-fp8e2e.XXXXXX)"
sock="$dir/d.sock"
tag="fp8e2e$$r$RANDOM"  # unique also across pid namespaces
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -rf "$dir"
  rm -f /dev/shm/weightsync-"$tag"-* 2>/dev/null || true
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$dir"/*.log; do echo "--- $f"; tail -n 20 "$f"; done; exit 1; }

timeout 120 "$daemon" --socket="$sock" >"$dir/daemon.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || fail "daemon did not start"

start_engine() {  # id, extra flags...
  local id="$1"; shift
  "$engine" --target="unix:$sock" --model=tiny --engine_id="$tag-$id" --dtype=bfloat16 "$@" \
    >"$dir/$id.log" 2>&1 &
  pids+=($!)
}
start_engine plain --layout=plain --fp8=e4m3fn --fp8_block=16
start_engine tp0 --layout=tp --tp_rank=0 --tp_size=2 --fp8=e4m3fn --fp8_block=16
start_engine tp1 --layout=tp --tp_rank=1 --tp_size=2 --fp8=e4m3fn --fp8_block=16
start_engine row --layout=plain --fp8=e5m2 --fp8_block=0
for _ in $(seq 100); do
  [ "$(grep -l registered "$dir"/{plain,tp0,tp1,row}.log 2>/dev/null | wc -l)" = 4 ] && break
  sleep 0.1
done
[ "$(grep -l registered "$dir"/{plain,tp0,tp1,row}.log 2>/dev/null | wc -l)" = 4 ] \
  || fail "engines did not register"
sleep 0.3

e4m3="$tag-plain:plain:bfloat16,$tag-tp0:tp:0:2:bfloat16,$tag-tp1:tp:1:2:bfloat16"
run() {  # log name, flags...
  local log="$1"; shift
  timeout 60 "$trainer" --target="unix:$sock" --model=tiny "$@" >"$dir/$log.log" 2>&1 \
    || fail "trainer $log failed"
  cat "$dir/$log.log"
}
# bfloat16 checkpoints (what RL trainers hold), 1 KiB chunks: a 16-row
# block of bfloat16 rows of 64 is 2 KiB, so every block spans chunks.
run bf16 --dtype=bfloat16 --updates=2 --chunk_bytes=1024 --verify="$e4m3" \
  --verify_fp8=e4m3fn --verify_fp8_block=16
[ "$(grep -c ' 4 engines: receipts ok, verified$' "$dir/bf16.log")" = 2 ] || fail "bf16"
# float32 into the per-row e5m2 engine (and the others, by receipts).
run f32 --dtype=float32 --updates=1 --first_version=3 --chunk_bytes=2816 \
  --verify="$tag-row:plain:bfloat16" --verify_fp8=e5m2 --verify_fp8_block=0
grep -q "update v3: .* 4 engines: receipts ok, verified" "$dir/f32.log" || fail "f32"
# float16, back to the e4m3 engines.
run f16 --dtype=float16 --updates=1 --first_version=4 --verify="$e4m3" \
  --verify_fp8=e4m3fn --verify_fp8_block=16
grep -q "update v4: .* 4 engines: receipts ok, verified" "$dir/f16.log" || fail "f16"
for id in plain tp0 tp1 row; do
  grep -q "now serving version 4" "$dir/$id.log" || fail "$id did not see version 4"
done
# A TP=2 layout in 128 x 128 blocks cuts blocks: the helper refuses it.
if "$engine" --target="unix:$sock" --model=tiny --engine_id="$tag-bad" --layout=tp \
  --tp_rank=0 --tp_size=2 --fp8=e4m3fn >"$dir/bad.log" 2>&1; then
  fail "a layout cutting blocks was registered"
fi
grep -q "cuts a 128 x 128 block" "$dir/bad.log" || fail "no clear refusal"
echo "PASS"
