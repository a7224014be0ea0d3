// Coordinator: the idle watchdog. Its thread (WatchIdle, started by the
// constructor when --update_idle_timeout_ms or --engine_start_grace_ms is
// set) expires engines that never opened their control stream
// (engine_expiry.cc), ends an update that its
// trainer abandoned, or left failed past a short grace (EndIdleUpdate), and
// resumes engines that a trainer gone silent paused and never resumed
// (ResumeOrphanedPauses). EndIfFailed is the same clean-up done at once by
// the next Init or Start. The locking rules are coordinator.h's.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/core/coordinator.h"
#include "daemon/core/event_log.h"
#include "glog/logging.h"

namespace weightsync {

// How long a failed update waits for its trainer's Finish or Abort before
// the daemon ends it (WatchIdle).
constexpr absl::Duration kFailedGrace = absl::Seconds(2);

void Coordinator::EndIfFailed(absl::string_view by) {
  absl::Status why;
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr || update_->phase == Phase::kReceiving) return;
    if (update_->phase == Phase::kFailed) {
      LOG(WARNING) << Event("update.ended", update_->id,
                            update_->target_version)
                   << "failed (" << update_->error << ") and nobody ended it; "
                   << by << " ends it";
      // The engines' dirty notice says what happened to the update (e.g.
      // "trainer disconnected mid-stream after 3 of 8 chunks"), not only
      // who ended it.
      why = absl::AbortedError(absl::StrCat(
          "update '", update_->id, "' failed: ", update_->error.message(), "; ",
          by, " ended it (its trainer did not)"));
    } else {
      // Prepared and never committed: its trainer is gone or gave up. It
      // may have committed other daemons, so the engines stay paused and
      // DIRTY until a dense update repairs them.
      LOG(WARNING) << Event("update.ended", update_->id,
                            update_->target_version)
                   << "prepared and never committed; " << by
                   << " ends it (engines it wrote stay paused, DIRTY)";
      why = absl::AbortedError(absl::StrCat("prepared update '", update_->id,
                                            "' was never committed; ", by,
                                            " superseded it"));
    }
  }
  EndFailedUpdate(why);
}

void Coordinator::WatchIdle() {
  absl::Duration period = absl::Milliseconds(200);
  for (absl::Duration d :
       {options_.update_idle_timeout, options_.engine_start_grace}) {
    if (d > absl::ZeroDuration()) period = std::min(period, d / 4);
  }
  while (WatchSleep(period)) {
    ExpireStreamlessEngines();
    if (options_.update_idle_timeout <= absl::ZeroDuration()) continue;
    if (ResumeOrphanedPauses()) continue;
    EndIdleUpdate();
  }
}

bool Coordinator::WatchSleep(absl::Duration period) {
  absl::MutexLock lock(&watch_mu_);
  auto stop = [this]()
                  ABSL_SHARED_LOCKS_REQUIRED(watch_mu_) { return watch_stop_; };
  return !watch_mu_.AwaitWithTimeout(absl::Condition(&stop), period);
}

bool Coordinator::ResumeOrphanedPauses() {
  std::vector<std::string> orphaned;  // paused by a trainer gone silent
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr && !shut_down_ &&
        absl::Now() - last_trainer_call_ >= options_.update_idle_timeout) {
      for (auto& [eid, r] : engines_) {
        // A dirty engine stays paused until an update cleans it.
        if (r.paused && !r.paused_by_update && !r.dirty) {
          orphaned.push_back(eid);
        }
      }
    }
  }
  if (orphaned.empty()) return false;
  absl::MutexLock control(&control_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (update_ != nullptr ||
        absl::Now() - last_trainer_call_ < options_.update_idle_timeout) {
      return true;
    }
  }
  LOG(WARNING) << Event("engine.pause_expired", "", -1,
                        absl::StrJoin(orphaned, ","))
               << "paused by a trainer that has not called for "
               << options_.update_idle_timeout << "; resuming them";
  ResumeEngines(orphaned, absl::Now() + options_.notice_timeout).IgnoreError();
  return true;
}

void Coordinator::EndIdleUpdate() {
  std::string id;
  absl::Duration idle;
  bool prepared = false;
  std::string failed;  // why, for a failed update
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr || shut_down_) return;
    const absl::Time now = absl::Now();
    // Bytes that arrive by themselves (NCCL, IPC) show up as progress.
    const int64_t written = update_->data_plane->chunks_written();
    if (written != update_->last_written) {
      update_->last_written = written;
      update_->last_activity = now;
    }
    idle = now - update_->last_activity;
    // A failed update can't complete: its trainer gets a short grace to
    // call Finish or Abort (and hear why), then the daemon ends it.
    const bool failed_long =
        update_->phase == Phase::kFailed &&
        now - update_->failed_at >=
            std::min(kFailedGrace, options_.update_idle_timeout);
    if (idle < options_.update_idle_timeout && !failed_long) return;
    id = update_->id;
    prepared = update_->phase == Phase::kPrepared;
    if (update_->phase == Phase::kFailed) {
      failed = std::string(update_->error.message());
    }
  }
  // As Abort does, after a Finish or Abort in progress (they hold
  // control_mu_ and end the update themselves).
  absl::MutexLock control(&control_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr || update_->id != id ||
        (absl::Now() - update_->last_activity < options_.update_idle_timeout &&
         update_->phase != Phase::kFailed)) {
      return;
    }
  }
  LOG(WARNING) << Event("update.abandoned", id)
               << (idle < options_.update_idle_timeout
                       ? "failed, and its trainer did not end it"
                       : absl::StrCat("no word from its trainer for ",
                                      absl::FormatDuration(idle)))
               << "; ending it";
  if (!failed.empty()) {
    EndFailedUpdate(absl::AbortedError(
        absl::StrCat("update '", id, "' failed: ", failed,
                     "; its trainer did not end it, so the daemon did")));
    return;
  }
  EndFailedUpdate(absl::DeadlineExceededError(absl::StrCat(
      "update '", id, "' abandoned: ",
      prepared ? "prepared but not committed, no call from its trainer for "
               : "no chunk, call or progress from its trainer for ",
      absl::FormatDuration(idle), " (--update_idle_timeout_ms)")));
}

}  // namespace weightsync
