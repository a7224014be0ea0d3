"""Issue 30: nothing a user does wrong crashes or wedges anything.

Everyday mistakes against the real weightsyncd on the host backend, each
with what the user must see (docs/python.md, "Mistakes and what you'll
see", is checked against MISTAKES below). Run by Bazel
(//client/python:mistakes_test); by hand:
WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 client/python/tests/test_mistakes.py
"""

import gc
import os
import subprocess
import sys
import textwrap
import time
import unittest

import numpy as np

if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import daemon_fixture  # noqa: E402  (next to this file)
import weightsync  # noqa: E402
from weightsync import WeightSyncError  # noqa: E402

CLIENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(test, body, *args, timeout=60):
    """Runs `body` in a fresh python3 with the client on its path; returns
    the CompletedProcess (stdout, stderr as text)."""
    code = f"import sys\nsys.path.insert(0, {CLIENT!r})\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout)


class ArraysOutliveTheirOwnerTest(daemon_fixture.HostDaemonCase):
    """Every array the client hands out keeps its mapping alive."""

    def test_arrays_of_a_dropped_engine_stay_readable(self):
        # Issue 30's repro: the Engine object goes, its arrays stay. Run in a
        # subprocess: it used to die of SIGSEGV (exit -11 here).
        p = run_script(self, """
            import gc, numpy as np, weightsync
            target = sys.argv[1]
            w = weightsync.Engine("worker0", target).register_host([("a", "FLOAT32", (1024,))])
            w["a"][:] = np.arange(1024)
            gc.collect()
            print(float(w["a"].sum()))
            # close() unlinks the name; the arrays still view the memory.
            e = weightsync.Engine("worker1", target)
            w1 = e.register_host([("b", "FLOAT16", (8, 8)), ("c", "INT32", (3,))])
            w1["c"][:] = [4, 5, 6]
            e.close()
            del e
            gc.collect()
            print(w1["c"].tolist(), w1["b"].shape)
            # A trainer's host source: its arrays outlive close() too.
            t = weightsync.Trainer(target)
            t.init_host()
            src = t.host_tensors([("x", "FLOAT32", (16,))])
            x = src["x"]
            buf = src.buffer
            x[:] = 7
            t.close()
            del t, src
            gc.collect()
            print(float(x.sum()), int(buf.size))
            """, self.target)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.split("\n")[:3],
                         [str(float(sum(range(1024)))), "[4, 5, 6] (8, 8)", "112.0 64"])
        # And no resource_tracker warning about "leaked" memory.
        self.assertNotIn("leaked", p.stderr)


if __name__ == "__main__":
    unittest.main()
