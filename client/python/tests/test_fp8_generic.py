"""weightsync.fp8's quantisation and FP8 receipts are one body for numpy and
torch (the torch run, on the trainer's GPU, is how a GPU trainer computes
an FP8 engine's receipt). CI has no torch: here the numpy run of that body
is checked against the former numpy-only code (kept below as written
before it became generic), piece by piece (rounding shifts by arrays,
amax per block with partial edge blocks, parameters cut into rows of
blocks), and the torch instantiation (weightsync._xp.TorchOps) runs on a
small torch-like shim over numpy that has torch's names and none of
numpy's own array methods, so that the body uses nothing numpy-only.
tests/gpu/check_fp8_receipts_gpu.py checks the real torch on a GPU."""

import os
import sys
import types
import unittest

import numpy as np

if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from weightsync import _xp, receipts  # noqa: E402
from weightsync.receipts import fp8  # noqa: E402
from weightsync._proto import v1  # noqa: E402
from weightsync._tensors import STORAGE  # noqa: E402

FORMATS = ("FLOAT8_E4M3FN", "FLOAT8_E5M2")


# --- The numpy-only reference as it was (before the generic body) --------

def _old_round_shift(m, shift):
    k = m >> shift
    rem = m & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    return k + ((rem > half) | ((rem == half) & ((k & 1) == 1)))


def _old_to_fp8(q, fmt):
    mb, bias, max_bits, nan_bits, fmax_bits = fp8.SPEC[fmt]
    bits = np.ascontiguousarray(q, np.float32).view(np.uint32).astype(np.int64)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = a >> 23
    emin = 1 - bias
    drop = 23 - mb
    normal = _old_round_shift(((e - 127 + bias) << 23) | (a & 0x7FFFFF), drop)
    m = np.where(e == 0, a, (a & 0x7FFFFF) | 0x800000)
    shift = (emin - mb) - (np.maximum(e, 1) - 150)
    sub = np.where(shift >= 25, 0, _old_round_shift(m, np.clip(shift, 1, 25)))
    out = np.where(e - 127 < emin, sub, normal)
    out = np.where(a >= fmax_bits, max_bits, out)
    out = np.where(a > 0x7F800000, nan_bits, out)
    return (out | sign).astype(np.uint8)


def _old_quantize(x, block_rows, block_cols, fmt, reciprocal):
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    gr, gc = -(-rows // block_rows), -(-cols // block_cols)
    mag = np.abs(x)
    mag[~np.isfinite(mag)] = 0
    padded = np.zeros((gr * block_rows, gc * block_cols), np.float32)
    padded[:rows, :cols] = mag
    amax = padded.reshape(gr, block_rows, gc, block_cols).max(axis=(1, 3))
    with np.errstate(all="ignore"):
        d = amax / np.float32(fp8.FMAX[fmt])
        d[d == 0] = np.float32(1)
        full = np.repeat(np.repeat(d, block_rows, axis=0), block_cols, axis=1)[:rows, :cols]
        q = np.where(np.isnan(x), x, x / full)
        stored = np.float32(1) / d if reciprocal else d
    return _old_to_fp8(q, fmt), stored.astype(np.float32)


# --- A torch-like shim over numpy ------------------------------------------

class Tensor(np.ndarray):
    """A numpy array that answers to torch's names (to, element_size,
    amax(dim), is_cuda, ...) and refuses numpy's own methods that torch
    lacks or spells otherwise."""

    is_cuda = True
    device = "cuda:0"

    def element_size(self):
        return np.ndarray.__getattribute__(self, "itemsize")

    def detach(self):
        return self

    def contiguous(self):
        return np.ascontiguousarray(self).view(Tensor)

    def to(self, dtype):
        return np.asarray(self).astype(dtype).view(Tensor)

    def amax(self, dim):
        return np.asarray(self).max(axis=dim).view(Tensor)

    def dim(self):
        return self.ndim

    def cpu(self):
        return self

    def numpy(self):
        return np.asarray(self)

    def __getattribute__(self, name):
        if name in ("astype", "max", "min", "size", "itemsize", "tobytes", "ravel",
                    "flatten", "nonzero", "clip", "view_as"):
            raise AttributeError(f"torch tensors have no numpy-style .{name}")
        return np.ndarray.__getattribute__(self, name)


Tensor.__module__ = "torch"


def _t(x):
    return np.asarray(x).view(Tensor)


def _fake_torch():
    m = types.ModuleType("torch")
    m.float32, m.float16, m.int64, m.int32, m.int16, m.uint8, m.bool = (
        np.float32, np.float16, np.int64, np.int32, np.int16, np.uint8, np.bool_)
    m.zeros = lambda shape, dtype=None, device=None: _t(np.zeros(shape, dtype))
    m.full_like = lambda x, v: _t(np.full_like(np.asarray(x), v))
    m.clamp = lambda x, min=None, max=None: _t(np.clip(np.asarray(x), min, max))

    def where(c, a, b):
        # torch.where takes Python scalars with a tensor's dtype.
        ref = b if isinstance(a, (int, float)) else a
        if isinstance(ref, (int, float)):
            raise TypeError("torch.where needs a tensor")
        dt = np.asarray(ref).dtype
        return _t(np.where(np.asarray(c), np.asarray(a, dt), np.asarray(b, dt)))
    m.where = where
    m.nonzero = lambda x: _t(np.argwhere(np.asarray(x)).astype(np.int64))
    m.count_nonzero = lambda x: _t(np.count_nonzero(np.asarray(x)))
    m.arange = lambda n, dtype=None, device=None: _t(np.arange(n, dtype=dtype))
    m.cat = lambda parts: _t(np.concatenate([np.asarray(p) for p in parts]))
    return m


class FakeTorch:
    """sys.modules["torch"] is the shim inside the block."""

    def __enter__(self):
        self.saved = sys.modules.get("torch")
        sys.modules["torch"] = _fake_torch()
        return self

    def __exit__(self, *exc):
        if self.saved is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = self.saved


# --- Data ------------------------------------------------------------------

F32_SPECIALS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA12345, 0x7F800000, 0xFF800000,
                0x00000001, 0x807FFFFF, 0x80000000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F808000,
                0x43E00000, 0x43E80000, 0x47600000, 0x47700000, 0x3B800000, 0x3B7FFFFF]
H16_SPECIALS = [0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0xFD55, 0x0001, 0x8001, 0x03FF,
                0x7BFF, 0xFBFF, 0x8000]
B16_SPECIALS = [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFA5, 0x0001, 0x807F, 0x7F7F,
                0xFF7F, 0x8000, 0x4400]


def _values(rng, dtype, n, zero_rows_from=None):
    """n random elements of `dtype` (storage array): normal values over a
    wide range of magnitudes, specials sprinkled."""
    scale = np.float32(2.0) ** rng.integers(-30, 30, n).astype(np.float32)
    f = (rng.standard_normal(n).astype(np.float32) * scale).astype(np.float32)
    if dtype == "FLOAT32":
        u = f.view(np.uint32).copy()
        specials, width = F32_SPECIALS, 4
    elif dtype == "FLOAT16":
        with np.errstate(all="ignore"):
            u = (f / np.float32(2.0 ** 20)).astype(np.float16).view(np.uint16).copy()
        specials, width = H16_SPECIALS, 2
    else:
        u = (f.view(np.uint32) >> 16).astype(np.uint16)
        specials, width = B16_SPECIALS, 2
    for k, v in enumerate(specials):
        u[(k * 7919) % n] = v
    out = u.view(STORAGE[dtype])
    return out if width else out


def _param(name, dtype, shape, segments=(), quant=None):
    p = v1.Parameter(name=name, dtype=getattr(v1, dtype), shape=list(shape))
    for s in segments:
        p.segments.add(**s)
    if quant:
        p.quantization.CopyFrom(v1.Quantization(**quant))
    return p


def _quant(fmt, scale, block=None, reciprocal=False):
    q = dict(format=getattr(v1, fmt), scale_parameter=scale,
             scale_form=v1.SCALE_FORM_RECIPROCAL if reciprocal else v1.SCALE_FORM_DEQUANT)
    if block is None:
        q["scheme"] = v1.QUANT_SCHEME_PER_ROW
    else:
        q.update(scheme=v1.QUANT_SCHEME_BLOCK, block_rows=block[0], block_cols=block[1])
    return q


def _layout_and_sent(rng):
    """A layout of FP8 targets (whole parameters and a fused one with
    strided segments, blocks with partial edges, per row, both formats
    and scale forms, a source not sent) and what was sent."""
    sent = {}

    def tensor(name, dtype, shape):
        sent[name] = (dtype, tuple(shape), _values(rng, dtype, int(np.prod(shape))))

    tensor("w", "BFLOAT16", (37, 70))
    tensor("q", "FLOAT32", (24, 40))
    tensor("k", "FLOAT16", (8, 40))
    tensor("v", "BFLOAT16", (8, 40))
    tensor("r", "FLOAT16", (9, 33))
    tensor("d", "FLOAT32", (40, 21))   # a column shard into d's columns 0..20
    layout = [
        _param("w", "FLOAT8_E4M3FN", (37, 70), quant=_quant("FLOAT8_E4M3FN", "w_s", (16, 32))),
        _param("w_s", "FLOAT32", (3, 3)),
        _param("qkv", "FLOAT8_E5M2", (48, 40), [
            dict(source="q", row_begin=0, row_count=24, col_begin=0, col_count=40,
                 dest_offset=0),
            dict(source="k", row_begin=0, row_count=8, col_begin=0, col_count=40,
                 dest_offset=24 * 40),
            dict(source="v", row_begin=0, row_count=8, col_begin=0, col_count=40,
                 dest_offset=32 * 40),
            dict(source="missing", row_begin=0, row_count=8, col_begin=0, col_count=40,
                 dest_offset=40 * 40)],
            quant=_quant("FLOAT8_E5M2", "qkv_s", (16, 16), reciprocal=True)),
        _param("qkv_s", "FLOAT32", (3, 3)),
        _param("r", "FLOAT8_E4M3FN", (9, 33), quant=_quant("FLOAT8_E4M3FN", "r_s", None, True)),
        _param("r_s", "FLOAT32", (9, 1)),
        _param("d", "FLOAT8_E4M3FN", (40, 50), [
            dict(source="d", row_begin=2, row_count=30, col_begin=1, col_count=20,
                 dest_offset=3 * 50 + 5, dest_row_stride=50)],
            quant=_quant("FLOAT8_E4M3FN", "d_s", (8, 8))),
        _param("d_s", "FLOAT32", (5, 7)),
    ]
    return layout, sent


def _old_receipt(quantized, sent):
    """The former quantized_receipt (numpy only, whole parameters)."""
    total = params = nbytes = 0
    for p in quantized:
        br, bc, rows, cols = fp8.block_shape(p)
        values = np.zeros(rows * cols, np.float32)
        mask = np.zeros(rows * cols, bool)
        for s in list(p.segments) or [None]:
            src = p.name if s is None else s.source
            if src not in sent:
                continue
            dtype, shape, raw = sent[src]
            f = receipts.to_float32(np.ascontiguousarray(raw).view(np.uint8), dtype)
            if s is None:
                values[:] = f[:rows * cols]
                mask[:] = True
                continue
            f = f.reshape(shape[0], -1)
            block = f[s.row_begin:s.row_begin + s.row_count, s.col_begin:s.col_begin + s.col_count]
            stride = s.dest_row_stride or s.col_count
            index = (s.dest_offset + np.arange(s.row_count)[:, None] * stride
                     + np.arange(s.col_count)[None, :])
            values[index] = block
            mask[index] = True
        if not mask.any():
            continue
        qz = p.quantization
        enc, stored = _old_quantize(values.reshape(rows, cols), br, bc,
                                    v1.enum_name("DType", qz.format),
                                    qz.scale_form == v1.SCALE_FORM_RECIPROCAL)
        index = np.flatnonzero(mask)
        total += int(receipts.terms32(enc.reshape(-1)[index].astype(np.uint32), index,
                                      receipts.salt32(p.name)).sum(dtype=np.uint64))
        gr, gc = stored.shape
        pad = np.zeros((gr * br, gc * bc), bool)
        pad[:rows, :cols] = mask.reshape(rows, cols)
        blocks = np.flatnonzero(pad.reshape(gr, br, gc, bc).any(axis=(1, 3)))
        total += int(receipts.terms32(stored.reshape(-1)[blocks].view(np.uint32), blocks,
                                      receipts.salt32(qz.scale_parameter)).sum(dtype=np.uint64))
        params += 2
        nbytes += index.size + 4 * blocks.size
    return total & 0xFFFFFFFFFFFFFFFF, params, nbytes


class GenericNumpyTest(unittest.TestCase):
    def test_round_shift_by_arrays(self):
        rng = np.random.default_rng(3)
        m = rng.integers(0, 1 << 40, 4000, dtype=np.int64)
        shift = rng.integers(1, 30, 4000, dtype=np.int64)
        # Ties: m = (2j + 1) << (shift - 1), both parities of j.
        m[:100] = ((2 * np.arange(100) + 1) << (shift[:100] - 1))
        got = fp8._round_shift(m, shift)
        for mi, si, g in zip(m.tolist(), shift.tolist(), got.tolist()):
            k, rem, half = mi >> si, mi & ((1 << si) - 1), 1 << (si - 1)
            want = k + (rem > half or (rem == half and k & 1))
            self.assertEqual(g, want, (mi, si))
        for s in (1, 13, 20, 21):   # a scalar shift: the same as an array of it
            np.testing.assert_array_equal(fp8._round_shift(m, s),
                                          fp8._round_shift(m, np.full_like(m, s)))

    def test_to_fp8_every_float32_class(self):
        rng = np.random.default_rng(4)
        u = rng.integers(0, 1 << 32, 200000, dtype=np.uint64).astype(np.uint32)
        u[:len(F32_SPECIALS)] = F32_SPECIALS
        # Around every FP8 value of both formats, and subnormal float32s.
        near = np.concatenate([fp8.from_fp8(np.arange(256, dtype=np.uint8), f) for f in FORMATS])
        near = near[np.isfinite(near)].view(np.uint32)
        u = np.concatenate([u, near, near + 1, near - 1, np.arange(0, 1 << 12, dtype=np.uint32)])
        q = u.view(np.float32)
        for fmt in FORMATS:
            np.testing.assert_array_equal(fp8.to_fp8(q, fmt), _old_to_fp8(q, fmt))

    def test_quantize_equals_former_numpy(self):
        rng = np.random.default_rng(5)
        for shape, block in (((37, 70), (16, 32)), ((128, 128), (128, 128)),
                             ((130, 260), (128, 128)), ((9, 33), (1, 33)), ((1, 1), (4, 4))):
            for src in ("FLOAT32", "BFLOAT16", "FLOAT16"):
                x = receipts.to_float32(_values(rng, src, shape[0] * shape[1]).view(np.uint8),
                                         src).reshape(shape)
                if shape[0] > 16:
                    x[:16, :16] = 0   # a block of zeros: d = 1
                for fmt in FORMATS:
                    for rec in (False, True):
                        enc, sc = fp8.quantize(x, *block, fmt, rec)
                        old_enc, old_sc = _old_quantize(x, *block, fmt, rec)
                        np.testing.assert_array_equal(enc, old_enc)
                        np.testing.assert_array_equal(sc.view(np.uint32), old_sc.view(np.uint32))
                        self.assertEqual(sc.dtype, np.float32)

    def test_widen_keeps_nan_sign_and_payload(self):
        rng = np.random.default_rng(6)
        ops = _xp.NumpyOps()
        for dtype in ("FLOAT32", "BFLOAT16", "FLOAT16"):
            raw = _values(rng, dtype, 5000)
            want = receipts.to_float32(raw.view(np.uint8), dtype).view(np.uint32)
            got = fp8._widen(ops, fp8._elements(ops, raw.view(np.uint8), dtype), dtype)
            np.testing.assert_array_equal(got.view(np.uint32), want)

    def test_receipt_equals_former_numpy_and_chunks_change_nothing(self):
        rng = np.random.default_rng(7)
        layout, sent = _layout_and_sent(rng)
        _, quant, _ = fp8.split_layout(layout)
        want = _old_receipt(quant, sent)
        self.assertEqual(want[1], 8)
        u8 = {n: (d, s, a.view(np.uint8)) for n, (d, s, a) in sent.items()}
        for chunk in (fp8.CHUNK, 1, 7, 50, 700, 2000):
            self.assertEqual(fp8.quantized_receipt(quant, u8, chunk=chunk), want, chunk)
            self.assertEqual(fp8.quantized_receipt(quant, sent, chunk=chunk), want, chunk)
            self.assertEqual(fp8.quantized_receipt(quant, u8, chunk=chunk, values=False),
                             (0,) + want[1:], chunk)
        self.assertEqual(receipts.expected_receipt(layout, u8), want)
        self.assertEqual(receipts.expected_receipt_arrays(layout, sent), want)

    def test_image_of_strided_segment(self):
        rng = np.random.default_rng(8)
        layout, sent = _layout_and_sent(rng)
        p = layout[6]
        for chunk in (1, 3, 1 << 20):
            image, mask = fp8._image(p, sent, 40, 50, chunk=chunk)
            self.assertEqual(int(mask.sum()), 30 * 20)
            self.assertTrue(mask[3, 5:25].all() and not mask[3, :5].any() and mask[32, 24])
            src = receipts.to_float32(sent["d"][2].view(np.uint8), "FLOAT32").reshape(40, 21)
            np.testing.assert_array_equal(image[3:33, 5:25].view(np.uint32),
                                          src[2:32, 1:21].view(np.uint32))


class TorchShimTest(unittest.TestCase):
    """The torch instantiation (TorchOps) on the shim: the same numbers."""

    def test_quantize_and_receipts_through_torch_ops(self):
        rng = np.random.default_rng(9)
        layout, sent = _layout_and_sent(rng)
        plain, quant, _ = fp8.split_layout(layout)
        want = _old_receipt(quant, sent)
        with FakeTorch(), np.errstate(all="ignore"):
            ops = _xp.TorchOps()
            as_t = {n: (d, s, _t(a.view(np.int16) if d == "BFLOAT16" else a))
                    for n, (d, s, a) in sent.items()}
            self.assertTrue(_xp.is_torch(as_t["w"][2]))
            for chunk in (fp8.CHUNK, 7, 700):
                self.assertEqual(fp8.quantized_receipt(quant, as_t, ops, chunk=chunk), want)
            # expected_receipt_arrays sends them to the torch path.
            self.assertEqual(receipts.quantized_where_sent(quant, as_t), want)
            x = receipts.to_float32(_values(rng, "FLOAT16", 130 * 70).view(np.uint8),
                                     "FLOAT16").reshape(130, 70)
            for fmt in FORMATS:
                enc, sc = fp8.quantize(_t(x), 64, 32, fmt, True, ops)
                old_enc, old_sc = _old_quantize(x, 64, 32, fmt, True)
                np.testing.assert_array_equal(np.asarray(enc), old_enc)
                np.testing.assert_array_equal(np.asarray(sc).view(np.uint32),
                                              old_sc.view(np.uint32))

    def test_mixed_devices_go_to_the_host(self):
        rng = np.random.default_rng(10)
        layout, sent = _layout_and_sent(rng)
        _, quant, _ = fp8.split_layout(layout)
        want = _old_receipt(quant, sent)
        with FakeTorch():
            # q as a numpy array: qkv (fed by q, k, v) is summed on the host
            # copies, the others by torch ops; the same total.
            mixed = {n: (d, s, a if n == "q" else _t(a.view(np.int16) if d == "BFLOAT16"
                                                       else a))
                     for n, (d, s, a) in sent.items()}
            calls = []
            real = fp8.quantized_receipt

            def spy(q, s, ops=None, **kw):
                calls.append((sorted(p.name for p in q), type(ops).__name__))
                return real(q, s, ops, **kw)
            fp8.quantized_receipt = spy
            try:
                got = receipts.quantized_where_sent(quant, mixed)
            finally:
                fp8.quantized_receipt = real
            self.assertEqual(got, want)
            self.assertEqual(calls, [(["qkv"], "NoneType"), (["d", "r", "w"], "TorchOps")])


if __name__ == "__main__":
    unittest.main()
