// An engine's registered memory layout: its parameters, how each is
// assembled from checkpoint tensors (segments), and the regions the daemon
// opened for it. Built once from a RegisterEngineRequest after validating
// every field; immutable afterwards and shared by the registry and any
// update in flight (which keeps the regions alive).
#ifndef WEIGHTSYNC_DAEMON_CORE_ENGINE_LAYOUT_H_
#define WEIGHTSYNC_DAEMON_CORE_ENGINE_LAYOUT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/core/memory.h"
#include "weightsync/v1/engine_service.pb.h"

namespace weightsync {

// The highest weight version an engine may hold or an update may target
// (docs/protocol.md, "Versions"): 2^62 - 1, so that a version is never the
// last one a 64-bit integer can name (a trainer that committed INT64_MAX
// would leave the engines no later version), while step counters and
// nanosecond timestamps (until 2116) fit.
inline constexpr int64_t kMaxVersion = (int64_t{1} << 62) - 1;

// Limits on what one registration may hold (untrusted input is bounded).
struct RegistrationLimits {
  int64_t max_parameters = 1 << 20;
  int64_t max_allocations = 1 << 16;
  int64_t max_segments_per_parameter = 4096;
  int64_t max_name_length = 1024;
  // Destination rows enumerated for the segment-overlap check.
  int64_t max_segment_rows = int64_t{1} << 24;
  // Float32 bytes of one row of blocks of a quantised parameter
  // (block_rows x cols x 4): what the host data plane holds while a row of
  // blocks arrives (docs/protocol.md, "FP8 targets").
  int64_t max_quant_band_bytes = int64_t{256} << 20;
};

struct SegmentLayout {
  std::string source;
  // Empty: not given at registration, and always for a parameter's
  // implicit segment (the parameter's own shape is checked instead).
  std::vector<int64_t> source_shape;
  int64_t row_begin = 0, row_count = 0, col_begin = 0, col_count = 0;
  int64_t dest_offset = 0, dest_row_stride = 0;  // elements; stride >= cols
};

// How a quantised parameter (an FP8 target) is cut into blocks, each with
// one float32 scale in its scale parameter (docs/protocol.md, "FP8
// targets"). Per-row quantisation is blocks of 1 x cols.
struct QuantLayout {
  v1::DType format = v1::DTYPE_UNSPECIFIED;  // FLOAT8_E4M3FN or _E5M2
  int32_t scale_parameter = -1;  // index into EngineLayout::parameters
  int64_t rows = 0, cols = 0;    // the parameter's [rows, cols]
  int64_t block_rows = 0, block_cols = 0;
  int64_t grid_cols = 0;    // blocks per row of blocks: ceil(cols / block_cols)
  bool reciprocal = false;  // the scale parameter holds 1 / d, not d
};

struct ParameterLayout {
  std::string name;
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t bytes = 0;
  int32_t region = 0;  // index into EngineLayout::regions
  int64_t offset = 0;  // bytes into the region
  // True when registered without segments: the checkpoint tensor of the
  // same name and shape is the whole parameter (segments holds that one).
  bool implicit = false;
  std::vector<SegmentLayout> segments;
  uint64_t salt = 0;  // ParameterSalt(name) (common/checksum.h), for receipts
  // Set for an FP8 target: what feeds it is quantised (segments lie on
  // block boundaries).
  std::optional<QuantLayout> quant;
  // The scale parameter of an FP8 target: no segments, no source; written
  // only with its owner's blocks.
  bool is_scale = false;
};

// Where a checkpoint tensor is used: parameter index and segment index.
struct SourceUse {
  int32_t parameter = 0;
  int32_t segment = 0;
};

struct EngineLayout {
  std::string engine_id;
  std::vector<ParameterLayout> parameters;
  std::vector<std::shared_ptr<MappedRegion>> regions;
  std::vector<std::string> device_uuids;  // distinct, in registration order
  int64_t total_bytes = 0;
  // Keyed by views of the segments' `source` strings above (the layout is
  // immutable once built, so they stay put); most sources feed one
  // segment, held without an allocation of its own.
  absl::flat_hash_map<absl::string_view, absl::InlinedVector<SourceUse, 1>>
      uses_by_source;
  // Parameters of no elements registered without segments (name -> index):
  // nothing to copy, but a manifest tensor of that name and shape is theirs,
  // not unused (BuildCopyPlan).
  absl::flat_hash_map<std::string, int> empty_parameters;
};

// Validates `request` (names, dtypes, shapes, ranges inside allocations, no
// overlapping parameters, segments inside their parameter and disjoint,
// quantisation declarations: quant_layout.h) and only then opens its
// allocations through `mapper`. INVALID_ARGUMENT names the engine and the
// offending parameter or segment (UNIMPLEMENTED: an FP8 target in GPU
// memory); nothing stays open on failure.
absl::StatusOr<std::shared_ptr<const EngineLayout>> BuildEngineLayout(
    const v1::RegisterEngineRequest& request, MemoryMapper& mapper,
    const RegistrationLimits& limits = {});

// True once the memory behind any of the engine's regions was found gone
// under the daemon (MappedRegion::faulted, bus_guard.h).
bool AnyRegionFaulted(const EngineLayout& layout);

// The 2-D view [rows, cols] of a checkpoint tensor that segments index.
void SourceMatrix(const std::vector<int64_t>& shape, int64_t* rows,
                  int64_t* cols);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_ENGINE_LAYOUT_H_
