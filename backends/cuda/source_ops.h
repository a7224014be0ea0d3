// The copies of a registered source's update: GPU worker ops that read the
// trainer's tensors where they live instead of the packed stream, and the
// joining of ops that continue one another. Plain C++ (the daemon's side);
// pure functions, safe from any thread.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_SOURCE_OPS_H_
#define WEIGHTSYNC_BACKENDS_CUDA_SOURCE_OPS_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "common/chunk_planner.h"
#include "daemon/core/source_registry.h"
#include "weightsync/worker/v1/gpu_worker.pb.h"

namespace weightsync {

// The copies of a registered source (exposed for tests). SplitSourceOp
// appends `g`, an op of chunk k that reads the packed stream, as ops that
// read the source's tensors where they live: one per tensor it covers (the
// copy plan joins ops across tensors that are contiguous in the stream);
// region_ids[i] is the worker's allocation id of source.regions[i].
// INTERNAL if it reads bytes no tensor holds. MergeContiguousOps joins ops
// that continue one another in source and destination (ipc, whole update
// present: no ring, not staged).
absl::Status SplitSourceOp(const ChunkPlan& chunks, const Source& source,
                           const std::vector<int64_t>& region_ids, int64_t k,
                           worker::v1::GpuOp g,
                           worker::v1::BeginUpdateRequest* req);
// The same, each op appended where `add` says (a quant step's gather).
absl::Status SplitSourceOp(const ChunkPlan& chunks, const Source& source,
                           const std::vector<int64_t>& region_ids, int64_t k,
                           worker::v1::GpuOp g,
                           const std::function<worker::v1::GpuOp*()>& add);
void MergeContiguousOps(worker::v1::BeginUpdateRequest* req);

}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_SOURCE_OPS_H_
