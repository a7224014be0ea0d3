#!/usr/bin/env python3
"""weightsync.transfer_plan against tests/vectors/transfer_plan.json (the
C++ plan, common/transfer_plan_test.cc, passes the same file), plus the
plan's properties on random layouts and the declaration helpers."""

import json
import os
import random
import sys
import unittest

_HERE = os.path.dirname(os.path.abspath(__file__))
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(_HERE))

from weightsync import transfer_plan as tp  # noqa: E402

VECTORS_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))),
                            "tests", "vectors", "transfer_plan.json")


def _from_json(spec):
    def blocks(items):
        return [tp.block(b["tensor"], b.get("rowBegin", 0), b.get("rowCount", 0),
                         b.get("colBegin", 0), b.get("colCount", 0)) for b in items]
    tensors = []
    for t in spec["tensors"]:
        d = {"name": t["name"], "dtype": t["dtype"], "shape": t.get("shape", [])}
        if t.get("sparseNnz"):
            d["sparse_nnz"] = t["sparseNnz"]
        tensors.append(d)
    return {"tensors": tensors,
            "senders": [{"holds": blocks(s.get("holds", []))} for s in spec.get("senders", [])],
            "receivers": [{"name": r.get("name", ""), "needs": blocks(r.get("needs", []))}
                          for r in spec.get("receivers", [])]}


class VectorsTest(unittest.TestCase):
    def setUp(self):
        with open(VECTORS_PATH, encoding="utf-8") as f:
            self.vectors = json.load(f)

    def test_file_is_what_the_reference_generates(self):
        self.assertEqual(self.vectors, json.loads(tp.render_vectors()))

    def test_cases_read_back_from_json(self):
        self.assertGreaterEqual(len(self.vectors["cases"]), 8)
        for case in self.vectors["cases"]:
            plan = tp.build_plan(_from_json(case["spec"]))
            self.assertEqual(plan.id, case["planId"], case["name"])
            got = [dict(zip(("tensor", "rowBegin", "rowCount", "colBegin", "colCount",
                             "sender", "receiver", "bytes"), p)) for p in plan.pieces]
            self.assertEqual(got, case["pieces"], case["name"])
            self.assertEqual(plan.sender_bytes, case["senderBytes"])

    def test_errors(self):
        for case in self.vectors["errors"]:
            with self.assertRaises(tp.TransferPlanError, msg=case["name"]) as cm:
                tp.build_plan(_from_json(case["spec"]))
            self.assertIn(case["errorContains"], str(cm.exception), case["name"])


def _random_spec(rng):
    replicas, shards, receivers = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4)
    tensors, senders = [], [{"holds": []} for _ in range(replicas * shards)]
    needs = [{"name": f"r{r}", "needs": []} for r in range(receivers)]
    for t in range(rng.randint(1, 10)):
        shape = [rng.randint(1, 60), rng.randint(1, 4), rng.randint(1, 5)]
        name = f"t{t}"
        tensors.append({"name": name, "dtype": rng.choice(["BFLOAT16", "FLOAT32"]),
                        "shape": shape})
        dim = rng.choice([0, 0, 1])
        for rep in range(replicas):
            for i in range(shards):
                b = tp.shard(name, shape, dim, i, shards)
                if b:
                    senders[rep * shards + i]["holds"].append(b)
        for r in range(receivers):
            k = rng.randint(1, 2)
            b = tp.shard(name, shape, rng.choice([0, 1]), r % k, k)
            if b:
                needs[r]["needs"].append(b)
    return {"tensors": tensors, "senders": senders, "receivers": needs}


class PropertiesTest(unittest.TestCase):
    def test_every_needed_element_once_from_a_holder(self):
        rng = random.Random(32)
        for _ in range(40):
            spec = _random_spec(rng)
            plan = tp.build_plan(spec)
            names = [t["name"] for t in spec["tensors"]]
            got = {}
            for p in plan.pieces:
                held = [b for b in spec["senders"][p.sender]["holds"]
                        if b["tensor"] == names[p.tensor]]
                for r in range(p.row_begin, p.row_begin + p.row_count):
                    for c in range(p.col_begin, p.col_begin + p.col_count):
                        key = (p.receiver, p.tensor, r, c)
                        got[key] = got.get(key, 0) + 1
                        self.assertTrue(any(b["row_begin"] <= r < b["row_begin"] + b["row_count"]
                                            and b["col_begin"] <= c < b["col_begin"] + b["col_count"]
                                            for b in held))
            want = set()
            for ri, rcv in enumerate(spec["receivers"]):
                for b in rcv["needs"]:
                    for r in range(b["row_begin"], b["row_begin"] + b["row_count"]):
                        for c in range(b["col_begin"], b["col_begin"] + b["col_count"]):
                            want.add((ri, names.index(b["tensor"]), r, c))
            self.assertEqual(set(got), want)
            self.assertEqual(set(got.values()), {1} if got else set())
            self.assertEqual(tp.build_plan(spec).pieces, plan.pieces)

    def test_one_senders_plan_is_its_part_of_the_whole(self):
        """build_plan(spec, sender=s): what rank s sends, the same pieces in
        the same order as the whole plan's, and the whole plan's bytes."""
        rng = random.Random(3232)
        for _ in range(40):
            spec = _random_spec(rng)
            whole = tp.build_plan(spec)
            for s in range(len(spec["senders"])):
                one = tp.build_plan(spec, sender=s)
                self.assertEqual(one.id, whole.id)
                self.assertEqual(one.sender, s)
                self.assertEqual(one.pieces, [p for p in whole.pieces if p.sender == s])
                self.assertEqual(one.sender_bytes, whole.sender_bytes)
                self.assertEqual(one.receiver_bytes, whole.receiver_bytes)
                for r in range(len(spec["receivers"])):
                    self.assertEqual(one.link_pieces(s, r), whole.link_pieces(s, r))
                    for other in range(len(spec["senders"])):
                        if other != s:
                            self.assertEqual(one.link_pieces(other, r), [])
        spec = _random_spec(rng)
        for bad in (-1, len(spec["senders"])):
            with self.assertRaisesRegex(tp.TransferPlanError, f"sender {bad}: the spec has"):
                tp.build_plan(spec, sender=bad)

    def test_replicas_balance_within_ten_percent(self):
        for senders in (2, 3, 4, 8):
            tensors = [{"name": f"l{t}", "dtype": "BFLOAT16", "shape": [64 + 37 * t, 16 + t % 5]}
                       for t in range(40)]
            spec = {"tensors": tensors,
                    "senders": [{"holds": [tp.whole(t["name"], t["shape"]) for t in tensors]}
                                for _ in range(senders)],
                    "receivers": [{"name": "r", "needs": [tp.whole(t["name"], t["shape"])
                                                          for t in tensors]}]}
            plan = tp.build_plan(spec)
            self.assertLessEqual(max(plan.sender_bytes), min(plan.sender_bytes) * 1.1)

    def test_shard_matches_torch_chunk(self):
        # torch.chunk / Shard(0) of 10 rows 4 ways: 3, 3, 3, 1.
        sizes = [tp.shard("w", [10, 2], 0, i, 4)["row_count"] for i in range(4)]
        self.assertEqual(sizes, [3, 3, 3, 1])
        self.assertIsNone(tp.shard("w", [2, 2], 0, 3, 4))
        b = tp.shard("w", [4, 6, 8], 1, 1, 3)  # dim 1 of [4, 6, 8]: columns 16..31
        self.assertEqual((b["col_begin"], b["col_count"], b["row_count"]), (16, 16, 4))
        with self.assertRaises(tp.TransferPlanError):
            tp.shard("w", [4, 6, 8], 2, 0, 2)

    def test_fsdp_shard_blocks(self):
        from weightsync.fsdp import shard_block
        # Shard(0) of [10, 4, 2] on rank 1 of 4: rows 3..5 of the [10, 8] view.
        self.assertEqual(shard_block("w", [10, 4, 2], [3, 4, 2], [3, 0, 0]),
                         tp.block("w", 3, 3, 0, 8))
        # Shard(1): columns 2..3 of dim 1 = view columns 4..7.
        self.assertEqual(shard_block("w", [10, 4, 2], [10, 2, 2], [0, 2, 0]),
                         tp.block("w", 0, 10, 4, 4))
        self.assertEqual(shard_block("w", [10, 4], [10, 4], [0, 0]), tp.whole("w", [10, 4]))
        self.assertIsNone(shard_block("w", [2, 4], [0, 4], [2, 0]))
        with self.assertRaises(ValueError):
            shard_block("w", [10, 4, 2], [10, 4, 1], [0, 0, 1])

    def test_partial_receipts_add_up_to_the_whole(self):
        import numpy as np
        from weightsync.receipts import expected_receipt
        from weightsync.senders.many_receipts import add_partials, partial_receipts
        rng = np.random.default_rng(5)
        w = rng.standard_normal((9, 6)).astype(np.float32)
        b = rng.standard_normal(7).astype(np.float32)
        layout, tensors, plan = _two_rank_engine()
        data = {"w": w.reshape(9, 6), "b": b.reshape(7, 1)}

        def payloads(r, flip=False):
            out = []
            for p in plan.link_pieces(r, 0):
                a = data[tensors[p.tensor]["name"]]
                raw = bytearray(a[p.row_begin:p.row_begin + p.row_count,
                                  p.col_begin:p.col_begin + p.col_count].tobytes())
                if flip:
                    raw[0] ^= 1
                out.append(bytes(raw))
            return out
        engines = {"e": layout}
        whole = expected_receipt(layout, {n: ("FLOAT32", a.shape, a.reshape(-1).view(np.uint8))
                                          for n, a in (("w", w), ("b", b))})
        total = add_partials(partial_receipts(plan, r, 0, engines, payloads(r)) for r in range(2))
        self.assertEqual(total["e"], (whole[0], whole[2]))
        bad = add_partials([partial_receipts(plan, 0, 0, engines, payloads(0)),
                            partial_receipts(plan, 1, 0, engines, payloads(1, flip=True))])
        self.assertNotEqual(bad["e"][0], whole[0])

    def test_link_manifest_is_a_chunk_plan_manifest(self):
        from weightsync import planner
        spec = _random_spec(random.Random(7))
        plan = tp.build_plan(spec)
        total = 0
        for s in range(plan.num_senders):
            for r in range(plan.num_receivers):
                manifest = tp.link_manifest(plan, s, r)
                if manifest:
                    total += sum(planner.plan_chunks(manifest, 4096)["payload_bytes"])
        self.assertEqual(total, sum(plan.sender_bytes))


def _fp8_param(name, shape, scale, block=(4, 4), fmt="FLOAT8_E4M3FN", reciprocal=False,
               segments=()):
    """An FP8 target and its scale parameter (as tests/test_fp8.py's)."""
    from weightsync._proto import v1
    from weightsync.receipts import fp8
    p = v1.Parameter(name=name, dtype=getattr(v1, fmt), shape=list(shape))
    for seg in segments:
        p.segments.add(**seg)
    p.quantization.CopyFrom(v1.Quantization(**fp8.quantization_fields(fmt, scale, block,
                                                                       reciprocal)))
    br, bc, rows, cols = fp8.block_shape(p)
    s = v1.Parameter(name=scale, dtype=v1.FLOAT32, shape=[-(-rows // br), -(-cols // bc)])
    return [p, s]


class Fp8PartialReceiptsTest(unittest.TestCase):
    """Many ranks' partial receipts of FP8 targets (senders.many_receipts):
    blocks cut between ranks are quantised with the whole block's amax (the
    ranks' parts exchanged, fp8_block_parts / combine_block_parts), each
    scale counted once, and the parts add up to the whole update's receipt
    (receipts.expected_receipt: what the daemon installs)."""

    @staticmethod
    def _data(tensors, seed):
        """{name: [rows, cols * element size] uint8} of each tensor's 2-D
        view: normal values, blocks of very different magnitudes, an inf
        and a NaN (neither counts in an amax), bfloat16 as float32's top
        half."""
        import numpy as np
        rng = np.random.default_rng(seed)
        out = {}
        for t in tensors:
            rows, cols = tp.view_2d(t["shape"])
            x = rng.standard_normal((rows, cols)).astype(np.float32)
            x *= np.float32(2.0) ** rng.integers(-6, 7, (rows, 1)).astype(np.float32)
            x[rows // 2, 0], x[rows - 1, cols - 1] = np.inf, np.nan
            if t["dtype"] == "BFLOAT16":
                x = (x.view(np.uint32) >> 16).astype(np.uint16)
            out[t["name"]] = x.view(np.uint8).reshape(rows, -1)
        return out

    def _check(self, tensors, holds, layout, seed=0, flip=None):
        """Plans `holds` (one list of blocks a rank) -> one daemon of one
        engine `layout` and returns (the ranks' block parts, their summed
        partial receipts, the whole receipt (checksum, bytes), the sum
        without the exchange). flip=(rank, piece): that rank's piece has
        its first element's sign flipped."""
        import json
        import types
        import numpy as np
        from weightsync import planner
        from weightsync.receipts import expected_receipt
        from weightsync.senders import many_receipts as mr
        from weightsync.senders.many import needs_of_status
        status = types.SimpleNamespace(engines=[types.SimpleNamespace(engine_id="e",
                                                                      layout=layout)])
        spec = {"tensors": tensors, "senders": [{"holds": h} for h in holds],
                "receivers": [{"name": "d", "needs": needs_of_status(status)}]}
        plan = tp.build_plan(spec)
        data = self._data(tensors, seed)
        engines = {"e": layout}

        def payloads(r):
            out = []
            for k, p in enumerate(plan.link_pieces(r, 0)):
                t = tensors[p.tensor]
                es = planner.element_size(t["dtype"])
                raw = bytearray(data[t["name"]][p.row_begin:p.row_begin + p.row_count,
                                                p.col_begin * es:(p.col_begin + p.col_count)
                                                * es].tobytes())
                if flip == (r, k):
                    raw[es - 1] ^= 0x80
                out.append(bytes(raw))
            return out
        ranks = range(len(holds))
        # Through JSON, as the tests' file collective carries them.
        parts = json.loads(json.dumps([mr.fp8_block_parts(plan, r, 0, engines, payloads(r))
                                       for r in ranks]))
        amax, owner = mr.combine_block_parts(parts)
        total = mr.add_partials(mr.partial_receipts(plan, r, 0, engines, payloads(r),
                                                    fp8_amax=amax, fp8_owner=owner)
                                for r in ranks)
        alone = mr.add_partials(mr.partial_receipts(plan, r, 0, engines, payloads(r))
                                for r in ranks)
        sent = {t["name"]: (t["dtype"], tuple(t["shape"]), data[t["name"]].reshape(-1))
                for t in tensors}
        whole = expected_receipt(layout, sent)
        return parts, total["e"], (whole[0], whole[2]), alone["e"]

    def test_row_shards_cutting_a_block(self):
        from weightsync._proto import v1
        tensors = [{"name": "w", "dtype": "FLOAT32", "shape": [10, 8]},
                   {"name": "n", "dtype": "FLOAT32", "shape": [8]}]
        layout = _fp8_param("w", [10, 8], "w_scale") + [
            v1.Parameter(name="n", dtype=v1.BFLOAT16, shape=[8])]
        holds = [[tp.shard("w", [10, 8], 0, r, 2), tp.whole("n", [8])] for r in range(2)]
        parts, total, whole, alone = self._check(tensors, holds, layout)
        # Rows 0..4 and 5..9: block row 1 (rows 4..7) cut, both its blocks.
        self.assertEqual(sorted(parts[0]), ["e/w/2", "e/w/3"])
        self.assertEqual(sorted(parts[1]), ["e/w/2", "e/w/3"])
        self.assertEqual([parts[0]["e/w/2"][1], parts[1]["e/w/2"][1]], [4, 12])
        self.assertEqual(total, whole)
        self.assertNotEqual(alone, whole)   # the exchange is what makes them agree
        # 80 FP8 bytes + 6 scales + n's 8 bfloat16.
        self.assertEqual(whole[1], 80 + 6 * 4 + 16)

    def test_column_shards_cutting_blocks(self):
        tensors = [{"name": "q", "dtype": "BFLOAT16", "shape": [8, 10]},
                   {"name": "k", "dtype": "BFLOAT16", "shape": [4, 10]},
                   {"name": "o", "dtype": "FLOAT32", "shape": [5, 10]}]
        seg = dict(col_begin=0, col_count=10, dest_row_stride=10)
        # A fused qkv of q and k (e5m2, reciprocal scales, 4 x 4 blocks)
        # and a per-row target.
        layout = (_fp8_param("qkv", [12, 10], "qkv_scale", fmt="FLOAT8_E5M2", reciprocal=True,
                             segments=[dict(source="q", row_begin=0, row_count=8,
                                            dest_offset=0, **seg),
                                       dict(source="k", row_begin=0, row_count=4,
                                            dest_offset=80, **seg)])
                  + _fp8_param("o", [5, 10], "o_scale", block=None))
        holds = [[tp.shard(t["name"], t["shape"], 1, r, 2) for t in tensors] for r in range(2)]
        parts, total, whole, alone = self._check(tensors, holds, layout, seed=1)
        # Columns 0..4 and 5..9: block column 1 (4..7) of qkv cut in every
        # block row, and every row of o.
        self.assertEqual(sorted(parts[1]), sorted(parts[0]))
        self.assertEqual(sorted(k for k in parts[0] if k.startswith("e/qkv/")),
                         ["e/qkv/1", "e/qkv/4", "e/qkv/7"])
        self.assertEqual(len([k for k in parts[0] if k.startswith("e/o/")]), 5)
        self.assertEqual(total, whole)
        self.assertNotEqual(alone, whole)

    def test_replicas_whose_rows_the_plan_splits(self):
        tensors = [{"name": "w", "dtype": "FLOAT32", "shape": [18, 8]},
                   {"name": "u", "dtype": "BFLOAT16", "shape": [7, 12]}]
        layout = _fp8_param("w", [18, 8], "w_scale") + _fp8_param("u", [7, 12], "u_scale",
                                                                   block=(4, 8))
        holds = [[tp.whole(t["name"], t["shape"]) for t in tensors] for _ in range(2)]
        parts, total, whole, alone = self._check(tensors, holds, layout, seed=2)
        self.assertTrue(parts[0] and parts[1], "the plan cut no block: the case is not covered")
        self.assertEqual(total, whole)
        self.assertNotEqual(alone, whole)

    def test_row_shards_on_block_boundaries_need_no_exchange(self):
        tensors = [{"name": "w", "dtype": "FLOAT32", "shape": [16, 6]}]
        layout = _fp8_param("w", [16, 6], "w_scale")
        holds = [[tp.shard("w", [16, 6], 0, r, 2)] for r in range(2)]
        parts, total, whole, alone = self._check(tensors, holds, layout, seed=3)
        self.assertEqual(parts, [{}, {}])
        self.assertEqual(total, whole)
        self.assertEqual(alone, whole)

    def test_a_flipped_byte_on_one_rank_changes_the_total(self):
        tensors = [{"name": "w", "dtype": "FLOAT32", "shape": [10, 8]}]
        layout = _fp8_param("w", [10, 8], "w_scale")
        holds = [[tp.shard("w", [10, 8], 0, r, 2)] for r in range(2)]
        _, total, whole, _ = self._check(tensors, holds, layout, seed=4)
        self.assertEqual(total, whole)
        for rank in (0, 1):
            _, bad, whole_again, _ = self._check(tensors, holds, layout, seed=4,
                                                 flip=(rank, 0))
            self.assertEqual(whole_again, whole)
            self.assertNotEqual(bad[0], whole[0], f"rank {rank}")
            self.assertEqual(bad[1], whole[1])

    def test_plain_layouts_partials_are_unchanged(self):
        """Without FP8 targets: no block parts, and each link's partial
        receipt is expected_receipt over its view, whatever FP8 maps come
        with it (what partial_receipts computed before FP8 targets)."""
        import numpy as np
        from weightsync import planner
        from weightsync._proto import v1
        from weightsync.receipts import expected_receipt
        from weightsync.senders import many_receipts as mr
        rng = random.Random(3208)
        for _ in range(12):
            spec = _random_spec(rng)
            plan = tp.build_plan(spec)
            engines = [{"e": [v1.Parameter(name=t["name"], dtype=v1.FLOAT16,
                                           shape=t["shape"]) for t in spec["tensors"]]}
                       for _ in spec["receivers"]]
            self.assertFalse(mr.has_fp8_targets(engines))
            nrng = np.random.default_rng(rng.randrange(1 << 30))
            for s in range(plan.num_senders):
                for r in range(plan.num_receivers):
                    pieces = plan.link_pieces(s, r)
                    payloads = [nrng.integers(0, 256, p.row_count * p.col_count * planner
                                              .element_size(spec["tensors"][p.tensor]["dtype"]),
                                              dtype=np.uint8).tobytes() for p in pieces]
                    views, manifest = mr.link_views(plan, s, r, engines[r])
                    sent = {m["name"]: (m["dtype"], tuple(m["shape"]),
                                        np.frombuffer(d, np.uint8))
                            for m, d in zip(manifest, payloads)}
                    want = {e: [str(int(c)), int(b)]
                            for e, (c, _, b) in ((e, expected_receipt(v, sent))
                                                 for e, v in views.items())}
                    self.assertEqual(mr.fp8_block_parts(plan, s, r, engines[r], payloads), {})
                    got = mr.partial_receipts(plan, s, r, engines[r], payloads)
                    self.assertEqual(got, want)
                    self.assertEqual(mr.partial_receipts(
                        plan, s, r, engines[r], payloads, fp8_amax={"e/x/0": 1.0},
                        fp8_owner={"e/x/0": 1 - s}), want)

    def test_many_senders_exchange_the_parts_in_step(self):
        """many_receipts.exchanged_fp8_partials on two ranks (threads, one collective):
        the receipts add up to the whole; a rank whose sends failed still
        joins the exchange, and then neither reports receipts."""
        import threading
        import numpy as np
        from weightsync.receipts import expected_receipt
        from weightsync.senders import many_receipts as mr
        tensors = [{"name": "w", "dtype": "FLOAT32", "shape": [10, 8]}]
        layout = _fp8_param("w", [10, 8], "w_scale")
        holds = [[tp.shard("w", [10, 8], 0, r, 2)] for r in range(2)]
        spec = {"tensors": tensors, "senders": [{"holds": h} for h in holds],
                "receivers": [{"name": "d", "needs": [tp.whole("w", [10, 8])]},
                              {"name": "other", "needs": []}]}
        plan = tp.build_plan(spec)
        data = self._data(tensors, 5)["w"]
        payloads = [[data[p.row_begin:p.row_begin + p.row_count].tobytes()
                     for p in plan.link_pieces(r, 0)] for r in range(2)]

        class Threads:
            def __init__(self, rank, box, barrier):
                self.rank, self.world_size, self._box, self._b = rank, 2, box, barrier

            def all_gather(self, obj):
                self._box[self.rank] = obj
                self._b.wait(10)
                out = list(self._box)
                self._b.wait(10)
                return out

        def run(fail_rank):
            box, barrier, out = [None, None], threading.Barrier(2), [None, None]

            def rank(r):
                out[r] = mr.exchanged_fp8_partials(
                    Threads(r, box, barrier), plan, r, [{"e": layout}, {}],
                    None if r == fail_rank else [payloads[r], 0])
            threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
            return out
        got = run(None)
        self.assertEqual(got[0][1], 0)
        whole = expected_receipt(layout, {"w": ("FLOAT32", (10, 8), data.reshape(-1))})
        self.assertEqual(mr.add_partials(g[0] for g in got)["e"], (whole[0], whole[2]))
        self.assertEqual(run(1), [[], []])


def _two_rank_engine():
    """(layout, tensors, plan): an engine taking w's columns 1..4 into a
    float16 [9, 3] parameter (a conversion and a segment) and b whole in
    float32, fed by two ranks of w's row shards that both hold b."""
    from weightsync._proto import v1
    layout = [v1.Parameter(name="p", dtype=v1.FLOAT16, shape=[9, 3],
                           segments=[v1.Segment(source="w", row_begin=0, row_count=9,
                                                col_begin=1, col_count=3)]),
              v1.Parameter(name="b", dtype=v1.FLOAT32, shape=[7])]
    tensors = [{"name": "w", "dtype": "FLOAT32", "shape": [9, 6]},
               {"name": "b", "dtype": "FLOAT32", "shape": [7]}]
    spec = {"tensors": tensors,
            "senders": [{"holds": [tp.shard("w", [9, 6], 0, r, 2), tp.whole("b", [7])]}
                        for r in range(2)],
            "receivers": [{"name": "d", "needs": [tp.block("w", 0, 9, 1, 3),
                                                  tp.whole("b", [7])]}]}
    return layout, tensors, tp.build_plan(spec)


class ManySparseTest(unittest.TestCase):
    """weightsync.senders.many_sparse: what a rank keeps and diffs."""

    def test_basis_patches_what_changed_little_and_keeps_within_its_budget(self):
        import numpy as np
        from weightsync.senders.many_sparse import (Basis, link_manifest_with_patches,
                                                    patch_entries)
        from types import SimpleNamespace
        piece = SimpleNamespace(row_count=4, col_count=25)   # a plan piece of 100 float32
        before = np.arange(100, dtype=np.float32)
        few, many = before.copy(), before + 1
        few[[3, 70]] = -1
        basis = Basis(budget=None)
        basis.keep("p", 1, {0: [before.tobytes(), before.tobytes(), before.tobytes()]})
        got = basis.patches("p", 1, 0, [piece] * 3,
                            [few.tobytes(), many.tobytes(), before.tobytes()], max_density=0.05)
        self.assertEqual(sorted(got), [0, 2])      # the piece that changed wholly goes dense
        self.assertEqual(got[0].indices.tolist(), [3, 70])
        self.assertEqual(got[0].values.view(np.float32).tolist(), [-1, -1])
        self.assertEqual(got[2].nnz, 1)            # unchanged: one element, still a patch
        self.assertEqual(got[0].index_bytes, 4)
        self.assertEqual(patch_entries(3, {0: got}), [[3, 0, 0, 2, 4], [3, 0, 2, 1, 4]])
        manifest = link_manifest_with_patches([{"name": "a"}, {"name": "b"}, {"name": "c"}], got)
        self.assertEqual([m.get("sparse_nnz", 0) for m in manifest], [2, 0, 1])
        # Another plan or base version: no basis, every piece dense.
        self.assertEqual(basis.patches("q", 1, 0, [piece], [few.tobytes()], 0.05), {})
        self.assertEqual(basis.patches("p", 2, 0, [piece], [few.tobytes()], 0.05), {})
        # A budget of one piece keeps the first; the second goes dense.
        small = Basis(budget=400)
        small.keep("p", 1, {0: [before.tobytes(), before.tobytes()]})
        self.assertEqual(sorted(small.patches("p", 1, 0, [piece] * 2,
                                              [few.tobytes(), few.tobytes()], 0.05)), [0])
        small.clear()
        self.assertEqual(small.patches("p", 1, 0, [piece], [few.tobytes()], 0.05), {})


    def test_receipt_deltas_are_the_change_of_the_partial_receipts(self):
        import numpy as np
        from weightsync.senders.many_receipts import partial_receipts
        from weightsync.senders.many_sparse import receipt_deltas
        rng = np.random.default_rng(9)
        layout, tensors, plan = _two_rank_engine()
        engines = {"e": layout}

        def payloads(data, r):
            return [data[tensors[p.tensor]["name"]][p.row_begin:p.row_begin + p.row_count,
                                                    p.col_begin:p.col_begin + p.col_count]
                    .tobytes() for p in plan.link_pieces(r, 0)]
        before = {"w": rng.standard_normal((9, 6)).astype(np.float32),
                  "b": rng.standard_normal((7, 1)).astype(np.float32)}
        after = {k: a.copy() for k, a in before.items()}
        after["w"][[0, 4, 8], [1, 2, 0]] = [7.0, -3.5, 1.0]   # (8, 0) is in no segment
        after["b"][5] = 2.0
        for r in range(2):
            old = partial_receipts(plan, r, 0, engines, payloads(before, r))
            new = partial_receipts(plan, r, 0, engines, payloads(after, r))
            delta = receipt_deltas(plan, r, 0, engines, payloads(before, r), payloads(after, r))
            self.assertEqual(set(delta), {"e"})
            self.assertEqual((int(old["e"][0]) + delta["e"]) % (1 << 64), int(new["e"][0]))
            self.assertNotEqual(old["e"][0], new["e"][0])
        # Nothing changed: no change.
        self.assertEqual(receipt_deltas(plan, 0, 0, engines, payloads(before, 0),
                                        payloads(before, 0)), {"e": 0})


class _Rows:
    """numpy standing in for the torch calls many_nccl.piece_views makes."""

    def __init__(self, a):
        self.a = a

    def __getitem__(self, key):
        return _Rows(self.a[key])

    def is_contiguous(self):
        return self.a.flags.c_contiguous

    def contiguous(self):
        return _Rows(self.a.copy())

    def reshape(self, *shape):
        return _Rows(self.a.reshape(*shape))

    def view(self, *shape):
        return _Rows(self.a.reshape(*shape))

    def copy_(self, src):
        self.a[...] = src.a


class NcclScheduleTest(unittest.TestCase):
    """The NCCL sender's side of M -> N (weightsync.senders.many_nccl), torch
    free: every chunk it sends, in place or packed, is byte for byte what the
    host path (planner.pack_chunk over the piece bytes) sends on that link,
    and round k holds chunk k of every link (the daemons' receive order)."""

    def test_rounds_carry_the_host_paths_bytes(self):
        import numpy as np
        from weightsync import planner
        from weightsync.senders import many_nccl
        for seed in range(6):
            rng = random.Random(seed)
            spec = _random_spec(rng)
            plan = tp.build_plan(spec)
            nrng = np.random.default_rng(seed)
            data, sizes = {}, {}
            for k, t in enumerate(spec["tensors"]):
                rows, cols = tp.view_2d(t["shape"])
                es = planner.element_size(t["dtype"])
                sizes[k] = es
                data[k] = nrng.integers(0, 256, (rows, cols * es), dtype=np.uint8)
            index = {t["name"]: k for k, t in enumerate(spec["tensors"])}
            for s in range(plan.num_senders):
                held = {}
                for b in spec["senders"][s]["holds"]:
                    k = index[b["tensor"]]
                    es = sizes[k]
                    part = data[k][b["row_begin"]:b["row_begin"] + b["row_count"],
                                   b["col_begin"] * es:(b["col_begin"] + b["col_count"]) * es]
                    held.setdefault(k, []).append((b, _Rows(np.ascontiguousarray(part))))
                plans, flats = {}, {}
                for r in range(plan.num_receivers):
                    pieces = plan.link_pieces(s, r)
                    if not pieces:
                        continue
                    views, copies = many_nccl.piece_views(
                        pieces, held, sizes, lambda n: _Rows(np.zeros(n, np.uint8)))
                    many_nccl.refresh(copies)
                    flats[r] = [v.a for v in views]
                    want = [data[p.tensor][p.row_begin:p.row_begin + p.row_count,
                                           p.col_begin * sizes[p.tensor]:
                                           (p.col_begin + p.col_count) * sizes[p.tensor]].tobytes()
                            for p in pieces]
                    self.assertEqual([f.tobytes() for f in flats[r]], want)
                    plans[r] = planner.plan_chunks(tp.link_manifest(plan, s, r), 1024)
                    for c in plans[r]["chunks"]:
                        direct = many_nccl.direct_source(c)
                        if direct is not None:
                            got = flats[r][direct[0]][direct[1]:direct[1] + c["size"]].tobytes()
                        else:
                            padded, copies = many_nccl.pack_ops(c)
                            buf = bytearray(c["size"]) if padded else bytearray(b"\xff" * c["size"])
                            for at, piece, begin, length in copies:
                                buf[at:at + length] = flats[r][piece][begin:begin + length].tobytes()
                            got = bytes(buf)
                        self.assertEqual(got, planner.pack_chunk(c, want), (seed, s, r, c["index"]))
                rounds = many_nccl.link_rounds(plans)
                self.assertEqual(len(rounds), max((len(p["chunks"]) for p in plans.values()),
                                                  default=0))
                for k, round_ in enumerate(rounds):
                    self.assertEqual([i for i, _ in round_],
                                     sorted(i for i in plans if k < len(plans[i]["chunks"])))
                    self.assertTrue(all(c["index"] == k for _, c in round_))

    def test_a_piece_no_block_holds_is_refused(self):
        from weightsync._errors import WeightSyncError
        from weightsync.senders import many_nccl
        plan = tp.build_plan({"tensors": [{"name": "w", "dtype": "FLOAT32", "shape": [4, 4]}],
                              "senders": [{"holds": [tp.whole("w", [4, 4])]}],
                              "receivers": [{"name": "d", "needs": [tp.whole("w", [4, 4])]}]})
        with self.assertRaises(WeightSyncError) as cm:
            many_nccl.piece_views(plan.link_pieces(0, 0), {}, {0: 4}, None)
        self.assertIn("does not hold", cm.exception.message)


if __name__ == "__main__":
    unittest.main()
