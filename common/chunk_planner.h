// The chunk planner: the one deterministic function of (manifest, chunk
// size) that cuts an update into packed chunks. The trainer clients and the
// daemon both call it, so they agree on where every byte travels without
// sending a layout. Specified in docs/chunk_planner.md and pinned by
// tests/vectors/chunk_plan.json. Pure functions; safe from any thread.
#ifndef WEIGHTSYNC_COMMON_CHUNK_PLANNER_H_
#define WEIGHTSYNC_COMMON_CHUNK_PLANNER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/repeated_field.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync {

inline constexpr int64_t kChunkAlignment = 256;
// Most chunks one update may have (PlanChunks refuses more before
// allocating its plan; found by tests/fuzz/proto_fuzzer).
inline constexpr int64_t kMaxChunks = int64_t{1} << 20;

// A contiguous run of one tensor's payload inside one chunk.
struct Piece {
  int32_t tensor = 0;         // index into the manifest
  int64_t tensor_offset = 0;  // byte offset in the tensor's payload
  int64_t chunk_offset = 0;   // byte offset in the chunk
  int64_t length = 0;         // bytes
};

struct Chunk {
  int64_t index = 0;
  int64_t offset = 0;  // in the packed stream
  int64_t size = 0;
  std::vector<Piece> pieces;
};

struct ChunkPlan {
  int64_t chunk_bytes = 0;
  int64_t total_bytes = 0;
  std::vector<int64_t> tensor_offsets;  // in the packed stream
  std::vector<int64_t> payload_bytes;
  std::vector<Chunk> chunks;
};

using Manifest = google::protobuf::RepeatedPtrField<v1::TensorSpec>;

// Width of a sparse patch's indices (TensorSpec.sparse_index_bytes: 4 or 8),
// INVALID_ARGUMENT naming the tensor for another value or a tensor too
// large for 4-byte indices.
absl::StatusOr<int> SparseIndexBytes(const v1::TensorSpec& tensor,
                                     int64_t numel);

// Bytes a tensor occupies on the wire (dense, sparse indices + values, or
// quantised: FP8 elements + scales), or INVALID_ARGUMENT naming the tensor.
absl::StatusOr<int64_t> PayloadBytes(const v1::TensorSpec& tensor);

// A tensor quantised on the wire (TensorSpec.quantization set; "FP8 on the
// wire", docs/protocol.md): its 2-D view [rows, cols] (as segments view
// it), its blocks (PER_ROW: 1 x cols), its grid of scales and where they
// start in its payload.
struct WireQuant {
  int64_t rows = 0, cols = 0;
  int64_t block_rows = 0, block_cols = 0;
  int64_t grid_rows = 0, grid_cols = 0;
  int64_t scales_offset = 0;  // the elements' bytes rounded up to 4
  bool per_row = false;
  bool reciprocal = false;  // the scales are 1 / d (SCALE_FORM_RECIPROCAL)
};

// INVALID_ARGUMENT naming the tensor: a dtype that is not FP8 or not the
// quantization's format, a scale_parameter named, an unknown scheme or
// scale form, block sides outside [0 (= 128), 2^24] or set with PER_ROW, a
// sparse patch quantised.
absl::StatusOr<WireQuant> ResolveWireQuant(const v1::TensorSpec& tensor);

// Plans `manifest` into chunks of `chunk_bytes` (a positive multiple of
// kChunkAlignment). INVALID_ARGUMENT names the offending tensor or field.
absl::StatusOr<ChunkPlan> PlanChunks(const Manifest& manifest,
                                     int64_t chunk_bytes);

}  // namespace weightsync

#endif  // WEIGHTSYNC_COMMON_CHUNK_PLANNER_H_
