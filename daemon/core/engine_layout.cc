#include "daemon/core/engine_layout.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "common/echo.h"
#include "common/status_macros.h"
#include "daemon/core/parameter_table.h"
#include "daemon/core/quant_layout.h"
#include "glog/logging.h"

namespace weightsync {
namespace {

absl::Status Invalid(const std::string& engine, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("engine '", engine, "': ", what));
}

bool ValidEngineId(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.' ||
           c == ':';
  });
}

// A segment's destination: `rows` runs of `cols` elements, `stride` apart
// from `begin` (one run when contiguous).
struct Runs {
  int64_t begin, rows, cols, stride;
  int32_t segment;
};

// OK if no two runs of `segments` share an element. A k-way merge of the
// segments' runs in address order: memory stays O(segments) however many
// rows a registration claims (they are only counted against the rows
// budget), so a small request can't make the daemon allocate per row.
absl::Status CheckDisjoint(const std::string& engine, const std::string& where,
                           const std::vector<Runs>& segments) {
  // (run begin, segment index, run number), smallest begin first.
  using Next = std::tuple<int64_t, size_t, int64_t>;
  std::priority_queue<Next, std::vector<Next>, std::greater<Next>> heap;
  for (size_t k = 0; k < segments.size(); ++k) {
    heap.emplace(segments[k].begin, k, 0);
  }
  int64_t end = 0;
  int32_t last = -1;
  while (!heap.empty()) {
    const auto [begin, k, r] = heap.top();
    heap.pop();
    const Runs& s = segments[k];
    if (last >= 0 && begin < end) {
      return Invalid(
          engine, absl::StrCat(where, ": segments ", last, " and ", s.segment,
                               " write the same elements (at ", begin, ")"));
    }
    end = begin + s.cols;
    last = s.segment;
    if (r + 1 < s.rows) heap.emplace(begin + s.stride, k, r + 1);
  }
  return absl::OkStatus();
}

// Segment `s` of parameter `p` (named `seg` in errors) as a SegmentLayout:
// a valid block, inside its source shape if one is given, that ends inside
// the parameter.
absl::Status SegmentFromProto(const std::string& engine, const std::string& seg,
                              const ParameterLayout& p, const v1::Segment& s,
                              SegmentLayout& l) {
  l.source = s.source();
  l.source_shape.assign(s.source_shape().begin(), s.source_shape().end());
  l.row_begin = s.row_begin();
  l.row_count = s.row_count();
  l.col_begin = s.col_begin();
  l.col_count = s.col_count();
  l.dest_offset = s.dest_offset();
  l.dest_row_stride =
      s.dest_row_stride() == 0 ? s.col_count() : s.dest_row_stride();
  if (l.row_begin < 0 || l.row_count <= 0 || l.col_begin < 0 ||
      l.col_count <= 0 || l.dest_offset < 0 ||
      l.dest_row_stride < l.col_count) {
    return Invalid(
        engine,
        absl::StrCat(seg, ": rows [", l.row_begin, "+", l.row_count, "] cols [",
                     l.col_begin, "+", l.col_count, "] dest ", l.dest_offset,
                     " stride ", l.dest_row_stride, " is not a valid block"));
  }
  if (!l.source_shape.empty()) {
    WS_RETURN_IF_ERROR(NumElements(l.source_shape, p.dtype,
                                   absl::StrCat("engine '", engine, "': ", seg))
                           .status());
    int64_t rows, cols;
    SourceMatrix(l.source_shape, &rows, &cols);
    // Subtracted, not added: begin + count may not fit in 64 bits
    // (found by tests/fuzz/update_fuzzer).
    if (l.row_begin > rows || l.row_count > rows - l.row_begin ||
        l.col_begin > cols || l.col_count > cols - l.col_begin) {
      return Invalid(engine,
                     absl::StrCat(seg, ": block rows ", l.row_begin, "+",
                                  l.row_count, " cols ", l.col_begin, "+",
                                  l.col_count, " lies outside source shape ",
                                  ShapeString(l.source_shape)));
    }
  }
  // Last element written: dest + (rows-1)*stride + cols, within numel.
  const int64_t kMax = int64_t{1} << 62;
  if (l.row_count > kMax / l.dest_row_stride ||
      l.dest_offset > kMax - l.row_count * l.dest_row_stride ||
      l.dest_offset + (l.row_count - 1) * l.dest_row_stride + l.col_count >
          p.numel) {
    return Invalid(engine, absl::StrCat(seg,
                                        ": destination runs past the "
                                        "parameter's ",
                                        p.numel, " elements"));
  }
  return absl::OkStatus();
}

absl::Status CheckSegments(const std::string& engine, ParameterLayout& p,
                           const v1::Parameter& proto,
                           const RegistrationLimits& limits,
                           int64_t* rows_budget) {
  const std::string where = absl::StrCat("parameter '", p.name, "'");
  if (proto.segments_size() > limits.max_segments_per_parameter) {
    return Invalid(engine, absl::StrCat(where, " has ", proto.segments_size(),
                                        " segments; the limit is ",
                                        limits.max_segments_per_parameter));
  }
  std::vector<Runs> runs;
  runs.reserve(proto.segments_size());
  for (int i = 0; i < proto.segments_size(); ++i) {
    const v1::Segment& s = proto.segments(i);
    const std::string seg =
        absl::StrCat(where, " segment ", i, " (source '", s.source(), "')");
    if (s.source().empty() || s.source().size() > limits.max_name_length) {
      return Invalid(engine, absl::StrCat(seg, ": bad source name"));
    }
    SegmentLayout l;
    WS_RETURN_IF_ERROR(SegmentFromProto(engine, seg, p, s, l));
    if (l.col_count == l.dest_row_stride) {
      runs.push_back({l.dest_offset, 1, l.row_count * l.col_count,
                      l.row_count * l.col_count, i});
    } else {
      // Strided rows are merged one by one: bounded in time, not memory.
      *rows_budget -= l.row_count;
      if (*rows_budget < 0) {
        return Invalid(engine, absl::StrCat(seg,
                                            ": too many strided segment "
                                            "rows to check"));
      }
      runs.push_back(
          {l.dest_offset, l.row_count, l.col_count, l.dest_row_stride, i});
    }
    p.segments.push_back(std::move(l));
  }
  return CheckDisjoint(engine, where, runs);
}

// The request before its parameters: the engine id, the counts, the version
// and the allocations, each named once.
absl::Status CheckRegistration(const v1::RegisterEngineRequest& request,
                               const RegistrationLimits& limits) {
  const std::string& engine = request.engine_id();
  if (!ValidEngineId(engine)) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine_id '", engine.substr(0, 64),
                     "' must be 1-128 characters of [A-Za-z0-9._:-]"));
  }
  WS_RETURN_IF_ERROR(CheckParameterTable(engine, request.parameter_table()));
  const int64_t parameters = RegisteredParameters(request);
  if (parameters == 0) {
    return Invalid(engine, "registers no parameters");
  }
  if (parameters > limits.max_parameters ||
      request.allocations_size() > limits.max_allocations) {
    return Invalid(engine,
                   absl::StrCat("registers ", parameters, " parameters in ",
                                request.allocations_size(),
                                " allocations; over the limit"));
  }
  if (request.version() < 0 || request.version() > kMaxVersion) {
    return Invalid(engine, absl::StrCat("version ", request.version(),
                                        " is outside [0, ", kMaxVersion, "]"));
  }
  absl::flat_hash_map<std::string, int> handles;
  for (int a = 0; a < request.allocations_size(); ++a) {
    const v1::Allocation& alloc = request.allocations(a);
    if (alloc.kind() == v1::MEMORY_KIND_UNSPECIFIED || alloc.handle().empty() ||
        alloc.size() <= 0) {
      return Invalid(engine, absl::StrCat("allocation ", a,
                                          " needs a kind, a handle and a "
                                          "positive size"));
    }
    // Each distinct allocation is opened once: a repeat is a client bug.
    auto [it, fresh] =
        handles.emplace(absl::StrCat(alloc.kind(), ":", alloc.handle()), a);
    if (!fresh) {
      return Invalid(engine, absl::StrCat("allocation ", a,
                                          " repeats allocation ", it->second));
    }
  }
  return absl::OkStatus();
}

// Parameter `row` (its name already checked) as `p`: its size, its bytes
// inside its allocation, and its segments (one implicit segment if it names
// none).
absl::Status ParameterFromRow(const std::string& engine,
                              const v1::RegisterEngineRequest& request,
                              const ParameterRow& row,
                              const RegistrationLimits& limits, bool is_scale,
                              int64_t* rows_budget, ParameterLayout& p) {
  p.name = std::string(row.name);
  p.dtype = row.dtype;
  p.shape.assign(row.dims, row.dims + row.rank);
  {
    // The error context is only formatted for an error (not 100k times).
    static const std::string kNoContext;
    absl::StatusOr<int64_t> numel = NumElements(p.shape, p.dtype, kNoContext);
    if (!numel.ok()) {
      return NumElements(p.shape, p.dtype,
                         absl::StrCat("engine '", engine, "': parameter '",
                                      p.name, "'"))
          .status();
    }
    p.numel = *numel;
  }
  p.bytes = p.numel * ElementSize(p.dtype);
  if (row.allocation < 0 || row.allocation >= request.allocations_size()) {
    return Invalid(engine, absl::StrCat("parameter '", p.name,
                                        "' names allocation ", row.allocation,
                                        " of ", request.allocations_size()));
  }
  p.region = row.allocation;
  p.offset = row.offset;
  const int64_t alloc_size = request.allocations(p.region).size();
  if (p.offset < 0 || p.offset > alloc_size ||
      p.bytes > alloc_size - p.offset) {
    return Invalid(engine, absl::StrCat("parameter '", p.name, "' bytes ",
                                        HalfOpen(p.offset, p.bytes),
                                        " lie outside its allocation of ",
                                        alloc_size, " bytes"));
  }
  const int segments = row.proto != nullptr ? row.proto->segments_size() : 0;
  if (is_scale) {
    // Written with its owner's blocks: no checkpoint tensor feeds it.
    if (segments != 0) {
      return Invalid(engine, absl::StrCat("parameter '", p.name,
                                          "' holds an FP8 target's scales "
                                          "and must be registered without "
                                          "segments"));
    }
    p.is_scale = true;
  } else if (segments == 0) {
    p.implicit = true;
    SegmentLayout s;
    s.source = p.name;
    SourceMatrix(p.shape, &s.row_count, &s.col_count);
    // A whole tensor is one contiguous run: view it as a single row.
    s.col_count *= s.row_count;
    s.row_count = 1;
    s.dest_row_stride = s.col_count;
    if (p.numel > 0) p.segments.push_back(std::move(s));
  } else {
    WS_RETURN_IF_ERROR(
        CheckSegments(engine, p, *row.proto, limits, rows_budget));
  }
  p.salt = ParameterSalt(p.name);
  return absl::OkStatus();
}

// Per allocation: [begin, end) byte ranges with the parameter index.
using ByteRanges =
    std::vector<std::vector<std::pair<std::pair<int64_t, int64_t>, int>>>;

// OK if no two parameters share a byte of an allocation.
absl::Status CheckNoOverlap(const std::string& engine, ByteRanges& ranges,
                            const std::vector<ParameterLayout>& parameters) {
  for (auto& r : ranges) {
    std::sort(r.begin(), r.end());
    for (size_t i = 1; i < r.size(); ++i) {
      if (r[i].first.first < r[i - 1].first.second) {
        return Invalid(
            engine,
            absl::StrCat("parameters '", parameters[r[i - 1].second].name,
                         "' and '", parameters[r[i].second].name,
                         "' overlap in allocation ",
                         parameters[r[i].second].region));
      }
    }
  }
  return absl::OkStatus();
}

// Opens the request's allocations into `layout` (regions, device uuids).
absl::Status OpenRegions(const v1::RegisterEngineRequest& request,
                         MemoryMapper& mapper, EngineLayout& layout) {
  for (int a = 0; a < request.allocations_size(); ++a) {
    const v1::Allocation& alloc = request.allocations(a);
    absl::StatusOr<std::shared_ptr<MappedRegion>> region = mapper.Open(alloc);
    if (!region.ok()) {
      return absl::Status(
          region.status().code(),
          absl::StrCat("engine '", request.engine_id(), "': allocation ", a,
                       ": ", region.status().message()));
    }
    layout.regions.push_back(*std::move(region));
    const std::string& uuid = alloc.device_uuid();
    if (std::find(layout.device_uuids.begin(), layout.device_uuids.end(),
                  uuid) == layout.device_uuids.end()) {
      layout.device_uuids.push_back(uuid);
    }
  }
  return absl::OkStatus();
}

}  // namespace

void SourceMatrix(const std::vector<int64_t>& shape, int64_t* rows,
                  int64_t* cols) {
  if (shape.empty()) {
    *rows = 1;
    *cols = 1;
    return;
  }
  *rows = shape[0];
  *cols = 1;
  for (size_t i = 1; i < shape.size(); ++i) *cols *= shape[i];
}

absl::StatusOr<std::shared_ptr<const EngineLayout>> BuildEngineLayout(
    const v1::RegisterEngineRequest& request, MemoryMapper& mapper,
    const RegistrationLimits& limits) {
  const absl::Time t0 = absl::Now();
  WS_RETURN_IF_ERROR(CheckRegistration(request, limits));
  const std::string& engine = request.engine_id();
  // FP8 targets and their scale parameters, by name, before the layout.
  WS_ASSIGN_OR_RETURN(const QuantRoles roles, ResolveQuantRoles(request));
  auto layout = std::make_shared<EngineLayout>();
  layout->engine_id = engine;
  // Sized once: 100k-parameter (mixture-of-experts) registrations spent a
  // fifth of their time rehashing and reallocating. Names are views of the
  // request, which outlives this function.
  const int num_parameters = static_cast<int>(RegisteredParameters(request));
  layout->parameters.reserve(num_parameters);
  layout->uses_by_source.reserve(num_parameters);
  absl::flat_hash_set<absl::string_view> names;
  names.reserve(num_parameters);
  int64_t rows_budget = limits.max_segment_rows;
  ByteRanges ranges(request.allocations_size());
  if (request.allocations_size() == 1) ranges[0].reserve(num_parameters);
  // The Parameter messages, then the table's rows (parameter_table.h).
  const int num_messages = request.parameters_size();
  const v1::ParameterTable& table = request.parameter_table();
  int64_t dim_begin = 0;
  for (int i = 0; i < num_parameters; ++i) {
    ParameterRow row;
    if (i < num_messages) {
      row = RowOf(request.parameters(i));
    } else {
      row = RowOf(table, i - num_messages, dim_begin);
      dim_begin += row.rank;
    }
    if (row.name.empty() ||
        static_cast<int64_t>(row.name.size()) > limits.max_name_length) {
      return Invalid(engine, absl::StrCat("parameter #", i,
                                          " has an empty or overlong name"));
    }
    if (!names.insert(row.name).second) {
      return Invalid(engine, absl::StrCat("parameter '", row.name,
                                          "' is registered twice"));
    }
    ParameterLayout p;
    WS_RETURN_IF_ERROR(ParameterFromRow(
        engine, request, row, limits,
        !roles.is_scale.empty() && roles.is_scale[i], &rows_budget, p));
    if (p.bytes > 0) {
      ranges[p.region].push_back({{p.offset, p.offset + p.bytes}, i});
    }
    if (p.implicit && p.numel == 0) layout->empty_parameters[p.name] = i;
    layout->total_bytes += p.bytes;
    layout->parameters.push_back(std::move(p));
  }
  // Indexed once every parameter has its place: the keys are views of
  // the segments' source strings, which must not move afterwards.
  for (int i = 0; i < num_parameters; ++i) {
    const std::vector<SegmentLayout>& segments = layout->parameters[i].segments;
    for (int s = 0; s < static_cast<int>(segments.size()); ++s) {
      layout->uses_by_source[segments[s].source].push_back({i, s});
    }
  }
  WS_RETURN_IF_ERROR(CheckNoOverlap(engine, ranges, layout->parameters));
  if (!roles.scale_of.empty()) {
    WS_RETURN_IF_ERROR(CheckQuantization(request, roles, limits, *layout));
  }
  // Everything checks out: only now open the memory.
  const absl::Time t1 = absl::Now();
  WS_RETURN_IF_ERROR(OpenRegions(request, mapper, *layout));
  VLOG(1) << "engine '" << engine << "': " << num_parameters
          << " parameters laid out and checked in "
          << absl::ToDoubleMilliseconds(t1 - t0) << " ms, "
          << request.allocations_size() << " allocations opened in "
          << absl::ToDoubleMilliseconds(absl::Now() - t1) << " ms";
  return std::shared_ptr<const EngineLayout>(std::move(layout));
}

bool AnyRegionFaulted(const EngineLayout& layout) {
  for (const auto& region : layout.regions) {
    if (region->faulted()) return true;
  }
  return false;
}

}  // namespace weightsync
