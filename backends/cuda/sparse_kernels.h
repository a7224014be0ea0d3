// Sparse patches on the GPU (docs/protocol.md, "Sparse patches"; issue 5):
// applying a patch (int64 or uint32 flat indices into a checkpoint tensor,
// values of its dtype) through one use of the tensor, i.e. one segment of one
// engine parameter, with dtype conversion; checking a patch's indices; and the
// trainer's diff helper that turns two versions of a tensor into a patch.
//
// Stateless and thread-safe; nothing here synchronises: work is enqueued on
// `stream` and the caller orders it (events) against what produced the
// inputs and what reads the outputs. Dtypes are weightsync::v1::DType values
// passed as int (no protobuf for nvcc). Built only with CUDA
// (//backends/cuda:sparse_kernels is header-only otherwise); include it from
// code that is itself compiled only when WEIGHTSYNC_HAS_CUDA.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_SPARSE_KERNELS_H_
#define WEIGHTSYNC_BACKENDS_CUDA_SPARSE_KERNELS_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backends/cuda/kernel_math.h"  // SparseUse

namespace weightsync {
namespace cuda {

// What SparseCheckIndices found in a patch's indices.
struct SparseIndexReport {
  unsigned long long out_of_range;  // indices outside [0, numel)
  unsigned long long unsorted;      // positions k > 0: indices[k] < [k - 1]
  unsigned long long repeated;      // positions k > 0: indices[k] == [k - 1]
  // Smallest position k whose index is outside [0, numel), or ~0ull.
  unsigned long long first_out_of_range;
};

// Fills *device_report (device memory; it is reset first, on `stream`) for
// the `nnz` indices at `indices` (device memory) of a
// tensor of `numel` elements. The host path (ApplySparsePatch) refuses a
// patch with any index out of range before writing anything; to do the
// same, check, synchronise, read the report, and only then apply.
// out_of_range == 0 and unsorted == 0 (as the diff helpers produce: sorted,
// no repeats) guarantee that SparseApply writes exactly what the host path
// writes. cudaErrorInvalidValue (nothing enqueued) for nnz < 0, a null or
// misaligned pointer.
// index_bytes: 8 (int64 indices) or 4 (uint32), aligned to that.
cudaError_t SparseCheckIndices(const void* indices, int64_t nnz, int64_t numel,
                               SparseIndexReport* device_report,
                               cudaStream_t stream, int index_bytes = 8);

// Writes the patch (`nnz` indices, `values` of `value_dtype`, both in
// memory the current device can read) into the parameter of `use`, exactly
// as ApplySparsePatch in backends/host/host_data_plane.cc does on the host:
//
// * use.implicit: value k goes to parameter element indices[k].
// * otherwise index i is element (i / tensor_cols, i % tensor_cols) of the
//   tensor's 2-D view [rows, tensor_cols] (docs/protocol.md, "Segments");
//   if it lies in the block [row_begin, row_begin + row_count) x
//   [col_begin, col_begin + col_count) it goes to parameter element
//   dest_offset + (row - row_begin) * dest_row_stride + (col - col_begin),
//   else nowhere.
//
// The value is converted from value_dtype to use.dtype (FLOAT32, BFLOAT16,
// FLOAT16 among themselves: round to nearest even, NaN payloads kept, bit
// for bit as common/dtype.cc and scatter.cu), or copied bytewise where the
// two are equal (any dtype of 1, 2, 4 or 8 bytes). Indices outside [0,
// tensor_numel) are skipped (never written out of bounds); of equal
// adjacent indices only the last is written (the host's last one wins).
// Equal indices that are not adjacent race: one of their values lands.
//
// cudaErrorInvalidValue, nothing enqueued: nnz < 0; another dtype pair;
// tensor_cols < 1 for a non-implicit use; with nnz > 0, a null pointer, or
// indices, values or use.param not aligned to their element size. nnz == 0
// is a no-op. use.param must be accessible from the current device (its own
// memory, an IPC mapping opened on it, or a peer with peer access).
//
// index_bytes: 8 (int64 indices) or 4 (uint32). `guard` (device memory, may
// be null): the report SparseCheckIndices wrote for these indices, earlier
// on `stream`; if it counts any index out of range the apply writes
// nothing, so a bad patch is refused whole without the host waiting for
// the check (the host path's behaviour, asynchronously).
cudaError_t SparseApply(const void* indices, const void* values,
                        int value_dtype, int64_t nnz, int64_t tensor_cols,
                        int64_t tensor_numel, const SparseUse& use,
                        cudaStream_t stream, int index_bytes = 8,
                        const SparseIndexReport* guard = nullptr);

// Batches: what the GPU worker launches, one check and one apply (two
// launches each: the tile table, then the kernel) for all the patches a
// chunk completes, instead of a few launches per patch (a Qwen3-8B update has
// 399 tensors; per-patch launches cost ~5 us each and dominated the sparse
// update's GPU time).
//
// A job is one patch to check (report: where SparseCheckIndices would
// write, reset beforehand by SparseResetReports), or one patch and one use
// to apply (report: the guard, may be null). The caller fills the fields
// above the line; PlanSparseJobs validates each job as SparseCheckIndices /
// SparseApply validate their arguments and fills the rest.
struct SparseJob {
  const void* indices;
  const void* values;  // apply
  SparseIndexReport* report;
  int64_t nnz, cols, numel;
  int32_t index_bytes;  // 4 or 8
  int32_t value_dtype;  // apply
  SparseUse use;        // apply
  // ---- PlanSparseJobs
  int32_t value_bytes, param_bytes;
  int64_t tile_begin, tiles;
};

// Entries per tile of a batch: a tile is what one thread block takes, one
// entry per thread. Small tiles keep the scattered writes in flight within
// a narrow span of addresses: a 1% patch of Qwen3-8B applied in 3.9 ms
// with 256-entry tiles against 4.3 ms with 2048 (bench/RESULTS.md).
constexpr int64_t kSparseTileEntries = 256;

// Plans jobs[0, n) for SparseCheckBatch (apply false) or SparseApplyBatch
// (apply true) and sets *total_tiles. cudaErrorInvalidValue where a job
// is one that SparseCheckIndices / SparseApply would refuse (nothing is
// planned then).
cudaError_t PlanSparseJobs(SparseJob* jobs, int64_t n, bool apply,
                           int64_t* total_tiles);

// Sets `n` reports (device memory) to "nothing found": counters 0,
// first_out_of_range ~0. One launch.
cudaError_t SparseResetReports(SparseIndexReport* device_reports, int64_t n,
                               cudaStream_t stream);

// SparseCheckIndices / SparseApply over every planned job of
// `device_jobs` (device memory holding the planned array, unchanged until
// the kernel has run). total_tiles == 0: no-op. Every apply job whose
// report counts an index out of range writes nothing; the check of that
// report must be earlier on `stream`. `device_tile_jobs`: device memory for
// total_tiles int32 (which job each tile belongs to), filled on `stream`
// first and not used by anything else until the kernel has run; one buffer
// may serve several batches on one stream. Two launches: the table, then
// one thread block per tile. cudaErrorInvalidValue (nothing enqueued) for
// a null or misaligned jobs or table pointer, or more than 2^31 - 1 tiles
// or jobs.
cudaError_t SparseCheckBatch(const SparseJob* device_jobs, int64_t n,
                             int64_t total_tiles, int32_t* device_tile_jobs,
                             cudaStream_t stream);
cudaError_t SparseApplyBatch(const SparseJob* device_jobs, int64_t n,
                             int64_t total_tiles, int32_t* device_tile_jobs,
                             cudaStream_t stream);

// Workspace bytes DiffChanged needs for `numel` elements of `es` bytes (8
// per tile of 2048 vectors of 16 bytes). 0 for numel <= 0 or a bad es.
size_t DiffWorkspaceBytes(int64_t numel, int es);

// The patch from `before` to `after` (device memory, `numel` elements of
// `es` bytes, 1, 2, 4 or 8, each aligned to es): the element indices whose
// bits differ (bitwise: -0.0 vs 0.0 differs, an unchanged NaN does not), in
// increasing order, and after's elements there. Writes the number of
// changed elements to *device_count (int64, device memory), and the first
// min(that, capacity) indices and values to `indices` (int64) and `values`
// (es bytes each). A count above capacity means "too dense" (the caller
// sends that tensor dense); nothing beyond capacity is written.
//
// Three launches: a count per tile, one prefix sum, a write pass that
// re-reads only tiles with changes. Reads both tensors twice when they
// differ everywhere, once where they are equal. 16-byte loads where both
// pointers are 16-byte aligned, element by element otherwise.
// `workspace`: at least DiffWorkspaceBytes(numel, es) bytes of device
// memory, 8-byte aligned, not used by anything else until the call's work
// has run.
//
// index_bytes: the indices are int64 (8) or uint32 (4, numel <= 2^32), as
// the wire's sparse_index_bytes.
//
// cudaErrorInvalidValue, nothing enqueued: bad es, numel < 0, capacity < 0,
// null or misaligned pointers, a workspace too small, 4-byte indices for
// more than 2^32 elements. numel == 0 writes a count of 0.
cudaError_t DiffChanged(const void* before, const void* after, int64_t numel,
                        int es, void* workspace, size_t workspace_bytes,
                        void* indices, void* values, int64_t capacity,
                        int64_t* device_count, cudaStream_t stream,
                        int index_bytes = 8);

}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_SPARSE_KERNELS_H_
