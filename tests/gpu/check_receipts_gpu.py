#!/usr/bin/env python3
"""The Triton receipt kernel (weightsync.receipts_gpu) against the numpy
reference (weightsync.receipts.expected_receipt) on one GPU: random
tensors of every dtype pair (special float32 values among them: NaNs,
infinities, denormals, rounding ties for bfloat16 and float16), segment
shapes from narrow rows to wide strided blocks, indices past 2^32, many
small parameters, several layouts in one call on a side stream; then the
speed over 4 GB of bfloat16. Prints one summary line; exits 1 on any
mismatch.

    python3 tests/gpu/check_receipts_gpu.py
"""

import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "client", "python"))

from weightsync import receipts, receipts_gpu  # noqa: E402
from weightsync._proto import v1  # noqa: E402

TORCH = {"FLOAT32": torch.float32, "BFLOAT16": torch.int16, "FLOAT16": torch.float16,
         "INT32": torch.int32, "INT64": torch.int64, "UINT8": torch.uint8}
SIZE = {"FLOAT32": 4, "BFLOAT16": 2, "FLOAT16": 2, "INT32": 4, "INT64": 8, "UINT8": 1}
SPECIAL_F32 = [0x7FC00000, 0x7F800001, 0xFFC12345, 0x7F800000, 0xFF800000, 0x00000001,
               0x807FFFFF, 0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x477FF000, 0x477FEFFF,
               0x33000000, 0x33000001, 0x387FC000, 0x3A801000, 0x3A803000, 0x80000000]
SPECIAL_16 = [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFD55, 0x0001, 0x03FF, 0x7F80, 0x7FC0, 0x7F81,
              0xFFA5, 0x807F]


def random_bytes(rng, dtype, n):
    raw = rng.integers(0, 256, n * SIZE[dtype], dtype=np.uint8)
    special = SPECIAL_F32 if dtype == "FLOAT32" else SPECIAL_16 if SIZE[dtype] == 2 else []
    view = raw.view(f"u{SIZE[dtype]}")
    for k, v in enumerate(special[:n]):
        view[(k * 7919) % n] = v
    return raw


def param(name, dtype, shape, segments=()):
    p = v1.Parameter(name=name, dtype=getattr(v1, dtype), shape=list(shape))
    for s in segments:
        p.segments.add(**s)
    return p


def seg(source, rb, rc, cb, cc, dest, stride=0):
    return dict(source=source, row_begin=rb, row_count=rc, col_begin=cb, col_count=cc,
                dest_offset=dest, dest_row_stride=stride)


def case(rng, src, dst):
    """A layout of every segment shape for one dtype pair, and what was sent."""
    shapes = {"wide": (3, 70001), "narrow": (5000, 7), "mid": (900, 600), "vec": (12345,),
              "tiny": (1, 1)}
    host, gpu = {}, {}
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        raw = random_bytes(rng, src, n)
        host[name] = (src, shape, raw)
        gpu[name] = (src, shape, torch.from_numpy(raw.view(np.dtype(f"u{SIZE[src]}")).copy()
                                                  .view(np.int64 if SIZE[src] == 8 else
                                                        f"i{SIZE[src]}" if SIZE[src] > 1
                                                        else np.uint8)).cuda())
    layout = [
        param("vec", dst, (12345,)),
        param("tiny", dst, (1,)),
        param("wide.t", dst, (3, 140002), [seg("wide", 0, 3, 0, 70001, 0, 140002),
                                           seg("wide", 0, 3, 1, 70000, 70001, 140002)]),
        param("narrow.t", dst, (2500, 7), [seg("narrow", 2500, 2500, 0, 7, 0)]),
        param("narrow.cols", dst, (5000, 3), [seg("narrow", 0, 5000, 2, 3, 0, 3)]),
        param("mid.block", dst, (1 << 33,), [seg("mid", 100, 700, 37, 501, (1 << 32) - 1000, 513)]),
        param("absent", dst, (4,), [seg("gone", 0, 1, 0, 4, 0)]),
    ]
    return layout, host, gpu


def check_pairs(rng):
    bad, checked = [], 0
    floats = ("FLOAT32", "BFLOAT16", "FLOAT16")
    pairs = [(s, d) for s in floats for d in floats] + [(t, t) for t in ("INT32", "INT64", "UINT8")]
    for src, dst in pairs:
        layout, host, gpu = case(rng, src, dst)
        want = receipts.expected_receipt(layout, host)
        got = receipts_gpu.expected_receipts_gpu({"x": layout}, gpu)["x"]
        checked += 1
        if got != want:
            bad.append(f"{src}->{dst}: {got} != {want}")
    return bad, checked


def check_many_layouts_on_a_stream(rng):
    n = 20000
    raw = rng.integers(0, 1 << 16, (n, 16), dtype=np.uint64).astype(np.uint16)
    host = {f"e{i}": ("BFLOAT16", (16,), raw[i].view(np.uint8)) for i in range(n)}
    dev = torch.from_numpy(raw.view(np.int16)).cuda()
    gpu = {f"e{i}": ("BFLOAT16", (16,), dev[i]) for i in range(n)}
    layouts = {
        "bf16": [param(f"e{i}", "BFLOAT16", (16,)) for i in range(n)],
        "fp32": [param(f"e{i}", "FLOAT32", (16,)) for i in range(0, n, 3)],
        "half": [param(f"e{i}", "FLOAT16", (2, 4), [seg(f"e{i}", 0, 2, 3, 4, 0)])
                 for i in range(0, n, 7)],
    }
    stream = torch.cuda.Stream()
    got = receipts_gpu.expected_receipts_gpu(layouts, gpu, stream=stream)
    bad = []
    for key, layout in layouts.items():
        want = receipts.expected_receipt(layout, host)
        if got[key] != want:
            bad.append(f"layout {key}: {got[key]} != {want}")
    return bad


def speed():
    n = (4 << 30) // 2
    x = torch.randint(-32768, 32767, (n,), dtype=torch.int16, device="cuda")
    sent = {"w": ("BFLOAT16", (n,), x)}
    layouts = {0: [param("w", "BFLOAT16", (n,))]}
    receipts_gpu.expected_receipts_gpu(layouts, sent)   # compile
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        receipts_gpu.expected_receipts_gpu(layouts, sent)
        times.append(time.perf_counter() - t)
    best = min(times)
    return (4 << 30) / best / 1e9, best


def main():
    if not receipts_gpu.available():
        print("check_receipts_gpu: FAIL: triton is not importable")
        return 1
    rng = np.random.default_rng(5)
    bad, pairs = check_pairs(rng)
    bad += check_many_layouts_on_a_stream(rng)
    gbs, best = speed()
    for b in bad:
        print("mismatch:", b)
    status = "OK" if not bad else f"FAIL ({len(bad)} mismatches)"
    print(f"check_receipts_gpu: {status}: {pairs} dtype pairs, 3 layouts of 20k parameters; "
          f"4 GB bfloat16 in {best * 1e3:.2f} ms = {gbs:.0f} GB/s on {torch.cuda.get_device_name()}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
