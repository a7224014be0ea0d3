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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from google.protobuf import json_format  # noqa: E402

from weightsync import _xp, receipts  # noqa: E402
from weightsync._proto import v1  # noqa: E402
from weightsync._tensors import STORAGE  # noqa: E402

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
                # Every run through the blocked (large) path.
                saved = receipts._SMALL
                receipts._SMALL = 0
                try:
                    self.assertEqual(receipts.expected_receipt(layout, sent, block=5), want)
                finally:
                    receipts._SMALL = saved
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
        print(f"100k parameters of 16 bfloat16: {elapsed * 1e3:.1f} ms")
        self.assertEqual(got[1:], (n, n * 32))
        some = layout[:300]
        want = receipts._receipt_by_ops(
            some, {k: (d, s, a.view(np.uint16)) for k, (d, s, a) in sent.items()}, None, 1 << 22)
        self.assertEqual(receipts.expected_receipt(some, sent), want)
        self.assertLess(elapsed, 1.0)   # generous: CI machines vary


if __name__ == "__main__":
    unittest.main()
