"""Receipts, trainer side: the checksum an engine must report for an
update, computed from what was sent, mapped through the engine's segments
and converted to its dtypes (docs/protocol.md, "Receipts").

The package, arrows pointing down (no module imports one above it):

    expected.py        expected_receipt / expected_receipt_arrays: picks the
                       implementation where the data is (host, torch, Triton;
                       FP8 targets split off to fp8 / fp8_gpu)
    fp8_gpu.py         FP8 targets' receipts on the GPU (Triton; kernels in
                       fp8_gpu_kernels.py, compiled at first launch)
    gpu.py             the receipts of many layouts on the GPU (Triton; kernels
                       in gpu_kernels.py, compiled at first launch)
    fp8.py             FP8 quantisation, numpy and torch alike, and its receipt
    host.py            numpy on the host (walks kept per layout)
    arrays.py          one body for numpy arrays and torch tensors
    core.py            the function and its constants (salt, key, mix32, Bits32)

This module re-exports the public names of core and expected.
"""

from weightsync.receipts.core import (BITS_HI, ESIZE, KEY_HI, KEY_LO, M32, MIX, bits32_np,
                                      bits32_of, convert_bits, convert_element_bits,
                                      layout_regions, layout_runs, mix32, mix32_bits,
                                      parameter_salt, salt32, terms32, to_float32)
from weightsync.receipts.expected import (all_cuda, expected_receipt, expected_receipt_arrays,
                                          expected_receipts_gpu, fp8_triton_failed, has_fp8,
                                          note_fp8_triton_failure, quantized_where_sent)

__all__ = ["BITS_HI", "ESIZE", "KEY_HI", "KEY_LO", "M32", "MIX", "all_cuda", "bits32_np",
           "bits32_of", "convert_bits", "convert_element_bits", "expected_receipt",
           "expected_receipt_arrays", "expected_receipts_gpu", "fp8_triton_failed", "has_fp8",
           "layout_regions", "layout_runs", "mix32", "mix32_bits", "note_fp8_triton_failure",
           "parameter_salt", "quantized_where_sent", "salt32", "terms32", "to_float32"]
