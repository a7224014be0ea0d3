#!/usr/bin/env bash
# The demo: weightsyncd plus three engine processes (one plain bfloat16
# engine fed float32, and a tensor-parallel pair with fused qkv/gate_up,
# row/column shards and padded vocab shards) and one trainer process that
# pushes three updates and verifies every engine byte after each.
# Run with `bazel run //tools:demo` (MODEL=tiny for a quick one).
set -euo pipefail
MODEL="${MODEL:-demo}"
here="$(pwd)"
bin() { echo "$here/$1"; }
dir="$(mktemp -d /tmp/weightsync-demo.XXXXXX)"
sock="$dir/weightsyncd.sock"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

echo "== weightsyncd on unix:$sock (model: $MODEL)"
"$(bin daemon/weightsyncd)" --socket="$sock" 2>"$dir/daemon.log" &
pids+=($!)
for i in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { cat "$dir/daemon.log"; exit 1; }

engine() {
  "$(bin tools/weightsync_engine)" --target="unix:$sock" --model="$MODEL" "$@" &
  pids+=($!)
}
tag="demo$$"
engine --engine_id="$tag-plain" --layout=plain --dtype=bfloat16
engine --engine_id="$tag-tp0" --layout=tp --tp_rank=0 --tp_size=2 --dtype=bfloat16
engine --engine_id="$tag-tp1" --layout=tp --tp_rank=1 --tp_size=2 --dtype=bfloat16
for i in $(seq 200); do
  n=$(grep -c "registered" "$dir/daemon.log" || true)
  [ "$n" -ge 3 ] && break; sleep 0.1
done
sleep 0.3  # control streams open

echo "== trainer: 3 updates, float32 checkpoint -> bfloat16 engines"
"$(bin tools/weightsync_trainer)" --target="unix:$sock" --model="$MODEL" \
  --updates=3 --dtype=float32 \
  --verify="$tag-plain:plain:bfloat16,$tag-tp0:tp:0:2:bfloat16,$tag-tp1:tp:1:2:bfloat16"
echo "== weightsyncctl status, and a receipt read back from the plain engine's memory"
"$(bin tools/weightsyncctl)" --socket="$sock" status
"$(bin tools/weightsyncctl)" --socket="$sock" check "$tag-plain"
echo "== daemon log (last lines)"
tail -n 6 "$dir/daemon.log"
