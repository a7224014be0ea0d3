// FP8 quantisation on the GPU (docs/protocol.md, "FP8 targets"; issue 17):
// a rectangle of float32 values in device memory (a row of blocks that the
// worker gathered from the chunks, widened by CopyConvert2D) quantised in
// blocks, its FP8 elements and one scale per block written into engine
// memory. Bit for bit common/fp8.h's QuantizeBlocks: the per-thread
// arithmetic is fp8_math.h's, which fp8_math_test checks on the CPU.
//
// Stateless and thread-safe; nothing here synchronises: the kernel is
// enqueued on `stream` and the caller orders it after the writes of job.x
// and before anything reads the outputs. Built only with CUDA
// (//backends/cuda:quant_kernels is header-only otherwise); include it from
// code that is itself compiled only when WEIGHTSYNC_HAS_CUDA.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_QUANT_KERNELS_H_
#define WEIGHTSYNC_BACKENDS_CUDA_QUANT_KERNELS_H_

#include <cuda_runtime.h>

#include "backends/cuda/fp8_direct_vec.h"  // Fp8DirectKernel
#include "backends/cuda/fp8_math.h"        // QuantJob, DirectJob

namespace weightsync {
namespace cuda {

// Threads per block of the kernel (one thread block per FP8 block).
inline constexpr int kQuantThreads = 256;

// Quantises `job` (fp8_math.h): every pointer addressable from the current
// device; job.x 4-byte aligned; job.q and job.scale may be unaligned.
// cudaErrorInvalidValue, nothing enqueued, for null pointers of a non-empty
// job, sizes below 0, block sides below 1, strides shorter than a row, or a
// block of more than 2^26 elements. An empty job is a no-op.
cudaError_t QuantizeFp8Blocks(const QuantJob& job, cudaStream_t stream);

// Quantises a batch of direct jobs (fp8_math.h, DirectJob: each a use's
// rectangle read straight from its source) in one launch of about as many
// thread blocks (kDirectThreads threads) as the device runs at once, each
// looping over FP8 blocks. `jobs`: n jobs in device memory, their
// first_block ascending from 0, total_blocks their blocks in all; every
// job's sizes checked (quant_direct.h, DirectExtentsOf), its source
// aligned to its element size and of a dtype the kernel reads, its output
// pointers valid (q and scale may be unaligned). cudaErrorInvalidValue,
// nothing enqueued, for n or total_blocks below 0 or null jobs; n or
// total_blocks 0 is a no-op.
//
// `receipts`: some job's receipt.out is set (fp8_math.h, DirectReceipt):
// those jobs also add the receipt terms of every FP8 byte and scale they
// store to *receipt.out (atomicAdd, mod 2^64; the caller zeroes it first
// and orders its read after the launch). False: the jobs' receipts
// are ignored: the kernel is the one without receipts at all.
cudaError_t QuantizeFp8Direct(const DirectJob* jobs, int n,
                              int64_t total_blocks, cudaStream_t stream,
                              Fp8DirectKernel kernel = Fp8DirectKernel::kRegs,
                              bool receipts = false);

// The lean kernel (fp8_direct_vec.h, DirectLeanOk; quant_kernels.cu,
// LeanKernel: the next block's source copied into shared memory while the
// current one is quantised) over a batch of direct jobs that are all
// DirectLeanOk and of source dtype `src_dtype`; otherwise as
// QuantizeFp8Direct. The same bytes, scales and receipt sums as the other
// kernels (quant_steps_test emulates it; tests/gpu/test_fp8_gpu.py exact
// on a GPU).
cudaError_t QuantizeFp8DirectLean(const DirectJob* jobs, int n,
                                  int64_t total_blocks, int32_t src_dtype,
                                  cudaStream_t stream, bool receipts = false);

}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_QUANT_KERNELS_H_
