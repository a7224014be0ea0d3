#!/usr/bin/env python3
"""SIGTERM stops the real daemon within --shutdown_timeout_ms whatever its
handlers are doing (issue 19): an engine process frozen with SIGSTOP never
acknowledges the Pause a trainer is waiting on, so the control lock stays
held and the orderly stop can't finish; the daemon must still be gone in
time (exit 1, saying why). Without the frozen engine the same stop is
clean (exit 0, at once).

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 tests/shutdown_test.py
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "faults"))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

import faults as F  # noqa: E402
import weightsync  # noqa: E402
from weightsync._proto import v1  # noqa: E402

failures = []


def check(what, ok, got=None):
    print(f"{'PASS' if ok else 'FAIL'} {what}" + ("" if ok else f": got {got}"), flush=True)
    if not ok:
        failures.append(what)


def stop(daemon, work, frozen):
    """Starts a daemon and an engine; with `frozen`, SIGSTOPs the engine and
    has a trainer wait on a Pause; then SIGTERM. (exit status, seconds, log)"""
    sock, log = os.path.join(work, "d.sock"), os.path.join(work, "daemon.log")
    open(log, "w").close()
    proc = subprocess.Popen(
        [daemon, f"--socket={sock}", "--notice_timeout_ms=30000", "--shutdown_grace_ms=500",
         "--shutdown_timeout_ms=1500"], stderr=open(log, "a"))
    for _ in range(200):
        if os.path.exists(sock):
            break
        time.sleep(0.025)
    engine = F.start_engine("e0", "unix:" + sock, os.path.join(work, "e0.log"))
    try:
        trainer = weightsync.Trainer("unix:" + sock, timeout=60)
        for _ in range(100):
            if all(e.connected for e in trainer.status().engines):
                break
            time.sleep(0.02)
        if frozen:
            engine.kill(signal.SIGSTOP)
            waiter = threading.Thread(
                target=lambda: _ignore(lambda: trainer._stub.call(
                    "Pause", v1.PauseRequest(timeout_ms=30000), timeout=60)),
                daemon=True)
            waiter.start()
            check("the Pause holds the daemon's control lock", lock_held(trainer))
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "still running 20 s after SIGTERM"
        return code, time.time() - t0, open(log).read()
    finally:
        engine.reap()
        os.unlink(sock) if os.path.exists(sock) else None


def lock_held(trainer):
    """True once a control call (Resume) waits: the Pause holds the lock."""
    for _ in range(50):
        try:
            trainer._stub.call("Resume", v1.ResumeRequest(), timeout=0.3)
        except weightsync.WeightSyncError as e:
            if "DEADLINE_EXCEEDED" in str(e):
                return True
        time.sleep(0.1)
    return False


def _ignore(call):
    try:
        call()
    except Exception as e:  # the daemon goes away under the call
        print("the waiting call ended:", e, flush=True)


def main():
    daemon = os.environ["WEIGHTSYNCD"]
    work = tempfile.mkdtemp(prefix="ws-stop.", dir="/tmp")
    os.chmod(work, 0o750)
    code, secs, log = stop(daemon, work, frozen=False)
    check(f"a clean stop exits 0 at once ({secs:.2f} s)", code == 0 and secs < 1.5, (code, secs))
    code, secs, log = stop(daemon, work, frozen=True)
    check(f"a stop held by a frozen engine exits 1 within the 1.5 s limit ({secs:.2f} s)",
          code == 1 and 1.4 < secs < 3.0, (code, secs))
    check("the daemon says why", "did not finish within 1500 ms" in log, log[-2000:])
    if failures:
        print(f"{len(failures)} FAILED: {failures} (logs kept in {work})")
        return 1
    shutil.rmtree(work, ignore_errors=True)  # kept when something failed
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
