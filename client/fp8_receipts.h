// Receipts of FP8 targets, trainer side (docs/protocol.md, "FP8 targets"):
// what the daemon installs into an engine's quantised parameter and its
// scale parameter, computed from the sent tensors with the same function
// (common/fp8.h), then summed as receipts are (common/checksum.h). Part of
// ExpectedReceipt (client/receipts.h). Pure functions.
#ifndef WEIGHTSYNC_CLIENT_FP8_RECEIPTS_H_
#define WEIGHTSYNC_CLIENT_FP8_RECEIPTS_H_

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "client/trainer_client.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync {

// Adds to *sum the terms of FP8 target `p` (p.has_quantization()) after an
// update that sent `sent` (dense tensors by name): its FP8 elements that a
// sent tensor writes and the stored scales of those blocks; counts the
// parameter and its scale parameter and their bytes into *receipt. A
// segment that cuts a block (the daemon refuses such a registration)
// counts the blocks it touches.
void AddQuantizedTerms(
    const v1::Parameter& p,
    const absl::flat_hash_map<std::string, const HostTensor*>& sent,
    uint64_t* sum, v1::Receipt* receipt);

}  // namespace weightsync

#endif  // WEIGHTSYNC_CLIENT_FP8_RECEIPTS_H_
