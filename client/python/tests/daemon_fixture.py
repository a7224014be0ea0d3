"""A weightsyncd ($WEIGHTSYNCD) for one test, on a Unix socket in a fresh
/tmp/wspy.* folder that goes away with the test: the daemon is stopped if
still running, its log printed when the test failed, the folder removed.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time


def _failures(test):
    # unittest keeps no public "did this test fail": count the result's
    # failures and errors (Python >= 3.11 records them at once) and look at
    # the outcome's pending errors (older versions record them at the end).
    outcome = getattr(test, "_outcome", None)
    result = getattr(outcome, "result", None)
    count = len(result.failures) + len(result.errors) if result is not None else 0
    pending = sum(1 for _, exc in getattr(outcome, "errors", None) or [] if exc is not None)
    return count + pending


def start(test, *flags):
    """Starts the daemon with `flags` for `test` (a unittest.TestCase) and
    registers its cleanup; returns (process, target)."""
    work = tempfile.mkdtemp(prefix="wspy.", dir="/tmp")
    sock = os.path.join(work, "d.sock")
    log_path = os.path.join(work, "daemon.log")
    log = open(log_path, "w")
    daemon = subprocess.Popen([os.environ["WEIGHTSYNCD"], f"--socket={sock}", *flags],
                              stderr=log)
    before = _failures(test)

    def remove():
        log.close()
        if _failures(test) > before:
            with open(log_path, errors="replace") as f:
                sys.stderr.write(f"--- daemon log ({test.id()}) ---\n{f.read()}--- end ---\n")
        shutil.rmtree(work, ignore_errors=True)

    def kill():  # a daemon the test left running (it failed before its stop)
        if daemon.poll() is None:
            daemon.terminate()
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()

    test.addCleanup(remove)
    test.addCleanup(kill)  # runs first (cleanups run last in, first out)
    for _ in range(100):
        if os.path.exists(sock):
            break
        time.sleep(0.05)
    return daemon, "unix:" + sock
