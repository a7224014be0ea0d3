#!/usr/bin/env python3
"""Tests for client/python/weightsync/planner.py against tests/vectors/chunk_plan.json.

Run: python3 tools/test_chunk_planner.py
"""

import json
import os
import random
import sys
import unittest

_HERE = os.path.dirname(os.path.abspath(__file__))
# The source tree's package (client/python), unless WEIGHTSYNC_TEST_INSTALLED=1:
# then the installed one (tests/pip_install_test.sh runs the suite that way).
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(_HERE))

from weightsync import planner as chunk_planner  # noqa: E402
from weightsync.planner import ALIGNMENT, ELEMENT_SIZES, plan_chunks  # noqa: E402

VECTORS_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))), "tests", "vectors", "chunk_plan.json")


def load_vectors():
    with open(VECTORS_PATH, encoding="utf-8") as f:
        return json.load(f)


def tensors_from_json(items):
    return [{"name": t.get("name", ""), "dtype": t.get("dtype", "DTYPE_UNSPECIFIED"),
             "shape": t.get("shape", []), "sparse_nnz": t.get("sparseNnz", 0),
             "sparse_index_bytes": t.get("sparseIndexBytes", 0)}
            for t in items]


def plan_to_json(plan):
    """The planner's result with the vectors file's field names."""
    return {
        "totalBytes": plan["total_bytes"],
        "tensorOffsets": plan["tensor_offsets"],
        "payloadBytes": plan["payload_bytes"],
        "chunks": [{
            "index": c["index"], "offset": c["offset"], "size": c["size"],
            "pieces": [{"tensor": p["tensor"], "tensorOffset": p["tensor_offset"],
                        "chunkOffset": p["chunk_offset"], "length": p["length"]}
                       for p in c["pieces"]],
        } for c in plan["chunks"]],
    }


def brute_force_pieces(payloads, offsets, total, chunk_bytes):
    """Pieces derived from a byte-by-byte owner map of the stream (an
    independent formulation of the spec, only for small streams)."""
    owner = [None] * total
    for i, (off, size) in enumerate(zip(offsets, payloads)):
        for b in range(off, off + size):
            assert owner[b] is None, "tensors overlap"
            owner[b] = (i, b - off)
    chunks = []
    for c_begin in range(0, total, chunk_bytes):
        pieces = []
        for b in range(c_begin, min(c_begin + chunk_bytes, total)):
            if owner[b] is None:
                continue
            i, t_off = owner[b]
            last = pieces[-1] if pieces else None
            if last and last["tensor"] == i and \
                    last["tensor_offset"] + last["length"] == t_off:
                last["length"] += 1
            else:
                pieces.append({"tensor": i, "tensor_offset": t_off,
                               "chunk_offset": b - c_begin, "length": 1})
        chunks.append(pieces)
    return chunks


def random_manifest(rng):
    dtypes = sorted(ELEMENT_SIZES)
    tensors = []
    for i in range(rng.randint(0, 12)):
        rank = rng.randint(0, 3)
        # Mostly non-empty dims; now and then a 0 (zero-element tensor).
        shape = [0 if rng.random() < 0.05 else rng.choice([1, 2, 3, 7, 16, 33, 64, 100, 129])
                 for _ in range(rank)]
        n = chunk_planner.numel(shape)
        nnz = rng.randint(1, n) if n > 0 and rng.random() < 0.2 else 0
        tensors.append({"name": f"t{i}", "dtype": rng.choice(dtypes),
                        "shape": shape, "sparse_nnz": nnz})
    chunk_bytes = ALIGNMENT * rng.choice([1, 1, 2, 3, 4, 8, 16])
    return tensors, chunk_bytes


class VectorsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.vectors = load_vectors()

    def test_header(self):
        self.assertEqual(self.vectors["specVersion"], chunk_planner.SPEC_VERSION)
        self.assertEqual(self.vectors["alignment"], ALIGNMENT)
        self.assertGreaterEqual(len(self.vectors["cases"]), 10)
        self.assertGreaterEqual(len(self.vectors["errors"]), 8)

    def test_file_is_up_to_date(self):
        with open(VECTORS_PATH, encoding="utf-8") as f:
            self.assertEqual(f.read(), chunk_planner.render_vectors(),
                             "regenerate: python3 client/python/weightsync/planner.py --write "
                             "tests/vectors/chunk_plan.json")

    def test_cases(self):
        for case in self.vectors["cases"]:
            with self.subTest(case=case["name"]):
                plan = plan_chunks(tensors_from_json(case["tensors"]), case["chunkBytes"])
                got = plan_to_json(plan)
                for key in ("totalBytes", "tensorOffsets", "payloadBytes", "chunks"):
                    self.assertEqual(got[key], case[key], key)
                check_invariants(self, tensors_from_json(case["tensors"]),
                                 case["chunkBytes"], plan)

    def test_errors(self):
        for err in self.vectors["errors"]:
            with self.subTest(error=err["name"]):
                with self.assertRaises(ValueError) as cm:
                    plan_chunks(tensors_from_json(err["tensors"]), err["chunkBytes"])
                self.assertIn(err["errorContains"], str(cm.exception))

    def test_case_names_unique(self):
        names = [c["name"] for c in self.vectors["cases"] + self.vectors["errors"]]
        self.assertEqual(len(names), len(set(names)))


def check_invariants(test, tensors, chunk_bytes, plan):
    payloads, offsets = plan["payload_bytes"], plan["tensor_offsets"]
    total, chunks = plan["total_bytes"], plan["chunks"]
    test.assertEqual(len(payloads), len(tensors))
    test.assertEqual(len(offsets), len(tensors))

    # Payload sizes follow the dense / sparse formula.
    for t, p in zip(tensors, payloads):
        esize = ELEMENT_SIZES[t["dtype"]]
        nnz = t.get("sparse_nnz", 0)
        index_bytes = 4 if t.get("sparse_index_bytes", 0) == 4 else 8
        want = (chunk_planner.numel(t["shape"]) * esize if nnz == 0
                else nnz * (index_bytes + esize))
        test.assertEqual(p, want)

    # Offsets: aligned, first at 0, each the aligned end of the previous one.
    for i, off in enumerate(offsets):
        test.assertEqual(off % ALIGNMENT, 0)
        if i == 0:
            test.assertEqual(off, 0)
        else:
            prev_end = offsets[i - 1] + payloads[i - 1]
            test.assertGreaterEqual(off, prev_end)
            test.assertLess(off - prev_end, ALIGNMENT)
    test.assertEqual(total, offsets[-1] + payloads[-1] if tensors else 0)

    # Chunks: consecutive, full-size except the last, sizes sum to total.
    test.assertEqual(len(chunks), -(-total // chunk_bytes))
    test.assertEqual(sum(c["size"] for c in chunks), total)
    for k, c in enumerate(chunks):
        test.assertEqual(c["index"], k)
        test.assertEqual(c["offset"], k * chunk_bytes)
        if k + 1 < len(chunks):
            test.assertEqual(c["size"], chunk_bytes)
        test.assertGreater(c["size"], 0)
        # Every chunk starts with payload bytes (no chunk is pure padding).
        test.assertTrue(c["pieces"])
        test.assertEqual(c["pieces"][0]["chunk_offset"], 0)

    # Pieces tile each tensor's payload exactly once, in order, at the right
    # stream position, and stay inside their chunk, in increasing position.
    next_tensor_offset = [0] * len(tensors)
    last_piece = None
    for c in chunks:
        prev_end_in_chunk = 0
        for p in c["pieces"]:
            i = p["tensor"]
            test.assertGreater(p["length"], 0)
            test.assertGreaterEqual(p["chunk_offset"], prev_end_in_chunk)
            test.assertLessEqual(p["chunk_offset"] + p["length"], c["size"])
            test.assertEqual(p["tensor_offset"], next_tensor_offset[i])
            test.assertEqual(c["offset"] + p["chunk_offset"], offsets[i] + p["tensor_offset"])
            if last_piece is not None:
                test.assertGreaterEqual(i, last_piece["tensor"])
            next_tensor_offset[i] += p["length"]
            prev_end_in_chunk = p["chunk_offset"] + p["length"]
            last_piece = p
    test.assertEqual(next_tensor_offset, payloads)

    # Independent byte-level derivation agrees (small streams only).
    if total <= 200_000:
        brute = brute_force_pieces(payloads, offsets, total, chunk_bytes)
        test.assertEqual([c["pieces"] for c in chunks], brute)


class InvariantTest(unittest.TestCase):
    def test_random_manifests(self):
        rng = random.Random(20240611)
        for n in range(400):
            tensors, chunk_bytes = random_manifest(rng)
            with self.subTest(n=n, tensors=tensors, chunk_bytes=chunk_bytes):
                plan = plan_chunks(tensors, chunk_bytes)
                check_invariants(self, tensors, chunk_bytes, plan)

    def test_pure_and_deterministic(self):
        tensors = [{"name": "a", "dtype": "FLOAT32", "shape": [3, 100]},
                   {"name": "b", "dtype": "BFLOAT16", "shape": [7], "sparse_nnz": 2}]
        snapshot = json.dumps(tensors)
        self.assertEqual(plan_chunks(tensors, 512), plan_chunks(tensors, 512))
        self.assertEqual(json.dumps(tensors), snapshot)  # input not mutated

    def test_dtype_numbers_and_objects(self):
        class Spec:  # stands in for a weightsync.v1.TensorSpec message
            def __init__(self, name, dtype, shape, sparse_nnz=0):
                self.name, self.dtype, self.shape, self.sparse_nnz = \
                    name, dtype, shape, sparse_nnz
        by_name = plan_chunks([{"name": "a", "dtype": "BFLOAT16", "shape": [300]},
                               {"name": "b", "dtype": "INT64", "shape": [2, 2],
                                "sparse_nnz": 1}], 256)
        by_number = plan_chunks([Spec("a", 2, [300]), Spec("b", 5, [2, 2], 1)], 256)
        self.assertEqual(by_name, by_number)
        with self.assertRaisesRegex(ValueError, "x"):
            plan_chunks([Spec("x", 0, [1])], 256)

    def test_small_examples(self):
        plan = plan_chunks([{"name": "a", "dtype": "BFLOAT16", "shape": [3, 5]}], 1024)
        self.assertEqual(plan["total_bytes"], 30)
        self.assertEqual(plan["chunks"], [{"index": 0, "offset": 0, "size": 30, "pieces": [
            {"tensor": 0, "tensor_offset": 0, "chunk_offset": 0, "length": 30}]}])
        self.assertEqual(plan_chunks([], 256),
                         {"total_bytes": 0, "tensor_offsets": [], "payload_bytes": [],
                          "chunks": []})

    def test_more_errors(self):
        bad = [
            (1.5 * 256, [], "chunk_bytes"),
            (True, [], "chunk_bytes"),
            (255, [], "chunk_bytes"),
            (256, [{"name": "q", "dtype": "COMPLEX64", "shape": [1]}], "q"),
            (256, [{"name": "q", "dtype": None, "shape": [1]}], "q"),
            (256, [{"dtype": "FLOAT32", "shape": [1]}], "name"),
            (256, [{"name": "q", "dtype": "FLOAT32", "shape": [2**31, 2**31, 2]}], "q"),
            (256, [{"name": "q", "dtype": "INT8", "shape": [2**62 + 1]}], "q"),
            (256, [{"name": "q", "dtype": "INT8", "shape": [0], "sparse_nnz": 1}], "q"),
        ]
        for chunk_bytes, tensors, contains in bad:
            with self.subTest(chunk_bytes=chunk_bytes, tensors=tensors):
                with self.assertRaises(ValueError) as cm:
                    plan_chunks(tensors, chunk_bytes)
                self.assertIn(contains, str(cm.exception))
        # Exactly 2**62 bytes is accepted (a huge chunk size keeps the chunk
        # list short).
        plan = plan_chunks([{"name": "q", "dtype": "INT8", "shape": [2**62]}], 2**60)
        self.assertEqual(plan["total_bytes"], 2**62)
        self.assertEqual(len(plan["chunks"]), 4)


if __name__ == "__main__":
    unittest.main()
