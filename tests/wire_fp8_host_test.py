#!/usr/bin/env python3
"""Issue 32, item 3: FP8 on the wire, end to end on the host backend
(docs/protocol.md, "FP8 on the wire"): `Trainer.update(fp8_on_wire=True)`
quantises each tensor whose every use in the engines it writes is an FP8
target of one format, block and scale form on whole blocks of it, sends a
byte an element plus its blocks' scales, and the daemon copies them as
they are.

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 tests/wire_fp8_host_test.py

tests/fp8_host_test.py's daemon and engine process (a TP=2 pair in e4m3
with 128 x 128 block scales, a TP=1 engine in e5m2 with per-row
reciprocal scales, a plain bfloat16 engine, FP8 targets stacked as a
fused MoE layer), this process the trainer. Into each FP8 form alone, in
chunks that cut blocks, float32 and float16 checkpoints, receipts on:
every FP8 weight and scale bit for bit weightsync.fp8 of what was sent
(as if the daemon had quantised it), on fewer bytes than the same update
unquantised; a tensor whose uses differ in form, or that also feeds a
bf16 parameter, travels as it is. A hand-quantised tensor whose form
does not match the engine's is refused INVALID_ARGUMENT naming the
tensor, engine and parameter, before anything is written.
"""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "..", "client", "python")
sys.path.insert(0, CLIENT)
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import weightsync  # noqa: E402
from weightsync import wire_fp8  # noqa: E402
import fp8_host_test  # noqa: E402

v1 = fp8_host_test.v1
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class WireFp8HostTest(unittest.TestCase):
    setUp = fp8_host_test.Fp8HostTest.setUp
    tearDown = fp8_host_test.Fp8HostTest.tearDown
    memory = fp8_host_test.Fp8HostTest.memory

    def check_only(self, engines, sent, why):
        """fp8_host_test's bit-for-bit check of the engines `engines`."""
        every = self.specs
        self.specs = [s for s in every if s[0] in engines]
        try:
            fp8_host_test.Fp8HostTest.check_engines(self, sent, why)
        finally:
            self.specs = every

    @staticmethod
    def checkpoint(version, dtype, engines):
        """fp8_host_test's checkpoint; the stacked engine alone uses only
        the MLP weights (an update may name no tensor its engines lack)."""
        ck = fp8_host_test.checkpoint(version, dtype)
        if engines == ["stacked"]:
            ck = {n: a for n, a in ck.items() if ".mlp." in n}
        return ck

    def plan_of(self, engines, ck):
        return self.trainer._wire_plans.plan(self.trainer._link, engines, list(ck.items()))

    def test_quantised_on_the_wire_lands_as_the_daemon_quantises(self):
        version = 0
        # (engines written, the forms their FP8 targets share)
        for engines, fmt, scheme in [(["tp0", "tp1"], "FLOAT8_E4M3FN", "QUANT_SCHEME_BLOCK"),
                                     (["row"], "FLOAT8_E5M2", "QUANT_SCHEME_PER_ROW"),
                                     (["stacked"], None, None)]:
            for dtype, chunk in ((np.float32, 16 << 10), (np.float16, 47 * 256)):
                version += 1
                ck = self.checkpoint(version, dtype, engines)
                plan = self.plan_of(engines, ck)
                if engines == ["stacked"]:
                    # w2 (e4m3 128 x 128) and w2_rows (e5m2 per row) both
                    # hold down_proj: it travels as it is; gate/up go in
                    # w13 alone.
                    self.assertEqual(sorted(plan), sorted(
                        f"model.layers.{i}.mlp.{p}.weight" for i in range(2)
                        for p in ("gate_proj", "up_proj")))
                else:
                    # Every linear weight goes quantised, nothing else.
                    self.assertEqual(sorted(plan), sorted(
                        n for n in ck if n.endswith(tuple(p + ".weight" for p in LINEAR))))
                    for n, fields in plan.items():
                        self.assertEqual((fields["format"], fields["scheme"]), (fmt, scheme), n)
                dense = self.trainer.update(list(ck.items()), version=version,
                                            chunk_bytes=chunk, engine_ids=engines)
                version += 1
                ck = self.checkpoint(version, dtype, engines)
                wired = self.trainer.update(list(ck.items()), version=version,
                                            chunk_bytes=chunk, engine_ids=engines,
                                            fp8_on_wire=True)
                why = f"{engines} {np.dtype(dtype).name} v{version}"
                self.assertEqual(wired.version, version, why)
                self.assertEqual(sorted(e.engine_id for e in wired.engines if
                                        e.HasField("receipt")), sorted(engines), why)
                # Fewer bytes: each quantised tensor a byte an element and
                # its scales, instead of 4 (float32) or 2 (float16).
                q_elems = sum(ck[n].size for n in plan)
                q_scales = sum(wire_fp8.payload_bytes(ck[n].shape, plan[n]) - ck[n].size
                               for n in plan)
                saved = q_elems * (np.dtype(dtype).itemsize - 1) - q_scales
                self.assertGreater(saved, 0, why)
                # (each tensor's payload starts on a 256-byte boundary)
                self.assertLessEqual(abs(dense.bytes - wired.bytes - saved), 256 * len(ck), why)
                self.check_only(engines, ck, why)
                print(f"{why}: {len(plan)} tensors quantised on the wire, "
                      f"{wired.bytes} bytes against {dense.bytes} unquantised", flush=True)
        for s in self.trainer.status().engines:
            self.assertEqual(s.state, v1.ENGINE_READY, s.engine_id)

    def test_uses_that_differ_travel_as_they_are(self):
        ck = fp8_host_test.checkpoint(1)
        # The bf16 engine uses every tensor as it is; tp and row differ in
        # format and block: nothing can go quantised to both.
        for engines in ([], ["tp0", "tp1", "row"], ["tp0", "bf16"]):
            self.assertEqual(self.plan_of(engines, ck), {}, engines)
        dense = self.trainer.update(list(ck.items()), version=1, chunk_bytes=64 << 10)
        wired = self.trainer.update(list(ck.items()), version=2, chunk_bytes=64 << 10,
                                    fp8_on_wire=True)
        self.assertEqual(wired.bytes, dense.bytes)
        fp8_host_test.Fp8HostTest.check_engines(self, ck, "every engine, nothing quantised")

    def test_a_form_the_engine_does_not_hold_is_refused_untouched(self):
        ck = fp8_host_test.checkpoint(1)
        self.trainer.update(list(ck.items()), version=1, chunk_bytes=64 << 10)
        before = {eid: self.memory(eid).copy() for eid in self.shm}
        name = "model.layers.1.mlp.down_proj.weight"
        per_row = {"format": "FLOAT8_E4M3FN", "scheme": "QUANT_SCHEME_PER_ROW",
                   "scale_form": "SCALE_FORM_DEQUANT"}
        ck2 = fp8_host_test.checkpoint(2)
        pairs = [(n, wire_fp8.quantize_on_wire(n, a, per_row) if n == name else a)
                 for n, a in ck2.items()]
        with self.assertRaises(weightsync.WeightSyncError) as ctx:
            self.trainer.update(pairs, version=2, engine_ids=["tp0", "tp1"])
        self.assertEqual(ctx.exception.code, "INVALID_ARGUMENT", str(ctx.exception))
        self.assertIn(f"'{name}'", str(ctx.exception))
        self.assertIn("engine 'tp", str(ctx.exception))
        self.assertIn("send it unquantised", str(ctx.exception))
        for eid in self.shm:
            np.testing.assert_array_equal(self.memory(eid), before[eid], err_msg=eid)
        for s in self.trainer.status().engines:
            self.assertEqual((s.version, s.state), (1, v1.ENGINE_READY), s.engine_id)
        # A HostSource has nothing on the wire to quantise: a clear error.
        source = self.trainer.host_tensors([(n, "FLOAT32", a.shape) for n, a in ck.items()])
        with self.assertRaises(ValueError) as ctx:
            self.trainer.update(source, version=2, fp8_on_wire=True)
        self.assertIn("fp8_on_wire", str(ctx.exception))
        source.close()


if __name__ == "__main__":
    unittest.main()
