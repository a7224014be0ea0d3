#!/usr/bin/env python3
"""The trainer's FP8 receipt expectation (weightsync.receipts.fp8_gpu) over
Qwen3-8B's 252 linear weights (bf16, 13.9 GB) into e4m3 128x128 blocks,
one call as Trainer.update makes it, for variants of the tile kernel
(rows per step, warps, whole tiles without masks, finite blocks' fast
encoding, the first read in 32-bit words); --once: the defaults alone
(for ncu);
every variant's sum must equal the first's. Prints one line each.

    PYTHONPATH=client/python python3 bench/fp8_triton_probe.py
"""

import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "gpu"))

import check_fp8_receipts_gpu as base  # noqa: E402
from weightsync.receipts import fp8, fp8_gpu  # noqa: E402


def main():
    dev = torch.device("cuda", 0)
    h, kv, inter, layers = 4096, 1024, 12288, 36
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter)]
    layout, sent = [], {}
    torch.manual_seed(0)
    for i in range(layers):
        for j, (r, c) in enumerate(shapes):
            name = f"l{i}.w{j}"
            layout.append(base.param(name, "FLOAT8_E4M3FN", (r, c),
                                     quant=base.quant("FLOAT8_E4M3FN", name + "_s",
                                                      (128, 128), False)))
            layout.append(base.param(name + "_s", "FLOAT32", (r // 128, c // 128)))
            sent[name] = ("BFLOAT16", (r, c),
                          (torch.randn(r * c, device=dev) * 0.02).to(torch.bfloat16))
    _, q, _ = fp8.split_layout(layout)
    nbytes = sum(t.numel() * 2 for _, _, t in sent.values())
    print(f"{len(q)} weights, {nbytes / 1e9:.2f} GB bf16, {torch.cuda.get_device_name(dev)}",
          flush=True)
    if "--once" in sys.argv:   # the defaults, one warm call (for ncu)
        fp8_gpu.quantized_receipt_gpu(q, sent)
        torch.cuda.synchronize()
        fp8_gpu.quantized_receipt_gpu(q, sent)
        torch.cuda.synchronize()
        return 0
    # (name, rows per step, warps, Fp8Divider, tile kernel, whole tiles
    # unmasked, finite blocks' fast encoding, 16-bit first read in words)
    variants = [("tile RB=8 w4 packed (default)", 8, 4, True, "1", True, True, True),
                ("tile RB=16 w4 packed", 16, 4, True, "1", True, True, True),
                ("tile RB=8 w2 packed", 8, 2, True, "1", True, True, True),
                ("tile RB=16 w4 full finite", 16, 4, True, "1", True, True, False),
                ("tile RB=16 w4 full", 16, 4, True, "1", True, False, False),
                ("tile RB=16 w4 masked (before)", 16, 4, True, "1", False, False, False)]
    want = None
    for name, rb, warps, fast, tile, full, finite, packed in variants:
        fp8_gpu.TILE_RB, fp8_gpu.TILE_WARPS, fp8_gpu.TILE_FAST_DIV = rb, warps, fast
        fp8_gpu.TILE_FULL, fp8_gpu.TILE_FINITE_FAST = full, finite
        fp8_gpu.TILE_PACKED = packed
        os.environ["WEIGHTSYNC_FP8_TILE"] = tile
        fp8_gpu._plans.clear()
        try:
            got = fp8_gpu.quantized_receipt_gpu(q, sent)   # compile + plan
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                got2 = fp8_gpu.quantized_receipt_gpu(q, sent)
                times.append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001
            print(f"{name:28s} FAILED: {str(e)[-400:]}", flush=True)
            continue
        want = got if want is None else want
        same = "" if got == want and got2 == want else f" DIFFERS {got} vs {want}"
        t = sorted(times)[len(times) // 2]
        print(f"{name:28s} {t * 1e3:8.2f} ms {nbytes / t / 1e9:7.0f} GB/s{same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
