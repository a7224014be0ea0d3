// RegisterEngineRequest.parameter_table (docs/protocol.md, "Parameter
// table"): parameters without segments or quantization sent as packed
// columns, one row per parameter, after the request's Parameter messages
// in parameter index order. BuildEngineLayout reads the rows in place (no
// Parameter message is made for them); GetStatus serves them back as the
// Parameter messages they stand for. Pure functions.
#ifndef WEIGHTSYNC_DAEMON_CORE_PARAMETER_TABLE_H_
#define WEIGHTSYNC_DAEMON_CORE_PARAMETER_TABLE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "daemon/core/engine_layout.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "weightsync/v1/engine_service.pb.h"

namespace weightsync {

// Parameters a request registers: its Parameter messages and table rows.
int64_t RegisteredParameters(const v1::RegisterEngineRequest& request);

// OK if every column of `table` has one entry per name (INVALID_ARGUMENT
// naming `engine`, the column and both lengths otherwise), no rank is
// negative and the ranks add up to the length of `dims`. The values
// themselves (names, dtypes, shapes, ranges) are checked like those of
// Parameter messages, by BuildEngineLayout.
absl::Status CheckParameterTable(const std::string& engine,
                                 const v1::ParameterTable& table);

// One parameter as registered, from a Parameter message or a table row: a
// view of the request, valid while it lives.
struct ParameterRow {
  absl::string_view name;
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  const int64_t* dims = nullptr;
  int rank = 0;
  int32_t allocation = 0;
  int64_t offset = 0;
  // The message (segments, quantization); nullptr for a table row.
  const v1::Parameter* proto = nullptr;
};

ParameterRow RowOf(const v1::Parameter& proto);

// Row `r` of a table that passed CheckParameterTable, whose shape starts
// at dims(dim_begin) (the ranks of the rows before it, added up).
ParameterRow RowOf(const v1::ParameterTable& table, int r, int64_t dim_begin);

// Appends the parameters [first, end) of `layout`, each registered without
// segments or quantization (table rows), as the Parameter messages that
// register them the same way: name, dtype, shape, allocation, offset.
void AppendParameterMessages(
    const EngineLayout& layout, int first,
    google::protobuf::RepeatedPtrField<v1::Parameter>* out);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_PARAMETER_TABLE_H_
