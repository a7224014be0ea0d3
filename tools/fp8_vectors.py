#!/usr/bin/env python3
"""Writes tests/vectors/fp8.json: the FP8 quantisation of FP8 targets
(docs/protocol.md, "FP8 targets") on special values and small blocks, and
the receipts of updates into FP8 engines, computed here with exact
rational arithmetic (fractions.Fraction: every float32 and FP8 rounding
done by comparing exact values against the format's grid), sharing
nothing with the production code (common/fp8.cc, weightsync/fp8.py), so
that a bug in one of those can't agree with itself. common/fp8_test.cc,
client/receipts_test.cc and client/python/tests/test_fp8.py assert every
case. The receipt terms come from tools/receipt_vectors.py (plain
integers, also independent of the production code).

    python3 tools/fp8_vectors.py --write tests/vectors/fp8.json
    python3 tools/fp8_vectors.py --check tests/vectors/fp8.json
"""

import argparse
import bisect
import json
import os
import struct
import sys
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import receipt_vectors as rv  # noqa: E402  (the receipt function, plain integers)

M64 = (1 << 64) - 1

# --- Exact values ---------------------------------------------------------
#
# A value is ("nan", sign), ("inf", sign) or ("num", sign, magnitude) with
# the magnitude a Fraction >= 0 (so -0 keeps its sign).


def f32_value(bits):
    sign = bits >> 31
    e, m = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if e == 0xFF:
        return ("nan", sign) if m else ("inf", sign)
    if e == 0:
        return ("num", sign, Fraction(m, 1 << 149))
    return ("num", sign, Fraction((1 << 23) | m) * Fraction(2) ** (e - 150))


def f16_value(bits):
    sign = bits >> 15
    e, m = (bits >> 10) & 0x1F, bits & 0x3FF
    if e == 0x1F:
        return ("nan", sign) if m else ("inf", sign)
    if e == 0:
        return ("num", sign, Fraction(m, 1 << 24))
    return ("num", sign, Fraction((1 << 10) | m) * Fraction(2) ** (e - 25))


def source_value(bits, dtype):
    if dtype == "FLOAT32":
        return f32_value(bits)
    if dtype == "BFLOAT16":
        return f32_value(bits << 16)
    return f16_value(bits)


def rne(x):
    """Fraction x >= 0 rounded to the nearest integer, ties to even."""
    n = x.numerator // x.denominator
    rest = x - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2):
        n += 1
    return n


def exponent(x):
    """e with 2^e <= x < 2^(e+1), for a Fraction x > 0."""
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** e > x:
        e -= 1
    while Fraction(2) ** (e + 1) <= x:
        e += 1
    return e


def to_f32(sign, mag):
    """float32 bits of sign * mag rounded to nearest even (overflow: inf)."""
    if mag == 0:
        return sign << 31
    e = max(exponent(mag), -126)
    m = rne(mag / Fraction(2) ** (e - 23))
    if m == 1 << 24:
        e, m = e + 1, m >> 1
    if e > 127:
        return (sign << 31) | 0x7F800000
    if m < 1 << 23:          # subnormal (e == -126)
        return (sign << 31) | m
    return (sign << 31) | ((e + 127) << 23) | (m - (1 << 23))


def f32_mag(bits):
    v = f32_value(bits)
    assert v[0] == "num", hex(bits)
    return v[2]


# --- FP8 grids ----------------------------------------------------------------

FORMATS = {
    # name: (exponent bits, mantissa bits, bias, NaN encoding, has inf)
    "FLOAT8_E4M3FN": (4, 3, 7, 0x7F, False),
    "FLOAT8_E5M2": (5, 2, 15, 0x7E, True),
}


def grid(fmt):
    """[(magnitude, encoding)] of every finite non-negative value, by value."""
    eb, mb, bias, _, has_inf = FORMATS[fmt]
    out = []
    for enc in range(0x80):
        e, m = enc >> mb, enc & ((1 << mb) - 1)
        if has_inf and e == (1 << eb) - 1:
            continue
        if not has_inf and enc == 0x7F:
            continue
        if e == 0:
            v = Fraction(m) * Fraction(2) ** (1 - bias - mb)
        else:
            v = Fraction((1 << mb) | m) * Fraction(2) ** (e - bias - mb)
        out.append((v, enc))
    return sorted(out)


GRIDS = {f: grid(f) for f in FORMATS}
VALUES = {f: [v for v, _ in GRIDS[f]] for f in FORMATS}
FMAX = {f: GRIDS[f][-1][0] for f in FORMATS}


def to_fp8(value, fmt):
    """The encoding of a value by the rule: NaN keeps its sign; |v| >= FMAX
    and inf saturate; otherwise the nearest grid value, ties to the even
    encoding."""
    nan_enc = FORMATS[fmt][3]
    if value[0] == "nan":
        return (value[1] << 7) | nan_enc
    sign = value[1]
    if value[0] == "inf" or value[2] >= FMAX[fmt]:
        return (sign << 7) | GRIDS[fmt][-1][1]
    mag = value[2]
    g = GRIDS[fmt]
    hi = bisect.bisect_left(VALUES[fmt], mag)   # g[hi - 1] < mag <= g[hi]
    if g[hi][0] == mag:
        return (sign << 7) | g[hi][1]
    (lo_v, lo_e), (hi_v, hi_e) = g[hi - 1], g[hi]
    if mag - lo_v < hi_v - mag or (mag - lo_v == hi_v - mag and lo_e % 2 == 0):
        return (sign << 7) | lo_e
    return (sign << 7) | hi_e


# --- The block function -------------------------------------------------------

def quantize_block(values, fmt, reciprocal):
    """(fp8 encodings, stored scale bits) of a block of values (exact, as
    the source elements widen to float32)."""
    finite = [v[2] for v in values if v[0] == "num"]
    amax = max(finite) if finite else Fraction(0)
    d_bits = to_f32(0, amax / FMAX[fmt])
    if f32_mag(d_bits) == 0:
        d_bits = 0x3F800000
    d = f32_mag(d_bits)
    out = []
    for v in values:
        if v[0] == "num":
            q = f32_value(to_f32(v[1], v[2] / d))   # IEEE float32 division
            out.append(to_fp8(q, fmt))
        else:
            out.append(to_fp8(v, fmt))              # inf / d = inf; NaN
    stored = to_f32(0, 1 / d) if reciprocal else d_bits
    return out, stored


def quantize_matrix(values, rows, cols, br, bc, fmt, reciprocal):
    """values: row-major list. Returns (fp8 list, [stored scale bits] by
    block, row-major)."""
    q = [None] * (rows * cols)
    scales = []
    for r0 in range(0, rows, br):
        for c0 in range(0, cols, bc):
            idx = [r * cols + c for r in range(r0, min(rows, r0 + br))
                   for c in range(c0, min(cols, c0 + bc))]
            enc, s = quantize_block([values[i] for i in idx], fmt, reciprocal)
            for i, e in zip(idx, enc):
                q[i] = e
            scales.append(s)
    return q, scales


# --- Cases ----------------------------------------------------------------

def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


ROUND_F32 = [
    0x00000000, 0x80000000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7F800000, 0xFF800000,
    0x00000001, 0x807FFFFF, 0x3F800000, 0xBF800000,
    f32_bits(448.0), f32_bits(-448.0), f32_bits(464.0), f32_bits(463.99),
    f32_bits(449.0), f32_bits(480.0), f32_bits(1e9), 0x7F7FFFFF,
    f32_bits(57344.0), f32_bits(61440.0), f32_bits(61439.0), f32_bits(65504.0),
    # e4m3fn ties: 1 + 1/16 (between 1 and 1.125: to 1), 1 + 3/16 (to 1.25)
    f32_bits(1.0625), f32_bits(1.1875), f32_bits(-1.0625), f32_bits(1.0625 + 2 ** -20),
    # e5m2 ties: 1 + 1/8 (to 1), 1 + 3/8 (to 1.5)
    f32_bits(1.125), f32_bits(1.375),
    # the least subnormals and the normal boundary
    f32_bits(2.0 ** -9), f32_bits(2.0 ** -10), f32_bits(3 * 2.0 ** -11),
    f32_bits(2.0 ** -10 + 2 ** -30), f32_bits(2.0 ** -6), f32_bits(2.0 ** -6 - 2.0 ** -10),
    f32_bits(15 * 2.0 ** -10), f32_bits(2.0 ** -16), f32_bits(2.0 ** -17),
    f32_bits(3 * 2.0 ** -18), f32_bits(2.0 ** -14), f32_bits(7 * 2.0 ** -17),
    f32_bits(2.0 ** -14 - 2.0 ** -18), f32_bits(1e-30), f32_bits(-1e-30),
    f32_bits(240.0), f32_bits(248.0), f32_bits(232.0), f32_bits(0.1), f32_bits(-3.3),
]


class Rng:
    def __init__(self, seed):
        self.x = seed

    def next(self, bits):
        self.x = (self.x * 6364136223846793005 + 1442695040888963407) & M64
        return self.x >> (64 - bits)

    def normal_f32(self, scale_exp):
        """float32 bits of a value of moderate spread around 2^scale_exp."""
        m = self.next(23)
        e = 127 + scale_exp - self.next(3)
        return (self.next(1) << 31) | (e << 23) | m


SIZES = {"FLOAT32": 4, "BFLOAT16": 2, "FLOAT16": 2}


def to_source(bits32, dtype):
    """Source bits of dtype from float32 bits (truncation: any bits will do
    as test data)."""
    if dtype == "FLOAT32":
        return bits32
    if dtype == "BFLOAT16":
        return bits32 >> 16
    v = struct.unpack("<f", struct.pack("<I", bits32))[0]
    try:
        return struct.unpack("<H", struct.pack("<e", v))[0]
    except OverflowError:
        return 0x7BFF if v > 0 else 0xFBFF


def block_case(name, fmt, src, rows, cols, br, bc, reciprocal, elements, scheme="BLOCK"):
    values = [source_value(b, src) for b in elements]
    q, scales = quantize_matrix(values, rows, cols, br, bc, fmt, reciprocal)
    return {"name": name, "format": fmt, "scheme": scheme, "blockRows": br, "blockCols": bc,
            "scaleForm": "RECIPROCAL" if reciprocal else "DEQUANT", "srcDtype": src,
            "shape": [rows, cols],
            "hex": b"".join(b.to_bytes(SIZES[src], "little") for b in elements).hex(),
            "fp8": bytes(q).hex(),
            "scales": b"".join(s.to_bytes(4, "little") for s in scales).hex()}


def random_elements(rng, n, src, scale_exp=0):
    return [to_source(rng.normal_f32(scale_exp), src) for _ in range(n)]


def block_cases():
    rng = Rng(8)
    out = []
    for fmt in FORMATS:
        for src in ("FLOAT32", "BFLOAT16", "FLOAT16"):
            els = random_elements(rng, 5 * 7, src, 2)
            out.append(block_case(f"{fmt} {src} 5x7 in 2x3 blocks (partial edges)",
                                  fmt, src, 5, 7, 2, 3, False, els))
        # Special values in one block; the other block plain.
        specials = [0x7FC00000, 0xFFC00000, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
                    0x00000001, 0x80000003, f32_bits(3.0), f32_bits(-1.5), f32_bits(1e-3),
                    f32_bits(2.5e-7)]
        els = specials + random_elements(rng, 12, "FLOAT32", -3)
        out.append(block_case(f"{fmt} specials: NaN, inf ignored by amax, zeros, denormals",
                              fmt, "FLOAT32", 4, 6, 4, 3, False, els))
        out.append(block_case(f"{fmt} specials, reciprocal scales", fmt, "FLOAT32", 4, 6, 4, 3,
                              True, els))
        # Blocks of zeros (scale 1), of -0, of NaN only, of inf only.
        els = [0] * 4 + [0x80000000] * 4 + [0x7FC00000] * 4 + [0xFF800000] * 4
        out.append(block_case(f"{fmt} zero, -0, NaN and inf blocks", fmt, "FLOAT32", 4, 4, 1, 4,
                              True, els))
        # Tiny blocks: amax / FMAX underflows (scale 1) or lands in the
        # float32 denormals (reciprocal overflows to inf).
        els = [0x00000005, 0x80000002, 0x00000001, 0x00000000,
               0x00800000, 0x00400000, 0x80200001, 0x00000010]
        for rec in (False, True):
            out.append(block_case(f"{fmt} tiny blocks, reciprocal={rec}", fmt, "FLOAT32", 2, 4,
                                  1, 4, rec, els))
        # Large values: bfloat16 and float16 extremes.
        els = [0x7F7F, 0xFF7F, 0x4780, 0x3F80, 0x0001, 0x8001, 0x7F80, 0x7FC1]
        out.append(block_case(f"{fmt} bfloat16 extremes", fmt, "BFLOAT16", 2, 4, 2, 2, False,
                              els))
        els = [0x7BFF, 0xFBFF, 0x0001, 0x03FF, 0x3C00, 0xBC00, 0x7C00, 0x7E00]
        out.append(block_case(f"{fmt} float16 extremes", fmt, "FLOAT16", 2, 4, 2, 2, False,
                              els))
        # Per row: one block per row of the whole width.
        els = random_elements(rng, 3 * 9, "BFLOAT16", 5)
        out.append(block_case(f"{fmt} per row", fmt, "BFLOAT16", 3, 9, 1, 9, False, els,
                              scheme="PER_ROW"))
    # Values chosen so that x / d lands on FP8 ties: amax = 448 (d = 1).
    els = [f32_bits(v) for v in (448.0, 1.0625, 1.1875, 3 * 2.0 ** -11, 2.0 ** -10,
                                 -2.0 ** -10, 464.0 / 448 * 448, 17.0)]
    out.append(block_case("e4m3fn ties with d = 1", "FLOAT8_E4M3FN", "FLOAT32", 1, 8, 1, 8,
                          False, els))
    els = [f32_bits(v) for v in (57344.0, 1.125, 1.375, 3 * 2.0 ** -18, 2.0 ** -17,
                                 -2.0 ** -17, 61440.0 - 1, 40.0)]
    out.append(block_case("e5m2 ties with d = 1", "FLOAT8_E5M2", "FLOAT32", 1, 8, 1, 8, False,
                          els))
    # A 128 x 128 block grid, the checkpoint default, over 130 x 260.
    els = random_elements(rng, 130 * 136, "BFLOAT16", 0)
    out.append(block_case("e4m3fn 130x136 in 128x128 blocks", "FLOAT8_E4M3FN", "BFLOAT16",
                          130, 136, 128, 128, False, els))
    return out


def round_cases():
    out = []
    for fmt in FORMATS:
        for bits in ROUND_F32:
            out.append({"format": fmt, "f32": f"{bits:08x}",
                        "fp8": f"{to_fp8(f32_value(bits), fmt):02x}"})
    return out


# --- Receipts of FP8 engines ----------------------------------------------

def quant_receipt(tensors, layout):
    """(checksum, parameters, bytes) the daemon reports after installing
    `tensors` into `layout` (plain parameters as tools/receipt_vectors.py
    computes them; quantised ones: their FP8 elements where a sent source
    writes, and the scales of those blocks)."""
    by_name = {t["name"]: t for t in tensors}
    scales = {p["quantization"]["scaleParameter"] for p in layout if p.get("quantization")}
    plain = [p for p in layout if not p.get("quantization") and p["name"] not in scales]
    total, params, nbytes = rv.expect(tensors, plain)
    for p in layout:
        qz = p.get("quantization")
        if not qz:
            continue
        # A stacked weight [..., n, k] (experts): the matrix of its rows.
        cols = p["shape"][-1]
        rows = 1
        for d in p["shape"][:-1]:
            rows *= d
        per_row = qz.get("scheme") == "QUANT_SCHEME_PER_ROW"
        br, bc = (1, cols) if per_row else (qz.get("blockRows") or 128, qz.get("blockCols") or 128)
        values = [None] * (rows * cols)
        segs = p["segments"] or [rv.segment(p["name"], 0, 1, 0, rows * cols, 0)]
        for s in segs:
            t = by_name.get(s["source"])
            if t is None:
                continue
            tcols = 1
            for d in t["shape"][1:]:
                tcols *= d
            if not p["segments"]:
                tcols = rows * cols
            stride = s["destRowStride"] or s["colCount"]
            for r in range(s["rowCount"]):
                for c in range(s["colCount"]):
                    src = t["elements"][(s["rowBegin"] + r) * tcols + s["colBegin"] + c]
                    values[s["destOffset"] + r * stride + c] = source_value(src, t["dtype"])
        grid_cols = -(-cols // bc)
        wrote = False
        for r0 in range(0, rows, br):
            for c0 in range(0, cols, bc):
                idx = [r * cols + c for r in range(r0, min(rows, r0 + br))
                       for c in range(c0, min(cols, c0 + bc))]
                have = [values[i] is not None for i in idx]
                if not any(have):
                    continue
                assert all(have), "a segment cuts a block: not a valid case"
                enc, s = quantize_block([values[i] for i in idx], qz["format"],
                                        qz.get("scaleForm") == "SCALE_FORM_RECIPROCAL")
                for i, e in zip(idx, enc):
                    total = (total + rv.term(p["name"], i, e)) & M64
                b = (r0 // br) * grid_cols + c0 // bc
                total = (total + rv.term(qz["scaleParameter"], b, s)) & M64
                nbytes += len(idx) + 4
                wrote = True
        params += 2 * wrote
    return total, params, nbytes


def quant(fmt, scale, scheme="QUANT_SCHEME_BLOCK", br=0, bc=0, form="SCALE_FORM_DEQUANT"):
    return {"format": fmt, "scaleParameter": scale, "scheme": scheme, "blockRows": br,
            "blockCols": bc, "scaleForm": form}


def receipt_cases():
    rng = Rng(77)
    out = []

    def add(name, tensors, layout):
        c, p, b = quant_receipt(tensors, layout)
        out.append({"name": name,
                    "tensors": [{"name": t["name"], "dtype": t["dtype"], "shape": t["shape"],
                                 "hex": b"".join(v.to_bytes(rv.SIZES[t["dtype"]], "little")
                                                 for v in t["elements"]).hex()}
                                for t in tensors],
                    "layout": layout, "checksum": f"{c:016x}", "parameters": p, "bytes": b})

    def tensor(name, dtype, shape, scale_exp=0):
        n = shape[0] * shape[1]
        return {"name": name, "dtype": dtype, "shape": list(shape),
                "elements": [to_source(rng.normal_f32(scale_exp), dtype) for _ in range(n)]}

    w = tensor("w", "BFLOAT16", (6, 10), 3)
    add("whole parameter, 4x4 blocks, bfloat16 source", [w], [
        dict(rv.param("w", "FLOAT8_E4M3FN", (6, 10)),
             quantization=quant("FLOAT8_E4M3FN", "w_scale_inv", br=4, bc=4)),
        rv.param("w_scale_inv", "FLOAT32", (2, 3)),
    ])
    q = tensor("q", "FLOAT32", (8, 6), 1)
    k = tensor("k", "FLOAT32", (4, 6), -2)
    v = tensor("v", "FLOAT32", (4, 6), 4)
    n = tensor("norm", "FLOAT32", (1, 6))
    # TP rank 1 of 2 of a fused qkv: q rows 4..7, k rows 2..3, v rows 2..3,
    # blocks of 2 x 4 (row shards on block boundaries), e5m2, reciprocal.
    add("fused qkv shard, e5m2, reciprocal scales, a plain norm, side by side", [q, k, v, n], [
        dict(rv.param("qkv", "FLOAT8_E5M2", (8, 6), [
            rv.segment("q", 4, 4, 0, 6, 0, 6), rv.segment("k", 2, 2, 0, 6, 24, 6),
            rv.segment("v", 2, 2, 0, 6, 36, 6)]),
            quantization=quant("FLOAT8_E5M2", "qkv_scale", br=2, bc=4,
                               form="SCALE_FORM_RECIPROCAL")),
        rv.param("qkv_scale", "FLOAT32", (4, 2)),
        rv.param("norm", "BFLOAT16", (1, 6)),
        # Two sources side by side: the right one a block column from 4.
        dict(rv.param("side", "FLOAT8_E4M3FN", (4, 8), [
            rv.segment("q", 0, 4, 0, 4, 0, 8), rv.segment("k", 0, 4, 2, 4, 4, 8)]),
            quantization=quant("FLOAT8_E4M3FN", "side_scale", br=2, bc=4)),
        rv.param("side_scale", "FLOAT32", (2, 2)),
    ])
    # Row-parallel shard (a column block), per-row scales; k not sent.
    o = tensor("o", "FLOAT16", (5, 8), 2)
    add("row-parallel shard, per-row scales, a source not sent", [o], [
        dict(rv.param("o", "FLOAT8_E4M3FN", (5, 4), [rv.segment("o", 0, 5, 4, 4, 0, 4)]),
             quantization=quant("FLOAT8_E4M3FN", "o_scale", scheme="QUANT_SCHEME_PER_ROW")),
        rv.param("o_scale", "FLOAT32", (5, 1)),
        dict(rv.param("kk", "FLOAT8_E4M3FN", (2, 6), [rv.segment("k", 0, 2, 0, 6, 0, 6)]),
             quantization=quant("FLOAT8_E4M3FN", "kk_scale")),
        rv.param("kk_scale", "FLOAT32", (1, 1)),
    ])
    # Experts stacked as a fused MoE layer holds them: [2, 4, 6] in 2 x 4
    # blocks (each expert's 4 rows whole blocks), scales per matrix
    # [2, 2, 2]; the same experts per row into [2, 4, 6] with scales [2, 4].
    e0 = tensor("e0", "BFLOAT16", (4, 6), 1)
    e1 = tensor("e1", "FLOAT32", (4, 6), -3)
    experts = [rv.segment("e0", 0, 4, 0, 6, 0, 6), rv.segment("e1", 0, 4, 0, 6, 24, 6)]
    add("stacked experts, scales per matrix and per row", [e0, e1], [
        dict(rv.param("w13", "FLOAT8_E4M3FN", (2, 4, 6), experts),
             quantization=quant("FLOAT8_E4M3FN", "w13_scale", br=2, bc=4)),
        rv.param("w13_scale", "FLOAT32", (2, 2, 2)),
        dict(rv.param("w13_rows", "FLOAT8_E5M2", (2, 4, 6), experts),
             quantization=quant("FLOAT8_E5M2", "w13_rows_scale",
                                scheme="QUANT_SCHEME_PER_ROW")),
        rv.param("w13_rows_scale", "FLOAT32", (2, 4)),
    ])
    return out


def document():
    return {
        "function": "fp8 v1: per block amax = max |x| over finite x, d = amax / FMAX "
                    "(float32; 1 if 0), q = x / d (float32), round to nearest even into the "
                    "format, saturating at +-FMAX, NaN keeps its sign; stored scale d or "
                    "1/d (docs/protocol.md, FP8 targets)",
        "generator": "tools/fp8_vectors.py",
        "round": round_cases(),
        "blocks": block_cases(),
        "receipts": receipt_cases(),
    }


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--write")
    ap.add_argument("--check")
    args = ap.parse_args(argv)
    text = json.dumps(document(), indent=1) + "\n"
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
    if args.check:
        with open(args.check) as f:
            if f.read() != text:
                print(f"{args.check} is stale: regenerate it", file=sys.stderr)
                return 1
    if not args.write and not args.check:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
