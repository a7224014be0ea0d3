#include "bench/sparse_probe.h"

namespace weightsync {
namespace bench {
namespace {

constexpr int kThreads = 256;
constexpr int kPer = kProbeTileEntries / kThreads;  // 8

// This block's tile: its patch, and its entries [*lo, *hi).
__device__ __forceinline__ const ProbePatch& TileOf(const ProbePatch* patches,
                                                    const int32_t* tile_patch,
                                                    const int64_t* tile_first,
                                                    int64_t* lo, int64_t* hi) {
  const ProbePatch& p = patches[tile_patch[blockIdx.x]];
  *lo = tile_first[blockIdx.x];
  *hi = min(*lo + kProbeTileEntries, p.nnz);
  return p;
}

__global__ void __launch_bounds__(kThreads)
    StoreOnly(const ProbePatch* patches, const int32_t* tile_patch,
              const int64_t* tile_first) {
  int64_t lo, hi;
  const ProbePatch& p = TileOf(patches, tile_patch, tile_first, &lo, &hi);
  for (int64_t k = lo + threadIdx.x; k < hi; k += kThreads) {
    p.param[p.indices[k]] = 0x3F80;
  }
}

// The apply, each thread's entries loaded before its first store, over
// 1/kParts of a tile per block (grid: tiles x kParts; kParts > 1: the
// blocks in flight cover a kParts times narrower span of addresses);
// kStream: streaming (evict-first) stores.
template <int kParts, bool kStream>
__global__ void __launch_bounds__(kThreads)
    LoadsFirst(const ProbePatch* patches, const int32_t* tile_patch,
               const int64_t* tile_first) {
  constexpr int kEach = kPer / kParts;
  const int tile = blockIdx.x / kParts, part = blockIdx.x % kParts;
  const ProbePatch& p = patches[tile_patch[tile]];
  const int64_t lo = tile_first[tile] + int64_t{part} * kEach * kThreads;
  const int64_t hi = min(
      min(lo + kEach * kThreads, tile_first[tile] + kProbeTileEntries), p.nnz);
  uint32_t idx[kEach], next[kEach];
  uint16_t val[kEach];
#pragma unroll
  for (int e = 0; e < kEach; ++e) {
    const int64_t k = lo + threadIdx.x + e * kThreads;
    if (k < hi) {
      idx[e] = p.indices[k];
      next[e] = k + 1 < p.nnz ? p.indices[k + 1] : ~idx[e];
      val[e] = p.values[k];
    }
  }
#pragma unroll
  for (int e = 0; e < kEach; ++e) {
    const int64_t k = lo + threadIdx.x + e * kThreads;
    if (k < hi && next[e] != idx[e]) {
      if (kStream) {
        __stcs(reinterpret_cast<unsigned short*>(p.param) + idx[e], val[e]);
      } else {
        p.param[idx[e]] = val[e];
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    RunPerThread(const ProbePatch* patches, const int32_t* tile_patch,
                 const int64_t* tile_first) {
  int64_t first, hi;
  const ProbePatch& p = TileOf(patches, tile_patch, tile_first, &first, &hi);
  const int64_t lo = first + int64_t{threadIdx.x} * kPer;
  uint32_t idx[kPer + 1];
  uint16_t val[kPer];
#pragma unroll
  for (int e = 0; e <= kPer; ++e) {
    const int64_t k = lo + e;
    idx[e] = k < p.nnz ? p.indices[k] : 0xFFFFFFFFu;
    if (e < kPer && k < hi) val[e] = p.values[k];
  }
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int64_t k = lo + e;
    if (k < hi && (k + 1 >= p.nnz || idx[e + 1] != idx[e])) {
      p.param[idx[e]] = val[e];
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    SectorRmw(const ProbePatch* patches, const int32_t* tile_patch,
              const int64_t* tile_first) {
  int64_t lo, hi;
  const ProbePatch& p = TileOf(patches, tile_patch, tile_first, &lo, &hi);
  for (int64_t k = lo + threadIdx.x; k < hi; k += kThreads) {
    const uint32_t i = p.indices[k];
    // The 32-byte sector of element i (parameters are 256-byte aligned).
    uint4* sector = reinterpret_cast<uint4*>(p.param + (i & ~15u));
    uint4 a = sector[0], b = sector[1];
    uint16_t* h = (i & 8u) ? reinterpret_cast<uint16_t*>(&b)
                           : reinterpret_cast<uint16_t*>(&a);
    h[i & 7u] = p.values[k];
    sector[0] = a;
    sector[1] = b;
  }
}

}  // namespace

cudaError_t LaunchProbe(Probe probe, const ProbePatch* patches,
                        const int32_t* tile_patch, const int64_t* tile_first,
                        int64_t tiles, cudaStream_t stream) {
  if (tiles <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(tiles)), block(kThreads);
  switch (probe) {
    case Probe::kStoreOnly:
      StoreOnly<<<grid, block, 0, stream>>>(patches, tile_patch, tile_first);
      break;
    case Probe::kStridedRegs:
      LoadsFirst<1, false>
          <<<grid, block, 0, stream>>>(patches, tile_patch, tile_first);
      break;
    case Probe::kStreaming:
      LoadsFirst<1, true>
          <<<grid, block, 0, stream>>>(patches, tile_patch, tile_first);
      break;
    case Probe::kRunPerThread:
      RunPerThread<<<grid, block, 0, stream>>>(patches, tile_patch, tile_first);
      break;
    case Probe::kQuarterTiles:
      LoadsFirst<4, false>
          <<<dim3(static_cast<unsigned>(tiles * 4)), block, 0, stream>>>(
              patches, tile_patch, tile_first);
      break;
    case Probe::kEighthTiles:
      LoadsFirst<8, false>
          <<<dim3(static_cast<unsigned>(tiles * 8)), block, 0, stream>>>(
              patches, tile_patch, tile_first);
      break;
    case Probe::kSectorRmw:
      SectorRmw<<<grid, block, 0, stream>>>(patches, tile_patch, tile_first);
      break;
  }
  return cudaGetLastError();
}

}  // namespace bench
}  // namespace weightsync
