// Receipts, trainer side: the checksum (common/checksum.h) an engine must
// report for an update, computed from what the trainer sent, mapped
// through the engine's registered segments and converted to its dtypes,
// independently of the daemon. Pure functions.
#ifndef WEIGHTSYNC_CLIENT_RECEIPTS_H_
#define WEIGHTSYNC_CLIENT_RECEIPTS_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backends/cuda/kernel_math.h"  // ReceiptRegion (plain C++)
#include "client/trainer_client.h"
#include "google/protobuf/repeated_field.h"
#include "weightsync/v1/trainer_service.pb.h"

namespace weightsync {

// The receipt an engine registered with `parameters` must report after an
// update that sent `tensors` (FP8 targets: what the daemon quantises,
// client/fp8_receipts.h).
v1::Receipt ExpectedReceipt(
    const google::protobuf::RepeatedPtrField<v1::Parameter>& parameters,
    const std::vector<HostTensor>& tensors);

// The same expectation as regions a GPU sums (backends/cuda/receipt_kernels.h
// ReceiptSumBatch, after PlanReceiptRegions): one region per parameter, or
// per segment, reading the sent tensor where `tensors[i].data` points (any
// address space: device memory for the GPU kernel) with the checkpoint's row
// stride, each element keyed on its place in the engine; every region adds
// to `out`. `counts` gets the receipt's parameters and bytes (its checksum
// is the regions' sum). UNIMPLEMENTED where a segment converts dtypes (the
// kernel sums the bytes as they are: use ExpectedReceipt on the host).
absl::StatusOr<std::vector<cuda::ReceiptRegion>> ExpectedReceiptRegions(
    const google::protobuf::RepeatedPtrField<v1::Parameter>& parameters,
    const std::vector<HostTensor>& tensors, unsigned long long* out,
    v1::Receipt* counts);

// Compares every receipt in `finished` with the expectation from `status`
// (GetStatus with include_layouts). DATA_LOSS names the first engine whose
// memory does not hold what was sent. Engines without a receipt (the
// daemon computed none) are skipped.
absl::Status CheckReceipts(const v1::FinishWeightUpdateResponse& finished,
                           const v1::GetStatusResponse& status,
                           const std::vector<HostTensor>& tensors);

}  // namespace weightsync

#endif  // WEIGHTSYNC_CLIENT_RECEIPTS_H_
