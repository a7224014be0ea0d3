#!/usr/bin/env bash
# End to end on the host backend: the real weightsyncd binary, three
# separate engine processes and a trainer process over a Unix socket. The
# trainer compares every engine byte with what it sent after each update.
# Then an engine is killed (SIGKILL) and the next update still lands on the
# others; two more daemons join and one trainer updates all three
# (weightsync_trainer --target=a,b,c); finally SIGTERM stops the daemon
# cleanly.
set -euo pipefail
root="${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-weightsync}"
daemon="$root/daemon/weightsyncd"
engine="$root/tools/weightsync_engine"
trainer="$root/tools/weightsync_trainer"
dir="$(mktemp -d /tmp/ws-e2e.XXXXXX)"
sock="$dir/d.sock"
tag="e2e$$r$RANDOM"  # unique also across pid namespaces (sandboxes share /dev/shm)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -rf "$dir"
  rm -f /dev/shm/weightsync-"$tag"-* 2>/dev/null || true
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$dir"/*.log; do echo "--- $f"; tail -n 20 "$f"; done; exit 1; }

timeout 120 "$daemon" --socket="$sock" --chunk_bytes=65536 >"$dir/daemon.log" 2>&1 &
dpid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || fail "daemon did not start"

start_engine() {  # id, extra flags...
  local id="$1"; shift
  "$engine" --target="unix:$sock" --model=tiny --engine_id="$tag-$id" "$@" \
    >"$dir/$id.log" 2>&1 &
  pids+=($!)
}
start_engine plain --layout=plain --dtype=bfloat16
start_engine tp0 --layout=tp --tp_rank=0 --tp_size=2 --dtype=float16
start_engine tp1 --layout=tp --tp_rank=1 --tp_size=2 --dtype=float32
for _ in $(seq 100); do
  [ "$(grep -l registered "$dir"/plain.log "$dir"/tp0.log "$dir"/tp1.log 2>/dev/null | wc -l)" = 3 ] && break
  sleep 0.1
done
sleep 0.3

verify="$tag-plain:plain:bfloat16,$tag-tp0:tp:0:2:float16,$tag-tp1:tp:1:2:float32"
# Receipts turned off (VERIFY_OFF): the engines' own check only.
timeout 60 "$trainer" --target="unix:$sock" --model=tiny --updates=3 --receipts=false \
  --verify="$verify" >"$dir/trainer.log" 2>&1 || fail "trainer failed"
cat "$dir/trainer.log"
[ "$(grep -c ' engines: verified$' "$dir/trainer.log")" = 3 ] || fail "not 3 verified updates"
# Receipts, on by default: the daemon's checksums of what it installed
# match what the trainer computes from what it sent, through every
# engine's layout.
timeout 60 "$trainer" --target="unix:$sock" --model=tiny --updates=1 --first_version=4 \
  --verify="$verify" >"$dir/trainer_receipts.log" 2>&1 || fail "receipts update failed"
grep -q "receipts ok, verified" "$dir/trainer_receipts.log" || fail "no receipts"
for id in plain tp0 tp1; do
  grep -q "now serving version 3" "$dir/$id.log" || fail "$id did not see version 3"
done

# An engine dies without a word; the next update lands on the others.
kill -KILL "${pids[0]}"
sleep 0.5
timeout 60 "$trainer" --target="unix:$sock" --model=tiny --updates=1 --first_version=5 \
  --verify="$tag-tp0:tp:0:2:float16,$tag-tp1:tp:1:2:float32" >"$dir/trainer2.log" 2>&1 \
  || fail "update after engine death failed"
grep -q "update v5: .* 2 engines: receipts ok, verified" "$dir/trainer2.log" || fail "v5 not verified on 2 engines"

# A bad update is refused with the culprit's name and the daemon serves on.
if timeout 60 "$trainer" --target="unix:$sock" --model=tiny --updates=1 --first_version=2 \
  >"$dir/trainer3.log" 2>&1; then fail "version going back was accepted"; fi
grep -q "FAILED_PRECONDITION.*version 5" "$dir/trainer3.log" || fail "no clear version error"

# Several daemons, one update (issue 20): two more daemons with a replica
# each; the trainer sends versions 6 and 7 to all three, committed on all.
for d in 2 3; do
  timeout 120 "$daemon" --socket="$dir/d$d.sock" --chunk_bytes=65536 >"$dir/daemon$d.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 100); do [ -S "$dir/d2.sock" ] && [ -S "$dir/d3.sock" ] && break; sleep 0.1; done
for d in 2 3; do
  "$engine" --target="unix:$dir/d$d.sock" --model=tiny --engine_id="$tag-r$d" --layout=plain \
    --dtype=bfloat16 >"$dir/r$d.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 100); do
  [ "$(grep -l registered "$dir"/r2.log "$dir"/r3.log 2>/dev/null | wc -l)" = 2 ] && break
  sleep 0.1
done
sleep 0.3
timeout 60 "$trainer" --target="unix:$sock,unix:$dir/d2.sock,unix:$dir/d3.sock" --model=tiny \
  --updates=2 --first_version=6 \
  --verify="$tag-tp0:tp:0:2:float16,$tag-tp1:tp:1:2:float32,$tag-r2:plain:bfloat16,$tag-r3:plain:bfloat16" \
  >"$dir/trainer_multi.log" 2>&1 || fail "update of three daemons failed"
cat "$dir/trainer_multi.log"
[ "$(grep -c ' 4 engines: receipts ok, verified$' "$dir/trainer_multi.log")" = 2 ] \
  || fail "not 2 verified updates of 4 engines behind 3 daemons"

# SIGTERM: clean exit, socket removed.
kill -TERM "$dpid"
wait "$dpid" || fail "daemon exited with $?"
[ ! -e "$sock" ] || fail "socket left behind"
grep -q "weightsyncd stopped" "$dir/daemon.log" || fail "no clean stop"
echo "PASS"
