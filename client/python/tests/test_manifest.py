#!/usr/bin/env python3
"""weightsync._tensors.build_manifest and planner.plan_chunks_cached /
pack_chunk (the per-update control path at mixture-of-experts scale).

Run: python3 client/python/tests/test_manifest.py
"""

import os
import sys
import unittest

import numpy as np

# The source tree's package, unless WEIGHTSYNC_TEST_INSTALLED=1: then the
# installed one (tests/pip_install_test.sh runs the suite that way).
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from weightsync import planner  # noqa: E402
from weightsync._tensors import build_manifest, describe, wire_dtype  # noqa: E402


class BuildManifestTest(unittest.TestCase):
    def test_dtypes_shapes_and_bytes(self):
        cases = [(np.float32, "FLOAT32"), (np.float16, "FLOAT16"), (np.float64, "FLOAT64"),
                 (np.int64, "INT64"), (np.int32, "INT32"), (np.int16, "INT16"),
                 (np.int8, "INT8"), (np.uint8, "UINT8"), (np.bool_, "BOOL")]
        pairs = [(f"t{i}", np.arange(6).astype(dt).reshape(2, 3)) for i, (dt, _) in
                 enumerate(cases)]
        pairs.append(("scalar", np.array(7, dtype=np.int64)))
        pairs.append(("empty", np.zeros((0, 4), np.float32)))
        m = build_manifest(pairs)
        self.assertEqual(m.dtypes, tuple(w for _, w in cases) + ("INT64", "FLOAT32"))
        self.assertEqual(m.shapes, ((2, 3),) * len(cases) + ((), (0, 4)))
        self.assertEqual(m.names, tuple(n for n, _ in pairs))
        self.assertEqual(len(m), len(pairs))
        for (name, t), raw, n in zip(pairs, m.payloads, m.nbytes):
            self.assertEqual(raw.dtype, np.uint8)
            self.assertEqual(raw.ndim, 1)
            self.assertEqual(raw.tobytes(), t.tobytes())
            self.assertEqual(n, t.nbytes)
            # A view, not a copy.
            if t.size:
                self.assertTrue(np.shares_memory(raw, t))
            # describe() agrees.
            d, shape, raw2 = describe(name, t)
            self.assertEqual((d, shape), (m.dtypes[m.names.index(name)], t.shape))
            self.assertEqual(raw2.tobytes(), raw.tobytes())
        self.assertEqual(m.total_bytes, sum(t.nbytes for _, t in pairs))
        self.assertEqual(m.specs()[0], {"name": "t0", "dtype": "FLOAT32", "shape": [2, 3]})
        self.assertEqual(wire_dtype(np.dtype(np.float32)), "FLOAT32")
        self.assertIsNone(wire_dtype(np.dtype(np.complex64)))

    def test_errors_name_the_tensor(self):
        good = ("ok", np.zeros(4, np.float32))
        for bad, what in [
                (("cplx", np.zeros(3, np.complex64)), "complex64"),
                (("obj", np.array(["a"], dtype=object)), "object"),
                (("big_endian", np.zeros(3, dtype=">f4")), "byte order"),
                (("strided", np.zeros((4, 4), np.float32)[:, ::2]), "contiguous"),
                (("transposed", np.zeros((3, 5), np.float32).T), "contiguous")]:
            with self.subTest(bad[0]):
                with self.assertRaises(ValueError) as ctx:
                    build_manifest([good, bad])
                self.assertIn(f"'{bad[0]}'", str(ctx.exception))
                self.assertIn(what, str(ctx.exception))
        for name in ("", None, 3):
            with self.assertRaises(ValueError):
                build_manifest([(name, np.zeros(1, np.float32))])
        with self.assertRaises(ValueError):
            build_manifest([("a", np.zeros(1), "extra")])
        # describe copies what build_manifest refuses.
        _, _, raw = describe("strided", np.arange(8, dtype=np.float32)[::2])
        self.assertEqual(raw.view(np.float32).tolist(), [0, 2, 4, 6])
        _, _, raw = describe("be", np.arange(3, dtype=">f4"))
        self.assertEqual(raw.view(np.float32).tolist(), [0, 1, 2])

    def test_fingerprint_and_previous(self):
        a = [(f"w{i}", np.full(16, i, np.float32)) for i in range(50)]
        m1 = build_manifest(a)
        m2 = build_manifest(list(a), previous=m1)   # same tensors: reused
        self.assertIs(m2.payloads, m1.payloads)
        self.assertEqual(m2.fingerprint, m1.fingerprint)
        self.assertTrue(m2.same_as(m1))
        # New arrays of the same names, dtypes, shapes: same manifest,
        # fresh views.
        b = [(n, t.copy()) for n, t in a]
        m3 = build_manifest(b, previous=m1)
        self.assertTrue(m3.same_as(m1))
        self.assertIsNot(m3.payloads, m1.payloads)
        self.assertTrue(np.shares_memory(m3.payloads[0], b[0][1]))
        # A changed shape, dtype or name is a different manifest.
        for changed in ([("w0", np.zeros(8, np.float32))] + a[1:],
                        [("w0", np.zeros(16, np.float16))] + a[1:],
                        [("v0", a[0][1])] + a[1:],
                        a[:-1]):
            m = build_manifest(changed, previous=m1)
            self.assertFalse(m.same_as(m1))
        # A shape reassigned in place on the same array object is seen.
        t = np.zeros(16, np.float32)
        m = build_manifest([("x", t)])
        t.shape = (4, 4)
        m5 = build_manifest([("x", t)], previous=m)
        self.assertEqual(m5.shapes, ((4, 4),))
        self.assertFalse(m5.same_as(m))

    def test_empty(self):
        m = build_manifest([])
        self.assertEqual((len(m), m.total_bytes), (0, 0))
        self.assertEqual(planner.plan_chunks(m, 256)["total_bytes"], 0)


class PlanCacheTest(unittest.TestCase):
    def setUp(self):
        planner.clear_plan_cache()

    def test_same_manifest_same_plan_object(self):
        a = [(f"w{i}", np.zeros(i + 1, np.float32)) for i in range(40)]
        m1 = build_manifest(a)
        p1 = planner.plan_chunks_cached(m1, m1, 1024)
        self.assertEqual(p1, planner.plan_chunks(m1.specs(), 1024))
        self.assertEqual(p1, planner.plan_chunks(m1, 1024))
        m2 = build_manifest([(n, t.copy()) for n, t in a])   # equal, not the same object
        self.assertIs(planner.plan_chunks_cached(m2, m2.specs(), 1024), p1)
        # Another chunk size or manifest: another plan.
        p3 = planner.plan_chunks_cached(m1, m1, 2048)
        self.assertIsNot(p3, p1)
        self.assertEqual(p3, planner.plan_chunks(m1, 2048))
        m4 = build_manifest(a[:-1])
        p4 = planner.plan_chunks_cached(m4, m4, 1024)
        self.assertIsNot(p4, p1)
        self.assertEqual(p4["total_bytes"], planner.plan_chunks(m4, 1024)["total_bytes"])
        m5 = build_manifest([(n, t.astype(np.int32)) for n, t in a])
        self.assertIsNot(planner.plan_chunks_cached(m5, m5, 1024), p1)
        # Any hashable key (e.g. a registered source id).
        specs = m1.specs()
        self.assertIs(planner.plan_chunks_cached("source-1", specs, 1024),
                      planner.plan_chunks_cached("source-1", specs, 1024))

    def test_errors_are_not_cached(self):
        bad = [{"name": "x", "dtype": "DTYPE_UNSPECIFIED", "shape": [1]}]
        for _ in range(2):
            with self.assertRaises(ValueError):
                planner.plan_chunks_cached("bad", bad, 256)
        with self.assertRaises(ValueError):
            planner.plan_chunks_cached("k", [{"name": "a", "dtype": "FLOAT32", "shape": [1]}],
                                       1000)

    def test_fast_path_matches_the_reference_checks(self):
        # Things the inline fast path must hand to the full validator.
        for tensors, contains in [
                ([{"name": "a", "dtype": True, "shape": [1]}], "'a'"),
                ([{"name": "a", "dtype": np.int32(1), "shape": [1]}], "'a'"),
                ([{"name": "a", "dtype": "FLOAT32", "shape": [True]}], "'a'"),
                ([{"name": "a", "dtype": "FLOAT32", "shape": [np.int64(2)]}], "'a'"),
                ([{"name": "a", "dtype": "FLOAT32", "shape": [2]},
                  {"name": "a", "dtype": "FLOAT32", "shape": [2]}], "'a'"),
                ([{"name": "", "dtype": "FLOAT32", "shape": [2]}], "name"),
                ([{"name": "h", "dtype": "FLOAT32", "shape": [2**40, 2**40]}], "'h'")]:
            with self.subTest(tensors=tensors):
                with self.assertRaises(ValueError) as ctx:
                    planner.plan_chunks(tensors, 256)
                self.assertIn(contains, str(ctx.exception))
        # Sparse and protobuf-style (camelCase) fields still work.
        plan = planner.plan_chunks([{"name": "s", "dtype": "BFLOAT16", "shape": [100],
                                     "sparseNnz": 3}], 256)
        self.assertEqual(plan["payload_bytes"], [3 * 8 + 3 * 2])


class PackChunkTest(unittest.TestCase):
    def test_pack_matches_a_byte_map(self):
        rng = np.random.default_rng(3)
        tensors = [(f"t{i}", rng.integers(0, 255, size=int(n), dtype=np.uint8))
                   for i, n in enumerate(rng.integers(0, 700, size=60))]
        m = build_manifest(tensors)
        for chunk_bytes in (256, 1024, 4096, 1 << 20):
            plan = planner.plan_chunks(m, chunk_bytes)
            stream = bytearray(plan["total_bytes"])
            for off, (_, t) in zip(plan["tensor_offsets"], tensors):
                stream[off:off + t.nbytes] = t.tobytes()
            got = b"".join(planner.pack_chunk(c, m.payloads) for c in plan["chunks"])
            self.assertEqual(got, bytes(stream))
            for c in plan["chunks"]:
                self.assertEqual(len(planner.pack_chunk(c, m.payloads)), c["size"])

    def test_kept_parts_see_new_values_and_follow_the_plan(self):
        a = [(f"t{i}", np.arange(i + 5, dtype=np.float32)) for i in range(40)]
        m = build_manifest(a)
        plan = planner.plan_chunks(m, 1024)
        parts = m.chunk_parts(plan)
        self.assertEqual([b"".join(p) for p in parts],
                         [planner.pack_chunk(c, m.payloads) for c in plan["chunks"]])
        for _, t in a:
            t += 1          # in place: the kept views see it
        m2 = build_manifest(list(a), previous=m)
        self.assertIs(m2.chunk_parts(plan), parts)
        self.assertEqual([b"".join(p) for p in parts],
                         [planner.pack_chunk(c, m2.payloads) for c in plan["chunks"]])
        other = planner.plan_chunks(m, 4096)   # another plan: parts made again
        self.assertEqual([b"".join(p) for p in m2.chunk_parts(other)],
                         [planner.pack_chunk(c, m2.payloads) for c in other["chunks"]])
        b = [(n, t.copy()) for n, t in a]      # new arrays: nothing carried over
        m3 = build_manifest(b, previous=m2)
        self.assertIsNot(m3.chunk_parts(plan), parts)


if __name__ == "__main__":
    unittest.main()
