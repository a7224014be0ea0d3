#include <cuda_pipeline.h>
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

// The thread block's largest amax (kThreads threads); every thread gets
// it. warp_max is free again when it returns (the next FP8 block of the
// thread block reuses it).
template <int kThreads = kDirectThreads>
__device__ __forceinline__ float DirectBlockMax(float amax, float* warp_max) {
  constexpr int kDirectWarps = kThreads / 32;
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
// kReceipt: the terms of what the thread stores added to *sum.
template <int kDtype, int kThreads = kDirectThreads, bool kReceipt = false>
__device__ __forceinline__ void DirectBlock(const DirectJob& job, int64_t b,
                                            float* warp_max,
                                            uint64_t* sum = nullptr) {
  const uint32_t t = threadIdx.x;
  if (DirectHeld(job, b, kThreads, kDirectPerThread)) {
    float v[kDirectPerThread];
    float amax =
        DirectLoadPart<kDtype, kDirectPerThread>(job, b, t, kThreads, v);
    amax = DirectBlockMax<kThreads>(amax, warp_max);
    DirectWritePart<kDirectPerThread, kReceipt>(job, b, t, kThreads, amax, v,
                                                sum);
    return;
  }
  float amax = DirectAmaxStream<kDtype>(job, b, t, kThreads);
  amax = DirectBlockMax<kThreads>(amax, warp_max);
  DirectWriteStream<kDtype, kReceipt>(job, b, t, kThreads, amax, sum);
}

// The vec and cvt variants (fp8_direct_vec.h): FP8 block b in 16-byte
// vectors where its layout allows, else DirectBlock's walk with the same
// kVecThreads threads.
template <int kDtype, bool kCvt, bool kReceipt = false>
__device__ __forceinline__ void VecBlock(const DirectJob& job, int64_t b,
                                         float* warp_max,
                                         uint64_t* sum = nullptr) {
  const uint32_t t = threadIdx.x;
  int64_t r0, c0, h, w, i, j;
  QuantBlockOf(job.out, b, &r0, &c0, &h, &w, &i, &j);
  if (!VecBlockOk<kDtype>(job, c0, w)) {
    DirectBlock<kDtype, kVecThreads, kReceipt>(job, b, warp_max, sum);
    return;
  }
  if (VecHeld<kDtype>(job, b, kVecThreads, kVecPerThread)) {
    Fp8Raw16 v[kVecPerThread];
    float amax = VecLoadPart<kDtype, kVecPerThread>(job, b, t, kVecThreads, v);
    amax = DirectBlockMax<kVecThreads>(amax, warp_max);
    VecWritePart<kDtype, kVecPerThread, kCvt, kReceipt>(job, b, t, kVecThreads,
                                                        amax, v, sum);
    return;
  }
  float amax = VecAmaxStream<kDtype>(job, b, t, kVecThreads);
  amax = DirectBlockMax<kVecThreads>(amax, warp_max);
  VecWriteStream<kDtype, kCvt, kReceipt>(job, b, t, kVecThreads, amax, sum,
                                         false);
}

// Receipts (DirectJob's receipt): each thread sums the terms of what it
// stores while the thread block's jobs add to one `out`; where `out`
// changes (a job of another group) and at the end, the thread block's sums
// go to it, one atomicAdd a warp. Every thread of the block gets here
// together (the blocks it takes are the same for all of its threads).
__device__ __forceinline__ void FlushDirectReceipt(uint64_t sum,
                                                   unsigned long long* out) {
  if (out == nullptr) return;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_down_sync(0xFFFFFFFFu, sum, o);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(out, static_cast<unsigned long long>(sum));
  }
}

// FP8 block b of `job` (source dtype kDtype) by the variant kKernel (0
// regs, 1 vec, 2 cvt).
template <int kDtype, int kKernel, bool kReceipt>
__device__ __forceinline__ void DirectBlockBy(const DirectJob& job, int64_t b,
                                              float* warp_max, uint64_t* sum) {
  if constexpr (kKernel == 0) {
    DirectBlock<kDtype, kDirectThreads, kReceipt>(job, b, warp_max, sum);
  } else {
    VecBlock<kDtype, kKernel == 2, kReceipt>(job, b, warp_max, sum);
  }
}

template <int kKernel, bool kReceipt>
__device__ __forceinline__ void DirectDispatch(const DirectJob& job, int64_t b,
                                               float* warp_max, uint64_t* sum) {
  switch (job.src_dtype) {  // the same for the whole thread block
    case kFp8SrcFloat32:
      DirectBlockBy<kFp8SrcFloat32, kKernel, kReceipt>(job, b, warp_max, sum);
      break;
    case kFp8SrcBfloat16:
      DirectBlockBy<kFp8SrcBfloat16, kKernel, kReceipt>(job, b, warp_max, sum);
      break;
    case kFp8SrcFloat16:
      DirectBlockBy<kFp8SrcFloat16, kKernel, kReceipt>(job, b, warp_max, sum);
      break;
    default:
      break;  // refused by the caller
  }
}

// A batch of direct jobs: thread block x takes FP8 blocks x, x + gridDim.x,
// ... of the batch (the job of each found from the last one's).
// kReceipts (a batch with receipts): jobs with a receipt also sum their
// terms (FlushDirectReceipt); without, the kernel is what it was before
// receipts were fused, register for register.
template <int kKernel, bool kReceipts>
__device__ __forceinline__ void DirectBatch(const DirectJob* __restrict__ jobs,
                                            int n, int64_t total,
                                            float* warp_max) {
  int j = 0;
  uint64_t sum = 0;
  unsigned long long* out = nullptr;
  for (int64_t g = blockIdx.x; g < total; g += gridDim.x) {
    j = DirectJobOf(jobs, n, g, j);
    const DirectJob job = jobs[j];
    const int64_t b = g - job.first_block;
    if constexpr (kReceipts) {
      if (job.receipt.out != out) {
        FlushDirectReceipt(sum, out);
        sum = 0;
        out = job.receipt.out;
      }
      if (out != nullptr) {
        DirectDispatch<kKernel, true>(job, b, warp_max, &sum);
        continue;
      }
    }
    DirectDispatch<kKernel, false>(job, b, warp_max, nullptr);
  }
  if constexpr (kReceipts) FlushDirectReceipt(sum, out);
}

template <bool kCvt, bool kReceipts>
__global__ void __launch_bounds__(kVecThreads)
    VecKernel(const DirectJob* __restrict__ jobs, int n, int64_t total) {
  __shared__ float warp_max[kVecThreads / 32];
  DirectBatch<kCvt ? 2 : 1, kReceipts>(jobs, n, total, warp_max);
}

template <bool kReceipts>
__global__ void __launch_bounds__(kDirectThreads)
    DirectKernel(const DirectJob* __restrict__ jobs, int n, int64_t total) {
  __shared__ float warp_max[kDirectThreads / 32];
  DirectBatch<0, kReceipts>(jobs, n, total, warp_max);
}

// The lean kernel: jobs of one source dtype, each DirectLeanOk (every
// block held as whole aligned vectors), so the kernel holds only that path
// (fewer registers, more warps a multiprocessor: bench/RESULTS.md); the
// bfloat16 and float16 quotients by Fp8Divider. Each thread block copies
// its next kLeanStages - 1 FP8 blocks' source into shared memory
// (cp.async, 16 bytes a thread a vector) while it quantises the current
// one, so one block's loads overlap the work of the one before (without
// it, 12.1 against 6.2 ms on an H200: a block's loads waited for the
// stores of the one before). Thread t copies and reads only its own
// vectors (slot s of stage p at stage[(p * kVecPerThread + s) *
// kVecThreads + t]), so no barrier orders the copies: __pipeline_wait_prior
// does, thread by thread. A block without inf or NaN (VecTopPart: one
// packed max a word; nearly every block) takes its amax from that top and
// is written without the specials' tests (VecWrite's kFinite); any other
// takes VecAmaxHeld and the full tests. kReceipts: jobs with a receipt
// also sum their terms (FlushDirectReceipt; a job without one in such a
// batch sums terms it then drops).
constexpr int kLeanStages = 2;
constexpr size_t kLeanStageBytes =
    size_t{kLeanStages} * kVecPerThread * kVecThreads * sizeof(Fp8Raw16);

// Thread t's vectors of block b of `job` into its slots of one stage.
template <int kDtype>
__device__ __forceinline__ void LeanIssue(const DirectJob& job, int64_t b,
                                          Fp8Raw16* stage) {
  VecWalk k = VecWalkOf<kDtype>(job, b, threadIdx.x, kVecThreads);
#pragma unroll
  for (int s = 0; s < kVecPerThread; ++s) {
    if (k.r < k.h) {
      __pipeline_memcpy_async(stage + s * kVecThreads + threadIdx.x,
                              job.src + k.src, sizeof(Fp8Raw16));
    }
    VecNext<kDtype>(&k);
  }
}

// The copies of the next block ahead, gi (of job *ji), into `stage`, as
// one commit group (empty past the last block); gi moves on a stride.
template <int kDtype>
__device__ __forceinline__ void LeanIssueNext(const DirectJob* jobs, int n,
                                              int64_t total, int64_t* gi,
                                              int* ji, Fp8Raw16* stage) {
  if (*gi < total) {
    *ji = DirectJobOf(jobs, n, *gi, *ji);
    LeanIssue<kDtype>(jobs[*ji], *gi - jobs[*ji].first_block, stage);
  }
  __pipeline_commit();
  *gi += gridDim.x;
}

// Thread t's vectors of one stage, read where they are used (VecTopPart,
// VecWritePart: v[s]) rather than held in registers across the block's
// reduction (fewer registers: 3 thread blocks a multiprocessor with the
// fused receipt too).
struct LeanSlots {
  const Fp8Raw16* stage;
  __device__ __forceinline__ Fp8Raw16 operator[](int s) const {
    return stage[s * kVecThreads + threadIdx.x];
  }
};

// The thread block's largest `top` (unsigned); every thread gets it.
__device__ __forceinline__ uint32_t BlockTop(uint32_t top, uint32_t* warp_top) {
  top = __reduce_max_sync(0xFFFFFFFFu, top);
  if ((threadIdx.x & 31) == 0) warp_top[threadIdx.x >> 5] = top;
  __syncthreads();
  top = 0;
#pragma unroll
  for (int w = 0; w < kVecThreads / 32; ++w) {
    top = warp_top[w] > top ? warp_top[w] : top;
  }
  __syncthreads();
  return top;
}

template <int kDtype, bool kReceipts>
__global__ void __launch_bounds__(kVecThreads)
    LeanKernel(const DirectJob* __restrict__ jobs, int n, int64_t total) {
  extern __shared__ Fp8Raw16 lean_stage[];
  __shared__ float warp_max[kVecThreads / 32];
  __shared__ uint32_t warp_top[kVecThreads / 32];
  constexpr bool kDivider = kDtype != kFp8SrcFloat32;
  constexpr int kSlots = kVecPerThread * kVecThreads;
  // The blocks ahead: gi (its job ji) is the next to copy.
  int64_t gi = blockIdx.x;
  int ji = 0;
#pragma unroll
  for (int p = 0; p + 1 < kLeanStages; ++p) {
    LeanIssueNext<kDtype>(jobs, n, total, &gi, &ji, lean_stage + p * kSlots);
  }
  int j = 0;
  int p = 0;  // the stage of block g
  uint64_t sum = 0;
  unsigned long long* out = nullptr;
  for (int64_t g = blockIdx.x; g < total; g += gridDim.x) {
    const int ahead = p == 0 ? kLeanStages - 1 : p - 1;  // freed last round
    LeanIssueNext<kDtype>(jobs, n, total, &gi, &ji,
                          lean_stage + ahead * kSlots);
    __pipeline_wait_prior(kLeanStages - 1);  // block g's copies are in
    j = DirectJobOf(jobs, n, g, j);
    const DirectJob job = jobs[j];
    const int64_t b = g - job.first_block;
    if constexpr (kReceipts) {
      if (job.receipt.out != out) {
        FlushDirectReceipt(sum, out);
        sum = 0;
        out = job.receipt.out;
      }
    }
    const LeanSlots v{lean_stage + p * kSlots};
    const uint32_t top = BlockTop(
        VecTopPart<kDtype, kVecPerThread>(job, b, threadIdx.x, kVecThreads, v),
        warp_top);
    if (top < VecInfBits<kDtype>()) {
      // No inf or NaN in the block (nearly every block): top is its amax,
      // and the write skips the specials' tests.
      VecWritePart<kDtype, kVecPerThread, true, kReceipts, kDivider, true>(
          job, b, threadIdx.x, kVecThreads, VecWiden<kDtype>(top), v, &sum);
    } else {
      const float amax =
          DirectBlockMax<kVecThreads>(VecAmaxHeld<kDtype, kVecPerThread>(
                                          job, b, threadIdx.x, kVecThreads, v),
                                      warp_max);
      VecWritePart<kDtype, kVecPerThread, true, kReceipts, kDivider>(
          job, b, threadIdx.x, kVecThreads, amax, v, &sum);
    }
    p = p + 1 == kLeanStages ? 0 : p + 1;
  }
  if constexpr (kReceipts) FlushDirectReceipt(sum, out);
}

// Thread blocks for a grid-stride kernel: as many as run at once (with
// `smem` bytes of dynamic shared memory each).
cudaError_t ResidentGrid(const void* kernel, int threads, int64_t total,
                         std::atomic<int>* per_sm, int64_t* grid,
                         size_t smem = 0) {
  int resident = per_sm->load(std::memory_order_relaxed);
  if (resident <= 0) {
    cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &resident, kernel, threads, smem);
    if (err != cudaSuccess) return err;
    if (resident < 1) resident = 1;
    per_sm->store(resident, std::memory_order_relaxed);
  }
  int sms = 0;
  cudaError_t err = MultiprocessorCount(&sms);
  if (err != cudaSuccess) return err;
  *grid = static_cast<int64_t>(sms) * resident;
  if (*grid > total) *grid = total;
  return cudaSuccess;
}

}  // namespace

cudaError_t QuantizeFp8DirectLean(const DirectJob* jobs, int n,
                                  int64_t total_blocks, int32_t src_dtype,
                                  cudaStream_t stream, bool receipts) {
  if (n < 0 || total_blocks < 0 || (total_blocks > 0 && jobs == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (n == 0 || total_blocks == 0) return cudaSuccess;
  using Kernel = void (*)(const DirectJob*, int, int64_t);
  const Kernel kernels[2][3] = {
      {LeanKernel<kFp8SrcFloat32, false>, LeanKernel<kFp8SrcBfloat16, false>,
       LeanKernel<kFp8SrcFloat16, false>},
      {LeanKernel<kFp8SrcFloat32, true>, LeanKernel<kFp8SrcBfloat16, true>,
       LeanKernel<kFp8SrcFloat16, true>}};
  const int d = src_dtype == kFp8SrcFloat32    ? 0
                : src_dtype == kFp8SrcBfloat16 ? 1
                : src_dtype == kFp8SrcFloat16  ? 2
                                               : -1;
  if (d < 0) return cudaErrorInvalidValue;
  const int rc = receipts ? 1 : 0;
  const Kernel kernel = kernels[rc][d];
  static std::atomic<int> per_sm[2][3] = {};
  if (per_sm[rc][d].load(std::memory_order_relaxed) <= 0) {
    // Over the 48 KiB a kernel gets without asking (set before the
    // occupancy query, which counts it).
    cudaError_t err =
        cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kLeanStageBytes));
    if (err != cudaSuccess) return err;
  }
  int64_t grid = 0;
  cudaError_t err =
      ResidentGrid(reinterpret_cast<const void*>(kernel), kVecThreads,
                   total_blocks, &per_sm[rc][d], &grid, kLeanStageBytes);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(grid), kVecThreads, kLeanStageBytes, stream>>>(
      jobs, n, total_blocks);
  return cudaGetLastError();
}

cudaError_t QuantizeFp8Direct(const DirectJob* jobs, int n,
                              int64_t total_blocks, cudaStream_t stream,
                              Fp8DirectKernel kernel, bool receipts) {
  if (n < 0 || total_blocks < 0 || (total_blocks > 0 && jobs == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (n == 0 || total_blocks == 0) return cudaSuccess;
  const int k = static_cast<int>(kernel);
  if (k < 0 || k > 2) return cudaErrorInvalidValue;
  using Kernel = void (*)(const DirectJob*, int, int64_t);
  const Kernel kernels[2][3] = {
      {DirectKernel<false>, VecKernel<false, false>, VecKernel<true, false>},
      {DirectKernel<true>, VecKernel<false, true>, VecKernel<true, true>}};
  const int threads[3] = {kDirectThreads, kVecThreads, kVecThreads};
  const int rc = receipts ? 1 : 0;
  // As many thread blocks as run at once (each then loops over blocks).
  static std::atomic<int> per_sm[2][3] = {};
  int64_t grid = 0;
  cudaError_t err =
      ResidentGrid(reinterpret_cast<const void*>(kernels[rc][k]), threads[k],
                   total_blocks, &per_sm[rc][k], &grid);
  if (err != cudaSuccess) return err;
  kernels[rc][k]<<<static_cast<unsigned>(grid), threads[k], 0, stream>>>(
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
