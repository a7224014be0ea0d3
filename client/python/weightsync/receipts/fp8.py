"""FP8 targets: the quantisation the daemon applies on the way into an FP8
engine (docs/protocol.md, "FP8 targets"), bit for bit what common/fp8.cc
computes; tests/vectors/fp8.json (tools/fp8_vectors.py, exact rational
arithmetic) binds both. quantize, to_fp8 and quantized_receipt are one
body for numpy arrays and torch tensors (ops=weightsync._xp.TorchOps():
on the tensors' device, the same bits; CI runs the numpy instantiation and
tests/gpu/check_fp8_receipts_gpu.py the torch one).

Per block of float32 values x (the sent elements widened exactly):

    amax  = max |x| over the block's finite elements (0 if none)
    d     = amax / FMAX in float32 (448 e4m3fn, 57344 e5m2); 1 where that is 0
    q     = x / d in float32, rounded to nearest even into the format;
            |q| >= FMAX and +-inf saturate to +-FMAX; NaN keeps x's sign
    scale = d (SCALE_FORM_DEQUANT, checkpoints' weight_scale_inv) or 1 / d

quantize(x, ...) quantises a 2-D float32 array; quantized_receipt sums what
an engine's FP8 parameters and their scales hold after an update (the part
of weightsync.receipts.expected_receipt for quantised targets). Given the
blocks' amax, quantisation is elementwise: one sender of many (whose parts
of a block the others complete) takes its blocks' amax with block_stats,
and quantize / quantized_receipt take the whole blocks' (amax=)."""

import numpy as np

from weightsync import _xp

__all__ = ["FMAX", "quantize", "to_fp8", "from_fp8", "dequantize", "block_shape",
           "block_amax", "block_stats", "quantized_receipt", "split_layout", "CHUNK"]

FMAX = {"FLOAT8_E4M3FN": 448.0, "FLOAT8_E5M2": 57344.0}
# (mantissa bits, bias, largest finite encoding, NaN encoding, FMAX bits)
SPEC = {"FLOAT8_E4M3FN": (3, 7, 0x7E, 0x7F, 0x43E00000),
         "FLOAT8_E5M2": (2, 15, 0x7B, 0x7E, 0x47600000)}


def _round_shift(m, shift):
    """m >> shift rounded to nearest, ties to even (int64 numpy arrays or
    torch tensors; `shift` an int or an int64 array like `m`, 1..62)."""
    k = m >> shift
    one = shift * 0 + 1   # 1, or int64 ones like `shift` (no uint arithmetic)
    rem = m & ((one << shift) - 1)
    half = one << (shift - 1)
    return k + ((rem > half) | ((rem == half) & ((k & 1) == 1)))


def to_fp8(q, fmt, ops=None):
    """uint8 encodings of float32 `q` (a numpy array, or a torch tensor
    with `ops` = weightsync._xp.TorchOps()) rounded to nearest even into
    `fmt`, saturating at +-FMAX; NaN keeps its sign. Integer arithmetic in
    int64 lanes, the same on both."""
    ops = ops or _xp.NumpyOps()
    mb, bias, max_bits, nan_bits, fmax_bits = SPEC[fmt]
    if not _xp.is_torch(q):
        q = np.asarray(q, np.float32)
    bits = ops.f32_bits(q)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = a >> 23
    emin = 1 - bias
    drop = 23 - mb
    normal = _round_shift(((e - 127 + bias) << 23) | (a & 0x7FFFFF), drop)
    m = ops.where(e == 0, a, (a & 0x7FFFFF) | 0x800000)
    shift = (emin - mb) - (ops.clip(e, 1) - 150)
    sub = ops.where(shift >= 25, 0, _round_shift(m, ops.clip(shift, 1, 25)))
    out = ops.where(e - 127 < emin, sub, normal)
    out = ops.where(a >= fmax_bits, max_bits, out)
    out = ops.where(a > 0x7F800000, nan_bits, out)
    return ops.to_uint8(out | sign)


def from_fp8(enc, fmt):
    """float32 values of FP8 encodings (exact)."""
    mb, bias = SPEC[fmt][:2]
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


def quantize(x, block_rows, block_cols, fmt="FLOAT8_E4M3FN", reciprocal=False, ops=None,
             amax=None):
    """(uint8 FP8 encodings of x's shape, float32 stored scales
    [ceil(rows / block_rows), ceil(cols / block_cols)]) of a 2-D float32
    array, cut into blocks from its top-left corner (edge blocks partial).
    Per row: block_rows=1, block_cols=cols. `x`: a numpy array, or a torch
    tensor with `ops` = weightsync._xp.TorchOps() (then on its device,
    bit for bit the same: float32 IEEE operations only, every operand a
    tensor).

    amax: float32 [ceil(rows / block_rows), ceil(cols / block_cols)] (an
    array of x's kind), each block's amax to quantise with instead of the
    one of x's own elements (block_amax): a sender that holds part of a
    block quantises its elements with the whole block's amax, the max of
    every part's block_amax, exactly as the daemon quantises the whole
    block (quantisation is elementwise once d is known)."""
    ops = ops or _xp.NumpyOps()
    if not _xp.is_torch(x):
        x = np.asarray(x, np.float32)
        amax = None if amax is None else np.asarray(amax, np.float32)
    rows, cols = x.shape
    gr, gc = -(-rows // block_rows), -(-cols // block_cols)
    with ops.errstate():
        padded = _padded(ops, x, block_rows, block_cols)
        if amax is None:
            amax = _padded_amax(ops, padded, block_rows, block_cols)
        d = amax / ops.full_like(amax, FMAX[fmt])
        one = ops.full_like(d, 1.0)
        d = ops.where(d == 0, one, d)
        q = (padded.reshape(gr, block_rows, gc, block_cols)
             / d.reshape(gr, 1, gc, 1)).reshape(gr * block_rows, gc * block_cols)
        q = q[:rows, :cols]
        q = ops.where(x != x, x, q)   # NaN as it is (its sign is kept)
        stored = one / d if reciprocal else d
    return to_fp8(q, fmt, ops), stored


def block_amax(x, block_rows, block_cols, ops=None):
    """float32 [ceil(rows / block_rows), ceil(cols / block_cols)]: the amax
    quantize takes for each block of 2-D float32 `x` (max |x| over the
    block's finite elements, 0 if none; an array of x's kind). Elements
    that are 0 change nothing, so the amax of a sender's part of a block is
    that of an image of the block holding its elements and zeros."""
    ops = ops or _xp.NumpyOps()
    if not _xp.is_torch(x):
        x = np.asarray(x, np.float32)
    with ops.errstate():
        return _padded_amax(ops, _padded(ops, x, block_rows, block_cols), block_rows,
                            block_cols)


def _padded(ops, x, block_rows, block_cols):
    """2-D `x` in a float32 grid of whole blocks (zeros past its edges)."""
    rows, cols = x.shape
    gr, gc = -(-rows // block_rows), -(-cols // block_cols)
    padded = ops.zeros((gr * block_rows, gc * block_cols), "float32", x)
    padded[:rows, :cols] = x
    return padded


def _padded_amax(ops, padded, block_rows, block_cols):
    """Each block's amax of a grid of whole blocks (_padded)."""
    gr, gc = padded.shape[0] // block_rows, padded.shape[1] // block_cols
    mag = abs(padded)
    # NaN and inf count as 0 (a float32 zero: no Python float operand
    # that an older numpy could widen the result with).
    mag = ops.where(mag < float("inf"), mag, ops.zeros(1, "float32", padded))
    return ops.amax_blocks(mag.reshape(gr, block_rows, gc, block_cols))


def dequantize(enc, scales, block_rows, block_cols, fmt="FLOAT8_E4M3FN", reciprocal=False):
    """float32 q * d: what an engine computes from its FP8 weight and scales."""
    enc = np.asarray(enc)
    rows, cols = enc.shape
    d = np.float32(1) / scales if reciprocal else np.asarray(scales, np.float32)
    d = np.asarray(d, np.float32).reshape(-(-rows // block_rows), -(-cols // block_cols))
    full = np.repeat(np.repeat(d, block_rows, axis=0), block_cols, axis=1)[:rows, :cols]
    return from_fp8(enc, fmt) * full


def enum_name(kind, value):
    """The name of enum `kind`'s `value` (weightsync.v1)."""
    from weightsync._proto import v1
    return v1.enum_name(kind, value)


def quantization_fields(fmt, scale_parameter, block=(128, 128), reciprocal=False):
    """weightsync.v1.Quantization fields (enum values by name) of an FP8
    target: `fmt` ("FLOAT8_E4M3FN" / "FLOAT8_E5M2"), its scales in
    `scale_parameter`, blocks of `block` = (rows, cols) or one scale per row
    (block=None), stored as d (DEQUANT) or 1 / d (reciprocal). What
    Engine.register_host / register_torch take per name, and
    v1.Quantization(**fields) builds."""
    q = {"format": fmt, "scale_parameter": scale_parameter,
         "scale_form": "SCALE_FORM_RECIPROCAL" if reciprocal else "SCALE_FORM_DEQUANT"}
    if block is None:
        q["scheme"] = "QUANT_SCHEME_PER_ROW"
    else:
        q.update(scheme="QUANT_SCHEME_BLOCK", block_rows=block[0], block_cols=block[1])
    return q


def block_shape(parameter):
    """(block_rows, block_cols, rows, cols) of a quantised Parameter
    message: the defaults (0 = 128) applied, per row as 1 x cols. A stacked
    weight [..., n, k] (experts) is the matrix of its rows: rows =
    prod(...) * n, cols = k (the daemon refuses one whose n cuts a block)."""
    shape = [int(d) for d in parameter.shape]
    cols = shape[-1] if shape else 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    qz = parameter.quantization
    if enum_name("QuantScheme", qz.scheme) == "QUANT_SCHEME_PER_ROW":
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


# Elements a step of quantized_receipt works on at most (rows of blocks of
# a parameter; segments written into its image this many at a time): the
# quantisation holds several int64 temporaries an element.
CHUNK = 1 << 24


def _elements(ops, raw, dtype):
    """Flat elements of a sent tensor (any integer or float view of its
    storage, a flat uint8 one too) as integers of the dtype's width."""
    from weightsync.receipts.core import ESIZE
    flat = ops.flat(raw)
    width = ESIZE[dtype]
    if ops.itemsize(flat) != width:
        flat = flat.view(ops.int_dtype(width))
    return flat


def _widen(ops, elements, dtype):
    """float32 values of `elements` (_elements) of float dtype `dtype`,
    exactly; NaN keeps sign and payload (as receipts.core.to_float32 and the
    daemon: torch's CUDA float16 -> float32 drops a NaN's sign)."""
    from weightsync.receipts.core import convert_element_bits
    return ops.f32_from_bits(convert_element_bits(ops, ops.flat(elements), dtype, "FLOAT32"))


def widened(raw, dtype, ops=None):
    """float32 values (flat) of a sent tensor's storage `raw` of float
    dtype `dtype`, exactly (as the daemon widens them)."""
    ops = ops or _xp.NumpyOps()
    return _widen(ops, _elements(ops, raw, dtype), dtype)


def sources(p):
    """The sent tensors that feed parameter `p` (its segments' sources, or
    its own name)."""
    return [s.source for s in p.segments] or [p.name]


def _image(p, sent, rows, cols, ops=None, values=True, chunk=CHUNK):
    """(float32 [rows, cols] of the sent values, bool mask of the elements
    a sent source writes) of quantised parameter `p`; values=False: (None,
    mask). Numpy arrays, or torch tensors on the sources' device with
    `ops` = weightsync._xp.TorchOps()."""
    ops = ops or _xp.NumpyOps()
    like = next((sent[n][2] for n in sources(p) if n in sent), None)
    n = rows * cols
    image = ops.zeros(n, "float32", like) if values else None
    mask = ops.zeros(n, "bool", like)
    segments = list(p.segments)
    if not segments:
        if p.name in sent:
            mask[:] = True
            if values:
                dtype, _, raw = sent[p.name][:3]
                src = _elements(ops, raw, dtype)
                for lo in range(0, n, chunk):
                    hi = min(n, lo + chunk)
                    image[lo:hi] = _widen(ops, src[lo:hi], dtype)
        return (image.reshape(rows, cols) if values else None), mask.reshape(rows, cols)
    for s in segments:
        if s.source not in sent:
            continue
        dtype, shape, raw = sent[s.source][:3]
        scols = 1
        for d in list(shape)[1:]:
            scols *= int(d)
        srows = int(shape[0]) if len(shape) else 1
        rc, cc = s.row_count, s.col_count
        stride = s.dest_row_stride or cc
        grid = _elements(ops, raw, dtype).reshape(srows, scols) if values else None
        step = max(1, chunk // max(cc, 1))
        for r0 in range(0, rc, step):
            r1 = min(rc, r0 + step)
            if stride == cc:   # rows back to back: one run of the image
                where = slice(s.dest_offset + r0 * cc, s.dest_offset + r1 * cc)
            else:
                where = (s.dest_offset + (ops.arange(r1 - r0, like=mask)[:, None] + r0) * stride
                         + ops.arange(cc, like=mask)[None, :]).reshape(-1)
            mask[where] = True
            if values:
                block = grid[s.row_begin + r0:s.row_begin + r1,
                             s.col_begin:s.col_begin + cc]
                image[where] = _widen(ops, block, dtype)
    return (image.reshape(rows, cols) if values else None), mask.reshape(rows, cols)


def _written_blocks(ops, mask, br, bc):
    """Flat indices (int64, increasing) of the blocks of a [rows, cols]
    mask's grid that hold a true element (edge blocks partial)."""
    rows, cols = mask.shape
    gr, gc = -(-rows // br), -(-cols // bc)
    pad = ops.zeros((gr * br, gc * bc), "bool", mask)
    pad[:rows, :cols] = mask
    return ops.nonzero(pad.reshape(gr, br, gc, bc).any(3).any(1).reshape(-1))


def terms_sum(ops, bits, index, salt):
    """Sum of the receipt terms (receipts.terms32) of int64 lanes of 32-bit
    `bits` at element indices `index` (< 2^31 of them: an int64 sum)."""
    from weightsync.receipts.core import KEY_HI, KEY_LO, M32, mix32_bits
    key = (salt + (index & M32) * KEY_LO + _xp.shr(index, 32) * KEY_HI) & M32
    return ops.to_int(mix32_bits(bits ^ key).sum())


def block_stats(quantized, sent, ops=None, chunk=CHUNK):
    """{parameter name: (amax, counts)} of the quantised parameters that
    `sent` (as quantized_receipt takes it) writes: float32 [gr, gc] each
    block's block_amax over the elements a sent source writes, and int64
    [gr, gc] how many of them there are (edge blocks partial). What one
    sender of many (weightsync.senders.many_receipts) holds of each block:
    the max of every sender's amax of a block is the block's amax (max is
    exact). Numpy arrays, or torch tensors with `ops` as quantized_receipt;
    `chunk` elements at a time at most (whole rows of blocks)."""
    ops = ops or _xp.NumpyOps()
    out = {}
    for p, (br, bc, rows, cols), image, mask in _sent_images(quantized, sent, ops, True, chunk):
        gr, gc = -(-rows // br), -(-cols // bc)
        amax = ops.zeros((gr, gc), "float32", image)
        counts = ops.zeros((gr, gc), "int64", image)
        step = br * max(1, chunk // max(br * cols, 1))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            g0, g1 = r0 // br, -(-r1 // br)
            amax[g0:g1] = block_amax(image[r0:r1], br, bc, ops)
            pad = ops.zeros(((g1 - g0) * br, gc * bc), "bool", mask)
            pad[:r1 - r0, :cols] = mask[r0:r1]
            counts[g0:g1] = pad.reshape(g1 - g0, br, gc, bc).sum(3).sum(1)
        out[p.name] = (amax, counts)
    return out


def _sent_images(quantized, sent, ops, values, chunk):
    """(parameter, block_shape, image, mask) of each quantised parameter of
    `quantized` that a sent source writes (_image), skipping those it
    writes nothing of: the walk quantized_receipt and block_stats share."""
    for p in quantized:
        if not any(n in sent for n in sources(p)):
            continue
        shape = block_shape(p)
        image, mask = _image(p, sent, shape[2], shape[3], ops, values, chunk)
        if bool(mask.any()):
            yield p, shape, image, mask


def quantized_receipt(quantized, sent, ops=None, chunk=CHUNK, values=True, amax=None,
                      scales=None):
    """(checksum, parameters, bytes) of the quantised parameters of a
    layout (split_layout) after an update that sent `sent` (as
    expected_receipt takes it): their FP8 elements that a sent source
    writes and the scales of those blocks.

    ops: None, numpy arrays (uint8 views or the dtypes' storage types);
    weightsync._xp.TorchOps(): torch tensors, each parameter's sources on
    one device, where all of it runs (the same code: bit for bit the same
    sums). A parameter is quantised `chunk` elements at a time at most
    (whole rows of blocks; at least one). values=False: the counts only
    (the checksum is 0), nothing quantised.

    One sender's part of an update of many (weightsync.senders.many_receipts):
    amax {parameter name: float32 [gr, gc]}, the blocks' amax to quantise
    with (quantize's amax: every sender's elements of the block); scales
    {parameter name: bool [gr, gc]}, the written blocks whose scale (and
    its 4 bytes) this part counts (each block's by one sender). Arrays of
    the ops' kind; a parameter neither names takes its own blocks' amax and
    every written block's scale, as the whole update's receipt."""
    from weightsync.receipts.core import salt32
    ops = ops or _xp.NumpyOps()
    amax, scales = amax or {}, scales or {}
    total = params = nbytes = 0
    for p, (br, bc, rows, cols), image, mask in _sent_images(quantized, sent, ops, values, chunk):
        qz = p.quantization
        fmt = enum_name("DType", qz.format)
        reciprocal = enum_name("ScaleForm", qz.scale_form) == "SCALE_FORM_RECIPROCAL"
        gc = -(-cols // bc)
        step = br * max(1, chunk // max(br * cols, 1))
        salt, scale_salt = salt32(p.name), salt32(qz.scale_parameter)
        given, counted = amax.get(p.name), scales.get(p.name)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            g0, g1 = r0 // br, -(-r1 // br)
            m = mask[r0:r1]
            index = ops.nonzero(m.reshape(-1))
            if not index.shape[0]:
                continue
            blocks = _written_blocks(ops, m, br, bc)
            if counted is not None:
                blocks = blocks[counted[g0:g1].reshape(-1)[blocks]]
            nbytes += int(index.shape[0]) + 4 * int(blocks.shape[0])
            if not values:
                continue
            enc, stored = quantize(image[r0:r1], br, bc, fmt, reciprocal, ops,
                                   None if given is None else given[g0:g1])
            total += terms_sum(ops, ops.to_int64(enc.reshape(-1)[index]), index + r0 * cols,
                                salt)
            total += terms_sum(ops, ops.f32_bits(stored.reshape(-1)[blocks]),
                                blocks + g0 * gc, scale_salt)
        params += 2
    return total & 0xFFFFFFFFFFFFFFFF, params, nbytes
