#!/usr/bin/env python3
"""Issue 32: FP8 targets through a transfer plan on the host backend (many
senders into FP8 engines; docs/transfer_plan.md, "FP8 targets").

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 tests/mton_fp8_host_test.py

One daemon holds tests/fp8_host_test.py's FP8 engines (a TP=2 pair in e4m3
with 128 x 128 block scales, a TP=1 engine in e5m2 with per-row reciprocal
scales, a plain bfloat16 one). Trainer ranks, threads of this process
each with its own Trainer and a collective of their own, hold the
checkpoint as (a) FSDP row shards on block boundaries (2 ranks), (b) row
shards that cut blocks (3 ranks: 512 rows at 171 and 342), (c) column
shards that cut blocks (3 ranks), (d) two replicas (the plan splits their
rows by bytes, anywhere). Each case sends two versions with receipts on
(the leader checks each engine's receipt against the ranks' summed
parts); then every FP8 weight and scale is compared bit for bit with
weightsync.fp8 applied to the whole checkpoint: a block cut between
senders is quantised once, whole, as if one sender had sent it. Then the
same cases with fp8_on_wire=True into the TP pair: each rank quantises
its pieces of the tensors no shard cuts (weightsync.senders.many_wire).
Then sparse patches into the FP8 engines: each rank patches only what
feeds no FP8 target (the daemon refuses the rest), the linear weights
dense or quantised on the wire.
"""

import json
import os
import sys
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "..", "client", "python")
sys.path.insert(0, CLIENT)
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import weightsync  # noqa: E402
from weightsync import transfer_plan  # noqa: E402
from weightsync.senders.many import ManySenders  # noqa: E402
import fp8_host_test  # noqa: E402


class ThreadCollective:
    """Ranks that are threads of one process: each call is a round, its
    objects copied through JSON as a real collective serialises them."""

    def __init__(self, room, rank):
        self.room, self.rank, self.world_size = room, rank, room["n"]

    def all_gather(self, obj):
        room = self.room
        room["slots"][self.rank] = json.dumps(obj)
        room["barrier"].wait()
        out = [json.loads(s) for s in room["slots"]]
        room["barrier"].wait()
        return out

    def broadcast(self, obj, src=0):
        return self.all_gather(obj if self.rank == src else None)[src]


def run_ranks(ranks, rank_main, timeout=120):
    """rank_main(r) on a thread per rank; raises if one is still running
    after `timeout` seconds."""
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise AssertionError("a rank hung")


def holdings(case, rank, ranks, ck):
    """(manifest, [(block, array)]) of rank `rank` of `ranks` in `case`."""
    manifest, local = [], []
    for name, a in ck.items():
        manifest.append({"name": name, "dtype": "FLOAT32", "shape": list(a.shape)})
        rows = a.reshape(a.shape[0], -1)
        if case == "replicas":
            local.append((transfer_plan.whole(name, a.shape), a))
            continue
        dim = 1 if case == "cols" and a.ndim > 1 else 0
        b = transfer_plan.shard(name, a.shape, dim, rank, ranks)
        if b is None:
            continue
        local.append((b, np.ascontiguousarray(
            rows[b["row_begin"]:b["row_begin"] + b["row_count"],
                 b["col_begin"]:b["col_begin"] + b["col_count"]])))
    return manifest, local


# Case: (ranks, how they hold the checkpoint).
CASES = {"aligned rows": (2, "rows"), "rows cut": (3, "rows"), "cols cut": (3, "cols"),
         "replicas": (2, "replicas")}


class ManyFp8HostTest(unittest.TestCase):
    def setUp(self):
        fp8_host_test.Fp8HostTest.setUp(self)
        # Each job's rank 0 forms the group: the fixture's trainer, which
        # formed one, steps aside (and stays to read statuses).
        self.trainer.close()
        self.trainer = weightsync.Trainer(self.target, timeout=60)

    tearDown = fp8_host_test.Fp8HostTest.tearDown
    memory = fp8_host_test.Fp8HostTest.memory
    check_engines = fp8_host_test.Fp8HostTest.check_engines

    def job(self, ranks, case, versions, engine_ids=None, fp8_on_wire=False, sparse=False):
        """Every version sent by `ranks` rank threads (`sparse`: each rank
        keeps what it sent and patches each version after the first
        against the one before); returns, per rank, [(version, committed
        responses or the exception, engines checked, tensors sent
        quantised, ManySenders.last_wire)]."""
        room = {"n": ranks, "slots": [None] * ranks, "barrier": threading.Barrier(ranks, timeout=60)}
        out = [[] for _ in range(ranks)]

        def rank_main(r):
            trainer = weightsync.Trainer(self.target, timeout=60)
            try:
                if r == 0:
                    trainer.init_host()
                senders = ManySenders(trainer._link, ThreadCollective(room, r), engine_ids,
                                      fp8_on_wire=fp8_on_wire,
                                      basis_bytes=None if sparse else 0)
                for k, version in enumerate(versions):
                    manifest, local = holdings(case, r, ranks, self.sent[version])
                    base = versions[k - 1] if sparse and k else None
                    try:
                        got = senders.update(manifest, local, version, chunk_bytes=24 << 10,
                                             update_id=f"u{version}", base_version=base,
                                             max_density=0.05)
                        out[r].append((version, got, sorted(senders.last_checked),
                                       sorted(senders.wire), dict(senders.last_wire)))
                    except Exception as e:  # reported, asserted below
                        out[r].append((version, e, [], [], None))
            finally:
                trainer.close()
        run_ranks(ranks, rank_main)
        return out

    def test_many_senders_quantise_every_block_once(self):
        version = 0
        self.sent = {}
        engines = sorted(self.shm)
        for name, (ranks, case) in CASES.items():
            versions = [version + 1, version + 2]
            for v in versions:
                self.sent[v] = fp8_host_test.checkpoint(v)
            out = self.job(ranks, case, versions)
            for r in range(ranks):
                for v, got, checked, _, _ in out[r]:
                    self.assertIsInstance(got, list, f"{name} v{v} rank {r}: {got}")
                    self.assertEqual([c.version for c in got], [v], name)
                    if r == 0:   # the leader checked every engine's receipt
                        self.assertEqual(checked, engines, f"{name} v{v}")
            self.check_engines(self.sent[versions[-1]], f"{name} v{versions[-1]}")
            for s in self.trainer.status().engines:
                self.assertEqual((s.version, s.state), (versions[-1], fp8_host_test.v1.ENGINE_READY),
                                 f"{name}: {s.engine_id}")
            print(f"{name}: {ranks} ranks, versions {versions} bit-exact, receipts match",
                  flush=True)
            version += 2

    def test_pieces_quantised_on_the_wire_land_as_the_daemon_quantises(self):
        """FP8 on the wire through the plan (fp8_on_wire=True) into the TP
        pair (e4m3, 128 x 128 blocks): with row shards on block boundaries
        every linear weight's pieces travel quantised (fewer bytes than the
        same job unquantised); where the shards or the replicas' split cut
        a tensor's blocks that tensor goes as it is; every FP8 weight and
        scale bit for bit weightsync.fp8 of the whole checkpoint, the
        receipts checked, in every case."""
        engines = ["tp0", "tp1"]
        linear = sorted(n for n in fp8_host_test.checkpoint(1) if n.endswith(
            tuple(p + "_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))))
        self.sent, version = {}, 0
        for name, (ranks, case) in CASES.items():
            bytes_of = {}
            for wire in (False, True):
                version += 1
                self.sent[version] = fp8_host_test.checkpoint(version)
                out = self.job(ranks, case, [version], engine_ids=engines, fp8_on_wire=wire)
                for r in range(ranks):
                    v, got, checked, quantised, _ = out[r][0]
                    self.assertIsInstance(got, list, f"{name} wire={wire} rank {r}: {got}")
                    self.assertEqual([c.version for c in got], [v], name)
                    self.assertEqual(quantised, out[0][0][3], f"{name}: the ranks agree")
                    if r == 0:
                        self.assertEqual(checked, engines, f"{name} wire={wire}")
                bytes_of[wire] = out[0][0][1][0].bytes
                quantised = out[0][0][3]
                every = self.specs
                self.specs = [x for x in every if x[0] in engines]
                try:
                    self.check_engines(self.sent[version], f"{name} wire={wire}")
                finally:
                    self.specs = every
            if case == "rows" and ranks == 2:
                self.assertEqual(quantised, linear, name)
                self.assertLess(bytes_of[True], 0.6 * bytes_of[False], name)
            elif case in ("rows", "cols"):
                self.assertEqual(quantised, [], f"{name}: every tensor's blocks are cut")
                self.assertEqual(bytes_of[True], bytes_of[False], name)
            self.assertTrue(set(quantised) <= set(linear), name)
            print(f"{name}, fp8_on_wire: {len(quantised)} of {len(linear)} linear weights "
                  f"quantised by their senders, {bytes_of[True]} bytes against "
                  f"{bytes_of[False]}; bit-exact, receipts match", flush=True)

    def test_sparse_patches_skip_the_tensors_that_feed_fp8_targets(self):
        """Sparse patches into FP8 engines (base_version): each rank patches
        only its pieces of tensors that feed no FP8 target of the engines
        (norms, embeddings, lm_head: the daemon refuses a patch into an
        FP8-fed tensor, whose blocks' scales it would leave stale); the
        linear weights go dense, quantised by their senders with
        fp8_on_wire. Into every engine (5: FP8 TP pair, per-row e5m2,
        stacked experts, bfloat16), then into the TP pair with
        fp8_on_wire; v2 changes 0.3% of every tensor's elements; every
        FP8 weight and scale bit for bit, receipts checked."""
        linear = sorted(n for n in fp8_host_test.checkpoint(1) if n.endswith(
            tuple(p + "_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))))
        rng = np.random.default_rng(7)
        self.sent, version = {}, 0
        for engines, wire in ((None, False), (["tp0", "tp1"], True)):
            versions = [version + 1, version + 2]
            base = fp8_host_test.checkpoint(versions[0])
            after = {n: a.copy() for n, a in base.items()}
            for a in after.values():
                flat = a.reshape(-1)
                at = rng.choice(flat.size, max(2, flat.size * 3 // 1000), replace=False)
                flat[at] = rng.standard_normal(at.size).astype(np.float32)
            self.sent.update({versions[0]: base, versions[1]: after})
            out = self.job(2, "rows", versions, engine_ids=engines, fp8_on_wire=wire,
                           sparse=True)
            for r in range(2):
                for v, got, checked, quantised, _ in out[r]:
                    self.assertIsInstance(got, list, f"wire={wire} v{v} rank {r}: {got}")
                    self.assertEqual([c.version for c in got], [v])
                    self.assertEqual(quantised, linear if wire else [], f"wire={wire}")
                    if r == 0:
                        self.assertEqual(checked, engines or sorted(self.shm), f"wire={wire}")
            # The ranks' blocks of tensors that feed no FP8 target of the
            # engines (as the fixture registers them): at most those go
            # as patches, and some do.
            fed = set()
            for eid, _, segments, quant in self.specs:
                if engines is None or eid in engines:
                    for name in quant:
                        fed.update([g["source"] for g in segments[name]]
                                   if segments.get(name) else [name])
            self.assertEqual(fed, set(linear))
            plain = sum(1 for r in range(2) for b, _ in holdings("rows", r, 2, after)[1]
                        if b["tensor"] not in fed)
            figures = [out[r][1][4] for r in range(2)]
            patched = sum(f["patched_pieces"] for f in figures)
            self.assertTrue(0 < patched <= plain, (patched, plain))
            dense = sum(f["dense_bytes"] for f in figures)
            sent = sum(f["wire_bytes"] for f in figures)
            # The linear weights are most of the bytes: dense, they keep
            # the wire near dense; quantised, near half of it (float32 ->
            # a byte an element plus scales, the patches a few percent).
            linear_bytes = sum(self.sent[versions[1]][n].nbytes for n in linear)
            self.assertLess(sent, dense)
            if wire:
                self.assertLess(sent, 0.35 * linear_bytes + 0.1 * (dense - linear_bytes))
            else:
                self.assertGreaterEqual(sent, linear_bytes)
            every = self.specs
            if engines:
                self.specs = [x for x in every if x[0] in engines]
            try:
                self.check_engines(after, f"sparse wire={wire}")
            finally:
                self.specs = every
            print(f"sparse into FP8 engines, fp8_on_wire={wire}: {patched} pieces patched "
                  f"(of {plain} that feed no FP8 target), {sent} of {dense} dense bytes on "
                  "the wire; bit-exact, receipts match", flush=True)
            version += 2


if __name__ == "__main__":
    unittest.main()
