#include "daemon/core/receipt.h"

#include "absl/status/status.h"
#include "common/checksum.h"
#include "common/dtype.h"

namespace weightsync {

absl::StatusOr<v1::Receipt> ComputeReceipt(
    const EngineLayout& engine,
    const absl::flat_hash_set<std::string>& sources) {
  v1::Receipt receipt;
  uint64_t sum = 0;
  for (const ParameterLayout& p : engine.parameters) {
    const uint8_t* base = engine.regions[p.region]->data();
    if (base == nullptr) {
      return absl::UnimplementedError(
          "receipts of GPU memory are not computed yet");
    }
    const int64_t es = ElementSize(p.dtype);
    const uint64_t salt = ParameterSalt(p.name);
    bool touched = false;
    for (const SegmentLayout& s : p.segments) {
      if (!sources.contains(s.source)) continue;
      touched = true;
      for (int64_t r = 0; r < s.row_count; ++r) {
        // A row of the segment is a run of consecutive elements.
        const int64_t row = s.dest_offset + r * s.dest_row_stride;
        sum += RunTerms(salt, row, base + p.offset + row * es, s.col_count, es);
      }
      receipt.set_bytes(receipt.bytes() + s.row_count * s.col_count * es);
    }
    if (touched) receipt.set_parameters(receipt.parameters() + 1);
  }
  receipt.set_checksum(sum);
  return receipt;
}

}  // namespace weightsync
