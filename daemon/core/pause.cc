// Coordinator: pausing and resuming engines. Pause and Resume are the
// trainer's calls; PauseAll (all or nothing) and ResumeEngines are the
// broadcasts that an update's start and end and the idle watchdog use;
// SetPaused keeps the record and its paused time. The locking rules are
// coordinator.h's.
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "daemon/core/coordinator.h"
#include "daemon/core/event_log.h"
#include "glog/logging.h"

namespace weightsync {
namespace {

// The first failure of a broadcast, or OK.
absl::Status FirstError(const std::map<std::string, absl::Status>& results) {
  for (const auto& [engine, status] : results) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

v1::DaemonMessage PauseNotice(v1::PauseMode mode) {
  v1::DaemonMessage m;
  m.mutable_pause()->set_mode(
      mode == v1::PAUSE_MODE_UNSPECIFIED ? v1::PAUSE_MODE_KEEP : mode);
  return m;
}

}  // namespace

absl::Status Coordinator::ResumeEngines(const std::vector<std::string>& engines,
                                        absl::Time deadline) {
  if (engines.empty()) return absl::OkStatus();
  const auto acks = hub_.Broadcast(engines, ResumeNotice(), deadline);
  absl::MutexLock lock(&mu_);
  for (const auto& [id, s] : acks) {
    auto it = engines_.find(id);
    if (s.ok() && it != engines_.end()) {
      SetPaused(it->second, false);
      it->second.paused_by_update = false;
    }
    if (s.ok()) VLOG(1) << Event("engine.resumed", "", -1, id);
    if (!s.ok()) LOG(WARNING) << Event("engine.resume_failed", "", -1, id) << s;
  }
  return FirstError(acks);
}

absl::StatusOr<std::vector<std::string>> Coordinator::PauseAll(
    const std::vector<std::string>& engines, v1::PauseMode mode,
    absl::Time deadline, absl::string_view why) {
  if (engines.empty()) return std::vector<std::string>();
  const auto acks = hub_.Broadcast(engines, PauseNotice(mode), deadline);
  std::vector<std::string> paused, failed;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, s] : acks) {
      if (s.ok()) {
        paused.push_back(id);
        VLOG(1) << Event("engine.paused", "", -1, id) << why;
      } else if (engines_.contains(id) && hub_.Connected(id)) {
        failed.push_back(id);
      } else {
        // It left while being paused (unregistered, its stream closed, or
        // it reported its memory gone before acknowledging): not a failed
        // pause but an engine the caller no longer has; an update reports
        // it lost (docs/protocol.md, "Pause and resume").
        LOG(WARNING) << Event("engine.left", "", -1, id) << why << ": " << s;
      }
    }
  }
  if (failed.empty()) return paused;
  LOG(WARNING) << Event("engine.pause_failed", "", -1,
                        absl::StrJoin(failed, ","))
               << why << ": " << acks.at(failed.front())
               << "; resuming the others";
  // All or nothing: undo the pauses that did happen.
  hub_.Broadcast(paused, ResumeNotice(), absl::Now() + options_.notice_timeout);
  const absl::Status first = acks.at(failed.front());
  return absl::Status(
      first.code(),
      absl::StrCat(why, ": pause failed for engine(s) ",
                   absl::StrJoin(failed, ", "), ": ", first.message(),
                   "; no engine was left paused"));
}

absl::StatusOr<v1::PauseResponse> Coordinator::Pause(
    const v1::PauseRequest& request) {
  absl::MutexLock control(&control_mu_);
  NoteTrainerCall();
  std::vector<std::string> ids, to_pause;
  {
    absl::MutexLock lock(&mu_);
    WS_ASSIGN_OR_RETURN(ids,
                        SelectReachableEngines(request.engine_ids(), nullptr));
    for (const std::string& id : ids) {
      EngineRecord& r = engines_.at(id);
      if (r.paused) {
        r.paused_by_update = false;  // the trainer owns this pause now
      } else {
        to_pause.push_back(id);
      }
    }
  }
  WS_ASSIGN_OR_RETURN(
      const std::vector<std::string> newly,
      PauseAll(to_pause, request.mode(),
               DeadlineFrom(request.timeout_ms(), options_.notice_timeout),
               "Pause"));
  // An engine that left while being paused may not be unregistered yet
  // (its stream's close reaches the hub first): it is neither paused nor
  // listed.
  std::set<std::string> left(to_pause.begin(), to_pause.end());
  for (const std::string& id : newly) left.erase(id);
  absl::MutexLock lock(&mu_);
  v1::PauseResponse response;
  for (const std::string& id : ids) {
    auto it = engines_.find(id);
    if (it == engines_.end() || left.count(id) > 0) continue;
    SetPaused(it->second, true);
    *response.add_engines() = EngineStatusLocked(id, it->second);
  }
  return response;
}

absl::StatusOr<v1::ResumeResponse> Coordinator::Resume(
    const v1::ResumeRequest& request) {
  absl::MutexLock control(&control_mu_);
  NoteTrainerCall();
  std::vector<std::string> ids, to_resume;
  {
    absl::MutexLock lock(&mu_);
    WS_ASSIGN_OR_RETURN(ids,
                        SelectReachableEngines(request.engine_ids(), nullptr));
    for (const std::string& id : ids) {
      const EngineRecord& r = engines_.at(id);
      if (r.updating) {
        return absl::FailedPreconditionError(
            absl::StrCat("engine '", id, "' is receiving update '", update_->id,
                         "'; finish or abort it before Resume"));
      }
      if (r.dirty && !request.allow_dirty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("engine '", id,
                         "' is dirty (an update failed half way); resume "
                         "with allow_dirty or send a full update first"));
      }
      if (r.paused) to_resume.push_back(id);
    }
  }
  WS_RETURN_IF_ERROR(ResumeEngines(
      to_resume, DeadlineFrom(request.timeout_ms(), options_.notice_timeout)));
  absl::MutexLock lock(&mu_);
  v1::ResumeResponse response;
  for (const std::string& id : ids) {
    auto it = engines_.find(id);
    if (it != engines_.end()) {
      *response.add_engines() = EngineStatusLocked(id, it->second);
    }
  }
  return response;
}

void Coordinator::SetPaused(EngineRecord& r, bool paused) {
  if (paused && !r.paused) r.paused_since = absl::Now();
  if (!paused && r.paused && r.paused_since != absl::InfiniteFuture()) {
    r.paused_total += absl::Now() - r.paused_since;
    r.paused_since = absl::InfiniteFuture();
  }
  r.paused = paused;
}

}  // namespace weightsync
