// The transfer plan (issue 32, docs/transfer_plan.md): which trainer rank
// sends which bytes of which checkpoint tensor to which receiver, when
// every trainer rank sends its own share (M senders -> N receivers). One
// deterministic function of a TransferPlanSpec (what each sender holds,
// what each receiver needs), run independently by every trainer rank and
// every daemon, like the chunk planner, and pinned by
// tests/vectors/transfer_plan.json, which the Python mirror
// (client/python/weightsync/transfer_plan.py) generates and passes too.
//
// A plan is made once for a pair (trainer layout, engine layouts), kept by
// its id (a digest of the spec) and reused by every update until either
// side changes. It lives in common/ because the senders (C++ tools, the
// Python client) and the daemons all run it.
//
// Pure functions; a TransferPlan is immutable once built, so any thread
// may read it.
#ifndef WEIGHTSYNC_COMMON_TRANSFER_PLAN_H_
#define WEIGHTSYNC_COMMON_TRANSFER_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/chunk_planner.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync {

// Version of docs/transfer_plan.md; part of every plan id. 2: the id is
// SHA-256 of the canonical text, not FNV-1a 64.
inline constexpr int kTransferPlanSpecVersion = 2;

// Bounds on untrusted declarations (a spec arrives over gRPC).
struct TransferPlanLimits {
  int max_senders = 1 << 16;
  int max_receivers = 1 << 16;
  int64_t max_blocks = int64_t{1} << 24;  // held + needed, all tensors
  int64_t max_tensors = int64_t{1} << 20;
  int64_t max_name_length = 1024;  // tensor and receiver names
  int max_rank = 16;               // dimensions of a tensor
  // Cells of one tensor's grid (its blocks' row cuts x column cuts).
  int64_t max_cells_per_tensor = int64_t{1} << 22;
};

// Rows [row_begin, row_begin + row_count) x columns [col_begin, ...) of
// manifest tensor `tensor`'s 2-D view, sent by `sender` to `receiver`.
// Its payload on the wire is those elements row-major, in the tensor's
// dtype (row_count * col_count * element size bytes).
struct PlanPiece {
  int32_t tensor = 0;  // index into TransferPlan::manifest
  int64_t row_begin = 0, row_count = 0, col_begin = 0, col_count = 0;
  int32_t sender = 0;    // index into TransferPlanSpec.senders
  int32_t receiver = 0;  // index into TransferPlanSpec.receivers
  int64_t bytes = 0;
};

struct TransferPlan {
  std::string id;  // "tp1-" + 16 hex digits: TransferPlanId(spec)
  Manifest manifest;
  int num_senders = 0;
  int num_receivers = 0;
  // Every piece, ordered by (sender, receiver, tensor, row_begin,
  // col_begin): the pieces of one link (sender, receiver) are contiguous
  // and in the order their bytes travel.
  std::vector<PlanPiece> pieces;
  // links[s][r]: indices into `pieces` of link (s, r), in stream order
  // (empty: that sender sends that receiver nothing).
  std::vector<std::vector<std::vector<int32_t>>> links;
  std::vector<int64_t> sender_bytes;    // bytes each sender sends
  std::vector<int64_t> receiver_bytes;  // bytes each receiver gets
  // Manifest tensors that no receiver needs (sent nowhere), in order.
  std::vector<std::string> unused;
};

// Builds the plan of `spec`: every element some receiver needs is sent to
// that receiver exactly once, by exactly one sender that holds it; blocks
// held by several senders (replicas) are split between them by rows so
// that every sender's bytes are as even as the blocks allow (water-filling
// in spec order; docs/transfer_plan.md). INVALID_ARGUMENT naming the
// tensor and the ranks concerned, before anything is planned, for: a
// manifest error (as the chunk planner's), a sparse tensor, a block of an
// unknown tensor or outside its tensor's shape or empty, two blocks of one
// sender that overlap, blocks of two senders that overlap without being
// the same block (only whole replicas may overlap), an element a receiver
// needs that no sender holds, no senders.
absl::StatusOr<TransferPlan> BuildTransferPlan(
    const v1::TransferPlanSpec& spec, const TransferPlanLimits& limits = {});

// The plan id of `spec`: the first 8 bytes of the SHA-256 of its canonical text
// (docs/transfer_plan.md, "Plan id"). Equal specs give equal ids in every
// language.
std::string TransferPlanId(const v1::TransferPlanSpec& spec);

// The manifest of one link's stream: piece k of link (s, r) is pseudo
// tensor k, named "<tensor>[r0:r1,c0:c1]", of shape [row_count, col_count]
// in the tensor's dtype, so the chunk planner cuts a link's stream into
// chunks exactly as it does an update's (PlanChunks(LinkManifest(...))).
Manifest LinkManifest(const TransferPlan& plan, int sender, int receiver);

}  // namespace weightsync

#endif  // WEIGHTSYNC_COMMON_TRANSFER_PLAN_H_
