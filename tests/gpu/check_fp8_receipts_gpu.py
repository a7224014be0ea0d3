#!/usr/bin/env python3
"""The FP8 part of a GPU trainer's receipt expectation, computed on the GPU
(weightsync.fp8 run with torch ops on the tensors' device, as
weightsync.receipts.expected_receipt_arrays does for CUDA tensors),
against the numpy reference (the same code run by numpy on host copies,
bound by tests/vectors/fp8.json): e4m3fn and e5m2, 128x128 blocks with
partial edges and per row, DEQUANT and RECIPROCAL scales, float32 /
bfloat16 / float16 sources with NaN (both signs, payloads), +-inf, zeros,
subnormal and huge values; every FP8 byte and scale bit for bit; receipt
sums of whole, fused (segmented) and strided parameters, chunked too; the
vectors; then the time of the torch path on a 4096 x 12288 bfloat16
weight. Prints PASS/FAIL lines; exit 1 on any FAIL. Under a minute.

    PYTHONPATH=client/python python3 tests/gpu/check_fp8_receipts_gpu.py
"""

import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "client", "python"))

from google.protobuf import json_format  # noqa: E402

from weightsync import _xp, receipts  # noqa: E402
from weightsync.receipts import fp8  # noqa: E402
from weightsync._proto import v1  # noqa: E402

DEV = torch.device("cuda", 0)
FORMATS = ("FLOAT8_E4M3FN", "FLOAT8_E5M2")
TORCH = {"FLOAT32": torch.float32, "BFLOAT16": torch.bfloat16, "FLOAT16": torch.float16}
SPECIALS = {
    "FLOAT32": [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA12345, 0x7F800000, 0xFF800000,
                0x00000001, 0x807FFFFF, 0x80000000, 0x7F7FFFFF, 0xFF7FFFFF, 0x43E00000,
                0x43E80000, 0x47600000, 0x47700000, 0x3B800000],
    "FLOAT16": [0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0xFD55, 0x0001, 0x8001, 0x03FF,
                0x7BFF, 0xFBFF, 0x8000],
    "BFLOAT16": [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFA5, 0x0001, 0x807F, 0x7F7F,
                 0xFF7F, 0x8000, 0x4400],
}
FAILS = []


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name}{'' if ok else ' ' + detail}", flush=True)
    if not ok:
        FAILS.append(name)


def bits(rng, dtype, shape, zero_block=True):
    """Host uint16/uint32 bits of random values of `dtype`: a wide range of
    magnitudes, the specials sprinkled, a 128x128 block of zeros."""
    n = int(np.prod(shape))
    f = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    if dtype == "FLOAT32":
        u = f.view(np.uint32).copy()
    elif dtype == "FLOAT16":
        with np.errstate(all="ignore"):
            u = (f / np.float32(2.0 ** 20)).astype(np.float16).view(np.uint16).copy()
    else:
        u = (f.view(np.uint32) >> 16).astype(np.uint16)
    for k, v in enumerate(SPECIALS[dtype]):
        u[(k * 7919) % n] = v
    u = u.reshape(shape)
    if zero_block and len(shape) == 2 and shape[0] >= 128 and shape[1] >= 256:
        u[:128, 128:256] = 0
    return u


def on_gpu(u, dtype):
    """The CUDA tensor of `dtype` with host bits `u` (flat)."""
    signed = u.astype(np.int64)
    signed = np.where(signed >= 1 << (8 * u.itemsize - 1), signed - (1 << (8 * u.itemsize)),
                      signed).astype(np.int32 if u.itemsize == 4 else np.int16)
    return torch.from_numpy(signed.reshape(-1)).to(DEV).view(TORCH[dtype])


def host_f32(u, dtype):
    return receipts.to_float32(np.ascontiguousarray(u).reshape(-1).view(np.uint8), dtype)


def check_quantize(rng):
    ops = _xp.TorchOps()
    for dtype in TORCH:
        u = bits(rng, dtype, (300, 400))
        t = on_gpu(u, dtype)
        x_host = host_f32(u, dtype)
        x_gpu = fp8._widen(ops, t, dtype)
        same = np.array_equal(x_gpu.view(torch.int32).cpu().numpy().view(np.uint32),
                              x_host.view(np.uint32))
        check(f"widen {dtype} on the GPU keeps every bit (NaN signs, payloads)", same)
        x_host = x_host.reshape(300, 400)
        x_gpu = x_gpu.reshape(300, 400)
        for fmt in FORMATS:
            for block, label in (((128, 128), "128x128"), ((1, 400), "per-row")):
                for rec in (False, True):
                    want_e, want_s = fp8.quantize(x_host, *block, fmt, rec)
                    got_e, got_s = fp8.quantize(x_gpu, *block, fmt, rec, ops)
                    got_e, got_s = got_e.cpu().numpy(), got_s.cpu().numpy()
                    bad = np.flatnonzero(got_e.reshape(-1) != want_e.reshape(-1))
                    ok = (not bad.size and got_s.shape == want_s.shape
                          and np.array_equal(got_s.view(np.uint32), want_s.view(np.uint32)))
                    detail = ""
                    if bad.size:
                        i = int(bad[0])
                        detail = (f"{bad.size} bytes differ; first at {i}: x bits "
                                  f"{x_host.reshape(-1)[i:i + 1].view(np.uint32)[0]:#010x} "
                                  f"gpu {got_e.reshape(-1)[i]:#04x} numpy "
                                  f"{want_e.reshape(-1)[i]:#04x}")
                    check(f"quantize {dtype} -> {fmt} {label} "
                          f"{'RECIPROCAL' if rec else 'DEQUANT'}", ok, detail)


def param(name, dtype, shape, segments=(), quant=None):
    p = v1.Parameter(name=name, dtype=getattr(v1, dtype), shape=list(shape))
    for s in segments:
        p.segments.add(**s)
    if quant:
        p.quantization.CopyFrom(v1.Quantization(**quant))
    return p


def quant(fmt, scale, block, reciprocal):
    return fp8.quantization_fields(fmt, scale, block, reciprocal)


def seg(source, rb, rc, cb, cc, dest, stride=0):
    return dict(source=source, row_begin=rb, row_count=rc, col_begin=cb, col_count=cc,
                dest_offset=dest, dest_row_stride=stride)


def check_receipts(rng):
    for fmt in FORMATS:
        for rec in (False, True):
            for src_w, src_qkv in (("BFLOAT16", "FLOAT32"), ("FLOAT16", "BFLOAT16"),
                                   ("FLOAT32", "FLOAT16")):
                host, gpu = {}, {}

                def tensor(name, dtype, shape):
                    u = bits(rng, dtype, shape)
                    host[name] = (dtype, shape, np.ascontiguousarray(u).reshape(-1).view(np.uint8))
                    gpu[name] = (dtype, shape, on_gpu(u, dtype))

                tensor("w", src_w, (300, 400))
                tensor("q", src_qkv, (256, 200))
                tensor("k", src_qkv, (128, 200))
                tensor("v", src_qkv, (128, 200))
                tensor("r", src_w, (77, 130))
                tensor("d", src_qkv, (260, 100))
                tensor("norm", src_w, (200,))
                layout = [
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
                    param("norm", "BFLOAT16", (200,)),
                ]
                _, q, _ = fp8.split_layout(layout)
                want = fp8.quantized_receipt(q, host)
                got = fp8.quantized_receipt(q, gpu, _xp.TorchOps())
                small = fp8.quantized_receipt(q, gpu, _xp.TorchOps(), chunk=5000)
                name = f"receipt {fmt} {'RECIPROCAL' if rec else 'DEQUANT'} {src_w}/{src_qkv}"
                check(name + " (whole, fused, strided, per-row)", got == want,
                      f"gpu {got} numpy {want}")
                check(name + " in chunks of 5000 elements", small == want,
                      f"gpu {small} numpy {want}")
                full_host = receipts.expected_receipt(layout, host)
                full_gpu = receipts.expected_receipt_arrays(layout, gpu)
                check(name + " expected_receipt_arrays(CUDA) == expected_receipt(host)",
                      full_gpu == full_host, f"gpu {full_gpu} host {full_host}")


def check_vectors():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vectors", "fp8.json")
    with open(root) as f:
        vectors = json.load(f)
    ops = _xp.TorchOps()
    bad = []
    for c in vectors["blocks"]:
        raw = np.frombuffer(bytes.fromhex(c["hex"]), np.uint8).copy()
        t = torch.from_numpy(raw).to(DEV)
        x = fp8._widen(ops, fp8._elements(ops, t, c["srcDtype"]), c["srcDtype"])
        enc, sc = fp8.quantize(x.reshape(c["shape"]), c["blockRows"], c["blockCols"],
                               c["format"], c["scaleForm"] == "RECIPROCAL", ops)
        if (enc.cpu().numpy().tobytes().hex() != c["fp8"]
                or sc.cpu().numpy().tobytes().hex() != c["scales"]):
            bad.append(c["name"])
    check(f"fp8.json: {len(vectors['blocks'])} block vectors on the GPU", not bad, str(bad))
    bad = []
    for case in vectors["receipts"]:
        layout = [json_format.ParseDict(p, v1.Parameter()) for p in case["layout"]]
        sent = {}
        for t in case["tensors"]:
            raw = torch.from_numpy(np.frombuffer(bytes.fromhex(t["hex"]), np.uint8).copy())
            sent[t["name"]] = (t["dtype"], tuple(t["shape"]),
                               raw.to(DEV).view(TORCH.get(t["dtype"], torch.uint8)))
        want = (int(case["checksum"], 16), case["parameters"], case["bytes"])
        if receipts.expected_receipt_arrays(layout, sent) != want:
            bad.append(case["name"])
    check(f"fp8.json: {len(vectors['receipts'])} receipt vectors with CUDA tensors",
          not bad, str(bad))


def time_big(rng):
    rows, cols = 4096, 12288
    w = (torch.randn(rows, cols, device=DEV) * 0.02).to(torch.bfloat16).reshape(-1)
    layout = [param("w", "FLOAT8_E4M3FN", (rows, cols),
                    quant=quant("FLOAT8_E4M3FN", "w_s", (128, 128), False)),
              param("w_s", "FLOAT32", (rows // 128, cols // 128))]
    _, q, _ = fp8.split_layout(layout)
    sent = {"w": ("BFLOAT16", (rows, cols), w)}
    ops = _xp.TorchOps()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(DEV)
    fp8.quantized_receipt(q, sent, ops)   # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        got = fp8.quantized_receipt(q, sent, ops)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(DEV) / 2 ** 30
    print(f"TIME torch path, {rows}x{cols} bf16 -> e4m3 128x128 receipt: "
          f"min {min(times) * 1e3:.1f} ms, runs {[round(t * 1e3, 1) for t in times]} ms, "
          f"peak GPU memory {peak:.2f} GiB (the weight itself 0.09)", flush=True)
    # The numpy reference on the first 512 rows (the whole would take a while).
    part = [param("w", "FLOAT8_E4M3FN", (512, cols),
                  quant=quant("FLOAT8_E4M3FN", "w_s", (128, 128), False)),
            param("w_s", "FLOAT32", (4, cols // 128))]
    _, qp, _ = fp8.split_layout(part)
    head = w[:512 * cols]
    host = {"w": ("BFLOAT16", (512, cols), head.view(torch.uint8).cpu().numpy())}
    t0 = time.perf_counter()
    want = fp8.quantized_receipt(qp, host)
    t_np = time.perf_counter() - t0
    check("first 512 rows of the big weight: torch == numpy",
          fp8.quantized_receipt(qp, {"w": ("BFLOAT16", (512, cols), head)}, ops) == want)
    print(f"TIME numpy path, 512 rows: {t_np:.2f} s (x8 ~ {8 * t_np:.1f} s for the whole "
          f"weight, before the copy to the host); torch total {got[2]} bytes", flush=True)


def main():
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(DEV)}", flush=True)
    rng = np.random.default_rng(2024)
    check_quantize(rng)
    check_receipts(rng)
    check_vectors()
    time_big(rng)
    print(f"{'ALL PASS' if not FAILS else f'{len(FAILS)} FAIL'} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
