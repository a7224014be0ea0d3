"""The receipt vectors (tests/vectors/receipts.json, computed by
tools/receipt_vectors.py with plain integers) against every Python
implementation: expected_receipt (numpy, the host backend; the small-run
gather and the blocked path), expected_receipt_arrays on numpy (the torch
code without Triton), and a many-small-parameters case for speed."""

import json
import os
import sys
import time
import unittest

import numpy as np

# The source tree's package, unless WEIGHTSYNC_TEST_INSTALLED=1: then the
# installed one (tests/pip_install_test.sh runs the suite that way).
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from google.protobuf import json_format  # noqa: E402

from weightsync import _xp, receipts  # noqa: E402
from weightsync._proto import v1  # noqa: E402
from weightsync._tensors import STORAGE, build_manifest  # noqa: E402

_VECTORS = "tests/vectors/receipts.json"


def _load():
    for root in (os.getcwd(), os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.dirname(os.path.abspath(__file__)))))):
        path = os.path.join(root, _VECTORS)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
    raise FileNotFoundError(_VECTORS)


def _case(case):
    layout = [json_format.ParseDict(p, v1.Parameter()) for p in case["layout"]]
    sent = {t["name"]: (t["dtype"], tuple(t["shape"]),
                        np.frombuffer(bytes.fromhex(t["hex"]), np.uint8).copy())
            for t in case["tensors"]}
    want = (int(case["checksum"], 16), case["parameters"], case["bytes"])
    return layout, sent, want


class ReceiptVectorsTest(unittest.TestCase):
    vectors = _load()

    def test_terms(self):
        for t in self.vectors["terms"]:
            bits = int(t["bits"], 16)
            got = receipts.terms32(receipts.bits32_np(
                np.array([bits], np.uint64).view(np.uint8), "INT64", "INT64"),
                np.array([int(t["index"])], np.uint64).view(np.int64),
                receipts.salt32(t["name"]))
            self.assertEqual(int(got[0]), int(t["term"], 16), t)

    def test_cases(self):
        self.assertGreaterEqual(len(self.vectors["cases"]), 10)
        for case in self.vectors["cases"]:
            layout, sent, want = _case(case)
            with self.subTest(case["name"]):
                self.assertEqual(receipts.expected_receipt(layout, sent), want)
                # The walk kept by layout key: built, then reused.
                key = ("vector", case["name"])
                self.assertEqual(receipts.expected_receipt(layout, sent, layout_key=key), want)
                self.assertIn(key, receipts.host._walks)
                self.assertEqual(receipts.expected_receipt(layout, sent, layout_key=key), want)
                # Every run through the blocked (large) path.
                saved = receipts.host._SMALL
                receipts.host._SMALL = 0
                try:
                    self.assertEqual(receipts.expected_receipt(layout, sent, block=5), want)
                finally:
                    receipts.host._SMALL = saved
                arrays = {n: (dt, shape, a.view(STORAGE[dt]))
                          for n, (dt, shape, a) in sent.items()}
                self.assertEqual(receipts.expected_receipt_arrays(layout, arrays), want)
                self.assertEqual(receipts.expected_receipt_arrays(
                    layout, arrays, _xp.NumpyOps(), block=3), want)

    def test_many_small_parameters(self):
        """The mixture-of-experts case: 100k parameters of 16 elements, the
        expectation in one gathered pass, agreeing with the blocked path."""
        n = 100_000
        rng = np.random.default_rng(3)
        data = rng.integers(0, 1 << 16, (n, 16), dtype=np.uint64).astype(np.uint16)
        sent = {f"experts.{i}.w": ("BFLOAT16", (16,), data[i].view(np.uint8))
                for i in range(n)}
        layout = [v1.Parameter(name=f"experts.{i}.w", dtype=v1.BFLOAT16, shape=[16])
                  for i in range(n)]
        receipts.expected_receipt(layout, sent)   # salts cached, as after one update
        t = time.perf_counter()
        got = receipts.expected_receipt(layout, sent)
        elapsed = time.perf_counter() - t
        self.assertEqual(receipts.expected_receipt(layout, sent, layout_key="moe"), got)
        t = time.perf_counter()
        self.assertEqual(receipts.expected_receipt(layout, sent, layout_key="moe"), got)
        kept = time.perf_counter() - t
        print(f"100k parameters of 16 bfloat16: {elapsed * 1e3:.1f} ms, "
              f"{kept * 1e3:.1f} ms with the walk kept")
        self.assertEqual(got[1:], (n, n * 32))
        self.assertLess(kept, elapsed)
        some = layout[:300]
        want = receipts.arrays.receipt_by_ops(
            some, {k: (d, s, a.view(np.uint16)) for k, (d, s, a) in sent.items()}, None, 1 << 22)
        self.assertEqual(receipts.expected_receipt(some, sent), want)
        # Its speed is bench/manifest_scale.py's to measure, not a test's
        # (a loaded CI machine took 2.4 s here once).


class KeptWalkTest(unittest.TestCase):
    """expected_receipt(..., layout_key=) keeps the walk of a layout: a
    repeated update reuses it, anything it depended on (names, order,
    dtypes, shapes, the key) makes a new one, and the answers are always
    those of the walk made afresh."""

    def setUp(self):
        receipts.host._walks.clear()
        # A fused parameter (segments, gathered rows), plain ones, a
        # converted one and one whose run is large.
        self.layout = [
            v1.Parameter(name="qkv", dtype=v1.FLOAT32, shape=[6, 4], segments=[
                v1.Segment(source="q", source_shape=[4, 4], row_count=4, col_count=4),
                v1.Segment(source="k", source_shape=[2, 8], row_count=2, col_begin=4,
                           col_count=4, dest_offset=16)]),
            v1.Parameter(name="a", dtype=v1.FLOAT32, shape=[16]),
            v1.Parameter(name="b", dtype=v1.BFLOAT16, shape=[3, 5]),
            v1.Parameter(name="big", dtype=v1.FLOAT32, shape=[1 << 17])]
        rng = np.random.default_rng(5)

        def tensor(*shape):
            return rng.standard_normal(shape).astype(np.float32)

        self.arrays = {"q": tensor(4, 4), "k": tensor(2, 8), "a": tensor(16),
                       "b": tensor(3, 5), "big": tensor(1 << 17)}

    def sent(self, names=None):
        names = names or list(self.arrays)
        return {n: ("FLOAT32", list(self.arrays[n].shape), self.arrays[n].reshape(-1).view(np.uint8))
                for n in names}

    def check(self, sent, key):
        want = receipts.expected_receipt(self.layout, sent)
        self.assertEqual(receipts.expected_receipt(self.layout, sent, layout_key=key), want)
        return want

    def test_reused_while_nothing_but_values_changes(self):
        first = self.check(self.sent(), "L")
        walk = receipts.host._walks["L"]
        for a in self.arrays.values():
            a += 1
        second = self.check(self.sent(), "L")
        self.assertIs(receipts.host._walks["L"], walk)
        self.assertNotEqual(first[0], second[0])
        self.assertEqual(first[1:], second[1:])
        # A flipped element changes the answer (the kept keys still apply).
        self.arrays["a"][3] = -self.arrays["a"][3]
        self.assertNotEqual(self.check(self.sent(), "L")[0], second[0])
        self.assertIs(receipts.host._walks["L"], walk)
        # Shapes as tuples are the same shapes.
        sent = {n: (d, tuple(s), p) for n, (d, s, p) in self.sent().items()}
        self.check(sent, "L")
        self.assertIs(receipts.host._walks["L"], walk)

    def test_rebuilt_when_the_manifest_changes(self):
        self.check(self.sent(), "L")
        walk = receipts.host._walks["L"]
        self.check(self.sent(["big", "b", "a", "k", "q"]), "L")   # another order
        self.assertIsNot(receipts.host._walks["L"], walk)
        walk = receipts.host._walks["L"]
        self.check(self.sent(["q", "k", "a"]), "L")                # fewer tensors
        self.assertIsNot(receipts.host._walks["L"], walk)
        walk = receipts.host._walks["L"]
        self.arrays["k"] = self.arrays["k"].reshape(4, 4)          # same bytes, new shape
        self.check(self.sent(["q", "k", "a"]), "L")
        self.assertIsNot(receipts.host._walks["L"], walk)
        # Another dtype for the same name and bytes: bfloat16 pairs.
        sent = self.sent(["q", "k", "a"])
        sent["a"] = ("BFLOAT16", [32], sent["a"][2])
        self.layout[1] = v1.Parameter(name="a", dtype=v1.BFLOAT16, shape=[32])
        self.check(sent, "L2")
        self.check(sent, "L2")

    def test_a_manifest_view_is_the_same_sent(self):
        """Manifest.sent() (what Trainer.update passes on the host backend:
        no dict per update) gives the answers of the dict, reuses the walk
        while only values change, and makes a new one for a new shape."""
        named = [(n, self.arrays[n]) for n in self.arrays]
        m = build_manifest(named)
        self.assertEqual(dict(m.sent().items()).keys(), self.sent().keys())
        want = self.check(self.sent(), "M")
        self.assertEqual(receipts.expected_receipt(self.layout, m.sent(), layout_key="M"), want)
        self.assertEqual(receipts.expected_receipt(self.layout, m.sent()), want)
        self.arrays["a"][0] += 1
        m2 = build_manifest(named, previous=m)
        walk = receipts.host._walks["M"]
        got = receipts.expected_receipt(self.layout, m2.sent(), layout_key="M")
        self.assertIs(receipts.host._walks["M"], walk)
        self.assertEqual(got, receipts.expected_receipt(self.layout, self.sent()))
        self.assertNotEqual(got, want)
        self.arrays["k"] = self.arrays["k"].reshape(4, 4)
        m3 = build_manifest([(n, self.arrays[n]) for n in self.arrays], previous=m2)
        got = receipts.expected_receipt(self.layout, m3.sent(), layout_key="M")
        self.assertIsNot(receipts.host._walks["M"], walk)
        self.assertEqual(got, receipts.expected_receipt(self.layout, self.sent()))

    def test_only_the_last_layouts_are_kept(self):
        for i in range(receipts.host._WALKS_KEPT + 3):
            self.check(self.sent(), f"L{i}")
        self.assertEqual(len(receipts.host._walks), receipts.host._WALKS_KEPT)
        self.assertNotIn("L0", receipts.host._walks)

    def test_small_runs_over_the_budget_are_summed_each_time(self):
        saved = receipts.host._CACHED_ELEMENTS
        receipts.host._CACHED_ELEMENTS = 8
        try:
            self.check(self.sent(), "L")
            self.assertFalse(receipts.host._walks["L"].fast)
            self.check(self.sent(), "L")
        finally:
            receipts.host._CACHED_ELEMENTS = saved


if __name__ == "__main__":
    unittest.main()
