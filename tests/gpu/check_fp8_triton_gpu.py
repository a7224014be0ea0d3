#!/usr/bin/env python3
"""The fused Triton kernel for FP8 targets' receipts (weightsync.receipts.fp8_gpu)
against the numpy reference (weightsync.fp8.quantized_receipt on host
copies) and the torch path: e4m3fn and e5m2, 128x128 blocks with partial
edges, odd blocks (64x32) and per row, DEQUANT and RECIPROCAL,
float32 / bfloat16 / float16 sources with NaN (both signs, payloads),
+-inf, zeros, subnormal and huge values, fused segments (on and off block
boundaries), strided and unsent segments; blocks of only zeros / NaN /
inf / subnormals / FLT_MAX; expected_receipt_arrays through the wire-in
(Triton on, and WEIGHTSYNC_FP8_TRITON=0); the fp8.json receipt vectors;
then TIME of the kernel against the torch path on a 4096 x 12288
bfloat16 weight. PASS/FAIL lines, ALL PASS at the end; a compile or
launch error is a FAIL with its message; exit 1 on any FAIL; a watchdog
ends it at 58 s.

    PYTHONPATH=client/python python3 tests/gpu/check_fp8_triton_gpu.py
"""

import faulthandler
import json
import os
import sys
import threading
import time
import traceback

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
sys.path.insert(0, HERE)

from google.protobuf import json_format  # noqa: E402

import check_fp8_receipts_gpu as base  # noqa: E402
from weightsync import _xp, receipts  # noqa: E402
from weightsync.receipts import fp8, fp8_gpu  # noqa: E402
from weightsync._proto import v1  # noqa: E402

DEV = base.DEV
FORMATS = base.FORMATS
param, quant, seg = base.param, base.quant, base.seg
FAILS = []


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name}{'' if ok else ' ' + detail}", flush=True)
    if not ok:
        FAILS.append(name)


ERRORS = []


def guarded(name, fn):
    """fn(); an exception (a Triton compile error too) is a FAIL with its
    message. After 3 of them the rest are FAILs without running (a compile
    error would repeat for every case and outlast the watchdog)."""
    if len(ERRORS) >= 3:
        check(name, False, "skipped after 3 errors (see the first)")
        return
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        ERRORS.append(msg)
        check(name, False, f"raised: {msg[-3000:]}")
        traceback.print_exc(limit=8)


def triton_sum(q, gpu):
    got = fp8_gpu.quantized_receipt_gpu(q, gpu)
    torch.cuda.synchronize()
    return got


def per_param(q, host, gpu):
    """Which parameters differ (for a FAIL's detail)."""
    bad = []
    for p in q:
        want = fp8.quantized_receipt([p], host)
        got = fp8_gpu.quantized_receipt_gpu([p], gpu)[:3]
        if got != want:
            bad.append(f"{p.name}: triton {got} numpy {want}")
    return "; ".join(bad)


def layout_of(fmt, rec):
    return [
        param("w", fmt, (300, 400), quant=quant(fmt, "w_s", (128, 128), rec)),
        param("w_s", "FLOAT32", (3, 4)),
        param("qkv", fmt, (640, 200), [
            seg("q", 0, 256, 0, 200, 0), seg("k", 0, 128, 0, 200, 256 * 200),
            seg("v", 0, 128, 0, 200, 384 * 200),
            seg("not sent", 0, 128, 0, 200, 512 * 200)],
            quant=quant(fmt, "qkv_s", (128, 128), rec)),
        param("qkv_s", "FLOAT32", (5, 2)),
        param("r", fmt, (77, 130), quant=quant(fmt, "r_s", None, rec)),
        param("r_s", "FLOAT32", (77, 1)),
        param("d", fmt, (300, 250), [seg("d", 3, 250, 1, 90, 7 * 250 + 30, 250)],
              quant=quant(fmt, "d_s", (128, 128), rec)),
        param("d_s", "FLOAT32", (3, 2)),
        param("odd", fmt, (200, 100), [seg("q", 0, 50, 0, 100, 0),
                                       seg("k", 5, 100, 7, 60, 50 * 100 + 3, 100),
                                       seg("v", 9, 40, 3, 100, 160 * 100)],
              quant=quant(fmt, "odd_s", (64, 32), rec)),
        param("odd_s", "FLOAT32", (4, 4)),
        param("norm", "BFLOAT16", (200,)),
    ]


def check_receipts(rng):
    for fmt in FORMATS:
        for rec in (False, True):
            for src_w, src_qkv in (("BFLOAT16", "FLOAT32"), ("FLOAT16", "BFLOAT16"),
                                   ("FLOAT32", "FLOAT16")):
                host, gpu = {}, {}
                for name, dtype, shape in (("w", src_w, (300, 400)), ("q", src_qkv, (256, 200)),
                                           ("k", src_qkv, (128, 200)),
                                           ("v", src_qkv, (128, 200)), ("r", src_w, (77, 130)),
                                           ("d", src_qkv, (260, 100)), ("norm", src_w, (200,))):
                    u = base.bits(rng, dtype, shape)
                    host[name] = (dtype, shape, np.ascontiguousarray(u).reshape(-1).view(np.uint8))
                    gpu[name] = (dtype, shape, base.on_gpu(u, dtype))
                layout = layout_of(fmt, rec)
                _, q, _ = fp8.split_layout(layout)
                name = f"triton receipt {fmt} {'RECIPROCAL' if rec else 'DEQUANT'} {src_w}/{src_qkv}"

                def run():
                    want = fp8.quantized_receipt(q, host)
                    got = triton_sum(q, gpu)
                    ok = got[:3] == want and got[3] == []
                    check(name + " == numpy (whole, fused, odd, strided, per-row, unsent)", ok,
                          f"triton {got[:3]} rest {[p.name for p in got[3]]} numpy {want}; "
                          + (per_param(q, host, gpu) if not ok else ""))
                    full_host = receipts.expected_receipt(layout, host)
                    receipts.fp8_triton_failed().clear()
                    full_gpu = receipts.expected_receipt_arrays(layout, gpu)
                    check(name + " expected_receipt_arrays(CUDA, Triton) == expected_receipt(host)",
                          full_gpu == full_host and not receipts.fp8_triton_failed(),
                          f"gpu {full_gpu} host {full_host} {receipts.fp8_triton_failed()}")
                    if rec and src_w == "BFLOAT16":
                        os.environ["WEIGHTSYNC_FP8_TRITON"] = "0"
                        try:
                            off = receipts.expected_receipt_arrays(layout, gpu)
                        finally:
                            del os.environ["WEIGHTSYNC_FP8_TRITON"]
                        check(name + " WEIGHTSYNC_FP8_TRITON=0 (torch path) == host",
                              off == full_host, f"gpu {off} host {full_host}")
                guarded(name, run)


def check_special_blocks():
    """Per-row blocks (and 8x16 blocks) each all of one kind: zeros, NaN,
    +-inf, subnormals only (d rounds to 0 -> 1, or to a subnormal d),
    FLT_MAX, FMAX exactly, a mix."""
    rows = [
        [0x00000000] * 16, [0x80000000] * 16, [0x7FC00000, 0xFFC00001] * 8,
        [0x7F800000, 0xFF800000] * 8, [0x00000001, 0x80000003] * 8,
        [0x007FFFFF, 0x00400000] * 8, [0x7F7FFFFF, 0xFF7FFFFF] * 8,
        [0x43E00000, 0x47600000] * 8, [0x3B800000, 0x00000001, 0x7FC00000, 0xFF800000] * 4,
        [0x1E000000 + 12345 * k for k in range(16)], [0x00800000 + 777 * k for k in range(16)],
        [0x0A000001 + 99991 * k for k in range(16)],
    ]
    u32 = np.array(rows, np.uint64).astype(np.uint32)
    r, c = u32.shape
    cases = {"FLOAT32": u32, "BFLOAT16": (u32 >> 16).astype(np.uint16),
             "FLOAT16": np.array([[x & 0xFFFF for x in row] for row in
                                  [[0, 0x8000] * 8, [0x7E00, 0xFE01] * 8, [0x7C00, 0xFC00] * 8,
                                   [0x0001, 0x8003] * 8, [0x03FF, 0x0200] * 8,
                                   [0x7BFF, 0xFBFF] * 8, [0x5F00, 0x0001] * 8,
                                   [0x1000 + 3 * k for k in range(16)]] + [[0x3C00] * 16] * 4],
                                 np.uint16)}
    for dtype, u in cases.items():
        for fmt in FORMATS:
            for rec in (False, True):
                for block in (None, (8, 16), (1, 16)):
                    layout = [param("s", fmt, (r, c), quant=quant(fmt, "s_s", block, rec))]
                    host = {"s": (dtype, (r, c), np.ascontiguousarray(u).reshape(-1).view(np.uint8))}
                    gpu = {"s": (dtype, (r, c), base.on_gpu(u, dtype))}
                    name = f"special blocks {dtype} {fmt} {'RECIPROCAL' if rec else 'DEQUANT'} {block}"

                    def run():
                        want = fp8.quantized_receipt(layout, host)
                        got = triton_sum(layout, gpu)
                        check(name, got[:3] == want and not got[3], f"triton {got} numpy {want}")
                    guarded(name, run)


def check_rest(rng):
    """Parameters the tables can't express go to the torch path: a block
    fed by two source dtypes, a destination that wraps rows."""
    name = "rest (mixed-dtype block, wrapping segment) through expected_receipt_arrays"

    def run():
        host, gpu = {}, {}
        for n, dtype, shape in (("a", "FLOAT32", (10, 8)), ("b", "BFLOAT16", (10, 8))):
            u = base.bits(rng, dtype, shape)
            host[n] = (dtype, shape, np.ascontiguousarray(u).reshape(-1).view(np.uint8))
            gpu[n] = (dtype, shape, base.on_gpu(u, dtype))
        q = quant("FLOAT8_E4M3FN", "x_s", (128, 128), False)
        layout = [param("x", "FLOAT8_E4M3FN", (20, 16), [seg("a", 0, 10, 0, 8, 0, 8)], quant=q),
                  param("z", "FLOAT8_E4M3FN", (20, 8), [seg("a", 0, 10, 0, 8, 0),
                                                        seg("b", 0, 10, 0, 8, 80)],
                        quant=quant("FLOAT8_E4M3FN", "z_s", (128, 128), False))]
        got = triton_sum(layout, gpu)
        check("rest: both parameters left to the torch path",
              [p.name for p in got[3]] == ["x", "z"], str([p.name for p in got[3]]))
        receipts.fp8_triton_failed().clear()
        want = receipts.expected_receipt(layout, host)
        full = receipts.expected_receipt_arrays(layout, gpu)
        check(name, full == want and not receipts.fp8_triton_failed(), f"gpu {full} host {want}")
    guarded(name, run)


def check_vectors():
    name = "fp8.json receipt vectors through the kernel"

    def run():
        with open(os.path.join(HERE, "..", "vectors", "fp8.json")) as f:
            vectors = json.load(f)
        bad = []
        for case in vectors["receipts"]:
            layout = [json_format.ParseDict(p, v1.Parameter()) for p in case["layout"]]
            sent = {}
            for t in case["tensors"]:
                raw = torch.from_numpy(np.frombuffer(bytes.fromhex(t["hex"]), np.uint8).copy())
                sent[t["name"]] = (t["dtype"], tuple(t["shape"]),
                                   raw.to(DEV).view(base.TORCH.get(t["dtype"], torch.uint8)))
            want = (int(case["checksum"], 16), case["parameters"], case["bytes"])
            receipts.fp8_triton_failed().clear()
            if (receipts.expected_receipt_arrays(layout, sent) != want
                    or receipts.fp8_triton_failed()):
                bad.append(case["name"])
        check(f"{name} ({len(vectors['receipts'])})", not bad,
              f"{bad} {receipts.fp8_triton_failed()}")
    guarded(name, run)


def time_big():
    name = "big weight: triton == torch path"

    def run():
        rows, cols = 4096, 12288
        w = (torch.randn(rows, cols, device=DEV) * 0.02).to(torch.bfloat16).reshape(-1)
        layout = [param("w", "FLOAT8_E4M3FN", (rows, cols),
                        quant=quant("FLOAT8_E4M3FN", "w_s", (128, 128), False)),
                  param("w_s", "FLOAT32", (rows // 128, cols // 128))]
        _, q, _ = fp8.split_layout(layout)
        sent = {"w": ("BFLOAT16", (rows, cols), w)}
        ops = _xp.TorchOps()

        def timed(fn, n):
            times = []
            for _ in range(n):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            return out, times

        t0 = time.perf_counter()
        tri = triton_sum(q, sent)   # plan + first launch
        first = time.perf_counter() - t0
        tri, t_tri = timed(lambda: fp8_gpu.quantized_receipt_gpu(q, sent), 10)
        ref, t_torch = timed(lambda: fp8.quantized_receipt(q, sent, ops), 3)
        fp8_gpu._plans.clear()
        _, t_plan = timed(lambda: fp8_gpu.quantized_receipt_gpu(q, sent), 1)
        # The general kernel alone (WEIGHTSYNC_FP8_TILE=0), for the record.
        os.environ["WEIGHTSYNC_FP8_TILE"] = "0"
        fp8_gpu._plans.clear()
        try:
            gen, t_gen = timed(lambda: fp8_gpu.quantized_receipt_gpu(q, sent), 5)
        finally:
            del os.environ["WEIGHTSYNC_FP8_TILE"]
            fp8_gpu._plans.clear()
        check(name, tri[:3] == ref and not tri[3], f"triton {tri} torch {ref}")
        check("big weight: tile kernel == general kernel", gen == tri, f"{gen} vs {tri}")
        gbs = rows * cols * 2 / min(t_tri) / 1e9
        print(f"TIME {rows}x{cols} bf16 -> e4m3 128x128 receipt: triton min "
              f"{min(t_tri) * 1e3:.2f} ms ({gbs:.0f} GB/s of source), general kernel only "
              f"{min(t_gen) * 1e3:.2f} ms, with the table built "
              f"{t_plan[0] * 1e3:.2f} ms, first call {first * 1e3:.0f} ms; torch path min "
              f"{min(t_torch) * 1e3:.1f} ms; speedup x{min(t_torch) / min(t_tri):.1f}",
              flush=True)
    guarded(name, run)


def main():
    faulthandler.dump_traceback_later(58, exit=True)

    def watchdog():
        print("FAIL watchdog: not done in 55 s", flush=True)
        os._exit(2)
    timer = threading.Timer(55, watchdog)
    timer.daemon = True
    timer.start()
    t0 = time.perf_counter()
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name(DEV)}", flush=True)
    rng = np.random.default_rng(2025)
    check("fp8_gpu.enabled()", fp8_gpu.enabled())
    check_special_blocks()
    check_receipts(rng)
    check_rest(rng)
    check_vectors()
    time_big()
    timer.cancel()
    print(f"{'ALL PASS' if not FAILS else f'{len(FAILS)} FAIL'} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
