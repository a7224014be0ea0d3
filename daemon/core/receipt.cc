#include "daemon/core/receipt.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "daemon/core/bus_guard.h"
#include "daemon/core/quant_layout.h"

namespace weightsync {
namespace {

bool ByParameterThenSegment(const SourceUse& a, const SourceUse& b) {
  return a.parameter != b.parameter ? a.parameter < b.parameter
                                    : a.segment < b.segment;
}

// The uses of the tensors for which `named(name)` holds, sorted.
template <typename Named>
std::vector<SourceUse> UsesOf(const EngineLayout& engine, const Named& named) {
  std::vector<SourceUse> uses;
  for (const auto& [source, list] : engine.uses_by_source) {
    if (named(source)) uses.insert(uses.end(), list.begin(), list.end());
  }
  std::sort(uses.begin(), uses.end(), ByParameterThenSegment);
  return uses;
}

absl::Status Gone(const ParameterLayout& p) {
  return absl::FailedPreconditionError(absl::StrCat(
      "parameter '", p.name, "': the memory behind its allocation ", p.region,
      " is gone (its owner shrank the shared-memory object under the "
      "daemon); the engine is dropped: register it again"));
}

// The terms of the scales of the blocks that segment `s` of FP8 target `p`
// writes (docs/protocol.md, "FP8 targets"), added to *sum; *blocks gets
// their count.
absl::Status AddScaleTerms(const EngineLayout& engine, const ParameterLayout& p,
                           const SegmentLayout& s, uint64_t* sum,
                           int64_t* blocks) {
  const QuantLayout& q = *p.quant;
  const ParameterLayout& scale = engine.parameters[q.scale_parameter];
  const ScaleBlocks b = ScaleBlocksOf(q, s);
  const MappedRegion& region = *engine.regions[scale.region];
  const uint8_t* base = region.data() + scale.offset;
  const bool read = GuardedAccess(region, [&] {
    for (int64_t i = b.i0; i < b.i1; ++i) {
      const int64_t first = i * q.grid_cols + b.j0;
      *sum += RunTerms(scale.salt, first, base + first * 4, b.j1 - b.j0, 4);
    }
  });
  if (!read) return Gone(scale);
  *blocks = (b.i1 - b.i0) * (b.j1 - b.j0);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::Receipt> ComputeReceipt(const EngineLayout& engine,
                                           const std::vector<SourceUse>& uses) {
  uint64_t sum = 0;
  int64_t parameters = 0, bytes = 0;
  int32_t last = -1;
  // Scale parameters counted (an FP8 target's scales count once).
  absl::flat_hash_set<int32_t> scales_seen;
  for (const SourceUse& u : uses) {
    const ParameterLayout& p = engine.parameters[u.parameter];
    const uint8_t* base = engine.regions[p.region]->data();
    if (base == nullptr) {
      return absl::UnimplementedError(
          "receipts of GPU memory are not computed yet");
    }
    if (u.parameter != last) ++parameters;
    last = u.parameter;
    const SegmentLayout& s = p.segments[u.segment];
    const int64_t es = ElementSize(p.dtype);
    // The engine's owner may shrink its shared memory under the read.
    const bool read = GuardedAccess(*engine.regions[p.region], [&] {
      for (int64_t r = 0; r < s.row_count; ++r) {
        // A row of the segment is a run of consecutive elements.
        const int64_t row = s.dest_offset + r * s.dest_row_stride;
        sum +=
            RunTerms(p.salt, row, base + p.offset + row * es, s.col_count, es);
      }
    });
    if (!read) return Gone(p);
    bytes += s.row_count * s.col_count * es;
    if (p.quant.has_value()) {
      int64_t blocks = 0;
      const absl::Status scales = AddScaleTerms(engine, p, s, &sum, &blocks);
      if (!scales.ok()) return scales;
      bytes += blocks * 4;
      if (scales_seen.insert(p.quant->scale_parameter).second) ++parameters;
    }
  }
  v1::Receipt receipt;
  receipt.set_checksum(sum);
  receipt.set_parameters(parameters);
  receipt.set_bytes(bytes);
  return receipt;
}

absl::StatusOr<v1::Receipt> ComputeReceipt(
    const EngineLayout& engine,
    const absl::flat_hash_set<std::string>& sources) {
  return ComputeReceipt(engine, UsesOf(engine, [&](absl::string_view name) {
                          return sources.contains(name);
                        }));
}

}  // namespace weightsync
