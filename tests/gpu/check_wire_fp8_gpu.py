#!/usr/bin/env python3
"""FP8 on the wire, quantised on the GPU (weightsync.wire_fp8.quantize_on_wire
on the tensor's device: the Triton kernels, and torch ops) against the
numpy path (the one CI binds to the daemon: backends/host:
quant_scatter_test): every payload byte (FP8 elements, padding, stored
scales) equal, for float32 / bfloat16 / float16 tensors with NaN, +-inf,
zeros, a zero block, subnormal and huge values, e4m3fn and e5m2, 128x128 blocks with partial edges, 2x128 and
per row (the host path: CPU torch tensors through numpy), DEQUANT and
RECIPROCAL scales, one tensor larger than a quantisation step (CHUNK
elements). Then the time of each GPU path on a 4096 x 12288 bfloat16
weight. Prints PASS/FAIL lines; exit 1 on any FAIL. Under a minute.

    PYTHONPATH=client/python python3 tests/gpu/check_wire_fp8_gpu.py
"""

import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "client", "python"))

from weightsync import _xp  # noqa: E402
from weightsync.planner import wire_payload_bytes  # noqa: E402
from weightsync import wire_fp8  # noqa: E402
from weightsync.receipts import fp8_gpu  # noqa: E402
from weightsync.wire_fp8 import quantize_on_wire  # noqa: E402

DEV = torch.device("cuda", 0)
TORCH = {"FLOAT32": torch.float32, "BFLOAT16": torch.bfloat16, "FLOAT16": torch.float16}
failures = 0


def check(what, ok, detail=""):
    global failures
    print(f"{'PASS' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}", flush=True)
    failures += 0 if ok else 1


def main():
    g = torch.Generator(device="cpu").manual_seed(5)
    forms = [
        ({"format": "FLOAT8_E4M3FN", "scheme": "QUANT_SCHEME_BLOCK", "block_rows": 128,
          "block_cols": 128, "scale_form": "SCALE_FORM_DEQUANT"}, "e4m3 128x128"),
        ({"format": "FLOAT8_E5M2", "scheme": "QUANT_SCHEME_BLOCK", "block_rows": 128,
          "block_cols": 128, "scale_form": "SCALE_FORM_RECIPROCAL"}, "e5m2 128x128 reciprocal"),
        ({"format": "FLOAT8_E4M3FN", "scheme": "QUANT_SCHEME_BLOCK", "block_rows": 2,
          "block_cols": 128, "scale_form": "SCALE_FORM_DEQUANT"}, "e4m3 2x128"),
        ({"format": "FLOAT8_E4M3FN", "scheme": "QUANT_SCHEME_PER_ROW",
          "scale_form": "SCALE_FORM_DEQUANT"}, "e4m3 per row"),
    ]
    shapes = [(300, 260), (130, 512), (4200, 4096)]   # the last: > CHUNK elements
    for dtype, tdt in TORCH.items():
        for shape in shapes:
            x = torch.randn(shape, generator=g) * 3
            x[0, 0], x[1, 1], x[2, 2], x[3, 3] = float("nan"), float("inf"), -float("inf"), 0.0
            x[-1, :7] = -float("nan")
            x[:, -3:] *= 1e-30                 # subnormal in float32, zero in 16 bits
            x[5, 6] = 3e38                     # near FLT_MAX (inf in 16 bits)
            x[128:256, 128:256] = 0.0          # a zero block: scale 1
            src = x.to(tdt)
            for fields, name in forms:
                if shape == (4200, 4096) and name != "e4m3 128x128":
                    continue
                what = f"{dtype} {list(shape)} {name}"
                host = quantize_on_wire("w", src, fields).payload()   # numpy
                want_len = wire_payload_bytes(shape, fields)
                for path in PATHS:
                    gpu = on_gpu(path, src.to(DEV), fields)
                    got = gpu.cpu().numpy()
                    check(f"{what} ({path}): payload bytes equal the host path's",
                          got.shape == host.shape and bool(np.array_equal(got, host))
                          and got.shape[0] == want_len,
                          f"{int((got != host).sum()) if got.shape == host.shape else 'size'}"
                          " differ")
    # Many tensors of mixed dtypes, shapes and forms at once (on_the_wire:
    # a launch per form over a table of its tensors), each against the
    # host path.
    many, plan = [], {}
    for k, (shape, (fields, _)) in enumerate(
            [(s, f) for s in ((300, 260), (130, 512), (256, 256), (1, 128)) for f in forms]):
        x = torch.randn(shape, generator=g) * (k + 1)
        x[0, 0] = float("nan")
        src = x.to(list(TORCH.values())[k % 3])
        many.append((f"t{k}", src))
        plan[f"t{k}"] = fields
    got = wire_fp8.on_the_wire([(n, t.to(DEV)) for n, t in many], plan)
    differ = [n for (n, w), (_, src) in zip(got, many) if not np.array_equal(
        w.payload().cpu().numpy(), quantize_on_wire(n, src, plan[n]).payload())]
    check(f"{len(many)} tensors quantised together (on_the_wire): each payload equals "
          "the host path's", not differ, f"{differ} differ")
    check("the Triton kernel never fell back to torch", not wire_fp8._TRITON_FAILED,
          "; ".join(wire_fp8._TRITON_FAILED))
    w = torch.randn(4096, 12288, generator=g).to(torch.bfloat16).to(DEV)
    fields = forms[0][0]
    for path in PATHS:
        on_gpu(path, w, fields)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            on_gpu(path, w, fields)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ms = sorted(times)[2] * 1e3
        print(f"TIME quantize_on_wire + payload ({path}), 4096 x 12288 bf16 (100.7 MB -> "
              f"50.3 MB) on the GPU: {ms:.2f} ms median of 5, {100.7e6 / ms / 1e6:.0f} GB/s "
              "of source read", flush=True)
    return 1 if failures else 0


PATHS = ("triton tile", "triton general", "torch")


def on_gpu(path, x, fields):
    """The payload of `x` quantised on its GPU by `path`: the Triton
    kernels (the default where Triton is present: fp8_wire_tile_kernel
    for blocks of powers of two up to 256 columns, else fp8_wire_kernel;
    "general": fp8_wire_kernel for every block) or torch ops
    (WEIGHTSYNC_WIRE_TRITON=0)."""
    os.environ["WEIGHTSYNC_WIRE_TRITON"] = "0" if path == "torch" else "1"
    fp8_gpu.WIRE_TILE = path != "triton general"
    try:
        w = quantize_on_wire("w", x, fields, _xp.TorchOps())
        if path != "torch" and w._payload is None:
            check("the Triton path made the payload", False, "it took the torch path")
        return w.payload()
    finally:
        os.environ.pop("WEIGHTSYNC_WIRE_TRITON", None)
        fp8_gpu.WIRE_TILE = True


if __name__ == "__main__":
    sys.exit(main())
