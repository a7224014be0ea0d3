// Probe kernels for gpu_kernels_bench's "sparse model" section: where the
// time of a batched sparse apply goes. Not used by the product; each probe
// writes bfloat16 patch values (uint32 indices) into parameters with the
// implicit mapping (flat index = parameter element), one tile of
// kProbeTileEntries entries per thread block, as the worker's batched
// apply does (backends/cuda/sparse_kernels.h). Built only with CUDA.
#ifndef WEIGHTSYNC_BENCH_SPARSE_PROBE_H_
#define WEIGHTSYNC_BENCH_SPARSE_PROBE_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace weightsync {
namespace bench {

constexpr int64_t kProbeTileEntries = 2048;

struct ProbePatch {
  const uint32_t* indices;
  const uint16_t* values;
  uint16_t* param;
  int64_t nnz;
};

enum class Probe {
  kStoreOnly,     // param[index] = constant: loads only the indices
  kStridedRegs,   // the apply, each thread's 8 strided entries loaded first
  kRunPerThread,  // the apply, each thread 8 consecutive entries
  kStreaming,     // kStridedRegs with streaming (evict-first) stores
  kQuarterTiles,  // kStridedRegs, a quarter tile (2 entries a thread) per
                  // block: in-flight writes span 4x fewer addresses
  kEighthTiles,   // the same, an eighth (1 entry a thread)
  kSectorRmw,     // read the 32-byte sector, merge, write it whole (racy:
                  // timing only, the result is not checked)
};

// tile_patch[t]: the patch of tile t; tile_first[t]: its first entry.
// All pointers device memory.
cudaError_t LaunchProbe(Probe probe, const ProbePatch* patches,
                        const int32_t* tile_patch, const int64_t* tile_first,
                        int64_t tiles, cudaStream_t stream);

}  // namespace bench
}  // namespace weightsync

#endif  // WEIGHTSYNC_BENCH_SPARSE_PROBE_H_
