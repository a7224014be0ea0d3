"""Lazy tensors (weightsync.lazy) and the FSDP2 helper (weightsync.fsdp),
without torch: the order tensors are made and let go in (a pure function
of the chunk plan), the feed that drives it, receipts summed tensor by
tensor (equal to the whole, mod 2^64), the IPC ring's control flow (numpy
packing against a stand-in daemon that copies each slot as late as the
protocol lets it), Hugging Face name mapping, and LazyTensor updates on
the host backend against the real weightsyncd, bytes compared bit for bit
(also two stand-in FSDP ranks in threads running send_fsdp2 in step).

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 client/python/tests/test_lazy.py
"""

import os
import queue
import random
import sys
import threading
import unittest

import numpy as np

# The source tree's package, unless WEIGHTSYNC_TEST_INSTALLED=1: then the
# installed one (tests/pip_install_test.sh runs the suite that way).
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import daemon_fixture  # noqa: E402  (next to this file)
import weightsync  # noqa: E402
from weightsync import fsdp, lazy, planner, receipts  # noqa: E402
from weightsync._errors import WeightSyncError  # noqa: E402
from weightsync._proto import v1  # noqa: E402
from weightsync.gpu_trainer import RingStream, ring_send  # noqa: E402
from weightsync.lazy import LazyTensor  # noqa: E402
from test_gpu_logic import _parameter, _rand_bits, _receipt_case  # noqa: E402


def _manifests():
    """(name, manifest) of the plans the order is checked on: tiny and
    empty tensors, tensors over many chunks, sparse payloads, a Llama."""
    yield "mixed", [{"name": f"t{i}", "dtype": d, "shape": list(s)} for i, (d, s) in enumerate([
        ("BFLOAT16", (300, 7)), ("FLOAT32", (5,)), ("FLOAT32", (2048, 3)), ("BFLOAT16", ()),
        ("UINT8", (0,)), ("FLOAT16", (1000,)), ("FLOAT32", (0, 4)), ("INT8", (3,)),
        ("FLOAT32", (64, 64)), ("FLOAT32", (1,))])]
    yield "sparse", [{"name": "d", "dtype": "FLOAT32", "shape": [500]},
                     {"name": "s", "dtype": "BFLOAT16", "shape": [1000, 64], "sparse_nnz": 300,
                      "sparse_index_bytes": 4},
                     {"name": "e", "dtype": "FLOAT32", "shape": [0]},
                     {"name": "t", "dtype": "FLOAT16", "shape": [77]}]
    yield "empty", []
    yield "llama", [{"name": t["name"], "dtype": t["dtype"], "shape": t["shape"]}
                    for t in planner._llama_like_model()]


class MaterializeOrderTest(unittest.TestCase):
    def check(self, manifest, chunk_bytes, lazy_set=None):
        plan = planner.plan_chunks(manifest, chunk_bytes)
        order = lazy.materialize_order(plan, lazy_set)
        self.assertEqual(len(order), len(plan["chunks"]))
        wanted = set(range(len(manifest))) if lazy_set is None else set(lazy_set)
        with_bytes = {i for i, n in enumerate(plan["payload_bytes"]) if n}
        made_at, dropped_at, seq = {}, {}, []
        for k, (make, drop) in enumerate(order):
            for i in make:
                self.assertNotIn(i, made_at, "made twice")
                made_at[i] = k
                seq.append(i)
            for i in drop:
                self.assertNotIn(i, dropped_at, "let go twice")
                self.assertIn(i, made_at, "let go before it was made")
                dropped_at[i] = k
            self.assertEqual(make, sorted(make))
            self.assertEqual(drop, sorted(drop))
        # Every lazy tensor with bytes exactly once; never an empty one.
        self.assertEqual(set(made_at), wanted & with_bytes)
        self.assertEqual(set(dropped_at), set(made_at))
        # Made before (at) its first piece, let go after (at) its last.
        pieces = {}
        for c in plan["chunks"]:
            for p in c["pieces"]:
                pieces.setdefault(p["tensor"], []).append(c["index"])
        for i in made_at:
            self.assertEqual(made_at[i], min(pieces[i]))
            self.assertEqual(dropped_at[i], max(pieces[i]))
        # While chunk k is sent, exactly the tensors it reads are alive:
        # the peak is what one chunk spans, never more.
        windows = lazy.window_bytes(plan, lazy_set)
        for c in plan["chunks"]:
            k = c["index"]
            alive = {i for i in made_at if made_at[i] <= k <= dropped_at[i]}
            read = {p["tensor"] for p in c["pieces"]} & set(made_at)
            self.assertEqual(alive, read, f"chunk {k}")
            self.assertEqual(windows[k], sum(plan["payload_bytes"][i] for i in read))
        # Manifest order, whatever the chunk size: what every FSDP rank does.
        sequence = [i for i in lazy.materialize_sequence(manifest) if i in wanted]
        self.assertEqual(seq, sequence)
        return plan, order

    def test_every_manifest_and_chunk_size(self):
        for name, manifest in _manifests():
            for chunk in (256, 512, 1024, 4096, 65536, 1 << 20):
                with self.subTest(manifest=name, chunk=chunk):
                    self.check(manifest, chunk)

    def test_some_tensors_lazy(self):
        _, manifest = next(_manifests())
        for chunk in (256, 1024):
            _, order = self.check(manifest, chunk, {0, 2, 5, 6, 9})
            self.assertNotIn(1, [i for make, _ in order for i in make])
            # Per-tensor flags work like a set.
            plan = planner.plan_chunks(manifest, chunk)
            flags = [i in {0, 2, 5, 6, 9} for i in range(len(manifest))]
            self.assertEqual(lazy.materialize_order(plan, flags), order)

    def test_sequence_skips_empty_and_keeps_order(self):
        _, manifest = next(_manifests())
        self.assertEqual(lazy.materialize_sequence(manifest), [0, 1, 2, 3, 5, 7, 8, 9])

    def test_one_tensor_over_many_chunks_is_made_once(self):
        plan = planner.plan_chunks([{"name": "big", "dtype": "FLOAT32", "shape": [1000, 3]}],
                                   1024)
        order = lazy.materialize_order(plan)
        self.assertEqual(order[0], ([0], []))
        self.assertEqual(order[-1], ([], [0]))
        self.assertTrue(all(o == ([], []) for o in order[1:-1]))
        self.assertEqual(max(lazy.window_bytes(plan)), 12000)


class FeedTest(unittest.TestCase):
    """lazy.Feed: made once, let go once, and with a budget it waits for
    tensors let go earlier before it holds more."""

    def run_feed(self, manifest, chunk, budget):
        plan = planner.plan_chunks(manifest, chunk)
        entries = {i: LazyTensor(m["name"], m["dtype"], m["shape"], lambda: None)
                   for i, m in enumerate(manifest)}
        events = []
        done = set()   # tokens the "device" has finished (only when waited)
        windows = lazy.window_bytes(plan)
        at = [0]

        def make(i, entry):
            # Memory grows only here: what is held then, with this tensor,
            # is within the budget or the chunk's own window.
            if budget is not None:
                self.assertLessEqual(feed.live + plan["payload_bytes"][i],
                                     max(budget, windows[at[0]]))
            events.append(("make", i))
            return ("payload", i)

        def release(i, payload):
            self.assertEqual(payload, ("payload", i))
            events.append(("release", i))
            return ("token", i)

        def wait(token):
            events.append(("wait", token[1]))
            done.add(token)

        feed = lazy.Feed(plan, entries, make, release, wait, budget)
        payloads = [None] * len(manifest)
        for c in plan["chunks"]:
            k = at[0] = c["index"]
            new = feed.before(k, payloads)
            for p in c["pieces"]:
                self.assertEqual(payloads[p["tensor"]], ("payload", p["tensor"]))
            self.assertEqual(new, feed.order[k][0])
            feed.after(k, payloads)
        feed.settle()
        self.assertEqual(feed.live, 0)
        self.assertTrue(all(p is None for p in payloads))
        made = [i for e, i in events if e == "make"]
        self.assertEqual(made, lazy.materialize_sequence(manifest))
        self.assertEqual(sorted(i for e, i in events if e == "release"), sorted(made))
        self.assertEqual(sorted(i for e, i in events if e == "wait"), sorted(made))
        return feed, events

    def test_without_budget_never_waits_before_the_end(self):
        _, manifest = next(_manifests())
        feed, events = self.run_feed(manifest, 1024, None)
        last_make = max(n for n, e in enumerate(events) if e[0] == "make")
        self.assertTrue(all(n > last_make for n, e in enumerate(events) if e[0] == "wait"))
        plan = planner.plan_chunks(manifest, 1024)
        self.assertEqual(feed.peak_bytes, sum(plan["payload_bytes"]))   # nothing done early

    def test_budget_bounds_what_is_held(self):
        for name, manifest in _manifests():
            for chunk in (256, 1024, 4096):
                plan = planner.plan_chunks(manifest, chunk)
                top = max(lazy.window_bytes(plan), default=0)
                for budget in (0, top, 2 * top):
                    with self.subTest(manifest=name, chunk=chunk, budget=budget):
                        feed, _ = self.run_feed(manifest, chunk, budget)
                        self.assertLessEqual(feed.peak_bytes, max(budget, top))

    def test_none_token_frees_at_once(self):
        plan = planner.plan_chunks([{"name": "a", "dtype": "FLOAT32", "shape": [100]},
                                    {"name": "b", "dtype": "FLOAT32", "shape": [100]}], 256)
        entries = {0: LazyTensor("a", "FLOAT32", [100], lambda: 1),
                   1: LazyTensor("b", "FLOAT32", [100], lambda: 2)}
        feed = lazy.Feed(plan, entries, lambda i, e: e.materialize())
        payloads = [None, None]
        for c in plan["chunks"]:
            feed.before(c["index"], payloads)
            feed.after(c["index"], payloads)
        self.assertEqual((feed.made, feed.released, feed.live), (2, 2, 0))
        self.assertEqual(feed.peak_bytes, 400)


class LazyTensorTest(unittest.TestCase):
    def test_dtypes_and_shape(self):
        t = LazyTensor("w", "bfloat16", [3, 4], lambda: "made")
        self.assertEqual((t.dtype, t.shape, t.numel, t.nbytes), ("BFLOAT16", (3, 4), 12, 24))
        self.assertEqual(t.materialize(), "made")
        self.assertEqual(LazyTensor("w", "torch.float16", (2,), int).dtype, "FLOAT16")
        self.assertEqual(LazyTensor("w", np.float32, (2,), int).dtype, "FLOAT32")
        self.assertEqual(LazyTensor("w", np.dtype("int64"), (2,), int).dtype, "INT64")
        self.assertEqual(LazyTensor("w", "FLOAT8_E4M3FN", (), int).dtype, "FLOAT8_E4M3FN")
        self.assertIs(weightsync.LazyTensor, LazyTensor)
        with self.assertRaises(ValueError) as e:
            LazyTensor("odd", np.complex64, (2,), int)
        self.assertIn("'odd'", str(e.exception))
        with self.assertRaises(ValueError):
            LazyTensor("neg", "FLOAT32", (2, -1), int)
        with self.assertRaises(TypeError):
            LazyTensor("x", "FLOAT32", (2,), "not callable")

    def test_is_lazy(self):
        self.assertTrue(lazy.is_lazy([("a", np.zeros(2)), ("b", LazyTensor("b", "FLOAT32",
                                                                           (1,), int))]))
        self.assertFalse(lazy.is_lazy([("a", np.zeros(2))]))
        self.assertFalse(lazy.is_lazy([]))
        self.assertFalse(lazy.is_lazy([3]))   # not pairs: the update reports it

    def test_check_materialized(self):
        t = LazyTensor("w", "FLOAT32", (2, 3), int)
        lazy.check_materialized("w", t, "FLOAT32", [2, 3])
        for dtype, shape in (("FLOAT16", (2, 3)), ("FLOAT32", (3, 2)), ("FLOAT32", (6,))):
            with self.assertRaises(ValueError) as e:
                lazy.check_materialized("w", t, dtype, shape)
            self.assertIn("'w'", str(e.exception))


def _u8(sent):
    return {n: (d, list(s), a.reshape(-1).view(np.uint8)) for n, (d, s, a) in sent.items()}


class PartialReceiptsTest(unittest.TestCase):
    """The receipt of a subset of the sent tensors is that subset's share:
    a partition's shares add up to the whole (mod 2^64), bytes too;
    parameter counts come from names and shapes alone."""

    def partitions(self, names, rng):
        yield [[n] for n in names]                      # one tensor at a time
        yield [list(names)]                             # all at once
        for _ in range(4):
            parts = {}
            for n in names:
                parts.setdefault(int(rng.integers(0, 3)), []).append(n)
            yield list(parts.values())

    def test_partition_sums_to_the_whole(self):
        rng = np.random.default_rng(31)
        layout, sent = _receipt_case(rng)
        whole = receipts.expected_receipt(layout, _u8(sent))
        self.assertEqual(lazy.receipt_counts(layout, _u8(sent)), whole[1:])
        shapes = {n: (d, s, None) for n, (d, s, _) in _u8(sent).items()}
        self.assertEqual(lazy.receipt_counts(layout, shapes), whole[1:])
        for parts in self.partitions(list(sent), rng):
            total = nbytes = 0
            for part in parts:
                sub = {n: sent[n] for n in part}
                c, _, b = receipts.expected_receipt(layout, _u8(sub))
                total += c
                nbytes += b
                # The torch-style code (the GPU fallback), run on numpy.
                self.assertEqual(receipts.expected_receipt_arrays(layout, sub, block=64)[0], c)
            self.assertEqual(total & lazy.MASK64, whole[0], parts)
            self.assertEqual(nbytes, whole[2])

    def test_fused_and_sharded_layouts(self):
        from weightsync import layouts
        config = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "model_type": "qwen3", "tie_word_embeddings": False}
        rng = np.random.default_rng(32)
        sent = {n: ("FLOAT32", list(s), _rand_bits(rng, "FLOAT32", int(np.prod(s))))
                for n, s in layouts.checkpoint_shapes(config)}
        for rank in (0, 1):
            specs, segs = layouts.llama_engine_layout(config, rank, 2, dtype="BFLOAT16")
            layout = [_parameter(n, dt, shape, segs.get(n, [])) for n, dt, shape in specs]
            whole = receipts.expected_receipt(layout, _u8(sent))
            total = sum(receipts.expected_receipt(layout, _u8({n: sent[n]}))[0] for n in sent)
            self.assertEqual(total & lazy.MASK64, whole[0])
            # Parameter counts are not additive (qkv has three sources):
            # they come from the manifest.
            self.assertGreater(sum(receipts.expected_receipt(layout, _u8({n: sent[n]}))[1]
                                   for n in sent), whole[1])

    def test_progressive_receipts(self):
        rng = np.random.default_rng(33)
        layout, sent = _receipt_case(rng)
        other = [_parameter("plain", "FLOAT32", (37, 23)), _parameter("bias", "BFLOAT16", (30,))]
        manifest = [{"name": n, "dtype": d, "shape": list(s)} for n, (d, s, _) in sent.items()]
        manifest.append({"name": "patch", "dtype": "FLOAT32", "shape": [9], "sparse_nnz": 2})
        computed = []

        def compute(layouts, part):
            computed.append(sorted(part))
            return {k: receipts.expected_receipt(lay, part)[0] for k, lay in layouts.items()}

        progress = lazy.ProgressiveReceipts({"a": layout, "b": other}, manifest, compute)
        names = list(sent)
        random.Random(4).shuffle(names)
        for n in names[:-3]:
            progress.add(_u8({n: sent[n]}))
        self.assertFalse(progress.complete())
        with self.assertRaises(WeightSyncError) as e:
            progress.expected("a")
        self.assertEqual(e.exception.code, "INTERNAL")
        progress.add(_u8({n: sent[n] for n in names[-3:]}))
        self.assertTrue(progress.complete())
        self.assertEqual(progress.expected("a"), receipts.expected_receipt(layout, _u8(sent)))
        self.assertEqual(progress.expected("b"), receipts.expected_receipt(other, _u8(sent)))
        with self.assertRaises(ValueError):
            progress.add(_u8({names[0]: sent[names[0]]}))   # twice
        # The empty tensor is owed nothing; the patch isn't covered.
        p2 = lazy.ProgressiveReceipts({"a": layout}, manifest, compute)
        p2.add(_u8({n: sent[n] for n in sent if n != "empty"}))
        self.assertEqual(p2.expected("a"), receipts.expected_receipt(layout, _u8(sent)))
        # No layouts (no engines): nothing computed, still complete.
        calls = len(computed)
        p3 = lazy.ProgressiveReceipts({}, manifest, compute)
        p3.add(_u8(sent))
        self.assertTrue(p3.complete())
        self.assertEqual(len(computed), calls)


def _finished(engines):
    f = v1.FinishWeightUpdateResponse()
    for eid, layout_id, checksum, nbytes, lost in engines:
        r = f.engines.add(engine_id=eid, layout_id=layout_id, lost=lost)
        if checksum is not None:
            r.receipt.CopyFrom(v1.Receipt(checksum=checksum, bytes=nbytes))
    return f


class CheckReceiptsTest(unittest.TestCase):
    def test_layouts_from_status_and_cache(self):
        layout = [_parameter("a", "FLOAT32", (4,)), _parameter("b", "BFLOAT16", (2, 2))]
        other = [_parameter("a", "FLOAT16", (4,))]
        status = v1.GetStatusResponse()
        for eid, lid, lay in (("e0", "L1", layout), ("e1", "L1", layout), ("e2", "L2", other)):
            e = status.engines.add(engine_id=eid, layout_id=lid, parameters=len(lay))
            e.layout.extend(lay)
        engines, layouts = lazy.engines_and_layouts([status, status])
        self.assertEqual(len(layouts), 2)   # replicas (and daemons) share a key
        self.assertEqual(engines[0]["e0"][1], engines[1]["e1"][1])
        self.assertEqual(engines[0]["e0"][0], "L1")
        engines, layouts = lazy.engines_and_layouts([status], engine_ids=["e2"])
        self.assertEqual((list(engines[0]), len(layouts)), (["e2"], 1))
        bare = v1.GetStatusResponse()
        bare.engines.add(engine_id="e0", layout_id="L1", parameters=2)
        with self.assertRaises(KeyError):
            lazy.engines_and_layouts([bare])
        engines, layouts = lazy.engines_and_layouts([bare], cached={"L1": layout})
        self.assertEqual(list(layouts.values()), [layout])

    def test_match_mismatch_and_new_layouts(self):
        engines = [{"e0": ("L1", "k1"), "e1": ("L1", "k1")}, {"e2": ("L9", "k2")}]
        want = {"k1": (111, 2, 40), "k2": (222, 1, 8)}
        good = [_finished([("e0", "L1", 111, 40, False), ("e1", "L1", 111, 40, False)]),
                _finished([("e2", "L9", 222, 8, False)])]
        lazy.check_receipts(good, engines, want.__getitem__)
        bad = [_finished([("e0", "L1", 111, 40, False), ("e1", "L1", 112, 40, False)]),
               good[1]]
        with self.assertRaises(WeightSyncError) as e:
            lazy.check_receipts(bad, engines, want.__getitem__, names=["d0", "d1"])
        self.assertEqual(e.exception.code, "DATA_LOSS")
        self.assertIn("engine 'e1' on d0", e.exception.message)
        # Registered again during the update: can't be checked.
        moved = [_finished([("e0", "L7", 111, 40, False)]), good[1]]
        with self.assertRaises(WeightSyncError) as e:
            lazy.check_receipts(moved, engines, want.__getitem__)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertIn("L7", e.exception.message)
        self.assertIn("L1", e.exception.message)
        newcomer = [_finished([("e5", "L3", 1, 1, False)]), good[1]]
        with self.assertRaises(WeightSyncError) as e:
            lazy.check_receipts(newcomer, engines, want.__getitem__)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        # Lost engines and results without receipts are not checked.
        lazy.check_receipts([_finished([("e0", "L7", 5, 5, True), ("e1", "L1", None, 0, False)]),
                             _finished([])], engines, want.__getitem__)


class FakeDaemonRing:
    """A stand-in for the daemon's end of IpcChunks: it copies chunk j out
    of its slot only when it must report j done (an answer to announcement
    k says k + 2 - slots chunks are done), or when the stream ends; a
    trainer that refilled a slot too early would have its bytes copied."""

    def __init__(self, plan, slots, buf, chunk_bytes):
        self.plan, self.slots, self.buf, self.chunk_bytes = plan, slots, buf, chunk_bytes
        self.copied = {}
        self.first = None
        self.cancelled = False

    def _copy_upto(self, n):
        for j in range(len(self.copied), n):
            size = self.plan["chunks"][j]["size"]
            at = (j % self.slots) * self.chunk_bytes
            self.copied[j] = self.buf[at:at + size].copy()

    def stream(self, name, requests, timeout=None):
        assert name == "IpcChunks"
        out = queue.Queue()
        daemon = self

        def serve():
            expected = 0
            for r in requests:
                if daemon.first is None:
                    daemon.first = r.update_id
                assert r.chunk_index == expected, (r.chunk_index, expected)
                expected += 1
                need = r.chunk_index + 2 - daemon.slots
                if need > 0:
                    daemon._copy_upto(need)
                    out.put(v1.IpcChunksResponse(chunks_done=need))
            daemon._copy_upto(expected)
            out.put(None)

        threading.Thread(target=serve, daemon=True).start()

        class Responses:
            def __iter__(self):
                return self

            def __next__(self):
                r = out.get(timeout=10)
                if r is None:
                    raise StopIteration
                return r

            def cancel(self):
                daemon.cancelled = True

        return Responses()


class RingTest(unittest.TestCase):
    def test_ring_delivers_the_packed_stream(self):
        rng = np.random.default_rng(7)
        _, manifest = next(_manifests())
        datas = [rng.integers(0, 256, planner.payload_bytes(m["dtype"], m["shape"]),
                              dtype=np.uint8) for m in manifest]
        for chunk in (256, 1024, 4096):
            for slots in (2, 3, 5):
                plan = planner.plan_chunks(manifest, chunk)
                buf = np.zeros(slots * chunk, np.uint8)
                daemon = FakeDaemonRing(plan, slots, buf, chunk)
                entries = {i: LazyTensor(m["name"], m["dtype"], m["shape"],
                                         lambda i=i: datas[i]) for i, m in enumerate(manifest)
                           if i % 2 == 0}
                payloads = [None if i in entries else d for i, d in enumerate(datas)]
                feed = lazy.Feed(plan, entries, lambda i, e: e.materialize())
                made = []

                def pack(c, slot):
                    base = slot * chunk
                    buf[base:base + chunk] = 0xEE   # stale bytes show up
                    for p in c["pieces"]:
                        buf[base + p["chunk_offset"]:base + p["chunk_offset"] + p["length"]] = \
                            payloads[p["tensor"]][p["tensor_offset"]:
                                                  p["tensor_offset"] + p["length"]]

                ring = RingStream(daemon, "u-1", 10)
                ring_send(plan, slots, ring, pack, feed, payloads, made.extend)
                self.assertEqual(daemon.first, "u-1")
                self.assertEqual(sorted(made), sorted(i for i in entries
                                                      if plan["payload_bytes"][i]))
                stream = np.zeros(plan["total_bytes"], np.uint8)
                got = np.zeros(plan["total_bytes"], np.uint8)
                for off, n, d in zip(plan["tensor_offsets"], plan["payload_bytes"], datas):
                    stream[off:off + n] = d
                for c in plan["chunks"]:
                    part = daemon.copied[c["index"]]
                    for p in c["pieces"]:
                        at = c["offset"] + p["chunk_offset"]
                        got[at:at + p["length"]] = part[p["chunk_offset"]:
                                                        p["chunk_offset"] + p["length"]]
                # Padding is never read: compare the tensors' bytes.
                for off, n in zip(plan["tensor_offsets"], plan["payload_bytes"]):
                    np.testing.assert_array_equal(got[off:off + n], stream[off:off + n],
                                                  err_msg=f"chunk {chunk} slots {slots}")
                self.assertTrue(all(p is None for i, p in enumerate(payloads) if i in entries))

    def test_stream_ended_early_is_aborted(self):
        class Ended:
            def stream(self, name, requests, timeout=None):
                class R:
                    def __iter__(self):
                        return self

                    def __next__(self):
                        raise StopIteration

                    def cancel(self):
                        pass
                return R()

        ring = RingStream(Ended(), "u", 1)
        ring.ready(0)
        with self.assertRaises(WeightSyncError) as e:
            ring.wait_done(1)
        self.assertEqual(e.exception.code, "ABORTED")
        ring.cancel()


class NameMappingTest(unittest.TestCase):
    def test_wrapper_components(self):
        self.assertEqual(fsdp.checkpoint_name("model.layers.0.mlp.up_proj.weight"),
                         "model.layers.0.mlp.up_proj.weight")
        self.assertEqual(fsdp.checkpoint_name(
            "_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight"),
            "model.layers.0.mlp.up_proj.weight")
        self.assertEqual(fsdp.checkpoint_name(
            "_fsdp_wrapped_module.model.layers.1._fsdp_wrapped_module.self_attn.q_proj.weight"),
            "model.layers.1.self_attn.q_proj.weight")
        self.assertEqual(fsdp.checkpoint_name("orig_mod_x._orig_modx.w"), "orig_mod_x._orig_modx.w")

    def test_dict_function_skip_and_clash(self):
        raw = ["_orig_mod.model.embed_tokens.weight", "_orig_mod.model.norm.weight",
               "_orig_mod.lm_head.weight", "_orig_mod.value_head.weight"]
        self.assertEqual(fsdp.checkpoint_names(raw), [
            (0, "model.embed_tokens.weight"), (1, "model.norm.weight"), (2, "lm_head.weight"),
            (3, "value_head.weight")])
        got = fsdp.checkpoint_names(raw, {"value_head.weight": None,
                                          "model.norm.weight": "model.final_norm.weight"})
        self.assertEqual(got, [(0, "model.embed_tokens.weight"), (1, "model.final_norm.weight"),
                               (2, "lm_head.weight")])
        got = fsdp.checkpoint_names(raw, {"_orig_mod.lm_head.weight": "head"})  # a raw name
        self.assertEqual(got[2], (2, "head"))
        got = fsdp.checkpoint_names(raw, lambda n: None if n.startswith("value_head")
                                    else "base." + n)
        self.assertEqual([n for _, n in got], ["base.model.embed_tokens.weight",
                                               "base.model.norm.weight", "base.lm_head.weight"])
        with self.assertRaises(ValueError) as e:
            fsdp.checkpoint_names(raw, lambda n: "same")
        self.assertIn("both map to 'same'", str(e.exception))
        with self.assertRaises(ValueError):
            fsdp.checkpoint_names(raw, lambda n: "")

    def test_mapping_is_computed_once_per_model(self):
        calls = []

        def names(n):
            calls.append(n)
            return n

        model = FakeModel(0, {"a": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}, 1)
        first = fsdp.lazy_parameters(model, names)
        fsdp.lazy_parameters(model, names)
        self.assertEqual(len(calls), 2)   # once per parameter, once per model
        fsdp.lazy_parameters(model, lambda n: n)   # another mapping: again
        model.params["c"] = FakeDTensor(model, "c", np.zeros(3, np.float32))
        fsdp.lazy_parameters(model, names)   # new parameters: again
        self.assertEqual(len(calls), 5)
        self.assertEqual([(n, t.dtype, t.shape) for n, t in first],
                         [("a", "FLOAT32", (4,)), ("b", "FLOAT32", (2,))])


# -- stand-in FSDP ranks (threads) ---------------------------------------------

class Collectives:
    """What every stand-in rank's gathers go through: each call waits for
    every rank's matching call (a barrier) and checks that all ranks
    gather the same tensor, then returns the full tensor (the shards
    concatenated)."""

    def __init__(self, ranks):
        self.ranks = ranks
        self.barrier = threading.Barrier(ranks, timeout=30)
        self.slots = {}
        self.log = {r: [] for r in range(ranks)}
        self.mismatch = []
        self.status = None

    def all_gather(self, rank, name, shard):
        self.slots[rank] = (name, shard)
        self.barrier.wait()
        names = {self.slots[r][0] for r in range(self.ranks)}
        if len(names) != 1:
            self.mismatch.append(sorted(names))
        full = np.concatenate([self.slots[r][1] for r in range(self.ranks)])
        self.log[rank].append(name)
        self.barrier.wait()
        return full


class FakeDTensor:
    """Row shards of a numpy array; full_tensor() is the collective."""

    def __init__(self, model, name, full):
        self.model, self.name = model, name
        self.dtype = full.dtype
        self.shape = full.shape
        rows = np.array_split(np.arange(full.shape[0]), model.world)[model.rank]
        self.flat_local = np.ascontiguousarray(full[rows])

    def full_tensor(self):
        full = self.model.coll.all_gather(self.model.rank, self.name, self.flat_local)
        out = full.reshape(self.shape)
        if self.model.bad == self.name:
            return out.astype(np.float64)   # a wrong dtype (after the collective)
        return out


class FakeModel:
    def __init__(self, rank, arrays, world, coll=None, bad=None):
        self.rank, self.world, self.coll, self.bad = rank, world, coll, bad
        self.params = {n: FakeDTensor(self, n, a) for n, a in arrays.items()}

    def named_parameters(self):
        return list(self.params.items())


class FakeGroup:
    def __init__(self, spec, src):
        self.rank, self.coll = spec
        self.src = src

    def outcome(self, code=0):
        if self.rank == self.src:
            self.coll.status = code
        self.coll.barrier.wait()
        return self.coll.status


class HostLazyTest(daemon_fixture.HostDaemonCase):
    """LazyTensor updates through the real daemon on the host backend."""

    def llama(self, dtype="BFLOAT16"):
        from weightsync import layouts
        config = {"vocab_size": 1003, "hidden_size": 64, "intermediate_size": 160,
                  "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "model_type": "qwen3"}
        ranks = []
        for r in range(2):
            params, segments = layouts.llama_engine_layout(config, r, 2, dtype=dtype)
            ranks.append((params, segments, self.engine(f"tp{r}", params,
                                                        segments=segments)[1]))
        return config, ranks

    def expected_engine(self, params, segments, ckpt, dtype):
        """What a TP rank must hold: {name: (element bits, written mask)},
        every segment of the checkpoint placed as docs/protocol.md says
        (a source is rows = shape[0] x cols = the rest) and converted with
        the daemon's rounding (receipts.convert_bits)."""
        out = {}
        for name, _, shape in params:
            n = int(np.prod(shape))
            dest = np.zeros(n, np.uint64)
            written = np.zeros(n, bool)
            for s in segments.get(name) or [None]:
                if s is None:   # no segments: the tensor of the same name, whole
                    src, rb, cb, rc, cc, off, stride = ckpt[name].reshape(1, n), 0, 0, 1, n, 0, n
                else:
                    t = ckpt[s["source"]]
                    cols = int(np.prod(t.shape[1:]))
                    src = t.reshape(-1, cols)
                    rb, cb = s.get("row_begin", 0), s.get("col_begin", 0)
                    rc, cc = s["row_count"], s["col_count"]
                    off, stride = s.get("dest_offset", 0), s.get("dest_row_stride") or cc
                part = np.ascontiguousarray(src[rb:rb + rc, cb:cb + cc])
                idx = (off + np.arange(rc)[:, None] * stride + np.arange(cc)[None, :]).reshape(-1)
                dest[idx] = receipts.convert_bits(part.reshape(-1).view(np.uint8), "FLOAT32",
                                                  dtype)
                written[idx] = True
            out[name] = (dest, written)
        return out

    def assert_engine(self, arrays, params, segments, ckpt, dtype="BFLOAT16"):
        for name, (dest, written) in self.expected_engine(params, segments, ckpt, dtype).items():
            have = arrays[name].reshape(-1).view(f"u{arrays[name].itemsize}").astype(np.uint64)
            np.testing.assert_array_equal(have[written], dest[written], err_msg=name)

    def test_lazy_update_is_bit_exact_made_in_order_and_receipted(self):
        config, ranks = self.llama()
        from weightsync import layouts
        self.trainer.init_host()
        calls = []
        real_start = self.trainer._stub.call

        def spy(name, request=None, timeout=None, **fields):
            calls.append(name)
            return real_start(name, request, timeout, **fields)
        self.trainer._stub.call = spy
        rng = np.random.default_rng(8)
        shapes = layouts.checkpoint_shapes(config)
        for version in (1, 2, 3):
            ckpt = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes}
            made = []

            def maker(n):
                def make():
                    made.append(n)
                    return ckpt[n]
                return make
            items = []
            for i, (n, s) in enumerate(shapes):
                if i % 3 == 2:
                    items.append((n, ckpt[n]))   # some eager tensors among the lazy
                else:
                    items.append((n, LazyTensor(n, np.float32, s, maker(n))))
            del calls[:]
            result = self.trainer.update(items, version=version, chunk_bytes=4096, verify=True)
            self.assertEqual(result.version, version)
            self.assertEqual(calls.count("StartWeightUpdate"), 1)   # one update, one pause
            self.assertTrue(all(e.HasField("receipt") for e in result.engines))
            self.assertEqual(made, [n for i, (n, _) in enumerate(shapes) if i % 3 != 2])
            for params, segments, arrays in ranks:
                self.assert_engine(arrays, params, segments, ckpt)
            info = self.trainer.last_lazy
            self.assertEqual(info["made"], len(made))
            # Held at most: what one chunk spans; never the whole model.
            self.assertEqual(info["peak_bytes"], info["window_bytes"])
            self.assertLess(info["peak_bytes"], sum(a.nbytes for a in ckpt.values()) / 2)
        # Receipts are really compared: a wrong share is DATA_LOSS.
        real = receipts.expected_receipt

        def wrong(layout, sent, *a, **k):
            c, p, b = real(layout, sent, *a, **k)
            return (c ^ 1 if "model.norm.weight" in sent else c), p, b
        receipts.expected_receipt = wrong
        try:
            items = [(n, LazyTensor(n, "FLOAT32", s, lambda a=ckpt[n]: a)) for n, s in shapes]
            with self.assertRaises(WeightSyncError) as e:
                self.trainer.update(items, version=4, chunk_bytes=4096)
        finally:
            receipts.expected_receipt = real
        self.assertEqual(e.exception.code, "DATA_LOSS")
        self.assertIn("engine 'tp", e.exception.message)

    def test_failures_while_making_abort_the_update(self):
        _, w = self.engine("e0", [("a", "FLOAT32", (64, 16)), ("b", "FLOAT32", (300,)),
                                  ("c", "FLOAT16", (7,))])
        self.trainer.init_host()
        a = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
        b = np.ones(300, np.float32)
        c = np.full(7, 3, np.float32)
        self.trainer.update([("a", a), ("b", b), ("c", c)], version=1)

        def boom():
            raise RuntimeError("gather failed")
        items = [("a", LazyTensor("a", "FLOAT32", (64, 16), lambda: a + 1)),
                 ("b", LazyTensor("b", "FLOAT32", (300,), boom)),
                 ("c", LazyTensor("c", "FLOAT32", (7,), lambda: c))]
        with self.assertRaises(RuntimeError) as e:
            self.trainer.update(items, version=2, chunk_bytes=1024)
        self.assertIn("gather failed", str(e.exception))
        # The update was aborted: the next one is accepted and lands.
        items[1] = ("b", LazyTensor("b", "FLOAT32", (300,), lambda: b * 2))
        wrong_shape = list(items)
        wrong_shape[2] = ("c", LazyTensor("c", "FLOAT32", (7,), lambda: np.zeros(8, np.float32)))
        with self.assertRaises(ValueError) as e:
            self.trainer.update(wrong_shape, version=3, chunk_bytes=1024)
        self.assertIn("'c'", str(e.exception))
        self.assertEqual(self.trainer.update(items, version=4, chunk_bytes=1024).version, 4)
        np.testing.assert_array_equal(w["a"], a + 1)
        np.testing.assert_array_equal(w["b"], b * 2)
        np.testing.assert_array_equal(w["c"], c.astype(np.float16))
        # A refused Start makes nothing.
        made = []
        with self.assertRaises(WeightSyncError) as e:
            self.trainer.update([("a", LazyTensor("a", "FLOAT32", (64, 16),
                                                  lambda: made.append(1) or a))], version=4)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertEqual(made, [])

    def test_several_daemons_refuse_lazy_host_updates(self):
        other = weightsync.Trainer([self.target, self.target], timeout=10)
        try:
            with self.assertRaises(ValueError) as e:
                other.update([("a", LazyTensor("a", "FLOAT32", (1,), int))], version=1)
            self.assertIn("host backend", str(e.exception))
        finally:
            other.close()

    def run_ranks(self, world, arrays, version, bad=None, chunk_bytes=2048, fail_start=False):
        """send_fsdp2 on `world` stand-in ranks (threads); returns (per-rank
        result or exception, the collectives)."""
        coll = Collectives(world)
        out = [None] * world
        real = fsdp._group_factory
        fsdp._group_factory = FakeGroup

        def rank_main(r):
            model = FakeModel(r, arrays, world, coll, bad=bad if r == 0 else None)
            try:
                out[r] = fsdp.send_fsdp2(self.trainer if r == 0 else None, model, version,
                                         names={"value_head.weight": None}, group=(r, coll),
                                         chunk_bytes=chunk_bytes)
            except BaseException as e:  # noqa: BLE001 - the test looks at it
                out[r] = e

        try:
            threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
                self.assertFalse(t.is_alive(), "a rank is stuck")
        finally:
            fsdp._group_factory = real
        self.assertEqual(coll.mismatch, [])
        self.assertEqual(len({tuple(v) for v in coll.log.values()}), 1, coll.log)
        return out, coll

    def test_send_fsdp2_ranks_in_step(self):
        names = [("model.embed_tokens.weight", (40, 8)), ("model.layers.0.mlp.up_proj.weight",
                                                          (24, 8)),
                 ("model.norm.weight", (8,)), ("lm_head.weight", (40, 8))]
        _, w = self.engine("e0", [(n, "FLOAT32", s) for n, s in names])
        self.trainer.init_host()
        rng = np.random.default_rng(9)
        arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in names}
        # A parameter no engine has (a value head), left out by `names`.
        arrays["value_head.weight"] = np.ones((3, 8), np.float32)
        for version in (1, 2):
            for a in arrays.values():
                a += 1   # a "training step"
            out, coll = self.run_ranks(2, arrays, version)
            self.assertNotIsInstance(out[0], BaseException, out[0])
            self.assertEqual(out[0].version, version)
            self.assertIsNone(out[1])
            self.assertEqual(coll.status, 0)
            self.assertEqual(coll.log[0], [n for n, _ in names])   # manifest order
            for n, _ in names:
                np.testing.assert_array_equal(w[n], arrays[n], err_msg=n)
        # Start refused (the version is not above the engine's): rank 0
        # gathers everything anyway, and both ranks raise its code.
        out, coll = self.run_ranks(2, arrays, 2)
        self.assertIsInstance(out[0], WeightSyncError)
        self.assertEqual(out[0].code, "FAILED_PRECONDITION")
        self.assertIsInstance(out[1], WeightSyncError)
        self.assertEqual(out[1].code, "FAILED_PRECONDITION")
        self.assertIn("rank 0", out[1].message)
        self.assertEqual(len(coll.log[0]), 4)
        # A tensor made wrong mid-update on rank 0: the update is aborted,
        # the rest gathered in step, every rank raises.
        before = {n: w[n].copy() for n, _ in names}
        out, coll = self.run_ranks(2, arrays, 3, bad="model.layers.0.mlp.up_proj.weight")
        self.assertIsInstance(out[0], ValueError)
        self.assertIn("up_proj", str(out[0]))
        self.assertEqual(out[1].code, "UNKNOWN")
        self.assertEqual(len(coll.log[1]), 4)
        np.testing.assert_array_equal(w["lm_head.weight"], before["lm_head.weight"])
        # Three ranks, a fresh version: lands.
        out, _ = self.run_ranks(3, arrays, 4)
        self.assertEqual(out[0].version, 4)
        self.assertEqual(out[1:], [None, None])
        for n, _ in names:
            np.testing.assert_array_equal(w[n], arrays[n], err_msg=n)


class FsdpOwnShardsTest(unittest.TestCase):
    """send_fsdp2's own-shards path (every rank has a Trainer) hands
    update_sharded the collective the NCCL group was formed with when
    there is one (another is refused there), else its group's; and its
    chunk_bytes and verify."""

    class Comm:
        rank, src = 0, 0

        def all_gather(self, obj):
            return [obj, obj]

    class Trainer:
        def __init__(self, joined):
            self.sharded_collective, self.calls = joined, []

        def update_sharded(self, manifest, local, version, collective=None, chunk_bytes=0,
                           verify=True):
            self.calls.append((manifest, local, version, collective, chunk_bytes, verify))
            return "committed"

    def send(self, trainer, comm, **kw):
        from unittest import mock
        with mock.patch.object(fsdp, "_group_factory", lambda group, rank: comm), \
                mock.patch.object(fsdp, "_own_shards", lambda model, names: (["m"], ["l"])):
            return fsdp.send_fsdp2(trainer, None, 5, **kw)

    def test_the_groups_collective_on_nccl_and_verify_passed_on(self):
        joined, comm = object(), self.Comm()
        t = self.Trainer(joined)
        self.assertEqual(self.send(t, comm, chunk_bytes=256, verify=False), "committed")
        self.assertEqual(t.calls, [(["m"], ["l"], 5, joined, 256, False)])
        host = self.Trainer(None)   # host backend: no NCCL group
        self.send(host, comm)
        self.assertEqual(host.calls, [(["m"], ["l"], 5, comm, 0, True)])


if __name__ == "__main__":
    unittest.main()
