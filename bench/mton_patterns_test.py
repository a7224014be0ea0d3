#!/usr/bin/env python3
"""bench/mton_patterns.py: the byte patterns the 4-GPU M->N proof and its
raw NCCL baseline move (issue 32). Every byte an engine GPU needs comes
from exactly one sender, the senders are balanced, and the patterns are
the same in every process."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mton_patterns as mp  # noqa: E402


def tiles(intervals, want):
    """True if the (begin, count) row intervals tile `want`'s exactly: no
    gap, no overlap (pieces split needed rectangles by rows only)."""
    def merged(iv):
        out = []
        for b, n in sorted(iv):
            if out and out[-1][1] > b:
                return None   # overlap
            if out and out[-1][1] == b:
                out[-1][1] = b + n
            else:
                out.append([b, b + n])
        return out
    got, exp = merged(intervals), merged(want)
    return got is not None and got == exp


class PatternTest(unittest.TestCase):
    def test_every_needed_byte_exactly_once(self):
        for model, cfg in mp.MODELS.items():
            for case in mp.CASES:
                for layout in mp.LAYOUTS:
                    with self.subTest(model=model, case=case, layout=layout):
                        need = mp.needs(cfg, layout)
                        ps = mp.pieces(cfg, case, layout)
                        held = mp.holdings(cfg, case)
                        for gpu in mp.RECEIVERS:
                            got = {}
                            for s, g, t, r0, nr, c0, nc, b in ps:
                                if g != gpu:
                                    continue
                                self.assertEqual(b, nr * nc * 2)
                                # The sender holds these rows.
                                h0, hn = held[t][s]
                                self.assertTrue(h0 <= r0 and r0 + nr <= h0 + hn, (t, s))
                                got.setdefault((t, c0, nc), []).append((r0, nr))
                            want = {}
                            for t, r0, nr, c0, nc in need[gpu]:
                                want.setdefault((t, c0, nc), []).append((r0, nr))
                            self.assertEqual(set(got), set(want))
                            for k in want:
                                self.assertTrue(tiles(got[k], want[k]), k)

    def test_balanced_within_10_percent(self):
        cfg = mp.QWEN3_8B
        for case in mp.CASES:
            for layout in mp.LAYOUTS:
                f = mp.flows(mp.pieces(cfg, case, layout))
                sent = [sum(b for (s, _r), b in f.items() if s == x) for x in mp.SENDERS]
                with self.subTest(case=case, layout=layout):
                    self.assertLessEqual(max(sent) / min(sent), 1.10)
                if case == "replicas":
                    # Replicas split every receiver's bytes between both.
                    for r in mp.RECEIVERS:
                        a, b = f[(0, r)], f[(1, r)]
                        self.assertLessEqual(max(a, b) / min(a, b), 1.10, (layout, r))

    def test_tp2_halves_each_receiver(self):
        # The pattern that makes two senders twice as fast as one: each
        # engine GPU of a TP=2 engine takes in half the model.
        cfg = mp.QWEN3_8B
        total = sum(p[7] for p in mp.pieces(cfg, "replicas", "replicas")) / 2
        for case in mp.CASES:
            f = mp.flows(mp.pieces(cfg, case, "tp2"))
            for r in mp.RECEIVERS:
                got = f.get((0, r), 0) + f.get((1, r), 0)
                self.assertAlmostEqual(got / total, 0.5, delta=0.01)

    def test_deterministic(self):
        cfg = mp.QWEN3_1_7B
        self.assertEqual(mp.all_patterns(cfg), mp.all_patterns(cfg))
        self.assertEqual(mp.pieces(cfg, "replicas", "tp2"), mp.pieces(cfg, "replicas", "tp2"))

    def test_unknown_case_refused(self):
        with self.assertRaisesRegex(ValueError, "unknown case"):
            mp.holdings(mp.QWEN3_1_7B, "diagonal")


if __name__ == "__main__":
    unittest.main()
