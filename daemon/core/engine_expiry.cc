// Coordinator: engines without a control stream (issue 30). No notice can
// reach such an engine, so it can't be paused, told a version or resumed:
// an update of every engine leaves it out and reports it, an update or
// pause that names it is refused at once (FAILED_PRECONDITION: retrying
// can't help until the engine starts), and after engine_start_grace it is
// unregistered (ExpireStreamlessEngines, from the watchdog thread). An
// engine whose stream closes is unregistered at once (DetachControl); so a
// registered engine without a stream never had one. The locking rules are
// coordinator.h's.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "daemon/core/coordinator.h"
#include "daemon/core/event_log.h"
#include "glog/logging.h"

namespace weightsync {

std::string Coordinator::StreamlessWhy(const std::string& id,
                                       const EngineRecord& r) const {
  std::string expiry =
      options_.engine_start_grace > absl::ZeroDuration()
          ? absl::StrCat("; it is unregistered ",
                         absl::FormatDuration(options_.engine_start_grace),
                         " after registering without one "
                         "(--engine_start_grace_ms)")
          : "";
  return absl::StrCat(
      "engine '", id, "' is registered but has no open control stream (",
      absl::FormatDuration(
          absl::Trunc(absl::Now() - r.registered_at, absl::Milliseconds(1))),
      " since it registered: its process never called start(), or hangs "
      "before it); start it (Python: Engine.start()) or unregister it "
      "(Engine.unregister() / close())",
      expiry);
}

absl::StatusOr<std::vector<std::string>> Coordinator::SelectReachableEngines(
    const google::protobuf::RepeatedPtrField<std::string>& ids,
    std::vector<std::pair<std::string, std::string>>* left_out) {
  WS_ASSIGN_OR_RETURN(std::vector<std::string> selected, SelectEngines(ids));
  std::vector<std::string> out;
  std::vector<std::pair<std::string, std::string>> without;
  for (const std::string& id : selected) {
    if (hub_.Connected(id)) {
      out.push_back(id);
    } else if (!ids.empty()) {
      return absl::FailedPreconditionError(StreamlessWhy(id, engines_.at(id)));
    } else {
      without.emplace_back(id, StreamlessWhy(id, engines_.at(id)));
    }
  }
  if (out.empty()) {
    return absl::FailedPreconditionError(
        without.size() == 1
            ? without[0].second
            : absl::StrCat("no registered engine has an open control stream; ",
                           without[0].second, " (and ", without.size() - 1,
                           " more)"));
  }
  if (left_out != nullptr) {
    for (auto& w : without) left_out->push_back(std::move(w));
  }
  return out;
}

void Coordinator::ExpireStreamlessEngines() {
  if (options_.engine_start_grace <= absl::ZeroDuration()) return;
  std::vector<std::string> expired;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    const absl::Time now = absl::Now();
    for (const auto& [id, r] : engines_) {
      if (now - r.registered_at >= options_.engine_start_grace &&
          !hub_.Connected(id)) {
        expired.push_back(id);
      }
    }
    for (const std::string& id : expired) {
      LOG(WARNING) << Event("engine.expired", "", engines_.at(id).version, id)
                   << "registered " << options_.engine_start_grace
                   << " ago and never opened its control stream; "
                      "unregistering it (--engine_start_grace_ms)";
      RemoveEngineLocked(
          id, absl::StrCat("expired: no control stream within ",
                           absl::FormatDuration(options_.engine_start_grace),
                           " of registering"));
    }
  }
  if (expired_listener_) {
    for (const std::string& id : expired) expired_listener_(id);
  }
}

}  // namespace weightsync
