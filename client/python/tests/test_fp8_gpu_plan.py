"""weightsync.receipts.fp8_gpu's tables (the fused FP8 receipt kernel's block and
piece tables, built by numpy on the host) without a GPU: fp8_gpu.emulate
runs in numpy what the kernel does with them, reading sources by address
from fake memory, and must give fp8.quantized_receipt's sums and counts
(the reference) for whole, fused, strided, per-row and partly sent
parameters; parameters the tables can't express go to `rest`.
tests/gpu/check_fp8_triton_gpu.py runs the kernel itself on a GPU."""

import os
import sys
import unittest

import numpy as np

if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from weightsync import receipts  # noqa: E402
from weightsync.receipts import fp8, fp8_gpu  # noqa: E402
from weightsync._proto import v1  # noqa: E402

FORMATS = ("FLOAT8_E4M3FN", "FLOAT8_E5M2")
SPECIALS = {
    "FLOAT32": [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA12345, 0x7F800000, 0xFF800000,
                0x00000001, 0x807FFFFF, 0x80000000, 0x7F7FFFFF, 0x43E00000, 0x47700000],
    "FLOAT16": [0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0xFD55, 0x0001, 0x8001, 0x7BFF],
    "BFLOAT16": [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFA5, 0x0001, 0x807F, 0x7F7F],
}


def bits(rng, dtype, shape):
    n = int(np.prod(shape))
    f = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    if dtype == "FLOAT32":
        u = f.view(np.uint32).copy()
    elif dtype == "FLOAT16":
        with np.errstate(all="ignore"):
            u = (f / np.float32(2.0 ** 20)).astype(np.float16).view(np.uint16).copy()
    else:
        u = (f.view(np.uint32) >> 16).astype(np.uint16)
    for k, v in enumerate(SPECIALS[dtype]):
        u[(k * 7919) % n] = v
    u = u.reshape(shape)
    if len(shape) == 2 and shape[0] >= 128 and shape[1] >= 256:
        u[:128, 128:256] = 0
    return u


def param(name, dtype, shape, segments=(), quant=None):
    p = v1.Parameter(name=name, dtype=getattr(v1, dtype), shape=list(shape))
    for s in segments:
        p.segments.add(**s)
    if quant:
        p.quantization.CopyFrom(v1.Quantization(**quant))
    return p


def quant(fmt, scale, block, reciprocal):
    return fp8.quantization_fields(fmt, scale, block, reciprocal)


def seg(source, rb, rc, cb, cc, dest, stride=0):
    return dict(source=source, row_begin=rb, row_count=rc, col_begin=cb, col_count=cc,
                dest_offset=dest, dest_row_stride=stride)


def layout_of(fmt, rec):
    """The layout of tests/gpu/check_fp8_receipts_gpu.py plus a fused
    parameter whose segments aren't on block boundaries."""
    return [
        param("w", fmt, (300, 400), quant=quant(fmt, "w_s", (128, 128), rec)),
        param("w_s", "FLOAT32", (3, 4)),
        param("qkv", fmt, (640, 200), [
            seg("q", 0, 256, 0, 200, 0), seg("k", 0, 128, 0, 200, 256 * 200),
            seg("v", 0, 128, 0, 200, 384 * 200),
            seg("not sent", 0, 128, 0, 200, 512 * 200)],
            quant=quant(fmt, "qkv_s", (128, 128), rec)),
        param("qkv_s", "FLOAT32", (5, 2)),
        param("r", fmt, (77, 130), quant=quant(fmt, "r_s", None, rec)),
        param("r_s", "FLOAT32", (77, 1)),
        param("d", fmt, (300, 250), [seg("d", 3, 250, 1, 90, 7 * 250 + 30, 250)],
              quant=quant(fmt, "d_s", (128, 128), rec)),
        param("d_s", "FLOAT32", (3, 2)),
        param("odd", fmt, (200, 100), [seg("q", 0, 50, 0, 100, 0),
                                       seg("k", 5, 100, 7, 60, 50 * 100 + 3, 100),
                                       seg("v", 9, 40, 3, 100, 160 * 100)],
              quant=quant(fmt, "odd_s", (64, 32), rec)),
        param("odd_s", "FLOAT32", (4, 4)),
        param("norm", "BFLOAT16", (200,)),
    ]


class Sources:
    """Sent tensors as numpy bytes at fake addresses (16-byte aligned)."""

    def __init__(self):
        self.host, self.meta, self.memory = {}, {}, {}
        self.next = 1 << 32

    def add(self, name, dtype, u):
        raw = np.ascontiguousarray(u).reshape(-1).view(np.uint8)
        self.host[name] = (dtype, u.shape, raw)
        self.meta[name] = (dtype, u.shape, self.next, True)
        self.memory[self.next] = raw
        self.next += (raw.size + 4096) // 16 * 16


class PlanTest(unittest.TestCase):

    def sources(self, rng, src_w, src_qkv):
        s = Sources()
        s.add("w", src_w, bits(rng, src_w, (300, 400)))
        s.add("q", src_qkv, bits(rng, src_qkv, (256, 200)))
        s.add("k", src_qkv, bits(rng, src_qkv, (128, 200)))
        s.add("v", src_qkv, bits(rng, src_qkv, (128, 200)))
        s.add("r", src_w, bits(rng, src_w, (77, 130)))
        s.add("d", src_qkv, bits(rng, src_qkv, (260, 100)))
        s.add("norm", src_w, bits(rng, src_w, (200,)))
        return s

    def test_emulated_tables_equal_reference(self):
        rng = np.random.default_rng(7)
        for fmt in FORMATS:
            for rec in (False, True):
                for src_w, src_qkv in (("BFLOAT16", "FLOAT32"), ("FLOAT16", "BFLOAT16"),
                                       ("FLOAT32", "FLOAT16")):
                    s = self.sources(rng, src_w, src_qkv)
                    _, q, _ = fp8.split_layout(layout_of(fmt, rec))
                    want = fp8.quantized_receipt(q, s.host)
                    tables, counts, rest = fp8_gpu.plan(q, s.meta)
                    self.assertEqual(rest, [])
                    got = (fp8_gpu.emulate(tables, s.memory),) + counts
                    self.assertEqual(got, want, (fmt, rec, src_w, src_qkv))

    def test_split_between_kernels(self):
        rng = np.random.default_rng(9)
        for fmt in FORMATS:
            for src_w, src_qkv in (("BFLOAT16", "FLOAT32"), ("FLOAT16", "BFLOAT16")):
                s = self.sources(rng, src_w, src_qkv)
                _, q, _ = fp8.split_layout(layout_of(fmt, True))
                want = fp8.quantized_receipt(q, s.host)
                tables, counts, _ = fp8_gpu.plan(q, s.meta)
                tiles, general = fp8_gpu.split(tables)
                self.assertEqual((fp8_gpu.emulate(fp8_gpu.unsplit(tiles, general), s.memory),)
                                 + counts, want, (fmt, src_w, src_qkv))
                # Every block in one kernel or the other, once.
                n = sum(b.shape[0] for b, _ in tables.values())
                self.assertEqual(sum(t.shape[0] for t in tiles.values())
                                 + sum(b.shape[0] for b, _ in general.values()), n)
                for (code, e5m2, aligned), t in tiles.items():
                    self.assertEqual(e5m2, fmt == "FLOAT8_E5M2")
                    self.assertTrue(((t[:, 2] <= 128) & (t[:, 3] <= 128)).all())
                    es = 4 if code == 0 else 2
                    self.assertEqual(bool(aligned), bool(((t[:, 0] % 16 == 0)
                                                          & (t[:, 1] * es % 16 == 0)).all()))
                # "w" (300 x 400, 128 x 128): 12 tile blocks, the row-blocks
                # of "r" (1 x 130) and the two-piece blocks of "odd" general.
                salt_w = receipts.salt32("w")
                self.assertEqual(sum(int((t[:, 7] == salt_w).sum()) for t in tiles.values()), 12)
                self.assertFalse(any((t[:, 7] == receipts.salt32("r")).any()
                                     for t in tiles.values()))
                self.assertTrue(any((b[:, 3] == receipts.salt32("r")).any()
                                    for b, _ in general.values()))
                # "d" starts one column in: an unaligned tile launch.
                self.assertTrue(any(not a and (t[:, 7] == receipts.salt32("d")).any()
                                    for (_, _, a), t in tiles.items()))

    def test_split_keeps_upper_index_halves_apart(self):
        # A piece whose destination indices cross 2^32 goes to the general
        # kernel (the tile kernel keys with 32-bit indices).
        blocks = np.zeros((2, fp8_gpu.BCOLS), np.int64)
        blocks[:, 0] = [0, 1]
        blocks[:, 1] = 1
        blocks[:, 5:10] = fp8.SPEC["FLOAT8_E4M3FN"]
        pieces = np.zeros((2, fp8_gpu.PCOLS), np.int64)
        pieces[:, 0] = 1 << 20
        pieces[:, 1:4] = (1 << 20, 128, 128)
        pieces[:, 5] = 1 << 20
        pieces[0, 4] = (1 << 32) - 64          # crosses
        pieces[1, 4] = (1 << 32) + 5
        tiles, general = fp8_gpu.split({1: (blocks, pieces)})
        self.assertEqual([list(r[:5]) for r in general[1][0]], [list(blocks[0, :5])])
        self.assertEqual(list(tiles[(1, False, True)][:, 4]), [(1 << 32) + 5])

    def test_split_off(self):
        rng = np.random.default_rng(10)
        s = self.sources(rng, "BFLOAT16", "BFLOAT16")
        _, q, _ = fp8.split_layout(layout_of("FLOAT8_E4M3FN", False))
        tables, _, _ = fp8_gpu.plan(q, s.meta)
        old = os.environ.get("WEIGHTSYNC_FP8_TILE")
        os.environ["WEIGHTSYNC_FP8_TILE"] = "0"
        try:
            tiles, general = fp8_gpu.split(tables)
        finally:
            if old is None:
                del os.environ["WEIGHTSYNC_FP8_TILE"]
            else:
                os.environ["WEIGHTSYNC_FP8_TILE"] = old
        self.assertEqual(tiles, {})
        self.assertTrue(all(np.array_equal(general[c][0], tables[c][0]) for c in tables))

    def test_partly_sent_and_unsent(self):
        rng = np.random.default_rng(8)
        s = self.sources(rng, "BFLOAT16", "FLOAT32")
        for drop in ("w", "q", "k", "v", "d"):
            host = {n: e for n, e in s.host.items() if n != drop}
            meta = {n: e for n, e in s.meta.items() if n != drop}
            _, q, _ = fp8.split_layout(layout_of("FLOAT8_E4M3FN", True))
            want = fp8.quantized_receipt(q, host)
            tables, counts, rest = fp8_gpu.plan(q, meta)
            self.assertEqual(rest, [])
            self.assertEqual((fp8_gpu.emulate(tables, s.memory),) + counts, want, drop)
        tables, counts, rest = fp8_gpu.plan(q, {})
        self.assertEqual((tables, counts, rest), ({}, (0, 0), []))

    def test_tables(self):
        s = Sources()
        s.add("w", "BFLOAT16", np.zeros((300, 400), np.uint16))
        p = param("w", "FLOAT8_E4M3FN", (300, 400),
                  quant=quant("FLOAT8_E4M3FN", "w_s", (128, 128), False))
        tables, counts, rest = fp8_gpu.plan([p], s.meta)
        blocks, pieces = tables[1]
        self.assertEqual(blocks.shape, (12, 12))
        self.assertEqual(list(blocks[:, 2]), list(range(12)))
        self.assertEqual(list(blocks[:, 1]), [1] * 12)
        self.assertEqual(list(blocks[5, 5:11]), [3, 7, 0x7E, 0x7F, 0x43E00000, 0])
        # block (2, 3): rows 256..299, cols 384..399
        self.assertEqual(list(pieces[11]), [(1 << 32) + (256 * 400 + 384) * 2, 400, 44, 16,
                                            256 * 400 + 384, 400])
        self.assertEqual(counts, (2, 300 * 400 + 4 * 12))

    def test_rest(self):
        s = Sources()
        s.add("a", "FLOAT32", np.zeros((10, 8), np.uint32))
        s.add("b", "BFLOAT16", np.zeros((10, 8), np.uint16))
        s.add("i", "INT32", np.zeros((10, 8), np.uint32))
        q = quant("FLOAT8_E4M3FN", "s", (128, 128), False)
        wraps = param("x", "FLOAT8_E4M3FN", (20, 16), [seg("a", 0, 10, 0, 8, 0, 8)], quant=q)
        overlap = param("y", "FLOAT8_E4M3FN", (20, 8), [seg("a", 0, 10, 0, 8, 0),
                                                        seg("b", 0, 10, 0, 8, 40)], quant=q)
        mixed = param("z", "FLOAT8_E4M3FN", (20, 8), [seg("a", 0, 10, 0, 8, 0),
                                                      seg("b", 0, 10, 0, 8, 80)], quant=q)
        ints = param("i", "FLOAT8_E4M3FN", (10, 8), quant=q)
        fine = param("f", "FLOAT8_E4M3FN", (20, 8), [seg("a", 0, 10, 0, 8, 0),
                                                     seg("a", 0, 10, 0, 8, 80, 8)],
                     quant=quant("FLOAT8_E4M3FN", "s", (10, 8), False))
        s.meta["nc"] = ("FLOAT32", (10, 8), 0, False)
        noncontig = param("nc", "FLOAT8_E4M3FN", (10, 8), quant=q)
        _, counts, rest = fp8_gpu.plan([wraps, overlap, mixed, ints, fine, noncontig], s.meta)
        self.assertEqual([p.name for p in rest], ["x", "y", "z", "i", "nc"])
        self.assertEqual(counts, (2, 160 + 8))


if __name__ == "__main__":
    unittest.main()
