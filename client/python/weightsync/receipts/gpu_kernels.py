"""The Triton kernels of weightsync.receipts.gpu: the receipt terms of many
regions summed per (source, destination) dtype pair, one tile a program
(receipt_kernel), and many small regions a program (small_kernel). Imported
only where Triton is present (gpu.available()); Triton compiles each at its
first launch. Bit for bit the function of weightsync.receipts.core.
"""

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
def _mix(b, key):
    # mix32(b ^ key) up to its last step (y ^ (y >> 16)): y, the
    # product.
    x = (b ^ key).to(tl.uint32)
    x ^= x >> 16
    x *= 0x85EBCA6B
    return x


@triton.jit
def _term(b, key):
    y = _mix(b, key)
    return (y ^ (y >> 16)).to(tl.uint32)


@triton.jit
def _key(index, salt):
    return (salt + (index & 0xFFFFFFFF).to(tl.uint32) * 0x9E3779B1
            + (index >> 32).to(tl.uint32) * 0x85EBCA77)


@triton.jit
def _fast_step(ptr, kb, kl, SRC: tl.constexpr, DST: tl.constexpr, ES: tl.constexpr,
               SPLIT: tl.constexpr):
    # Terms of one whole aligned block as 32-bit words; kb: the key of
    # its first element, kl: each word's first element's key offset.
    # SPLIT: (sum of the terms' low halves, of their high halves) as
    # uint32, the high half being mix32's y >> 16, which it
    # computes anyway; else (sum as int64, the same).
    w = tl.load(ptr, eviction_policy="evict_first")
    if ES == 2:
        k0 = kl + kb
        y0 = _mix(_bits32((w & 0xFFFF).to(tl.uint16), SRC, DST, ES), k0)
        y1 = _mix(_bits32((w >> 16).to(tl.uint16), SRC, DST, ES), k0 + 0x9E3779B1)
        if SPLIT:
            h0 = y0 >> 16
            h1 = y1 >> 16
            lo = ((y0 ^ h0) & 0xFFFF) + ((y1 ^ h1) & 0xFFFF)
            hi = h0 + h1
        else:
            lo = (y0 ^ (y0 >> 16)).to(tl.int64) + (y1 ^ (y1 >> 16)).to(tl.int64)
            hi = lo
    else:
        y = _mix(_bits32(w, SRC, DST, ES), kl + kb)
        if SPLIT:
            hi = y >> 16
            lo = (y ^ hi) & 0xFFFF
        else:
            lo = (y ^ (y >> 16)).to(tl.int64)
            hi = lo
    return lo, hi


@triton.jit
def _narrow_rows(src, src_stride, rows, cols, salt, dest, dest_stride, rpt, local, lane,
                 SRC: tl.constexpr, DST: tl.constexpr, ES: tl.constexpr, BLOCK: tl.constexpr,
                 ITERS: tl.constexpr):
    # A tile of a region of narrow rows: BLOCK // cols whole rows per step.
    acc = tl.zeros([BLOCK], dtype=tl.int64)
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
        x = _term(_bits32(raw, SRC, DST, ES), _key(dest + r * dest_stride + c, salt))
        acc += tl.where(mask, x.to(tl.int64), 0)
    return tl.sum(acc, axis=0)


@triton.jit
def _receipt_kernel(table, tile_region, out, SRC: tl.constexpr, DST: tl.constexpr,
                    ES: tl.constexpr, RAW: tl.constexpr, BLOCK: tl.constexpr,
                    ITERS: tl.constexpr, WORDS: tl.constexpr, FAST: tl.constexpr,
                    SPLIT: tl.constexpr, REL: tl.constexpr):
    pid = tl.program_id(0)
    reg = tl.load(tile_region + pid).to(tl.int64)
    row = table + reg * 12
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
    aligned = tl.load(row + 11)
    src = src_addr.to(tl.pointer_type(RAW))
    lane = tl.arange(0, BLOCK)
    if rpt > 1:
        total = _narrow_rows(src, src_stride, rows, cols, salt, dest, dest_stride, rpt, local,
                             lane, SRC, DST, ES, BLOCK, ITERS)
    else:
        r = local // cpr
        c0 = (local - r * cpr) * (BLOCK * ITERS)
        steps = tl.minimum((cols - c0 + BLOCK - 1) // BLOCK, ITERS)
        index0 = dest + r * dest_stride + c0
        nfast = 0
        if FAST:
            # Whole blocks of an aligned region, when the tile's
            # indices share their high 32 bits.
            last = index0 + tl.minimum(cols - c0, BLOCK * ITERS) - 1
            same_hi = ((index0 >> 32) == (last >> 32)) & (aligned != 0)
            nfast = tl.where(same_hi, tl.minimum((cols - c0) // BLOCK, ITERS), 0)
            tile_addr = src_addr + (r * src_stride + c0) * ES
            if REL:
                # As words from the (16-byte aligned) table argument.
                off = tl.multiple_of((tile_addr - table.to(tl.int64)) >> 2, 4)
                tile_ptr = table.to(tl.pointer_type(tl.uint32)) + off
            else:
                tile_addr = tl.multiple_of(tile_addr, 16)
                tile_ptr = tl.multiple_of(tile_addr.to(tl.pointer_type(tl.uint32)), 16)
            jw = tl.arange(0, WORDS)
            if ES == 2:
                kl = (jw * 2).to(tl.uint32) * 0x9E3779B1
            else:
                kl = jw.to(tl.uint32) * 0x9E3779B1
            if SPLIT:
                # Per lane at most 2 * ITERS halves below 2^16 each.
                acc_lo = tl.zeros([WORDS], dtype=tl.uint32)
                acc_hi = tl.zeros([WORDS], dtype=tl.uint32)
            else:
                acc_lo = tl.zeros([WORDS], dtype=tl.int64)
            for it in range(0, nfast):
                i0 = index0 + it * BLOCK
                kb = (salt + (i0 & 0xFFFFFFFF).to(tl.uint32) * 0x9E3779B1
                      + (i0 >> 32).to(tl.uint32) * 0x85EBCA77)
                lo, hi = _fast_step(tile_ptr + it * WORDS + jw, kb, kl, SRC, DST, ES, SPLIT)
                acc_lo += lo
                if SPLIT:
                    acc_hi += hi
            if SPLIT:
                fast_total = (tl.sum(acc_lo.to(tl.int64), axis=0)
                              + (tl.sum(acc_hi.to(tl.int64), axis=0) << 16))
            else:
                fast_total = tl.sum(acc_lo, axis=0)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        base = src + r * src_stride + c0
        for it in range(nfast, steps):
            c = it * BLOCK + lane
            mask = c0 + c < cols
            raw = tl.load(base + c, mask=mask, other=0, eviction_policy="evict_first")
            x = _term(_bits32(raw, SRC, DST, ES), _key(index0 + c, salt))
            acc += tl.where(mask, x.to(tl.int64), 0)
        total = tl.sum(acc, axis=0)
        if FAST:
            total += fast_total
    tl.atomic_add(out + group, total)


@triton.jit
def _small_kernel(table, out, SRC: tl.constexpr, DST: tl.constexpr, ES: tl.constexpr,
                  RAW: tl.constexpr, K: tl.constexpr, E: tl.constexpr):
    # K small regions (one row of at most E elements each) per program,
    # a [K, E] block of lanes: a mixture of experts' 100k tiny tensors
    # cost one program per K instead of one each. The table (int64 per
    # region: address, cols, salt32, first destination index, group) is
    # sorted by group and padded so that a program's regions share one.
    pid = tl.program_id(0)
    k = tl.arange(0, K)
    e = tl.arange(0, E)
    row = table + (pid * K + k).to(tl.int64) * 5
    addr = tl.load(row + 0)
    cols = tl.load(row + 1)
    salt = tl.load(row + 2).to(tl.uint32)
    dest = tl.load(row + 3)
    ptr = addr.to(tl.pointer_type(RAW))[:, None] + e[None, :]
    mask = e[None, :] < cols[:, None]
    raw = tl.load(ptr, mask=mask, other=0, eviction_policy="evict_first")
    x = _term(_bits32(raw, SRC, DST, ES), _key(dest[:, None] + e[None, :], salt[:, None]))
    total = tl.sum(tl.sum(tl.where(mask, x.to(tl.int64), 0), axis=1), axis=0)
    group = tl.load(table + (pid * K).to(tl.int64) * 5 + 4)
    tl.atomic_add(out + group, total)


# The kernels the launcher calls.
receipt_kernel = _receipt_kernel
small_kernel = _small_kernel
