"""Receipts on the trainer's GPU: one fused Triton kernel per (source
dtype, engine dtype) pair reads every sent element an engine's segments
cover, converts its bits as common/dtype.cc does, and adds its term
(docs/protocol.md, "Receipts") to one 64-bit sum per layout. The numpy
expected_receipt (weightsync.receipts) is the spec;
tests/gpu/check_receipts_gpu.py checks this kernel against it on a GPU.

The region table (one row per segment, int64): source address (the
segment's first element), source row stride (elements), rows, cols,
salt32, first destination index, destination row stride (elements),
group (the layout's slot in the output), rows per tile, chunks per row,
first tile. A tile is up to TILE elements: a run of ITERS blocks of BLOCK
columns of one row (wide rows), or ITERS * (BLOCK // cols) whole rows
(narrow ones). Programs take one tile each and add their sum to their
group's slot with one atomic.

Triton is imported lazily; without it `available()` is False and callers
use the torch fallback (weightsync.receipts._receipt_by_ops).
"""

import numpy as np

from weightsync import receipts

BLOCK = 1024
ITERS = 16
TILE = BLOCK * ITERS
_DTYPES = {"FLOAT32": 0, "BFLOAT16": 1, "FLOAT16": 2}
_COLS = 11

_kernel = None
_checked = None


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


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _f32_bits(raw, SRC: tl.constexpr):
        # float32 bits (uint32) of a float element's raw bits.
        if SRC == 0:
            u = raw.to(tl.uint32, bitcast=True)
        elif SRC == 1:
            u = raw.to(tl.uint32) << 16
        else:
            h = raw.to(tl.uint32)
            wide = raw.to(tl.float16, bitcast=True).to(tl.float32).to(tl.uint32, bitcast=True)
            nan16 = ((h & 0x7C00) == 0x7C00) & ((h & 0x3FF) != 0)
            u = tl.where(nan16, ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13), wide)
        return u

    @triton.jit
    def _bits32(raw, SRC: tl.constexpr, DST: tl.constexpr, ES: tl.constexpr):
        # Bits32 of the element as stored in the engine's dtype.
        if SRC == DST:
            if ES == 8:
                w = raw.to(tl.uint64, bitcast=True)
                b = (w & 0xFFFFFFFF).to(tl.uint32) ^ ((w >> 32).to(tl.uint32) * 0x27D4EB2F)
            elif ES == 4:
                b = raw.to(tl.uint32, bitcast=True)
            else:
                b = raw.to(tl.uint32)
        else:
            u = _f32_bits(raw, SRC)
            nan = (u & 0x7FFFFFFF) > 0x7F800000
            if DST == 0:
                b = u
            elif DST == 1:
                rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
                b = tl.where(nan, ((u >> 16) | 0x40) & 0xFFFF, rounded)
            else:
                # Round to nearest even in hardware (cvt.rn.f16.f32); NaN
                # keeps the sign and the quiet bit only (FloatToHalf).
                h = (u.to(tl.float32, bitcast=True).to(tl.float16)
                     .to(tl.uint16, bitcast=True).to(tl.uint32))
                b = tl.where(nan, ((u >> 16) & 0x8000) | 0x7E00, h)
        return b

    @triton.jit
    def _receipt_kernel(table, tile_region, out, SRC: tl.constexpr, DST: tl.constexpr,
                        ES: tl.constexpr, RAW: tl.constexpr, BLOCK: tl.constexpr,
                        ITERS: tl.constexpr):
        pid = tl.program_id(0)
        reg = tl.load(tile_region + pid).to(tl.int64)
        row = table + reg * 11
        src_addr = tl.load(row + 0)
        src_stride = tl.load(row + 1)
        rows = tl.load(row + 2)
        cols = tl.load(row + 3)
        salt = tl.load(row + 4).to(tl.uint32)
        dest = tl.load(row + 5)
        dest_stride = tl.load(row + 6)
        group = tl.load(row + 7)
        rpt = tl.load(row + 8)
        cpr = tl.load(row + 9)
        local = pid - tl.load(row + 10)
        src = src_addr.to(tl.pointer_type(RAW))
        lane = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        if rpt > 1:
            # Narrow rows: BLOCK // cols whole rows per step.
            cols32 = cols.to(tl.int32)
            r_in = lane // cols32
            c = (lane - r_in * cols32).to(tl.int64)
            r_in = r_in.to(tl.int64)
            row0 = local * rpt * ITERS
            steps = tl.minimum((rows - row0 + rpt - 1) // rpt, ITERS)
            for it in range(0, steps):
                r = row0 + it * rpt + r_in
                mask = (r_in < rpt) & (r < rows)
                raw = tl.load(src + r * src_stride + c, mask=mask, other=0,
                              eviction_policy="evict_first")
                index = dest + r * dest_stride + c
                key = (salt + (index & 0xFFFFFFFF).to(tl.uint32) * 0x9E3779B1
                       + (index >> 32).to(tl.uint32) * 0x85EBCA77)
                x = _bits32(raw, SRC, DST, ES) ^ key
                x ^= x >> 16
                x *= 0x85EBCA6B
                x ^= x >> 13
                x *= 0xC2B2AE35
                x ^= x >> 16
                acc += tl.where(mask, x.to(tl.int64), 0)
        else:
            r = local // cpr
            c0 = (local - r * cpr) * (BLOCK * ITERS)
            steps = tl.minimum((cols - c0 + BLOCK - 1) // BLOCK, ITERS)
            base = src + r * src_stride + c0
            index0 = dest + r * dest_stride + c0
            for it in range(0, steps):
                c = it * BLOCK + lane
                mask = c0 + c < cols
                raw = tl.load(base + c, mask=mask, other=0, eviction_policy="evict_first")
                index = index0 + c
                key = (salt + (index & 0xFFFFFFFF).to(tl.uint32) * 0x9E3779B1
                       + (index >> 32).to(tl.uint32) * 0x85EBCA77)
                x = _bits32(raw, SRC, DST, ES) ^ key
                x ^= x >> 16
                x *= 0x85EBCA6B
                x ^= x >> 13
                x *= 0xC2B2AE35
                x ^= x >> 16
                acc += tl.where(mask, x.to(tl.int64), 0)
        tl.atomic_add(out + group, tl.sum(acc, axis=0))

    return _receipt_kernel


def _raw_dtype(es):
    import triton.language as tl
    return {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}[es]


def _tiles(rows, cols):
    """(rows per tile, chunks per row, tiles) of a region (numpy arrays)."""
    narrow = cols <= BLOCK // 2   # at least two rows per step (the kernel's test)
    rpt = np.where(narrow, BLOCK // np.maximum(cols, 1), 1)
    cpr = np.where(narrow, 1, (cols + TILE - 1) // TILE)
    tiles = np.where(narrow, (rows + rpt * ITERS - 1) // (rpt * ITERS), rows * cpr)
    return rpt, cpr, tiles


def expected_receipts_gpu(layouts, sent, stream=None):
    """{key: (checksum, parameters, bytes)} for each layout in `layouts`
    ({key: weightsync.v1.Parameter messages}), from `sent` ({name: (dtype
    enum name, shape, flat torch CUDA tensor of the dtype's elements, or
    int16 for bfloat16)}), enqueued on `stream` (None: the current stream)
    and waited for. One launch per (source dtype, engine dtype) pair over
    every layout. The tensors must not change until it returns."""
    import torch
    global _kernel
    if _kernel is None:
        _kernel = _build()
    keys = list(layouts)
    per_pair = {}
    counts = {}
    device = None
    for g, key in enumerate(keys):
        params, nbytes, groups = receipts._runs(layouts[key], sent)
        counts[key] = (params, nbytes)
        for (src, dst), runs in groups.items():
            rows_out = per_pair.setdefault((src, dst), [])
            for name, _rows, cols, rb, cb, rc, cc, dest, stride, s in runs:
                t = sent[name][2]
                device = t.device
                addr = t.data_ptr() + (rb * cols + cb) * t.element_size()
                rows_out.append((addr, cols, rc, cc, s, dest, stride, g))
    stream = stream or torch.cuda.current_stream(device)
    out = torch.zeros(max(len(keys), 1), dtype=torch.int64, device=device)
    with torch.cuda.stream(stream):
        for (src, dst), table_rows in per_pair.items():
            if src != dst and (src not in _DTYPES or dst not in _DTYPES):
                raise ValueError(f"can't convert {src} to {dst}")
            t = np.array(table_rows, dtype=np.uint64).view(np.int64).reshape(-1, 8)
            rpt, cpr, tiles = _tiles(t[:, 2], t[:, 3])
            first = np.cumsum(tiles) - tiles
            table = np.concatenate([t, rpt[:, None], cpr[:, None], first[:, None]], axis=1)
            tile_region = np.repeat(np.arange(len(t), dtype=np.int32), tiles)
            if tile_region.size == 0:
                continue
            es = receipts.ESIZE[src]
            raw = _raw_dtype(es)
            table_d = torch.from_numpy(np.ascontiguousarray(table)).to(device, non_blocking=True)
            tiles_d = torch.from_numpy(tile_region).to(device, non_blocking=True)
            _kernel[(int(tile_region.size),)](
                table_d, tiles_d, out, SRC=_DTYPES.get(src, -1 - es), DST=_DTYPES.get(dst, -1 - es),
                ES=es, RAW=raw, BLOCK=BLOCK, ITERS=ITERS)
        sums = out.cpu()   # waits for the stream
    result = {}
    for g, key in enumerate(keys):
        result[key] = (int(sums[g]) & receipts._xp.MASK64,) + counts[key]
    return result
