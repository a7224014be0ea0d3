"""Receipts, trainer side: the checksum an engine must report for an
update, computed from what was sent, mapped through the engine's segments
and converted to its dtypes (docs/protocol.md, "Receipts"; the same
function as common/checksum.h and client/receipts.cc).

expected_receipt: numpy, on the host (the host backend).
expected_receipt_arrays: the same on torch tensors where they are (the
nccl/ipc backends: on the trainer's GPU, int64 torch ops), or on numpy
arrays, which is how CI checks it against expected_receipt."""

import numpy as np

from weightsync import _xp
from weightsync._tensors import STORAGE

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x):
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def parameter_salt(name):
    h = 0xCBF29CE484222325
    for c in name.encode():
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return np.uint64(h)


def _to_float32(raw, dtype):
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
    f = _to_float32(raw, src)
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


def expected_receipt(layout, sent):
    """(checksum, parameters, bytes) for an engine registered with `layout`
    (weightsync.v1.Parameter messages) after an update that sent `sent`:
    {name: (dtype enum name, shape, flat uint8 array)}."""
    from weightsync._proto import v1
    total = np.uint64(0)
    params = nbytes = 0
    for p in layout:
        dst = v1.enum_name("DType", p.dtype)
        esize = np.dtype(STORAGE[dst]).itemsize
        salt = parameter_salt(p.name)
        segments = list(p.segments)
        if not segments and p.name in sent:
            n = int(np.prod(p.shape)) if len(p.shape) else 1
            segments = [None]
        touched = False
        for s in segments:
            if s is None:
                src_dtype, _, raw = sent[p.name]
                src_idx = np.arange(n, dtype=np.int64)
                dst_idx = src_idx
            else:
                if s.source not in sent:
                    continue
                src_dtype, shape, raw = sent[s.source]
                cols = int(np.prod(shape[1:])) if len(shape) > 1 else 1
                stride = s.dest_row_stride or s.col_count
                r = np.arange(s.row_count, dtype=np.int64)[:, None]
                c = np.arange(s.col_count, dtype=np.int64)[None, :]
                src_idx = ((s.row_begin + r) * cols + s.col_begin + c).reshape(-1)
                dst_idx = (s.dest_offset + r * stride + c).reshape(-1)
            ses = np.dtype(STORAGE[src_dtype]).itemsize
            picked = raw.reshape(-1, ses)[src_idx].reshape(-1)
            bits = convert_bits(picked, src_dtype, dst)
            with np.errstate(over="ignore"):
                terms = _splitmix(((salt + dst_idx.astype(np.uint64)) * _GOLDEN) ^ bits)
                total = total + terms.sum(dtype=np.uint64)
            nbytes += len(dst_idx) * esize
            touched = True
        params += touched
    return int(total), params, nbytes


# --- The same function on torch tensors (on their GPU) or numpy arrays ----
#
# Written once with operators numpy int64 arrays and torch int64 tensors
# share (weightsync._xp): on a GPU it runs as torch ops where the tensors
# are; in CI the numpy run of this very code is checked bit for bit
# against expected_receipt above.

_G = _xp.signed64(0x9E3779B97F4A7C15)
_M1 = _xp.signed64(0xBF58476D1CE4E5B9)
_M2 = _xp.signed64(0x94D049BB133111EB)
_FLOATS = ("FLOAT32", "BFLOAT16", "FLOAT16")


def splitmix_bits(x):
    """splitmix64 of int64 bits (same bits as the uint64 function)."""
    x = x + _G
    x = (x ^ _xp.shr(x, 30)) * _M1
    x = (x ^ _xp.shr(x, 27)) * _M2
    return x ^ _xp.shr(x, 31)


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


def _regions(layout, sent):
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


def expected_receipt_arrays(layout, sent, ops=None, block=1 << 22):
    """expected_receipt computed where the data is: `sent` maps a name to
    (dtype enum name, shape, flat elements) with the elements a torch
    tensor (computed on its device with torch int64 ops, `block` elements
    at a time) or a numpy array of the dtype's storage type
    (weightsync._tensors.STORAGE). Returns (checksum, parameters, bytes)."""
    from weightsync.planner import ELEMENT_SIZES
    total, params, nbytes = 0, 0, 0
    for name, dst, regions in _regions(layout, sent):
        if regions is None:
            continue
        esize = ELEMENT_SIZES[dst]
        salt = _xp.signed64(int(parameter_salt(name)))
        for source, rows, cols, rb, cb, rc, cc, dest, stride in regions:
            src_dtype, _, elements = sent[source]
            o = ops or _xp.ops_for(elements)
            nbytes += rc * cc * esize
            if rc * cc == 0:
                continue
            if rows * cols != elements.shape[0]:
                elements = elements[:rows * cols]   # an unsegmented parameter
            grid = elements.reshape(rows, cols)
            lo = hi = 0
            step_c = min(cc, block)
            step_r = max(1, block // step_c)
            for r0 in range(0, rc, step_r):
                r1 = min(rc, r0 + step_r)
                for c0 in range(0, cc, step_c):
                    c1 = min(cc, c0 + step_c)
                    piece = grid[rb + r0:rb + r1, cb + c0:cb + c1].reshape(-1)
                    bits = convert_element_bits(o, piece, src_dtype, dst)
                    index = (dest + c0 + (o.arange(r1 - r0, like=piece)[:, None] + r0) * stride
                             + o.arange(c1 - c0, like=piece)[None, :]).reshape(-1)
                    terms = splitmix_bits(((index + salt) * _G) ^ bits)
                    # Sum mod 2^64 in two 32-bit halves: no int64 overflow in
                    # the reductions (block <= 2^30 elements).
                    lo = lo + (terms & _xp.MASK32).sum()
                    hi = (hi + _xp.shr(terms, 32).sum() + _xp.shr(lo, 32)) & _xp.MASK32
                    lo = lo & _xp.MASK32
            total = (total + o.to_int(lo) + (o.to_int(hi) << 32)) & _xp.MASK64
        params += 1
    return total, params, nbytes
