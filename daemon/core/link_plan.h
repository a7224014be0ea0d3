// The copy plan of a transfer-plan update (issue 32, docs/transfer_plan.md)
// on one daemon: the links (sender, receiver) that reach this daemon's
// receivers, each a stream of pieces (sub-rectangles of checkpoint tensors)
// cut into chunks by the chunk planner, resolved into one CopyPlan that any
// data plane runs as it runs an ordinary update. Link k's chunks are plan
// chunks [first_chunk, first_chunk + num_chunks); each piece's copies are
// the intersections of its rectangle with the engines' segments (dtype
// conversion as usual). Immutable once built; any thread may read it.
#ifndef WEIGHTSYNC_DAEMON_CORE_LINK_PLAN_H_
#define WEIGHTSYNC_DAEMON_CORE_LINK_PLAN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transfer_plan.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/engine_layout.h"

namespace weightsync {

struct LinkChunks {
  int32_t sender = 0;
  int32_t receiver = 0;
  int64_t first_chunk = 0;  // index into the copy plan's chunks
  int64_t num_chunks = 0;
  int64_t bytes = 0;  // the link stream's total_bytes
};

struct LinkedCopyPlan {
  // What the data plane runs: engines, receipts' uses and covers_engine of
  // the whole manifest; chunks and copies of the links, one after another.
  std::shared_ptr<const CopyPlan> copy;
  std::vector<LinkChunks> links;  // ordered by (receiver, sender)
};

// Segment `s` of parameter `p` as a block of its source's 2-D view (an
// implicit segment, kept as one flat row, is the whole matrix): what a
// receiver that holds the engine needs (TensorBlock).
SegmentLayout SegmentBlock(const ParameterLayout& p, const SegmentLayout& s);

// A piece of a link sent as a sparse patch (v1::PlanSparsePiece): piece
// `piece` of link (sender, the daemon's receiver) carries `nnz` (index,
// value) pairs; index_bytes 4 (uint32) or 8 (int64).
struct LinkPatch {
  int32_t sender = 0;
  int32_t piece = 0;
  int64_t nnz = 0;
  int32_t index_bytes = 8;
};

// Resolves `plan`'s links into `receivers` (indices of the plan's
// receivers that this daemon is) against `engines`. INVALID_ARGUMENT as
// BuildCopyPlan for a manifest the engines can't take; FAILED_PRECONDITION
// when the receivers' needs do not cover every element the engines use
// (the engine layouts changed: re-plan), when `receivers` is not exactly
// one receiver (a daemon of several GPU ranks assigns engines to ranks:
// the GPU data plane's job), or for a sparse patch into a tensor that feeds
// an FP8 target. `patches`: the pieces of links to this receiver sent as
// sparse patches (INVALID_ARGUMENT naming the entry for a sender or piece
// the plan does not have, a piece named twice, an nnz outside [1, the
// piece's elements], an index width not 4 or 8); no engine is then
// rewritten whole (covers_engine).
//
// `wire`: tensors of the plan sent quantised (FP8 on the wire,
// StartWeightUpdateRequest.plan_wire): every piece of each carries the FP8
// elements and scales of its blocks, copied as they are into FP8 targets
// of the same form (CheckWireUse, for the whole tensor and for each piece).
// INVALID_ARGUMENT naming the tensor for one not in the plan, named twice,
// not float, whose uses can't take it (a plain parameter, another block or
// scale form), or a piece of it that cuts its blocks.
struct WireTensor {
  std::string tensor;
  v1::Quantization quantization;
};
absl::StatusOr<LinkedCopyPlan> BuildLinkedCopyPlan(
    const TransferPlan& plan, const std::vector<int32_t>& receivers,
    int64_t chunk_bytes,
    const std::vector<std::shared_ptr<const EngineLayout>>& engines,
    const std::vector<LinkPatch>& patches = {},
    const std::vector<WireTensor>& wire = {});

// A linked plan's chunks in the order a GPU receiver takes them when every
// sender sends in rounds (round k = chunk k of every link; issue 32's NCCL
// schedule, docs/protocol.md): ordered by (round, sender, receiver).
struct RoundChunk {
  int64_t chunk = 0;  // index into the copy plan's chunks
  int32_t sender = 0;
  int32_t receiver = 0;
  int64_t round = 0;
};
std::vector<RoundChunk> ChunksByRound(const LinkedCopyPlan& linked);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_LINK_PLAN_H_
