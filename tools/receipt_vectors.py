#!/usr/bin/env python3
"""Writes tests/vectors/receipts.json: receipts (docs/protocol.md,
"Receipts") of small updates, computed here with plain Python integers and
nothing from the production code (not common/checksum.h, not
weightsync.receipts, not common/dtype.cc), so that a bug in one of those
can't agree with itself. client/receipts_test.cc (C++: ExpectedReceipt and
RunTerms) and client/python/tests/test_receipt_vectors.py (numpy, and the
torch-style int code on numpy) assert every case.

    python3 tools/receipt_vectors.py --write tests/vectors/receipts.json
    python3 tools/receipt_vectors.py --check tests/vectors/receipts.json
"""

import argparse
import json
import sys

M32 = (1 << 32) - 1
M64 = (1 << 64) - 1
SIZES = {"INT8": 1, "UINT8": 1, "BOOL": 1, "INT16": 2, "FLOAT16": 2, "BFLOAT16": 2,
         "INT32": 4, "FLOAT32": 4, "INT64": 8, "FLOAT64": 8}
FLOATS = ("FLOAT32", "BFLOAT16", "FLOAT16")


# --- The function, spelled out ------------------------------------------------

def fnv1a64(name):
    h = 0xCBF29CE484222325
    for c in name.encode():
        h = ((h ^ c) * 0x100000001B3) & M64
    return h


def salt32(name):
    h = fnv1a64(name)
    return (h ^ (h >> 32)) & M32


def key(s, i):
    return (s + (i & M32) * 0x9E3779B1 + (i >> 32) * 0x85EBCA77) & M32


def bits32(b):
    return ((b & M32) ^ ((b >> 32) * 0x27D4EB2F)) & M32


def mix32(x):
    x ^= x >> 16
    y = (x * 0x85EBCA6B) & M32
    return y ^ (y >> 16)


def term(name, i, b):
    return mix32(bits32(b) ^ key(salt32(name), i))


# --- Conversions (the rules of common/dtype.cc, on integers) -----------------

def f32_of(bits, dtype):
    """float32 bits of an element of `dtype` (float)."""
    if dtype == "FLOAT32":
        return bits
    if dtype == "BFLOAT16":
        return bits << 16
    sign, exp, mant = (bits & 0x8000) << 16, (bits >> 10) & 0x1F, bits & 0x3FF
    if exp == 0x1F:
        return sign | 0x7F800000 | (mant << 13)   # inf, NaN with its payload
    if exp == 0:
        if mant == 0:
            return sign
        e = 127 - 15 + 1
        while not mant & 0x400:
            mant <<= 1
            e -= 1
        return sign | (e << 23) | ((mant & 0x3FF) << 13)
    return sign | ((exp + 127 - 15) << 23) | (mant << 13)


def round_shift(m, shift):
    """m >> shift rounded to nearest, ties to even."""
    q, r, half = m >> shift, m & ((1 << shift) - 1), 1 << (shift - 1)
    return q + (r > half or (r == half and q & 1))


def from_f32(u, dtype):
    if dtype == "FLOAT32":
        return u
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if dtype == "BFLOAT16":
        if nan:
            return (u >> 16) | 0x40
        return round_shift(u, 16) & 0xFFFF   # overflow rounds into inf, as the bits do
    sign, x = (u >> 16) & 0x8000, u & 0x7FFFFFFF
    if x >= 0x7F800000:
        return sign | 0x7C00 | (0x200 if nan else 0)
    biased = x >> 23
    if biased - 127 >= 16:
        return sign | 0x7C00
    if biased - 127 < -14:
        # A float16 subnormal (or zero): value / 2^-24 = mant * 2^(E - 126),
        # mant with its hidden bit (a float32 denormal: E = 1, none).
        mant = (x & 0x7FFFFF) | (0x800000 if biased else 0)
        shift = 126 - max(biased, 1)
        return sign | (round_shift(mant, shift) if shift <= 40 else 0)
    h = round_shift(((biased - 127 + 15) << 23) | (x & 0x7FFFFF), 13)
    return sign | min(h, 0x7C00)


def convert(bits, src, dst):
    if src == dst:
        return bits
    assert src in FLOATS and dst in FLOATS, (src, dst)
    return from_f32(f32_of(bits, src), dst)


# --- Cases --------------------------------------------------------------------

class Rng:
    def __init__(self, seed):
        self.x = seed

    def next(self, bits):
        self.x = (self.x * 6364136223846793005 + 1442695040888963407) & M64
        return self.x >> (64 - bits)


SPECIAL_F32 = [
    0x7FC00000, 0x7F800001, 0xFFC12345, 0x7FBFFFFF,   # NaNs: quiet, signalling, payloads
    0x7F800000, 0xFF800000, 0x00000000, 0x80000000,   # infinities, zeros
    0x00000001, 0x807FFFFF, 0x00400000,               # float32 denormals
    0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F808001,   # bfloat16 ties (even, odd), near ties
    0x7F7FFFFF, 0x7F7F8000, 0xFF7FFFFF,               # max float: bfloat16 rounds to inf
    0x477FE000, 0x477FF000, 0x477FEFFF, 0x47800000,   # float16 max, overflow edge
    0x38800000, 0x387FC000, 0x33800000, 0x33000000, 0x33000001, 0x32FFFFFF,  # float16 subnormals
    0x3A801000, 0x3A803000, 0x3F801000, 0x3F803000,   # float16 ties
    0x3F800000, 0xC0490FDB,
]
SPECIAL_F16 = [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFD55, 0x0001, 0x03FF, 0x8200, 0x7BFF, 0x3C00,
               0x0000, 0x8000]
SPECIAL_BF16 = [0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFA5, 0x0001, 0x807F, 0x7F7F, 0x3F80, 0x0000,
                0x4780, 0x3380]


def tensor(name, dtype, shape, rng, specials=()):
    n = 1
    for d in shape:
        n *= d
    es = SIZES[dtype]
    vals = [rng.next(8 * es) for _ in range(n)]
    for k, v in enumerate(specials[:n]):
        vals[k] = v
    return {"name": name, "dtype": dtype, "shape": list(shape), "elements": vals}


def segment(source, rb, rc, cb, cc, dest, stride=0):
    return {"source": source, "rowBegin": rb, "rowCount": rc, "colBegin": cb, "colCount": cc,
            "destOffset": dest, "destRowStride": stride}


def param(name, dtype, shape, segments=()):
    return {"name": name, "dtype": dtype, "shape": list(shape), "segments": list(segments)}


def expect(tensors, layout):
    by_name = {t["name"]: t for t in tensors}
    total = params = nbytes = 0
    for p in layout:
        dst, es = p["dtype"], SIZES[p["dtype"]]
        runs = []   # (source tensor, first source element, first dest index, n)
        if not p["segments"]:
            if p["name"] in by_name:
                t = by_name[p["name"]]
                runs.append((t, 0, 0, len(t["elements"])))
        for s in p["segments"]:
            if s["source"] not in by_name:
                continue
            t = by_name[s["source"]]
            cols = 1
            for d in t["shape"][1:]:
                cols *= d
            stride = s["destRowStride"] or s["colCount"]
            for r in range(s["rowCount"]):
                runs.append((t, (s["rowBegin"] + r) * cols + s["colBegin"],
                             s["destOffset"] + r * stride, s["colCount"]))
            if s["rowCount"] * s["colCount"] == 0:
                runs.append((t, 0, 0, 0))   # still counts the parameter
        for t, src, dest, n in runs:
            for k in range(n):
                b = convert(t["elements"][src + k], t["dtype"], dst)
                total = (total + term(p["name"], dest + k, b)) & M64
            nbytes += n * es
        params += bool(runs)
    return total, params, nbytes


def cases():
    rng = Rng(20240601)
    out = []

    def add(name, tensors, layout):
        c, p, b = expect(tensors, layout)
        out.append({"name": name,
                    "tensors": [{"name": t["name"], "dtype": t["dtype"], "shape": t["shape"],
                                 "hex": b"".join(v.to_bytes(SIZES[t["dtype"]], "little")
                                                 for v in t["elements"]).hex()}
                                for t in tensors],
                    "layout": layout,
                    "checksum": f"{c:016x}", "parameters": p, "bytes": b})

    for dtype, shape in (("INT8", (37,)), ("BFLOAT16", (5, 7)), ("FLOAT16", (3, 11)),
                         ("FLOAT32", (4, 9)), ("INT64", (13,)), ("FLOAT64", (2, 5))):
        t = tensor("w", dtype, shape, rng)
        add(f"whole {dtype}", [t], [param("w", dtype, shape)])
    f32 = tensor("x", "FLOAT32", (len(SPECIAL_F32) // 4 + 1, 4), rng, SPECIAL_F32)
    for dst in ("BFLOAT16", "FLOAT16"):
        add(f"FLOAT32 -> {dst}, special values", [f32], [param("x", dst, f32["shape"])])
    f16 = tensor("h", "FLOAT16", (4, 6), rng, SPECIAL_F16)
    bf16 = tensor("h", "BFLOAT16", (4, 6), rng, SPECIAL_BF16)
    for src, dst in (("FLOAT16", "FLOAT32"), ("FLOAT16", "BFLOAT16"),
                     ("BFLOAT16", "FLOAT32"), ("BFLOAT16", "FLOAT16")):
        t = f16 if src == "FLOAT16" else bf16
        add(f"{src} -> {dst}, special values", [t], [param("h", dst, (4, 6))])

    # A fused parameter fed by two sources side by side (strided rows), and
    # a row block of a third one converted.
    a = tensor("a", "FLOAT32", (6, 10), rng)
    b = tensor("b", "BFLOAT16", (6, 4), rng)
    c = tensor("c", "FLOAT32", (8, 3), rng, SPECIAL_F32)
    add("strided segments", [a, b, c], [
        param("fused", "BFLOAT16", (6, 20),
              [segment("a", 0, 6, 2, 7, 1, 20), segment("b", 0, 6, 0, 4, 9, 20)]),
        param("rows", "FLOAT16", (3, 3), [segment("c", 4, 3, 0, 3, 0)]),
        param("cols", "FLOAT32", (8, 2), [segment("c", 0, 8, 1, 2, 0, 0)]),
    ])

    # Element indices past 2^32: lo32 wraps inside a row, and hi32 > 1.
    big = tensor("big", "INT32", (3, 5), rng)
    big8 = tensor("big8", "INT64", (2, 3), rng)
    big1 = tensor("big1", "UINT8", (2, 40), rng)
    add("indices past 2^32", [big, big8, big1], [
        param("huge", "INT32", (1 << 33,), [segment("big", 0, 3, 0, 5, (1 << 32) - 7, 6)]),
        param("huge8", "INT64", (1 << 36,), [segment("big8", 0, 2, 0, 3, 5 * (1 << 32) + 1, 3)]),
        param("huge1", "UINT8", (1 << 34,), [segment("big1", 0, 2, 0, 40, (1 << 33) - 20, 40)]),
    ])

    # Several parameters; one fed by a tensor not sent (not counted), one
    # unsegmented and not sent, one partly fed.
    p1 = tensor("p1", "BFLOAT16", (16,), rng)
    p2 = tensor("p2", "FLOAT32", (4, 4), rng)
    add("several parameters", [p1, p2], [
        param("p1", "BFLOAT16", (16,)),
        param("p2", "BFLOAT16", (4, 4)),
        param("absent", "FLOAT32", (3,)),
        param("fed_by_absent", "FLOAT32", (2, 2), [segment("gone", 0, 2, 0, 2, 0)]),
        param("partly", "FLOAT32", (8, 4),
              [segment("p2", 0, 4, 0, 4, 0), segment("gone", 0, 4, 0, 4, 16)]),
    ])

    terms = []
    for name, i, b in (("", 0, 0), ("layer.0.weight", 1, 0x3F80),
                       ("x", (1 << 32) - 1, 0xFFFFFFFF), ("x", 1 << 32, 0x0123456789ABCDEF),
                       ("model.embed_tokens.weight", 0xFEDCBA9876543210, 0x8000000000000000)):
        terms.append({"name": name, "index": str(i), "bits": f"{b:016x}",
                      "term": f"{term(name, i, b):08x}"})
    return out, terms


def document():
    out, terms = cases()
    return {
        "function": "receipt v3: term = mix32(bits32(e) ^ key(p, i)), "
                    "mix32(x) = y ^ (y >> 16) with y = x * 0x85EBCA6B mod 2^32, "
                    "checksum = sum of terms mod 2^64 (docs/protocol.md, Receipts)",
        "generator": "tools/receipt_vectors.py",
        "terms": terms,
        "cases": out,
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
