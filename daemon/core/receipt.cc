#include "daemon/core/receipt.h"

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "daemon/core/bus_guard.h"

namespace weightsync {
namespace {

// Sums every segment s of parameter p (index i) for which covered(i, j, s)
// holds, j being s's index in p.
template <typename Covered>
absl::StatusOr<v1::Receipt> SumSegments(const EngineLayout& engine,
                                        const Covered& covered) {
  v1::Receipt receipt;
  uint64_t sum = 0;
  int64_t parameters = 0, bytes = 0;
  for (size_t i = 0; i < engine.parameters.size(); ++i) {
    const ParameterLayout& p = engine.parameters[i];
    const uint8_t* base = engine.regions[p.region]->data();
    if (base == nullptr) {
      return absl::UnimplementedError(
          "receipts of GPU memory are not computed yet");
    }
    const int64_t es = ElementSize(p.dtype);
    uint64_t salt = 0;
    bool touched = false;
    for (size_t j = 0; j < p.segments.size(); ++j) {
      const SegmentLayout& s = p.segments[j];
      if (!covered(i, j, s)) continue;
      if (!touched) salt = ParameterSalt(p.name);
      touched = true;
      // The engine's owner may shrink its shared memory under the read.
      const bool read = GuardedAccess(*engine.regions[p.region], [&] {
        for (int64_t r = 0; r < s.row_count; ++r) {
          // A row of the segment is a run of consecutive elements.
          const int64_t row = s.dest_offset + r * s.dest_row_stride;
          sum +=
              RunTerms(salt, row, base + p.offset + row * es, s.col_count, es);
        }
      });
      if (!read) {
        return absl::FailedPreconditionError(absl::StrCat(
            "parameter '", p.name, "': the memory behind its allocation ",
            p.region,
            " is gone (its owner shrank the shared-memory object under the "
            "daemon); the engine is dropped: register it again"));
      }
      bytes += s.row_count * s.col_count * es;
    }
    if (touched) ++parameters;
  }
  receipt.set_checksum(sum);
  receipt.set_parameters(parameters);
  receipt.set_bytes(bytes);
  return receipt;
}

}  // namespace

absl::StatusOr<v1::Receipt> ComputeReceipt(
    const EngineLayout& engine,
    const absl::flat_hash_set<std::string>& sources) {
  return SumSegments(engine, [&](size_t, size_t, const SegmentLayout& s) {
    return sources.contains(s.source);
  });
}

absl::StatusOr<v1::Receipt> ComputeReceipt(
    const EngineLayout& engine,
    const google::protobuf::RepeatedPtrField<v1::TensorSpec>& manifest) {
  // first[i]: the flat number of parameter i's first segment.
  std::vector<int64_t> first(engine.parameters.size() + 1, 0);
  for (size_t i = 0; i < engine.parameters.size(); ++i) {
    first[i + 1] = first[i] + engine.parameters[i].segments.size();
  }
  std::vector<bool> covered(first.back(), false);
  for (const v1::TensorSpec& t : manifest) {
    if (t.sparse_nnz() != 0) continue;
    auto it = engine.uses_by_source.find(t.name());
    if (it == engine.uses_by_source.end()) continue;
    for (const SourceUse& u : it->second) {
      covered[first[u.parameter] + u.segment] = true;
    }
  }
  return SumSegments(engine, [&](size_t i, size_t j, const SegmentLayout&) {
    return covered[first[i] + j];
  });
}

}  // namespace weightsync
