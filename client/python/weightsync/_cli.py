"""`python -m weightsync` (also the `weightsync` console script).

Prints this package's version and what the daemon says of itself (its
build, its version when it reports one, backend, engines), and checks the
local daemon's health the way the `weightsync_health` probe does
(grpc.health.v1 Check of the whole daemon). Exit status: 0 the daemon
answers SERVING; 1 it is unreachable, not serving or answers an error;
2 bad arguments.

    python -m weightsync                       # the default socket (default_target())
    python -m weightsync --target unix:/run/weightsync/weightsyncd.sock
    python -m weightsync --version             # the package version only
"""

import argparse
import os
import re
import sys

from weightsync._version import __version__

# "weightsyncd 0.1.0", "version 0.1.0", "weightsync/0.1.0": a daemon that
# names its version inside build_info.
_VERSION_IN_BUILD = re.compile(r"(?:weightsyncd?|version)[\s/:=v]*(\d+\.\d+\.\d+[\w.+-]*)")


def _daemon_version(status):
    """The version the daemon reports, or None: a version field of
    GetStatusResponse where the descriptor set has one, else a version
    named in build_info."""
    for field in ("daemon_version", "version"):
        if field in status.DESCRIPTOR.fields_by_name:
            value = getattr(status, field)
            if value:
                return str(value)
    m = _VERSION_IN_BUILD.search(status.build_info)
    return m.group(1) if m else None


def _engines_line(status, v1):
    if not status.engines:
        return "none registered"
    states = {}
    for e in status.engines:
        name = v1.enum_name("EngineState", e.state).replace("ENGINE_", "").lower()
        states[name] = states.get(name, 0) + 1
    versions = sorted({e.version for e in status.engines})
    return (f"{len(status.engines)} (" + ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
            + "), version" + ("s " if len(versions) > 1 else " ")
            + ", ".join(str(v) for v in versions))


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="weightsync" if os.path.basename(sys.argv[0]) == "weightsync"
        else "python -m weightsync",
        description="Report the weightsync package and daemon versions and check the local "
                    "daemon's health. Exit status 0: the daemon answers SERVING.")
    parser.add_argument("--version", action="version", version=f"weightsync {__version__}")
    parser.add_argument("--target", default=None,
                        help="daemon: unix:PATH, a socket path, or host:port (TCP uses TLS and "
                             "a token from WEIGHTSYNC_TLS_CA / WEIGHTSYNC_TOKEN_FILE); default: "
                             "the daemon's default socket, $XDG_RUNTIME_DIR/weightsync/"
                             "weightsyncd.sock or /tmp/weightsync-$UID/weightsyncd.sock")
    parser.add_argument("--timeout", type=float, default=3.0,
                        help="seconds for connecting and each call (default 3)")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be positive")

    package_dir = os.path.dirname(os.path.abspath(__file__))
    print(f"weightsync {__version__} (Python package, {package_dir})")
    try:
        import grpc
        from weightsync._proto import Stub, channel, default_target, v1
    except ImportError as e:  # grpcio or protobuf missing
        print(f"daemon: can't check: {e} (the package needs grpcio, protobuf and numpy)")
        return 1

    target = args.target or default_target()
    path = target[len("unix:"):] if target.startswith("unix:") else (
        target if target.startswith("/") else None)
    if path is not None and not os.path.exists(path):
        print(f"daemon {target}: UNREACHABLE: {path} does not exist (is weightsyncd running, "
              "and on this socket? --target names another)")
        return 1
    ch = channel(target)
    try:
        try:
            grpc.channel_ready_future(ch).result(timeout=args.timeout)
        except grpc.FutureTimeoutError:
            print(f"daemon {target}: UNREACHABLE: no connection within {args.timeout:g} s")
            return 1
        health = Stub(ch, "grpc.health.v1.Health", args.timeout)
        try:
            answer = health.call("Check", service="")
        except Exception as e:  # WeightSyncError: the call failed
            print(f"daemon {target}: health check failed: {e}")
            return 1
        serving = answer.DESCRIPTOR.fields_by_name["status"].enum_type.values_by_number[
            answer.status].name
        print(f"daemon {target}: {serving}")

        # What the daemon says of itself. Health decides the exit status: a
        # daemon that serves but refuses this caller its status (another
        # user's socket) is still healthy.
        try:
            status = Stub(ch, "TrainerService", args.timeout).call("GetStatus")
        except Exception as e:
            print(f"daemon status: not available: {e}")
        else:
            version = _daemon_version(status)
            if version is None:
                print("daemon version: not reported by this daemon")
            elif version != __version__:
                print(f"daemon version: {version} (differs from this package's {__version__})")
            else:
                print(f"daemon version: {version}")
            print(f"daemon build: {status.build_info or '(not reported)'}")
            backend = v1.enum_name("Backend", status.backend).replace("BACKEND_", "").lower()
            print(f"backend: {'none yet' if backend == 'unspecified' else backend}")
            print(f"engines: {_engines_line(status, v1)}")
        if serving != "SERVING":
            print(f"daemon {target}: not healthy")
            return 1
        return 0
    finally:
        ch.close()


if __name__ == "__main__":
    sys.exit(main())
