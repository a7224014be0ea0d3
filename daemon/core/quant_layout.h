// FP8 targets at registration (docs/protocol.md, "FP8 targets"): which
// parameters are quantised and which hold their scales, and the checks
// that let a block be quantised whole: dtypes, the scale parameter's
// shape, segments that lie on block boundaries, the FP8 elements and their
// scales in one kind of memory. Part of BuildEngineLayout; pure functions.
#ifndef WEIGHTSYNC_DAEMON_CORE_QUANT_LAYOUT_H_
#define WEIGHTSYNC_DAEMON_CORE_QUANT_LAYOUT_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/core/engine_layout.h"
#include "weightsync/v1/engine_service.pb.h"

namespace weightsync {

// Per parameter of a registration (its Parameter messages, then its
// parameter_table rows): the index of its scale parameter (-1:
// not quantised) and whether it is a scale parameter. Empty vectors when
// no parameter is quantised.
struct QuantRoles {
  std::vector<int32_t> scale_of;
  std::vector<bool> is_scale;
};

// Resolves every Quantization of `request` by name, before the parameters
// are laid out. INVALID_ARGUMENT naming the engine and the parameter: a
// format that is not FP8, an unknown scheme or scale form, bad block
// sizes, a scale parameter that is missing, the parameter itself,
// quantised, or the scale of two parameters.
absl::StatusOr<QuantRoles> ResolveQuantRoles(
    const v1::RegisterEngineRequest& request);

// Fills ParameterLayout::quant of every quantised parameter of `layout`
// (laid out from `request`, its segments checked) and checks it: the
// parameter's dtype is the format and it is 2-D and not empty; the scale
// parameter is FLOAT32 of shape [ceil(rows / block_rows), ceil(cols /
// block_cols)] (BLOCK) or [rows] / [rows, 1] (PER_ROW); every segment
// writes a rectangle of the parameter whose edges lie on block boundaries
// or on the parameter's edges (a tensor-parallel shard that cuts a block is
// refused, naming the parameter, the segment and the block size); a row of
// blocks fits limits.max_quant_band_bytes; the parameter and its scale
// parameter both in host shared memory or both in GPU memory (CUDA IPC or
// VMM). INVALID_ARGUMENT for every one of those.
absl::Status CheckQuantization(const v1::RegisterEngineRequest& request,
                               const QuantRoles& roles,
                               const RegistrationLimits& limits,
                               EngineLayout& layout);

// The rectangle rows [r0, r1) x cols [c0, c1) of a parameter of `cols`
// columns that segment `s` writes, or nullopt where its destination is not
// one (rows that land other than one parameter row apart, or a contiguous
// run that neither stays in one row nor covers whole rows).
struct QuantRect {
  int64_t r0 = 0, r1 = 0, c0 = 0, c1 = 0;
};
std::optional<QuantRect> SegmentRect(int64_t cols, const SegmentLayout& s);

// The blocks rows [i0, i1) x cols [j0, j1) of FP8 target `q`'s scale grid
// that segment `s` (of a checked layout: SegmentRect has a value) writes,
// and `first`, the flat index of block (i0, j0): the scales its receipt
// counts.
struct ScaleBlocks {
  int64_t i0 = 0, i1 = 0, j0 = 0, j1 = 0, first = 0;
};
ScaleBlocks ScaleBlocksOf(const QuantLayout& q, const SegmentLayout& s);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_QUANT_LAYOUT_H_
