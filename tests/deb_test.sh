#!/usr/bin/env bash
# The Debian package (tools/build_deb.sh; docs/operations.md, "Installing
# the Debian package"), from the binaries this build made:
#
# * it builds; its control fields: name, version = VERSION + revision,
#   Depends naming the package of every library the binaries load (found
#   as deploy/container/stage.sh finds them: ldd, dpkg -S), the CUDA
#   runtime and NCCL excepted; the conffile;
# * installed into a throwaway root (dpkg -x: no maintainer scripts, nothing
#   on the host), its files are where the unit and the docs say, and the
#   postinst's systemd-sysusers call makes the user in that root;
# * the INSTALLED daemon starts on the host backend on a temporary socket
#   (finding its GPU worker in ../libexec/weightsync when built with CUDA),
#   the installed weightsync_health says SERVING, the installed
#   `weightsyncctl status` shows the daemon's version, and every --version
#   is VERSION; the daemon stops on SIGTERM;
# * lintian (when installed, as CI installs it) reports no error or warning
#   beyond deploy/debian/lintian-overrides.
#
# Run by //tests:deb_test from the runfiles root; everything it makes is
# removed on exit.
set -euo pipefail
cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"
runfiles=$PWD

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

tmp=$(mktemp -d /tmp/ws-debtest.XXXXXX)  # short: the socket path
daemon_pid=
cleanup() {
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -KILL "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

version=$(tr -d '[:space:]' <VERSION)
bins=(daemon/weightsyncd tools/weightsyncctl tools/weightsync_health)
worker=backends/cuda/weightsync_gpu_worker
[ -x "$worker" ] && bins+=("$worker")

# ---- Build ----
t0=$(date +%s)
deb=$(bash tools/build_deb.sh "$tmp/out" "${bins[@]/#/$runfiles/}" | tail -n1)
[ -f "$deb" ] || fail "build_deb.sh made no .deb"
echo "built $(basename "$deb") in $(($(date +%s) - t0)) s"
field() { dpkg-deb -f "$deb" "$1"; }
[ "$(field Package)" = weightsync ] || fail "Package: $(field Package)"
case "$(field Version)" in
  "$version"-[0-9]*) ;;
  *) fail "Version $(field Version) is not VERSION $version plus a revision" ;;
esac
[ "$(field Architecture)" = "$(dpkg --print-architecture)" ] || fail "Architecture"
depends=$(field Depends)
echo "Depends: $depends"
[ "$(dpkg-deb --ctrl-tarfile "$deb" | tar -xOf - ./conffiles)" = \
  /etc/weightsync/weightsyncd.env ] || fail "conffiles"

# Every library a binary links directly (NEEDED), as ldd resolves it, is in
# a package Depends names (dpkg -S, trying the names merged /usr gives a
# path), except the CUDA toolkit's. Libraries those load in turn come with
# their packages' own Depends.
depends_names=" $(echo "$depends" | tr ',|' '\n\n' | awk '{print $1}' | tr '\n' ' ') "
declare -A lib_of_path=()  # resolved library path -> "binary lib"
for bin in "${bins[@]}"; do
  needed=" $(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ') "
  [ "$needed" != "  " ] || fail "$bin: no NEEDED entries"
  while read -r lib path; do
    case "$needed" in *" $lib "*) ;; *) continue ;; esac
    case "$path" in
      NOT-FOUND) fail "$bin: $lib not found by ldd" ;;
      /usr/local/cuda*) continue ;;
    esac
    lib_of_path[$path]="$bin $lib"
  done < <(ldd "$bin" | awk '/=> \// {print $1, $3} / not found/ {print $1, "NOT-FOUND"}')
done
# One dpkg -S for every name a library may be known by.
candidates=()
for p in "${!lib_of_path[@]}"; do
  r=$(readlink -f "$p")
  candidates+=("$p" "$r" "${r#/usr}" "/usr$p")
done
declare -A owner=()
while IFS= read -r line; do
  case "$line" in diversion*) continue ;; esac
  owner[${line#*: }]=${line%%:*}
done < <(dpkg -S "${candidates[@]}" 2>/dev/null || true)
for p in "${!lib_of_path[@]}"; do
  r=$(readlink -f "$p")
  pkg=
  for c in "$p" "$r" "${r#/usr}" "/usr$p"; do
    [ -n "${owner[$c]:-}" ] && { pkg=${owner[$c]}; break; }
  done
  read -r bin lib <<<"${lib_of_path[$p]}"
  [ -n "$pkg" ] || fail "$bin: no package holds $p ($lib)"
  case "$depends_names" in
    *" $pkg "*) ;;
    *) fail "$bin needs $lib from $pkg, which Depends does not name" ;;
  esac
done
echo "every NEEDED library of ${#bins[@]} binaries is in a package Depends names"

# ---- Install into a throwaway root ----
root="$tmp/root"
dpkg-deb -x "$deb" "$root"
for f in usr/sbin/weightsyncd usr/bin/weightsyncctl usr/bin/weightsync_health; do
  [ -x "$root/$f" ] || fail "$f not installed"
done
if [ -x "$worker" ]; then
  [ -x "$root/usr/libexec/weightsync/weightsync_gpu_worker" ] || fail "GPU worker"
fi
for f in usr/lib/systemd/system/weightsyncd.service \
  usr/lib/sysusers.d/weightsync.conf etc/weightsync/weightsyncd.env \
  usr/share/doc/weightsync/copyright usr/share/doc/weightsync/changelog.Debian.gz \
  usr/share/doc/weightsync/deploy.md usr/share/doc/weightsync/operations.md \
  usr/share/man/man8/weightsyncd.8.gz usr/share/man/man1/weightsyncctl.1.gz \
  usr/share/man/man1/weightsync_health.1.gz; do
  [ -f "$root/$f" ] || fail "$f not installed"
done
unit="$root/usr/lib/systemd/system/weightsyncd.service"
grep -q '^ExecStart=/usr/sbin/weightsyncd ' "$unit" || fail "unit's ExecStart"
grep -q '^EnvironmentFile=-/etc/weightsync/weightsyncd.env$' "$unit" ||
  fail "unit's EnvironmentFile"
for d in $(sed -n 's/^Documentation=//p' "$unit"); do
  case "$d" in
    file:*) [ -f "$root/${d#file:}" ] || fail "unit's Documentation $d" ;;
    man:*) p=${d#man:}; n=${p%(*}; s=${p#*(}; s=${s%)}
      [ -f "$root/usr/share/man/man$s/$n.$s.gz" ] || fail "unit's Documentation $d" ;;
  esac
done

# The postinst's `systemd-sysusers weightsync.conf` (its other steps touch
# systemd, so they are not run), against the throwaway root: the basename
# resolves to the installed file and makes the user and group.
dpkg-deb --ctrl-tarfile "$deb" | tar -xOf - ./postinst |
  grep -qF 'systemd-sysusers ${DPKG_ROOT:+--root="$DPKG_ROOT"} weightsync.conf' ||
  fail "postinst does not run systemd-sysusers weightsync.conf"
mkdir -p "$root/etc"
systemd-sysusers --root="$root" weightsync.conf >/dev/null 2>&1 ||
  fail "systemd-sysusers --root: $(systemd-sysusers --root="$root" weightsync.conf 2>&1)"
grep -q '^weightsync:x:[0-9]*:[0-9]*:weightsync daemon:/nonexistent:/usr/sbin/nologin$' \
  "$root/etc/passwd" || fail "sysusers made no weightsync user: $(cat "$root/etc/passwd")"

# ---- Versions ----
got=$("$root/usr/sbin/weightsyncd" --version | head -n1)
[ "$got" = "weightsyncd version $version" ] || fail "weightsyncd --version: $got"
got=$("$root/usr/bin/weightsyncctl" --version)
[ "$got" = "weightsyncctl version $version" ] || fail "weightsyncctl --version: $got"
got=$("$root/usr/bin/weightsync_health" --version | head -n1)
[ "$got" = "weightsync_health version $version" ] ||
  fail "weightsync_health --version: $got"

# ---- The installed daemon, host backend, temporary socket ----
sock="$tmp/run/weightsyncd.sock"
log="$tmp/daemon.log"
env -u NOTIFY_SOCKET "$root/usr/sbin/weightsyncd" --socket="$sock" >"$log" 2>&1 &
daemon_pid=$!
ok=0
for _ in $(seq 1 100); do
  if "$root/usr/bin/weightsync_health" --socket="$sock" --timeout_ms=1000 \
    >"$tmp/health" 2>&1; then
    ok=1
    break
  fi
  kill -0 "$daemon_pid" 2>/dev/null || { cat "$log" >&2; fail "daemon exited"; }
  sleep 0.2
done
[ "$ok" = 1 ] || { cat "$log" "$tmp/health" >&2; fail "never SERVING"; }
[ "$(cat "$tmp/health")" = SERVING ] || fail "health said $(cat "$tmp/health")"
grep -q "weightsyncd $version listening on unix:$sock" "$log" ||
  { cat "$log" >&2; fail "the daemon's log names no version"; }
if [ -x "$worker" ]; then
  # The package's layout: the worker is not beside the daemon.
  grep -q "GPU backends via $root/usr/libexec/weightsync/weightsync_gpu_worker" "$log" ||
    { cat "$log" >&2; fail "the daemon did not find its worker in ../libexec"; }
fi
status=$("$root/usr/bin/weightsyncctl" --socket="$sock" status)
echo "$status"
echo "$status" | grep -q "^backend: none (no transfer group)   version: $version" ||
  fail "weightsyncctl status shows no version $version"
echo "$status" | grep -q "^update: none since the daemon started" ||
  fail "weightsyncctl status: no update line"
json=$("$root/usr/bin/weightsyncctl" --socket="$sock" --json status)
echo "$json" | grep -q "\"version\":\"$version\"" || fail "status --json: $json"
kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=
[ "$rc" = 0 ] || { cat "$log" >&2; fail "daemon exited $rc on SIGTERM"; }
if "$root/usr/bin/weightsync_health" --socket="$sock" --timeout_ms=500 >/dev/null; then
  fail "health still SERVING after the daemon stopped"
fi

# ---- lintian ----
# On the package of a normal build; an instrumented one (--config=asan, cov:
# CI runs the suite under both) is no package anyone ships.
instrumented=
if readelf -d daemon/weightsyncd | grep -q 'libasan\|libclang_rt' ||
  readelf -s daemon/weightsyncd | grep -q '__llvm_profile_runtime\|__asan_init'; then
  instrumented=1
fi
if [ -n "$instrumented" ]; then
  echo "lintian skipped: the binaries are instrumented (sanitizer or coverage build)"
elif command -v lintian >/dev/null; then
  t0=$(date +%s)
  # Errors and warnings fail; info and pedantic tags are printed.
  if ! HOME="$tmp" lintian --fail-on error,warning --display-info "$deb" \
    >"$tmp/lintian" 2>&1; then
    cat "$tmp/lintian" >&2
    fail "lintian"
  fi
  cat "$tmp/lintian"
  echo "lintian: clean (errors, warnings) in $(($(date +%s) - t0)) s"
else
  echo "lintian not installed: skipped (CI installs it: .ci/install-deps.sh)"
fi
echo "PASS in $SECONDS s"
