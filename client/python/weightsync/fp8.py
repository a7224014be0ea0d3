"""FP8 targets: the quantisation the daemon applies on the way into an FP8
engine (docs/protocol.md, "FP8 targets"), in numpy, bit for bit what
common/fp8.cc computes; tests/vectors/fp8.json (tools/fp8_vectors.py,
exact rational arithmetic) binds both.

Per block of float32 values x (the sent elements widened exactly):

    amax  = max |x| over the block's finite elements (0 if none)
    d     = amax / FMAX in float32 (448 e4m3fn, 57344 e5m2); 1 where that is 0
    q     = x / d in float32, rounded to nearest even into the format;
            |q| >= FMAX and +-inf saturate to +-FMAX; NaN keeps x's sign
    scale = d (SCALE_FORM_DEQUANT, checkpoints' weight_scale_inv) or 1 / d

quantize(x, ...) quantises a 2-D float32 array; quantized_receipt sums what
an engine's FP8 parameters and their scales hold after an update (the part
of weightsync.receipts.expected_receipt for quantised targets)."""

import numpy as np

__all__ = ["FMAX", "quantize", "to_fp8", "from_fp8", "dequantize", "block_shape",
           "quantized_receipt", "split_layout"]

FMAX = {"FLOAT8_E4M3FN": 448.0, "FLOAT8_E5M2": 57344.0}
# (mantissa bits, bias, largest finite encoding, NaN encoding, FMAX bits)
_SPEC = {"FLOAT8_E4M3FN": (3, 7, 0x7E, 0x7F, 0x43E00000),
         "FLOAT8_E5M2": (2, 15, 0x7B, 0x7E, 0x47600000)}


def _round_shift(m, shift):
    """m >> shift rounded to nearest, ties to even (int64 arrays, shift
    1..62)."""
    k = m >> shift
    rem = m & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    return k + ((rem > half) | ((rem == half) & ((k & 1) == 1)))


def to_fp8(q, fmt):
    """uint8 encodings of float32 `q` rounded to nearest even into `fmt`,
    saturating at +-FMAX; NaN keeps its sign."""
    mb, bias, max_bits, nan_bits, fmax_bits = _SPEC[fmt]
    bits = np.ascontiguousarray(q, np.float32).view(np.uint32).astype(np.int64)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = a >> 23
    emin = 1 - bias
    drop = 23 - mb
    normal = _round_shift(((e - 127 + bias) << 23) | (a & 0x7FFFFF), drop)
    m = np.where(e == 0, a, (a & 0x7FFFFF) | 0x800000)
    shift = (emin - mb) - (np.maximum(e, 1) - 150)
    sub = np.where(shift >= 25, 0, _round_shift(m, np.clip(shift, 1, 25)))
    out = np.where(e - 127 < emin, sub, normal)
    out = np.where(a >= fmax_bits, max_bits, out)
    out = np.where(a > 0x7F800000, nan_bits, out)
    return (out | sign).astype(np.uint8)


def from_fp8(enc, fmt):
    """float32 values of FP8 encodings (exact)."""
    mb, bias = _SPEC[fmt][:2]
    e8 = np.asarray(enc, np.uint8).astype(np.int64)
    eb = 7 - mb
    exp = (e8 >> mb) & ((1 << eb) - 1)
    mant = e8 & ((1 << mb) - 1)
    v = np.where(exp == 0, mant.astype(np.float64) * 2.0 ** (1 - bias - mb),
                 ((1 << mb) | mant).astype(np.float64) * np.exp2((exp - bias - mb).astype(float)))
    if fmt == "FLOAT8_E5M2":
        v = np.where(exp == (1 << eb) - 1, np.where(mant == 0, np.inf, np.nan), v)
    else:
        v = np.where((e8 & 0x7F) == 0x7F, np.nan, v)
    return np.where(e8 & 0x80, -v, v).astype(np.float32)


def quantize(x, block_rows, block_cols, fmt="FLOAT8_E4M3FN", reciprocal=False):
    """(uint8 FP8 encodings of x's shape, float32 stored scales
    [ceil(rows / block_rows), ceil(cols / block_cols)]) of a 2-D float32
    array, cut into blocks from its top-left corner (edge blocks partial).
    Per row: block_rows=1, block_cols=cols."""
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    gr, gc = -(-rows // block_rows), -(-cols // block_cols)
    mag = np.abs(x)
    mag[~np.isfinite(mag)] = 0
    padded = np.zeros((gr * block_rows, gc * block_cols), np.float32)
    padded[:rows, :cols] = mag
    amax = padded.reshape(gr, block_rows, gc, block_cols).max(axis=(1, 3))
    with np.errstate(all="ignore"):
        d = amax / np.float32(FMAX[fmt])
        d[d == 0] = np.float32(1)
        full = np.repeat(np.repeat(d, block_rows, axis=0), block_cols, axis=1)[:rows, :cols]
        q = np.where(np.isnan(x), x, x / full)
        stored = np.float32(1) / d if reciprocal else d
    return to_fp8(q, fmt), stored.astype(np.float32)


def dequantize(enc, scales, block_rows, block_cols, fmt="FLOAT8_E4M3FN", reciprocal=False):
    """float32 q * d: what an engine computes from its FP8 weight and scales."""
    enc = np.asarray(enc)
    rows, cols = enc.shape
    d = np.float32(1) / scales if reciprocal else np.asarray(scales, np.float32)
    d = np.asarray(d, np.float32).reshape(-(-rows // block_rows), -(-cols // block_cols))
    full = np.repeat(np.repeat(d, block_rows, axis=0), block_cols, axis=1)[:rows, :cols]
    return from_fp8(enc, fmt) * full


def _enum(kind, value):
    from weightsync._proto import v1
    return v1.enum_name(kind, value)


def block_shape(parameter):
    """(block_rows, block_cols, rows, cols) of a quantised Parameter
    message: the defaults (0 = 128) applied, per row as 1 x cols."""
    rows = int(parameter.shape[0])
    cols = 1
    for d in parameter.shape[1:]:
        cols *= int(d)
    qz = parameter.quantization
    if _enum("QuantScheme", qz.scheme) == "QUANT_SCHEME_PER_ROW":
        return 1, cols, rows, cols
    return qz.block_rows or 128, qz.block_cols or 128, rows, cols


def split_layout(layout):
    """(plain parameters, quantised parameters, {scale name: parameter})
    of a layout (weightsync.v1.Parameter messages): scale parameters are
    in neither list (the daemon writes them with their owner)."""
    quantized = [p for p in layout if p.HasField("quantization")]
    if not quantized:
        return list(layout), [], {}
    scale_names = {p.quantization.scale_parameter for p in quantized}
    scales = {p.name: p for p in layout if p.name in scale_names}
    plain = [p for p in layout if not p.HasField("quantization") and p.name not in scale_names]
    return plain, quantized, scales


def _widen(raw, dtype):
    from weightsync.receipts import _to_float32
    return _to_float32(np.ascontiguousarray(raw), dtype)


def _image(p, sent, rows, cols):
    """(float32 [rows, cols] of the sent values, bool mask of the elements
    a sent source writes) of quantised parameter `p`."""
    values = np.zeros(rows * cols, np.float32)
    mask = np.zeros(rows * cols, bool)
    segments = list(p.segments)
    if not segments:
        if p.name in sent:
            dtype, _, raw = sent[p.name][:3]
            values[:] = _widen(np.asarray(raw).view(np.uint8), dtype)[:rows * cols]
            mask[:] = True
        return values.reshape(rows, cols), mask.reshape(rows, cols)
    for s in segments:
        if s.source not in sent:
            continue
        dtype, shape, raw = sent[s.source][:3]
        scols = 1
        for d in list(shape)[1:]:
            scols *= int(d)
        srows = int(shape[0]) if len(shape) else 1
        src = _widen(np.asarray(raw).view(np.uint8), dtype).reshape(srows, scols)
        block = src[s.row_begin:s.row_begin + s.row_count, s.col_begin:s.col_begin + s.col_count]
        stride = s.dest_row_stride or s.col_count
        index = (s.dest_offset + np.arange(s.row_count, dtype=np.int64)[:, None] * stride
                 + np.arange(s.col_count, dtype=np.int64)[None, :])
        values[index] = block
        mask[index] = True
    return values.reshape(rows, cols), mask.reshape(rows, cols)


def quantized_receipt(quantized, sent):
    """(checksum, parameters, bytes) of the quantised parameters of a
    layout (split_layout) after an update that sent `sent` (as
    expected_receipt takes it): their FP8 elements that a sent source
    writes and the scales of those blocks."""
    from weightsync.receipts import salt32, terms32
    total = params = nbytes = 0
    for p in quantized:
        br, bc, rows, cols = block_shape(p)
        values, mask = _image(p, sent, rows, cols)
        if not mask.any():
            continue
        qz = p.quantization
        fmt = _enum("DType", qz.format)
        enc, stored = quantize(values, br, bc, fmt,
                               _enum("ScaleForm", qz.scale_form) == "SCALE_FORM_RECIPROCAL")
        index = np.flatnonzero(mask.reshape(-1))
        total += int(terms32(enc.reshape(-1)[index].astype(np.uint32), index,
                             salt32(p.name)).sum(dtype=np.uint64))
        gr, gc = stored.shape
        pad = np.zeros((gr * br, gc * bc), bool)
        pad[:rows, :cols] = mask
        written = pad.reshape(gr, br, gc, bc).any(axis=(1, 3)).reshape(-1)
        blocks = np.flatnonzero(written)
        total += int(terms32(stored.reshape(-1)[blocks].view(np.uint32), blocks,
                             salt32(qz.scale_parameter)).sum(dtype=np.uint64))
        params += 2
        nbytes += index.size + 4 * blocks.size
    return total & 0xFFFFFFFFFFFFFFFF, params, nbytes
