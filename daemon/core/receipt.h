// Receipts, daemon side: after an update's bytes are in engine memory, the
// checksum (common/checksum.h) of every element the update installed, read
// back from the engine's memory. Host memory only (GPU: the GPU worker's
// kernels, backends/cuda/receipt_kernels.h). Pure functions; the caller
// keeps the engine's regions mapped (its layout does) and no update writes
// them meanwhile.
#ifndef WEIGHTSYNC_DAEMON_CORE_RECEIPT_H_
#define WEIGHTSYNC_DAEMON_CORE_RECEIPT_H_

#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "daemon/core/engine_layout.h"
#include "google/protobuf/repeated_field.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync {

// The receipt of `engine` for an update whose manifest named `sources`.
// UNIMPLEMENTED for memory the daemon can't read (GPU).
absl::StatusOr<v1::Receipt> ComputeReceipt(
    const EngineLayout& engine,
    const absl::flat_hash_set<std::string>& sources);

// The same for an update of `manifest`, whose dense tensors are the
// sources (a sparse patch's other elements are not the trainer's to vouch
// for). Finds the segments through the layout's uses_by_source, so an
// update of many small tensors builds no set of names.
absl::StatusOr<v1::Receipt> ComputeReceipt(
    const EngineLayout& engine,
    const google::protobuf::RepeatedPtrField<v1::TensorSpec>& manifest);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_RECEIPT_H_
