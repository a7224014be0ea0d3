"""The Triton kernels of weightsync.receipts.fp8_gpu: the receipt of FP8
targets quantised as the daemon quantises them (weightsync.receipts.fp8,
common/fp8.cc), a block a program over its pieces (fp8_receipt_kernel),
and whole 128 x 128 tiles a program (fp8_tile_kernel); and FP8 on the
wire's quantisation, a block of a tensor a program (fp8_wire_kernel).
Imported only where Triton is present; Triton compiles each at its first
launch.
"""

import triton
import triton.language as tl


@triton.jit
def _f32_bits(raw, SRC: tl.constexpr):
    # float32 bits (uint32) of a float element's raw bits, exactly
    # (float16 NaN: sign and payload kept, as receipts_gpu does).
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
def _round_shift(m, shift):
    # m >> shift rounded to nearest, ties to even (int32, shift 1..25).
    one = m * 0 + 1   # int32 ones like m (1 << tensor: no constexpr operand)
    k = m >> shift
    rem = m & ((one << shift) - 1)
    half = one << (shift - 1)
    up = (rem > half) | ((rem == half) & ((k & 1) == 1))
    return k + up.to(tl.int32)


@triton.jit
def _to_fp8(bits, mb, bias, max_bits, nan_bits, fmax_bits):
    # weightsync.fp8.to_fp8 on int32 float32 bits: every intermediate
    # fits 32 bits (|(e - 127 + bias) << 23| < 2^31 for e <= 255).
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = a >> 23
    emin = 1 - bias
    drop = 23 - mb
    normal = _round_shift(((e - 127 + bias) << 23) | (a & 0x7FFFFF), drop + e * 0)
    m = tl.where(e == 0, a, (a & 0x7FFFFF) | 0x800000)
    shift = (emin - mb) - (tl.maximum(e, 1) - 150)
    sub = tl.where(shift >= 25, 0,
                   _round_shift(m, tl.minimum(tl.maximum(shift, 1), 25)))
    out = tl.where(e - 127 < emin, sub, normal)
    out = tl.where(a >= fmax_bits, max_bits, out)
    out = tl.where(a > 0x7F800000, nan_bits, out)
    return (out | sign) & 0xFF


@triton.jit
def _term(b, key):
    x = (b ^ key).to(tl.uint32)
    x ^= x >> 16
    x *= 0x85EBCA6B
    return (x ^ (x >> 16)).to(tl.uint32)


@triton.jit
def _key(index, salt):
    return (salt + (index & 0xFFFFFFFF).to(tl.uint32) * 0x9E3779B1
            + (index >> 32).to(tl.uint32) * 0x85EBCA77)


@triton.jit
def _fp8_receipt_kernel(blocks, pieces, out, SRC: tl.constexpr, RAW: tl.constexpr,
                        TILE: tl.constexpr):
    pid = tl.program_id(0)
    brow = blocks + pid.to(tl.int64) * 12
    p0 = tl.load(brow + 0)
    npieces = tl.load(brow + 1)
    scale_index = tl.load(brow + 2)
    salt = tl.load(brow + 3).to(tl.uint32)
    scale_salt = tl.load(brow + 4).to(tl.uint32)
    mb = tl.load(brow + 5).to(tl.int32)
    bias = tl.load(brow + 6).to(tl.int32)
    max_bits = tl.load(brow + 7).to(tl.int32)
    nan_bits = tl.load(brow + 8).to(tl.int32)
    fmax_bits = tl.load(brow + 9).to(tl.int32)
    rec = tl.load(brow + 10)
    lane = tl.arange(0, TILE)
    # Pass 1: amax (as float32 bits: non-negative floats order as ints).
    amax = tl.zeros([TILE], dtype=tl.int32)
    for k in range(0, npieces):
        prow = pieces + (p0 + k) * 6
        src = tl.load(prow + 0).to(tl.pointer_type(RAW))
        sstride = tl.load(prow + 1)
        pr = tl.load(prow + 2).to(tl.int32)
        pc = tl.load(prow + 3).to(tl.int32)
        n = pr * pc
        for f0 in range(0, n, TILE):
            f = f0 + lane
            mask = f < n
            r = f // pc
            c = f - r * pc
            raw = tl.load(src + r.to(tl.int64) * sstride + c, mask=mask, other=0)
            a = _f32_bits(raw, SRC).to(tl.int32, bitcast=True) & 0x7FFFFFFF
            a = tl.where(mask & (a < 0x7F800000), a, 0)
            amax = tl.maximum(amax, a)
    am = tl.max(amax, axis=0)
    fmax = (tl.zeros([TILE], dtype=tl.int32) + fmax_bits).to(tl.float32, bitcast=True)
    amv = (tl.zeros([TILE], dtype=tl.int32) + am).to(tl.float32, bitcast=True)
    d = tl.math.div_rn(amv, fmax)
    d = tl.where(d == 0.0, 1.0, d)
    # Pass 2: the encodings' terms.
    acc = tl.zeros([TILE], dtype=tl.int64)
    for k in range(0, npieces):
        prow = pieces + (p0 + k) * 6
        src = tl.load(prow + 0).to(tl.pointer_type(RAW))
        sstride = tl.load(prow + 1)
        pr = tl.load(prow + 2).to(tl.int32)
        pc = tl.load(prow + 3).to(tl.int32)
        dest = tl.load(prow + 4)
        dstride = tl.load(prow + 5)
        n = pr * pc
        for f0 in range(0, n, TILE):
            f = f0 + lane
            mask = f < n
            r = f // pc
            c = f - r * pc
            raw = tl.load(src + r.to(tl.int64) * sstride + c, mask=mask, other=0)
            u = _f32_bits(raw, SRC).to(tl.int32, bitcast=True)
            q = tl.math.div_rn(u.to(tl.float32, bitcast=True), d)
            qb = tl.where((u & 0x7FFFFFFF) > 0x7F800000, u,
                          q.to(tl.int32, bitcast=True))
            enc = _to_fp8(qb, mb, bias, max_bits, nan_bits, fmax_bits)
            index = dest + r.to(tl.int64) * dstride + c.to(tl.int64)
            t = _term(enc.to(tl.uint32), _key(index, salt))
            acc += tl.where(mask, t.to(tl.int64), 0)
    one = tl.zeros([TILE], dtype=tl.float32) + 1.0
    stored = tl.where(rec != 0, tl.math.div_rn(one, d), d)
    sidx = tl.zeros([TILE], dtype=tl.int64) + scale_index
    st = _term(stored.to(tl.uint32, bitcast=True), _key(sidx, scale_salt))
    acc += tl.where(lane == 0, st.to(tl.int64), 0)
    tl.atomic_add(out, tl.sum(acc, axis=0))


@triton.jit
def _tile_quotient(x, d, FAST_DIV: tl.constexpr):
    # x / d rounded to nearest even: fp8_math.h's Fp8Divider (checked
    # for every bfloat16 / float16 x and scale by fp8_divide_test) where
    # FAST_DIV (such sources) and d is in [2^-60, 2^60], else div_rn.
    # +-inf x gives NaN: the caller encodes it by x's class.
    if FAST_DIV:
        e = (d.to(tl.int32, bitcast=True) >> 23) & 0xFF
        e_s = tl.max(tl.max(e, axis=1), axis=0)
        if (e_s >= 127 - 60) & (e_s <= 127 + 60):
            y = tl.broadcast_to(tl.math.div_rn(d * 0.0 + 1.0, d), x.shape)
            q0 = x * y
            q = tl.fma(-tl.fma(q0, tl.broadcast_to(d, x.shape), -x), y, q0)
            # x's sign, explicitly: the compiler may fold the negations
            # (exact but for signed zeros), which lost -0's sign on an
            # H100 (tests/gpu/check_fp8_triton_gpu.py's zero blocks).
            q = ((q.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
                 | (x.to(tl.int32, bitcast=True) & -0x80000000)).to(tl.float32,
                                                                     bitcast=True)
        else:
            q = tl.math.div_rn(x, d)
    else:
        q = tl.math.div_rn(x, d)
    return q


@triton.jit
def _tile_encode(u, a, d, FMAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr,
                 NAN_BITS: tl.constexpr, E5M2: tl.constexpr, FAST_DIV: tl.constexpr,
                 SPECIALS: tl.constexpr):
    # The FP8 encodings (int32, 0..255) of a tile's float32 bits `u`
    # (a = u & 0x7FFFFFFF) with the block's scale d ([1, 1]).
    # SPECIALS false: the block holds no inf or NaN, so every quotient
    # is finite and the hardware's saturating conversion is to_fp8's
    # answer (|q| >= FMAX saturates to the largest finite, as to_fp8).
    q = _tile_quotient(u.to(tl.float32, bitcast=True), d, FAST_DIV)
    if E5M2:
        hw = q.to(tl.float8e5, fp_downcast_rounding="rtne")
    else:
        hw = q.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    hw = hw.to(tl.uint8, bitcast=True).to(tl.int32)
    if SPECIALS:
        sign = (u >> 24) & 0x80
        aq = q.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        enc = tl.where(a > 0x7F800000, sign | NAN_BITS,
                       tl.where(aq >= FMAX_BITS, sign | MAX_BITS, hw))
    else:
        enc = hw
    return enc


@triton.jit
def _tile_terms(u, a, d, rows, cc, dest_lo, dstride_lo, salt_hi,
                FMAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr,
                NAN_BITS: tl.constexpr, E5M2: tl.constexpr, FAST_DIV: tl.constexpr,
                SPECIALS: tl.constexpr):
    # The receipt terms (uint32) of one [rows, cols] tile's FP8 bytes.
    enc = _tile_encode(u, a, d, FMAX_BITS, MAX_BITS, NAN_BITS, E5M2, FAST_DIV, SPECIALS)
    rowkey = salt_hi + (dest_lo + rows.to(tl.uint32) * dstride_lo) * 0x9E3779B1
    key = rowkey + cc.to(tl.uint32) * 0x9E3779B1
    return _term(enc.to(tl.uint32), key)


@triton.jit
def _tile_load(src, sstride, r0, pr, pc, cc, SRC: tl.constexpr, RB: tl.constexpr,
               FULL: tl.constexpr):
    # Rows [r0, r0 + RB) of the piece as float32 bits (int32), their
    # row numbers and the mask of the piece's elements among them
    # (FULL: the piece is whole tiles; no mask).
    rr = r0 + tl.arange(0, RB)[:, None]
    mask = (rr < pr) & (cc < pc)   # unused (and dropped) where FULL
    if FULL:
        raw = tl.load(src + rr.to(tl.int64) * sstride + cc)
    else:
        raw = tl.load(src + rr.to(tl.int64) * sstride + cc, mask=mask, other=0)
    return _f32_bits(raw, SRC).to(tl.int32, bitcast=True), rr, mask


@triton.jit
def _tile_amax(src, sstride, pr, pc, cc, SRC: tl.constexpr, RB: tl.constexpr,
               C: tl.constexpr, FULL: tl.constexpr):
    # The first read: (the largest finite |x|'s float32 bits, the
    # largest |bits| with inf and NaN), int32 scalars.
    am = tl.zeros([RB, C], dtype=tl.int32)
    top = tl.zeros([RB, C], dtype=tl.int32)
    for r0 in range(0, pr, RB):
        u, rr, mask = _tile_load(src, sstride, r0, pr, pc, cc, SRC, RB, FULL)
        a = u & 0x7FFFFFFF
        am = tl.maximum(am, tl.where(a < 0x7F800000, a, 0))
        top = tl.maximum(top, a)
    return tl.max(tl.max(am, axis=1), axis=0), tl.max(tl.max(top, axis=1), axis=0)


@triton.jit
def _tile_top16(addr, sstride, pr, SRC: tl.constexpr, RB: tl.constexpr,
                C: tl.constexpr):
    # The first read of whole tiles of a 16-bit source in aligned 32-bit
    # words (two elements each): the largest |bits| of the block, inf
    # and NaN included, as an int32 scalar. One bf16x2 / f16x2 max with
    # NaN kept a word (non-negative non-NaN values order as their bits;
    # a NaN lane comes out above inf), as the daemon's VecTop.
    w32 = tl.multiple_of(addr.to(tl.pointer_type(tl.uint32)), 16)
    cw = tl.arange(0, C // 2)[None, :]
    top = tl.zeros([RB, C // 2], dtype=tl.uint32)
    for r0 in range(0, pr, RB):
        rr = r0 + tl.arange(0, RB)[:, None]
        w = tl.load(w32 + rr.to(tl.int64) * (sstride // 2) + cw)
        a = w & 0x7FFF7FFF
        if SRC == 1:
            top = tl.inline_asm_elementwise("max.NaN.bf16x2 $0, $1, $2;", "=r,r,r",
                                            [top, a], dtype=tl.uint32, is_pure=True,
                                            pack=1)
        else:
            top = tl.inline_asm_elementwise("max.NaN.f16x2 $0, $1, $2;", "=r,r,r",
                                            [top, a], dtype=tl.uint32, is_pure=True,
                                            pack=1)
    lane = tl.maximum(top & 0xFFFF, top >> 16)
    return tl.max(tl.max(lane, axis=1), axis=0).to(tl.int32)


@triton.jit
def _tile_pass(src, sstride, pr, pc, cc, d, dest_lo, dstride_lo, salt_hi,
               SRC: tl.constexpr, RB: tl.constexpr, C: tl.constexpr, FULL: tl.constexpr,
               FMAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_BITS: tl.constexpr,
               E5M2: tl.constexpr, FAST_DIV: tl.constexpr, SPECIALS: tl.constexpr):
    # The second read: the block's terms in an int64 tile (reduced once
    # by the caller).
    acc = tl.zeros([RB, C], dtype=tl.int64)
    for r0 in range(0, pr, RB):
        u, rr, mask = _tile_load(src, sstride, r0, pr, pc, cc, SRC, RB, FULL)
        t = _tile_terms(u, u & 0x7FFFFFFF, d, rr, cc, dest_lo, dstride_lo, salt_hi,
                        FMAX_BITS, MAX_BITS, NAN_BITS, E5M2, FAST_DIV, SPECIALS)
        if FULL:
            acc += t.to(tl.int64)
        else:
            acc += tl.where(mask, t.to(tl.int64), 0)
    return acc


@triton.jit
def _fp8_tile_kernel(tab, out, SRC: tl.constexpr, RAW: tl.constexpr, E5M2: tl.constexpr,
                     FMAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr,
                     NAN_BITS: tl.constexpr, VEC: tl.constexpr, C: tl.constexpr,
                     RB: tl.constexpr, FAST_DIV: tl.constexpr, FULL: tl.constexpr,
                     FINITE_FAST: tl.constexpr, PACKED: tl.constexpr):
    # One block of one piece (split's tile rows), read in RB x C tiles
    # twice: the amax, then the terms (the second read comes from cache;
    # holding the whole block at once was slower: bench/RESULTS.md).
    # FULL: every piece of the launch is RB-row tiles of C columns
    # (no masks). The terms add up in an int64 tile, reduced once.
    row = tab + tl.program_id(0).to(tl.int64) * 10
    src = tl.load(row + 0).to(tl.pointer_type(RAW))
    sstride = tl.load(row + 1)
    pr = tl.load(row + 2).to(tl.int32)
    pc = tl.load(row + 3).to(tl.int32)
    dest = tl.load(row + 4)
    dstride = tl.load(row + 5)
    scale_index = tl.load(row + 6)
    salt = tl.load(row + 7).to(tl.uint32)
    scale_salt = tl.load(row + 8).to(tl.uint32)
    rec = tl.load(row + 9)
    if VEC > 1:   # the launch's pieces start and stride in 16-byte vectors
        src = tl.multiple_of(src, 16)
        sstride = tl.multiple_of(sstride, VEC)
    # Keys of 32 bits: the piece's indices share their upper half.
    salt_hi = salt + (dest >> 32).to(tl.uint32) * 0x85EBCA77
    dest_lo = (dest & 0xFFFFFFFF).to(tl.uint32)
    dstride_lo = (dstride & 0xFFFFFFFF).to(tl.uint32)
    cc = tl.arange(0, C)[None, :]
    fmax = (tl.zeros([1, 1], dtype=tl.int32) + FMAX_BITS).to(tl.float32, bitcast=True)
    if PACKED:
        # Whole tiles of a 16-bit source (FULL, VEC, FINITE_FAST): the
        # top in words; below inf it is the amax, else the first read
        # again element by element (a block with inf or NaN: rare).
        top = _tile_top16(tl.load(row + 0), sstride, pr, SRC, RB, C)
        if SRC == 1:
            amb = top << 16
        else:
            amb = top.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32).to(
                tl.int32, bitcast=True)
        finite = top < (0x7F80 if SRC == 1 else 0x7C00)
        if top >= (0x7F80 if SRC == 1 else 0x7C00):
            amb, top = _tile_amax(src, sstride, pr, pc, cc, SRC, RB, C, FULL)
    else:
        amb, top = _tile_amax(src, sstride, pr, pc, cc, SRC, RB, C, FULL)
        # FINITE_FAST: a block without inf or NaN takes the pass
        # without the specials' selects.
        finite = top < (0x7F800000 if FINITE_FAST else 0)
    amv = (tl.zeros([1, 1], dtype=tl.int32) + amb).to(tl.float32, bitcast=True)
    d = tl.math.div_rn(amv, fmax)
    d = tl.where(d == 0.0, 1.0, d)
    if finite:
        acc = _tile_pass(src, sstride, pr, pc, cc, d, dest_lo, dstride_lo, salt_hi,
                         SRC, RB, C, FULL, FMAX_BITS, MAX_BITS, NAN_BITS, E5M2,
                         FAST_DIV, False)
    else:
        acc = _tile_pass(src, sstride, pr, pc, cc, d, dest_lo, dstride_lo, salt_hi,
                         SRC, RB, C, FULL, FMAX_BITS, MAX_BITS, NAN_BITS, E5M2,
                         FAST_DIV, True)
    one = tl.zeros([1, 1], dtype=tl.float32) + 1.0
    stored = tl.where(rec != 0, tl.math.div_rn(one, d), d)
    sidx = tl.zeros([1, 1], dtype=tl.int64) + scale_index
    st = _term(stored.to(tl.uint32, bitcast=True), _key(sidx, scale_salt))
    tl.atomic_add(out, tl.sum(tl.sum(acc, axis=1), axis=0)
                  + tl.sum(tl.sum(st.to(tl.int64), axis=1), axis=0))


@triton.jit
def _wire_tile(src, base, cols, rr, cc, pr, pc, SRC: tl.constexpr):
    # Rows rr x cols cc of a block at element `base` of a contiguous
    # matrix of `cols` columns whose block is pr x pc: (float32 bits as
    # int32, element offsets, mask) of a float32 (int32 view) or 16-bit
    # (int16 view) source.
    mask = (rr < pr) & (cc < pc)
    off = base + rr.to(tl.int64) * cols + cc
    raw = tl.load(src + off, mask=mask, other=0)
    if SRC == 0:
        bits = raw.to(tl.uint32, bitcast=True)
    else:
        bits = raw.to(tl.uint16, bitcast=True)
    return _f32_bits(bits, SRC).to(tl.int32, bitcast=True), off, mask


@triton.jit
def _fp8_wire_kernel(src, enc, scales, rows, cols, br, bc, n_bc, mb, bias, max_bits,
                     nan_bits, fmax_bits, SRC: tl.constexpr, REC: tl.constexpr,
                     RB: tl.constexpr, C: tl.constexpr):
    # FP8 on the wire (weightsync.wire_fp8): one block of a contiguous
    # [rows, cols] tensor a program (block (bi, bj) of a grid n_bc blocks
    # wide; per row: br = 1, bc = cols), read twice in RB x C tiles as
    # _fp8_receipt_kernel reads its pieces: the amax of the finite |x|,
    # d = amax / FMAX (div_rn; 1 where 0), then q = x / d (div_rn; NaN as
    # it is) encoded by _to_fp8 and stored as a byte, and the stored scale
    # (d, or 1 / d) at the block's index: weightsync.receipts.fp8.quantize
    # bit for bit (tests/gpu/check_wire_fp8_gpu.py).
    pid = tl.program_id(0).to(tl.int64)
    bi = pid // n_bc
    r0 = bi * br
    c0 = (pid - bi * n_bc) * bc
    pr = tl.minimum(br, rows - r0).to(tl.int32)
    pc = tl.minimum(bc, cols - c0).to(tl.int32)
    base = r0 * cols + c0
    rr0 = tl.arange(0, RB)[:, None]
    cc0 = tl.arange(0, C)[None, :]
    am = tl.zeros([RB, C], dtype=tl.int32)
    for r in range(0, pr, RB):
        for c in range(0, pc, C):
            u, off, mask = _wire_tile(src, base, cols, r + rr0, c + cc0, pr, pc, SRC)
            a = u & 0x7FFFFFFF
            am = tl.maximum(am, tl.where(mask & (a < 0x7F800000), a, 0))
    amb = tl.max(tl.max(am, axis=1), axis=0)
    fmax = (tl.zeros([RB, C], dtype=tl.int32) + fmax_bits).to(tl.float32, bitcast=True)
    amv = (tl.zeros([RB, C], dtype=tl.int32) + amb).to(tl.float32, bitcast=True)
    d = tl.math.div_rn(amv, fmax)
    d = tl.where(d == 0.0, 1.0, d)
    for r in range(0, pr, RB):
        for c in range(0, pc, C):
            u, off, mask = _wire_tile(src, base, cols, r + rr0, c + cc0, pr, pc, SRC)
            q = tl.math.div_rn(u.to(tl.float32, bitcast=True), d)
            qb = tl.where((u & 0x7FFFFFFF) > 0x7F800000, u, q.to(tl.int32, bitcast=True))
            e = _to_fp8(qb, mb, bias, max_bits, nan_bits, fmax_bits)
            tl.store(enc + off, e.to(tl.uint8), mask=mask)
    if REC:
        stored = tl.math.div_rn(tl.zeros([RB, C], dtype=tl.float32) + 1.0, d)
    else:
        stored = d
    first = (rr0 == 0) & (cc0 == 0)
    tl.store(scales + pid + rr0 * 0 + cc0 * 0, stored, mask=first)


@triton.jit
def _wire_tile_pass(src, enc, base, cols, pr, pc, rr0, cc, d, SRC: tl.constexpr,
                    RB: tl.constexpr, FMAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr,
                    NAN_BITS: tl.constexpr, E5M2: tl.constexpr, FAST_DIV: tl.constexpr,
                    SPECIALS: tl.constexpr):
    # The second read of fp8_wire_tile_kernel: the block's encodings stored.
    for r in range(0, pr, RB):
        u, off, mask = _wire_tile(src, base, cols, r + rr0, cc, pr, pc, SRC)
        e = _tile_encode(u, u & 0x7FFFFFFF, d, FMAX_BITS, MAX_BITS, NAN_BITS, E5M2, FAST_DIV,
                         SPECIALS)
        tl.store(enc + off, e.to(tl.uint8), mask=mask)


@triton.jit
def _fp8_wire_tile_kernel(tab, ntab, SRC: tl.constexpr, E5M2: tl.constexpr,
                          FMAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr,
                          NAN_BITS: tl.constexpr, REC: tl.constexpr, BR: tl.constexpr,
                          BC: tl.constexpr, RB: tl.constexpr, FAST_DIV: tl.constexpr,
                          STEPS: tl.constexpr):
    # fp8_wire_kernel for blocks of BR x BC (powers of two, BC <= 256) of
    # many tensors at once, the way fp8_tile_kernel encodes: the amax and
    # the top (inf and NaN included) in the first read, then _tile_encode
    # (Fp8Divider's quotient for 16-bit sources, the hardware's
    # round-to-nearest-even conversion, the specials explicitly only in a
    # block that has them). `tab`: a row per tensor (int64 x 8): its
    # source's address, rows, cols, blocks a row of blocks, its encodings'
    # and its scales' addresses, its first block in the launch (the rows
    # in that order), 0. A program finds its tensor by a binary search of
    # STEPS (ceil(log2(ntab))) over the first blocks.
    pid = tl.program_id(0).to(tl.int64)
    lo = pid * 0
    hi = lo + ntab - 1
    for _ in range(STEPS):
        mid = (lo + hi + 1) // 2
        up = tl.load(tab + mid * 8 + 6) <= pid
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid - 1)
    row = tab + lo * 8
    if SRC == 0:
        src = tl.load(row + 0).to(tl.pointer_type(tl.int32))
    else:
        src = tl.load(row + 0).to(tl.pointer_type(tl.int16))
    rows = tl.load(row + 1)
    cols = tl.load(row + 2)
    n_bc = tl.load(row + 3)
    enc = tl.load(row + 4).to(tl.pointer_type(tl.uint8))
    scales = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    blk = pid - tl.load(row + 6)
    bi = blk // n_bc
    r0 = bi * BR
    c0 = (blk - bi * n_bc) * BC
    pr = tl.minimum(rows - r0, BR).to(tl.int32)
    pc = tl.minimum(cols - c0, BC).to(tl.int32)
    base = r0 * cols + c0
    rr0 = tl.arange(0, RB)[:, None]
    cc = tl.arange(0, BC)[None, :]
    am = tl.zeros([RB, BC], dtype=tl.int32)
    top = tl.zeros([RB, BC], dtype=tl.int32)
    for r in range(0, pr, RB):
        u, off, mask = _wire_tile(src, base, cols, r + rr0, cc, pr, pc, SRC)
        a = u & 0x7FFFFFFF
        am = tl.maximum(am, tl.where(a < 0x7F800000, a, 0))
        top = tl.maximum(top, a)
    amb = tl.max(tl.max(am, axis=1), axis=0)
    topb = tl.max(tl.max(top, axis=1), axis=0)
    fmax = (tl.zeros([1, 1], dtype=tl.int32) + FMAX_BITS).to(tl.float32, bitcast=True)
    amv = (tl.zeros([1, 1], dtype=tl.int32) + amb).to(tl.float32, bitcast=True)
    d = tl.math.div_rn(amv, fmax)
    d = tl.where(d == 0.0, 1.0, d)
    if topb < 0x7F800000:
        _wire_tile_pass(src, enc, base, cols, pr, pc, rr0, cc, d, SRC, RB, FMAX_BITS,
                        MAX_BITS, NAN_BITS, E5M2, FAST_DIV, False)
    else:
        _wire_tile_pass(src, enc, base, cols, pr, pc, rr0, cc, d, SRC, RB, FMAX_BITS,
                        MAX_BITS, NAN_BITS, E5M2, FAST_DIV, True)
    if REC:
        stored = tl.math.div_rn(tl.zeros([1, 1], dtype=tl.float32) + 1.0, d)
    else:
        stored = d
    tl.store(scales + blk + tl.zeros([1, 1], dtype=tl.int64), stored)


# The kernels the launcher calls.
fp8_receipt_kernel = _fp8_receipt_kernel
fp8_tile_kernel = _fp8_tile_kernel
fp8_wire_kernel = _fp8_wire_kernel
fp8_wire_tile_kernel = _fp8_wire_tile_kernel
