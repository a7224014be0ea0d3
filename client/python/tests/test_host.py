"""The Python client against the real weightsyncd on the host backend.

Run by Bazel (//client/python:host_test) with WEIGHTSYNCD pointing at the
daemon binary; also by hand: WEIGHTSYNCD=bazel-bin/daemon/weightsyncd
python3 client/python/tests/test_host.py
"""

import os
import sys
import unittest

import numpy as np

# The source tree's package, unless WEIGHTSYNC_TEST_INSTALLED=1: then the
# installed one (tests/pip_install_test.sh runs the suite that way).
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import daemon_fixture  # noqa: E402  (next to this file)
import weightsync  # noqa: E402
from weightsync import WeightSyncError  # noqa: E402
from weightsync._tensors import build_manifest  # noqa: E402
from weightsync._proto import v1  # noqa: E402


class HostBackendTest(daemon_fixture.HostDaemonCase):
    def test_updates_convert_and_commit_versions(self):
        events = []
        engine, w = self.engine(
            "e0", [("a", "FLOAT16", (33, 17)), ("b", "FLOAT32", (5,))],
            hooks={"on_pause": lambda mode: events.append(("pause", mode)),
                   "on_resume": lambda: events.append(("resume",)),
                   "on_new_version": lambda v: events.append(("version", v))})
        self.trainer.init_host()
        self.assertEqual(self.trainer.world_size(), 1)
        rng = np.random.default_rng(0)
        for version in (1, 2, 3):
            a = rng.standard_normal((33, 17)).astype(np.float32)
            b = rng.standard_normal(5).astype(np.float32)
            result = self.trainer.update([("a", a), ("b", b)], version=version, chunk_bytes=1024)
            self.assertEqual(result.version, version)
            # float32 -> float16 on the way in, round to nearest even.
            np.testing.assert_array_equal(w["a"], a.astype(np.float16))
            np.testing.assert_array_equal(w["b"], b)
            self.assertTrue(engine.wait_for_version(version, 5))
        self.assertEqual(engine.version, 3)
        self.assertIn(("pause", "PAUSE_MODE_KEEP"), events)
        self.assertIn(("version", 3), events)
        self.assertEqual(events[-1], ("resume",))
        status = self.trainer.status()
        self.assertEqual(status.engines[0].version, 3)
        self.assertEqual(status.update.phase, "committed")

    def test_engine_ids_with_any_characters_get_shared_memory(self):
        # ":" (allowed in ids) used to crash Python's shared-memory
        # resource tracker.
        engine, w = self.engine("node-1:gpu0", [("a", "FLOAT32", (7,))])
        self.trainer.init_host()
        a = np.arange(7, dtype=np.float32)
        self.assertEqual(self.trainer.update([("a", a)], version=1).version, 1)
        np.testing.assert_array_equal(w["a"], a)
        self.assertEqual([s.engine_id for s in self.trainer.status().engines], ["node-1:gpu0"])
        # A refused registration leaves no shared memory behind.
        bad = weightsync.Engine("bad/id", self.target, timeout=10)
        with self.assertRaises(WeightSyncError) as ctx:
            bad.register_host([("a", "FLOAT32", (7,))])
        self.assertEqual(ctx.exception.code, "INVALID_ARGUMENT")
        self.assertFalse([f for f in os.listdir("/dev/shm") if f.startswith("weightsync-bad_id-")])

    def test_shared_memory_of_another_namespace_is_never_taken_over(self):
        # Processes in different pid namespaces (containers, sandboxed
        # tests) share /dev/shm and can have this process's pid. An object
        # already under the name the client draws belongs to such an engine:
        # it must be left alone and another name drawn. (The client used to
        # unlink it and take the name, so the other engine's daemon could
        # map this engine's memory.)
        import secrets
        from multiprocessing import shared_memory
        from weightsync import _shm as shm_mod
        first, second = secrets.token_hex(4), secrets.token_hex(4)  # this run's own
        taken = f"weightsync-e7-{os.getpid()}-{first}"
        other = shared_memory.SharedMemory(name=taken, create=True, size=64)
        try:
            other.buf[:4] = b"live"
            drawn = iter([first, second])
            real = shm_mod.secrets.token_hex
            shm_mod.secrets.token_hex = lambda n: next(drawn)
            try:
                _, w = self.engine("e7", [("a", "FLOAT32", (7,))])
            finally:
                shm_mod.secrets.token_hex = real
            self.assertEqual(self.engines[-1]._shm.name, f"weightsync-e7-{os.getpid()}-{second}")
            self.trainer.init_host()
            a = np.arange(7, dtype=np.float32)
            self.assertEqual(self.trainer.update([("a", a)], version=1).version, 1)
            np.testing.assert_array_equal(w["a"], a)
            peek = shared_memory.SharedMemory(name=taken)
            self.assertEqual(bytes(peek.buf[:4]), b"live")
            peek.close()
        finally:
            other.close()
            other.unlink()

    def test_check_reads_the_receipt_an_update_would_give(self):
        _, w = self.engine("e0", [("a", "BFLOAT16", (64, 3)), ("b", "FLOAT32", (5,))])
        self.trainer.init_host()
        rng = np.random.default_rng(3)
        r = self.trainer.update([("a", rng.standard_normal((64, 3)).astype(np.float32)),
                                 ("b", rng.standard_normal(5).astype(np.float32))], version=4)
        got = self.trainer.check("e0")
        self.assertEqual((got.version, got.receipt.checksum), (4, r.engines[0].receipt.checksum))
        w["b"][2] += 1  # the engine's memory changes: so does its receipt
        self.assertNotEqual(self.trainer.check("e0").receipt.checksum, got.receipt.checksum)
        with self.assertRaises(WeightSyncError) as ctx:
            self.trainer.check("nosuch")
        self.assertEqual(ctx.exception.code, "NOT_FOUND")

    def test_staged_update_pauses_only_for_the_commit(self):
        events = []
        engine, w = self.engine("st", [("a", "FLOAT32", (64, 64))],
                                hooks={"on_pause": lambda mode: events.append("pause"),
                                       "on_resume": lambda: events.append("resume")})
        self.trainer.init_host()
        a = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
        result = self.trainer.update([("a", a)], version=1, mode="staged", chunk_bytes=1024)
        np.testing.assert_array_equal(w["a"], a)
        self.assertEqual(events, ["pause", "resume"])
        self.assertGreater(result.pause_seconds, 0)
        self.assertLess(result.pause_seconds, result.seconds)

    def test_receipts_catch_a_difference_and_bf16_rounds_like_the_daemon(self):
        from weightsync import receipts
        self.engine("rb", [("a", "BFLOAT16", (8, 8))])
        self.trainer.init_host()
        a = np.random.default_rng(2).standard_normal((8, 8)).astype(np.float32)
        a[0, 0] = 1.0 + 2.0 ** -8  # a tie: rounds to even
        result = self.trainer.update([("a", a)], version=1, verify=True)
        self.assertTrue(result.engines[0].HasField("receipt"))
        layout = {e.engine_id: e.layout for e in
                  self.trainer._stub.call("GetStatus", include_layouts=True).engines}["rb"]
        raw = a.reshape(-1).view(np.uint8)
        good = receipts.expected_receipt(layout, {"a": ("FLOAT32", (8, 8), raw)})
        self.assertEqual(good[0], result.engines[0].receipt.checksum)
        b = a.copy()
        b[3, 3] *= -1
        bad = receipts.expected_receipt(layout, {"a": ("FLOAT32", (8, 8), b.reshape(-1).view(np.uint8))})
        self.assertNotEqual(bad[0], result.engines[0].receipt.checksum)

    def test_sparse_patch_sends_only_what_changed(self):
        from weightsync import sparse
        _, w = self.engine("sp", [("a", "FLOAT32", (100, 100)), ("b", "FLOAT32", (10,))])
        self.trainer.init_host()
        rng = np.random.default_rng(3)
        a1 = rng.standard_normal((100, 100)).astype(np.float32)
        b1 = np.zeros(10, np.float32)
        self.trainer.update([("a", a1), ("b", b1)], version=1)
        a2 = a1.copy()
        a2.reshape(-1)[rng.choice(a2.size, 100, replace=False)] += 1  # 1%
        b2 = np.arange(10, dtype=np.float32)                         # 90%
        patch = sparse.diff(a1, a2, max_density=0.05)
        self.assertEqual(len(patch.indices), 100)
        self.assertIsNone(sparse.diff(b1, b2, max_density=0.05))  # dense then
        result = self.trainer.update([("a", patch), ("b", b2)], version=2, base_version=1)
        np.testing.assert_array_equal(w["a"], a2)
        np.testing.assert_array_equal(w["b"], b2)
        self.assertEqual(patch.index_bytes, 4)  # 4-byte indices: 8 bytes a change
        self.assertLess(result.bytes, a2.nbytes * 0.02 + 1024)
        with self.assertRaises(WeightSyncError) as e:  # engines are at 2 now
            self.trainer.update([("a", patch)], version=3, base_version=1)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertIn("is at version 2", e.exception.message)
        # int64 indices still work (tensors above 2^32 elements need them).
        a3 = a2.copy()
        a3.reshape(-1)[[7, 4242, 9999]] = [1.5, -2.5, 3.5]
        wide = sparse.SparsePatch([7, 4242, 9999], np.float32([1.5, -2.5, 3.5]),
                                  a3.shape, index_bytes=8)
        result = self.trainer.update([("a", wide)], version=3, base_version=2)
        np.testing.assert_array_equal(w["a"], a3)
        self.assertGreaterEqual(result.bytes, 3 * (8 + 4))
        with self.assertRaises(ValueError):
            sparse.SparsePatch([0], [1.0], (10,), index_bytes=2)
        # Nothing changed: a one-element patch (element 0, unchanged), which
        # still travels as a patch and so still checks the base version.
        same = sparse.diff(a3, a3.copy())
        self.assertEqual((list(same.indices), same.nnz), ([0], 1))
        result = self.trainer.update([("a", same), ("b", sparse.diff(b2, b2.copy()))],
                                     version=4, base_version=3)
        self.assertEqual(result.version, 4)
        np.testing.assert_array_equal(w["a"], a3)
        np.testing.assert_array_equal(w["b"], b2)
        with self.assertRaises(WeightSyncError) as e:
            self.trainer.update([("a", same)], version=5, base_version=3)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        with self.assertRaises(ValueError):   # sparse_nnz 0 would mean dense
            self.trainer.update([("a", sparse.SparsePatch([], np.float32([]), a3.shape))],
                                version=5, base_version=4)

    def test_segments_fuse_checkpoint_tensors(self):
        # qkv [6, 4] = q [4, 4] rows then k [2, 4] rows.
        segs = {"qkv": [
            {"source": "q", "source_shape": [4, 4], "row_count": 4, "col_count": 4},
            {"source": "k", "source_shape": [2, 4], "row_count": 2, "col_count": 4,
             "dest_offset": 16}]}
        _, w = self.engine("fused", [("qkv", "FLOAT32", (6, 4))], segments=segs)
        self.trainer.init_host()
        q = np.arange(16, dtype=np.float32).reshape(4, 4)
        k = -np.arange(8, dtype=np.float32).reshape(2, 4)
        self.trainer.update([("q", q), ("k", k)], version=1)
        np.testing.assert_array_equal(w["qkv"], np.concatenate([q, k]))

    def test_parameters_without_segments_register_as_table_rows(self):
        # register_host sends plain parameters as parameter_table rows and
        # those with segments as messages; the daemon lays them out and
        # serves them back (GetStatus layouts) as the messages they stand
        # for, and an update writes them bit-exactly.
        params = [("qkv", "FLOAT32", (6, 4)), ("norm", "BFLOAT16", (5,)),
                  ("scalar", "FLOAT32", ()), ("none", "FLOAT16", (0, 3)),
                  ("experts", "FLOAT32", (2, 3, 4))]
        segs = {"qkv": [
            {"source": "q", "source_shape": [4, 4], "row_count": 4, "col_count": 4},
            {"source": "k", "source_shape": [2, 4], "row_count": 2, "col_count": 4,
             "dest_offset": 16}]}
        engine, w = self.engine("tab", params, segments=segs)
        request = engine._registration
        self.assertEqual([p.name for p in request.parameters], ["qkv"])
        table = request.parameter_table
        self.assertEqual(list(table.names), ["norm", "scalar", "none", "experts"])
        self.assertEqual(list(table.ranks), [1, 0, 2, 3])
        self.assertEqual(list(table.dims), [5, 0, 3, 2, 3, 4])
        self.assertEqual(list(table.allocations), [0, 0, 0, 0])
        layout = {e.engine_id: e.layout for e in
                  self.trainer._stub.call("GetStatus", include_layouts=True).engines}["tab"]
        self.assertEqual([p.name for p in layout], ["qkv", "norm", "scalar", "none", "experts"])
        for p, (name, dtype, shape), off in zip(layout[1:], params[1:], table.offsets):
            self.assertEqual(p, v1.Parameter(
                name=name, dtype=getattr(v1, dtype), shape=shape, offset=off))
        self.assertEqual(len(layout[0].segments), 2)
        self.trainer.init_host()
        rng = np.random.default_rng(7)
        q = rng.standard_normal((4, 4)).astype(np.float32)
        k = rng.standard_normal((2, 4)).astype(np.float32)
        experts = rng.standard_normal((2, 3, 4)).astype(np.float32)
        scalar = np.array(3.5, np.float32)
        self.trainer.update([("q", q), ("k", k), ("experts", experts), ("scalar", scalar),
                             ("none", np.zeros((0, 3), np.float16))], version=1)
        np.testing.assert_array_equal(w["qkv"], np.concatenate([q, k]))
        np.testing.assert_array_equal(w["experts"], experts)
        self.assertEqual(w["scalar"].tobytes(), scalar.tobytes())
        self.assertTrue(engine.wait_for_version(1))

    def test_bad_input_names_the_culprit_and_writes_nothing(self):
        _, w = self.engine("e1", [("a", "FLOAT32", (4, 4))])
        self.trainer.init_host()
        self.trainer.update([("a", np.ones((4, 4), np.float32))], version=5)
        before = w["a"].copy()
        with self.assertRaises(WeightSyncError) as e:
            self.trainer.update([("ghost", np.zeros(3, np.float32))], version=6)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("'ghost'", e.exception.message)
        with self.assertRaises(WeightSyncError) as e:
            self.trainer.update([("a", np.zeros((2, 2), np.float32))], version=6)
        self.assertIn("shape [2, 2] does not match", e.exception.message)
        with self.assertRaises(WeightSyncError) as e:
            self.trainer.update([("a", np.zeros((4, 4), np.float32))], version=4)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertIn("engine 'e1' version 5", e.exception.message)
        np.testing.assert_array_equal(w["a"], before)
        with self.assertRaises(ValueError):
            self.trainer.update([("a", np.zeros(2, np.complex64))], version=6)
        self.trainer.update([("a", np.full((4, 4), 2, np.float32))], version=6)
        np.testing.assert_array_equal(w["a"], np.full((4, 4), 2, np.float32))

    def test_pause_context_and_refusing_engine(self):
        engine, _ = self.engine("e2", [("a", "FLOAT32", (2,))])
        with self.trainer.paused():
            self.assertTrue(engine.paused)
            self.assertEqual(self.trainer.status().engines[0].state,
                             weightsync._proto.v1.ENGINE_PAUSED)
        self.assertFalse(engine.paused)

        def refuse(mode):
            raise RuntimeError("mid-generation")

        self.engine("e3", [("a", "FLOAT32", (2,))], hooks={"on_pause": refuse})
        with self.assertRaises(WeightSyncError) as e:
            self.trainer.pause(timeout=2)
        self.assertIn("e3", e.exception.message)
        self.assertIn("mid-generation", e.exception.message)
        self.assertFalse(engine.paused)  # all or nothing: e2 was resumed

    def test_a_groupless_trainer_that_dies_releases_its_pauses(self):
        """A Trainer that pauses before any init_* holds its pauses (an
        empty Liveness group): SIGKILLed, its engines resume within a second,
        not at the daemon's idle deadline (5 min by default, as here)."""
        import signal
        import subprocess
        import time
        engine, _ = self.engine("e", [("a", "FLOAT32", (2,))])
        code = ("import sys, time, weightsync\n"
                "t = weightsync.Trainer(sys.argv[1], timeout=10)\n"
                "t.pause()\n"
                "print('paused', flush=True)\n"
                "time.sleep(60)\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        child = subprocess.Popen([sys.executable, "-c", code, self.target],
                                 stdout=subprocess.PIPE, text=True, env=env)
        self.addCleanup(child.kill)
        self.assertEqual(child.stdout.readline().strip(), "paused")
        self.assertTrue(engine.paused)
        time.sleep(0.3)   # alive: its pauses last
        self.assertTrue(engine.paused)
        t0 = time.monotonic()
        child.send_signal(signal.SIGKILL)
        child.wait()
        while engine.paused and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        self.assertFalse(engine.paused, "still paused 5 s after the trainer died")
        self.assertLess(time.monotonic() - t0, 1.0)

    def test_llama_layout_helpers_on_a_tensor_parallel_pair(self):
        from weightsync import layouts
        config = {"vocab_size": 1003, "hidden_size": 64, "intermediate_size": 160,
                  "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "model_type": "qwen3"}
        ranks = []
        for r in range(2):
            params, segments = layouts.llama_engine_layout(config, r, 2, dtype="FLOAT16")
            ranks.append(self.engine(f"tp{r}", params, segments=segments)[1])
        self.trainer.init_host()
        rng = np.random.default_rng(1)
        ckpt = {name: rng.standard_normal(shape).astype(np.float32)
                for name, shape in layouts.checkpoint_shapes(config)}
        self.assertIn("lm_head.weight", ckpt)
        self.assertIn("model.layers.1.self_attn.k_norm.weight", ckpt)
        # Receipts: the daemon's checksums of both ranks match what this
        # client computes from the checkpoint through their segments.
        self.trainer.update(ckpt.items(), version=1, chunk_bytes=4096, verify=True)
        h = lambda a: a.astype(np.float16)  # noqa: E731
        qs, kvs, is_, vs = 32, 16, 80, 512
        for r, w in enumerate(ranks):
            p = "model.layers.1."
            np.testing.assert_array_equal(w[p + "self_attn.qkv_proj.weight"], h(np.concatenate([
                ckpt[p + "self_attn.q_proj.weight"][r * qs:(r + 1) * qs],
                ckpt[p + "self_attn.k_proj.weight"][r * kvs:(r + 1) * kvs],
                ckpt[p + "self_attn.v_proj.weight"][r * kvs:(r + 1) * kvs]])))
            np.testing.assert_array_equal(w[p + "self_attn.o_proj.weight"],
                                          h(ckpt[p + "self_attn.o_proj.weight"][:, r * qs:(r + 1) * qs]))
            np.testing.assert_array_equal(w[p + "mlp.gate_up_proj.weight"], h(np.concatenate([
                ckpt[p + "mlp.gate_proj.weight"][r * is_:(r + 1) * is_],
                ckpt[p + "mlp.up_proj.weight"][r * is_:(r + 1) * is_]])))
            np.testing.assert_array_equal(w[p + "mlp.down_proj.weight"],
                                          h(ckpt[p + "mlp.down_proj.weight"][:, r * is_:(r + 1) * is_]))
            np.testing.assert_array_equal(w["model.norm.weight"], h(ckpt["model.norm.weight"]))
            rows = ckpt["lm_head.weight"][r * vs:(r + 1) * vs]
            np.testing.assert_array_equal(w["lm_head.weight"][:len(rows)], h(rows))
            self.assertFalse(w["lm_head.weight"][len(rows):].any())  # padding untouched
        with self.assertRaises(ValueError):
            layouts.llama_engine_layout(config, 0, 3)  # 4 heads over 3 ranks

    def spy(self, trainer):
        """Records (method, request or fields) of every unary call `trainer`
        makes (RegisterSource, StartWeightUpdate, ...)."""
        calls = []
        real = trainer._stub.call

        def call(name, request=None, timeout=None, **fields):
            calls.append((name, request if request is not None else fields))
            return real(name, request, timeout, **fields)

        trainer._stub.call = call
        return calls

    def test_registered_source_is_reused_and_registered_again_when_needed(self):
        from weightsync import receipts
        _, w = self.engine("src", [("a", "FLOAT32", (4, 4)), ("b", "BFLOAT16", (8,)),
                                   ("c", "FLOAT32", (3,))])
        self.trainer.init_host()
        calls = self.spy(self.trainer)

        def names(method):
            return [r for m, r in calls if m == method]

        rng = np.random.default_rng(11)
        a = rng.standard_normal((4, 4)).astype(np.float32)
        b = rng.standard_normal(8).astype(np.float32)
        for version in (1, 2, 3):
            a += 1   # values change in place, as a trainer's do
            b[version] = -b[version]
            result = self.trainer.update([("a", a), ("b", b)], version=version)
            np.testing.assert_array_equal(w["a"], a)
            np.testing.assert_array_equal(  # bfloat16, rounded to nearest even
                w["b"].view(np.uint16),
                receipts.convert_bits(b.view(np.uint8), "FLOAT32", "BFLOAT16").astype(np.uint16))
            self.assertTrue(result.engines[0].HasField("receipt"))
        # One source for the three steps; each Start names it and no tensors.
        self.assertEqual(len(names("RegisterSource")), 1)
        starts = names("StartWeightUpdate")
        self.assertEqual(len(starts), 3)
        source_id = starts[0].source_id
        self.assertTrue(source_id)
        for s in starts:
            self.assertEqual((s.source_id, len(s.tensors)), (source_id, 0))

        # A new tensor: a new source.
        c = np.arange(3, dtype=np.float32)
        self.trainer.update([("a", a), ("b", b), ("c", c)], version=4)
        np.testing.assert_array_equal(w["c"], c)
        self.assertEqual(len(names("RegisterSource")), 2)
        self.assertEqual(len(names("RegisterSource")[1].tensors), 3)
        self.assertNotEqual(names("StartWeightUpdate")[-1].source_id, source_id)
        # A new shape: a new source, which the engine's layout refuses at
        # Start as an inline manifest would be; nothing is written.
        before = w["a"].copy()
        with self.assertRaises(WeightSyncError) as e:
            self.trainer.update([("a", np.zeros((2, 8), np.float32)), ("b", b), ("c", c)],
                                version=5)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("shape [2, 8] does not match", e.exception.message)
        self.assertEqual(len(names("RegisterSource")), 3)
        np.testing.assert_array_equal(w["a"], before)

        # The trainer's own init_host: a new group, a new source.
        self.trainer.init_host()
        self.trainer.update([("a", a), ("b", b), ("c", c)], version=5)
        self.assertEqual(len(names("RegisterSource")), 4)
        # Another trainer forms a new group behind this one's back: its
        # source id is unknown now (NOT_FOUND), and the update registers
        # again and retries by itself.
        other = weightsync.Trainer(self.target, timeout=10)
        try:
            other.init_host()
        finally:
            other.close()
        del calls[:]
        a += 1
        self.assertEqual(self.trainer.update([("a", a), ("b", b), ("c", c)], version=6).version, 6)
        np.testing.assert_array_equal(w["a"], a)
        self.assertEqual([m for m, _ in calls if m in ("StartWeightUpdate", "RegisterSource")],
                         ["StartWeightUpdate", "RegisterSource", "StartWeightUpdate"])
        self.assertNotEqual(calls[0][1].source_id, names("StartWeightUpdate")[-1].source_id)

        # Receipts are still checked: a wrong expectation is DATA_LOSS
        # naming the engine (the engine did get the bytes).
        real = receipts.expected_receipt

        def wrong(*args, **kwargs):
            checksum, params, nbytes = real(*args, **kwargs)
            return checksum ^ 1, params, nbytes

        receipts.expected_receipt = wrong
        try:
            a += 1
            with self.assertRaises(WeightSyncError) as e:
                self.trainer.update([("a", a), ("b", b), ("c", c)], version=7)
        finally:
            receipts.expected_receipt = real
        self.assertEqual(e.exception.code, "DATA_LOSS")
        self.assertIn("engine 'src'", e.exception.message)
        np.testing.assert_array_equal(w["a"], a)
        # The daemon's receipt is the function of what the engine holds.
        a += 1
        result = self.trainer.update([("a", a), ("b", b), ("c", c)], version=8)
        layout = {e.engine_id: e.layout for e in
                  self.trainer._stub.call("GetStatus", include_layouts=True).engines}["src"]
        sent = {n: (d, t.shape, t.reshape(-1).view(np.uint8))
                for n, d, t in (("a", "FLOAT32", a), ("b", "FLOAT32", b), ("c", "FLOAT32", c))}
        self.assertEqual(receipts.expected_receipt(layout, sent)[0],
                         result.engines[0].receipt.checksum)
        self.assertEqual(receipts.expected_receipt(layout, sent, layout_key="t")[0],
                         result.engines[0].receipt.checksum)

    def test_host_tensors_update_in_one_call_from_the_trainers_memory(self):
        from weightsync import layouts, receipts
        config = {"vocab_size": 1003, "hidden_size": 64, "intermediate_size": 160,
                  "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "model_type": "qwen3"}
        ranks = []
        for r in range(2):   # fused, sliced and padded bfloat16 parameters
            params, segments = layouts.llama_engine_layout(config, r, 2, dtype="BFLOAT16")
            ranks.append(self.engine(f"tp{r}", params, segments=segments)[1])
        with self.assertRaises(ValueError) as e:
            self.trainer.host_tensors([("w", "FLOAT32", (2,))])
        self.assertIn("init_host", str(e.exception))
        self.trainer.init_host()
        calls = self.spy(self.trainer)
        shapes = layouts.checkpoint_shapes(config)
        src = self.trainer.host_tensors([(n, "FLOAT32", s) for n, s in shapes])
        self.assertEqual(list(src), [n for n, _ in shapes])
        rng = np.random.default_rng(5)
        for version in (1, 2):
            for t in src.values():   # a training step writes in place
                t[...] = rng.standard_normal(t.shape)
            result = self.trainer.update(src, version=version)
            self.assertEqual(result.version, version)
            for r, w in enumerate(ranks):
                self.assertTrue(result.engines[r].HasField("receipt"))
                o = "model.layers.1.self_attn.o_proj.weight"
                np.testing.assert_array_equal(
                    w[o].view(np.uint16), receipts.convert_bits(
                        np.ascontiguousarray(src[o][:, r * 32:(r + 1) * 32]).view(np.uint8),
                        "FLOAT32", "BFLOAT16").astype(np.uint16).reshape(w[o].shape))
        # One registration; each update one Start with finish, no chunks.
        methods = [m for m, _ in calls]
        self.assertEqual(methods.count("RegisterSource"), 1)
        self.assertNotIn("PushChunks", methods)
        self.assertNotIn("FinishWeightUpdate", methods)
        starts = [r for m, r in calls if m == "StartWeightUpdate"]
        self.assertTrue(all(s.finish and s.source_id for s in starts))
        # The same arrays as (name, tensor) pairs take the same path.
        self.trainer.update(list(src.items()), version=3)
        self.assertTrue([r for m, r in calls if m == "StartWeightUpdate"][-1].finish)
        # The receipts' one-index read of the shared memory equals joining
        # the payloads (the path of any other update).
        layout = {e.engine_id: e.layout for e in
                  self.trainer._stub.call("GetStatus", include_layouts=True).engines}["tp1"]
        copied = build_manifest([(n, t.copy()) for n, t in src.items()])
        self.assertEqual(receipts.expected_receipt(layout, src.sent(), layout_key="g"),
                         receipts.expected_receipt(layout, copied.sent()))
        self.assertEqual(receipts.expected_receipt(layout, src.sent(), layout_key="g")[0],
                         self.trainer.last_results[0].engines[1].receipt.checksum)
        # A new group forgets the source: the next update registers again.
        other = weightsync.Trainer(self.target, timeout=10)
        try:
            other.init_host()
        finally:
            other.close()
        self.assertEqual(self.trainer.update(src, version=4).version, 4)
        self.assertEqual([m for m, _ in calls].count("RegisterSource"), 2)
        # Staged updates take the packed path (the daemon's copy from
        # registered memory streams).
        self.trainer.update(src, version=5, mode="staged")
        self.assertIn("PushChunks", [m for m, _ in calls])
        handle = src.handle
        self.trainer.close()
        self.assertFalse(os.path.exists("/dev/shm" + handle))

    def test_calls_out_of_order(self):
        self.engine("e4", [("a", "FLOAT32", (2,))])
        with self.assertRaises(WeightSyncError) as e:
            self.trainer.update([("a", np.zeros(2, np.float32))], version=1)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        # In the user's terms (issue 30); the daemon's own words in details.
        self.assertIn("init_host()", e.exception.message)
        self.assertIn("InitWeightTransfer", e.exception.details)


if __name__ == "__main__":
    unittest.main()
