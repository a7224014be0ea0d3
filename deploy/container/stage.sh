#!/usr/bin/env bash
# Stages the weightsyncd container image's build context (docs/deploy.md#image):
#
#   OUT/Containerfile
#   OUT/weightsync_VERSION-REV_ARCH.deb   the Debian package (tools/build_deb.sh):
#                         the image installs it with apt, which brings the
#                         Debian packages it Depends on (gRPC, protobuf, ...)
#   OUT/rootfs/usr/local/cuda/lib64/...   CUDA runtime and NCCL, where the
#                         GPU worker's RUNPATH looks for them (not Debian's)
#
# then: docker build -t weightsyncd -f OUT/Containerfile OUT
#
# Usage: deploy/container/stage.sh OUT            bazel build, then stage
#        deploy/container/stage.sh OUT BINARY...  stage these binaries (by name:
#                                                 weightsyncd, weightsync_gpu_worker,
#                                                 weightsyncctl, weightsync_health)
# Run it on the Debian release the image is based on (bookworm): the
# package's Depends name this machine's packages. Without a GPU worker (a
# build without CUDA) the image serves the host backend only.
set -euo pipefail
out=${1:?usage: stage.sh OUT [BINARY...]}
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

bins=("$@")
[ ${#bins[@]} -gt 0 ] || mapfile -t bins < <(bash "$repo/tools/release_binaries.sh")
[ ${#bins[@]} -gt 0 ] || { echo "$0: no binaries (the bazel build failed?)" >&2; exit 1; }

if [ -r /etc/os-release ]; then
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  [ "$codename" = bookworm ] ||
    echo "stage.sh: warning: this is '$codename', the image is bookworm" >&2
fi

rm -rf "$out"
mkdir -p "$out/rootfs"
cp "$here/Containerfile" "$out/Containerfile"
deb=$(bash "$repo/tools/build_deb.sh" "$out" "${bins[@]}" | tail -n1)

# The GPU worker's CUDA runtime and NCCL: not in Debian, so not among the
# package's Depends; copied where the worker's RUNPATH finds them.
for bin in "${bins[@]}"; do
  [ "$(basename "$bin")" = weightsync_gpu_worker ] || continue
  while read -r lib path; do
    case "$path" in
      NOT-FOUND)
        echo "stage.sh: $lib (needed by $bin) not found" >&2; exit 1 ;;
      /usr/local/cuda*)
        mkdir -p "$out/rootfs/usr/local/cuda/lib64"
        cp -L "$path" "$out/rootfs/usr/local/cuda/lib64/$lib" ;;
    esac
  done < <(ldd "$bin" | awk '/=> \// {print $1, $3} / not found/ {print $1, "NOT-FOUND"}')
done
echo "staged $(basename "$deb") and $(ls "$out/rootfs/usr/local/cuda/lib64" 2>/dev/null |
  wc -l) CUDA libraries into $out; build with:"
echo "  docker build -t weightsyncd -f $out/Containerfile $out"
