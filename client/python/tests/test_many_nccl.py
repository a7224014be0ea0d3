#!/usr/bin/env python3
"""weightsync.senders.many_nccl's sender (NcclLinks.push) on the CPU: torch
is tests/fake_torch.py (numpy memory, streams that run at once) and the
communicator records what each send reads. Checked: per daemon, the bytes
sent are the host path's link stream (planner.pack_chunk of the same
pieces), in place or packed, padding zero; round k holds chunk k of every
link, one send per daemon; a second update of the same tensors reuses the
compiled program and sends their new values (column-cut pieces included);
rounds the GPU never finishes end in ABORTED with the communicator aborted
once the watch reports the update ended on a daemon.

    python3 client/python/tests/test_many_nccl.py
"""

import ctypes
import os
import sys
import unittest
from types import SimpleNamespace

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(_HERE))

import fake_torch  # noqa: E402

sys.modules["torch"] = fake_torch

from weightsync import planner  # noqa: E402
from weightsync import transfer_plan as tp  # noqa: E402
from weightsync._errors import WeightSyncError  # noqa: E402
from weightsync.senders import many_nccl  # noqa: E402

CHUNK = 1024
PEERS = {0: 2, 1: 3}   # daemon index -> its NCCL rank (after trainer ranks 0, 1)


class FakeComm:
    def __init__(self):
        self.groups, self.open, self.aborted = [], None, False

    def group_start(self):
        assert self.open is None, "groups do not nest"
        self.open = []

    def group_end(self):
        self.groups.append(self.open)
        self.open = None

    def send(self, ptr, nbytes, peer, stream):
        self.open.append((peer, ctypes.string_at(ptr, nbytes)))

    def async_error(self):
        return None

    def abort(self):
        self.aborted = True


# w: row shards, one receiver a TP row shard; o: column halves (row-parallel
# TP) of row shards, so pieces cut columns; n: replicated (the plan splits
# it); b: odd-sized, one holder.
TENSORS = [{"name": "w", "dtype": "FLOAT32", "shape": [64, 96]},
           {"name": "o", "dtype": "BFLOAT16", "shape": [48, 64]},
           {"name": "n", "dtype": "FLOAT32", "shape": [10]},
           {"name": "b", "dtype": "BFLOAT16", "shape": [7]}]
HOLDS = [[tp.block("w", 0, 32, 0, 96), tp.block("o", 0, 24, 0, 64), tp.whole("n", [10])],
         [tp.block("w", 32, 32, 0, 96), tp.block("o", 24, 24, 0, 64), tp.whole("n", [10]),
          tp.whole("b", [7])]]
NEEDS = [[tp.whole("w", [64, 96]), tp.block("o", 0, 48, 0, 32), tp.whole("n", [10]),
          tp.whole("b", [7])],
         [tp.block("w", 16, 32, 0, 96), tp.block("o", 0, 48, 32, 32), tp.whole("n", [10]),
          tp.whole("b", [7])]]


def make_plan():
    return tp.build_plan({"tensors": TENSORS,
                          "senders": [{"holds": h} for h in HOLDS],
                          "receivers": [{"name": f"d{i}", "needs": n}
                                        for i, n in enumerate(NEEDS)]})


def global_bytes(seed):
    rng = np.random.default_rng(seed)
    out = {}
    for t in TENSORS:
        rows, cols = tp.view_2d(t["shape"])
        out[t["name"]] = rng.integers(0, 256, (rows, cols * planner.element_size(t["dtype"])),
                                      dtype=np.uint8)
    return out


def local_of(rank, data):
    """[(block, fake tensor of the block's bytes)] of trainer rank `rank`."""
    out = []
    for b in HOLDS[rank]:
        es = planner.element_size(next(t["dtype"] for t in TENSORS if t["name"] == b["tensor"]))
        part = data[b["tensor"]][b["row_begin"]:b["row_begin"] + b["row_count"],
                                 b["col_begin"] * es:(b["col_begin"] + b["col_count"]) * es]
        out.append((b, fake_torch.Tensor(part.copy())))   # memory of its own
    return out


def host_stream(plan, rank, daemon, data):
    """The host path's chunks of link (rank, daemon)."""
    pieces = plan.link_pieces(rank, daemon)
    payloads = []
    for p in pieces:
        t = plan.tensors[p.tensor]
        es = planner.element_size(t["dtype"])
        payloads.append(data[t["name"]][p.row_begin:p.row_begin + p.row_count,
                                        p.col_begin * es:(p.col_begin + p.col_count) * es]
                        .tobytes())
    chunks = planner.plan_chunks(tp.link_manifest(plan, rank, daemon), CHUNK)["chunks"]
    return [planner.pack_chunk(c, payloads) for c in chunks]


class PushTest(unittest.TestCase):
    def setUp(self):
        fake_torch.cuda.Event.held = False
        self.plan = make_plan()

    def check_sends(self, comm, rank, data):
        want = {i: host_stream(self.plan, rank, i, data) for i in PEERS}
        self.assertEqual(len(comm.groups), max(len(w) for w in want.values()))
        got = {i: [] for i in PEERS}
        for k, group in enumerate(comm.groups):
            peers = [peer for peer, _ in group]
            self.assertEqual(peers, [PEERS[i] for i in sorted(PEERS) if k < len(want[i])],
                             f"round {k}")
            for peer, raw in group:
                got[next(i for i, r in PEERS.items() if r == peer)].append(raw)
        for i in PEERS:
            self.assertEqual(got[i], want[i], f"rank {rank} -> daemon {i}")

    def test_every_send_is_the_host_paths_bytes_and_a_repeat_sends_new_values(self):
        for rank in (0, 1):
            comm = FakeComm()
            links = many_nccl.NcclLinks(comm, "cuda:0", PEERS, pack_buffers=4)
            data = global_bytes(rank)
            local = local_of(rank, data)
            links.push(self.plan, rank, local, {"chunk_bytes": [CHUNK, CHUNK]}, None, False)
            self.check_sends(comm, rank, data)
            self.assertGreater(len(comm.groups), 2)
            program = links._pending[1]
            # New values in the same tensors (an optimizer step in place).
            fresh = global_bytes(100 + rank)
            for b, t in local_of(rank, fresh):
                mine = next(x for c, x in local if c == b)
                np.copyto(mine.a, t.a)
            comm.groups.clear()
            links.push(self.plan, rank, local, {"chunk_bytes": [CHUNK, CHUNK]}, None, False)
            self.assertIs(links._pending[1], program, "the program was made again")
            self.check_sends(comm, rank, fresh)
            # Other tensors (new memory): a new program, their bytes.
            other = local_of(rank, data)
            comm.groups.clear()
            links.push(self.plan, rank, other, {"chunk_bytes": [CHUNK, CHUNK]}, None, False)
            self.assertIsNot(links._pending[1], program)
            self.check_sends(comm, rank, data)
            # Only the last program is kept: the old tensors are not held.
            self.assertEqual(list(links._programs.values()), [links._pending[1]])

    def test_column_cuts_and_packs_are_exercised(self):
        links = many_nccl.NcclLinks(FakeComm(), "cuda:0", PEERS, pack_buffers=4)
        links.push(self.plan, 0, local_of(0, global_bytes(0)), {"chunk_bytes": [CHUNK, CHUNK]},
                   None, False)
        program = links._pending[1]
        self.assertTrue(program.copies, "no piece cut columns: the case is not covered")
        kinds = {op[0] for ops in program.rounds for op in ops}
        self.assertEqual(kinds, {"direct", "pack"})

    def test_partial_receipts_are_the_host_paths(self):
        """The GPU path's partial receipts (the elements where they are:
        numpy here, the Triton kernel or torch ops on a GPU) equal the host
        path's over the same pieces, and a changed byte changes them."""
        from weightsync import _gpu
        from weightsync._proto import v1
        from weightsync._tensors import STORAGE
        from weightsync.senders.many_receipts import partial_receipts

        def seg(source, r0, rn, c0, cn):
            return v1.Segment(source=source, row_begin=r0, row_count=rn, col_begin=c0,
                              col_count=cn)
        engines = [
            {"e0": [v1.Parameter(name="w", dtype=v1.FLOAT32, shape=[64, 96]),
                    v1.Parameter(name="o", dtype=v1.BFLOAT16, shape=[48, 32],
                                 segments=[seg("o", 0, 48, 0, 32)]),
                    v1.Parameter(name="n", dtype=v1.FLOAT32, shape=[10]),
                    v1.Parameter(name="b", dtype=v1.BFLOAT16, shape=[7])]},
            {"e1": [v1.Parameter(name="w", dtype=v1.FLOAT32, shape=[32, 96],
                                 segments=[seg("w", 16, 32, 0, 96)]),
                    v1.Parameter(name="o", dtype=v1.FLOAT16, shape=[48, 32],
                                 segments=[seg("o", 0, 48, 32, 32)]),
                    v1.Parameter(name="n", dtype=v1.FLOAT32, shape=[10]),
                    v1.Parameter(name="b", dtype=v1.BFLOAT16, shape=[7])]}]
        real = _gpu.elements
        _gpu.elements = lambda flat, dtype: flat.a.view(STORAGE[dtype])
        try:
            for rank in (0, 1):
                data = global_bytes(7 + rank)
                links = many_nccl.NcclLinks(FakeComm(), "cuda:0", PEERS, pack_buffers=4)
                local = local_of(rank, data)
                got = links.push(self.plan, rank, local, {"chunk_bytes": [CHUNK, CHUNK]},
                                 engines, True)
                for i in PEERS:
                    pieces = self.plan.link_pieces(rank, i)
                    payloads = [data[self.plan.tensors[p.tensor]["name"]][
                        p.row_begin:p.row_begin + p.row_count,
                        p.col_begin * planner.element_size(self.plan.tensors[p.tensor]["dtype"]):
                        (p.col_begin + p.col_count) *
                        planner.element_size(self.plan.tensors[p.tensor]["dtype"])].tobytes()
                        for p in pieces]
                    want = partial_receipts(self.plan, rank, i, engines[i], payloads)
                    self.assertTrue(want)
                    self.assertEqual(got[str(i)], want, f"rank {rank} daemon {i}")
                # A byte changed in place: the cached program sums the new one.
                local[0][1].a.reshape(-1)[0] ^= 0x40
                again = links.push(self.plan, rank, local, {"chunk_bytes": [CHUNK, CHUNK]},
                                   engines, True)
                self.assertNotEqual(again, got)
        finally:
            _gpu.elements = real

    def test_rounds_the_gpu_never_finishes_end_the_update(self):
        comm = FakeComm()
        links = many_nccl.NcclLinks(comm, "cuda:0", PEERS, pack_buffers=4)
        links.WINDOW_ROUNDS = 1
        fake_torch.cuda.Event.held = True
        calls = []

        def watch():
            calls.append(1)
            raise WeightSyncError("ABORTED", "daemon 1: update 'u' ended there (rank 1 died)")
        with self.assertRaises(WeightSyncError) as cm:
            links.push(self.plan, 0, local_of(0, global_bytes(0)),
                       {"chunk_bytes": [CHUNK, CHUNK]}, None, False, watch=watch, timeout=30)
        self.assertEqual(cm.exception.code, "ABORTED")
        self.assertIn("rank 1 died", cm.exception.message)
        self.assertTrue(comm.aborted)
        self.assertIsNone(links.comm)
        self.assertEqual(len(comm.groups), 1, "sent past the window")
        self.assertEqual(calls, [1])
        with self.assertRaises(WeightSyncError) as cm:   # until init_nccl again
            links.push(self.plan, 0, local_of(0, global_bytes(0)),
                       {"chunk_bytes": [CHUNK, CHUNK]}, None, False)
        self.assertEqual(cm.exception.code, "FAILED_PRECONDITION")

    def test_the_deadline_ends_a_wait_without_a_watch(self):
        comm = FakeComm()
        links = many_nccl.NcclLinks(comm, "cuda:0", PEERS, pack_buffers=4)
        links.WINDOW_ROUNDS = 1
        fake_torch.cuda.Event.held = True
        with self.assertRaises(WeightSyncError) as cm:
            links.push(self.plan, 0, local_of(0, global_bytes(0)),
                       {"chunk_bytes": [CHUNK, CHUNK]}, None, False, timeout=0.05)
        self.assertIn("deadline", cm.exception.message)
        self.assertTrue(comm.aborted)


class JoinTest(unittest.TestCase):
    """Forming the group: the leader's failure reaches every rank (no rank
    left waiting in the collective or in ncclCommInitRank)."""

    class Coll:
        def __init__(self, rank, answer=None, hosts=None):
            self.rank, self.world_size, self.answer, self.sent = rank, 2, answer, []
            self.hosts = hosts

        def broadcast(self, obj, src=0):
            self.sent.append(obj)
            return obj if self.rank == src else self.answer

        def all_gather(self, obj):
            return self.hosts or [obj, obj]

    class Link:
        stubs = ()
        group = SimpleNamespace(targets=["unix:/x"])

        def world_sizes(self, backend):
            raise WeightSyncError("UNAVAILABLE", "daemon 1 (unix:/x): connection refused")

    def test_the_leaders_error_is_raised_on_every_rank(self):
        leader = self.Coll(0)
        with self.assertRaises(WeightSyncError) as cm:
            many_nccl.NcclLinks.join(self.Link(), leader, device="cuda:0")
        self.assertIn("connection refused", cm.exception.message)
        self.assertEqual(leader.sent, [{"error": ["UNAVAILABLE",
                                                  "daemon 1 (unix:/x): connection refused"]}])
        other = self.Coll(1, answer=leader.sent[0])
        with self.assertRaises(WeightSyncError) as cm:
            many_nccl.NcclLinks.join(self.Link(), other, device="cuda:1")
        self.assertEqual(cm.exception.code, "UNAVAILABLE")

    def test_an_error_that_is_not_weightsyncs_reaches_every_rank_too(self):
        class Broken(self.Link):
            def world_sizes(self, backend):
                raise OSError("could not load the NCCL library")
        leader = self.Coll(0)
        with self.assertRaises(WeightSyncError) as cm:
            many_nccl.NcclLinks.join(Broken(), leader, device="cuda:0")
        self.assertIn("NCCL library", cm.exception.message)
        self.assertEqual(leader.sent[0]["error"][0], "UNAVAILABLE")


    def test_the_leader_tells_the_daemons_whether_the_senders_share_their_host(self):
        """InitWeightTransfer says senders_on_this_host where every rank is
        on one host with NCCL's peer-to-peer transport on and every daemon
        behind a Unix socket (the daemons then take 256 MiB chunks)."""
        from weightsync import nccl

        class Stub:
            def __init__(self):
                self.inits = []

            def call(self, method, **kw):
                self.inits.append(kw)
                return SimpleNamespace(group_id="g")

        class Link:
            def __init__(self, targets):
                self.stubs = [Stub() for _ in targets]
                self.group = SimpleNamespace(targets=targets)

            def world_sizes(self, backend):
                return [1] * len(self.stubs)
        saved = nccl.get_unique_id
        nccl.get_unique_id = lambda: bytes(128)
        try:
            for targets, hosts, want in [
                    (["unix:/a", "unix:/b"], [("h", None, None)] * 2, True),
                    (["unix:/a", "10.0.0.2:7000"], [("h", None, None)] * 2, False),
                    (["unix:/a"], [("h", None, None), ("g", None, None)], False),
                    (["unix:/a"], [("h", "1", None), ("h", None, None)], False)]:
                link = Link(targets)
                with self.assertRaises(WeightSyncError):   # no NCCL here to join
                    many_nccl.NcclLinks.join(link, self.Coll(0, hosts=hosts), device="cuda:0")
                for stub in link.stubs:
                    self.assertEqual(stub.inits[0]["senders_on_this_host"], want,
                                     (targets, hosts))
        finally:
            nccl.get_unique_id = saved


class LocalLinksTest(unittest.TestCase):
    """Which groups the daemons may give their larger chunks: NCCL carries
    every sender's bytes inside one host."""

    def test_one_host_over_nvlink_only(self):
        from weightsync.senders.nccl import local_links
        here = ("node-a", None, None)
        self.assertTrue(local_links(["unix:/s0", "unix:/s1"], [here, here]))
        self.assertTrue(local_links(["unix:/s0"], [here, ("node-a", "0", "0")]))
        for targets, ranks, why in [
                (["unix:/s0", "node-b:7000"], [here], "a daemon over TCP"),
                (["unix:/s0"], [here, ("node-b", None, None)], "a rank on another host"),
                (["unix:/s0"], [here, ("node-a", "1", None)], "peer-to-peer off"),
                (["unix:/s0"], [here, ("node-a", None, "1")], "shared memory off"),
                ([], [here], "no daemon"), (["unix:/s0"], [], "no rank")]:
            self.assertFalse(local_links(targets, ranks), why)


class LeaderStatusesTest(unittest.TestCase):
    """ManySenders asks every daemon's GetStatus side by side (the layout
    key is checked before every update: one round trip, not one a daemon)
    and fails as the first daemon that fails."""

    class Stub:
        def __init__(self, engines, barrier, error=None):
            self.engines, self.barrier, self.error = engines, barrier, error

        def call(self, rpc, **request):
            assert rpc == "GetStatus", rpc
            # Every daemon's call must be in flight at once to pass.
            self.barrier.wait()
            if self.error:
                raise self.error
            return SimpleNamespace(engines=[SimpleNamespace(engine_id=e, layout_id=l)
                                            for e, l in self.engines])

    def senders(self, stubs, engine_ids=None):
        from weightsync import _multi
        from weightsync.senders.base import Link
        from weightsync.senders.many import ManySenders
        group = _multi.Group(stubs, [f"unix:/d{i}" for i in range(len(stubs))])
        return ManySenders(Link(stubs, group, 5, 5), None, engine_ids=engine_ids)

    def test_side_by_side_in_daemon_order(self):
        import threading
        barrier = threading.Barrier(3, timeout=10)
        stubs = [self.Stub([("a", "L2"), ("b", "L1")], barrier), self.Stub([], barrier),
                 self.Stub([("c", "L3")], barrier)]
        self.assertEqual(self.senders(stubs)._layout_key(), [["L1", "L2"], [], ["L3"]])
        self.assertEqual(self.senders(stubs, engine_ids=["b", "c"])._layout_key(),
                         [["L1"], [], ["L3"]])

    def test_a_daemons_failure_raises(self):
        import threading
        barrier = threading.Barrier(2, timeout=10)
        gone = WeightSyncError("UNAVAILABLE", "daemon 1 (unix:/d1) is not reachable")
        stubs = [self.Stub([("a", "L1")], barrier), self.Stub([], barrier, error=gone)]
        with self.assertRaises(WeightSyncError) as cm:
            self.senders(stubs)._layout_key()
        self.assertIs(cm.exception, gone)


class StartTest(unittest.TestCase):
    """The leader's Start says whether receipts are wanted: VERIFY_ON has a
    GPU daemon sum them as the chunks land (unset, it read every engine
    back after the transfer, receipts wanted or not); VERIFY_OFF none."""

    class Stub:
        def __init__(self):
            self.requests = []

        def call(self, rpc, request=None, **kw):
            assert rpc == "StartWeightUpdate", rpc
            self.requests.append(request)
            return SimpleNamespace(chunk_bytes=1 << 20)

    def test_verify_is_said_to_every_daemon(self):
        from weightsync import _multi
        from weightsync._proto import v1
        from weightsync.senders.base import Link
        from weightsync.senders.many import ManySenders
        stubs = [self.Stub(), self.Stub()]
        group = _multi.Group(stubs, ["unix:/d0", "unix:/d1"])
        senders = ManySenders(Link(stubs, group, 5, 5), None)
        plan = SimpleNamespace(id="plan-1")
        for verify, want in ((True, v1.VERIFY_ON), (False, v1.VERIFY_OFF)):
            started = senders._start(plan, f"u-{verify}", 7, 0, "streaming", verify)
            self.assertEqual(started["chunk_bytes"], [1 << 20, 1 << 20])
            for stub in stubs:
                r = stub.requests[-1]
                self.assertEqual((r.update_id, r.verify, r.transfer_plan_id),
                                 (f"u-{verify}", want, "plan-1"))


if __name__ == "__main__":
    unittest.main()
