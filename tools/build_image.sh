#!/usr/bin/env bash
# Builds the weightsyncd container image without a registry or a container
# build daemon (docs/deploy.md#image; issue 34):
#
#   1. deploy/container/stage.sh stages the build context: the project's
#      .deb (tools/build_deb.sh) and, with a GPU worker, the CUDA libraries.
#   2. The base: Debian 12 from Debian's archive with mmdebstrap (minbase,
#      what debian:bookworm-slim is), plus the packages the .deb Depends on
#      and systemd-standalone-sysusers. It is cached as a tarball under
#      $WEIGHTSYNC_IMAGE_CACHE (default ~/.cache/weightsync-image), keyed by
#      the archive's state (the Date of bookworm, bookworm-updates and
#      bookworm-security's InRelease) and that package list: a warm cache
#      downloads three small files, a new Debian update builds a new base.
#   3. deploy/container/Containerfile's instructions run on that base, in
#      order, in a chroot: RUN as a shell command, COPY from the context;
#      LABEL, ENV, USER, ENTRYPOINT and CMD become the image's config. The
#      Containerfile stays the one recipe (`docker build` runs it too).
#   4. umoci assembles an OCI image of one layer: OUT/oci (layout, tag
#      weightsyncd) and OUT/weightsyncd.oci.tar (`podman load -i`, or
#      `podman run oci-archive:OUT/weightsyncd.oci.tar`).
#
# Usage: tools/build_image.sh OUT [BINARY...]
#   BINARY...  as stage.sh takes them (default: tools/release_binaries.sh,
#              which builds them). Without weightsync_gpu_worker the image
#              serves the host backend only (what CI builds: no CUDA copy).
# Needs root (chroot, mounts), mmdebstrap and umoci (Debian 12 packages),
# and Debian's archive (deb.debian.org; $DEBIAN_MIRROR to change it).
# Prints a line per step with its time.
set -euo pipefail
out=${1:?usage: build_image.sh OUT [BINARY...]}
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
cache=${WEIGHTSYNC_IMAGE_CACHE:-$HOME/.cache/weightsync-image}
t0=$(date +%s)
step() { echo "build_image: $1 ($(($(date +%s) - t0)) s)" >&2; }

[ "$(id -u)" = 0 ] || { echo "build_image.sh: needs root (chroot, mounts)" >&2; exit 2; }
for tool in mmdebstrap umoci curl dpkg-deb; do
  command -v "$tool" >/dev/null ||
    { echo "build_image.sh: $tool missing (apt-get install $tool)" >&2; exit 2; }
done

rm -rf "$out"
mkdir -p "$out" "$cache"
out=$(cd "$out" && pwd)

# ---- 1. the build context
bash "$repo/deploy/container/stage.sh" "$out/context" "$@" >&2
deb=$(ls "$out"/context/weightsync_*.deb)
step "staged $(basename "$deb")"

# ---- 2. the base, cached by the archive's state and the package list
# (The group "systemd | systemd-standalone-sysusers | ..." is met by the
# latter, as in the Containerfile; of other groups, the first.)
depends=$(dpkg-deb -f "$deb" Depends | tr ',' '\n' | grep -v 'systemd-standalone-sysusers' |
  sed -E 's/\([^)]*\)//g; s/\|.*//; s/[[:space:]]//g' | grep -v '^$' | sort -u | tr '\n' ',')
packages="systemd-standalone-sysusers,${depends%,}"
stamp=""
for suite in "$mirror/dists/bookworm" "$mirror/dists/bookworm-updates" \
             "$security/dists/bookworm-security"; do
  date=$(curl -fsS --max-time 30 "$suite/InRelease" | sed -n 's/^Date: //p' | head -n1) ||
    { echo "build_image.sh: $suite/InRelease unreachable" >&2; exit 1; }
  stamp+="$date;"
done
key=$(printf '%s\n%s\n' "$stamp" "$packages" | sha256sum | cut -c1-16)
base="$cache/bookworm-$(date -u -d "${stamp%%;*}" +%Y%m%dT%H%M%SZ)-$key.tar"
if [ ! -s "$base" ]; then
  step "base: mmdebstrap bookworm (minbase + $packages); archive: $stamp"
  # The apt lists are kept: the Containerfile's apt-get then needs no
  # download beyond its own update.
  mmdebstrap --mode=root --variant=minbase --format=tar --include="$packages" \
    --skip=cleanup/apt/lists --quiet \
    bookworm "$base.tmp" \
    "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
    "deb $security bookworm-security main"
  mv "$base.tmp" "$base"
  # Older bases of other archive states go.
  find "$cache" -maxdepth 1 -name 'bookworm-*.tar' ! -name "$(basename "$base")" -delete
  step "base built: $base ($(du -m "$base" | cut -f1) MiB)"
else
  step "base cached: $base"
fi

# ---- 3. the Containerfile's instructions on the base
root="$out/rootfs"
mkdir -p "$root"
tar -C "$root" -xf "$base"
cp /etc/resolv.conf "$root/etc/resolv.conf"
config_args=()
run_in_root() {
  # A private mount namespace: /proc, /dev and /sys go with it.
  unshare --mount --fork sh -euc '
    r=$1; shift
    mount -t proc proc "$r/proc"
    mount --rbind /dev "$r/dev"
    mount --rbind /sys "$r/sys"
    exec chroot "$r" /bin/sh -euc "$1"' sh "$root" "$1"
}
# Instructions joined across "\" line ends, comments and blank lines dropped.
mapfile -t instructions < <(awk '
  /^[[:space:]]*#/ && cont == "" { next }
  /^[[:space:]]*$/ { next }
  { line = $0; sub(/^[[:space:]]+/, "", line)
    if (sub(/\\[[:space:]]*$/, "", line)) { cont = cont line " "; next }
    print cont line; cont = "" }' "$out/context/Containerfile")
for ins in "${instructions[@]}"; do
  op=${ins%% *}
  arg=${ins#* }
  case "$op" in
    FROM) ;;  # the base above stands for debian:bookworm-slim
    RUN)
      step "RUN ${arg:0:60}..."
      run_in_root "$arg" >&2 ;;
    COPY)
      read -r -a parts <<<"$arg"
      dest=${parts[-1]}
      for src in "${parts[@]:0:${#parts[@]}-1}"; do
        # shellcheck disable=SC2086  # the source is a glob of the context
        for f in "$out"/context/$src; do
          if [ -d "$f" ]; then
            cp -a "$f/." "$root/$dest"
          else
            mkdir -p "$root/$dest" && cp -a "$f" "$root/$dest"
          fi
        done
      done ;;
    LABEL)
      eval "labels=($arg)"
      for kv in "${labels[@]}"; do
        config_args+=(--config.label "$kv" --manifest.annotation "$kv")
      done ;;
    ENV)
      eval "envs=($arg)"
      for kv in "${envs[@]}"; do config_args+=(--config.env "$kv"); done ;;
    USER) config_args+=(--config.user "$arg") ;;
    ENTRYPOINT)
      config_args+=(--clear=config.entrypoint)
      while read -r e; do config_args+=(--config.entrypoint "$e"); done < <(
        python3 -c 'import json,sys; print("\n".join(json.loads(sys.argv[1])))' "$arg") ;;
    CMD)
      config_args+=(--clear=config.cmd)
      while read -r c; do config_args+=(--config.cmd "$c"); done < <(
        python3 -c 'import json,sys; print("\n".join(json.loads(sys.argv[1])))' "$arg") ;;
    *) echo "build_image.sh: Containerfile instruction $op is not supported here" >&2
       exit 2 ;;
  esac
done
: >"$root/etc/resolv.conf"  # the runtime provides it

# ---- 4. the OCI image
umoci init --layout "$out/oci"
umoci new --image "$out/oci:weightsyncd"
umoci unpack --image "$out/oci:weightsyncd" "$out/bundle" >/dev/null
rm -rf "$out/bundle/rootfs"
mv "$root" "$out/bundle/rootfs"
umoci repack --image "$out/oci:weightsyncd" "$out/bundle"
umoci config --image "$out/oci:weightsyncd" --os linux --architecture amd64 \
  --author "weightsync tools/build_image.sh" "${config_args[@]}"
umoci gc --layout "$out/oci"
rm -rf "$out/bundle"
tar -C "$out/oci" -cf "$out/weightsyncd.oci.tar" .
step "image: $out/oci:weightsyncd, $out/weightsyncd.oci.tar ($(du -m "$out/weightsyncd.oci.tar" | cut -f1) MiB)"
