#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "backends/cuda/float_convert.cuh"
#include "backends/cuda/kernel_math.h"
#include "backends/cuda/sm_count.cuh"
#include "backends/cuda/sparse_kernels.h"

namespace weightsync {
namespace cuda {
namespace {

using convert::Bf16;
using convert::F16;
using convert::F32;
using convert::kBfloat16;
using convert::kFloat16;
using convert::kFloat32;
using convert::Raw;

// Bytes per element of a weightsync::v1::DType value (the table of
// weightsync::ElementSize; patch_gpu_test checks it), 0 if unknown.
int64_t ElemSize(int dtype) {
  switch (dtype) {
    case 1:  // FLOAT32
    case 6:  // INT32
      return 4;
    case 2:  // BFLOAT16
    case 3:  // FLOAT16
    case 7:  // INT16
      return 2;
    case 4:  // FLOAT64
    case 5:  // INT64
      return 8;
    case 8:   // INT8
    case 9:   // UINT8
    case 10:  // BOOL
    case 11:  // FLOAT8_E4M3FN
    case 12:  // FLOAT8_E5M2
      return 1;
    default:
      return 0;
  }
}

bool IsConvertibleFloat(int dtype) {
  return dtype == kFloat32 || dtype == kBfloat16 || dtype == kFloat16;
}

bool Aligned(const void* p, int64_t a) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(a) == 0;
}

// Launches `kernel` with `args` and returns exactly its launch error (not
// an earlier one that cudaGetLastError might report).
template <typename... Params, typename... Args>
cudaError_t LaunchOn(void (*kernel)(Params...), int64_t grid, int block,
                     cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(static_cast<unsigned>(block));
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = nullptr;
  config.numAttrs = 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// Grid for a grid-stride loop over `n` items with `block` threads: enough
// blocks to fill the GPU, no more than the items need.
cudaError_t GridFor(int64_t n, int block, int64_t* grid) {
  int sms = 0;
  const cudaError_t err = MultiprocessorCount(&sms);
  if (err != cudaSuccess) return err;
  *grid = std::max<int64_t>(
      1, std::min<int64_t>((n + block - 1) / block, int64_t{sms} * 8));
  return cudaSuccess;
}

// ---------------------------------------------------------------------------
// Checking indices.

constexpr int kCheckThreads = 256;

// Checks indices[k] for k = begin, begin + step, ... < end (of a patch of
// a tensor of `numel` elements) and adds what it found to *report, one
// atomic per warp and counter. Every lane of the warp calls it.
template <typename I>
__device__ __forceinline__ void CheckStrided(const I* __restrict__ indices,
                                             int64_t begin, int64_t end,
                                             int64_t step, int64_t numel,
                                             SparseIndexReport* report) {
  unsigned long long out_of_range = 0, unsorted = 0, repeated = 0;
  unsigned long long first = ~0ull;
  for (int64_t k = begin; k < end; k += step) {
    const int64_t i = static_cast<int64_t>(indices[k]);
    if (i < 0 || i >= numel) {
      ++out_of_range;
      first = min(first, static_cast<unsigned long long>(k));
    }
    if (k > 0) {
      const int64_t prev = static_cast<int64_t>(indices[k - 1]);
      unsorted += i < prev;
      repeated += i == prev;
    }
  }
  // Almost always nothing was found: one vote instead of four reductions
  // (a batch block checks one entry per thread).
  if (!__any_sync(0xFFFFFFFFu, (out_of_range | unsorted | repeated) != 0)) {
    return;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    out_of_range += __shfl_down_sync(0xFFFFFFFFu, out_of_range, o);
    unsorted += __shfl_down_sync(0xFFFFFFFFu, unsorted, o);
    repeated += __shfl_down_sync(0xFFFFFFFFu, repeated, o);
    first = min(first, __shfl_down_sync(0xFFFFFFFFu, first, o));
  }
  if ((threadIdx.x & 31) == 0) {
    if (out_of_range != 0) {
      atomicAdd(&report->out_of_range, out_of_range);
      atomicMin(&report->first_out_of_range, first);
    }
    if (unsorted != 0) atomicAdd(&report->unsorted, unsorted);
    if (repeated != 0) atomicAdd(&report->repeated, repeated);
  }
}

template <typename I>
__global__ void __launch_bounds__(kCheckThreads)
    CheckIndicesKernel(const I* __restrict__ indices, int64_t nnz,
                       int64_t numel, SparseIndexReport* report) {
  CheckStrided(indices, blockIdx.x * int64_t{blockDim.x} + threadIdx.x, nnz,
               int64_t{gridDim.x} * blockDim.x, numel, report);
}

// ---------------------------------------------------------------------------
// Applying a patch.

// Value conversions of the apply kernel.
template <typename S, typename D>
struct Convert {
  using From = typename S::Storage;
  using To = typename D::Storage;
  static __device__ __forceinline__ To Apply(From v) {
    return D::FromFloat(S::ToFloat(v));
  }
};

template <int Bytes>
struct Copy {
  using From = typename Raw<Bytes>::Storage;
  using To = From;
  static __device__ __forceinline__ To Apply(From v) { return v; }
};

constexpr int kApplyThreads = 256;

// Writes entries k = begin, begin + step, ... < end of a patch (nnz
// entries of a tensor with `cols` columns and `numel` elements) through
// `use`, converted by Conv.
template <typename Conv, typename I>
__device__ __forceinline__ void ApplyStrided(
    const I* __restrict__ indices,
    const typename Conv::From* __restrict__ values, int64_t nnz, int64_t cols,
    int64_t numel, const SparseUse& use, int64_t begin, int64_t end,
    int64_t step) {
  auto* param = static_cast<typename Conv::To*>(use.param);
  for (int64_t k = begin; k < end; k += step) {
    if (!SparseEntryWins(indices, nnz, k)) continue;
    int64_t dst;
    if (!SparseDestination(use, cols, numel, static_cast<int64_t>(indices[k]),
                           &dst)) {
      continue;
    }
    param[dst] = Conv::Apply(values[k]);
  }
}

// `guard` (may be null): a report of SparseCheckIndices over the same
// indices; any index out of range there and the kernel writes nothing.
template <typename Conv, typename I>
__global__ void __launch_bounds__(kApplyThreads)
    ApplyKernel(const I* __restrict__ indices,
                const typename Conv::From* __restrict__ values, int64_t nnz,
                int64_t cols, int64_t numel, const SparseUse use,
                const SparseIndexReport* __restrict__ guard) {
  if (guard != nullptr && guard->out_of_range != 0) return;
  ApplyStrided<Conv>(indices, values, nnz, cols, numel, use,
                     blockIdx.x * int64_t{blockDim.x} + threadIdx.x, nnz,
                     int64_t{gridDim.x} * blockDim.x);
}

// What the apply launches share besides the conversion.
struct ApplyArgs {
  const void* indices;
  int index_bytes;
  const void* values;
  int64_t nnz, cols, numel;
  const SparseIndexReport* guard;
};

template <typename Conv>
cudaError_t LaunchApply(const ApplyArgs& a, const SparseUse& use,
                        cudaStream_t stream) {
  int64_t grid = 0;
  const cudaError_t err = GridFor(a.nnz, kApplyThreads, &grid);
  if (err != cudaSuccess) return err;
  const auto* values = static_cast<const typename Conv::From*>(a.values);
  if (a.index_bytes == 4) {
    return LaunchOn(ApplyKernel<Conv, uint32_t>, grid, kApplyThreads, stream,
                    static_cast<const uint32_t*>(a.indices), values, a.nnz,
                    a.cols, a.numel, use, a.guard);
  }
  return LaunchOn(ApplyKernel<Conv, int64_t>, grid, kApplyThreads, stream,
                  static_cast<const int64_t*>(a.indices), values, a.nnz, a.cols,
                  a.numel, use, a.guard);
}

template <typename S>
cudaError_t DispatchApplyDst(const ApplyArgs& a, const SparseUse& use,
                             cudaStream_t stream) {
  switch (use.dtype) {
    case kFloat32:
      return LaunchApply<Convert<S, F32>>(a, use, stream);
    case kBfloat16:
      return LaunchApply<Convert<S, Bf16>>(a, use, stream);
    case kFloat16:
      return LaunchApply<Convert<S, F16>>(a, use, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------------------
// Batches (SparseCheckBatch, SparseApplyBatch): block t takes tile t, the
// kSparseTileEntries entries of one job from (t - tile_begin) times that
// on; tile_jobs[t] (filled by FillTileJobsKernel first) names the job.

constexpr int kBatchThreads = 256;

__device__ __forceinline__ void TileRange(const SparseJob& j, int64_t t,
                                          int64_t* lo, int64_t* hi) {
  *lo = (t - j.tile_begin) * kSparseTileEntries;
  *hi = min(*lo + kSparseTileEntries, j.nnz);
}

// tile_jobs[tile_begin .. + tiles) = the job's index, for every job.
__global__ void FillTileJobsKernel(const SparseJob* __restrict__ jobs,
                                   int64_t n, int32_t* __restrict__ tile_jobs) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t begin = jobs[i].tile_begin, tiles = jobs[i].tiles;
    for (int64_t t = threadIdx.x; t < tiles; t += blockDim.x) {
      tile_jobs[begin + t] = static_cast<int32_t>(i);
    }
  }
}

// Tiles a check block takes: the check only reads (no span of writes to
// keep narrow), and per-block costs dominate one-entry-per-thread blocks.
constexpr int kCheckTilesPerBlock = 8;

__global__ void __launch_bounds__(kBatchThreads)
    CheckBatchKernel(const SparseJob* __restrict__ jobs,
                     const int32_t* __restrict__ tile_jobs,
                     int64_t total_tiles) {
  const int64_t first = int64_t{blockIdx.x} * kCheckTilesPerBlock;
  const int64_t end = min(first + kCheckTilesPerBlock, total_tiles);
  for (int64_t t = first; t < end; ++t) {
    const SparseJob& j = jobs[tile_jobs[t]];
    int64_t lo, hi;
    TileRange(j, t, &lo, &hi);
    if (j.index_bytes == 4) {
      CheckStrided(static_cast<const uint32_t*>(j.indices), lo + threadIdx.x,
                   hi, blockDim.x, j.numel, j.report);
    } else {
      CheckStrided(static_cast<const int64_t*>(j.indices), lo + threadIdx.x, hi,
                   blockDim.x, j.numel, j.report);
    }
  }
}

// Entries each thread of a batch block takes from its tile.
constexpr int kTilePerThread =
    static_cast<int>(kSparseTileEntries / kBatchThreads);
static_assert(kSparseTileEntries % kBatchThreads == 0, "whole tiles");

// Writes entries [lo, hi) (hi - lo <= kSparseTileEntries) of job j's patch,
// entry lo + t + e * kBatchThreads by thread t, every load before the first
// store. The stores are scattered 2-to-8-byte writes that cost a DRAM
// read-modify-write each and bound the apply (bench/gpu_kernels_bench
// "sparse model": stores alone take 97% of the apply's time).
template <typename Conv, typename I>
__device__ __forceinline__ void ApplyTile(const SparseJob& j, int64_t lo,
                                          int64_t hi) {
  const auto* indices = static_cast<const I*>(j.indices);
  const auto* values = static_cast<const typename Conv::From*>(j.values);
  auto* param = static_cast<typename Conv::To*>(j.use.param);
  I index[kTilePerThread];
  typename Conv::From value[kTilePerThread];
  bool wins[kTilePerThread];
#pragma unroll
  for (int e = 0; e < kTilePerThread; ++e) {
    const int64_t k = lo + threadIdx.x + int64_t{e} * kBatchThreads;
    wins[e] = k < hi && SparseEntryWins(indices, j.nnz, k);
    if (k < hi) {
      index[e] = indices[k];
      value[e] = values[k];
    }
  }
#pragma unroll
  for (int e = 0; e < kTilePerThread; ++e) {
    int64_t dst;
    if (wins[e] && SparseDestination(j.use, j.cols, j.numel,
                                     static_cast<int64_t>(index[e]), &dst)) {
      param[dst] = Conv::Apply(value[e]);
    }
  }
}

template <typename Conv>
__device__ __forceinline__ void ApplyRangeOf(const SparseJob& j, int64_t lo,
                                             int64_t hi) {
  if (j.index_bytes == 4) {
    ApplyTile<Conv, uint32_t>(j, lo, hi);
  } else {
    ApplyTile<Conv, int64_t>(j, lo, hi);
  }
}

template <typename S>
__device__ __forceinline__ void ApplyConverted(const SparseJob& j, int64_t lo,
                                               int64_t hi) {
  switch (j.use.dtype) {
    case kFloat32:
      ApplyRangeOf<Convert<S, F32>>(j, lo, hi);
      break;
    case kBfloat16:
      ApplyRangeOf<Convert<S, Bf16>>(j, lo, hi);
      break;
    default:
      ApplyRangeOf<Convert<S, F16>>(j, lo, hi);
      break;
  }
}

__global__ void __launch_bounds__(kBatchThreads)
    ApplyBatchKernel(const SparseJob* __restrict__ jobs,
                     const int32_t* __restrict__ tile_jobs, int64_t) {
  const int64_t t = blockIdx.x;
  const SparseJob& j = jobs[tile_jobs[t]];
  if (j.report != nullptr && j.report->out_of_range != 0) return;
  int64_t lo, hi;
  TileRange(j, t, &lo, &hi);
  if (j.value_dtype == j.use.dtype) {  // the job's kind is uniform
    switch (j.value_bytes) {
      case 1:
        ApplyRangeOf<Copy<1>>(j, lo, hi);
        break;
      case 2:
        ApplyRangeOf<Copy<2>>(j, lo, hi);
        break;
      case 4:
        ApplyRangeOf<Copy<4>>(j, lo, hi);
        break;
      default:
        ApplyRangeOf<Copy<8>>(j, lo, hi);
        break;
    }
    return;
  }
  switch (j.value_dtype) {
    case kFloat32:
      ApplyConverted<F32>(j, lo, hi);
      break;
    case kBfloat16:
      ApplyConverted<Bf16>(j, lo, hi);
      break;
    default:
      ApplyConverted<F16>(j, lo, hi);
      break;
  }
}

__global__ void ResetReportsKernel(SparseIndexReport* reports, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    reports[i] = SparseIndexReport{0, 0, 0, ~0ull};
  }
}

// `kernel` over `total_tiles` tiles, `per_block` of them a block.
cudaError_t LaunchBatch(void (*kernel)(const SparseJob*, const int32_t*,
                                       int64_t),
                        int64_t per_block, const SparseJob* jobs, int64_t n,
                        int64_t total_tiles, int32_t* tile_jobs,
                        cudaStream_t stream) {
  if (n < 0 || total_tiles < 0) return cudaErrorInvalidValue;
  if (n == 0 || total_tiles == 0) return cudaSuccess;
  if (jobs == nullptr || !Aligned(jobs, 8) || tile_jobs == nullptr ||
      !Aligned(tile_jobs, 4) || n > 0x7FFFFFFF || total_tiles > 0x7FFFFFFF) {
    return cudaErrorInvalidValue;
  }
  const cudaError_t err =
      LaunchOn(FillTileJobsKernel, std::min<int64_t>(n, 65535), kBatchThreads,
               stream, jobs, n, tile_jobs);
  if (err != cudaSuccess) return err;
  return LaunchOn(kernel, (total_tiles + per_block - 1) / per_block,
                  kBatchThreads, stream, jobs,
                  static_cast<const int32_t*>(tile_jobs), total_tiles);
}

// ---------------------------------------------------------------------------
// The diff helper. A tile is kDiffRounds rounds of kDiffThreads vectors of
// kV = 16 / ES elements; in round j thread t owns the elements
// [tile * kTe + (j * kDiffThreads + t) * kV, ... + kV): a warp's accesses
// are contiguous and, round after round, thread order is element order.

// Loads for the diff: kept in L2 where they fit, since the write pass reads
// the same bytes again.
__device__ __forceinline__ Words4 LoadVec(const char* p) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  Words4 out;
  out.w[0] = v.x;
  out.w[1] = v.y;
  out.w[2] = v.z;
  out.w[3] = v.w;
  return out;
}

// Bit j set where element j of the vector starting at element e0 differs
// (elements at or past numel never do). kVec: 16-byte loads of whole
// vectors (both tensors 16-byte aligned); the vector at the very end of the
// tensor may be partial and goes element by element.
template <int ES, bool kVec>
__device__ __forceinline__ uint32_t ChangedMask(const char* before,
                                                const char* after,
                                                int64_t numel, int64_t e0) {
  constexpr int kV = 16 / ES;
  uint32_t mask = 0;
  if (e0 >= numel) return 0;
  if (kVec && e0 + kV <= numel) {
    const Words4 a = LoadVec(before + e0 * ES);
    const Words4 b = LoadVec(after + e0 * ES);
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      mask |= static_cast<uint32_t>(VecBits<ES>(a, j) != VecBits<ES>(b, j))
              << j;
    }
    return mask;
  }
  const int64_t n = numel - e0 < kV ? numel - e0 : kV;
  for (int j = 0; j < n; ++j) {
    const int64_t off = (e0 + j) * ES;
    mask |= static_cast<uint32_t>(LoadBits<ES>(before + off) !=
                                  LoadBits<ES>(after + off))
            << j;
  }
  return mask;
}

template <int ES>
__device__ __forceinline__ int64_t VectorStart(int64_t tile, int round) {
  constexpr int kV = 16 / ES;
  return tile * DiffTileElems(ES) +
         (int64_t{round} * kDiffThreads + threadIdx.x) * kV;
}

// counts[tile] = changed elements in the tile.
template <int ES, bool kVec>
__global__ void __launch_bounds__(kDiffThreads)
    DiffCountKernel(const char* __restrict__ before,
                    const char* __restrict__ after, int64_t numel,
                    int64_t* __restrict__ counts) {
  __shared__ int warp_counts[kDiffThreads / 32];
  const int64_t tile = blockIdx.x;
  int count = 0;
#pragma unroll
  for (int j = 0; j < kDiffRounds; ++j) {
    count += __popc(
        ChangedMask<ES, kVec>(before, after, numel, VectorStart<ES>(tile, j)));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    count += __shfl_down_sync(0xFFFFFFFFu, count, o);
  }
  if ((threadIdx.x & 31) == 0) warp_counts[threadIdx.x >> 5] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    int total = 0;
#pragma unroll
    for (int w = 0; w < kDiffThreads / 32; ++w) total += warp_counts[w];
    counts[tile] = total;
  }
}

constexpr int kScanThreads = 1024;

// One block: counts[0, n) becomes its exclusive prefix sum (each tile's
// first output position), *total the sum. Thread t scans a contiguous strip.
__global__ void __launch_bounds__(kScanThreads)
    DiffScanKernel(int64_t* __restrict__ counts, int64_t n,
                   int64_t* __restrict__ total) {
  __shared__ long long warp_sums[kScanThreads / 32];
  const int64_t per = (n + kScanThreads - 1) / kScanThreads;
  const int64_t lo = min(n, threadIdx.x * per);
  const int64_t hi = min(n, lo + per);
  long long sum = 0;
  for (int64_t i = lo; i < hi; ++i) sum += counts[i];
  // Inclusive scan within the warp, then over the warps' totals.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  long long incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const long long v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    long long w = warp_sums[lane];
    long long wincl = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const long long v = __shfl_up_sync(0xFFFFFFFFu, wincl, o);
      if (lane >= o) wincl += v;
    }
    warp_sums[lane] = wincl - w;  // exclusive prefix of the warps
    if (lane == 31) *total = wincl;
  }
  __syncthreads();
  long long running = warp_sums[warp] + incl - sum;
  for (int64_t i = lo; i < hi; ++i) {
    const long long c = counts[i];
    counts[i] = running;
    running += c;
  }
}

// Writes each tile's changed elements from its first output position on, in
// element order, stopping at `capacity`.
template <int ES, bool kVec, typename I>
__global__ void __launch_bounds__(kDiffThreads)
    DiffWriteKernel(const char* __restrict__ before,
                    const char* __restrict__ after, int64_t numel,
                    const int64_t* __restrict__ offsets, int64_t tiles,
                    const int64_t* __restrict__ total, I* __restrict__ indices,
                    typename Raw<ES>::Storage* __restrict__ values,
                    int64_t capacity) {
  // Warp totals per round, double-buffered: one barrier per round.
  __shared__ int warp_counts[2][kDiffThreads / 32];
  const int64_t tile = blockIdx.x;
  const int64_t begin = offsets[tile];
  const int64_t end = tile + 1 < tiles ? offsets[tile + 1] : *total;
  // Uniform across the block: tiles without changes are not read again.
  if (begin == end || begin >= capacity) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t running = begin;  // output position of the round's first change
  for (int j = 0; j < kDiffRounds; ++j) {
    const int64_t e0 = VectorStart<ES>(tile, j);
    uint32_t mask = ChangedMask<ES, kVec>(before, after, numel, e0);
    const int count = __popc(mask);
    int incl = count;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
      if (lane >= o) incl += v;
    }
    int* buf = warp_counts[j & 1];
    if (lane == 31) buf[warp] = incl;
    __syncthreads();
    int before_warp = 0, round_total = 0;
#pragma unroll
    for (int w = 0; w < kDiffThreads / 32; ++w) {
      const int c = buf[w];
      before_warp += w < warp ? c : 0;
      round_total += c;
    }
    int64_t pos = running + before_warp + (incl - count);
    while (mask != 0 && pos < capacity) {
      const int b = __ffs(mask) - 1;
      mask &= mask - 1;
      indices[pos] = static_cast<I>(e0 + b);
      values[pos] = static_cast<typename Raw<ES>::Storage>(
          LoadBits<ES>(after + (e0 + b) * ES));
      ++pos;
    }
    running += round_total;
    if (running >= end || running >= capacity) break;  // uniform
  }
}

// The diff launches' arguments besides the element size.
struct DiffArgs {
  const void* before;
  const void* after;
  int64_t numel;
  int64_t* counts;  // the workspace
  void* indices;
  int index_bytes;
  void* values;
  int64_t capacity;
  int64_t* device_count;
};

template <int ES, bool kVec>
cudaError_t LaunchDiff(const DiffArgs& d, cudaStream_t stream) {
  const auto* b = static_cast<const char*>(d.before);
  const auto* a = static_cast<const char*>(d.after);
  const int64_t tiles = DiffTiles(d.numel, ES);
  cudaError_t err = LaunchOn(DiffCountKernel<ES, kVec>, tiles, kDiffThreads,
                             stream, b, a, d.numel, d.counts);
  if (err != cudaSuccess) return err;
  err = LaunchOn(DiffScanKernel, 1, kScanThreads, stream, d.counts, tiles,
                 d.device_count);
  if (err != cudaSuccess) return err;
  auto* values = static_cast<typename Raw<ES>::Storage*>(d.values);
  const auto* offsets = static_cast<const int64_t*>(d.counts);
  const auto* total = static_cast<const int64_t*>(d.device_count);
  if (d.index_bytes == 4) {
    return LaunchOn(DiffWriteKernel<ES, kVec, uint32_t>, tiles, kDiffThreads,
                    stream, b, a, d.numel, offsets, tiles, total,
                    static_cast<uint32_t*>(d.indices), values, d.capacity);
  }
  return LaunchOn(DiffWriteKernel<ES, kVec, int64_t>, tiles, kDiffThreads,
                  stream, b, a, d.numel, offsets, tiles, total,
                  static_cast<int64_t*>(d.indices), values, d.capacity);
}

template <int ES>
cudaError_t DispatchDiff(const DiffArgs& d, cudaStream_t stream) {
  if (Aligned(d.before, 16) && Aligned(d.after, 16)) {
    return LaunchDiff<ES, true>(d, stream);
  }
  return LaunchDiff<ES, false>(d, stream);
}

}  // namespace

cudaError_t SparseCheckIndices(const void* indices, int64_t nnz, int64_t numel,
                               SparseIndexReport* device_report,
                               cudaStream_t stream, int index_bytes) {
  if (nnz < 0 || device_report == nullptr || !Aligned(device_report, 8) ||
      (index_bytes != 4 && index_bytes != 8)) {
    return cudaErrorInvalidValue;
  }
  if (nnz > 0 && (indices == nullptr || !Aligned(indices, index_bytes))) {
    return cudaErrorInvalidValue;
  }
  static_assert(sizeof(SparseIndexReport) == 32, "four counters");
  cudaError_t err = cudaMemsetAsync(device_report, 0, 24, stream);
  if (err != cudaSuccess) return err;
  err = cudaMemsetAsync(&device_report->first_out_of_range, 0xFF, 8, stream);
  if (err != cudaSuccess || nnz == 0) return err;
  int64_t grid = 0;
  err = GridFor(nnz, kCheckThreads, &grid);
  if (err != cudaSuccess) return err;
  if (index_bytes == 4) {
    return LaunchOn(CheckIndicesKernel<uint32_t>, grid, kCheckThreads, stream,
                    static_cast<const uint32_t*>(indices), nnz, numel,
                    device_report);
  }
  return LaunchOn(CheckIndicesKernel<int64_t>, grid, kCheckThreads, stream,
                  static_cast<const int64_t*>(indices), nnz, numel,
                  device_report);
}

cudaError_t SparseApply(const void* indices, const void* values,
                        int value_dtype, int64_t nnz, int64_t tensor_cols,
                        int64_t tensor_numel, const SparseUse& use,
                        cudaStream_t stream, int index_bytes,
                        const SparseIndexReport* guard) {
  const int64_t ss = ElemSize(value_dtype);
  const int64_t ds = ElemSize(use.dtype);
  const bool same = value_dtype == use.dtype;
  if (ss == 0 || ds == 0 ||
      !(same ||
        (IsConvertibleFloat(value_dtype) && IsConvertibleFloat(use.dtype)))) {
    return cudaErrorInvalidValue;
  }
  if (nnz < 0 || (!use.implicit && tensor_cols < 1) ||
      (index_bytes != 4 && index_bytes != 8) ||
      (guard != nullptr && !Aligned(guard, 8))) {
    return cudaErrorInvalidValue;
  }
  if (nnz == 0) return cudaSuccess;
  if (indices == nullptr || values == nullptr || use.param == nullptr ||
      !Aligned(indices, index_bytes) || !Aligned(values, ss) ||
      !Aligned(use.param, ds)) {
    return cudaErrorInvalidValue;
  }
  const ApplyArgs a{indices,     index_bytes,  values, nnz,
                    tensor_cols, tensor_numel, guard};
  if (same) {
    switch (ss) {
      case 1:
        return LaunchApply<Copy<1>>(a, use, stream);
      case 2:
        return LaunchApply<Copy<2>>(a, use, stream);
      case 4:
        return LaunchApply<Copy<4>>(a, use, stream);
      default:
        return LaunchApply<Copy<8>>(a, use, stream);
    }
  }
  switch (value_dtype) {
    case kFloat32:
      return DispatchApplyDst<F32>(a, use, stream);
    case kBfloat16:
      return DispatchApplyDst<Bf16>(a, use, stream);
    default:
      return DispatchApplyDst<F16>(a, use, stream);
  }
}

cudaError_t PlanSparseJobs(SparseJob* jobs, int64_t n, bool apply,
                           int64_t* total_tiles) {
  if (n < 0 || total_tiles == nullptr || (n > 0 && jobs == nullptr)) {
    return cudaErrorInvalidValue;
  }
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    SparseJob& j = jobs[i];
    if (j.nnz < 0 || (j.index_bytes != 4 && j.index_bytes != 8) ||
        (j.report != nullptr && !Aligned(j.report, 8)) ||
        (!apply && j.report == nullptr) ||
        (j.nnz > 0 &&
         (j.indices == nullptr || !Aligned(j.indices, j.index_bytes)))) {
      return cudaErrorInvalidValue;
    }
    if (apply) {
      const int64_t ss = ElemSize(j.value_dtype);
      const int64_t ds = ElemSize(j.use.dtype);
      const bool same = j.value_dtype == j.use.dtype;
      if (ss == 0 || ds == 0 ||
          !(same || (IsConvertibleFloat(j.value_dtype) &&
                     IsConvertibleFloat(j.use.dtype))) ||
          (!j.use.implicit && j.cols < 1)) {
        return cudaErrorInvalidValue;
      }
      if (j.nnz > 0 && (j.values == nullptr || j.use.param == nullptr ||
                        !Aligned(j.values, ss) || !Aligned(j.use.param, ds))) {
        return cudaErrorInvalidValue;
      }
      j.value_bytes = static_cast<int32_t>(ss);
      j.param_bytes = static_cast<int32_t>(ds);
    }
    j.tile_begin = total;
    j.tiles = (j.nnz + kSparseTileEntries - 1) / kSparseTileEntries;
    total += j.tiles;
  }
  *total_tiles = total;
  return cudaSuccess;
}

cudaError_t SparseResetReports(SparseIndexReport* device_reports, int64_t n,
                               cudaStream_t stream) {
  if (n < 0 ||
      (n > 0 && (device_reports == nullptr || !Aligned(device_reports, 8)))) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  int64_t grid = 0;
  const cudaError_t err = GridFor(n, 256, &grid);
  if (err != cudaSuccess) return err;
  return LaunchOn(ResetReportsKernel, grid, 256, stream, device_reports, n);
}

cudaError_t SparseCheckBatch(const SparseJob* device_jobs, int64_t n,
                             int64_t total_tiles, int32_t* device_tile_jobs,
                             cudaStream_t stream) {
  return LaunchBatch(CheckBatchKernel, kCheckTilesPerBlock, device_jobs, n,
                     total_tiles, device_tile_jobs, stream);
}

cudaError_t SparseApplyBatch(const SparseJob* device_jobs, int64_t n,
                             int64_t total_tiles, int32_t* device_tile_jobs,
                             cudaStream_t stream) {
  return LaunchBatch(ApplyBatchKernel, 1, device_jobs, n, total_tiles,
                     device_tile_jobs, stream);
}

size_t DiffWorkspaceBytes(int64_t numel, int es) {
  if (numel <= 0 || (es != 1 && es != 2 && es != 4 && es != 8)) return 0;
  return static_cast<size_t>(DiffTiles(numel, es)) * sizeof(int64_t);
}

cudaError_t DiffChanged(const void* before, const void* after, int64_t numel,
                        int es, void* workspace, size_t workspace_bytes,
                        void* indices, void* values, int64_t capacity,
                        int64_t* device_count, cudaStream_t stream,
                        int index_bytes) {
  if ((es != 1 && es != 2 && es != 4 && es != 8) || numel < 0 || capacity < 0 ||
      device_count == nullptr || !Aligned(device_count, 8) ||
      (index_bytes != 4 && index_bytes != 8) ||
      (index_bytes == 4 && numel > (int64_t{1} << 32))) {
    return cudaErrorInvalidValue;
  }
  if (numel == 0) {
    return cudaMemsetAsync(device_count, 0, sizeof(int64_t), stream);
  }
  if (before == nullptr || after == nullptr || !Aligned(before, es) ||
      !Aligned(after, es) || workspace == nullptr || !Aligned(workspace, 8) ||
      workspace_bytes < DiffWorkspaceBytes(numel, es)) {
    return cudaErrorInvalidValue;
  }
  if (capacity > 0 &&
      (indices == nullptr || values == nullptr ||
       !Aligned(indices, index_bytes) || !Aligned(values, es))) {
    return cudaErrorInvalidValue;
  }
  // One block per tile: the grid's x dimension holds 2^31 - 1.
  if (DiffTiles(numel, es) > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const DiffArgs d{
      before,      after,       numel,  static_cast<int64_t*>(workspace),
      indices,     index_bytes, values, capacity,
      device_count};
  switch (es) {
    case 1:
      return DispatchDiff<1>(d, stream);
    case 2:
      return DispatchDiff<2>(d, stream);
    case 4:
      return DispatchDiff<4>(d, stream);
    default:
      return DispatchDiff<8>(d, stream);
  }
}

}  // namespace cuda
}  // namespace weightsync
