#!/usr/bin/env python3
"""FP8 on the wire's tile kernel (weightsync.receipts.fp8_gpu.quantize_gpu,
fp8_wire_tile_kernel) over its launch settings, on one GPU: rows a tile
(WIRE_RB) and warps (WIRE_WARPS), on a 4096 x 12288 weight (bfloat16
and float32, e4m3 128 x 128) and on Qwen3-8B's 252 linear weights
(bfloat16: one launch a tensor, or batched: the whole set in one launch,
as Trainer.update(fp8_on_wire=True) quantises them, wire_fp8.on_the_wire). Every
setting's payload is compared byte for byte with the torch path's (the
reference's ops on the GPU) before it is timed; a setting that differs is
a FAIL. Prints a table, best first.

    PYTHONPATH=client/python python3 bench/wire_kernel_tune.py [OUT_JSON]
"""

import itertools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client",
                                "python"))
from weightsync import _xp  # noqa: E402
from weightsync.receipts import fp8_gpu  # noqa: E402
from weightsync.wire_fp8 import on_the_wire, quantize_on_wire  # noqa: E402

DEV = torch.device("cuda", 0)
FIELDS = {"format": "FLOAT8_E4M3FN", "scheme": "QUANT_SCHEME_BLOCK", "block_rows": 128,
          "block_cols": 128, "scale_form": "SCALE_FORM_DEQUANT"}


def qwen3_8b_linear():
    h, i, q, kv, layers = 4096, 12288, 4096, 1024, 36
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)] * layers
    g = torch.Generator(device=DEV).manual_seed(1)
    return [torch.randn(s, generator=g, device=DEV, dtype=torch.float32).to(torch.bfloat16)
            for s in shapes]


def timed(fn, repeats=7):
    fn()
    torch.cuda.synchronize(DEV)
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize(DEV)
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    g = torch.Generator(device=DEV).manual_seed(0)
    big = {dt: (torch.randn(4096, 12288, generator=g, device=DEV) * 3).to(dt)
           for dt in (torch.bfloat16, torch.float32)}
    for t in big.values():
        t[0, 0], t[1, 1] = float("nan"), float("inf")
    model = qwen3_8b_linear()
    model_bytes = sum(t.numel() * 2 for t in model)
    os.environ["WEIGHTSYNC_WIRE_TRITON"] = "0"
    want = {dt: quantize_on_wire("w", t, FIELDS, _xp.TorchOps()).payload()
            for dt, t in big.items()}
    os.environ.pop("WEIGHTSYNC_WIRE_TRITON")
    rows, failures = [], 0
    for rb, warps, batched in itertools.product((8, 16, 32), (4, 8), (False, True)):
        fp8_gpu.WIRE_RB, fp8_gpu.WIRE_WARPS = rb, warps
        row = {"rb": rb, "warps": warps, "batched": batched}
        try:
            for dt, t in big.items():
                got = quantize_on_wire("w", t, FIELDS, _xp.TorchOps()).payload()
                if not torch.equal(got, want[dt]):
                    raise AssertionError(f"{dt}: {int((got != want[dt]).sum())} bytes differ")
                row[str(dt).split(".")[1] + "_s"] = timed(
                    lambda t=t: quantize_on_wire("w", t, FIELDS, _xp.TorchOps()))
            if batched:   # as update(fp8_on_wire=True): one launch for the lot
                pairs = [(f"w{i}", t) for i, t in enumerate(model)]
                plan = {n: FIELDS for n, _ in pairs}
                row["model_s"] = timed(lambda: on_the_wire(pairs, plan), repeats=3)
            else:
                row["model_s"] = timed(lambda: [quantize_on_wire("w", t, FIELDS,
                                                                 _xp.TorchOps())
                                                for t in model], repeats=3)
        except Exception as e:  # noqa: BLE001 - reported as a FAIL row
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            failures += 1
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = sorted((r for r in rows if "error" not in r), key=lambda r: r["model_s"])
    print(f"\n{'rb':>3} {'warps':>5} {'batch':>5} {'bf16 ms':>8} {'GB/s':>6} {'f32 ms':>7} "
          f"{'model ms':>9} {'GB/s':>6}")
    for r in ok:
        print(f"{r['rb']:3d} {r['warps']:5d} {str(r['batched']):>5} {r['bfloat16_s'] * 1e3:8.3f} "
              f"{4096 * 12288 * 2 / r['bfloat16_s'] / 1e9:6.0f} {r['float32_s'] * 1e3:7.3f} "
              f"{r['model_s'] * 1e3:9.2f} {model_bytes / r['model_s'] / 1e9:6.0f}")
    for r in rows:
        if "error" in r:
            print(f"FAIL rb={r['rb']} warps={r['warps']} batched={r['batched']}: {r['error']}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(DEV), "model_bytes": model_bytes,
                       "rows": rows}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
