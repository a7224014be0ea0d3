#!/usr/bin/env python3
"""The Triton receipt kernel (weightsync.receipts.gpu) against the numpy
reference (weightsync.receipts.expected_receipt) on one GPU: random
tensors of every dtype pair (special float32 values among them: NaNs,
infinities, denormals, rounding ties for bfloat16 and float16), segment
shapes from narrow rows to wide strided blocks, indices past 2^32, many
small parameters, aligned blocks whose indices cross 2^32, several
layouts in one call on a side stream; then the speed over 4 GB of
bfloat16 and over Qwen3-8B's 399 bfloat16 tensors (16.4 GB, one layout,
checked against the torch fallback), a repeated call (cached tables) and
the first (tables built). Prints a summary; exits 1 on any mismatch.
CHECK_RECEIPTS_TUNE=1 also times other tile shapes on Qwen3-8B.

    python3 tests/gpu/check_receipts_gpu.py
"""

import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "client", "python"))

from weightsync import receipts  # noqa: E402
from weightsync.receipts import gpu as receipts_gpu  # noqa: E402
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
              "tiny": (1, 1), "grid": (64, 8192)}
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
        # Aligned: whole rows merged into one run whose indices cross 2^32
        # inside a tile; a 16-byte-aligned strided block with a row tail.
        param("grid.t", dst, (1 << 33,), [seg("grid", 0, 64, 0, 8192, (1 << 32) - 200000)]),
        param("grid.block", dst, (40, 6000), [seg("grid", 3, 40, 8, 5000, 7, 6000)]),
        # Small runs (the small-region kernel): whole short rows merged, one
        # short row from inside a wide one.
        param("narrow.small", dst, (3, 7), [seg("narrow", 10, 3, 0, 7, 0)]),
        param("mid.row", dst, (40,), [seg("mid", 5, 1, 10, 30, 4)]),
    ]
    return layout, host, gpu


def check_pairs(rng):
    bad, checked = [], 0
    floats = ("FLOAT32", "BFLOAT16", "FLOAT16")
    pairs = [(s, d) for s in floats for d in floats] + [(t, t) for t in ("INT32", "INT64", "UINT8")]
    for src, dst in pairs:
        layout, host, gpu = case(rng, src, dst)
        want = receipts.expected_receipt(layout, host)
        try:
            got = receipts_gpu.expected_receipts_gpu({"x": layout}, gpu)["x"]
        except Exception as e:  # noqa: BLE001 - reported as a mismatch
            got = f"error {e!r}"[:2000]
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


QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "model_type": "qwen3", "tie_word_embeddings": False}  # bench/


def qwen3_8b():
    """Qwen3-8B's bfloat16 tensors on the GPU (as bench/python_ipc_bench.py
    sends them) and the layout of an engine that registered them whole."""
    from weightsync import layouts
    shapes = layouts.checkpoint_shapes(QWEN3_8B)
    sent = {}
    for name, shape in shapes:
        n = int(np.prod(shape))
        sent[name] = ("BFLOAT16", list(shape),
                      torch.randint(-32768, 32767, (n,), dtype=torch.int16, device="cuda"))
    return sent, [param(name, "BFLOAT16", shape) for name, shape in shapes]


def timed(fn, reps):
    """Best wall seconds of `fn` (which waits for its GPU work)."""
    walls = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
    return min(walls)


def kernel_seconds(fn):
    """GPU seconds of the receipt kernels in one call of `fn` (profiler),
    None where the profiler can't say."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
        us = sum(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
                 for e in prof.key_averages() if "receipt" in e.key)
        return us / 1e6 or None
    except Exception:  # noqa: BLE001 - the figure is informative only
        return None


def qwen_speed(sent, layout):
    """Checks the Qwen3-8B receipt against the torch fallback; returns
    (mismatch or None, the receipt, GB/s, seconds of a repeated call, of its
    kernel, of the first call)."""
    nbytes = sum(e[2].numel() * 2 for e in sent.values())
    layouts = {0: layout}
    receipts_gpu.expected_receipts_gpu(layouts, sent)   # compile
    receipts_gpu.configure()                            # drop the tables
    torch.cuda.synchronize()
    t = time.perf_counter()
    got = receipts_gpu.expected_receipts_gpu(layouts, sent)[0]
    first = time.perf_counter() - t
    call = lambda: receipts_gpu.expected_receipts_gpu(layouts, sent)  # noqa: E731
    wall = timed(call, 10)
    gpu = kernel_seconds(call) or float("nan")
    want = receipts.arrays.receipt_by_ops(layout, sent, None, 1 << 24)
    bad = None if got == want else f"Qwen3-8B: {got} != {want} (torch fallback)"
    return bad, want, nbytes / wall / 1e9, wall, gpu, first


def tune(sent, layout, want):
    """With CHECK_RECEIPTS_TUNE=1: Qwen3-8B under other tile shapes and
    fast-path variants (receipts_gpu.configure), registers and spills."""
    nbytes = sum(e[2].numel() * 2 for e in sent.values())
    layouts = {0: layout}
    call = lambda: receipts_gpu.expected_receipts_gpu(layouts, sent)  # noqa: E731
    default = (receipts_gpu.BLOCK, receipts_gpu.ITERS, receipts_gpu.NUM_WARPS,
               receipts_gpu.SPLIT, receipts_gpu.REL)
    for cfg in [(4096, 16, 4, False, False), (4096, 16, 2, True, True),
                (8192, 16, 4, True, True), (8192, 8, 8, True, True), (2048, 32, 4, True, True)]:
        try:
            receipts_gpu.configure(*cfg)
            got = call()[0]
            w = timed(call, 5)
            k = kernel_seconds(call) or float("nan")
            c = receipts_gpu.compiled[("BFLOAT16", "BFLOAT16")]
            print(f"tune: {cfg} {w * 1e3:.2f} ms = {nbytes / w / 1e9:.0f} GB/s, kernel "
                  f"{k * 1e3:.2f} ms, {'ok' if got == want else 'MISMATCH'}, "
                  f"{getattr(c, 'n_regs', '?')} registers, {getattr(c, 'n_spills', '?')} spills",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported
            print(f"tune: {cfg} failed: {e!r}"[:1500], flush=True)
    receipts_gpu.configure(*default)


def main():
    if not receipts_gpu.available():
        print("check_receipts_gpu: FAIL: triton is not importable")
        return 1
    rng = np.random.default_rng(5)
    bad, pairs = check_pairs(rng)
    bad += check_many_layouts_on_a_stream(rng)
    gbs, best = speed()
    sent, layout = qwen3_8b()
    qbad, want, qgbs, qwall, qgpu, qfirst = qwen_speed(sent, layout)
    bad += [qbad] if qbad else []
    if os.environ.get("CHECK_RECEIPTS_TUNE"):
        tune(sent, layout, want)
    for b in bad:
        print("mismatch:", b)
    status = "OK" if not bad else f"FAIL ({len(bad)} mismatches)"
    print(f"check_receipts_gpu: {status}: {pairs} dtype pairs, 3 layouts of 20k parameters; "
          f"4 GB bfloat16 in {best * 1e3:.2f} ms = {gbs:.0f} GB/s; Qwen3-8B (399 tensors, "
          f"16.4 GB) in {qwall * 1e3:.2f} ms = {qgbs:.0f} GB/s (kernel {qgpu * 1e3:.2f} ms, the "
          f"rest {(qwall - qgpu) * 1e3:.2f} ms; first call {qfirst * 1e3:.1f} ms) on "
          f"{torch.cuda.get_device_name()}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
