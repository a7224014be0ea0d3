"""Receipts, trainer side: the checksum an engine must report for an
update, computed from what was sent, mapped through the engine's segments
and converted to its dtypes (docs/protocol.md, "Receipts"; the same
function as common/checksum.h and client/receipts.cc; the vectors of
tests/vectors/receipts.json, from tools/receipt_vectors.py, bind them).

    s          = lo32(FNV-1a 64 of the name) ^ hi32(it)
    key(p, i)  = s + lo32(i) * 0x9E3779B1 + hi32(i) * 0x85EBCA77   (mod 2^32)
    mix32(x)   = y ^ (y >> 16),  y = x * 0x85EBCA6B                 (mod 2^32)
    term(p, i) = mix32(bits32(p[i]) ^ key(p, i)),  checksum = sum mod 2^64

expected_receipt: numpy, on the host (the host backend): segments of many
  small tensors are gathered into one run of numpy operations, large ones
  go through it in blocks.
expected_receipt_arrays: the same on torch tensors where they are (the
  nccl/ipc backends: on the trainer's GPU, one fused Triton kernel per
  dtype pair, weightsync.receipts_gpu; torch int64 ops without Triton), or
  on numpy arrays, which is how CI checks the torch code against
  expected_receipt.
expected_receipts_gpu: several layouts at once, on a given CUDA stream."""

import collections
import operator
import threading

import numpy as np

from weightsync import _xp
from weightsync._tensors import STORAGE

KEY_LO, KEY_HI, BITS_HI = 0x9E3779B1, 0x85EBCA77, 0x27D4EB2F
MIX = 0x85EBCA6B
_U32 = np.uint32
# Segments up to this many elements are gathered with others of the same
# dtype pair; larger ones are summed in blocks of _BLOCK elements.
_SMALL = 1 << 16
_BLOCK = 1 << 22


def parameter_salt(name):
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


def _runs(layout, sent):
    """The walk both sides make, flattened to runs of consecutive elements:
    yields (parameter count, bytes, {(src dtype, dst dtype): [runs]}) once,
    a run being (source name, source rows, source cols, row_begin,
    col_begin, rows, cols, dest_offset, dest row stride, salt32)."""
    from weightsync.planner import ELEMENT_SIZES
    groups = {}
    params = nbytes = 0
    for name, dst, regions in _regions(layout, sent):
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


def _sum_block(raw_grid, rb, cb, rc, cc, dest, stride, s, src, dst):
    """Sum of the terms of rows [rb, rb + rc) x cols [cb, cb + cc) of
    `raw_grid` (rows x cols elements as an integer numpy array)."""
    piece = np.ascontiguousarray(raw_grid[rb:rb + rc, cb:cb + cc]).reshape(-1)
    bits = bits32_np(piece.view(np.uint8), src, dst)
    index = ((dest + np.arange(rc, dtype=np.int64) * stride)[:, None]
             + np.arange(cc, dtype=np.int64)[None, :]).reshape(-1)
    return int(terms32(bits, index, s).sum(dtype=np.uint64))


def _sum_large(raw, run, src, dst, block):
    _, rows, cols, rb, cb, rc, cc, dest, stride, s = run
    ses = np.dtype(STORAGE[src]).itemsize
    grid = raw.view(f"u{ses}")[:rows * cols].reshape(rows, cols)
    total = 0
    step_c = min(cc, block)
    step_r = max(1, block // step_c)
    for r0 in range(0, rc, step_r):
        r1 = min(rc, r0 + step_r)
        for c0 in range(0, cc, step_c):
            c1 = min(cc, c0 + step_c)
            total += _sum_block(grid, rb + r0, cb + c0, r1 - r0, c1 - c0,
                                dest + r0 * stride + c0, stride, s, src, dst)
    return total


def _sum_small(sent, runs, src, dst):
    """The small runs of one dtype pair in one pass: their sources
    concatenated, every element's source position, index and salt built
    with array operations (no Python loop per element or per run's
    elements)."""
    ses = np.dtype(STORAGE[src]).itemsize
    names = list(dict.fromkeys(r[0] for r in runs))
    where = {n: i for i, n in enumerate(names)}
    arrays = [sent[n][2].reshape(-1) for n in names]
    lengths = np.array([a.size // ses for a in arrays], np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    elements = np.concatenate(arrays).view(f"u{ses}")
    t = np.array([r[1:] for r in runs], np.int64)   # rows cols rb cb rc cc dest stride s
    cols, rb, cb, rc, cc, dest, stride, salt = (t[:, k] for k in range(1, 9))
    base = starts[[where[r[0]] for r in runs]] + rb * cols + cb
    # Rows of a run that are contiguous in source and destination form one
    # row; others are expanded into one run per row.
    whole = (cc == cols) & (cc == stride)
    cc = np.where(whole, cc * rc, cc)
    rc = np.where(whole, 1, rc)
    row_of = np.repeat(np.arange(len(runs)), rc)
    r = np.arange(row_of.size, dtype=np.int64) - np.repeat(np.cumsum(rc) - rc, rc)
    src0 = base[row_of] + r * cols[row_of]
    dst0 = dest[row_of] + r * stride[row_of]
    n = cc[row_of]
    first = np.cumsum(n) - n
    e = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(first, n)
    picked = elements[np.repeat(src0, n) + e]
    bits = bits32_np(picked.view(np.uint8), src, dst)
    index = np.repeat(dst0, n) + e
    return int(terms32(bits, index, np.repeat(salt[row_of].astype(_U32), n)).sum(dtype=np.uint64))


def expected_receipt(layout, sent, block=_BLOCK, layout_key=None):
    """(checksum, parameters, bytes) for an engine registered with `layout`
    (weightsync.v1.Parameter messages) after an update that sent `sent`:
    {name: (dtype enum name, shape, flat uint8 array)}, or a Manifest's
    sent() view (weightsync._tensors: its key is the signature, its
    payloads the arrays in send order, so a repeated update builds nothing
    per tensor).

    layout_key: a hashable that names `layout` exactly (the daemon's
    EngineResult.layout_id: a new id for every registration). With it, the
    walk through the layout's segments (regions, salts, element indices,
    what depends on the layout and on the sent names, dtypes and shapes but
    not on the values) is kept for the next update that sends the same
    names, dtypes and shapes in the same order, so a repeated update costs
    a few array passes over the sent elements and no Python work per
    tensor (a mixture of experts sends 100k tensors every step). Without
    it nothing is kept.

    FP8 targets (docs/protocol.md, "FP8 targets") count what the daemon
    installs: the sent values quantised by weightsync.fp8, FP8 elements and
    the scales of the blocks written."""
    quantized = _quantized_part(layout, layout_key)
    if quantized is not None:
        plain, quant = quantized
        key = None if layout_key is None else ("plain", layout_key)
        checksum, params, nbytes = expected_receipt(plain, sent, block, key)
        from weightsync import fp8
        q_sum, q_params, q_bytes = fp8.quantized_receipt(quant, sent)
        return (checksum + q_sum) & _xp.MASK64, params + q_params, nbytes + q_bytes
    if layout_key is None:
        return _receipt_of(_build_walk(layout, sent, cache_arrays=False), sent, block)
    signature = getattr(sent, "signature", None) or _signature(sent)
    with _walks_lock:
        walk = _walks.get(layout_key)
        if walk is not None and _same_signature(walk.signature, signature):
            _walks.move_to_end(layout_key)
        else:
            walk = None
    if walk is None:
        walk = _build_walk(layout, sent, cache_arrays=True)
        walk.signature = signature
        with _walks_lock:
            _walks[layout_key] = walk
            _walks.move_to_end(layout_key)
            while len(_walks) > _WALKS_KEPT:
                _walks.popitem(last=False)
    return _receipt_of(walk, sent, block)


# layout_key -> (plain parameters, FP8 targets) or None, for the last few
# layouts (the split is a pass over every parameter).
_SPLITS = collections.OrderedDict()


def _quantized_part(layout, layout_key):
    """(plain parameters, FP8 targets) of a layout with FP8 targets, None
    for one without (weightsync.fp8.split_layout; kept by layout_key)."""
    if layout_key is not None:
        with _walks_lock:
            if layout_key in _SPLITS:
                return _SPLITS[layout_key]
    if any(p.HasField("quantization") for p in layout):
        from weightsync import fp8
        plain, quant, _ = fp8.split_layout(layout)
        split = (plain, quant)
    else:
        split = None
    if layout_key is not None:
        with _walks_lock:
            _SPLITS[layout_key] = split
            while len(_SPLITS) > _WALKS_KEPT:
                _SPLITS.popitem(last=False)
    return split


# Walks kept by expected_receipt (layout_key -> _Walk), least recently used
# first, and how many elements of small runs a walk may hold precomputed
# keys and positions for (12 bytes each at most).
_WALKS_KEPT = 8
_CACHED_ELEMENTS = 1 << 24
_walks = collections.OrderedDict()
_walks_lock = threading.Lock()
_get0, _get1, _get2 = (operator.itemgetter(i) for i in range(3))


class _Walk:
    """What expected_receipt needs of a layout for one manifest (names,
    dtypes and shapes, in send order): the parameter and byte counts, the
    large runs, and per (src, dst) dtype pair of the small runs either the
    runs themselves or, precomputed, which sent tensors they read (`take`:
    positions in send order), where in those tensors' concatenated
    elements (`where`: None when in order, every element once) and the
    key of every element (key(p, i) of the receipt function)."""

    __slots__ = ("signature", "params", "nbytes", "large", "small", "fast")

    def __init__(self):
        self.signature = None
        self.large, self.small, self.fast = [], [], []


def _signature(sent):
    vals = tuple(sent.values())
    return (tuple(sent), tuple(map(_get0, vals)), list(map(_get1, vals)))


def _same_signature(a, b):
    # Names and dtypes compare by identity first (the same str objects
    # every step); shapes may be new lists or tuples of the same values.
    if a is b:
        return True
    if a[0] != b[0] or a[1] != b[1]:
        return False
    if a[2] == b[2]:
        return True
    return all(map(_same_shape, a[2], b[2]))


def _same_shape(x, y):
    return tuple(x) == tuple(y)


def _build_walk(layout, sent, cache_arrays):
    walk = _Walk()
    walk.params, walk.nbytes, groups = _runs(layout, sent)
    order = {n: i for i, n in enumerate(sent)} if cache_arrays else None
    budget = _CACHED_ELEMENTS
    for (src, dst), runs in groups.items():
        small = []
        for r in runs:
            if r[5] * r[6] > _SMALL:
                walk.large.append((src, dst, r))
            else:
                small.append(r)
        if not small:
            continue
        count = sum(r[5] * r[6] for r in small)
        if cache_arrays and count <= budget:
            budget -= count
            walk.fast.append(_precompute_small(sent, small, src, dst, order))
        else:
            walk.small.append((src, dst, small))
    return walk


def _precompute_small(sent, runs, src, dst, order):
    """(src, dst, take, sizes, where, key) of `runs` (see _Walk): the
    index arithmetic of _sum_small done once."""
    ses = np.dtype(STORAGE[src]).itemsize
    names = list(dict.fromkeys(r[0] for r in runs))
    where_of = {n: i for i, n in enumerate(names)}
    numel = []
    for n in names:
        k = 1
        for d in sent[n][1]:
            k *= int(d)
        numel.append(k)
    lengths = np.array(numel, np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    t = np.array([r[1:] for r in runs], np.int64)   # rows cols rb cb rc cc dest stride s
    cols, rb, cb, rc, cc, dest, stride, salt = (t[:, k] for k in range(1, 9))
    base = starts[[where_of[r[0]] for r in runs]] + rb * cols + cb
    whole = (cc == cols) & (cc == stride)
    cc = np.where(whole, cc * rc, cc)
    rc = np.where(whole, 1, rc)
    row_of = np.repeat(np.arange(len(runs)), rc)
    r = np.arange(row_of.size, dtype=np.int64) - np.repeat(np.cumsum(rc) - rc, rc)
    src0 = base[row_of] + r * cols[row_of]
    dst0 = dest[row_of] + r * stride[row_of]
    n = cc[row_of]
    first = np.cumsum(n) - n
    e = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(first, n)
    where = np.repeat(src0, n) + e
    total = int(lengths.sum())
    if where.size == total and np.array_equal(where, np.arange(total, dtype=np.int64)):
        where = None   # every element once, in order: no gather
    elif total < 1 << 31:
        where = where.astype(np.int32)
    index = np.repeat(dst0, n) + e
    with np.errstate(over="ignore"):
        key = index.astype(_U32) * _U32(KEY_LO)
        hi = (index >> 32).astype(_U32)
        if hi.any():
            key += hi * _U32(KEY_HI)
        key += np.repeat(salt[row_of].astype(_U32), n)
    take = tuple(order[nm] for nm in names)
    if take == tuple(range(len(sent))):
        take = None   # every sent tensor, in send order
    return (src, dst, take, total * ses, where, key)


def _receipt_of(walk, sent, block):
    total = 0
    for src, dst, run in walk.large:
        total += _sum_large(sent[run[0]][2], run, src, dst, block)
    for src, dst, runs in walk.small:
        total += _sum_small(sent, runs, src, dst)
    if walk.fast:
        gather = getattr(sent, "gather", None)
        payloads = getattr(sent, "payloads", None)
        if payloads is None:
            payloads = tuple(map(_get2, sent.values()))
        for entry in walk.fast:
            total += (_sum_gathered(gather, *entry) if gather is not None
                      else _sum_precomputed(payloads, *entry))
    return total & _xp.MASK64, walk.params, walk.nbytes


def _sum_precomputed(payloads, src, dst, take, nbytes, where, key):
    if take is not None:
        payloads = operator.itemgetter(*take)(payloads) if len(take) > 1 else \
            (payloads[take[0]],)
    raw = np.concatenate(payloads) if len(payloads) != 1 else np.asarray(payloads[0])
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    if raw.size != nbytes:
        raise ValueError(f"receipts: the sent tensors hold {raw.size} bytes, their shapes "
                         f"{nbytes}")
    ses = np.dtype(STORAGE[src]).itemsize
    if where is not None:
        raw = raw.view(f"u{ses}")[where].view(np.uint8)
    bits = bits32_np(raw, src, dst)
    bits ^= key
    return int(mix32(bits).sum(dtype=np.uint64))


def _sum_gathered(gather, src, dst, take, nbytes, where, key):
    """_sum_precomputed over tensors that all live in one buffer
    (weightsync.host_source): their elements are read with one index into
    it, built once per walk entry and kept in gather.cache, instead of
    joining the payloads."""
    ses = np.dtype(STORAGE[src]).itemsize
    hit = gather.cache.get(id(key))
    if hit is None or hit[0] is not key:
        sel = np.arange(len(gather.offsets)) if take is None else np.asarray(take, np.int64)
        if np.any(gather.offsets[sel] % ses):
            raise ValueError("receipts: a tensor is not aligned to its element size")
        counts = gather.nbytes[sel] // ses
        if int(counts.sum()) * ses != nbytes:
            raise ValueError(f"receipts: the sent tensors hold {int(counts.sum()) * ses} "
                             f"bytes, their shapes {nbytes}")
        first = np.cumsum(counts) - counts
        index = (np.repeat(gather.offsets[sel] // ses - first, counts)
                 + np.arange(int(counts.sum()), dtype=np.int64))
        if where is not None:
            index = index[where]
        if index.size and int(index[-1]) < 1 << 31 and int(index.max()) < 1 << 31:
            index = index.astype(np.int32)
        hit = gather.cache[id(key)] = (key, index)
    elements = gather.u8[:gather.u8.size // ses * ses].view(f"u{ses}")
    raw = elements[hit[1]].view(np.uint8)
    bits = bits32_np(raw, src, dst)
    bits ^= key
    return int(mix32(bits).sum(dtype=np.uint64))


# --- The same function on torch tensors (on their GPU) or numpy arrays ----
#
# Written once with operators numpy int64 arrays and torch int64 tensors
# share (weightsync._xp): it is the GPU's fallback where Triton is missing
# (weightsync.receipts_gpu is the fast path); in CI the numpy run of this
# very code is checked bit for bit against expected_receipt above. 32-bit
# values live in int64 lanes: products of two of them are exact mod 2^64,
# masked back to 32 bits.

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
    tensor or a numpy array of the dtype's storage type
    (weightsync._tensors.STORAGE). CUDA tensors, no `ops`, Triton present:
    the fused kernel (weightsync.receipts_gpu) on the current stream;
    otherwise int64 array ops (`block` elements at a time) with `ops` or
    those of the data. Returns (checksum, parameters, bytes). FP8 targets
    (a GPU engine's, quantised by the daemon on its GPU): the rest of the
    layout as above, the quantised parameters by weightsync.fp8 where the
    tensors that feed them are: torch ops on their GPU for CUDA tensors,
    numpy (on host copies) otherwise."""
    if has_fp8(layout):
        from weightsync import fp8
        plain, quant, _ = fp8.split_layout(layout)
        checksum, params, nbytes = expected_receipt_arrays(plain, sent, ops, block)
        q_sum, q_params, q_bytes = quantized_where_sent(quant, sent)
        return (checksum + q_sum) & _xp.MASK64, params + q_params, nbytes + q_bytes
    if ops is None and all_cuda(sent):
        from weightsync import receipts_gpu
        if receipts_gpu.available():
            return receipts_gpu.expected_receipts_gpu({0: layout}, sent)[0]
    return _receipt_by_ops(layout, sent, ops, block)


def has_fp8(layout):
    """True if `layout` has FP8 targets (docs/protocol.md, "FP8 targets")."""
    return any(p.HasField("quantization") for p in layout)


def quantized_where_sent(quantized, sent):
    """weightsync.fp8.quantized_receipt of FP8 targets where their sources
    are: a parameter whose sent sources are all CUDA tensors of one device
    is quantised and summed there by the fused Triton kernel
    (weightsync.fp8_gpu) where Triton is present and WEIGHTSYNC_FP8_TRITON
    is not "0", else (and for what its tables can't express) with torch ops
    (the same code as numpy's, bit for bit the same sums); the others by
    numpy on host copies."""
    from weightsync import fp8
    on_gpu, on_host, acc = [], [], []
    for p in quantized:
        feeds = [sent[n][2] for n in fp8._sources(p) if n in sent]
        if not feeds:
            continue
        cuda = all(_xp.is_torch(e) and e.is_cuda for e in feeds)
        (on_gpu if cuda and len({e.device for e in feeds}) == 1 else on_host).append(p)
    total, params, nbytes = fp8.quantized_receipt(on_host, _on_host(on_host, sent))
    if on_gpu:
        on_gpu = _quantized_by_triton(on_gpu, sent, acc.append)
        for g_sum, g_params, g_bytes in acc:
            total, params, nbytes = total + g_sum, params + g_params, nbytes + g_bytes
    if on_gpu:
        g_sum, g_params, g_bytes = fp8.quantized_receipt(on_gpu, sent, ops=_xp.TorchOps())
        total, params, nbytes = total + g_sum, params + g_params, nbytes + g_bytes
    return total & _xp.MASK64, params, nbytes


_fp8_triton_failed = []


def fp8_triton_failed():
    """The failures of the fused FP8 receipt kernel so far (repr of each);
    once it failed, the torch path takes its work. The list itself: a
    check may clear it."""
    return _fp8_triton_failed


def note_fp8_triton_failure(error):
    """Records that the fused FP8 receipt kernel failed with `error`."""
    _fp8_triton_failed.append(repr(error))


def _quantized_by_triton(quantized, sent, add):
    """The fused kernel (weightsync.fp8_gpu) for FP8 targets fed by CUDA
    tensors, one device at a time, where Triton is present and
    WEIGHTSYNC_FP8_TRITON is not "0": add((sum, parameters, bytes)) for
    what it summed; returns the parameters left for the torch path (those
    its tables can't express, or all of them if the kernel failed: then a
    warning, once, and the torch path from then on)."""
    from weightsync import fp8, fp8_gpu
    if _fp8_triton_failed or not fp8_gpu.enabled():
        return quantized
    by_device = collections.OrderedDict()
    for p in quantized:
        device = next(sent[n][2].device for n in fp8._sources(p) if n in sent)
        by_device.setdefault(device, []).append(p)
    rest = []
    for device, params in by_device.items():
        try:
            import torch
            with torch.cuda.device(device):
                total, n, nbytes, left = fp8_gpu.quantized_receipt_gpu(params, sent)
        except Exception as e:  # noqa: BLE001 - the torch path is exact too
            import warnings
            warnings.warn(f"weightsync: the FP8 receipt kernel failed ({e!r}); "
                          "using the torch path")
            _fp8_triton_failed.append(repr(e))
            rest += params
            continue
        add((total, n, nbytes))
        rest += left
    return rest


def _on_host(quantized, sent):
    """The entries of `sent` that feed the quantised parameters, their
    elements as numpy arrays (torch tensors, CUDA ones too, copied)."""
    names = set()
    for p in quantized:
        names.update([s.source for s in p.segments] or [p.name])
    out = {}
    for name in names:
        if name not in sent:
            continue
        dtype, shape, elements = sent[name][:3]
        if _xp.is_torch(elements):
            import torch
            flat = elements.detach().contiguous().reshape(-1)
            elements = flat.view(torch.uint8).cpu().numpy()
        out[name] = (dtype, shape, elements)
    return out


def all_cuda(sent):
    """True if every entry of `sent` is a CUDA tensor."""
    return bool(sent) and all(_xp.is_torch(e) and e.is_cuda for _, _, e in sent.values())


def _receipt_by_ops(layout, sent, ops, block):
    from weightsync.planner import ELEMENT_SIZES
    total, params, nbytes = 0, 0, 0
    for name, dst, regions in _regions(layout, sent):
        if regions is None:
            continue
        esize = ELEMENT_SIZES[dst]
        salt = salt32(name)
        for source, rows, cols, rb, cb, rc, cc, dest, stride in regions:
            src_dtype, _, elements = sent[source]
            o = ops or _xp.ops_for(elements)
            nbytes += rc * cc * esize
            if rc * cc == 0:
                continue
            if rows * cols != elements.shape[0]:
                elements = elements[:rows * cols]   # an unsegmented parameter
            grid = elements.reshape(rows, cols)
            acc = 0
            step_c = min(cc, block)
            step_r = max(1, block // step_c)
            for r0 in range(0, rc, step_r):
                r1 = min(rc, r0 + step_r)
                for c0 in range(0, cc, step_c):
                    c1 = min(cc, c0 + step_c)
                    piece = grid[rb + r0:rb + r1, cb + c0:cb + c1].reshape(-1)
                    bits = bits32_of(convert_element_bits(o, piece, src_dtype, dst),
                                     ESIZE[dst])
                    index = (dest + c0 + (o.arange(r1 - r0, like=piece)[:, None] + r0) * stride
                             + o.arange(c1 - c0, like=piece)[None, :]).reshape(-1)
                    key = (salt + (index & M32) * KEY_LO + _xp.shr(index, 32) * KEY_HI) & M32
                    # Terms are < 2^32: an int64 sum of a block (<= 2^31
                    # elements) can't overflow.
                    acc += o.to_int(mix32_bits(bits ^ key).sum())
            total = (total + acc) & _xp.MASK64
        params += 1
    return total, params, nbytes


def expected_receipts_gpu(layouts, sent, stream=None):
    """{key: (checksum, parameters, bytes)} for every layout of `layouts`
    ({key: weightsync.v1.Parameter messages}) from `sent` (torch CUDA
    tensors, as expected_receipt_arrays takes them), on `stream` (a
    torch.cuda.Stream; None: the current one). See weightsync.receipts_gpu."""
    from weightsync import receipts_gpu
    return receipts_gpu.expected_receipts_gpu(layouts, sent, stream)
