#!/usr/bin/env python3
"""FP8 targets on the host backend, end to end (docs/protocol.md, "FP8
targets"): a real weightsyncd, an engine process holding FP8 engines (a
TP=2 pair of a Qwen3-style model in e4m3 with 128 x 128 block scales, a
TP=1 engine in e5m2 with per-row reciprocal scales, a plain bfloat16
engine, and one whose FP8 targets stack matrices as a fused MoE layer
holds experts) and this process as the trainer.

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 tests/fp8_host_test.py

Four versions: float32 and float16 checkpoints streamed in chunks that cut
blocks, a staged update, and one the daemon copies from the trainer's
registered shared memory; after each, every FP8 weight and every scale is
compared bit for bit with weightsync.fp8 (numpy) applied to what was sent,
receipts on (the client checks them). Then: a sparse patch into an FP8
target is refused FAILED_PRECONDITION with the engines untouched; a TP
layout whose shards cut a block, and every other bad registration, are
refused before the daemon maps the engine's memory (its /proc maps never
show the object, and the memory keeps its fill).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "..", "client", "python")
sys.path.insert(0, CLIENT)

import numpy as np  # noqa: E402

import weightsync  # noqa: E402
from weightsync import layouts, sparse  # noqa: E402
from weightsync.receipts import fp8  # noqa: E402
from weightsync._proto import v1  # noqa: E402
from weightsync.engine import _set_quantization, lay_out_shared  # noqa: E402
from weightsync.receipts import convert_bits, to_float32  # noqa: E402

# Heads of 64: at TP 2, q has 256 rows a rank and k/v 128 (whole blocks).
CONFIG = dict(model_type="qwen3", vocab_size=300, hidden_size=256, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, num_hidden_layers=2,
              intermediate_size=512, tie_word_embeddings=False)


def engine_specs():
    """[(engine id, params, segments, quantization)] of the engine process."""
    specs = []
    for r in range(2):
        specs.append((f"tp{r}",) + layouts.llama_fp8_engine_layout(CONFIG, r, 2))
    params, segments, quant = layouts.llama_fp8_engine_layout(
        CONFIG, 0, 1, fp8="FLOAT8_E5M2", block=None)
    for q in quant.values():
        q["scale_form"] = "SCALE_FORM_RECIPROCAL"
    specs.append(("row", params, segments, quant))
    params, segments = layouts.llama_engine_layout(CONFIG, 0, 1)
    specs.append(("bf16", params, segments, {}))
    specs.append(("stacked",) + stacked_layout())
    return specs


def stacked_layout():
    """(params, segments, quantization) of FP8 targets stacked as vLLM's
    fused MoE layers hold experts, each layer's MLP standing for an expert:
    w13 [L, 2I, H] (gate rows then up rows of each) with e4m3 128 x 128
    scales per matrix [L, 2I / 128, H / 128]; w2 [L, H, I] with flat
    scales [L * H / 128, I / 128]; w2_rows [L, H, I] in e5m2 per row
    [L, H]."""
    H, I, L = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["num_hidden_layers"]
    shapes = dict(layouts.checkpoint_shapes(CONFIG))
    mlp = "model.layers.{}.mlp.{}.weight"
    params = [("w13", "FLOAT8_E4M3FN", (L, 2 * I, H)),
              ("w13_scale", "FLOAT32", (L, 2 * I // 128, H // 128)),
              ("w2", "FLOAT8_E4M3FN", (L, H, I)),
              ("w2_scale", "FLOAT32", (L * H // 128, I // 128)),
              ("w2_rows", "FLOAT8_E5M2", (L, H, I)),
              ("w2_rows_scale", "FLOAT32", (L, H))]
    segments = {"w13": [], "w2": [], "w2_rows": []}
    for e in range(L):
        for k, proj in enumerate(("gate_proj", "up_proj")):
            src = mlp.format(e, proj)
            segments["w13"].append(layouts.segment(src, shapes[src], (0, I), (0, H),
                                                  (e * 2 + k) * I * H, H))
        src = mlp.format(e, "down_proj")
        for name in ("w2", "w2_rows"):
            segments[name].append(layouts.segment(src, shapes[src], (0, H), (0, I),
                                                 e * H * I, I))
    quant = {"w13": fp8.quantization_fields("FLOAT8_E4M3FN", "w13_scale"),
             "w2": fp8.quantization_fields("FLOAT8_E4M3FN", "w2_scale"),
             "w2_rows": fp8.quantization_fields("FLOAT8_E5M2", "w2_rows_scale", None)}
    return params, segments, quant


ENGINES = r"""
import json, os, signal, sys, time
sys.path.insert(0, {client!r})
import weightsync
target, spec_path = sys.argv[1], sys.argv[2]
engines, shm = [], {{}}
for eid, params, segments, quant in json.load(open(spec_path)):
    e = weightsync.Engine(eid, target, timeout=10)
    e.register_host([(n, d, tuple(s)) for n, d, s in params], segments=segments,
                    quantization=quant)
    e.start()
    engines.append(e)
    shm[eid] = e._shm.name
print("ready", json.dumps(shm), flush=True)
def stop(*_):
    for e in engines:
        e.close()
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(1)
"""


def checkpoint(version, dtype=np.float32):
    rng = np.random.default_rng(version)
    out = {}
    for name, shape in layouts.checkpoint_shapes(CONFIG):
        x = rng.standard_normal(shape).astype(np.float32) * (1 + version)
        if len(shape) == 2:
            x[0, 0] = np.nan if version % 2 else np.inf   # ignored by amax
            x[-1, -1] = 0.0
        out[name] = x.astype(dtype)
    return out


def parameter_values(name, shape, segments, sent):
    """float32 [rows, cols] of what `sent` places in a parameter (the sent
    values widened exactly), written out in numpy."""
    rows = shape[0]
    cols = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    flat = np.zeros(rows * cols, np.float32)
    for s in segments.get(name) or [None]:
        if s is None:
            flat[:] = sent[name].astype(np.float32).reshape(-1)
            continue
        src = sent[s["source"]].astype(np.float32)
        m = src.reshape(src.shape[0], -1)
        block = m[s["row_begin"]:s["row_begin"] + s["row_count"],
                  s["col_begin"]:s["col_begin"] + s["col_count"]]
        stride = s["dest_row_stride"] or s["col_count"]
        idx = (s["dest_offset"] + np.arange(s["row_count"])[:, None] * stride
               + np.arange(s["col_count"])[None, :])
        flat[idx] = block
    return flat.reshape(rows, cols)


def offsets_of(params):
    out, offset = {}, 0
    for name, dtype, shape in params:
        offset = (offset + 255) & ~255
        n = int(np.prod(shape)) * {"FLOAT32": 4, "BFLOAT16": 2}.get(dtype, 1)
        out[name] = (offset, n)
        offset += n
    return out


class Fp8HostTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="ws-fp8.", dir="/tmp")
        sock = os.path.join(self.work, "d.sock")
        self.log = open(os.path.join(self.work, "daemon.log"), "w")
        self.daemon = subprocess.Popen(
            [os.environ["WEIGHTSYNCD"], f"--socket={sock}", "--notice_timeout_ms=5000"],
            stderr=self.log)
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        self.target = "unix:" + sock
        self.trainer = weightsync.Trainer(self.target, timeout=60)
        self.specs = engine_specs()
        path = os.path.join(self.work, "engines.json")
        with open(path, "w") as f:
            json.dump(self.specs, f)
        self.engines_log = open(os.path.join(self.work, "engines.log"), "w")
        self.engines = subprocess.Popen(
            [sys.executable, "-c", ENGINES.format(client=CLIENT), self.target, path],
            stdout=subprocess.PIPE, stderr=self.engines_log, text=True)
        line = self.engines.stdout.readline()
        if not line.startswith("ready"):
            with open(os.path.join(self.work, "engines.log")) as f:
                raise RuntimeError(f"engine process did not start: {line!r}\n{f.read()}")
        self.shm = json.loads(line.split(" ", 1)[1])
        for _ in range(200):
            up = {s.engine_id for s in self.trainer.status().engines if s.connected}
            if up >= set(self.shm):
                break
            time.sleep(0.02)
        self.trainer.init_host()

    def tearDown(self):
        self.engines.send_signal(signal.SIGTERM)
        try:
            self.engines.wait(10)
        except subprocess.TimeoutExpired:
            self.engines.kill()
        self.engines.stdout.close()
        self.engines_log.close()
        self.trainer.close()
        self.daemon.terminate()
        self.assertEqual(self.daemon.wait(timeout=10), 0)
        self.log.close()
        for name in self.shm.values():
            try:
                os.unlink("/dev/shm/" + name)
            except FileNotFoundError:
                pass
        shutil.rmtree(self.work, ignore_errors=True)

    def memory(self, eid):
        return np.fromfile("/dev/shm/" + self.shm[eid], np.uint8)

    def check_engines(self, sent, why):
        """Every parameter of every engine bit for bit as weightsync.fp8 /
        the bfloat16 conversion of `sent` says."""
        for eid, params, segments, quant in self.specs:
            mem = self.memory(eid)
            where = offsets_of(params)
            scales = {q["scale_parameter"] for q in quant.values()}
            for name, dtype, shape in params:
                if name in scales:
                    continue
                off, n = where[name]
                got = mem[off:off + n]
                x = parameter_values(name, shape, segments, sent)
                if name in quant:
                    # A stacked weight [..., n, k]: the matrix of its rows.
                    x = x.reshape(-1, shape[-1])
                    q = quant[name]
                    block = (1, shape[-1]) if q["scheme"] == "QUANT_SCHEME_PER_ROW" else (
                        q["block_rows"], q["block_cols"])
                    enc, st = fp8.quantize(x, *block, q["format"],
                                           q["scale_form"] == "SCALE_FORM_RECIPROCAL")
                    np.testing.assert_array_equal(got, enc.reshape(-1),
                                                  err_msg=f"{why}: {eid} {name}")
                    self.assertGreater(np.count_nonzero(got), got.size // 2)
                    s_off, s_n = where[q["scale_parameter"]]
                    np.testing.assert_array_equal(
                        mem[s_off:s_off + s_n].view(np.uint32), st.reshape(-1).view(np.uint32),
                        err_msg=f"{why}: {eid} {q['scale_parameter']}")
                else:
                    want = convert_bits(x.reshape(-1).view(np.uint8), "FLOAT32", "BFLOAT16")
                    np.testing.assert_array_equal(got.view(np.uint16), want.astype(np.uint16),
                                                  err_msg=f"{why}: {eid} {name}")

    def update(self, sent, version, **kw):
        result = self.trainer.update(list(sent.items()), version=version, **kw)
        self.assertEqual(result.version, version)
        for e in result.engines:
            self.assertTrue(e.HasField("receipt"), e.engine_id)
        return result

    def test_fp8_engines_hold_the_reference_quantisation(self):
        # v1: float32 in 16 KiB chunks (a row of 128 x 256 float32 blocks
        # is 128 KiB: every block arrives over several chunks).
        ck = checkpoint(1)
        self.update(ck, 1, chunk_bytes=16 << 10)
        self.check_engines(ck, "v1 float32")
        # v2: float16 in chunks of an odd number of 256-byte units.
        ck = checkpoint(2, np.float16)
        self.update(ck, 2, chunk_bytes=47 * 256)
        self.check_engines(ck, "v2 float16")
        # v3: staged: the engines serve until the commit.
        ck = checkpoint(3)
        result = self.update(ck, 3, chunk_bytes=64 << 10, mode="staged")
        self.assertGreater(result.pause_seconds, 0)
        self.check_engines(ck, "v3 staged")
        # v4: from the trainer's registered shared memory (the daemon reads
        # each piece there).
        ck = checkpoint(4)
        source = self.trainer.host_tensors(
            [(n, "FLOAT32", a.shape) for n, a in ck.items()])
        for n, a in ck.items():
            source[n][...] = a
        result = self.trainer.update(source, version=4, chunk_bytes=32 << 10)
        self.assertEqual(result.version, 4)
        self.check_engines(ck, "v4 registered memory")
        for s in self.trainer.status().engines:
            self.assertEqual((s.version, s.state), (4, v1.ENGINE_READY), s.engine_id)

    def test_sparse_patch_into_an_fp8_target_is_refused_untouched(self):
        ck = checkpoint(1)
        self.update(ck, 1, chunk_bytes=64 << 10)
        before = {eid: self.memory(eid).copy() for eid in self.shm}
        name = "model.layers.0.mlp.down_proj.weight"
        after = ck[name].copy()
        after[3, 5] += 1
        patch = sparse.diff(ck[name], after, max_density=0.5)
        with self.assertRaises(weightsync.WeightSyncError) as ctx:
            self.trainer.update([(name, patch)], version=2, base_version=1)
        self.assertEqual(ctx.exception.code, "FAILED_PRECONDITION")
        self.assertIn(f"tensor '{name}' -> engine 'row' parameter "
                      "'model.layers.0.mlp.down_proj.weight': a sparse patch can't update "
                      "an FP8 target", str(ctx.exception))
        for eid in self.shm:
            np.testing.assert_array_equal(self.memory(eid), before[eid], err_msg=eid)
        for s in self.trainer.status().engines:
            self.assertEqual((s.version, s.state), (1, v1.ENGINE_READY), s.engine_id)
        # The plain bfloat16 engine alone takes the patch.
        patched = self.trainer.update([(name, patch)], version=2, base_version=1,
                                      engine_ids=["bf16"])
        self.assertEqual(patched.version, 2)

    def refused(self, eid, params, segments=None, quant=None, change=None):
        """Registers `params` in fresh shared memory filled with 0xA5 and
        returns the daemon's refusal; checks that the daemon never mapped
        the object and that its bytes kept their fill."""
        shm, offsets, enums, _ = lay_out_shared(params, f"ws-fp8-bad-{os.getpid()}")
        try:
            shm.array((shm.size,), np.uint8)[:] = 0xA5
            request = v1.RegisterEngineRequest(engine_id=eid)
            request.allocations.add(kind=v1.MEMORY_HOST_SHM, handle=shm.handle.encode(),
                                    size=shm.size, device_uuid="host")
            for (name, dtype, shape), off in zip(params, offsets):
                p = request.parameters.add(name=name, dtype=enums[dtype], shape=shape,
                                           offset=off)
                for seg in (segments or {}).get(name, ()):
                    p.segments.add(**seg)
                if quant and name in quant:
                    _set_quantization(p, quant[name])
            if change is not None:
                change(request)
            engine = weightsync.Engine(eid, self.target, timeout=10)
            try:
                with self.assertRaises(weightsync.WeightSyncError) as ctx:
                    engine._stub.call("RegisterEngine", request)
            finally:
                engine.close()
            with open(f"/proc/{self.daemon.pid}/maps") as f:
                self.assertNotIn(shm.name, f.read(), f"{eid}: the daemon mapped the memory")
            self.assertTrue((shm.array((shm.size,), np.uint8) == 0xA5).all())
            self.assertNotIn(eid, [s.engine_id for s in self.trainer.status().engines])
            return ctx.exception
        finally:
            shm.unlink()

    def test_bad_registrations_are_refused_before_memory_is_mapped(self):
        # A TP=4 layout: k and v get 64 rows a rank, half a 128-row block.
        params, segments = layouts.llama_engine_layout(CONFIG, 1, 4)
        name = "model.layers.0.self_attn.qkv_proj.weight"
        rows, cols = dict((n, s) for n, _, s in params)[name]
        params = [(n, "FLOAT8_E4M3FN" if n == name else d, s) for n, d, s in params]
        params.append((name + "_scale_inv", "FLOAT32", (-(-rows // 128), -(-cols // 128))))
        quant = {name: {"format": "FLOAT8_E4M3FN", "scale_parameter": name + "_scale_inv"}}
        err = self.refused("tp4", params, segments, quant)
        self.assertEqual(err.code, "INVALID_ARGUMENT")
        self.assertIn(f"parameter '{name}': segment 1 (source "
                      "'model.layers.0.self_attn.k_proj.weight')", str(err))
        self.assertIn("cuts a 128 x 128 block", str(err))
        # One FP8 weight and its scale; each case breaks one thing.
        w = [("w", "FLOAT8_E4M3FN", (256, 200)), ("w_scale", "FLOAT32", (2, 2)),
             ("n", "BFLOAT16", (200,))]
        good = {"w": {"format": "FLOAT8_E4M3FN", "scale_parameter": "w_scale"}}

        def quant_of(**fields):
            return {"w": dict(good["w"], **fields)}

        cases = [
            ("format", w, quant_of(format="BFLOAT16"), "INVALID_ARGUMENT",
             "FP8 targets are FLOAT8_E4M3FN or FLOAT8_E5M2"),
            ("dtype", w, quant_of(format="FLOAT8_E5M2"), "INVALID_ARGUMENT",
             "differs from its quantization.format"),
            ("missing scale", w, quant_of(scale_parameter="nope"), "INVALID_ARGUMENT",
             "'nope' is not a parameter"),
            ("scale dtype", [w[0], ("w_scale", "BFLOAT16", (2, 2)), w[2]], good,
             "INVALID_ARGUMENT", "needs float32 [2, 2]"),
            ("scale shape", [w[0], ("w_scale", "FLOAT32", (2, 1)), w[2]], good,
             "INVALID_ARGUMENT", "needs float32 [2, 2]"),
            ("per-row shape", w, quant_of(scheme="QUANT_SCHEME_PER_ROW"), "INVALID_ARGUMENT",
             "needs float32 [256] or [256, 1]"),
            ("block of 96", w, quant_of(block_rows=96), "INVALID_ARGUMENT",
             "needs float32 [3, 2]"),
            ("1-D", [("w", "FLOAT8_E4M3FN", (256,)), w[1], w[2]], good, "INVALID_ARGUMENT",
             "non-empty weight of 2 or more dimensions"),
            ("stacked, blocks across matrices", [("w", "FLOAT8_E4M3FN", (2, 64, 256)),
                                                 ("w_scale", "FLOAT32", (1, 2)), w[2]],
             good, "INVALID_ARGUMENT",
             "needs the rows of each matrix (64) in whole blocks of 128 rows"),
            ("scale of itself", w, quant_of(scale_parameter="w"), "INVALID_ARGUMENT",
             "is the parameter itself"),
            ("quantised scale", w, {"w": good["w"], "w_scale": dict(good["w"],
                                                                    scale_parameter="n")},
             "INVALID_ARGUMENT", "is itself quantised"),
        ]
        for what, params, quant, code, message in cases:
            with self.subTest(what):
                err = self.refused("bad", params, quant=quant)
                self.assertEqual(err.code, code, str(err))
                self.assertIn(message, str(err))
                self.assertIn("engine 'bad'", str(err))
        # GPU memory: the GPU backends quantise too, so the declaration
        # passes; only this daemon's missing GPU worker refuses the memory.
        err = self.refused("gpu", w, quant=good, change=lambda r: r.allocations[0].__setattr__(
            "kind", v1.MEMORY_CUDA_IPC))
        self.assertEqual(err.code, "UNIMPLEMENTED")
        self.assertIn("needs the GPU worker", str(err))

        def split(r):   # the weight in host memory, its scales in GPU memory
            r.allocations.add(kind=v1.MEMORY_CUDA_IPC, handle=b"h" * 64, size=4096,
                              device_uuid="GPU-0")
            scale = [p for p in r.parameters if p.name == "w_scale"][0]
            scale.allocation = 1
            scale.offset = 0
        err = self.refused("split", w, quant=good, change=split)
        self.assertEqual(err.code, "INVALID_ARGUMENT", str(err))
        self.assertIn("both must be host shared memory (host backend) or both GPU memory",
                      str(err))
        # The engines already registered serve on, untouched by all this.
        ck = checkpoint(1)
        self.update(ck, 1, chunk_bytes=64 << 10)
        self.check_engines(ck, "after the refusals")


if __name__ == "__main__":
    unittest.main()
