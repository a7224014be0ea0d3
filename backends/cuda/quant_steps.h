// FP8 targets on the GPU backends: the copy plan's quantised uses
// (CopyPlan::quant, quant_by_chunk) as the worker's quant steps
// (worker::v1::GpuQuantStep; docs/protocol.md, "FP8 targets on the GPU
// backends"). Plain C++, no CUDA: the daemon builds the steps at Start and
// the worker only runs them, so the planning is tested on the CPU.
//
// Chunks cut tensors anywhere, as on the host backend: each quantised use
// (a segment of an FP8 target fed by a manifest tensor) gathers its
// elements, widened to float32, into a window of its rows of blocks in the
// worker's scratch (one 2-D copy per run of rows a piece brings); once the
// window holds every element it is quantised into the engine's memory (a
// flush) and the next window starts where it was. A window is as many rows
// of blocks as fit `window_bytes` (at least one, at most the rectangle), so
// per-row scales cost one launch per many rows. The uses of one tensor own
// disjoint slots of the scratch, and the next tensor's uses reuse it from
// offset 0: their gathers come after the last flush of every use of the
// tensor before, in stream order on one GPU stream.
//
// Where the update's whole source is readable from the first step
// (`whole_source`: the ipc backend, not staged, no ring; the packed buffer
// or a registered source's tensors), a use gets instead ONE direct step
// (worker::v1::GpuQuantDirect): its whole rectangle quantised straight
// from the source, no scratch, no gathers (~3 bytes moved per bfloat16
// element instead of ~15). Every use whose source rows lie one stride
// apart does (all but a contiguous destination fed by part of each of
// several source rows), if its tensor starts on a whole element; the
// others keep the gathers. Direct steps go in the update's last chunk:
// nothing reads their output before (receipts of such an update are
// summed after the last chunk), and the worker runs each chunk's direct
// steps as one launch.
//
// Pure functions; safe from any thread.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_QUANT_STEPS_H_
#define WEIGHTSYNC_BACKENDS_CUDA_QUANT_STEPS_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/source_registry.h"
#include "weightsync/worker/v1/gpu_worker.pb.h"

namespace weightsync {

// Windows of rows of blocks of this many float32 bytes (rounded down to
// whole rows of blocks, at least one) unless the staging budget is short.
inline constexpr int64_t kQuantWindowBytes = int64_t{8} << 20;

// The scratch bytes `plan`'s quant steps need with windows of
// `window_bytes` (0: one row of blocks each): the most any one tensor's
// uses hold at once, each slot 256-aligned. 0 without quantised uses.
// `whole_source`, `source`: as for AddQuantSteps (direct uses hold none).
int64_t QuantScratchBytes(const CopyPlan& plan, int64_t window_bytes,
                          bool whole_source = false,
                          const Source* source = nullptr);

// Whether AddQuantSteps gives quantised use `target` (an index into
// plan.quant) a direct step.
bool QuantIsDirect(const CopyPlan& plan, int32_t target, bool whole_source,
                   const Source* source);

// The worker's allocation id of region `region` of engine `engine`
// (indices into plan.engines and its regions); an error where the memory
// is not the worker's (host memory).
using RegionIdOf =
    std::function<absl::StatusOr<int64_t>(int32_t engine, int32_t region)>;

// Appends `plan`'s quant steps to req->quant_steps and sets
// req->quant_scratch_bytes. With `source` (a registered source's memory;
// source_ids[i]: the worker's id of source->regions[i]) every gather reads
// the trainer's tensor in place (SplitSourceOp), and so does every direct
// step (`whole_source`; without `source` they read the packed ipc buffer).
// INTERNAL where the plan's pieces of a use are out of order or leave its
// rectangle (a broken plan).
absl::Status AddQuantSteps(const CopyPlan& plan, int64_t window_bytes,
                           bool whole_source, const RegionIdOf& region_id,
                           const Source* source,
                           const std::vector<int64_t>& source_ids,
                           worker::v1::BeginUpdateRequest* req);

}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_QUANT_STEPS_H_
