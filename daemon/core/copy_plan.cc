#include "daemon/core/copy_plan.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/echo.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace weightsync {
namespace {

struct Use {
  int32_t engine;
  const ParameterLayout* param;
  const SegmentLayout* segment;
  int64_t rows, cols;  // the source's matrix view for this use
  SourceUse source_use;
};

using UsesByTensor = std::vector<std::vector<Use>>;

// The rectangle of a tensor's 2-D view that a use reads: rows [r0, r0 +
// rows) x cols [c0, c0 + cols) (an implicit segment: all of it).
struct SourceRect {
  int64_t r0 = 0, rows = 0, c0 = 0, cols = 0;
};
SourceRect SourceRectOf(const ParameterLayout& p, const SegmentLayout& s,
                        int64_t rows, int64_t cols) {
  if (p.implicit) return {0, rows, 0, cols};
  return {s.row_begin, s.row_count, s.col_begin, s.col_count};
}

// A use of a tensor quantised on the wire ("FP8 on the wire",
// docs/protocol.md): its FP8 target must quantise exactly as the trainer
// did, block for block, so that its elements and scales are copied as they
// are: the same format, scheme, block and scale form, and a rectangle that
// starts on a block of the tensor and ends on one or at its edge (then the
// target's blocks, on its own boundaries, are the tensor's).
absl::Status CheckWireUse(const v1::TensorSpec& t, const std::string& where,
                          const ParameterLayout& p, const SegmentLayout& s) {
  const std::string resend =
      "; send it unquantised (in its own dtype) and the daemon quantises it";
  if (!p.quant.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the tensor arrives quantised to ",
                     DTypeName(t.dtype()), " but the parameter (",
                     DTypeName(p.dtype), ") is not an FP8 target", resend));
  }
  WS_ASSIGN_OR_RETURN(const WireQuant w, ResolveWireQuant(t));
  const QuantLayout& q = *p.quant;
  const bool q_per_row =
      q.block_rows == 1 && q.block_cols == q.cols && q.grid_cols == 1;
  if (q.format != t.dtype() || q.reciprocal != w.reciprocal ||
      (w.per_row
           ? !q_per_row
           : (q.block_rows != w.block_rows || q.block_cols != w.block_cols))) {
    auto form = [](bool per_row, int64_t br, int64_t bc, bool reciprocal) {
      return absl::StrCat(per_row ? "per row" : absl::StrCat(br, " x ", bc),
                          reciprocal ? ", reciprocal scales" : "");
    };
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": the tensor is quantised to ", DTypeName(t.dtype()), " (",
        form(w.per_row, w.block_rows, w.block_cols, w.reciprocal),
        ") but the target quantises to ", DTypeName(q.format), " (",
        form(false, q.block_rows, q.block_cols, q.reciprocal), ")", resend));
  }
  if (p.implicit && (w.rows != q.rows || w.cols != q.cols)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the parameter's blocks are of its ", q.rows,
                     " x ", q.cols, " matrix, the tensor's of its ", w.rows,
                     " x ", w.cols, " view", resend));
  }
  const SourceRect r = SourceRectOf(p, s, w.rows, w.cols);
  const QuantRect dst = *SegmentRect(q.cols, s);
  // PER_ROW: a block is a whole row of both, so the use must span both.
  const int64_t bc = w.per_row ? w.cols : w.block_cols;
  const bool aligned =
      dst.r1 - dst.r0 == r.rows && dst.c1 - dst.c0 == r.cols &&
      r.r0 % w.block_rows == 0 && r.c0 % bc == 0 &&
      ((r.r0 + r.rows) % w.block_rows == 0 || r.r0 + r.rows == w.rows) &&
      ((r.c0 + r.cols) % bc == 0 || r.c0 + r.cols == w.cols) &&
      (!w.per_row || (dst.c0 == 0 && dst.c1 == q.cols));
  if (!aligned) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": the segment reads rows ", HalfOpen(r.r0, r.rows), " x cols ",
        HalfOpen(r.c0, r.cols), " of the tensor's ", w.rows, "x", w.cols,
        " matrix, which are not whole blocks of it (", w.block_rows, " x ", bc,
        ") laid onto the target's", resend));
  }
  return absl::OkStatus();
}

absl::Status CheckUse(const v1::TensorSpec& t, const std::string& engine,
                      const ParameterLayout& p, const SegmentLayout& s) {
  const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  const std::string where = absl::StrCat("tensor '", t.name(), "' -> engine '",
                                         engine, "' parameter '", p.name, "'");
  if (t.has_quantization()) {
    if (!p.quant.has_value()) return CheckWireUse(t, where, p, s);
  } else if (p.quant.has_value()) {
    if (!IsConvertibleFloat(t.dtype())) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": dtype ", DTypeName(t.dtype()), " can't be quantised into ",
          DTypeName(p.dtype), ": send float32, bfloat16 or float16"));
    }
    if (t.sparse_nnz() > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          where,
          ": a sparse patch can't update an FP8 target (the scales "
          "of the blocks it touches would go stale); send the tensor "
          "dense"));
    }
  } else if (!CanConvert(t.dtype(), p.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dtype ", DTypeName(t.dtype()),
                     " can't be converted to ", DTypeName(p.dtype)));
  }
  if (p.implicit) {
    if (shape != p.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": shape ", ShapeString(shape),
          " does not match the registered ", ShapeString(p.shape)));
    }
    return t.has_quantization() ? CheckWireUse(t, where, p, s)
                                : absl::OkStatus();
  }
  if (!s.source_shape.empty() && shape != s.source_shape) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": shape ", ShapeString(shape),
                     " does not match the segment's "
                     "source shape ",
                     ShapeString(s.source_shape)));
  }
  int64_t rows, cols;
  SourceMatrix(shape, &rows, &cols);
  // Subtracted, not added: a segment without source_shape may name any
  // begin and count (engine_layout.cc checks them only against a
  // source_shape), and begin + count may not fit in 64 bits.
  if (s.row_begin > rows || s.row_count > rows - s.row_begin ||
      s.col_begin > cols || s.col_count > cols - s.col_begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": segment rows ", HalfOpen(s.row_begin, s.row_count), " cols ",
        HalfOpen(s.col_begin, s.col_count), " lie outside the tensor's ", rows,
        "x", cols, " matrix"));
  }
  return t.has_quantization() ? CheckWireUse(t, where, p, s) : absl::OkStatus();
}

// Appends `op` to `out`, or extends a recent op of the same region when both
// are contiguous on both sides and `op` starts where it ends: a plain layout
// packed in the engine's own order becomes one copy per chunk instead of one
// per tensor (400 copies of Qwen3-8B in 1 GiB chunks become 16). Ops of a
// chunk write disjoint bytes, so their order does not matter; only the last
// few are searched (one per engine the piece went to).
void AppendCoalesced(const CopyOp& op, int64_t ses, int64_t des,
                     std::vector<CopyOp>& out) {
  auto flat = [&](const CopyOp& o) {
    return o.rows == 1 ||
           (o.src_stride == o.cols * ses && o.dst_stride == o.cols * des);
  };
  if (flat(op)) {
    const int64_t n = op.rows * op.cols;
    for (size_t i = out.size(), seen = 0; i > 0 && seen < 8; --i, ++seen) {
      CopyOp& last = out[i - 1];
      if (last.engine != op.engine || last.region != op.region) continue;
      const int64_t m = last.rows * last.cols;
      if (last.src_dtype == op.src_dtype && last.dst_dtype == op.dst_dtype &&
          flat(last) && last.src_offset + m * ses == op.src_offset &&
          last.dst_offset + m * des == op.dst_offset) {
        last.rows = 1;
        last.cols = m + n;
        last.src_stride = last.cols * ses;
        last.dst_stride = last.cols * des;
        return;
      }
      break;  // the region's latest op does not adjoin: keep order simple
    }
  }
  out.push_back(op);
}

// Appends the copies that move source elements [e0, e1), found at chunk byte
// `chunk_offset`, through `use`. At most three: a partial first row, a block
// of whole rows, a partial last row.
void EmitOps(const Use& use, int64_t e0, int64_t e1, int64_t chunk_offset,
             v1::DType src_dtype, std::vector<CopyOp>& out) {
  const SegmentLayout& s = *use.segment;
  const ParameterLayout& p = *use.param;
  const int64_t ses = ElementSize(src_dtype);
  const int64_t des = ElementSize(p.dtype);
  const int64_t C = use.cols;
  const int64_t r_lo = std::max(s.row_begin, e0 / C);
  const int64_t r_hi = std::min(s.row_begin + s.row_count - 1, (e1 - 1) / C);
  auto emit = [&](int64_t r, int64_t a, int64_t b, int64_t nrows) {
    // Elements [a, b) of source row r (absolute source indices), nrows rows.
    CopyOp op;
    op.engine = use.engine;
    op.region = p.region;
    op.src_offset = chunk_offset + (a - e0) * ses;
    op.src_stride = C * ses;
    const int64_t dst_elem = s.dest_offset +
                             (r - s.row_begin) * s.dest_row_stride +
                             (a - r * C - s.col_begin);
    op.dst_offset = p.offset + dst_elem * des;
    op.dst_stride = s.dest_row_stride * des;
    op.rows = nrows;
    op.cols = b - a;
    op.src_dtype = src_dtype;
    op.dst_dtype = p.dtype;
    AppendCoalesced(op, ses, des, out);
  };
  auto row_span = [&](int64_t r, int64_t* a, int64_t* b) {
    *a = std::max(r * C + s.col_begin, e0);
    *b = std::min(r * C + s.col_begin + s.col_count, e1);
    return *b > *a;
  };
  // Rows strictly between r_lo and r_hi lie wholly inside [e0, e1); the two
  // end rows may be cut by the piece (or miss the block's columns).
  int64_t first_full = r_lo, last_full = r_hi;
  int64_t a, b;
  if (r_lo <= r_hi) {
    if (!row_span(r_lo, &a, &b)) {
      first_full = r_lo + 1;
    } else if (b - a < s.col_count) {
      emit(r_lo, a, b, 1);
      first_full = r_lo + 1;
    }
  }
  bool tail = false;
  int64_t ta = 0, tb = 0;
  if (r_hi >= first_full) {
    if (!row_span(r_hi, &ta, &tb)) {
      last_full = r_hi - 1;
    } else if (tb - ta < s.col_count) {
      tail = true;
      last_full = r_hi - 1;
    }
  }
  if (first_full <= last_full) {
    const int64_t start = first_full * C + s.col_begin;
    emit(first_full, start, start + s.col_count, last_full - first_full + 1);
  }
  if (tail) emit(r_hi, ta, tb, 1);
}

// Appends the copies of payload bytes [piece.tensor_offset, + length) of a
// tensor quantised on the wire through `use` (checked by CheckWireUse):
// its FP8 elements into the target as they are, its scales into the
// target's scale parameter `scale`, at the blocks the use covers.
void EmitWireOps(const Use& use, const WireQuant& w,
                 const ParameterLayout& scale, const Piece& piece,
                 std::vector<CopyOp>& out) {
  const int64_t lo = piece.tensor_offset;
  const int64_t hi = lo + piece.length;
  const int64_t numel = w.rows * w.cols;
  if (lo < numel) {
    EmitOps(use, lo, std::min(hi, numel), piece.chunk_offset, use.param->dtype,
            out);
  }
  const int64_t s_lo = std::max(lo, w.scales_offset);
  const int64_t s_hi =
      std::min(hi, w.scales_offset + w.grid_rows * w.grid_cols * 4);
  if (s_lo >= s_hi) return;
  const QuantLayout& q = *use.param->quant;
  const SourceRect r = SourceRectOf(*use.param, *use.segment, w.rows, w.cols);
  const ScaleBlocks b = ScaleBlocksOf(q, *use.segment);
  // The scales as a parameter fed by the tensor's grid of scales.
  ParameterLayout grid;
  grid.dtype = v1::FLOAT32;
  grid.region = scale.region;
  grid.offset = scale.offset;
  SegmentLayout blocks;
  blocks.row_begin = r.r0 / w.block_rows;
  blocks.row_count = b.i1 - b.i0;
  blocks.col_begin = w.per_row ? 0 : r.c0 / w.block_cols;
  blocks.col_count = b.j1 - b.j0;
  blocks.dest_offset = b.first;
  blocks.dest_row_stride = q.grid_cols;
  const Use scales{use.engine, &grid, &blocks, w.grid_rows, w.grid_cols, {}};
  // Scales start 4-aligned in a 256-aligned tensor, and chunks are
  // multiples of 256: a piece never splits one.
  EmitOps(scales, (s_lo - w.scales_offset) / 4, (s_hi - w.scales_offset) / 4,
          piece.chunk_offset + (s_lo - lo), v1::FLOAT32, out);
}

// Every use of every manifest tensor by every engine, checked (CheckUse).
absl::StatusOr<UsesByTensor> ResolveUses(
    const Manifest& manifest,
    const std::vector<std::shared_ptr<const EngineLayout>>& engines) {
  UsesByTensor uses(manifest.size());
  for (int t = 0; t < manifest.size(); ++t) {
    const v1::TensorSpec& spec = manifest[t];
    const std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
    for (int e = 0; e < static_cast<int>(engines.size()); ++e) {
      const EngineLayout& engine = *engines[e];
      auto it = engine.uses_by_source.find(spec.name());
      if (it == engine.uses_by_source.end()) continue;
      for (const SourceUse& su : it->second) {
        const ParameterLayout& p = engine.parameters[su.parameter];
        const SegmentLayout& s = p.segments[su.segment];
        WS_RETURN_IF_ERROR(CheckUse(spec, engine.engine_id, p, s));
        Use use{e, &p, &s, 0, 0, su};
        if (p.implicit) {
          use.rows = 1;
          use.cols = p.numel;
        } else {
          SourceMatrix(shape, &use.rows, &use.cols);
        }
        uses[t].push_back(use);
      }
    }
  }
  return uses;
}

// Whether `spec` is an engine's parameter of no elements (same name and
// shape): nothing to copy, but not unused either.
bool IsEmptyParameter(
    const v1::TensorSpec& spec,
    const std::vector<std::shared_ptr<const EngineLayout>>& engines) {
  for (const auto& e : engines) {
    auto it = e->empty_parameters.find(spec.name());
    if (it == e->empty_parameters.end()) continue;
    const std::vector<int64_t>& shape = e->parameters[it->second].shape;
    if (std::equal(shape.begin(), shape.end(), spec.shape().begin(),
                   spec.shape().end())) {
      return true;
    }
  }
  return false;
}

// Refuses (kRefuse) or lists in plan.unused the tensors no engine uses;
// with kOmit, leaves them out of plan.manifest and `uses`. A tensor that is
// an engine's parameter of no elements is neither.
absl::Status HandleUnused(const Manifest& manifest, UnusedTensors mode,
                          CopyPlan& plan, UsesByTensor& uses) {
  for (int t = 0; t < manifest.size(); ++t) {
    if (!uses[t].empty()) continue;
    const v1::TensorSpec& spec = manifest[t];
    if (IsEmptyParameter(spec, plan.engines)) continue;
    if (mode == UnusedTensors::kRefuse) {
      std::vector<std::string> ids;
      for (const auto& e : plan.engines) ids.push_back(e->engine_id);
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", spec.name(),
                       "' is not a parameter or segment source of "
                       "any engine in the update (",
                       absl::StrJoin(ids, ", "), ")"));
    }
    plan.unused.push_back(spec.name());
  }
  plan.manifest = manifest;
  if (mode != UnusedTensors::kOmit || plan.unused.empty()) {
    return absl::OkStatus();
  }
  Manifest used;
  UsesByTensor kept;
  used.Reserve(manifest.size() - plan.unused.size());
  for (int t = 0; t < manifest.size(); ++t) {
    if (uses[t].empty()) continue;
    *used.Add() = manifest[t];
    kept.push_back(std::move(uses[t]));
  }
  plan.manifest = std::move(used);
  uses = std::move(kept);
  return absl::OkStatus();
}

// Bytes a use writes: its elements, and for an FP8 target the scales of
// the blocks it covers.
int64_t UseBytes(const Use& u) {
  const SegmentLayout& s = *u.segment;
  const int64_t bytes = s.row_count * s.col_count * ElementSize(u.param->dtype);
  if (!u.param->quant.has_value()) return bytes;
  const QuantLayout& q = *u.param->quant;
  const QuantRect r = *SegmentRect(q.cols, s);
  const int64_t rows = (r.r1 - r.r0 + q.block_rows - 1) / q.block_rows;
  const int64_t cols = (r.c1 - r.c0 + q.block_cols - 1) / q.block_cols;
  return bytes + rows * cols * 4;
}

// Per engine: the bytes written, whether every segment is rewritten, and
// the dense uses its receipt sums.
void SumEngines(const UsesByTensor& uses, CopyPlan& plan) {
  const int num_engines = plan.engines.size();
  plan.bytes_by_engine.assign(num_engines, 0);
  plan.covers_engine.assign(num_engines, false);
  plan.dense_uses.assign(num_engines, {});
  std::vector<int64_t> resolved_uses(num_engines, 0);
  for (int t = 0; t < plan.manifest.size(); ++t) {
    if (plan.manifest[t].sparse_nnz() > 0) continue;  // rewrites some only
    for (const Use& u : uses[t]) {
      plan.dense_uses[u.engine].push_back(u.source_use);
      plan.bytes_by_engine[u.engine] += UseBytes(u);
      ++resolved_uses[u.engine];
    }
  }
  for (int e = 0; e < num_engines; ++e) {
    // Every segment of every parameter is rewritten (padding that no
    // segment covers is never written, so it can't be stale).
    int64_t uses = 0;
    for (const auto& [source, list] : plan.engines[e]->uses_by_source) {
      uses += list.size();
    }
    plan.covers_engine[e] = resolved_uses[e] == uses;
    std::sort(plan.dense_uses[e].begin(), plan.dense_uses[e].end(),
              [](const SourceUse& a, const SourceUse& b) {
                return a.parameter != b.parameter ? a.parameter < b.parameter
                                                  : a.segment < b.segment;
              });
  }
}

// The sparse patches of the manifest; returns, per tensor, its index into
// plan.sparse (-1: dense).
std::vector<int> PlanSparse(const UsesByTensor& uses, CopyPlan& plan) {
  const Manifest& manifest = plan.manifest;
  std::vector<int> sparse_index(manifest.size(), -1);
  for (int t = 0; t < manifest.size(); ++t) {
    const v1::TensorSpec& spec = manifest[t];
    if (spec.sparse_nnz() == 0) continue;
    SparsePatch patch;
    patch.tensor = t;
    patch.name = spec.name();
    patch.nnz = spec.sparse_nnz();
    patch.payload_bytes = plan.chunks.payload_bytes[t];
    patch.dtype = spec.dtype();
    const std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
    int64_t rows;
    SourceMatrix(shape, &rows, &patch.cols);
    patch.numel = rows * patch.cols;
    patch.index_bytes = spec.sparse_index_bytes() == 4 ? 4 : 8;
    for (const Use& u : uses[t]) {
      SparsePatch::Use s;
      s.engine = u.engine;
      s.region = u.param->region;
      s.param_offset = u.param->offset;
      s.dtype = u.param->dtype;
      s.implicit = u.param->implicit;
      s.row_begin = u.segment->row_begin;
      s.row_count = u.segment->row_count;
      s.col_begin = u.segment->col_begin;
      s.col_count = u.segment->col_count;
      s.dest_offset = u.segment->dest_offset;
      s.dest_row_stride = u.segment->dest_row_stride;
      patch.uses.push_back(s);
    }
    sparse_index[t] = plan.sparse.size();
    plan.sparse.push_back(std::move(patch));
  }
  return sparse_index;
}

// The quantised uses of the manifest (plan.quant); returns, per tensor and
// use, its index into plan.quant (-1: copied as it is). Empty where no use
// is quantised.
std::vector<std::vector<int>> PlanQuant(const UsesByTensor& uses,
                                        CopyPlan& plan) {
  std::vector<std::vector<int>> target_of;
  for (int t = 0; t < plan.manifest.size(); ++t) {
    // Quantised on the wire: copied as it is (EmitWireOps).
    if (plan.manifest[t].has_quantization()) continue;
    int64_t band_bytes = 0;  // of this tensor's uses, open together
    for (size_t u = 0; u < uses[t].size(); ++u) {
      const Use& use = uses[t][u];
      if (!use.param->quant.has_value()) continue;
      if (target_of.empty()) target_of.resize(plan.manifest.size());
      if (target_of[t].empty()) target_of[t].assign(uses[t].size(), -1);
      QuantTarget q;
      q.engine = use.engine;
      q.parameter = use.source_use.parameter;
      q.segment = use.source_use.segment;
      q.src_dtype = plan.manifest[t].dtype();
      q.src_cols = use.cols;
      q.tensor = t;
      q.rect = *SegmentRect(use.param->quant->cols, *use.segment);
      // Each at most 256 MiB (registration) and at most 2^20 uses.
      band_bytes +=
          std::min(q.rect.r1 - q.rect.r0, use.param->quant->block_rows) *
          (q.rect.c1 - q.rect.c0) * 4;
      target_of[t][u] = plan.quant.size();
      plan.quant.push_back(q);
    }
    plan.quant_band_bytes = std::max(plan.quant_band_bytes, band_bytes);
  }
  return target_of;
}

// Per chunk: the copies of its dense pieces, the pieces of its patches,
// the pieces of quantised uses.
void PlanOps(const UsesByTensor& uses, const std::vector<int>& sparse_index,
             const std::vector<std::vector<int>>& target_of, CopyPlan& plan) {
  plan.ops_by_chunk.resize(plan.chunks.chunks.size());
  plan.sparse_pieces_by_chunk.resize(plan.chunks.chunks.size());
  if (!target_of.empty()) plan.quant_by_chunk.resize(plan.chunks.chunks.size());
  for (const Chunk& chunk : plan.chunks.chunks) {
    std::vector<CopyOp>& ops = plan.ops_by_chunk[chunk.index];
    for (const Piece& piece : chunk.pieces) {
      const v1::TensorSpec& spec = plan.manifest[piece.tensor];
      if (sparse_index[piece.tensor] >= 0) {
        plan.sparse_pieces_by_chunk[chunk.index].push_back(
            {sparse_index[piece.tensor], piece});
        continue;
      }
      if (spec.has_quantization()) {
        const WireQuant w = *ResolveWireQuant(spec);  // checked by PlanChunks
        for (const Use& use : uses[piece.tensor]) {
          const EngineLayout& engine = *plan.engines[use.engine];
          EmitWireOps(use, w,
                      engine.parameters[use.param->quant->scale_parameter],
                      piece, ops);
        }
        continue;
      }
      const int64_t es = ElementSize(spec.dtype());
      // Tensors start 256-aligned and chunks are multiples of 256, so a
      // piece never splits an element.
      CHECK_EQ(piece.tensor_offset % es, 0);
      CHECK_EQ(piece.length % es, 0);
      const int64_t e0 = piece.tensor_offset / es;
      const int64_t e1 = e0 + piece.length / es;
      const std::vector<int>* targets =
          target_of.empty() || target_of[piece.tensor].empty()
              ? nullptr
              : &target_of[piece.tensor];
      for (size_t u = 0; u < uses[piece.tensor].size(); ++u) {
        if (targets != nullptr && (*targets)[u] >= 0) {
          plan.quant_by_chunk[chunk.index].push_back(
              {(*targets)[u], piece.tensor, e0, e1, piece.chunk_offset,
               piece.tensor_offset});
          continue;
        }
        EmitOps(uses[piece.tensor][u], e0, e1, piece.chunk_offset, spec.dtype(),
                ops);
      }
    }
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<const CopyPlan>> BuildCopyPlan(
    const Manifest& manifest, int64_t chunk_bytes,
    std::vector<std::shared_ptr<const EngineLayout>> engines,
    UnusedTensors unused) {
  auto plan = std::make_shared<CopyPlan>();
  // Validates the manifest (names, dtypes, sizes) before anything else.
  WS_ASSIGN_OR_RETURN(plan->chunks, PlanChunks(manifest, chunk_bytes));
  plan->engines = std::move(engines);
  WS_ASSIGN_OR_RETURN(UsesByTensor uses, ResolveUses(manifest, plan->engines));
  WS_RETURN_IF_ERROR(HandleUnused(manifest, unused, *plan, uses));
  if (plan->manifest.size() != manifest.size()) {
    WS_ASSIGN_OR_RETURN(plan->chunks, PlanChunks(plan->manifest, chunk_bytes));
  }
  SumEngines(uses, *plan);
  const std::vector<int> sparse_index = PlanSparse(uses, *plan);
  const std::vector<std::vector<int>> target_of = PlanQuant(uses, *plan);
  PlanOps(uses, sparse_index, target_of, *plan);
  return std::shared_ptr<const CopyPlan>(std::move(plan));
}

}  // namespace weightsync
