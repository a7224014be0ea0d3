#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "backends/cuda/kernel_math.h"
#include "backends/cuda/receipt_kernels.h"
#include "backends/cuda/sm_count.cuh"

namespace weightsync {
namespace cuda {
namespace {

constexpr int kWarps = kReceiptThreads / 32;

__device__ __forceinline__ unsigned long long WarpSum(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, o);
  return v;
}

// Adds the sum of every thread's `sum` to *out with one atomicAdd. Every
// thread of the block calls it (it has barriers); `scratch` is shared.
__device__ __forceinline__ void FlushBlockSum(unsigned long long sum,
                                              unsigned long long* out,
                                              unsigned long long* scratch) {
  sum = WarpSum(sum);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += scratch[w];
    if (total != 0) atomicAdd(out, total);
  }
  __syncthreads();  // scratch is reused by the next flush
}

// The regions of a launch: one, passed by value (ReceiptSum), or an array
// in device memory (ReceiptSumBatch).
struct OneRegion {
  ReceiptRegion r;
  __device__ __forceinline__ int64_t size() const { return 1; }
  __device__ __forceinline__ ReceiptRegion operator[](int64_t) const {
    return r;
  }
};

struct RegionArray {
  const ReceiptRegion* p;
  int64_t n;
  __device__ __forceinline__ int64_t size() const { return n; }
  __device__ __forceinline__ const ReceiptRegion& operator[](int64_t i) const {
    return p[i];
  }
};

// Block b takes a contiguous run of tiles (ReceiptBlockTiles) and adds its
// partial sum to a region's `out` when the next tile's region has another
// `out`, and at the end: one atomicAdd per region and block at most.
// COPY: the regions are copy regions (ReceiptRegion::dst), each element
// written where it belongs as it is summed.
template <typename Regions, bool COPY>
__global__ void __launch_bounds__(kReceiptThreads)
    ReceiptKernel(const Regions regions, const int64_t total_tiles) {
  __shared__ unsigned long long scratch[kWarps];
  int64_t lo, hi;
  ReceiptBlockTiles(total_tiles, gridDim.x, blockIdx.x, &lo, &hi);
  if (lo >= hi) return;  // the whole block: no barrier is skipped unevenly
  int64_t d = FindReceiptRegion(regions, regions.size(), lo);
  unsigned long long* out = nullptr;
  unsigned long long sum = 0;
  for (int64_t t = lo; t < hi; ++t) {
    while (t >= regions[d].tile_begin + regions[d].tiles) ++d;
    // A reference into the array (a copy for OneRegion): fields are read
    // where used, rather than all held in registers.
    const auto& r = regions[d];
    // r (hence r.out) is the same for every thread: the branch and its
    // barriers are uniform.
    if (r.out != out) {
      if (out != nullptr) FlushBlockSum(sum, out, scratch);
      out = r.out;
      sum = 0;
    }
    const int64_t local = t - r.tile_begin;
    switch (r.es) {
      case 1:
        sum += ReceiptTileThreadSum<1, COPY>(r, local, threadIdx.x);
        break;
      case 2:
        sum += ReceiptTileThreadSum<2, COPY>(r, local, threadIdx.x);
        break;
      case 4:
        sum += ReceiptTileThreadSum<4, COPY>(r, local, threadIdx.x);
        break;
      default:
        sum += ReceiptTileThreadSum<8, COPY>(r, local, threadIdx.x);
        break;
    }
  }
  if (out != nullptr) FlushBlockSum(sum, out, scratch);
}

template <typename Regions, bool COPY = false>
cudaError_t Launch(Regions regions, int64_t total_tiles, cudaStream_t stream) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int sms = 0;
  err = MultiprocessorCount(device, &sms);
  if (err != cudaSuccess) return err;
  // Resident blocks per SM, once per process and instantiation (every GPU
  // of a node is the same model).
  static std::atomic<int> blocks_per_sm{0};
  int bps = blocks_per_sm.load(std::memory_order_relaxed);
  if (bps == 0) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &bps, ReceiptKernel<Regions, COPY>, kReceiptThreads, 0);
    if (err != cudaSuccess) return err;
    bps = std::max(bps, 1);
    blocks_per_sm.store(bps, std::memory_order_relaxed);
  }
  const int64_t grid =
      std::min<int64_t>(total_tiles, static_cast<int64_t>(sms) * bps);
  void* args[] = {&regions, &total_tiles};
  return cudaLaunchKernel(
      reinterpret_cast<const void*>(&ReceiptKernel<Regions, COPY>),
      dim3(static_cast<unsigned>(grid)), dim3(kReceiptThreads), args, 0,
      stream);
}

}  // namespace

cudaError_t ReceiptSum(const void* base, int64_t rows, int64_t cols,
                       int64_t row_stride_bytes, int es, uint64_t salt,
                       uint64_t first_index, uint64_t* device_out,
                       cudaStream_t stream) {
  OneRegion one;
  ReceiptRegion& r = one.r;
  r = ReceiptRegion{};
  r.base = base;
  r.rows = rows;
  r.cols = cols;
  r.row_stride_bytes = row_stride_bytes;
  r.salt = salt;
  r.first_index = first_index;
  r.out = reinterpret_cast<unsigned long long*>(device_out);
  r.es = es;
  if (!PlanReceiptRegion(r, 0)) return cudaErrorInvalidValue;
  if (r.tiles == 0) return cudaSuccess;
  return Launch(one, r.tiles, stream);
}

cudaError_t ReceiptSumBatch(const ReceiptRegion* device_regions, int64_t n,
                            int64_t total_tiles, cudaStream_t stream) {
  if (n < 0 || total_tiles < 0) return cudaErrorInvalidValue;
  if (n == 0 || total_tiles == 0) return cudaSuccess;
  if (device_regions == nullptr) return cudaErrorInvalidValue;
  return Launch(RegionArray{device_regions, n}, total_tiles, stream);
}

cudaError_t ReceiptCopyBatch(const ReceiptRegion* device_regions, int64_t n,
                             int64_t total_tiles, cudaStream_t stream) {
  if (n < 0 || total_tiles < 0) return cudaErrorInvalidValue;
  if (n == 0 || total_tiles == 0) return cudaSuccess;
  if (device_regions == nullptr) return cudaErrorInvalidValue;
  return Launch<RegionArray, true>(RegionArray{device_regions, n}, total_tiles,
                                   stream);
}

}  // namespace cuda
}  // namespace weightsync
