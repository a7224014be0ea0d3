// Receipts, daemon side: after an update's bytes are in engine memory, the
// checksum (common/checksum.h) of every element the update installed, read
// back from the engine's memory. Host memory only (GPU: the GPU worker's
// kernels, backends/cuda/receipt_kernels.h). Pure functions; the caller
// keeps the engine's regions mapped (its layout does) and no update writes
// them meanwhile.
#ifndef WEIGHTSYNC_DAEMON_CORE_RECEIPT_H_
#define WEIGHTSYNC_DAEMON_CORE_RECEIPT_H_

#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "daemon/core/engine_layout.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync {

// The receipt of `engine` for an update whose manifest named `sources`.
// UNIMPLEMENTED for memory the daemon can't read (GPU).
absl::StatusOr<v1::Receipt> ComputeReceipt(
    const EngineLayout& engine,
    const absl::flat_hash_set<std::string>& sources);

// The same over `uses` (sorted by parameter, then segment; each once): an
// update's CopyPlan::dense_uses, resolved with the plan, so an update of
// many small tensors looks up no names.
absl::StatusOr<v1::Receipt> ComputeReceipt(const EngineLayout& engine,
                                           const std::vector<SourceUse>& uses);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_RECEIPT_H_
