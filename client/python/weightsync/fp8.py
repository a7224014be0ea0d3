"""FP8 targets' quantisation (the public name of weightsync.receipts.fp8,
where the code lives beside the receipts it feeds): quantize, to_fp8,
from_fp8, dequantize, block_shape, quantization_fields, split_layout,
quantized_receipt."""

from weightsync.receipts.fp8 import (CHUNK, FMAX, block_shape, dequantize, from_fp8,
                                     quantization_fields, quantize, quantized_receipt,
                                     split_layout, to_fp8)

__all__ = ["CHUNK", "FMAX", "block_shape", "dequantize", "from_fp8", "quantization_fields",
           "quantize", "quantized_receipt", "split_layout", "to_fp8"]
