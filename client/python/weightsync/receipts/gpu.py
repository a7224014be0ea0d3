"""Receipts on the trainer's GPU: one fused Triton kernel per (source
dtype, engine dtype) pair reads every sent element an engine's segments
cover, converts its bits as common/dtype.cc does, and adds its term
(docs/protocol.md, "Receipts") to one 64-bit sum per layout. The numpy
expected_receipt (weightsync.receipts) is the spec;
tests/gpu/check_receipts_gpu.py checks this kernel against it on a GPU and
prints its GB/s.

The region table (one row per segment, int64): source address (the
segment's first element), source row stride (elements), rows, cols,
salt32, first destination index, destination row stride (elements),
group (the layout's slot in the output), rows per tile, chunks per row,
first tile, aligned (address and row stride in bytes are multiples of
16). Rows contiguous in source and destination are merged into one row.
A tile is up to TILE elements: a run of ITERS blocks of BLOCK columns of
one row (wide rows), or ITERS * (BLOCK // cols) whole rows (narrow ones).
Programs take one tile each and add their sum to their group's slot with
one atomic.

Speed: the work per element is a handful of 32-bit integer operations
(v3's mix32: one multiply and one xorshift, where v2's fmix32 took two
multiplies and three xorshifts and left the kernel bound by integer
work), so the kernel is meant to cost one read of the bytes. Blocks of an
aligned region of 2- or 4-byte elements that are whole and whose indices
share their high 32 bits take the fast path: unmasked 16-byte loads of
32-bit words (bfloat16 pairs split with shifts), the index key as a 32-bit
lane constant plus one per-block scalar. Everything else (row tails,
unaligned or narrow segments, 1- and 8-byte elements, a tile whose
indices cross 2^32) takes the general masked path with 64-bit indices.
Runs of at most SMALL_E elements (a mixture of experts' 100k tiny
tensors) go to a second kernel instead, SMALL_K of them per program as a
[K, E] block of lanes (one program each cost ~6 ms for 100k on an H100).
Measured on one H200 with v2: Qwen3-8B's 16.4 GB in 7.3 ms (2.25 TB/s;
the previous kernel 16.7 ms), not yet one read (~4 ms). On one H100
(2026-11-25, check_receipts_gpu.py, both on the same machine): kernel
7.30 ms with v2, 6.66 ms with v3, still not one read (~5 ms there). With
v2 the kernel compiled to 255 registers with spills, the general paths'
BLOCK-wide int64 tensors setting the allocation the fast loop runs under
(2 CTAs of 4 warps per SM). Giving those paths a narrower block is the next step;
CHECK_RECEIPTS_TUNE=1 tests/gpu/check_receipts_gpu.py prints registers,
spills and the speed of other shapes.

The table of a call is kept on the device, keyed by the layouts' identity
and (name, dtype, address, shape) of every sent tensor, so a repeated call
with the same tensors (every update of a training run) builds nothing and
copies nothing to the device: it launches and waits. Layouts are taken as
immutable while cached (the trainer keeps them by layout_id the same way).

Triton is imported lazily; without it `available()` is False and callers
use the torch fallback (weightsync.receipts.arrays.receipt_by_ops).
"""

import collections
import threading

import numpy as np

from weightsync import _xp
from weightsync.receipts.core import ESIZE, layout_runs

BLOCK = 4096      # elements of one step of a program
ITERS = 16        # steps of one tile
NUM_WARPS = 2      # measured on one H100 with v3: 5.9 ms for Qwen3-8B against 6.7 with 4
SPLIT = True      # fast path: uint32 sums of the terms' halves (fewer operations)
REL = True        # fast path: addresses as offsets from a kernel argument
_DTYPES = {"FLOAT32": 0, "BFLOAT16": 1, "FLOAT16": 2}
_COLS = 12
SMALL_K = 64      # small regions per program of the small-region kernel
SMALL_E = 64      # elements of a small region at most (one row of the program)
_PLANS = 8        # cached tables (distinct layout sets x tensor sets)

_kernel = None
_checked = None
_plans = collections.OrderedDict()
compiled = {}     # (src, dst) -> the last launched kernel (registers, PTX: for tests)
_lock = threading.Lock()


def available():
    """Whether Triton can be imported (once per process)."""
    global _checked
    if _checked is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
            _checked = True
        except Exception:  # noqa: BLE001 - any import failure means no Triton
            _checked = False
    return _checked


def configure(block=None, iters=None, num_warps=None, split=None, rel=None):
    """Sets the tile shape and fast-path variants (tuning;
    tests/gpu/check_receipts_gpu.py) and drops the cached tables built for
    the previous ones."""
    global BLOCK, ITERS, NUM_WARPS, SPLIT, REL
    with _lock:
        BLOCK = block or BLOCK
        ITERS = iters or ITERS
        NUM_WARPS = num_warps or NUM_WARPS
        SPLIT = SPLIT if split is None else split
        REL = REL if rel is None else rel
        _plans.clear()


def _build():
    """The kernels (compiled by Triton at their first launch)."""
    from weightsync.receipts import gpu_kernels
    return gpu_kernels.receipt_kernel, gpu_kernels.small_kernel


def _raw_dtype(es):
    import triton.language as tl
    return {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}[es]


def _tiles(rows, cols, block=None, iters=None):
    """(rows per tile, chunks per row, tiles) of a region (numpy arrays)."""
    block, iters = block or BLOCK, iters or ITERS
    narrow = cols <= block // 2   # at least two rows per step (the kernel's test)
    rpt = np.where(narrow, block // np.maximum(cols, 1), 1)
    cpr = np.where(narrow, 1, (cols + block * iters - 1) // (block * iters))
    tiles = np.where(narrow, (rows + rpt * iters - 1) // (rpt * iters), rows * cpr)
    return rpt, cpr, tiles


def _split_small(rows_out):
    """(the other runs, the small-region table or None) of one dtype pair's
    runs: a run that is one row of at most SMALL_E elements (or whole rows
    as contiguous in source and destination, merged) goes to the small
    kernel's table, int64 rows (address, cols, salt32, first destination
    index, group), sorted by group and padded with empty rows so that
    every SMALL_K rows share one group. Pure numpy (tested in CI)."""
    if not rows_out:
        return rows_out, None
    t = np.array(rows_out, dtype=np.uint64).view(np.int64).reshape(-1, 8)
    addr, sstride, rc, cc, salt, dest, dstride, group = (t[:, k] for k in range(8))
    whole = (cc == sstride) & (cc == dstride)
    n = np.where(whole, cc * rc, np.where(rc == 1, cc, SMALL_E + 1))
    small = (n <= SMALL_E) & (n > 0)
    if not small.any():
        return rows_out, None
    idx = np.flatnonzero(small)
    idx = idx[np.argsort(group[idx], kind="stable")]
    pieces = []
    for g in np.unique(group[idx]):
        sel = idx[group[idx] == g]
        rows = np.zeros(((len(sel) + SMALL_K - 1) // SMALL_K * SMALL_K, 5), np.int64)
        rows[:, 4] = g
        rows[:len(sel), 0] = addr[sel]
        rows[:len(sel), 1] = n[sel]
        rows[:len(sel), 2] = salt[sel]
        rows[:len(sel), 3] = dest[sel]
        pieces.append(rows)
    rest = [r for r, is_small in zip(rows_out, small.tolist()) if not is_small]
    return rest, np.concatenate(pieces)


def _table(rows_out, es, block, iters):
    """(region table, tile -> region) of one dtype pair's regions."""
    t = np.array(rows_out, dtype=np.uint64).view(np.int64).reshape(-1, 8)
    addr, sstride, rc, cc, salt, dest, dstride, group = (t[:, k] for k in range(8))
    whole = (cc == sstride) & (cc == dstride)
    cc = np.where(whole, cc * rc, cc)
    rc = np.where(whole, 1, rc)
    rpt, cpr, tiles = _tiles(rc, cc, block, iters)
    first = np.cumsum(tiles) - tiles
    aligned = ((es in (2, 4)) & (addr % 16 == 0)
               & ((rc == 1) | (sstride * es % 16 == 0))).astype(np.int64)
    table = np.stack([addr, sstride, rc, cc, salt, dest, dstride, group, rpt, cpr, first,
                      aligned], axis=1)
    return table, np.repeat(np.arange(len(t), dtype=np.int32), tiles)


class _Plan:
    """What a call needs on the device: launches (dtype pair, table and
    tile views of one device buffer, tiles) and the counts per layout."""

    def __init__(self, layouts, counts, launches, device, buffer):
        self.layouts = layouts    # held: their ids are part of the key
        self.counts = counts
        self.launches = launches
        self.device = device
        self.buffer = buffer


def _plan(keys, layouts, sent, block, iters):
    import torch
    per_pair = {}
    counts = {}
    device = None
    for g, key in enumerate(keys):
        params, nbytes, groups = layout_runs(layouts[key], sent)
        counts[key] = (params, nbytes)
        for (src, dst), runs in groups.items():
            if src != dst and (src not in _DTYPES or dst not in _DTYPES):
                raise ValueError(f"can't convert {src} to {dst}")
            es = ESIZE[src]
            rows_out = per_pair.setdefault((src, dst), [])
            for name, _rows, cols, rb, cb, rc, cc, dest, stride, s in runs:
                t = sent[name][2]
                device = t.device
                rows_out.append((t.data_ptr() + (rb * cols + cb) * es, cols, rc, cc, s, dest,
                                 stride, g))
    # One host buffer, one copy: each pair's table then its tile list
    # (int32 pairs as int64), every part at a 16-byte boundary.
    parts, launches, offset = [], [], 0
    for (src, dst), rows_out in per_pair.items():
        es = ESIZE[src]
        rows_out, small = _split_small(rows_out)
        if small is not None:
            launches.append((src, dst, offset, small.size, -1, 0, small.shape[0] // SMALL_K))
            parts.append(small.reshape(-1))
            offset += small.size
        if not rows_out:
            continue
        table, tile_region = _table(rows_out, es, block, iters)
        if tile_region.size == 0:
            continue
        tiles64 = np.zeros((tile_region.size + 3) // 4 * 2, np.int64)
        tiles64.view(np.int32)[:tile_region.size] = tile_region
        table = table.reshape(-1)
        pad = np.zeros(table.size % 2, np.int64)
        launches.append((src, dst, offset, table.size, offset + table.size + pad.size,
                         tiles64.size, int(tile_region.size)))
        parts += [table, pad, tiles64]
        offset += table.size + pad.size + tiles64.size
    buffer = None
    views = []
    if parts:
        buffer = torch.from_numpy(np.concatenate(parts)).to(device)
        for src, dst, t0, tn, r0, rn, ntiles in launches:
            views.append((src, dst, buffer[t0:t0 + tn],
                          None if r0 < 0 else buffer[r0:r0 + rn].view(torch.int32), ntiles))
    return _Plan([layouts[k] for k in keys], counts, views, device, buffer)


def _cached_plan(keys, layouts, sent):
    key = (tuple((k, id(layouts[k])) for k in keys),
           tuple((n, e[0], e[2].data_ptr(), tuple(e[1])) for n, e in sent.items()),
           BLOCK, ITERS)
    return _plan_for(key, lambda: _plan(keys, layouts, sent, BLOCK, ITERS))


def _keyed_plan(keys, layouts, sent, plan_key):
    return _plan_for(("keyed", plan_key, tuple(keys), BLOCK, ITERS),
                     lambda: _plan(keys, layouts, sent() if callable(sent) else sent, BLOCK,
                                   ITERS))


def _plan_for(key, build):
    """The plan kept under `key` (the last _PLANS kept), else build()'s."""
    with _lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
            return plan
    plan = build()
    with _lock:
        _plans[key] = plan
        while len(_plans) > _PLANS:
            _plans.popitem(last=False)
    return plan


def expected_receipts_gpu(layouts, sent, stream=None, plan_key=None, keep=True):
    """{key: (checksum, parameters, bytes)} for each layout in `layouts`
    ({key: weightsync.v1.Parameter messages}), from `sent` ({name: (dtype
    enum name, shape, flat torch CUDA tensor of the dtype's elements, or
    int16 for bfloat16)}, or a function returning it), enqueued on `stream`
    (None: the current stream) and waited for. One launch per (source
    dtype, engine dtype) pair over every layout; the tables are cached
    (module docstring): by what `sent` and the layouts hold, or by
    `plan_key` when given, a hashable the caller guarantees changes
    whenever the layouts, names, dtypes, shapes or data pointers do (then
    `sent` is not even built for a cached plan: a 100k-tensor update pays
    nothing per tensor). keep=False (without plan_key): build the tables
    for this call only and cache nothing (a lazy update sums each tensor
    once as it is made: weightsync.lazy.ProgressiveReceipts). The tensors
    must not change until it returns."""
    import torch
    global _kernel
    if _kernel is None:
        _kernel = _build()
    keys = list(layouts)
    block, iters, num_warps = BLOCK, ITERS, NUM_WARPS
    if plan_key is None and not keep:
        plan = _plan(keys, layouts, sent() if callable(sent) else sent, block, iters)
    elif plan_key is None:
        plan = _cached_plan(keys, layouts, sent() if callable(sent) else sent)
    else:
        plan = _keyed_plan(keys, layouts, sent, plan_key)
    stream = stream or torch.cuda.current_stream(plan.device)
    with torch.cuda.stream(stream):
        out = torch.zeros(max(len(keys), 1), dtype=torch.int64, device=plan.device)
        for src, dst, table_d, tiles_d, ntiles in plan.launches:
            es = ESIZE[src]
            s, d = _DTYPES.get(src, -1 - es), _DTYPES.get(dst, -1 - es)
            if tiles_d is None:   # small regions, SMALL_K a program
                compiled[(src, dst, "small")] = _kernel[1][(ntiles,)](
                    table_d, out, SRC=s, DST=d, ES=es, RAW=_raw_dtype(es), K=SMALL_K,
                    E=SMALL_E, num_warps=4)
                continue
            compiled[(src, dst)] = _kernel[0][(ntiles,)](
                table_d, tiles_d, out, SRC=s, DST=d, ES=es, RAW=_raw_dtype(es), BLOCK=block,
                ITERS=iters, WORDS=block * es // 4, FAST=es in (2, 4), SPLIT=SPLIT,
                REL=REL, num_warps=num_warps)
        sums = out.tolist()   # waits for the stream
    return {key: (sums[g] & _xp.MASK64,) + plan.counts[key]
            for g, key in enumerate(keys)}


def warm(pairs, device):
    """Compiles (or loads from Triton's on-disk cache) and runs once both
    kernels for each (source dtype, engine dtype) of `pairs` on CUDA
    `device`, over a few synthetic elements, so that the first update's
    receipts pay no compilation (issue 30: 4.8 s of a first update against
    24 ms steady). The kernels specialise on the dtypes and the module's
    tile constants only (tables and outputs are device allocations, aligned
    alike), so a small table compiles exactly what a large one launches.
    Pairs this module can't take are skipped. Returns the pairs warmed."""
    import torch
    from weightsync._proto import v1
    torch_of = {"FLOAT32": torch.float32, "FLOAT16": torch.float16, "BFLOAT16": torch.int16}
    done = []
    for src, dst in pairs:
        if src not in _DTYPES or dst not in _DTYPES:
            continue
        # One run above SMALL_E (the tile kernel), one below (the small one).
        sizes = {"w_tiles": 1 << 16, "w_small": SMALL_E // 2}
        params = [v1.Parameter(name=n, dtype=getattr(v1, dst), shape=[k])
                  for n, k in sizes.items()]
        sent = {n: (src, [k], torch.zeros(k, dtype=torch_of[src], device=device))
                for n, k in sizes.items()}
        expected_receipts_gpu({"warm": params}, sent, keep=False)
        done.append((src, dst))
    return done
