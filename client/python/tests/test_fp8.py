"""The FP8 vectors (tests/vectors/fp8.json, computed by tools/fp8_vectors.py
with exact rational arithmetic) against weightsync.fp8 (numpy): single
roundings, blocks of every format, source dtype, scheme and scale form,
and the receipts of FP8 engines through weightsync.receipts.expected_receipt;
and the layout helper for FP8 Llama/Qwen engines."""

import json
import os
import sys
import unittest

import numpy as np

# The source tree's package, unless WEIGHTSYNC_TEST_INSTALLED=1: then the
# installed one (tests/pip_install_test.sh runs the suite that way).
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from google.protobuf import json_format  # noqa: E402

from weightsync import layouts, receipts  # noqa: E402
from weightsync.receipts import fp8  # noqa: E402
from weightsync._proto import v1  # noqa: E402

_VECTORS = "tests/vectors/fp8.json"


def _load():
    for root in (os.getcwd(), os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.dirname(os.path.abspath(__file__)))))):
        path = os.path.join(root, _VECTORS)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
    raise FileNotFoundError(_VECTORS)


def _widen(hex_bytes, dtype):
    return receipts.to_float32(np.frombuffer(bytes.fromhex(hex_bytes), np.uint8).copy(), dtype)


class Fp8VectorsTest(unittest.TestCase):
    vectors = _load()

    def test_rounding(self):
        self.assertGreaterEqual(len(self.vectors["round"]), 80)
        for c in self.vectors["round"]:
            q = np.array([int(c["f32"], 16)], np.uint32).view(np.float32)
            self.assertEqual(int(fp8.to_fp8(q, c["format"])[0]), int(c["fp8"], 16), c)

    def test_blocks(self):
        self.assertGreaterEqual(len(self.vectors["blocks"]), 20)
        for c in self.vectors["blocks"]:
            with self.subTest(c["name"]):
                x = _widen(c["hex"], c["srcDtype"]).reshape(c["shape"])
                enc, scales = fp8.quantize(x, c["blockRows"], c["blockCols"], c["format"],
                                           c["scaleForm"] == "RECIPROCAL")
                self.assertEqual(enc.tobytes().hex(), c["fp8"])
                self.assertEqual(scales.tobytes().hex(), c["scales"])

    def test_receipts(self):
        self.assertGreaterEqual(len(self.vectors["receipts"]), 3)
        for case in self.vectors["receipts"]:
            layout = [json_format.ParseDict(p, v1.Parameter()) for p in case["layout"]]
            sent = {t["name"]: (t["dtype"], tuple(t["shape"]),
                                np.frombuffer(bytes.fromhex(t["hex"]), np.uint8).copy())
                    for t in case["tensors"]}
            want = (int(case["checksum"], 16), case["parameters"], case["bytes"])
            with self.subTest(case["name"]):
                self.assertEqual(receipts.expected_receipt(layout, sent), want)
                key = ("fp8 vector", case["name"])
                self.assertEqual(receipts.expected_receipt(layout, sent, layout_key=key), want)
                self.assertEqual(receipts.expected_receipt(layout, sent, layout_key=key), want)
                # What a GPU trainer computes (the elements in their storage
                # type; the quantised part by weightsync.fp8 on the host).
                from weightsync._tensors import STORAGE
                arrays = {n: (d, s, raw.view(STORAGE[d])) for n, (d, s, raw) in sent.items()}
                self.assertEqual(receipts.expected_receipt_arrays(layout, arrays), want)
                # A lazy update's counts, from names and shapes only.
                from weightsync import lazy
                shapes = {n: (d, list(s), None) for n, (d, s, _) in sent.items()}
                self.assertEqual(lazy.receipt_counts(layout, shapes), want[1:])

    def test_round_trip_and_dequantize(self):
        for fmt in fp8.FMAX:
            enc = np.arange(256, dtype=np.uint8)
            v = fp8.from_fp8(enc, fmt)
            finite = np.isfinite(v)
            np.testing.assert_array_equal(fp8.to_fp8(v[finite], fmt), enc[finite])
        rng = np.random.default_rng(1)
        x = rng.standard_normal((130, 260)).astype(np.float32) * 3
        enc, scales = fp8.quantize(x, 128, 128)
        self.assertEqual(scales.shape, (2, 3))
        back = fp8.dequantize(enc, scales, 128, 128)
        # e4m3: 3 mantissa bits, relative error at most 2^-4 of the block's
        # amax scale for normal values.
        self.assertLess(np.max(np.abs(back - x)), np.max(np.abs(x)) / 16)
        enc_r, inv = fp8.quantize(x, 128, 128, reciprocal=True)
        np.testing.assert_array_equal(enc_r, enc)
        np.testing.assert_array_equal(inv, np.float32(1) / scales)


class Fp8LayoutTest(unittest.TestCase):
    # Heads of 64: at TP 2 q has 256 rows a rank and k/v 128 (one block).
    QWEN3 = dict(model_type="qwen3", vocab_size=300, hidden_size=256, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, num_hidden_layers=2,
                 intermediate_size=512, tie_word_embeddings=False)

    def test_fp8_layout_quantises_linear_layers_only(self):
        params, segments, quant = layouts.llama_fp8_engine_layout(self.QWEN3, tp_rank=1,
                                                                  tp_size=2)
        shapes = {n: (d, s) for n, d, s in params}
        fp8_names = {n for n, (d, _) in shapes.items() if d == "FLOAT8_E4M3FN"}
        self.assertEqual(set(quant), fp8_names)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                     "mlp.down_proj"):
            w = f"model.layers.1.{name}.weight"
            self.assertIn(w, fp8_names)
            scale = quant[w]["scale_parameter"]
            self.assertEqual(scale, f"model.layers.1.{name}.weight_scale_inv")
            rows, cols = shapes[w][1]
            self.assertEqual(shapes[scale], ("FLOAT32", (-(-rows // 128), -(-cols // 128))))
            self.assertNotIn(scale, segments)
        for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                     "model.layers.0.input_layernorm.weight",
                     "model.layers.0.self_attn.q_norm.weight"):
            self.assertEqual(shapes[kept][0], "BFLOAT16", kept)
        self.assertEqual(quant["model.layers.0.mlp.down_proj.weight"]["block_rows"], 128)
        # At TP 4, k/v get 64 rows a rank: half a block, refused.
        with self.assertRaises(ValueError) as ctx:
            layouts.llama_fp8_engine_layout(self.QWEN3, tp_rank=0, tp_size=4)
        self.assertIn("cuts a 128 x 128 block", str(ctx.exception))
        # Per row: [rows, 1] scales, any shard.
        params, _, quant = layouts.llama_fp8_engine_layout(self.QWEN3, tp_rank=2, tp_size=4,
                                                           block=None)
        shapes = {n: s for n, _, s in params}
        w = "model.layers.0.self_attn.qkv_proj.weight"
        self.assertEqual(shapes[w + "_scale_inv"], (shapes[w][0], 1))
        self.assertEqual(quant[w]["scheme"], "QUANT_SCHEME_PER_ROW")


if __name__ == "__main__":
    unittest.main()
