"""Issue 30: nothing a user does wrong crashes or wedges anything.

Everyday mistakes against the real weightsyncd on the host backend, each
with what the user must see (docs/python.md, "Mistakes and what you'll
see", is checked against MISTAKES below). Run by Bazel
(//client/python:mistakes_test); by hand:
WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 client/python/tests/test_mistakes.py
"""

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

# What the user did -> (exception, code, what they are told: a substring of
# the message). docs/python.md's table "Mistakes and what you'll see" must
# list every row with the same words (test_docs_table_matches).
MISTAKES = {
    "update() before init_host()": (
        "WeightSyncError", "FAILED_PRECONDITION",
        "no transfer group: call the Trainer's init_host(), init_nccl() or init_ipc() "
        "before update()"),
    "update([])": (
        "UsageError", "INVALID_ARGUMENT", "update() got no tensors"),
    "update(model.state_dict())": (
        None, "OK", "accepted: a {name: tensor} mapping is sent in its order"),
    "register_host([(\"w\", \"float32\", shape)])": (
        None, "OK", "accepted: numpy and torch dtype spellings (\"float32\", np.float16, "
        "torch.bfloat16)"),
    "register_host([(\"w\", \"complex64\", shape)])": (
        "UsageError", "INVALID_ARGUMENT",
        "dtype 'complex64' is not supported; use one of FLOAT32, BFLOAT16"),
    "an engine registers and never calls start()": (
        None, "OK", "updates of every engine go ahead without it and list it lost, saying "
        "engine 'e' is registered but has no open control stream"),
    "update(..., engine_ids=[an engine that never started])": (
        "WeightSyncError", "FAILED_PRECONDITION",
        "engine 'e' is registered but has no open control stream"),
    "the trainer is killed mid-update": (
        None, "OK", "the engine's on_dirty reason says trainer disconnected mid-stream after "
        "n of m chunks"),
    "an engine process dies without close()": (
        None, "OK", "no warning; the daemon removes its shared memory"),
    "arrays used after the Engine is gone": (
        None, "OK", "the arrays stay valid memory"),
    "an engine frees or moves its registered tensors": (
        None, "OK", "at its next pause or resume the engine tells the daemon, which "
        "unregisters it; the update reports it lost, naming the parameter whose memory moved"),
}


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


class ForgetfulEngineTest(daemon_fixture.HostDaemonCase):
    """No engine can wedge the daemon: one that registers and never starts
    is left out of updates of every engine (and reported), refused by name
    at once, and unregistered after --engine_start_grace_ms."""

    FLAGS = ("--notice_timeout_ms=2000", "--engine_start_grace_ms=1500")

    def test_an_engine_that_never_starts_is_left_out_then_expired(self):
        _, w = self.engine("good", [("a", "FLOAT32", (4,))])
        forgot = weightsync.Engine("forgot-start", self.target, timeout=10)
        forgot.register_host([("a", "FLOAT32", (4,))])   # and no start()
        self.trainer.init_host()
        a = np.arange(4, dtype=np.float32)
        # An update of every engine goes ahead without it and says why.
        result = self.trainer.update([("a", a)], version=1)
        np.testing.assert_array_equal(w["a"], a)
        by_id = {r.engine_id: r for r in result.engines}
        self.assertEqual(by_id["good"].version, 1)
        self.assertTrue(by_id["forgot-start"].lost)
        self.assertIn("no open control stream", by_id["forgot-start"].message)
        self.assertIn("Engine.start()", by_id["forgot-start"].message)
        # Named, it is refused at once: FAILED_PRECONDITION, not a retry.
        t0 = time.monotonic()
        with self.assertRaises(WeightSyncError) as ctx:
            self.trainer.update([("a", a)], version=2, engine_ids=["forgot-start"])
        self.assertLess(time.monotonic() - t0, 1.0)
        self.assertEqual(ctx.exception.code, "FAILED_PRECONDITION")
        self.assertIn("engine 'forgot-start' is registered but has no open control stream",
                      ctx.exception.message)
        with self.assertRaises(WeightSyncError) as ctx:
            self.trainer.pause(engine_ids=["forgot-start"])
        self.assertEqual(ctx.exception.code, "FAILED_PRECONDITION")
        # After the grace the daemon forgets it, and updates name no one lost.
        deadline = time.monotonic() + 10
        while "forgot-start" in [e.engine_id for e in self.trainer.status().engines]:
            self.assertLess(time.monotonic(), deadline, "never expired")
            time.sleep(0.1)
        result = self.trainer.update([("a", a + 1)], version=2)
        self.assertEqual([r.engine_id for r in result.engines], ["good"])
        # Its memory is gone from the daemon's mappings; the engine's own
        # arrays still work, and close() after expiry is quiet.
        with open(f"/proc/{self.daemon.pid}/maps") as f:
            self.assertNotIn(forgot._shm.name, f.read())
        forgot.close()

    def test_unregister_and_close_leave_nothing_registered(self):
        def ids():
            return sorted(e.engine_id for e in self.trainer.status().engines)
        e1 = weightsync.Engine("e1", self.target, timeout=10)
        e1.register_host([("a", "FLOAT32", (4,))])
        e1.close()        # never started: close() still unregisters
        self.assertEqual(ids(), [])
        e2, w2 = self.engine("e2", [("a", "FLOAT32", (4,))])
        e2.unregister()   # started: stream and registration go at once
        self.assertEqual(ids(), [])
        e2.unregister()   # idempotent
        e2.register_host([("a", "FLOAT32", (4,))])   # and it may come back
        e2.start()
        self.assertEqual(ids(), ["e2"])
        e2.close()
        self.assertEqual(ids(), [])


class ErrorsInTheUsersTermsTest(daemon_fixture.HostDaemonCase):
    """Every row of MISTAKES, as the user meets it."""

    def told(self, row, ctx):
        kind, code, words = MISTAKES[row]
        e = ctx.exception
        self.assertEqual(type(e).__name__, kind, row)
        self.assertEqual(e.code, code, row)
        words = words.replace("engine 'e'", "engine '{}'")
        self.assertIn(words.split("{}")[0], e.message, row)
        return e

    def test_update_before_init(self):
        self.engine("e0", [("a", "FLOAT32", (4,))])
        with self.assertRaises(WeightSyncError) as ctx:
            self.trainer.update([("a", np.zeros(4, np.float32))], version=1)
        e = self.told("update() before init_host()", ctx)
        self.assertIn("InitWeightTransfer", e.details)   # the daemon's own words

    def test_update_of_nothing(self):
        self.trainer.init_host()
        for nothing in ([], {}, iter(())):
            with self.assertRaises(WeightSyncError) as ctx:
                self.trainer.update(nothing, version=1)
            self.told("update([])", ctx)
            self.assertIsInstance(ctx.exception, ValueError)

    def test_a_state_dict_is_accepted(self):
        _, w = self.engine("e0", [("a", "FLOAT32", (4,)), ("b", "FLOAT16", (2, 3))])
        self.trainer.init_host()
        state = {"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 3), np.float32)}
        self.assertEqual(self.trainer.update(state, version=1).version, 1)
        np.testing.assert_array_equal(w["a"], state["a"])
        np.testing.assert_array_equal(w["b"], state["b"].astype(np.float16))
        import collections
        ordered = collections.OrderedDict(reversed(list(state.items())))
        self.assertEqual(self.trainer.update(ordered, version=2).version, 2)

    def test_dtype_spellings(self):
        class FakeTorchDtype:   # what str(torch.bfloat16) gives
            def __str__(self):
                return "torch.bfloat16"
        spellings = ["float32", "FLOAT32", "torch.float32", np.float32, np.dtype("float32"),
                     "<f4", "fp32"]
        params = [(f"p{i}", d, (3,)) for i, d in enumerate(spellings)]
        params += [("h", "half", (3,)), ("b", FakeTorchDtype(), (3,)), ("c", "bf16", (3,))]
        _, w = self.engine("e0", params)
        self.assertEqual({str(w[f"p{i}"].dtype) for i in range(len(spellings))}, {"float32"})
        self.assertEqual(str(w["h"].dtype), "float16")
        self.assertEqual(str(w["b"].dtype), "uint16")   # bf16 bits
        self.assertEqual(str(w["c"].dtype), "uint16")
        bad = weightsync.Engine("bad", self.target, timeout=10)
        with self.assertRaises(WeightSyncError) as ctx:
            bad.register_host([("w", "complex64", (3,))])
        self.told("register_host([(\"w\", \"complex64\", shape)])", ctx)
        self.assertIn("parameter 'w'", ctx.exception.message)
        self.assertIsInstance(ctx.exception, ValueError)
        bad.close()
        # The trainer's host_tensors takes the same spellings.
        self.trainer.init_host()
        src = self.trainer.host_tensors([("x", "float16", (2,))])
        self.assertEqual(str(src["x"].dtype), "float16")

    def test_trainer_killed_mid_update_says_so(self):
        reasons = []
        _, w = self.engine("e0", [("a", "FLOAT32", (1024,))],
                           hooks={"on_dirty": reasons.append})
        trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {CLIENT!r})
            from weightsync._proto import Stub, channel, v1
            stub = Stub(channel({self.target!r}), "TrainerService", 10)
            stub.call("InitWeightTransfer", backend=v1.BACKEND_HOST)
            req = v1.StartWeightUpdateRequest(update_id="u1", target_version=1, chunk_bytes=1024)
            req.tensors.add(name="a", dtype=v1.FLOAT32, shape=[1024])
            stub.call("StartWeightUpdate", req)
            def chunks():
                yield v1.PushChunksRequest(update_id="u1", chunk_index=0, data=bytes(1024))
                print("pushed", flush=True)
                time.sleep(60)
            stub.call("PushChunks", chunks(), timeout=60)
            """)], stdout=subprocess.PIPE, text=True)
        try:
            self.assertEqual(trainer.stdout.readline().strip(), "pushed")
            time.sleep(0.3)   # the chunk is in
        finally:
            trainer.kill()
            trainer.wait()
            trainer.stdout.close()
        deadline = time.monotonic() + 10
        while not reasons and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(len(reasons), 1, "no dirty notice")
        self.assertIn("trainer disconnected mid-stream after 1 of 4 chunks", reasons[0])
        self.assertNotEqual(reasons[0], "superseded")


class DocsTableTest(unittest.TestCase):
    def test_docs_table_matches(self):
        """docs/python.md's "Mistakes and what you'll see" has a row for
        every MISTAKES entry with the same words (and code)."""
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(here, "..", "..", "..", "docs", "python.md")
        if not os.path.exists(path):   # the installed package's run has no docs
            self.skipTest("docs/python.md is not in this tree")
        with open(path) as f:
            text = f.read()
        section = text.split("## Mistakes and what you'll see", 1)[1].split("\n## ", 1)[0]
        rows = [line for line in section.splitlines() if line.startswith("| ")]
        for did, (kind, code, words) in MISTAKES.items():
            found = [r for r in rows if r.split(" | ")[0].strip("| `") == did]
            self.assertEqual(len(found), 1, f"docs/python.md has no row for {did!r}")
            for part in (kind, code, words):
                if part not in (None, "OK"):
                    self.assertIn(part, found[0], did)

    def test_warm_pairs(self):
        # What init_nccl()/init_ipc() warms (no GPU here: the choice alone).
        from weightsync import _warm
        from weightsync._proto import v1
        status = v1.GetStatusResponse()
        e = status.engines.add(engine_id="e")
        e.layout.add(name="a", dtype=v1.BFLOAT16, shape=[4])
        e.layout.add(name="b", dtype=v1.FLOAT32, shape=[4])
        q = e.layout.add(name="q", dtype=v1.FLOAT8_E4M3FN, shape=[4])
        q.quantization.SetInParent()
        self.assertEqual(_warm.receipt_pairs(status),
                         [("BFLOAT16", "BFLOAT16"), ("FLOAT32", "BFLOAT16"),
                          ("FLOAT32", "FLOAT32")])


class FreedEngineTest(daemon_fixture.HostDaemonCase):
    """An engine whose registered tensors no longer hold the registered
    memory is noticed at the next pause or resume and reported lost."""

    def test_an_engine_that_freed_its_weights_is_not_ready(self):
        from weightsync._watch import MemoryWatch

        class TorchLike:   # what the check reads of a torch tensor
            def __init__(self):
                self.ptr = 0x7f0000001000

            def data_ptr(self):
                if self.ptr != 0x7f0000001000:
                    # A slow check: a report sent after the pause's Ack
                    # loses the race to the commit every time.
                    time.sleep(0.2)
                return self.ptr

            def untyped_storage(self):
                return self

        _, wa = self.engine("a", [("w", "FLOAT32", (4,))])
        b, wb = self.engine("b", [("w", "FLOAT32", (4,))])
        weight = TorchLike()
        b._watch = MemoryWatch({"w": weight})   # as register_torch records it
        self.trainer.init_host()
        w = np.arange(4, dtype=np.float32)
        first = self.trainer.update([("w", w)], version=1)
        self.assertEqual(sorted((r.engine_id, r.lost) for r in first.engines),
                         [("a", False), ("b", False)])
        weight.ptr = 0x7f0000200000   # the engine freed it and allocated anew
        second = self.trainer.update([("w", w + 1)], version=2)
        by_id = {r.engine_id: r for r in second.engines}
        self.assertEqual(by_id["a"].version, 2)
        self.assertTrue(by_id["b"].lost)
        # Reported at the pause, before its Ack: nothing of version 2 was
        # written to b (after the Ack, the report raced the update).
        np.testing.assert_array_equal(wb["w"], w)
        np.testing.assert_array_equal(wa["w"], w + 1)
        self.assertIn("'b' reported that its registered memory is no longer its weights",
                      by_id["b"].message)
        self.assertIn("parameter 'w': its data pointer moved from 0x7f0000001000 to "
                      "0x7f0000200000", by_id["b"].message)
        self.assertIsNotNone(b.lost)
        # Not READY: no longer registered; the next update is a's alone.
        self.assertEqual([e.engine_id for e in self.trainer.status().engines], ["a"])
        self.assertEqual([r.engine_id for r in
                          self.trainer.update([("w", w)], version=3).engines], ["a"])


class RestartsTest(unittest.TestCase):
    """A daemon restarted on the same socket is reached at once; SIGTERM
    with idle clients stops it quickly."""

    def setUp(self):
        import shutil
        import tempfile
        self.work = tempfile.mkdtemp(prefix="wspy.", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.work, True)
        self.sock = os.path.join(self.work, "d.sock")
        self.target = "unix:" + self.sock
        self.daemons = []
        self.addCleanup(self.stop_all)

    def spawn(self, *flags):
        log = open(os.path.join(self.work, f"daemon{len(self.daemons)}.log"), "w")
        d = subprocess.Popen([os.environ["WEIGHTSYNCD"], f"--socket={self.sock}", *flags],
                             stderr=log)
        log.close()
        self.daemons.append(d)
        return d

    def stop_all(self):
        for d in self.daemons:
            if d.poll() is None:
                d.kill()
                d.wait()

    def trainer_and_engine(self):
        """A Trainer and a started engine "e0" (one float32 [4] parameter
        "a") of the daemon at self.target, both closed at cleanup; returns
        the Trainer."""
        trainer = weightsync.Trainer(self.target, timeout=10)
        self.addCleanup(trainer.close)
        engine = weightsync.Engine("e0", self.target, timeout=10)
        self.addCleanup(engine.close)
        engine.register_host([("a", "FLOAT32", (4,))])
        engine.start()
        return trainer

    def wait_listening(self, timeout=10):
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.sock):
            self.assertLess(time.monotonic(), deadline, "daemon never listened")
            time.sleep(0.001)
        return time.monotonic()

    def test_a_connected_client_reaches_a_restarted_daemon_at_once(self):
        import threading
        first = self.spawn()
        self.wait_listening()
        trainer = self.trainer_and_engine()
        self.assertEqual(trainer.world_size("host"), 1)
        first.terminate()
        self.assertEqual(first.wait(timeout=10), 0)
        # The client calls while the daemon is away (the call retries), and
        # the new daemon comes up meanwhile.
        answered = {}

        def ask():
            t = time.monotonic()
            answered["status"] = trainer.status()
            answered["at"] = time.monotonic()
            answered["took"] = answered["at"] - t

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(0.3)
        self.spawn()
        listening = self.wait_listening()
        asker.join(timeout=10)
        self.assertIn("status", answered, "status() never answered")
        self.assertLess(answered["at"] - listening, 0.2,
                        f"answered {answered['at'] - listening:.3f} s after the daemon listened")
        # A Start that never reached the daemon is retried too; the engine
        # re-registered by itself.
        deadline = time.monotonic() + 5
        while not any(e.connected for e in trainer.status().engines):
            self.assertLess(time.monotonic(), deadline, "the engine never came back")
            time.sleep(0.02)
        trainer.init_host()
        self.assertEqual(trainer.update([("a", np.ones(4, np.float32))], version=1).version, 1)

    def test_sigterm_with_idle_clients_stops_at_once(self):
        d = self.spawn()
        self.wait_listening()
        trainer = self.trainer_and_engine()   # an open control stream, nothing on it
        trainer.init_host()
        trainer.update([("a", np.ones(4, np.float32))], version=1)
        time.sleep(0.2)         # idle connections now
        t0 = time.monotonic()
        d.terminate()
        self.assertEqual(d.wait(timeout=10), 0)
        took = time.monotonic() - t0
        if took >= 0.5:
            with open(os.path.join(self.work, "daemon0.log")) as f:
                sys.stderr.write(f.read())
        self.assertLess(took, 0.5, f"SIGTERM took {took:.2f} s")


if __name__ == "__main__":
    unittest.main()
