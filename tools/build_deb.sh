#!/usr/bin/env bash
# Builds the Debian package of the daemon (docs/operations.md, "Installing
# the Debian package"): weightsync_VERSION-REV_ARCH.deb with
#
#   /usr/sbin/weightsyncd                         the daemon
#   /usr/libexec/weightsync/weightsync_gpu_worker its GPU worker (CUDA builds)
#   /usr/bin/weightsyncctl, /usr/bin/weightsync_health
#   /usr/lib/systemd/system/weightsyncd.service   deploy/systemd
#   /usr/lib/sysusers.d/weightsync.conf           the `weightsync` user
#   /etc/weightsync/weightsyncd.env               conffile: flags, NCCL env
#   /usr/share/doc/weightsync/                    copyright, changelog, docs
#   /usr/share/man/man{1,8}/                      weightsyncctl, weightsync_health, weightsyncd
#
# Usage: tools/build_deb.sh OUTDIR             bazel build, then package
#        tools/build_deb.sh OUTDIR BINARY...   package these binaries (by
#                                              name: weightsyncd,
#                                              weightsync_gpu_worker,
#                                              weightsyncctl, weightsync_health)
# Prints the .deb's path as its last line. Needs dpkg-dev (dpkg-shlibdeps,
# dpkg-parsechangelog) and binutils (strip). Run it on the Debian release
# the package is for (bookworm): Depends names this machine's library
# packages, found from the binaries' NEEDED entries by dpkg-shlibdeps.
#
# The version is /VERSION plus the Debian revision of deploy/debian/changelog,
# whose first entry must be for VERSION (bump both together). File times
# are clamped to that entry's date, so the same binaries give the same .deb.
set -euo pipefail
out=${1:?usage: build_deb.sh OUTDIR [BINARY...]}
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
deb="$repo/deploy/debian"

bins=("$@")
[ ${#bins[@]} -gt 0 ] || mapfile -t bins < <(bash "$repo/tools/release_binaries.sh")
[ ${#bins[@]} -gt 0 ] || { echo "$0: no binaries (the bazel build failed?)" >&2; exit 1; }

version=$(tr -d '[:space:]' <"$repo/VERSION")
changelog_version=$(dpkg-parsechangelog -l "$deb/changelog" -S Version)
case "$changelog_version" in
  "$version"-*) ;;
  *) echo "build_deb.sh: deploy/debian/changelog is at $changelog_version," \
          "VERSION is $version: add a changelog entry" >&2; exit 1 ;;
esac
export SOURCE_DATE_EPOCH
SOURCE_DATE_EPOCH=$(dpkg-parsechangelog -l "$deb/changelog" -S Timestamp)
arch=$(dpkg --print-architecture)
maintainer=$(dpkg-parsechangelog -l "$deb/changelog" -S Maintainer)

work=$(mktemp -d "${TMPDIR:-/tmp}/ws-deb.XXXXXX")
trap 'rm -rf "$work"' EXIT
root="$work/weightsync"
mkdir -p "$root/DEBIAN"

# Binaries, stripped as dh_strip does.
have=" "
for bin in "${bins[@]}"; do
  name=$(basename "$bin")
  case "$name" in
    weightsyncd) dest=usr/sbin ;;
    weightsync_gpu_worker) dest=usr/libexec/weightsync ;;
    weightsyncctl | weightsync_health) dest=usr/bin ;;
    *) echo "build_deb.sh: unexpected binary $bin" >&2; exit 2 ;;
  esac
  install -D -m 0755 "$bin" "$root/$dest/$name"
  strip --strip-unneeded --remove-section=.comment --remove-section=.note \
    "$root/$dest/$name"
  have+="$name "
done
for need in weightsyncd weightsyncctl weightsync_health; do
  case "$have" in *" $need "*) ;; *)
    echo "build_deb.sh: $need not given" >&2; exit 2 ;;
  esac
done

# systemd, sysusers, the environment file (a conffile).
install -D -m 0644 "$repo/deploy/systemd/weightsyncd.service" \
  "$root/usr/lib/systemd/system/weightsyncd.service"
install -D -m 0644 "$repo/deploy/systemd/weightsync-sysusers.conf" \
  "$root/usr/lib/sysusers.d/weightsync.conf"
install -D -m 0644 "$repo/deploy/systemd/weightsyncd.env" \
  "$root/etc/weightsync/weightsyncd.env"
echo /etc/weightsync/weightsyncd.env >"$root/DEBIAN/conffiles"

# Docs and man pages.
doc="$root/usr/share/doc/weightsync"
install -D -m 0644 "$deb/copyright" "$doc/copyright"
gzip -9n <"$deb/changelog" >"$doc/changelog.Debian.gz"
install -m 0644 "$repo/README.md" "$doc/README.md"
for d in deploy operations security weightsyncctl; do
  install -m 0644 "$repo/docs/$d.md" "$doc/$d.md"
done
for page in weightsyncd.8 weightsyncctl.1 weightsync_health.1; do
  section=${page##*.}
  mkdir -p "$root/usr/share/man/man$section"
  gzip -9n <"$deb/$page" >"$root/usr/share/man/man$section/$page.gz"
done
install -D -m 0644 "$deb/lintian-overrides" \
  "$root/usr/share/lintian/overrides/weightsync"

# Maintainer scripts: the system user, the unit enabled and started.
for script in postinst prerm postrm; do
  install -m 0755 "$deb/$script" "$root/DEBIAN/$script"
done

# Depends: the packages that hold the libraries the binaries link
# (dpkg-shlibdeps: versions from their shlibs/symbols files). The CUDA
# runtime and NCCL that the GPU worker links come from NVIDIA's toolkit in
# /usr/local/cuda, not from a Debian package: they are left out (the
# worker is optional; docs/operations.md says what it needs).
elfs=()
for f in "$root"/usr/sbin/* "$root"/usr/bin/* "$root"/usr/libexec/weightsync/*; do
  [ -f "$f" ] && elfs+=("$f")
done
mkdir -p "$work/src/debian"
printf 'Source: weightsync\n\nPackage: weightsync\nArchitecture: any\n' \
  >"$work/src/debian/control"
shlibs=$(cd "$work/src" && dpkg-shlibdeps -O --warnings=0 \
  -l/usr/local/cuda/lib64 --ignore-missing-info "${elfs[@]}" 2>"$work/shlibdeps.err" |
  sed -n 's/^shlibs:Depends=//p') || {
  cat "$work/shlibdeps.err" >&2
  exit 1
}
[ -n "$shlibs" ] || { echo "build_deb.sh: dpkg-shlibdeps found nothing" >&2; exit 1; }

# Reproducible: every file at the changelog's date, sorted md5sums.
find "$root" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\n' | LC_ALL=C sort |
  xargs md5sum) >"$root/DEBIAN/md5sums"
installed_size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)

cat >"$root/DEBIAN/control" <<EOF
Package: weightsync
Version: $changelog_version
Architecture: $arch
Maintainer: $maintainer
Installed-Size: $installed_size
Depends: $shlibs, systemd | systemd-standalone-sysusers | systemd-sysusers
Section: net
Priority: optional
Description: moves trained weights into running inference engines
 weightsyncd is a per-node daemon that takes weight updates from
 reinforcement-learning trainers and writes them straight into the memory
 of the inference engines registered with it on the node, pausing and
 resuming the engines around each update and committing a new weight
 version. Trainers and engines talk to it over gRPC on a Unix socket.
 .
 This package holds the daemon, run by weightsyncd.service as the system
 user weightsync, its GPU worker, the operators' command line
 weightsyncctl and the health probe weightsync_health. The GPU backends
 (NCCL and CUDA IPC) need the NVIDIA driver, the CUDA 13 runtime and NCCL
 from NVIDIA, not from Debian; without them the daemon serves the host
 backend (shared memory).
EOF
touch -d "@$SOURCE_DATE_EPOCH" "$root/DEBIAN/control" "$root/DEBIAN/md5sums"

mkdir -p "$out"
file="$out/weightsync_${changelog_version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$root" "$file" >/dev/null
echo "$file"
