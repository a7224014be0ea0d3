// The copy plan: for every chunk of an update, the exact 2-D block copies
// that move its bytes into engine memory (segment mapping and dtype
// conversion resolved). Built by Start from the manifest, the chunk plan and
// the engines' layouts, before a single byte moves; immutable afterwards, so
// any data plane thread may read it.
#ifndef WEIGHTSYNC_DAEMON_CORE_COPY_PLAN_H_
#define WEIGHTSYNC_DAEMON_CORE_COPY_PLAN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/chunk_planner.h"
#include "daemon/core/engine_layout.h"
#include "daemon/core/quant_layout.h"

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

// A sparse patch of one checkpoint tensor (TensorSpec.sparse_nnz > 0): its
// payload (nnz int64 indices into the flattened tensor, then nnz values)
// is applied once complete, element by element, through every use.
struct SparsePatch {
  int32_t tensor = 0;  // manifest index
  std::string name;
  int64_t nnz = 0;
  int64_t numel = 0;
  int index_bytes = 8;  // 8: int64 indices, 4: uint32
  int64_t payload_bytes = 0;
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  int64_t cols = 1;  // of the source's 2-D view
  struct Use {
    int32_t engine = 0, region = 0;
    int64_t param_offset = 0;  // bytes into the region
    v1::DType dtype = v1::DTYPE_UNSPECIFIED;
    bool implicit = false;  // flat index = parameter element
    int64_t row_begin = 0, row_count = 0, col_begin = 0, col_count = 0;
    int64_t dest_offset = 0, dest_row_stride = 0;
  };
  std::vector<Use> uses;
};

// A quantised use of a checkpoint tensor: segment `segment` of the FP8
// target `parameter` of engine `engine` (docs/protocol.md, "FP8 targets").
// Its elements get no CopyOp: the data plane gathers them as float32 and
// quantises each row of blocks once all of it has arrived.
struct QuantTarget {
  int32_t tensor = 0;  // the manifest tensor that feeds it
  int32_t engine = 0;
  int32_t parameter = 0;  // index into that engine's parameters
  int32_t segment = 0;
  v1::DType src_dtype = v1::DTYPE_UNSPECIFIED;
  int64_t src_cols = 0;  // of the source's 2-D view (the segment's view)
  QuantRect rect;        // what the segment writes, on block boundaries
  // Fed by the pieces of several links of a transfer plan (link_plan.h)
  // in no fixed order: several of its rows of blocks may be open at once,
  // each quantised once all of it has arrived. False: one stream in order,
  // one row of blocks open at a time.
  bool gathered = false;
};

// Source elements [begin, end) of a quantised use, at byte `chunk_offset`
// of a chunk; they are bytes [tensor_offset, ...) of manifest tensor
// `tensor` (where a registered source's memory holds them).
struct QuantPiece {
  int32_t target = 0;  // index into CopyPlan::quant
  int32_t tensor = 0;
  int64_t begin = 0, end = 0;
  int64_t chunk_offset = 0;
  int64_t tensor_offset = 0;
};

// What BuildCopyPlan does with a manifest tensor no engine of the update
// uses (a daemon of several holds only some pipeline stages or experts).
enum class UnusedTensors {
  kRefuse,  // INVALID_ARGUMENT naming it (one daemon: the trainer's mistake)
  // Planned in the stream but copied nowhere: the bytes reach this daemon
  // anyway (NCCL broadcasts) or are read in place (a source's memory).
  kSkip,
  // Left out of the stream: the chunk plan is the used tensors' only, in
  // manifest order (bytes sent to this daemon alone, PushChunks).
  kOmit,
};

struct CopyPlan {
  // What was planned (names for the data planes): with kOmit, the manifest
  // without the unused tensors.
  Manifest manifest;
  std::vector<std::string> unused;  // kSkip, kOmit: in manifest order
  ChunkPlan chunks;
  std::vector<std::shared_ptr<const EngineLayout>> engines;
  std::vector<std::vector<CopyOp>> ops_by_chunk;  // one list per chunk
  std::vector<SparsePatch> sparse;
  // Per chunk: (index into sparse, piece) of sparse payload bytes.
  std::vector<std::vector<std::pair<int, Piece>>> sparse_pieces_by_chunk;
  std::vector<int64_t> bytes_by_engine;  // engine bytes written
  // True where the update rewrites every segment of every parameter (all
  // the engine's memory that any update can write).
  std::vector<bool> covers_engine;
  // Per engine: the (parameter, segment) uses of the manifest's dense
  // tensors, ordered by parameter then segment: what the engine's receipt
  // sums (daemon/core/receipt.h), resolved once with the plan.
  std::vector<std::vector<SourceUse>> dense_uses;
  // FP8 targets: the quantised uses, and per chunk the pieces of them it
  // carries, in stream order.
  std::vector<QuantTarget> quant;
  std::vector<std::vector<QuantPiece>> quant_by_chunk;
  // The most float32 bytes of rows of blocks open at once: the uses of one
  // tensor fill theirs together (what a host data plane holds; bounded by
  // its staging budget).
  int64_t quant_band_bytes = 0;
};

// Checks every manifest tensor against every engine (names, shapes,
// segment blocks, dtypes) and resolves the copies. INVALID_ARGUMENT names
// the tensor, engine and parameter concerned. Sparse patches get no copy
// ops: their pieces are listed for the data plane to assemble and apply;
// a patch into an FP8 target is FAILED_PRECONDITION (its blocks' scales
// would go stale). Quantised uses get QuantPieces instead of copy ops.
// A tensor no engine uses is handled as `unused` says.
absl::StatusOr<std::shared_ptr<const CopyPlan>> BuildCopyPlan(
    const Manifest& manifest, int64_t chunk_bytes,
    std::vector<std::shared_ptr<const EngineLayout>> engines,
    UnusedTensors unused = UnusedTensors::kRefuse);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_COPY_PLAN_H_
