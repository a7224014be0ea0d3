#include "daemon/core/quant_layout.h"

#include <algorithm>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/echo.h"
#include "common/fp8.h"
#include "common/status_macros.h"

namespace weightsync {
namespace {

// Block sides above this are refused (they would only be one block).
constexpr int64_t kMaxBlockSide = int64_t{1} << 24;

absl::Status Invalid(const std::string& engine, absl::string_view param,
                     const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(
      "engine '", engine, "': parameter '", Echo(param), "': ", what));
}

// The checks of one Quantization that need no other parameter.
absl::Status CheckDeclaration(const std::string& engine,
                              const v1::Parameter& p) {
  const v1::Quantization& q = p.quantization();
  if (!IsFp8(q.format())) {
    return Invalid(
        engine, p.name(),
        absl::StrCat("quantization.format is ", DTypeName(q.format()),
                     "; FP8 targets are FLOAT8_E4M3FN or "
                     "FLOAT8_E5M2"));
  }
  if (!v1::QuantScheme_IsValid(q.scheme()) ||
      !v1::ScaleForm_IsValid(q.scale_form())) {
    return Invalid(
        engine, p.name(),
        absl::StrCat("quantization.scheme ", q.scheme(), " or scale_form ",
                     q.scale_form(), " is not a value this daemon knows"));
  }
  if (q.block_rows() < 0 || q.block_cols() < 0 ||
      q.block_rows() > kMaxBlockSide || q.block_cols() > kMaxBlockSide) {
    return Invalid(engine, p.name(),
                   absl::StrCat("block ", q.block_rows(), " x ", q.block_cols(),
                                " must be 0 (128) or 1 to ", kMaxBlockSide));
  }
  if (q.scheme() == v1::QUANT_SCHEME_PER_ROW &&
      (q.block_rows() != 0 || q.block_cols() != 0)) {
    return Invalid(engine, p.name(),
                   "block_rows and block_cols are for QUANT_SCHEME_BLOCK; "
                   "leave them 0 with QUANT_SCHEME_PER_ROW");
  }
  return absl::OkStatus();
}

// The shape the scale parameter of a weight of shape `w` must have: the
// flat [rows] / [rows, 1] (per row) or [grid rows, grid cols] (blocks), or
// for a stacked weight [..., n, k] the same per matrix: [..., n] /
// [..., n, 1], or [..., ceil(n / block rows), grid cols].
bool ScaleShapeFits(const QuantLayout& q, bool per_row,
                    const std::vector<int64_t>& w,
                    const std::vector<int64_t>& shape) {
  const std::vector<int64_t> lead(w.begin(), w.end() - 2);
  const int64_t n = w[w.size() - 2];
  auto is = [&shape](std::vector<int64_t> want) { return shape == want; };
  auto stacked = [&lead](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> v = lead;
    v.insert(v.end(), tail);
    return v;
  };
  if (per_row) {
    return is({q.rows}) || is({q.rows, 1}) || is(stacked({n})) ||
           is(stacked({n, 1}));
  }
  const int64_t grid_rows = (q.rows + q.block_rows - 1) / q.block_rows;
  return is({grid_rows, q.grid_cols}) ||
         is(stacked({(n + q.block_rows - 1) / q.block_rows, q.grid_cols}));
}

// Every segment of `p` writes a rectangle whose edges lie on block
// boundaries or on the parameter's edges.
absl::Status CheckSegmentsAligned(const std::string& engine,
                                  const ParameterLayout& p,
                                  const QuantLayout& q) {
  for (size_t i = 0; i < p.segments.size(); ++i) {
    const SegmentLayout& s = p.segments[i];
    const std::string seg =
        p.implicit
            ? "the whole tensor"
            : absl::StrCat("segment ", i, " (source '", Echo(s.source), "')");
    const std::optional<QuantRect> rect = SegmentRect(q.cols, s);
    if (!rect.has_value()) {
      return Invalid(
          engine, p.name,
          absl::StrCat(seg, " lands its rows ", s.dest_row_stride,
                       " elements apart in a parameter of ", q.cols,
                       " columns: not a rectangle of the parameter, so its "
                       "blocks can't be formed"));
    }
    const bool aligned = rect->r0 % q.block_rows == 0 &&
                         rect->c0 % q.block_cols == 0 &&
                         (rect->r1 % q.block_rows == 0 || rect->r1 == q.rows) &&
                         (rect->c1 % q.block_cols == 0 || rect->c1 == q.cols);
    if (!aligned) {
      return Invalid(
          engine, p.name,
          absl::StrCat(seg,
                       " (a tensor-parallel shard or fused part) writes "
                       "rows [",
                       rect->r0, ", ", rect->r1, ") x cols [", rect->c0, ", ",
                       rect->c1, "), which cuts a ", q.block_rows, " x ",
                       q.block_cols,
                       " block: a block is quantised whole, so shard "
                       "boundaries must lie on multiples of the block size "
                       "(or the parameter's edges)"));
    }
  }
  return absl::OkStatus();
}

bool IsGpuMemory(v1::MemoryKind kind) {
  return kind == v1::MEMORY_CUDA_IPC || kind == v1::MEMORY_CUDA_VMM;
}

// The parameter and its scales are written together, by one data plane:
// the host backend's (host shared memory) or a GPU backend's worker (GPU
// memory), so both must be the one kind or the other.
absl::Status CheckMemory(const std::string& engine,
                         const v1::RegisterEngineRequest& request,
                         const ParameterLayout& p,
                         const ParameterLayout& scale) {
  const v1::MemoryKind kind = request.allocations(p.region).kind();
  const v1::MemoryKind scale_kind = request.allocations(scale.region).kind();
  const bool host =
      kind == v1::MEMORY_HOST_SHM && scale_kind == v1::MEMORY_HOST_SHM;
  if (host || (IsGpuMemory(kind) && IsGpuMemory(scale_kind))) {
    return absl::OkStatus();
  }
  return Invalid(
      engine, p.name,
      absl::StrCat("an FP8 target (", DTypeName(p.dtype), ") in ",
                   v1::MemoryKind_Name(kind),
                   " memory with its scale "
                   "parameter '",
                   scale.name, "' in ", v1::MemoryKind_Name(scale_kind),
                   " memory: the FP8 elements and their scales are written "
                   "together, so both must be host shared memory (host "
                   "backend) or both GPU memory (GPU backends)"));
}

// Checks parameter `i` (quantised) of `layout` and records its QuantLayout.
absl::Status CheckOne(const v1::RegisterEngineRequest& request, int i,
                      int32_t scale_index, const RegistrationLimits& limits,
                      EngineLayout& layout) {
  const std::string& engine = layout.engine_id;
  ParameterLayout& p = layout.parameters[i];
  const ParameterLayout& scale = layout.parameters[scale_index];
  const v1::Quantization& decl = request.parameters(i).quantization();
  if (p.dtype != decl.format()) {
    return Invalid(engine, p.name,
                   absl::StrCat("dtype ", DTypeName(p.dtype),
                                " differs from its quantization.format ",
                                DTypeName(decl.format())));
  }
  if (p.shape.size() < 2 || p.numel == 0) {
    return Invalid(engine, p.name,
                   absl::StrCat("an FP8 target must be a non-empty weight "
                                "of 2 or more dimensions; its shape is ",
                                ShapeString(p.shape)));
  }
  const bool per_row = decl.scheme() == v1::QUANT_SCHEME_PER_ROW;
  QuantLayout q;
  q.format = decl.format();
  q.scale_parameter = scale_index;
  // A stacked weight [..., n, k] (experts) is quantised as the matrix of
  // its rows, [prod(...) * n, k]: the same blocks as each [n, k] matrix's
  // where n is whole blocks (checked below).
  q.cols = p.shape.back();
  q.rows = p.numel / q.cols;
  q.block_rows = per_row ? 1 : (decl.block_rows() ? decl.block_rows() : 128);
  q.block_cols =
      per_row ? q.cols : (decl.block_cols() ? decl.block_cols() : 128);
  q.grid_cols = (q.cols + q.block_cols - 1) / q.block_cols;
  q.reciprocal = decl.scale_form() == v1::SCALE_FORM_RECIPROCAL;
  const int64_t n = p.shape[p.shape.size() - 2];
  if (p.shape.size() > 2 && n % q.block_rows != 0) {
    return Invalid(engine, p.name,
                   absl::StrCat("a stacked FP8 target ", ShapeString(p.shape),
                                " needs the rows of each matrix (", n,
                                ") in whole blocks of ", q.block_rows,
                                " rows: a block may not span two of them"));
  }
  if (scale.dtype != v1::FLOAT32 ||
      !ScaleShapeFits(q, per_row, p.shape, scale.shape)) {
    const int64_t grid_rows = (q.rows + q.block_rows - 1) / q.block_rows;
    return Invalid(
        engine, p.name,
        absl::StrCat(
            "its scale parameter '", scale.name, "' is ",
            DTypeName(scale.dtype), " ", ShapeString(scale.shape), "; a ",
            q.rows, " x ", q.cols, " weight in ",
            per_row
                ? "rows"
                : absl::StrCat(q.block_rows, " x ", q.block_cols, " blocks"),
            " needs float32 ",
            per_row ? absl::StrCat("[", q.rows, "] or [", q.rows, ", 1]")
                    : absl::StrCat("[", grid_rows, ", ", q.grid_cols, "]"),
            p.shape.size() > 2 ? " (or the same per stacked matrix)" : ""));
  }
  // A row of blocks as float32; rows <= 2^62 and cols <= 2^62 / rows.
  const int64_t band_rows = std::min(q.rows, q.block_rows);
  if (q.cols > limits.max_quant_band_bytes / 4 / band_rows) {
    return Invalid(
        engine, p.name,
        absl::StrCat("a row of its blocks (", band_rows, " x ", q.cols,
                     " float32) exceeds the ", limits.max_quant_band_bytes,
                     " bytes the daemon holds per row of blocks"));
  }
  WS_RETURN_IF_ERROR(CheckSegmentsAligned(engine, p, q));
  WS_RETURN_IF_ERROR(CheckMemory(engine, request, p, scale));
  p.quant = q;
  return absl::OkStatus();
}

}  // namespace

ScaleBlocks ScaleBlocksOf(const QuantLayout& q, const SegmentLayout& s) {
  const QuantRect r = *SegmentRect(q.cols, s);
  ScaleBlocks b;
  b.i0 = r.r0 / q.block_rows;
  b.i1 = (r.r1 + q.block_rows - 1) / q.block_rows;
  b.j0 = r.c0 / q.block_cols;
  b.j1 = (r.c1 + q.block_cols - 1) / q.block_cols;
  b.first = b.i0 * q.grid_cols + b.j0;
  return b;
}

std::optional<QuantRect> SegmentRect(int64_t cols, const SegmentLayout& s) {
  const int64_t r0 = s.dest_offset / cols, c0 = s.dest_offset % cols;
  if (s.dest_row_stride == cols && s.col_count <= cols - c0) {
    return QuantRect{r0, r0 + s.row_count, c0, c0 + s.col_count};
  }
  if (s.row_count != 1 && s.dest_row_stride != s.col_count) {
    return std::nullopt;
  }
  // One contiguous run (registration bounded it by the parameter's size).
  const int64_t n = s.row_count * s.col_count;
  if (n <= cols - c0) return QuantRect{r0, r0 + 1, c0, c0 + n};
  if (c0 == 0 && n % cols == 0) return QuantRect{r0, r0 + n / cols, 0, cols};
  return std::nullopt;
}

absl::StatusOr<QuantRoles> ResolveQuantRoles(
    const v1::RegisterEngineRequest& request) {
  QuantRoles roles;
  // Quantised parameters are messages; their scale parameters may also be
  // rows of the parameter table, which follow the messages.
  const int messages = request.parameters_size();
  const v1::ParameterTable& table = request.parameter_table();
  const int n = messages + table.names_size();
  bool any = false;
  for (const v1::Parameter& p : request.parameters()) {
    any = any || p.has_quantization();
  }
  if (!any) return roles;
  const std::string& engine = request.engine_id();
  absl::flat_hash_map<absl::string_view, int> index;
  index.reserve(n);
  for (int i = 0; i < messages; ++i) {
    index.emplace(request.parameters(i).name(), i);
  }
  for (int r = 0; r < table.names_size(); ++r) {
    index.emplace(table.names(r), messages + r);
  }
  roles.scale_of.assign(n, -1);
  roles.is_scale.assign(n, false);
  std::vector<int> owner(n, -1);
  for (int i = 0; i < messages; ++i) {
    const v1::Parameter& p = request.parameters(i);
    if (!p.has_quantization()) continue;
    WS_RETURN_IF_ERROR(CheckDeclaration(engine, p));
    const std::string& name = p.quantization().scale_parameter();
    auto it = index.find(name);
    if (it == index.end() || it->second == i) {
      return Invalid(
          engine, p.name(),
          absl::StrCat("its scale parameter '", Echo(name), "' ",
                       it == index.end() ? "is not a parameter of this "
                                           "registration"
                                         : "is the parameter itself"));
    }
    const int j = it->second;
    if (j < messages && request.parameters(j).has_quantization()) {
      return Invalid(engine, p.name(),
                     absl::StrCat("its scale parameter '", Echo(name),
                                  "' is itself quantised"));
    }
    if (owner[j] >= 0) {
      return Invalid(
          engine, p.name(),
          absl::StrCat("its scale parameter '", Echo(name),
                       "' already holds the scales of '",
                       Echo(request.parameters(owner[j]).name()), "'"));
    }
    owner[j] = i;
    roles.scale_of[i] = j;
    roles.is_scale[j] = true;
  }
  return roles;
}

absl::Status CheckQuantization(const v1::RegisterEngineRequest& request,
                               const QuantRoles& roles,
                               const RegistrationLimits& limits,
                               EngineLayout& layout) {
  for (size_t i = 0; i < roles.scale_of.size(); ++i) {
    if (roles.scale_of[i] < 0) continue;
    WS_RETURN_IF_ERROR(CheckOne(request, static_cast<int>(i), roles.scale_of[i],
                                limits, layout));
  }
  return absl::OkStatus();
}

}  // namespace weightsync
