"""expected_receipt's plain part in numpy, on the host (the host backend):
segments of many small tensors are gathered into one run of numpy
operations, large ones go through it in blocks; with a layout key the walk
through the layout (regions, salts, element indices) is kept for the next
update of the same names, dtypes and shapes."""

import collections
import operator
import threading

import numpy as np

from weightsync import _xp
from weightsync._tensors import STORAGE
from weightsync.receipts.core import KEY_HI, KEY_LO, bits32_np, layout_runs, mix32, terms32

_U32 = np.uint32
# Segments up to this many elements are gathered with others of the same
# dtype pair; larger ones are summed in blocks of BLOCK elements.
_SMALL = 1 << 16
BLOCK = 1 << 22


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
    arrays = [sent[n][2].reshape(-1) for n in names]
    lengths = np.array([a.size // ses for a in arrays], np.int64)
    elements = np.concatenate(arrays).view(f"u{ses}")
    where, index, salts = _elements_of(runs, names, lengths)
    bits = bits32_np(elements[where].view(np.uint8), src, dst)
    return int(terms32(bits, index, salts).sum(dtype=np.uint64))


def _elements_of(runs, names, lengths):
    """(source position, destination index, salt) of every element of
    `runs`, in run order, with the sources `names` (of `lengths`
    elements) concatenated: array operations, no Python loop per element
    or per run's elements."""
    where_of = {n: i for i, n in enumerate(names)}
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    t = np.array([r[1:] for r in runs], np.int64)   # rows cols rb cb rc cc dest stride s
    cols, rb, cb, rc, cc, dest, stride, salt = (t[:, k] for k in range(1, 9))
    base = starts[[where_of[r[0]] for r in runs]] + rb * cols + cb
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
    return (np.repeat(src0, n) + e, np.repeat(dst0, n) + e,
            np.repeat(salt[row_of].astype(_U32), n))


def plain_receipt(layout, sent, block=BLOCK, layout_key=None):
    """(checksum, parameters, bytes) of a layout without FP8 targets
    (weightsync.receipts.expected_receipt describes `sent` and
    `layout_key`)."""
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
    walk.params, walk.nbytes, groups = layout_runs(layout, sent)
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
    numel = []
    for n in names:
        k = 1
        for d in sent[n][1]:
            k *= int(d)
        numel.append(k)
    lengths = np.array(numel, np.int64)
    where, index, salts = _elements_of(runs, names, lengths)
    total = int(lengths.sum())
    if where.size == total and np.array_equal(where, np.arange(total, dtype=np.int64)):
        where = None   # every element once, in order: no gather
    elif total < 1 << 31:
        where = where.astype(np.int32)
    with np.errstate(over="ignore"):
        key = index.astype(_U32) * _U32(KEY_LO)
        hi = (index >> 32).astype(_U32)
        if hi.any():
            key += hi * _U32(KEY_HI)
        key += salts
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
