#!/usr/bin/env bash
# Runs the weightsyncd image that tools/build_image.sh built (issue 34;
# docs/deploy.md#image) and checks it serves:
#
#   * the daemon starts from the image's own entrypoint and command, as the
#     image's user (uid 1000), with a host folder mounted on
#     /run/weightsync (the socket directory, as Kubernetes mounts a volume);
#   * the image's weightsync_health answers SERVING;
#   * a trainer and an engine outside the image (the Python client on this
#     host, as uid 1000 like the pod manifests' engine) take one update
#     through the mounted socket, bit for bit, with receipts;
#   * the image's weightsyncctl shows the engine at that version;
#   * SIGTERM stops the daemon with exit status 0 and it removes its socket.
#
# The runtime: podman (runc, the host's /dev/shm shared with --ipc=host)
# where it can start a container on this machine; else the image's rootfs
# unpacked by umoci and entered with unshare + chroot as the image's user,
# which is what a container runtime does minus cgroups and namespaces.
# WEIGHTSYNC_IMAGE_RUNTIME=podman|chroot picks one.
#
# Usage: tests/image_test.sh OUT    (OUT of tools/build_image.sh)
set -euo pipefail
out=$(cd "${1:?usage: image_test.sh OUT}" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
t0=$(date +%s)
say() { echo "image_test: $1 ($(($(date +%s) - t0)) s)"; }
fail() { echo "image_test: FAIL: $1" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "needs root (chroot, mounts, a uid 1000 engine)"
[ -s "$out/weightsyncd.oci.tar" ] || fail "no $out/weightsyncd.oci.tar: run tools/build_image.sh first"

tmp=$(mktemp -d /tmp/wsimage.XXXXXX)
sockdir="$tmp/run"
install -d -m 0750 -o 1000 -g 1000 "$sockdir"
sock="$sockdir/weightsyncd.sock"
name="wsimage-$$"
image=""
pid=""
runtime=${WEIGHTSYNC_IMAGE_RUNTIME:-}
cleanup() {
  set +e
  if [ "$runtime" = podman ]; then
    podman rm -f -t 5 "$name" >/dev/null 2>&1
    [ -n "$image" ] && podman rmi -f "$image" >/dev/null 2>&1
  elif [ -n "$pid" ]; then
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

# The image's config (read from the OCI layout): labels, user, entrypoint
# + command, environment.
python3 - "$out/oci" "$tmp" <<'EOF' || fail "the image's config"
import json, os, sys
lay, tmp = sys.argv[1], sys.argv[2]
index = json.load(open(os.path.join(lay, "index.json")))
blob = lambda d: json.load(open(os.path.join(lay, "blobs", *d["digest"].split(":"))))
config = blob(blob(index["manifests"][0])["config"])["config"]
labels = config.get("Labels", {})
assert labels.get("org.opencontainers.image.licenses") == "Apache-2.0", labels
assert config.get("User") == "1000:1000", f"the image runs as {config.get('User')}, not 1000:1000"
with open(os.path.join(tmp, "args"), "w") as f:
    f.write("\n".join(config["Entrypoint"] + config.get("Cmd", [])) + "\n")
with open(os.path.join(tmp, "env"), "w") as f:
    f.write("\n".join(config.get("Env", [])) + "\n")
print("labels:", ", ".join(f"{k}={v}" for k, v in sorted(labels.items())))
print("user 1000:1000, runs:", " ".join(config["Entrypoint"] + config.get("Cmd", [])))
EOF

if [ -z "$runtime" ]; then
  runtime=chroot
  if command -v podman >/dev/null; then runtime=podman; fi
fi
podman_run=(podman)
if [ "$runtime" = podman ]; then
  # runc where installed: crun can't run on hybrid cgroup v1 hosts. Limits
  # at or below this shell's: a runtime without CAP_SYS_RESOURCE can't raise
  # them (podman's defaults for root are above them).
  command -v runc >/dev/null && podman_run+=(--runtime "$(command -v runc)")
  limits=(--ulimit "nofile=$(ulimit -Sn):$(ulimit -Hn)" --ulimit "nproc=4096:4096")
  image=$("${podman_run[@]}" load -q -i "$out/weightsyncd.oci.tar" 2>&1 | sed -n 's/^Loaded image[^:]*: //p' | tail -n1)
  if [ -z "$image" ] ||
    ! "${podman_run[@]}" run --rm "${limits[@]}" --network=none --entrypoint /bin/true \
      "$image" >"$tmp/probe.log" 2>&1; then
    say "podman can't run a container here ($(tail -n1 "$tmp/probe.log" 2>/dev/null)); chroot instead"
    [ -n "$image" ] && podman rmi -f "$image" >/dev/null 2>&1
    image=""
    runtime=chroot
  fi
fi

if [ "$runtime" = podman ]; then
  # The image's own entrypoint and command; --ipc=host: the engine's shared
  # memory (host backend) is the host's /dev/shm.
  "${podman_run[@]}" run -d --name "$name" "${limits[@]}" --network=none --ipc=host \
    -v "$sockdir:/run/weightsync" "$image" >/dev/null
  in_image() { "${podman_run[@]}" exec "$name" "$@"; }
  logs() { podman logs "$name" 2>&1; }
else
  # The rootfs as umoci unpacked it, entered as the image's user with the
  # image's environment and arguments; /dev (with /dev/shm) is the host's.
  umoci unpack --image "$out/oci:weightsyncd" "$tmp/bundle" >/dev/null
  root="$tmp/bundle/rootfs"
  mapfile -t args <"$tmp/args"
  mapfile -t envs <"$tmp/env"
  # PIDFILE: the pid the command will have (sh execs into it).
  enter() {
    unshare --mount --fork sh -euc '
      r=$1 s=$2 p=$3; shift 3
      mount -t proc proc "$r/proc"
      mount --rbind /dev "$r/dev"
      mount --bind "$s" "$r/run/weightsync"
      mount -t tmpfs tmpfs "$r/tmp"
      [ -z "$p" ] || echo $$ >"$p"
      exec chroot --userspec=1000:1000 "$r" /usr/bin/env -i "$@"' \
      sh "$root" "$sockdir" "${PIDFILE:-}" "$@"
  }
  PIDFILE="$tmp/daemon.pid" enter "${envs[@]}" "${args[@]}" 2>"$tmp/daemon.log" &
  pid=$!
  in_image() { enter "${envs[@]}" "$@"; }
  logs() { cat "$tmp/daemon.log"; }
fi
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { logs >&2; fail "no socket $sock after 10 s"; }
say "daemon up in the image ($runtime): $(stat -c '%U:%G %a' "$sock") $sock"

in_image /usr/bin/weightsync_health --socket=/run/weightsync/weightsyncd.sock ||
  { logs >&2; fail "weightsync_health"; }
say "weightsync_health: SERVING"

# One update from outside: an engine (its weights in the host's /dev/shm)
# and a trainer, as uid 1000, through the mounted socket directory.
cp -r "$repo/client/python" "$tmp/py"
chmod -R a+rX "$tmp/py"
chmod 0711 "$tmp"
setpriv --reuid=1000 --regid=1000 --clear-groups env -i PATH=/usr/bin:/bin HOME=/tmp \
  PYTHONPATH="$tmp/py" PYTHONDONTWRITEBYTECODE=1 timeout 60 /usr/bin/python3 - "unix:$sock" <<'EOF' ||
import sys
import numpy as np
import weightsync
target = sys.argv[1]
engine = weightsync.Engine("image-e0", target=target)
weights = engine.register_host([("w", "FLOAT32", (256, 64)), ("b", "BFLOAT16", (64,))])
engine.start()
try:
    trainer = weightsync.Trainer(target)
    trainer.init_host()
    rng = np.random.default_rng(34)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    trainer.update([("w", w), ("b", b)], version=1)   # receipts on: the daemon's checksums checked
    assert engine.wait_for_version(1), "engine did not reach version 1"
    assert np.array_equal(weights["w"], w), "w differs"
    want_b = (b.view(np.uint32) + 0x7FFF + ((b.view(np.uint32) >> 16) & 1)) >> 16
    assert np.array_equal(weights["b"], want_b.astype(np.uint16)), "b differs"
    print("update: version 1, w and b bit for bit (b as bfloat16), receipts ok")
    trainer.close()
finally:
    engine.close()
EOF
  { logs >&2; fail "the update from outside"; }

status=$(in_image /usr/bin/weightsyncctl --socket=/run/weightsync/weightsyncd.sock --json status 2>&1) ||
  { echo "$status" >&2; fail "weightsyncctl status"; }
python3 -c '
import json, sys
u = json.loads(sys.argv[1])["update"]
assert u["phase"] == "committed" and u["target_version"] == "1", u' "$status" ||
  { echo "$status" >&2; fail "weightsyncctl status: the last update is not version 1, committed"; }
say "weightsyncctl status in the image: the last update committed version 1"

# SIGTERM: exit 0, socket removed.
if [ "$runtime" = podman ]; then
  podman stop -t 20 "$name" >/dev/null
  code=$(podman inspect "$name" --format '{{.State.ExitCode}}')
else
  # The daemon itself (unshare passes no signal on); unshare --fork exits
  # with its status.
  kill -TERM "$(cat "$tmp/daemon.pid")"
  code=0
  wait "$pid" || code=$?
  pid=""
fi
[ "$code" = 0 ] || { logs >&2; fail "daemon exit status $code after SIGTERM"; }
[ ! -e "$sock" ] || fail "socket left behind after SIGTERM"
say "stopped by SIGTERM: exit 0, socket removed"
echo "image_test: PASS ($runtime)"
