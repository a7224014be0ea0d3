// Receipts, trainer side: the checksum (common/checksum.h) an engine must
// report for an update, computed from what the trainer sent, mapped
// through the engine's registered segments and converted to its dtypes,
// independently of the daemon. Pure functions.
#ifndef WEIGHTSYNC_CLIENT_RECEIPTS_H_
#define WEIGHTSYNC_CLIENT_RECEIPTS_H_

#include <vector>

#include "absl/status/status.h"
#include "client/trainer_client.h"
#include "google/protobuf/repeated_field.h"
#include "weightsync/v1/trainer_service.pb.h"

namespace weightsync {

// The receipt an engine registered with `parameters` must report after an
// update that sent `tensors`.
v1::Receipt ExpectedReceipt(
    const google::protobuf::RepeatedPtrField<v1::Parameter>& parameters,
    const std::vector<HostTensor>& tensors);

// Compares every receipt in `finished` with the expectation from `status`
// (GetStatus with include_layouts). DATA_LOSS names the first engine whose
// memory does not hold what was sent. Engines without a receipt (the
// daemon computed none) are skipped.
absl::Status CheckReceipts(const v1::FinishWeightUpdateResponse& finished,
                           const v1::GetStatusResponse& status,
                           const std::vector<HostTensor>& tensors);

}  // namespace weightsync

#endif  // WEIGHTSYNC_CLIENT_RECEIPTS_H_
