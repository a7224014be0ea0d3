// Fused receipts (docs/protocol.md, "Receipts"): which of an IPC update's
// receipt regions are summed by the very kernels that write them, so the
// receipt costs no second pass over engine memory. Plain copies become copy
// regions of ReceiptCopyBatch (it copies and sums in one pass); the FP8
// weights and scales that direct quant jobs write get the jobs' receipt
// fields (fp8_math.h, DirectReceipt), and the direct kernel sums them as it
// stores them. The GPU worker's planning (GpuWorker::PlanFusedCopies), as a
// pure function over addresses, so it is tested on the CPU
// (fused_receipts_test). Plain C++; stateless and thread-safe.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_FUSED_RECEIPTS_H_
#define WEIGHTSYNC_BACKENDS_CUDA_FUSED_RECEIPTS_H_

#include <cstdint>
#include <vector>

#include "backends/cuda/fp8_math.h"     // DirectJob, DirectReceipt
#include "backends/cuda/kernel_math.h"  // ReceiptRegion

namespace weightsync {
namespace cuda {

// A same-dtype copy of the update, resolved to addresses: rows x cols
// elements of es bytes, row r from src + r * src_stride to
// dst + r * dst_stride; done after chunk `chunk`.
struct FusedCopyOp {
  const uint8_t* src;
  uint8_t* dst;
  int64_t rows, cols;
  int64_t src_stride, dst_stride;  // bytes
  int32_t es;
  int64_t chunk;
};

// What fuses: the copy regions (ReceiptRegion with dst set; out unset),
// each with its group and chunk; per direct job its receipt fields (out
// unset) and group, or group -1 for a job that writes nothing.
struct FusedReceiptPlan {
  std::vector<ReceiptRegion> copies;
  std::vector<int32_t> copy_group;
  std::vector<int64_t> copy_chunk;
  std::vector<DirectReceipt> direct;
  std::vector<int32_t> direct_group;
};

// Plans the fused receipts of an update whose resolved receipt `regions`
// (region i summed into group group_of[i]) are written by `ops` and
// `jobs`. True where every element of the regions is written by exactly
// one of them: each copied row cut where it leaves a region's row, its
// source and destination equally misaligned modulo 16 bytes; each direct
// job's FP8 elements (es 1) and scales (es 4) in regions of one group and
// salt each, keyed as the kernel keys them (DirectReceipt: element (r, c)
// first + r * the job's row stride + c). An
// element counted twice and another missed would also balance the count:
// the pieces all lie inside the regions, and such a plan (never made by
// the daemon) would show as a receipt that differs from the trainer's.
// False (nothing fused: the caller copies and then sums as usual) for
// anything else: a byte written outside the regions, of another element
// size, a job across groups or salts or keyed otherwise, elements of the
// regions nobody writes.
bool PlanFusedReceipts(const std::vector<ReceiptRegion>& regions,
                       const std::vector<int32_t>& group_of,
                       const std::vector<FusedCopyOp>& ops,
                       const std::vector<DirectJob>& jobs,
                       FusedReceiptPlan* plan);

}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_FUSED_RECEIPTS_H_
