#include "daemon/core/parameter_table.h"

#include "absl/strings/str_cat.h"

namespace weightsync {
namespace {

absl::Status Invalid(const std::string& engine, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("engine '", engine, "': parameter_table: ", what));
}

}  // namespace

int64_t RegisteredParameters(const v1::RegisterEngineRequest& request) {
  return int64_t{request.parameters_size()} +
         request.parameter_table().names_size();
}

absl::Status CheckParameterTable(const std::string& engine,
                                 const v1::ParameterTable& table) {
  const int rows = table.names_size();
  const std::pair<const char*, int> columns[] = {
      {"dtypes", table.dtypes_size()},
      {"ranks", table.ranks_size()},
      {"allocations", table.allocations_size()},
      {"offsets", table.offsets_size()},
  };
  for (const auto& [column, size] : columns) {
    if (size != rows) {
      return Invalid(engine,
                     absl::StrCat(rows, " names but ", size, " ", column,
                                  ": every column has one "
                                  "entry per parameter"));
    }
  }
  int64_t dims = 0;
  for (int r = 0; r < rows; ++r) {
    const int32_t rank = table.ranks(r);
    if (rank < 0) {
      return Invalid(engine, absl::StrCat("row ", r, " (parameter '",
                                          table.names(r).substr(0, 128),
                                          "') has rank ", rank));
    }
    dims += rank;
  }
  if (dims != table.dims_size()) {
    return Invalid(
        engine, absl::StrCat("the ranks add up to ", dims,
                             " dimensions but dims holds ", table.dims_size()));
  }
  return absl::OkStatus();
}

ParameterRow RowOf(const v1::Parameter& proto) {
  ParameterRow row;
  row.name = proto.name();
  row.dtype = proto.dtype();
  row.dims = proto.shape().data();
  row.rank = proto.shape_size();
  row.allocation = proto.allocation();
  row.offset = proto.offset();
  row.proto = &proto;
  return row;
}

ParameterRow RowOf(const v1::ParameterTable& table, int r, int64_t dim_begin) {
  ParameterRow row;
  row.name = table.names(r);
  row.dtype = static_cast<v1::DType>(table.dtypes(r));
  row.dims = table.dims().data() + dim_begin;
  row.rank = table.ranks(r);
  row.allocation = table.allocations(r);
  row.offset = table.offsets(r);
  return row;
}

void AppendParameterMessages(
    const EngineLayout& layout, int first,
    google::protobuf::RepeatedPtrField<v1::Parameter>* out) {
  const int end = static_cast<int>(layout.parameters.size());
  if (first >= end) return;
  out->Reserve(out->size() + end - first);
  for (int i = first; i < end; ++i) {
    const ParameterLayout& p = layout.parameters[i];
    v1::Parameter* m = out->Add();
    m->set_name(p.name);
    m->set_dtype(p.dtype);
    m->mutable_shape()->Add(p.shape.begin(), p.shape.end());
    m->set_allocation(p.region);
    m->set_offset(p.offset);
  }
}

}  // namespace weightsync
