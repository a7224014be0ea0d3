#!/usr/bin/env bash
# Host-backend benchmark, one command:
#   bash bench/run_host_bench.sh            (1 GiB update, chunk sweep)
# Builds the daemon and the benchmark, starts weightsyncd, runs the
# benchmark against it, and writes bench/results/host.json.
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build -c opt //daemon:weightsyncd //bench:host_bench >/dev/null
dir="$(mktemp -d /tmp/ws-bench.XXXXXX)"
trap 'kill -TERM $dpid 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"' EXIT
bazel-bin/daemon/weightsyncd --socket="$dir/d.sock" --staging_buffers=4 \
  2>"$dir/daemon.log" &
dpid=$!
for _ in $(seq 100); do [ -S "$dir/d.sock" ] && break; sleep 0.1; done
bazel-bin/bench/host_bench --target="unix:$dir/d.sock" \
  --json=bench/results/host.json "$@"
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(lscpu | sed -n 's/^Model name: *//p')"
echo "commit: $(git rev-parse --short HEAD), $(date -u +%F)"
