#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "backends/cuda/fp8_math.h"
#include "backends/cuda/quant_kernels.h"
#include "backends/cuda/sm_count.cuh"

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

constexpr int kDirectWarps = kDirectThreads / 32;

// The thread block's largest amax; every thread gets it. warp_max is free
// again when it returns (the next FP8 block of the thread block reuses it).
__device__ __forceinline__ float DirectBlockMax(float amax, float* warp_max) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float other = __shfl_down_sync(0xFFFFFFFFu, amax, o);
    amax = other > amax ? other : amax;
  }
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.0f;
#pragma unroll
  for (int w = 0; w < kDirectWarps; ++w) {
    amax = warp_max[w] > amax ? warp_max[w] : amax;
  }
  __syncthreads();
  return amax;
}

// FP8 block b of `job`: held in registers (read once) where it fits, else
// read twice; fp8_math.h's functions, as quant_steps_test runs them.
template <int kDtype>
__device__ __forceinline__ void DirectBlock(const DirectJob& job, int64_t b,
                                            float* warp_max) {
  const uint32_t t = threadIdx.x;
  if (DirectHeld(job, b, kDirectThreads, kDirectPerThread)) {
    float v[kDirectPerThread];
    float amax =
        DirectLoadPart<kDtype, kDirectPerThread>(job, b, t, kDirectThreads, v);
    amax = DirectBlockMax(amax, warp_max);
    DirectWritePart<kDirectPerThread>(job, b, t, kDirectThreads, amax, v);
    return;
  }
  float amax = DirectAmaxStream<kDtype>(job, b, t, kDirectThreads);
  amax = DirectBlockMax(amax, warp_max);
  DirectWriteStream<kDtype>(job, b, t, kDirectThreads, amax);
}

// A batch of direct jobs: thread block x takes FP8 blocks x, x + gridDim.x,
// ... of the batch (the job of each found from the last one's).
__global__ void __launch_bounds__(kDirectThreads)
    DirectKernel(const DirectJob* __restrict__ jobs, int n, int64_t total) {
  __shared__ float warp_max[kDirectWarps];
  int j = 0;
  for (int64_t g = blockIdx.x; g < total; g += gridDim.x) {
    j = DirectJobOf(jobs, n, g, j);
    const DirectJob job = jobs[j];
    const int64_t b = g - job.first_block;
    switch (job.src_dtype) {  // the same for the whole thread block
      case kFp8SrcFloat32:
        DirectBlock<kFp8SrcFloat32>(job, b, warp_max);
        break;
      case kFp8SrcBfloat16:
        DirectBlock<kFp8SrcBfloat16>(job, b, warp_max);
        break;
      case kFp8SrcFloat16:
        DirectBlock<kFp8SrcFloat16>(job, b, warp_max);
        break;
      default:
        break;  // refused by the caller
    }
  }
}

}  // namespace

cudaError_t QuantizeFp8Direct(const DirectJob* jobs, int n,
                              int64_t total_blocks, cudaStream_t stream) {
  if (n < 0 || total_blocks < 0 || (total_blocks > 0 && jobs == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (n == 0 || total_blocks == 0) return cudaSuccess;
  // As many thread blocks as run at once (each then loops over blocks).
  static std::atomic<int> per_sm{0};
  int resident = per_sm.load(std::memory_order_relaxed);
  if (resident <= 0) {
    cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &resident, DirectKernel, kDirectThreads, 0);
    if (err != cudaSuccess) return err;
    if (resident < 1) resident = 1;
    per_sm.store(resident, std::memory_order_relaxed);
  }
  int sms = 0;
  cudaError_t err = MultiprocessorCount(&sms);
  if (err != cudaSuccess) return err;
  int64_t grid = static_cast<int64_t>(sms) * resident;
  if (grid > total_blocks) grid = total_blocks;
  DirectKernel<<<static_cast<unsigned>(grid), kDirectThreads, 0, stream>>>(
      jobs, n, total_blocks);
  return cudaGetLastError();
}

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
