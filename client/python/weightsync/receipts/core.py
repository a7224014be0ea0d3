"""The receipt function and its constants: the bottom of weightsync.receipts
(docs/protocol.md, "Receipts"; the same function as common/checksum.h and
client/receipts.cc; tests/vectors/receipts.json, from
tools/receipt_vectors.py, binds them).

    s          = lo32(FNV-1a 64 of the name) ^ hi32(it)
    key(p, i)  = s + lo32(i) * 0x9E3779B1 + hi32(i) * 0x85EBCA77   (mod 2^32)
    mix32(x)   = y ^ (y >> 16),  y = x * 0x85EBCA6B                 (mod 2^32)
    term(p, i) = mix32(bits32(p[i]) ^ key(p, i)),  checksum = sum mod 2^64

Here: the salts, the mixing step and Bits32 of elements converted to an
engine's dtype, on uint32 numpy arrays (mix32, terms32, bits32_np) and on
int64 lanes of numpy arrays or torch tensors alike (mix32_bits, bits32_of,
convert_element_bits, through weightsync._xp); and the walk through an
engine's layout both sides make (regions, runs). Everything above
(host.py, arrays.py, triton.py, fp8.py, fp8_triton.py, expected.py)
imports from here; this module imports none of them.
"""

import numpy as np

from weightsync import _xp
from weightsync._tensors import STORAGE

KEY_LO, KEY_HI, BITS_HI = 0x9E3779B1, 0x85EBCA77, 0x27D4EB2F
MIX = 0x85EBCA6B
_U32 = np.uint32


def parameter_salt(name):
    """FNV-1a 64 of the parameter's name (numpy uint64)."""
    h = 0xCBF29CE484222325
    for c in name.encode():
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return np.uint64(h)


_SALTS = {}


def salt32(name):
    """The 32-bit salt of a parameter (cached: layouts repeat every update)."""
    s = _SALTS.get(name)
    if s is None:
        h = int(parameter_salt(name))
        s = (h ^ (h >> 32)) & 0xFFFFFFFF
        if len(_SALTS) < 1 << 20:
            _SALTS[name] = s
    return s


def mix32(x):
    """The terms' mixing step, y ^ (y >> 16) with y = (x ^ (x >> 16)) * MIX
    (mod 2^32), on a uint32 numpy array (a new array; `x` is left as it
    is)."""
    with np.errstate(over="ignore"):
        y = (x ^ (x >> _U32(16))) * _U32(MIX)
        y ^= y >> _U32(16)
    return y


def terms32(bits, index, salt):
    """Terms (uint32) of elements with Bits32 `bits` (uint32), element
    indices `index` (int64) and 32-bit salts `salt` (scalar or uint32)."""
    with np.errstate(over="ignore"):
        key = index.astype(_U32) * _U32(KEY_LO)
        hi = (index >> 32).astype(_U32)
        if hi.any():
            key += hi * _U32(KEY_HI)
        key += salt if isinstance(salt, np.ndarray) else _U32(salt)
        key ^= bits
    return mix32(key)


def to_float32(raw, dtype):
    """float32 values of `raw` bytes of a float dtype (float16 NaN keeps sign
    and payload, as HalfToFloat)."""
    if dtype == "FLOAT32":
        return raw.view(np.float32)
    if dtype == "FLOAT16":
        h = raw.view(np.uint16)
        f = h.view(np.float16).astype(np.float32)
        # NaN keeps sign and payload (HalfToFloat), whatever numpy's widening
        # does with signalling NaNs.
        nan = ((h & np.uint16(0x7C00)) == np.uint16(0x7C00)) & ((h & np.uint16(0x3FF)) != 0)
        if nan.any():
            h32 = h[nan].astype(np.uint32)
            f = f.copy()
            f.view(np.uint32)[nan] = (((h32 & np.uint32(0x8000)) << np.uint32(16))
                                      | np.uint32(0x7F800000)
                                      | ((h32 & np.uint32(0x3FF)) << np.uint32(13)))
        return f
    if dtype == "BFLOAT16":
        return (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    raise ValueError(dtype)


def convert_bits(raw, src, dst):
    """Element bits (uint64) of `raw` bytes of dtype `src` stored as `dst`,
    rounding to nearest even like common/dtype.cc."""
    if src == dst:
        return raw.view(STORAGE[dst]).view(f"u{np.dtype(STORAGE[dst]).itemsize}").astype(np.uint64)
    f = to_float32(raw, src)
    if dst == "FLOAT32":
        return f.view(np.uint32).astype(np.uint64)
    if dst == "FLOAT16":
        with np.errstate(all="ignore"):
            h = f.astype(np.float16).view(np.uint16).astype(np.uint64)
        # NaN: sign and the quiet bit, no payload (FloatToHalf); numpy
        # would keep the payload's top bits.
        nan = np.isnan(f)
        h[nan] = ((f.view(np.uint32)[nan].astype(np.uint64) >> np.uint64(16))
                  & np.uint64(0x8000)) | np.uint64(0x7E00)
        return h
    if dst == "BFLOAT16":
        u = f.view(np.uint32).astype(np.uint64)
        rounded = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
        nan = np.isnan(f)
        rounded[nan] = (u[nan] >> np.uint64(16)) | np.uint64(0x40)
        return rounded & np.uint64(0xFFFF)
    raise ValueError(f"can't convert {src} to {dst}")


def bits32_np(raw, src, dst):
    """Bits32 (uint32) of the elements in `raw` (flat uint8, dtype `src`)
    stored as `dst`: zero-extended bits, lo32 ^ hi32 * BITS_HI for 8-byte
    elements; conversions are convert_bits'."""
    if src == dst:
        size = np.dtype(STORAGE[dst]).itemsize
        if size == 8:
            w = raw.view(_U32).reshape(-1, 2)
            with np.errstate(over="ignore"):
                return w[:, 0] ^ (w[:, 1] * _U32(BITS_HI))
        return raw.view(f"u{size}").astype(_U32)
    return convert_bits(raw, src, dst).astype(_U32)


def layout_runs(layout, sent):
    """The walk both sides make, flattened to runs of consecutive elements:
    yields (parameter count, bytes, {(src dtype, dst dtype): [runs]}) once,
    a run being (source name, source rows, source cols, row_begin,
    col_begin, rows, cols, dest_offset, dest row stride, salt32)."""
    from weightsync.planner import ELEMENT_SIZES
    groups = {}
    params = nbytes = 0
    for name, dst, regions in layout_regions(layout, sent):
        if regions is None:
            continue
        params += 1
        s = salt32(name)
        es = ELEMENT_SIZES[dst]
        for region in regions:
            nbytes += region[5] * region[6] * es
            if region[5] * region[6]:
                groups.setdefault((sent[region[0]][0], dst), []).append(region + (s,))
    return params, nbytes, groups


# Int64 lanes (numpy arrays or torch tensors, weightsync._xp): 32-bit values
# live in int64 lanes; products of two of them are exact mod 2^64, masked
# back to 32 bits.

_FLOATS = ("FLOAT32", "BFLOAT16", "FLOAT16")
M32 = _xp.MASK32
ESIZE = {"FLOAT32": 4, "FLOAT16": 2, "BFLOAT16": 2, "FLOAT64": 8, "INT64": 8, "INT32": 4,
         "INT16": 2, "INT8": 1, "UINT8": 1, "BOOL": 1}


def mix32_bits(x):
    """mix32 of int64 lanes holding 32-bit values (same bits as mix32)."""
    y = ((x ^ (x >> 16)) * MIX) & M32
    return y ^ (y >> 16)


def bits32_of(bits, width):
    """Bits32 of zero-extended element bits (int64 lanes) of `width` bytes."""
    if width < 8:
        return bits
    return (bits & M32) ^ ((_xp.shr(bits, 32) * BITS_HI) & M32)


def convert_element_bits(ops, elements, src, dst):
    """int64 bits (zero-extended) of `elements` (dtype `src`, a numpy array
    or torch tensor of that dtype; bfloat16 also as 16-bit integers) stored
    as `dst`: the bits of convert_bits, i.e. common/dtype.cc's conversions,
    NaN rules included (bfloat16: sign and payload, quiet bit set; float16:
    sign and the quiet bit only; float16 -> float32 keeps the payload)."""
    width = ops.itemsize(elements)
    bits = ops.to_int64(elements.view(ops.int_dtype(width)))
    if width < 8:
        bits = bits & ((1 << (8 * width)) - 1)
    if src == dst:
        return bits
    if src not in _FLOATS or dst not in _FLOATS:
        raise ValueError(f"can't convert {src} to {dst}")
    if src == "FLOAT32":
        u = bits
    elif src == "BFLOAT16":
        u = bits << 16
    else:
        nan16 = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x3FF) != 0)
        u = ops.where(nan16, ((bits & 0x8000) << 16) | 0x7F800000 | ((bits & 0x3FF) << 13),
                      ops.f16_to_f32_bits(bits))
    if dst == "FLOAT32":
        return u
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if dst == "BFLOAT16":
        rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
        return ops.where(nan, ((u >> 16) | 0x40) & 0xFFFF, rounded)
    return ops.where(nan, ((u >> 16) & 0x8000) | 0x7E00, ops.f32_to_f16_bits(u))


def layout_regions(layout, sent):
    """Per parameter of `layout`: (name, dst dtype, [(source, source rows,
    source cols, row_begin, col_begin, rows, cols, dest_offset, dest row
    stride)]) of the segments whose source was sent (a parameter without
    segments: one region, all of it), None when it has no such segment. The
    walk of expected_receipt."""
    from weightsync._proto import v1
    for p in layout:
        dst = v1.enum_name("DType", p.dtype)
        segments = list(p.segments)
        regions = []
        if not segments:
            if p.name not in sent:
                continue
            n = 1
            for d in p.shape:
                n *= int(d)
            regions.append((p.name, 1, n, 0, 0, 1, n, 0, n))
        for s in segments:
            if s.source not in sent:
                continue
            shape = list(sent[s.source][1])
            numel = 1
            for d in shape:
                numel *= int(d)
            cols = 1
            for d in shape[1:]:
                cols *= int(d)
            rows = numel // cols if cols else 0
            regions.append((s.source, rows, cols, s.row_begin, s.col_begin, s.row_count,
                            s.col_count, s.dest_offset, s.dest_row_stride or s.col_count))
        yield p.name, dst, regions or None
