// Event lines (docs/operations.md, "Logs"): each line the daemon logs about
// a transfer group, an update or an engine starts with key=value fields,
//
//   event=update.committed update=u7 version=7 engine=e0,e1: in 0.41 s ...
//
// so that `grep update=u7` tells one update's story and tools can parse the
// log. Values are ids and numbers only: never tokens, NCCL ids or handles.
#ifndef WEIGHTSYNC_DAEMON_CORE_EVENT_LOG_H_
#define WEIGHTSYNC_DAEMON_CORE_EVENT_LOG_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace weightsync {

// "event=<event>[ update=<update>][ version=<version>][ engine=<engine>]: "
// (empty ids and negative versions are left out).
inline std::string Event(absl::string_view event, absl::string_view update = "",
                         int64_t version = -1, absl::string_view engine = "") {
  std::string s = absl::StrCat("event=", event);
  if (!update.empty()) absl::StrAppend(&s, " update=", update);
  if (version >= 0) absl::StrAppend(&s, " version=", version);
  if (!engine.empty()) absl::StrAppend(&s, " engine=", engine);
  absl::StrAppend(&s, ": ");
  return s;
}

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_EVENT_LOG_H_
