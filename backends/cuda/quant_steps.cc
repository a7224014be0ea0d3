#include "backends/cuda/quant_steps.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backends/cuda/source_ops.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace weightsync {
namespace {

constexpr int64_t kSlotAlign = 256;

int64_t AlignUp(int64_t x) {
  return (x + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
}

// A quantised use's place in the scratch and its open window: parameter
// rows [first_row, first_row + bands * block_rows), clipped to its
// rectangle, of which `filled` elements have arrived.
struct Window {
  int64_t slot = 0;
  int64_t bands = 1;
  int64_t first_row = 0;
  int64_t filled = 0;
};

const ParameterLayout& ParamOf(const CopyPlan& plan, const QuantTarget& t) {
  return plan.engines[t.engine]->parameters[t.parameter];
}

// Rows of blocks per window of `t`, and a window's float32 bytes.
std::pair<int64_t, int64_t> WindowOf(const CopyPlan& plan, const QuantTarget& t,
                                     int64_t window_bytes) {
  const QuantLayout& q = *ParamOf(plan, t).quant;
  const int64_t rows = t.rect.r1 - t.rect.r0;
  const int64_t band_bytes =
      std::min(rows, q.block_rows) * (t.rect.c1 - t.rect.c0) * 4;
  const int64_t total = (rows + q.block_rows - 1) / q.block_rows;
  const int64_t bands =
      std::max<int64_t>(1, std::min(total, window_bytes / band_bytes));
  return {bands,
          std::min(rows, bands * q.block_rows) * (t.rect.c1 - t.rect.c0) * 4};
}

// The manifest tensor of every quantised use (-1: it gets no piece).
std::vector<int32_t> TensorOfTargets(const CopyPlan& plan) {
  std::vector<int32_t> tensor(plan.quant.size(), -1);
  for (const std::vector<QuantPiece>& pieces : plan.quant_by_chunk) {
    for (const QuantPiece& piece : pieces) tensor[piece.target] = piece.tensor;
  }
  return tensor;
}

// Lays out the uses' windows (the uses of one tensor side by side from
// offset 0); returns the scratch bytes.
int64_t AssignWindows(const CopyPlan& plan, int64_t window_bytes,
                      const std::vector<bool>& direct,
                      std::vector<Window>* windows) {
  const std::vector<int32_t> tensor = TensorOfTargets(plan);
  windows->assign(plan.quant.size(), Window());
  int64_t most = 0, used = 0;
  int32_t last = -2;
  for (size_t i = 0; i < plan.quant.size(); ++i) {
    if (tensor[i] != last) used = 0;
    last = tensor[i];
    if (direct[i]) continue;  // no scratch
    const auto [bands, bytes] = WindowOf(plan, plan.quant[i], window_bytes);
    (*windows)[i].slot = used;
    (*windows)[i].bands = bands;
    (*windows)[i].first_row = plan.quant[i].rect.r0;
    used += AlignUp(bytes);
    most = std::max(most, used);
  }
  return most;
}

// Use `t`'s rectangle in its source: rectangle element (r, c) is source
// element *first + r * *stride + c of its tensor (the segment's view,
// src_cols wide); false where no one stride does it (a contiguous
// destination fed by part of each of several source rows).
bool DirectGeometry(const CopyPlan& plan, const QuantTarget& t, int64_t* first,
                    int64_t* stride) {
  const ParameterLayout& p = ParamOf(plan, t);
  const QuantLayout& q = *p.quant;
  const SegmentLayout& s = p.segments[t.segment];
  *first = s.row_begin * t.src_cols + s.col_begin;
  // SegmentRect's cases: each source row on the parameter row below the
  // last ...
  if (s.dest_row_stride == q.cols &&
      s.col_count <= q.cols - s.dest_offset % q.cols) {
    *stride = t.src_cols;
    return true;
  }
  // ... or one contiguous run of the parameter, fed by a contiguous run of
  // the source (one source row, or whole ones) a rectangle row at a time.
  if (s.row_count == 1 || s.col_count == t.src_cols) {
    *stride = t.rect.c1 - t.rect.c0;
    return true;
  }
  return false;
}

// Per use: whether a direct step quantises it (QuantIsDirect).
std::vector<bool> DirectUses(const CopyPlan& plan, bool whole_source,
                             const Source* source) {
  std::vector<bool> direct(plan.quant.size(), false);
  if (!whole_source) return direct;
  const std::vector<int32_t> tensor = TensorOfTargets(plan);
  for (size_t i = 0; i < plan.quant.size(); ++i) {
    const QuantTarget& t = plan.quant[i];
    int64_t first, stride;
    if (tensor[i] < 0 || t.rect.r1 <= t.rect.r0 || t.rect.c1 <= t.rect.c0 ||
        !DirectGeometry(plan, t, &first, &stride)) {
      continue;
    }
    // The kernel loads whole elements: the tensor must start on one
    // (the packed stream's tensors start 256-aligned).
    if (source != nullptr &&
        (tensor[i] >= static_cast<int32_t>(source->placements.size()) ||
         source->placements[tensor[i]].offset % ElementSize(t.src_dtype) !=
             0)) {
      continue;
    }
    direct[i] = true;
  }
  return direct;
}

// The outputs of use `t`'s rows [first_row, end_row) (a flush, or a direct
// step's `out`).
absl::Status FillOut(const CopyPlan& plan, const QuantTarget& t,
                     const RegionIdOf& region_id, int64_t first_row,
                     int64_t end_row, worker::v1::GpuQuantFlush* f) {
  const EngineLayout& engine = *plan.engines[t.engine];
  const ParameterLayout& p = engine.parameters[t.parameter];
  const QuantLayout& q = *p.quant;
  const ParameterLayout& scale = engine.parameters[q.scale_parameter];
  WS_ASSIGN_OR_RETURN(const int64_t out, region_id(t.engine, p.region));
  WS_ASSIGN_OR_RETURN(const int64_t scales, region_id(t.engine, scale.region));
  f->set_rows(end_row - first_row);
  f->set_width(t.rect.c1 - t.rect.c0);
  f->set_block_rows(q.block_rows);
  f->set_block_cols(q.block_cols);
  f->set_format(q.format);
  f->set_reciprocal(q.reciprocal);
  f->set_allocation_id(out);
  f->set_offset(p.offset + first_row * q.cols + t.rect.c0);
  f->set_stride(q.cols);
  f->set_scale_allocation_id(scales);
  f->set_scale_offset(
      scale.offset +
      4 * (first_row / q.block_rows * q.grid_cols + t.rect.c0 / q.block_cols));
  f->set_scale_stride(q.grid_cols);
  return absl::OkStatus();
}

// Turns the pieces of quantised uses into the worker's steps, chunk by
// chunk (Piece), keeping each use's window.
class StepBuilder {
 public:
  StepBuilder(const CopyPlan& plan, const RegionIdOf& region_id,
              const Source* source, const std::vector<int64_t>& source_ids,
              std::vector<Window> windows, worker::v1::BeginUpdateRequest* req)
      : plan_(plan),
        region_id_(region_id),
        source_(source),
        source_ids_(source_ids),
        windows_(std::move(windows)),
        req_(req) {}

  absl::Status Piece(int64_t k, const QuantPiece& piece);
  // INTERNAL for a use (not `direct`) whose elements did not all arrive.
  absl::Status Finish(const std::vector<bool>& direct) const;

 private:
  // n_rows runs of n_cols source elements (row r at chunk byte src_off +
  // r * src_stride) for parameter rows pr, pr + 1, ... from column pc.
  absl::Status Rows(int32_t target, int64_t src_off, int64_t src_stride,
                    int64_t pr, int64_t n_rows, int64_t pc, int64_t n_cols);
  // n source elements at chunk byte src_off for the parameter's elements
  // dest, dest + 1, ... (a run that may span parameter rows).
  absl::Status Run(int32_t target, int64_t src_off, int64_t dest, int64_t n);
  absl::Status Gather(worker::v1::GpuOp g);
  absl::Status Flush(int32_t target, int64_t end_row);
  absl::Status OutOfOrder(int32_t target, int64_t pr, int64_t pc) const;

  const CopyPlan& plan_;
  const RegionIdOf& region_id_;
  const Source* source_;
  const std::vector<int64_t>& source_ids_;
  std::vector<Window> windows_;
  worker::v1::BeginUpdateRequest* req_;
  int64_t chunk_ = 0;
};

absl::Status StepBuilder::Piece(int64_t k, const QuantPiece& piece) {
  chunk_ = k;
  const QuantTarget& t = plan_.quant[piece.target];
  const ParameterLayout& p = ParamOf(plan_, t);
  const QuantLayout& q = *p.quant;
  const SegmentLayout& s = p.segments[t.segment];
  const int64_t ses = ElementSize(t.src_dtype);
  const int64_t cols = t.src_cols;
  const int64_t r_lo = std::max(s.row_begin, piece.begin / cols);
  const int64_t r_hi =
      std::min(s.row_begin + s.row_count - 1, (piece.end - 1) / cols);
  // Each source row lands on one parameter row, the next row below it
  // (SegmentRect's rectangle case): whole rows go as one 2-D run.
  const bool stacked = s.dest_row_stride == q.cols &&
                       s.col_count <= q.cols - s.dest_offset % q.cols;
  auto src_at = [&](int64_t e) {
    return piece.chunk_offset + (e - piece.begin) * ses;
  };
  auto dest_of = [&](int64_t r, int64_t a) {
    return s.dest_offset + (r - s.row_begin) * s.dest_row_stride +
           (a - r * cols - s.col_begin);
  };
  auto whole = [&](int64_t r) {
    return r * cols + s.col_begin >= piece.begin &&
           r * cols + s.col_begin + s.col_count <= piece.end;
  };
  for (int64_t r = r_lo; r <= r_hi;) {
    const int64_t a = std::max(r * cols + s.col_begin, piece.begin);
    const int64_t z = std::min(r * cols + s.col_begin + s.col_count, piece.end);
    if (z <= a) {
      ++r;
      continue;
    }
    if (stacked && whole(r)) {
      const int64_t last = whole(r_hi) ? r_hi : r_hi - 1;
      const int64_t dest = dest_of(r, a);
      WS_RETURN_IF_ERROR(Rows(piece.target, src_at(a), cols * ses,
                              dest / q.cols, last - r + 1, dest % q.cols,
                              s.col_count));
      r = last + 1;
      continue;
    }
    WS_RETURN_IF_ERROR(Run(piece.target, src_at(a), dest_of(r, a), z - a));
    ++r;
  }
  return absl::OkStatus();
}

absl::Status StepBuilder::Run(int32_t target, int64_t src_off, int64_t dest,
                              int64_t n) {
  const QuantTarget& t = plan_.quant[target];
  const int64_t cols = ParamOf(plan_, t).quant->cols;
  const int64_t ses = ElementSize(t.src_dtype);
  while (n > 0) {
    const int64_t pr = dest / cols, pc = dest % cols;
    // Whole rows (the source run is contiguous), or a part of one row.
    const bool whole = pc == 0 && n >= cols;
    const int64_t rows = whole ? n / cols : 1;
    const int64_t m = whole ? cols : std::min(n, cols - pc);
    WS_RETURN_IF_ERROR(Rows(target, src_off, m * ses, pr, rows, pc, m));
    src_off += rows * m * ses;
    dest += rows * m;
    n -= rows * m;
  }
  return absl::OkStatus();
}

absl::Status StepBuilder::OutOfOrder(int32_t target, int64_t pr,
                                     int64_t pc) const {
  const QuantTarget& t = plan_.quant[target];
  return absl::InternalError(
      absl::StrCat("FP8 target '", ParamOf(plan_, t).name, "' of engine '",
                   plan_.engines[t.engine]->engine_id, "': elements of row ",
                   pr, ", column ", pc,
                   " arrive outside its open rows of blocks or out of order"));
}

absl::Status StepBuilder::Rows(int32_t target, int64_t src_off,
                               int64_t src_stride, int64_t pr, int64_t n_rows,
                               int64_t pc, int64_t n_cols) {
  const QuantTarget& t = plan_.quant[target];
  const QuantLayout& q = *ParamOf(plan_, t).quant;
  const int64_t ses = ElementSize(t.src_dtype);
  const int64_t width = t.rect.c1 - t.rect.c0;
  Window& w = windows_[target];
  while (n_rows > 0) {
    const int64_t end =
        std::min(t.rect.r1, w.first_row + w.bands * q.block_rows);
    if (pr < w.first_row || pr >= end || pc < t.rect.c0 ||
        pc + n_cols > t.rect.c1) {
      return OutOfOrder(target, pr, pc);
    }
    const int64_t take = std::min(n_rows, end - pr);
    worker::v1::GpuOp g;
    g.set_chunk(chunk_);
    g.set_src_offset(src_off);
    g.set_src_stride(take == 1 ? n_cols * ses : src_stride);
    g.set_dst_offset(w.slot +
                     ((pr - w.first_row) * width + pc - t.rect.c0) * 4);
    g.set_dst_stride(take == 1 ? n_cols * 4 : width * 4);
    g.set_rows(take);
    g.set_cols(n_cols);
    g.set_src_dtype(t.src_dtype);
    g.set_dst_dtype(v1::FLOAT32);
    WS_RETURN_IF_ERROR(Gather(std::move(g)));
    w.filled += take * n_cols;
    if (w.filled == (end - w.first_row) * width) {
      WS_RETURN_IF_ERROR(Flush(target, end));
    }
    src_off += take * src_stride;
    pr += take;
    n_rows -= take;
  }
  return absl::OkStatus();
}

absl::Status StepBuilder::Gather(worker::v1::GpuOp g) {
  if (source_ == nullptr) {
    worker::v1::GpuQuantStep* step = req_->add_quant_steps();
    step->set_chunk(chunk_);
    *step->mutable_gather() = std::move(g);
    return absl::OkStatus();
  }
  // A registered source: read each byte where its tensor lives.
  return SplitSourceOp(
      plan_.chunks, *source_, source_ids_, chunk_, std::move(g), [this]() {
        worker::v1::GpuQuantStep* step = req_->add_quant_steps();
        step->set_chunk(chunk_);
        return step->mutable_gather();
      });
}

absl::Status StepBuilder::Flush(int32_t target, int64_t end_row) {
  const QuantTarget& t = plan_.quant[target];
  Window& w = windows_[target];
  worker::v1::GpuQuantStep* step = req_->add_quant_steps();
  step->set_chunk(chunk_);
  worker::v1::GpuQuantFlush* f = step->mutable_flush();
  f->set_scratch_offset(w.slot);
  WS_RETURN_IF_ERROR(FillOut(plan_, t, region_id_, w.first_row, end_row, f));
  w.first_row = end_row;
  w.filled = 0;
  return absl::OkStatus();
}

absl::Status StepBuilder::Finish(const std::vector<bool>& direct) const {
  for (size_t i = 0; i < windows_.size(); ++i) {
    if (!direct[i] && windows_[i].first_row != plan_.quant[i].rect.r1) {
      return OutOfOrder(static_cast<int32_t>(i), windows_[i].first_row,
                        plan_.quant[i].rect.c0);
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool QuantIsDirect(const CopyPlan& plan, int32_t target, bool whole_source,
                   const Source* source) {
  return DirectUses(plan, whole_source, source)[target];
}

int64_t QuantScratchBytes(const CopyPlan& plan, int64_t window_bytes,
                          bool whole_source, const Source* source) {
  std::vector<Window> windows;
  return AssignWindows(plan, window_bytes,
                       DirectUses(plan, whole_source, source), &windows);
}

absl::Status AddQuantSteps(const CopyPlan& plan, int64_t window_bytes,
                           bool whole_source, const RegionIdOf& region_id,
                           const Source* source,
                           const std::vector<int64_t>& source_ids,
                           worker::v1::BeginUpdateRequest* req) {
  req->clear_quant_steps();
  req->set_quant_scratch_bytes(0);
  if (plan.quant.empty()) return absl::OkStatus();
  const std::vector<bool> direct = DirectUses(plan, whole_source, source);
  std::vector<Window> windows;
  req->set_quant_scratch_bytes(
      AssignWindows(plan, window_bytes, direct, &windows));
  StepBuilder builder(plan, region_id, source, source_ids, std::move(windows),
                      req);
  for (size_t k = 0; k < plan.quant_by_chunk.size(); ++k) {
    for (const QuantPiece& piece : plan.quant_by_chunk[k]) {
      if (direct[piece.target]) continue;
      WS_RETURN_IF_ERROR(builder.Piece(static_cast<int64_t>(k), piece));
    }
  }
  WS_RETURN_IF_ERROR(builder.Finish(direct));
  // Direct steps: in the last chunk (their source is all there from the
  // first; with the whole update present the receipts are summed after
  // the last chunk, so nothing reads their output before).
  const std::vector<int32_t> tensor = TensorOfTargets(plan);
  const int64_t last = static_cast<int64_t>(plan.chunks.chunks.size()) - 1;
  for (size_t i = 0; i < plan.quant.size(); ++i) {
    if (!direct[i]) continue;
    const QuantTarget& t = plan.quant[i];
    int64_t first = 0, stride = 0;
    DirectGeometry(plan, t, &first, &stride);
    const int64_t es = ElementSize(t.src_dtype);
    worker::v1::GpuQuantStep* step = req->add_quant_steps();
    step->set_chunk(last);
    worker::v1::GpuQuantDirect* d = step->mutable_direct();
    if (source == nullptr) {
      d->set_src_offset(plan.chunks.tensor_offsets[tensor[i]] + first * es);
    } else {
      const Source::Placement& at = source->placements[tensor[i]];
      if (at.region < 0 ||
          at.region >= static_cast<int32_t>(source_ids.size())) {
        return absl::InternalError(absl::StrCat(
            "FP8 target '", ParamOf(plan, t).name,
            "': its source tensor's region ", at.region, " has no worker id"));
      }
      d->set_src_allocation_id(source_ids[at.region]);
      d->set_src_offset(at.offset + first * es);
    }
    d->set_src_stride(stride);
    d->set_src_dtype(t.src_dtype);
    WS_RETURN_IF_ERROR(
        FillOut(plan, t, region_id, t.rect.r0, t.rect.r1, d->mutable_out()));
  }
  return absl::OkStatus();
}

}  // namespace weightsync
