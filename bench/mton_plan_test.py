#!/usr/bin/env python3
"""bench/mton_plan.py, executed on the CPU: every sender packs its chunks
from its shard, every receiver copies each chunk's ops into its engine,
and every engine rectangle then holds exactly its checkpoint elements, for
every case, layout and mode of the 4-GPU proof (a small Qwen3-shaped
model). This is what bench/mton_worker_bench.cc does on the GPUs."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mton_plan  # noqa: E402

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 32, "model_type": "qwen3", "tie_word_embeddings": False}


# Rows of 192 and 320 bytes: the transfer plan's 256-byte-aligned chunk
# cuts fall inside rows.
ODD = dict(TINY, hidden_size=96, head_dim=48, intermediate_size=160, vocab_size=100)


def value(t, r, c):
    return (t * 7919 + r * 104729 + c * 31 + 1) % 65521


def execute(lines):
    """{gpu: {dst_byte_offset: value}} after the plan runs; asserts the
    chunk sizes and that no engine element is written twice."""
    tensors, holds, chunks, engines, needs = {}, {}, [], {}, {}
    for line in lines:
        f = line.split()
        if f[0] == "tensor":
            tensors[int(f[1])] = (int(f[3]), int(f[4]))
        elif f[0] == "hold":
            holds.setdefault(int(f[1]), {})[int(f[2])] = (int(f[3]), int(f[4]))
        elif f[0] == "engine":
            engines[int(f[1])] = {}
        elif f[0] == "need":
            needs.setdefault(int(f[1]), []).append(tuple(int(x) for x in f[2:]))
        elif f[0] == "chunk":
            chunks.append({"sender": int(f[3]), "receiver": int(f[4]), "bytes": int(f[5]),
                           "packs": [], "ops": [], "round": int(f[2])})
        elif f[0] == "pack":
            chunks[int(f[1])]["packs"].append(tuple(int(x) for x in f[2:]))
        elif f[0] == "op":
            chunks[int(f[1])]["ops"].append(tuple(int(x) for x in f[2:]))
    def coords(t, r0, i, c0, j, nr, nc):
        """(row, col) of element (i, j) of a rectangle, or of element j of
        a flat run (one row whose columns pass the tensor's width)."""
        cols = tensors[t][1]
        if nr == 1 and c0 + nc > cols:
            e = r0 * cols + c0 + j
            return e // cols, e % cols
        return r0 + i, c0 + j

    for c in chunks:
        buf = {}   # byte offset in the chunk -> value (element granularity)
        for t, r0, nr, c0, nc, off in c["packs"]:
            h0, hn = holds[c["sender"]][t]
            last = coords(t, r0, nr - 1, c0, nc - 1, nr, nc)[0]
            assert h0 <= r0 and last < h0 + hn, ("pack outside the shard", t)
            for i in range(nr):
                for j in range(nc):
                    buf[off + (i * nc + j) * 2] = value(t, *coords(t, r0, i, c0, j, nr, nc))
        assert max(buf) + 2 <= c["bytes"], "pack past the chunk"
        for g, t, r0, nr, c0, nc, off, sstride, dst, dstride in c["ops"]:
            assert c["receiver"] in (g, -1)
            for i in range(nr):
                for j in range(nc):
                    v = buf[off + i * sstride + j * 2]
                    assert v == value(t, *coords(t, r0, i, c0, j, nr, nc)), \
                        ("op reads the wrong element", t)
                    at = dst + i * dstride + j * 2
                    assert at not in engines[g], ("written twice", g, t, r0 + i, c0 + j)
                    engines[g][at] = v
    # Rounds: non-decreasing in chunk order; one chunk per link a round.
    seen = set()
    last = -1
    for c in chunks:
        assert c["round"] >= last
        last = c["round"]
        key = (c["round"], c["sender"], c["receiver"])
        assert key not in seen, key
        seen.add(key)
    return engines, needs


class PlanTest(unittest.TestCase):
    def test_every_engine_element_once_and_right(self):
        for mode, planner in (("p2p", "bench"), ("p2p", "transfer_plan"), ("bcast", "bench")):
            for case in ("rows", "layers", "replicas", "one"):
                if mode == "bcast" and case != "one":
                    continue
                for layout in ("tp2", "replicas"):
                    with self.subTest(mode=mode, planner=planner, case=case, layout=layout):
                        # Small chunks: pieces split across chunks (mid-row
                        # for the transfer plan's), direct chunks (rows of
                        # 128 bytes) and packed ones.
                        lines = mton_plan.plan(TINY, case, layout, mode, 4096, 0, planner)
                        engines, needs = execute(lines)
                        for g, ns in needs.items():
                            want = {}
                            for t, r0, nr, c0, nc, dst, ds in ns:
                                for i in range(nr):
                                    for j in range(nc):
                                        want[dst + i * ds + j * 2] = value(t, r0 + i, c0 + j)
                            self.assertEqual(engines[g], want)

    def test_transfer_plan_cuts_rows_and_merges_runs(self):
        for case in ("rows", "layers", "replicas"):
            for layout in ("tp2", "replicas"):
                with self.subTest(case=case, layout=layout):
                    lines = mton_plan.plan(ODD, case, layout, "p2p", 4096, 0, "transfer_plan")
                    engines, needs = execute(lines)
                    for g, ns in needs.items():
                        want = {}
                        for t, r0, nr, c0, nc, dst, ds in ns:
                            for i in range(nr):
                                for j in range(nc):
                                    want[dst + i * ds + j * 2] = value(t, r0 + i, c0 + j)
                        self.assertEqual(engines[g], want)
        lines = mton_plan.plan(ODD, "rows", "replicas", "p2p", 4096, 0, "transfer_plan")
        cols = {int(f[1]): int(f[4]) for f in (x.split() for x in lines) if f[0] == "tensor"}
        ops = [[int(x) for x in f[1:]] for f in (x.split() for x in lines) if f[0] == "op"]
        # op: chunk gpu tensor r0 nr c0 nc ...: runs that start mid-row, and
        # runs merged past a row's end (a whole chunk as one op: in place).
        self.assertTrue(any(o[4] == 1 and o[5] > 0 for o in ops))
        self.assertTrue(any(o[4] == 1 and o[5] + o[6] > cols[o[2]] for o in ops))

    def test_direct_chunks_are_one_contiguous_op(self):
        lines = mton_plan.plan(TINY, "rows", "replicas", "p2p", 4096, 0)
        ops = {}
        sizes = {}
        for line in lines:
            f = line.split()
            if f[0] == "chunk":
                sizes[int(f[1])] = int(f[5])
            if f[0] == "op":
                ops.setdefault(int(f[1]), []).append([int(x) for x in f[2:]])
        # op: gpu tensor r0 nr c0 nc offset src_stride dst dst_stride
        direct = [k for k, o in ops.items() if len(o) == 1 and o[0][9] == o[0][5] * 2
                  and o[0][3] * o[0][5] * 2 == sizes[k]]
        self.assertGreater(len(direct), 0)


if __name__ == "__main__":
    unittest.main()
