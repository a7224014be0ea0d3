// The copy plan: for every chunk of an update, the exact 2-D block copies
// that move its bytes into engine memory (segment mapping and dtype
// conversion resolved). Built by Start from the manifest, the chunk plan and
// the engines' layouts, before a single byte moves; immutable afterwards, so
// any data plane thread may read it.
#ifndef WEIGHTSYNC_DAEMON_CORE_COPY_PLAN_H_
#define WEIGHTSYNC_DAEMON_CORE_COPY_PLAN_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/chunk_planner.h"
#include "daemon/core/engine_layout.h"

namespace weightsync {

// rows x cols elements from a chunk into one engine region.
struct CopyOp {
  int32_t engine = 0;      // index into CopyPlan::engines
  int32_t region = 0;      // index into that engine's regions
  int64_t src_offset = 0;  // bytes into the chunk
  int64_t src_stride = 0;  // bytes between rows in the chunk
  int64_t dst_offset = 0;  // bytes into the region
  int64_t dst_stride = 0;  // bytes between rows in the region
  int64_t rows = 0;
  int64_t cols = 0;  // elements per row
  v1::DType src_dtype = v1::DTYPE_UNSPECIFIED;
  v1::DType dst_dtype = v1::DTYPE_UNSPECIFIED;
};

struct CopyPlan {
  ChunkPlan chunks;
  std::vector<std::shared_ptr<const EngineLayout>> engines;
  std::vector<std::vector<CopyOp>> ops_by_chunk;  // one list per chunk
  std::vector<int64_t> bytes_by_engine;           // engine bytes written
  // True where the update rewrites every segment of every parameter (all
  // the engine's memory that any update can write).
  std::vector<bool> covers_engine;
};

// Checks every manifest tensor against every engine (names, shapes,
// segment blocks, dtypes) and resolves the copies. INVALID_ARGUMENT names
// the tensor, engine and parameter concerned; UNIMPLEMENTED for sparse
// patches until they are supported.
absl::StatusOr<std::shared_ptr<const CopyPlan>> BuildCopyPlan(
    const Manifest& manifest, int64_t chunk_bytes,
    std::vector<std::shared_ptr<const EngineLayout>> engines);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_COPY_PLAN_H_
