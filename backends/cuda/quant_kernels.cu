#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/fp8_math.h"
#include "backends/cuda/quant_kernels.h"

namespace weightsync {
namespace cuda {
namespace {

constexpr int kWarps = kQuantThreads / 32;

// One thread block per FP8 block: the block's amax (a maximum: the order of
// the reduction changes nothing), then its elements and its scale.
__global__ void __launch_bounds__(kQuantThreads) QuantizeKernel(QuantJob job) {
  __shared__ float warp_max[kWarps];
  const int64_t b = blockIdx.x;
  float amax = QuantAmaxPart(job, b, threadIdx.x, kQuantThreads);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float other = __shfl_down_sync(0xFFFFFFFFu, amax, o);
    amax = other > amax ? other : amax;
  }
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w)
    amax = warp_max[w] > amax ? warp_max[w] : amax;
  QuantWritePart(job, b, amax, threadIdx.x, kQuantThreads);
}

}  // namespace

cudaError_t QuantizeFp8Blocks(const QuantJob& job, cudaStream_t stream) {
  if (job.rows < 0 || job.width < 0 || job.block_rows < 1 ||
      job.block_cols < 1) {
    return cudaErrorInvalidValue;
  }
  if (job.rows == 0 || job.width == 0) return cudaSuccess;
  const int64_t h = job.rows < job.block_rows ? job.rows : job.block_rows;
  const int64_t w = job.width < job.block_cols ? job.width : job.block_cols;
  if (job.x == nullptr || job.q == nullptr || job.scale == nullptr ||
      reinterpret_cast<uintptr_t>(job.x) % 4 != 0 || job.x_stride < job.width ||
      job.q_stride < job.width || h * w > (int64_t{1} << 26)) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = QuantJobBlocks(job);
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  QuantizeKernel<<<static_cast<unsigned>(blocks), kQuantThreads, 0, stream>>>(
      job);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace weightsync
