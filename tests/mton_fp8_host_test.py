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
senders is quantised once, whole, as if one sender had sent it.
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

    def job(self, ranks, case, versions):
        """Every version sent by `ranks` rank threads; returns, per rank,
        [(version, committed responses or the exception)]."""
        room = {"n": ranks, "slots": [None] * ranks, "barrier": threading.Barrier(ranks, timeout=60)}
        out = [[] for _ in range(ranks)]

        def rank_main(r):
            trainer = weightsync.Trainer(self.target, timeout=60)
            try:
                if r == 0:
                    trainer.init_host()
                senders = ManySenders(trainer._link, ThreadCollective(room, r))
                for version in versions:
                    manifest, local = holdings(case, r, ranks, self.sent[version])
                    try:
                        got = senders.update(manifest, local, version, chunk_bytes=24 << 10,
                                             update_id=f"u{version}")
                        out[r].append((version, got, sorted(senders.last_checked)))
                    except Exception as e:  # reported, asserted below
                        out[r].append((version, e, []))
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
                for v, got, checked in out[r]:
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


if __name__ == "__main__":
    unittest.main()
