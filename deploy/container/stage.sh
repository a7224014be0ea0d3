#!/usr/bin/env bash
# Stages the weightsyncd container image's build context (docs/deploy.md#image):
#
#   OUT/Containerfile
#   OUT/packages.txt      Debian packages holding every shared library the
#                         binaries need (found with ldd and dpkg -S here)
#   OUT/rootfs/opt/weightsync/bin/{weightsyncd,weightsync_gpu_worker,weightsync_health}
#   OUT/rootfs/opt/weightsync/doc/*.md
#   OUT/rootfs/usr/local/cuda/lib64/...   CUDA runtime and NCCL, where the
#                         GPU worker's RUNPATH looks for them
#
# then: docker build -t weightsyncd -f OUT/Containerfile OUT
#
# Usage: deploy/container/stage.sh OUT            bazel build -c opt, then stage
#        deploy/container/stage.sh OUT BINARY...  stage these binaries (by name:
#                                                 weightsyncd, weightsync_gpu_worker,
#                                                 weightsync_health)
# Run it on the Debian release the image is based on (bookworm): the package
# names in packages.txt are this machine's. Without a GPU worker (a build
# without CUDA) the image serves the host backend only.
set -euo pipefail
out=${1:?usage: stage.sh OUT [BINARY...]}
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

bins=("$@")
if [ ${#bins[@]} -eq 0 ]; then
  targets=(//daemon:weightsyncd //tools:weightsync_health)
  (cd "$repo" && bazel query //backends/cuda:weightsync_gpu_worker >/dev/null 2>&1) &&
    targets+=(//backends/cuda:weightsync_gpu_worker)
  (cd "$repo" && bazel build -c opt "${targets[@]}")
  bazel_bin=$(cd "$repo" && bazel info -c opt bazel-bin)
  bins=("$bazel_bin/daemon/weightsyncd" "$bazel_bin/tools/weightsync_health")
  [ -x "$bazel_bin/backends/cuda/weightsync_gpu_worker" ] &&
    bins+=("$bazel_bin/backends/cuda/weightsync_gpu_worker")
fi

if [ -r /etc/os-release ]; then
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  [ "$codename" = bookworm ] ||
    echo "stage.sh: warning: this is '$codename', the image is bookworm" >&2
fi

rm -rf "$out"
mkdir -p "$out/rootfs/opt/weightsync/bin" "$out/rootfs/opt/weightsync/doc"
cp "$here/Containerfile" "$out/Containerfile"
for doc in deploy operations security; do
  if [ -f "$repo/docs/$doc.md" ]; then
    cp "$repo/docs/$doc.md" "$out/rootfs/opt/weightsync/doc/"
  else
    echo "stage.sh: warning: docs/$doc.md not found; not in the image" >&2
  fi
done

# The package that owns a library file, trying the names merged /usr gives it.
package_of() {
  local p=$1 r
  r=$(readlink -f "$p")
  for c in "$p" "$r" "${r#/usr}" "/usr$p"; do
    dpkg -S "$c" 2>/dev/null | head -n1 | cut -d: -f1 && return 0
  done
  return 1
}

have_daemon=0
packages=()
for bin in "${bins[@]}"; do
  name=$(basename "$bin")
  case "$name" in
    weightsyncd) have_daemon=1 ;;
    weightsync_gpu_worker | weightsync_health) ;;
    *) echo "stage.sh: unexpected binary $bin" >&2; exit 2 ;;
  esac
  install -m 0755 "$bin" "$out/rootfs/opt/weightsync/bin/$name"
  while read -r lib path; do
    case "$path" in
      /usr/local/cuda*)
        # Not in Debian: copy it where the binary's RUNPATH finds it.
        mkdir -p "$out/rootfs/usr/local/cuda/lib64"
        cp -L "$path" "$out/rootfs/usr/local/cuda/lib64/$lib" ;;
      *)
        if ! pkg=$(package_of "$path") || [ -z "$pkg" ]; then
          echo "stage.sh: no Debian package holds $path ($lib, needed by $name)" >&2
          exit 1
        fi
        packages+=("$pkg") ;;
    esac
  done < <(ldd "$bin" | awk '/=> \// {print $1, $3} / not found/ {print $1, "NOT-FOUND"}')
done
[ "$have_daemon" = 1 ] || { echo "stage.sh: weightsyncd not given" >&2; exit 2; }
printf '%s\n' "${packages[@]}" | sort -u >"$out/packages.txt"
echo "staged $(ls "$out/rootfs/opt/weightsync/bin" | tr '\n' ' ')into $out;" \
  "$(wc -l <"$out/packages.txt") packages; build with:"
echo "  docker build -t weightsyncd -f $out/Containerfile $out"
