// Early-return helpers for absl::Status / absl::StatusOr.
#ifndef WEIGHTSYNC_COMMON_STATUS_MACROS_H_
#define WEIGHTSYNC_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define WS_RETURN_IF_ERROR(expr)              \
  do {                                        \
    const ::absl::Status _ws_status = (expr); \
    if (!_ws_status.ok()) return _ws_status;  \
  } while (0)

#define WS_CONCAT_INNER(a, b) a##b
#define WS_CONCAT(a, b) WS_CONCAT_INNER(a, b)

#define WS_ASSIGN_OR_RETURN(lhs, expr) \
  WS_ASSIGN_OR_RETURN_IMPL(WS_CONCAT(_ws_statusor_, __LINE__), lhs, expr)

#define WS_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()

#endif  // WEIGHTSYNC_COMMON_STATUS_MACROS_H_
