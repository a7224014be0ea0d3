#!/usr/bin/env bash
# Builds what a release ships (the daemon, weightsyncctl, the health probe
# and, where CUDA is configured, the GPU worker) with bazel and prints their
# paths, one per line. Used by tools/build_deb.sh and
# deploy/container/stage.sh when they are given no binaries.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
targets=(//daemon:weightsyncd //tools:weightsyncctl //tools:weightsync_health)
bazel query //backends/cuda:weightsync_gpu_worker >/dev/null 2>&1 &&
  targets+=(//backends/cuda:weightsync_gpu_worker)
bazel build "${targets[@]}" >&2
bazel_bin=$(bazel info bazel-bin 2>/dev/null)
printf '%s\n' "$bazel_bin/daemon/weightsyncd" "$bazel_bin/tools/weightsyncctl" \
  "$bazel_bin/tools/weightsync_health"
if [ -x "$bazel_bin/backends/cuda/weightsync_gpu_worker" ]; then
  echo "$bazel_bin/backends/cuda/weightsync_gpu_worker"
fi
