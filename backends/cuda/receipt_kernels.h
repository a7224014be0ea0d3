// Receipts on the GPU (docs/protocol.md, "Receipts"; issue 5): the sum,
// mod 2^64, of common/checksum.h's ElementTerm(salt, index, bits) over the
// elements of a parameter that an update installed, read from device
// memory. Bit for bit what daemon/core/receipt.cc's ComputeReceipt adds for
// the same elements on the host.
//
// Stateless and thread-safe; nothing here synchronises: work is enqueued on
// `stream` and the caller orders it (events) after the writes it checks and
// before it reads the sums. Only the device's multiprocessor count and the
// kernel's occupancy are cached. Built only with CUDA
// (//backends/cuda:receipt_kernels is header-only otherwise); include it from
// code that is itself compiled only when WEIGHTSYNC_HAS_CUDA.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_RECEIPT_KERNELS_H_
#define WEIGHTSYNC_BACKENDS_CUDA_RECEIPT_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernel_math.h"  // ReceiptRegion, PlanReceiptRegions

namespace weightsync {
namespace cuda {

// Adds to *device_out (device memory, one atomicAdd per thread block) the
// terms of rows x cols elements of `es` bytes (1, 2, 4 or 8): row r starts
// at base + r * row_stride_bytes, and element (r, c) is element
//   first_index + r * (row_stride_bytes / es) + c
// of the parameter salted `salt` (weightsync::ParameterSalt(name)).
//
// For segment s of parameter p, as ComputeReceipt sums it: base = the
// parameter's address + s.dest_offset * es, first_index = s.dest_offset,
// rows = s.row_count, cols = s.col_count, row_stride_bytes =
// s.dest_row_stride * es. A parameter without segments: one row of numel
// elements, first_index 0. Only segments whose source was in the manifest
// count; padding that no segment writes is never read.
//
// cudaErrorInvalidValue, nothing enqueued, where PlanReceiptRegion refuses
// the region (kernel_math.h: es, negative sizes, null or misaligned
// pointers, a stride not a multiple of es or shorter than a row). An empty
// region is a no-op returning cudaSuccess. The caller zeroes *device_out
// before the first call of a sum (e.g. cudaMemsetAsync); several calls may
// add to one sum.
cudaError_t ReceiptSum(const void* base, int64_t rows, int64_t cols,
                       int64_t row_stride_bytes, int es, uint64_t salt,
                       uint64_t first_index, uint64_t* device_out,
                       cudaStream_t stream);

// The same for many regions in one launch (e.g. every segment of every
// parameter of an engine): `device_regions` holds `n` ReceiptRegions planned
// on the host by PlanReceiptRegions(regions, n), which returned
// `total_tiles` (>= 0), then copied to device memory as they are. Each
// region's terms go to its own `out` (any device address: one per engine,
// one per parameter, ...). The array must stay unchanged until the kernel
// has run. total_tiles == 0: no-op.
//
// Work is split evenly in tiles of at most 16 KiB, so parameters of any mix
// of sizes cost one launch and run at one speed. Speed: see
// bench/gpu_kernels_bench.cc (the function is 32-bit arithmetic, about a
// handful of operations and one multiply per element, so even 2-byte elements
// are meant to run at HBM speed: ~4 ms for 16.4 GB of bfloat16 on an H200).
cudaError_t ReceiptSumBatch(const ReceiptRegion* device_regions, int64_t n,
                            int64_t total_tiles, cudaStream_t stream);

// ReceiptSumBatch over copy regions (every region's dst set): each element
// is read from base, written to dst and its term, keyed on its place at
// dst, added to the region's out. One pass over the bytes instead of a copy
// and then a receipt pass that reads the destination again: the receipt of
// an IPC update fused with its copy (GpuWorker::PlanFusedCopies). The
// kernel reads through the SMs, so the copy runs at SM-copy speed
// (bench/RESULTS.md). Regions must not overlap at dst.
cudaError_t ReceiptCopyBatch(const ReceiptRegion* device_regions, int64_t n,
                             int64_t total_tiles, cudaStream_t stream);

}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_RECEIPT_KERNELS_H_
