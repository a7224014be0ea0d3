// On-GPU copy of a rectangular block of elements with optional dtype
// conversion: the primitive that scatters a staged chunk into engine memory
// (a whole tensor, or one segment of it: a tensor-parallel shard, a slice of
// a fused qkv / gate_up parameter).
//
// Stateless and thread-safe: any thread may call it concurrently, each with
// its own stream. Only the device's multiprocessor count is cached (per
// device, on first use). Nothing here synchronises: the copy is enqueued on
// `stream` and the caller orders it (events) against whatever produced the
// source or reads the destination.
//
// Built only with CUDA (//backends/cuda:scatter is empty otherwise); include
// it from code that is itself compiled only when WEIGHTSYNC_HAS_CUDA.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_SCATTER_H_
#define WEIGHTSYNC_BACKENDS_CUDA_SCATTER_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace weightsync {
namespace cuda {

// Copies a rows x cols block of elements: row r of the source starts at
// src + r * src_stride (bytes), row r of the destination at
// dst + r * dst_stride (bytes). Dtypes are weightsync::v1::DType values,
// passed as int so this header and its .cu file need no protobuf.
//
// * Equal dtypes (any dtype DTypeSize knows): cudaMemcpy2DAsync, or one
//   cudaMemcpyAsync when both sides are contiguous. Copy engines, no SMs;
//   works for any pair of pointers the runtime can address (same device,
//   peer device, CUDA IPC mappings, pinned host).
// * FLOAT32 / BFLOAT16 / FLOAT16 conversions: a kernel launched on the
//   current device, so both pointers must be accessible from it (its own
//   memory, an IPC mapping opened on it, or a peer with peer access
//   enabled). Round-to-nearest-even, overflow to infinity, NaN stays NaN;
//   bit-identical to weightsync::ConvertElements in common/dtype.h.
// * Any other pair: cudaErrorInvalidValue, nothing enqueued.
//
// Requirements (else cudaErrorInvalidValue, nothing enqueued): rows >= 0,
// cols >= 0; non-null pointers when the block is non-empty; src, dst and, for
// rows > 1, both strides multiples of their element sizes; for rows > 1 each
// stride at least one row's bytes (rows never overlap). An empty block is a
// no-op returning cudaSuccess. Errors of the enqueued copy or kernel come
// back as the CUDA runtime reports them (cudaGetLastError semantics for the
// launch); asynchronous faults surface at the next synchronisation.
//
// Speed (H100, 1 GiB blocks, bytes read + written): conversions ~2.8-2.9
// TB/s, equal dtypes ~3.0 TB/s contiguous. The kernel stores 16 bytes per
// access (V = 4 elements for a FLOAT32 destination, 8 for a 16-bit one) when
// src and dst are equally misaligned modulo V elements and, for rows > 1,
// both strides are multiples of V elements (e.g. 256-byte aligned staging
// and shards whose column offset is a multiple of 8); otherwise it goes
// element by element, same results at ~1 TB/s.
cudaError_t CopyConvert2D(const void* src, int64_t src_stride, int src_dtype,
                          void* dst, int64_t dst_stride, int dst_dtype,
                          int64_t rows, int64_t cols, cudaStream_t stream);

// Bytes per element of a weightsync::v1::DType value, or 0 for
// DTYPE_UNSPECIFIED and unknown values (the table of
// weightsync::ElementSize in common/dtype.cc).
// Copies rows x `width` bytes with a kernel (SMs) instead of the copy
// engines: faster within one GPU (IPC from a colocated trainer), at the
// price of SM time taken from the engine. Row r: src + r * src_stride.
cudaError_t CopyBytes2DWithSMs(const void* src, int64_t src_stride, void* dst,
                               int64_t dst_stride, int64_t width, int64_t rows,
                               cudaStream_t stream);

int64_t DTypeSize(int dtype);

// One byte copy of CopyBatchWithSMs's table: rows x width bytes, row r at
// src + r * src_stride and dst + r * dst_stride.
struct BatchCopy {
  const void* src;
  void* dst;
  int64_t width, rows, src_stride, dst_stride;
};

// Runs `n` copies of `table` (device memory; n entries) as one kernel:
// each block takes whole copies, so many small ones (a mixture of experts'
// 100k tensors) cost one launch instead of n. Meant for copies of at most
// a few hundred KiB each (one block moves a copy). Same pointer rules as
// CopyBytes2DWithSMs; rows must not overlap; n == 0 is a no-op.
cudaError_t CopyBatchWithSMs(const BatchCopy* table, int64_t n,
                             cudaStream_t stream);

}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_SCATTER_H_
