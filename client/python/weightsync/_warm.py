"""Warm start (issue 30): the GPU trainer's init_nccl() / init_ipc() asks
the daemon which dtypes its engines registered and has the receipt kernels
for them compiled and loaded before the first update, which otherwise
paid for Triton's compilation (4.76 s against 23.9 ms steady for Qwen3-8B
on one H100). Triton keeps what it compiled in its on-disk cache
(TRITON_CACHE_DIR, default ~/.triton/cache), so a later process loads
instead of compiling.

The trainer's dtypes are not known before update(): each engine dtype is
warmed for a trainer that sends the same dtype (a bf16 trainer into bf16
engines), and bfloat16/float16 engines also for float32 sources (fp32
master weights). Other pairs compile at their first update, as before.
WEIGHTSYNC_WARM=0 turns this off. FP8 engines' quantised-receipt kernels
(weightsync.fp8_gpu) are not warmed here.
"""

import os

from weightsync._proto import v1


def receipt_pairs(status):
    """{(source dtype, engine dtype)} worth warming for a GetStatus answer
    with layouts."""
    dsts = set()
    for engine in status.engines:
        dsts.update(v1.enum_name("DType", p.dtype) for p in engine.layout
                    if not p.HasField("quantization"))
    pairs = {(d, d) for d in dsts}
    pairs |= {("FLOAT32", d) for d in dsts & {"BFLOAT16", "FLOAT16"}}
    return sorted(pairs)


def warm_receipts(stub, device, remember=None):
    """Compiles the receipt kernels the engines behind `stub` will need on
    `device`; returns the pairs warmed ([] without Triton, with
    WEIGHTSYNC_WARM=0, or without engines). `remember(layout_id, layout)`
    (the sender's layout cache) is given each engine's layout on the way,
    so the first update's receipts need no GetStatus of their own."""
    if os.environ.get("WEIGHTSYNC_WARM", "1") == "0":
        return []
    from weightsync.receipts import gpu as receipts_gpu
    if not receipts_gpu.available():
        return []
    status = stub.call("GetStatus", include_layouts=True)
    for engine in status.engines if remember is not None else ():
        remember(engine.layout_id, engine.layout)
    pairs = receipt_pairs(status)
    return receipts_gpu.warm(pairs, device) if pairs else []
