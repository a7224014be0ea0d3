#include "backends/host/quant_scatter.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/fp8.h"
#include "common/status_macros.h"
#include "daemon/core/bus_guard.h"

namespace weightsync {
namespace {

int64_t Width(const QuantTarget& t) { return t.rect.c1 - t.rect.c0; }

// Rows of parameter in row of blocks `band` of `t`'s rectangle.
int64_t BandRows(const QuantTarget& t, const QuantLayout& q, int64_t band) {
  return std::min(t.rect.r1, (band + 1) * q.block_rows) - band * q.block_rows;
}

}  // namespace

void QuantScatter::Reset(const CopyPlan& plan) {
  bands_.clear();
  bands_.resize(plan.quant.size());
  gathered_.clear();
  gathered_.resize(plan.quant.size());
}

int64_t QuantScatter::open_bytes() const {
  int64_t n = 0;
  for (const Band& b : bands_) n += b.index >= 0 ? 4 * b.values.size() : 0;
  for (const auto& open : gathered_) {
    for (const auto& [band, b] : open) n += 4 * b.values.size();
  }
  return n;
}

absl::Status QuantScatter::Feed(const CopyPlan& plan, int64_t index,
                                const uint8_t* chunk, const Source* source,
                                const std::atomic<bool>* lost) {
  if (plan.quant_by_chunk.empty()) return absl::OkStatus();
  std::string copied;  // a piece read out of a source's memory
  for (const QuantPiece& piece : plan.quant_by_chunk[index]) {
    const QuantTarget& t = plan.quant[piece.target];
    if (lost != nullptr && lost[t.engine].load(std::memory_order_relaxed)) {
      continue;
    }
    const int64_t ses = ElementSize(t.src_dtype);
    const uint8_t* bytes = chunk + piece.chunk_offset;
    if (source != nullptr) {
      // Copied out first: the band's writes into engine memory run in
      // their own SIGBUS window, which can't nest in the source's.
      const Source::Placement& at = source->placements[piece.tensor];
      const MappedRegion& region = *source->regions[at.region];
      copied.resize((piece.end - piece.begin) * ses);
      const uint8_t* from = region.data() + at.offset + piece.tensor_offset;
      if (!GuardedAccess(region, [&] {
            std::memcpy(copied.data(), from, copied.size());
          })) {
        return absl::DataLossError(absl::StrCat(
            "chunk ", index, ": allocation ", at.region, " of source '",
            source->id,
            "' shrank under the daemon (the trainer truncated its shared "
            "memory); register the source again"));
      }
      bytes = reinterpret_cast<const uint8_t*>(copied.data());
    }
    // Source rows of the segment in [begin, end): one run each.
    const ParameterLayout& p = plan.engines[t.engine]->parameters[t.parameter];
    const SegmentLayout& s = p.segments[t.segment];
    const int64_t cols = t.src_cols;
    const int64_t r_lo = std::max(s.row_begin, piece.begin / cols);
    const int64_t r_hi =
        std::min(s.row_begin + s.row_count - 1, (piece.end - 1) / cols);
    for (int64_t r = r_lo; r <= r_hi; ++r) {
      const int64_t a = std::max(r * cols + s.col_begin, piece.begin);
      const int64_t z =
          std::min(r * cols + s.col_begin + s.col_count, piece.end);
      if (z <= a) continue;
      const int64_t dest = s.dest_offset +
                           (r - s.row_begin) * s.dest_row_stride +
                           (a - r * cols - s.col_begin);
      WS_RETURN_IF_ERROR(Take(plan, piece.target,
                              bytes + (a - piece.begin) * ses, dest, z - a));
    }
  }
  return absl::OkStatus();
}

absl::Status QuantScatter::Take(const CopyPlan& plan, int32_t target,
                                const uint8_t* src, int64_t dest, int64_t n) {
  const QuantTarget& t = plan.quant[target];
  const ParameterLayout& p = plan.engines[t.engine]->parameters[t.parameter];
  const QuantLayout& q = *p.quant;
  const int64_t ses = ElementSize(t.src_dtype);
  const int64_t width = Width(t);
  while (n > 0) {
    const int64_t pr = dest / q.cols, pc = dest % q.cols;
    const int64_t m = std::min(n, q.cols - pc);
    const int64_t band = pr / q.block_rows;
    Band& b = t.gathered ? gathered_[target][band] : bands_[target];
    // The plan keeps every element inside the rectangle, and a use fed by
    // one stream in order; a plan that broke that must not write out of
    // the band.
    if (pr < t.rect.r0 || pr >= t.rect.r1 || pc < t.rect.c0 ||
        pc + m > t.rect.c1 || (b.index != band && b.filled != 0)) {
      return absl::InternalError(absl::StrCat(
          "FP8 target '", p.name, "' of engine '",
          plan.engines[t.engine]->engine_id, "': elements at ", dest,
          " arrived outside its rows of blocks or out of order"));
    }
    if (b.index != band) {
      b.index = band;
      b.values.resize(BandRows(t, q, band) * width);
    }
    ConvertElements(
        src, t.src_dtype,
        &b.values[(pr - band * q.block_rows) * width + (pc - t.rect.c0)],
        v1::FLOAT32, m);
    b.filled += m;
    if (b.filled == static_cast<int64_t>(b.values.size())) {
      Flush(plan, target, b);
      if (t.gathered) gathered_[target].erase(band);
    }
    src += m * ses;
    dest += m;
    n -= m;
  }
  return absl::OkStatus();
}

void QuantScatter::Flush(const CopyPlan& plan, int32_t target, Band& b) {
  const QuantTarget& t = plan.quant[target];
  const EngineLayout& engine = *plan.engines[t.engine];
  const ParameterLayout& p = engine.parameters[t.parameter];
  const QuantLayout& q = *p.quant;
  const ParameterLayout& scale = engine.parameters[q.scale_parameter];
  const int64_t width = Width(t);
  const int64_t rows = static_cast<int64_t>(b.values.size()) / width;
  const int64_t row0 = b.index * q.block_rows;
  const MappedRegion& to = *engine.regions[p.region];
  const MappedRegion& to_scale = *engine.regions[scale.region];
  uint8_t* q_out = to.data() + p.offset + row0 * q.cols + t.rect.c0;
  uint8_t* scale_out = to_scale.data() + scale.offset +
                       4 * (b.index * q.grid_cols + t.rect.c0 / q.block_cols);
  const Fp8Blocks blocks{q.format, q.block_rows, q.block_cols, q.reciprocal};
  auto write = [&] {
    QuantizeBlocks(b.values.data(), rows, width, width, blocks, q_out, q.cols,
                   scale_out, q.grid_cols);
  };
  // A region whose owner shrank it fails (bus_guard.h); Finish drops the
  // engine, as for plain copies.
  if (&to == &to_scale) {
    GuardedAccess(to, write);
  } else {
    GuardedAccess(to, to_scale, write);
  }
  const bool last = row0 + rows >= t.rect.r1;
  b.index = -1;
  b.filled = 0;
  if (last) std::vector<float>().swap(b.values);
}

}  // namespace weightsync
