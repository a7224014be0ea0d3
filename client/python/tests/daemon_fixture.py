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
import unittest


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


class HostDaemonCase(unittest.TestCase):
    """A test case with its own weightsyncd on the host backend (started per
    test, stopped and checked for a clean exit after it), a Trainer of it,
    and engine(): host engines registered and connected, closed after.
    FLAGS: the daemon's flags (a subclass may set its own)."""

    FLAGS = ("--notice_timeout_ms=2000",)

    def setUp(self):
        import weightsync
        # Its folder (socket, log) goes away with the test.
        self.daemon, self.target = start(self, *self.FLAGS)
        self.trainer = weightsync.Trainer(self.target, timeout=10)
        self.engines = []

    def tearDown(self):
        for e in self.engines:
            e.close()
        self.trainer.close()
        self.daemon.terminate()
        self.assertEqual(self.daemon.wait(timeout=10), 0)

    def engine(self, engine_id, params, **kwargs):
        """(Engine, {name: array}) of a host engine registered with `params`
        (register_host's kwargs; hooks= start()'s), once the daemon sees its
        control stream."""
        import weightsync
        e = weightsync.Engine(engine_id, self.target, timeout=10)
        hooks = kwargs.pop("hooks", {})
        arrays = e.register_host(params, **kwargs)
        e.start(**hooks)
        self.engines.append(e)
        for _ in range(100):  # until the daemon sees the control stream
            if any(s.engine_id == engine_id and s.connected
                   for s in self.trainer.status().engines):
                break
            time.sleep(0.02)
        return e, arrays
