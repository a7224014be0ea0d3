// Kernels of bench/mton_worker_bench.cc (issue 32's worker-level proof):
// every element of every checkpoint tensor is a function of (tensor, row,
// column, version), so that a sender fills its own shard and a receiver
// checks its engine's memory without any data travelling besides the
// update itself. Built only with CUDA.
#ifndef WEIGHTSYNC_BENCH_MTON_KERNELS_H_
#define WEIGHTSYNC_BENCH_MTON_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace weightsync {
namespace bench {

// dst[r * cols + c] = value(tensor, row0 + r, c, version), r < rows.
cudaError_t FillRows(uint16_t* dst, int64_t rows, int64_t cols, int64_t row0,
                     uint32_t tensor, uint32_t version, cudaStream_t stream);

// Adds to *bad the elements (r, c) of the rows x cols rectangle at
// engine (row stride `stride` elements) that differ from
// value(tensor, row0 + r, col0 + c, version).
cudaError_t CountMismatches(const uint16_t* engine, int64_t rows, int64_t cols,
                            int64_t stride, int64_t row0, int64_t col0,
                            uint32_t tensor, uint32_t version,
                            unsigned long long* bad, cudaStream_t stream);

}  // namespace bench
}  // namespace weightsync

#endif  // WEIGHTSYNC_BENCH_MTON_KERNELS_H_
