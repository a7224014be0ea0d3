// Coordinator: the trainer's liveness (issue 36; docs/protocol.md, "Trainer
// liveness"). The trainer that formed the group holds it through a stream
// (TrainerService.Liveness) for as long as it lives. When a hold of the
// current group ends, its trainer is gone: the update in progress is failed
// at once (a Finish or Prepare waiting on its bytes is woken through
// DataPlane::Cancel) and ended as any failed update is, and the engines the
// trainer paused are resumed. Without this, nothing told the NCCL backend
// that its trainer died: the update lasted until --update_idle_timeout_ms.
// TakeOver is a restarted trainer's explicit takeover of an update
// nobody holds. The locking rules are coordinator.h's.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/echo.h"
#include "daemon/core/coordinator.h"
#include "daemon/core/event_log.h"
#include "glog/logging.h"

namespace weightsync {

absl::StatusOr<int64_t> Coordinator::HoldGroup(const std::string& group_id) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("daemon is shutting down");
  // An empty id holds the pauses of a trainer that has formed no group.
  if (!group_id.empty() && group_id != group_id_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Liveness: group '", Echo(group_id), "' is not the transfer group ",
        group_id_.empty() ? "(none is formed)"
                          : absl::StrCat("formed now ('", group_id_, "')"),
        ": call InitWeightTransfer and hold the group it returns"));
  }
  if (holds_.size() >= kMaxHolds) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Liveness: ", kMaxHolds, " streams are open already"));
  }
  const int64_t hold = next_hold_++;
  holds_[hold] = group_id;
  VLOG(1) << "trainer holds "
          << (group_id.empty() ? "its pauses (no group)"
                               : absl::StrCat("group ", group_id))
          << " (hold " << hold << ")";
  return hold;
}

bool Coordinator::GroupHeldLocked() const {
  for (const auto& [hold, group] : holds_) {
    if (!group.empty() && group == group_id_) return true;
  }
  return false;
}

void Coordinator::ReleaseGroup(int64_t hold, absl::string_view why,
                               bool trainer_gone) {
  const absl::Time gone_at = absl::Now();
  std::string group;
  std::shared_ptr<DataPlane> plane;
  {
    absl::MutexLock lock(&mu_);
    auto it = holds_.find(hold);
    if (it == holds_.end()) return;
    group = it->second;
    holds_.erase(it);
    if (shut_down_ || !trainer_gone) return;
    if (group.empty()) {
      // A pause hold: its trainer paused engines without a group. Gone,
      // and no other trainer holding anything: its pauses end now, not at
      // the idle deadline. (A trainer that forms a group opens that hold
      // before it lets this one go.)
      if (!holds_.empty()) return;
      LOG(WARNING) << Event("trainer.gone", "")
                   << "the trainer holding its pauses (no group) is gone: "
                   << why;
    } else {
      // A hold of an earlier group (the trainer formed a new one) ends
      // nothing.
      if (group != group_id_) return;
      LOG(WARNING) << Event("trainer.gone", update_ ? update_->id : "")
                   << "the trainer holding group " << group
                   << " is gone: " << why
                   << (update_ ? "; ending its update" : "");
      if (update_ != nullptr && update_->phase == Phase::kReceiving) {
        FailUpdateLocked(absl::AbortedError(
            absl::StrCat("the trainer of update '", update_->id,
                         "' is gone (its Liveness stream ended: ", why,
                         "); the update failed, start it again")));
        plane = update_->data_plane;
      }
    }
  }
  if (group.empty()) {
    absl::MutexLock control(&control_mu_);
    ResumeTrainerPauses(why);
    return;
  }
  // A Finish or Prepare in progress holds control_mu_ while it waits for
  // bytes that will never come: wake it (it then ends the update itself).
  if (plane != nullptr) plane->Cancel();
  absl::MutexLock control(&control_mu_);
  std::string id;
  bool prepared = false;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_ || group != group_id_) return;
    // The update of the trainer that left: begun before it left, in this
    // group (a new trainer forms a new group first).
    if (update_ != nullptr && update_->started <= gone_at) {
      id = update_->id;
      prepared = update_->phase == Phase::kPrepared;
    }
  }
  if (!id.empty()) {
    EndFailedUpdate(absl::AbortedError(absl::StrCat(
        "the trainer of update '", id,
        "' is gone (its Liveness stream ended: ", why, ")",
        prepared ? "; prepared, never committed: its engines stay paused "
                   "and DIRTY"
                 : "")));
  }
  ResumeTrainerPauses(why);
}

void Coordinator::ResumeTrainerPauses(absl::string_view why) {
  std::vector<std::string> paused;
  {
    absl::MutexLock lock(&mu_);
    if (update_ != nullptr) return;
    for (auto& [eid, r] : engines_) {
      // As ResumeOrphanedPauses: a dirty engine stays paused until an
      // update cleans it.
      if (r.paused && !r.paused_by_update && !r.dirty) paused.push_back(eid);
    }
  }
  if (paused.empty()) return;
  LOG(WARNING) << Event("engine.pause_expired", "", -1,
                        absl::StrJoin(paused, ","))
               << "paused by a trainer that is gone (" << why
               << "); resuming them";
  ResumeEngines(paused, absl::Now() + options_.notice_timeout).IgnoreError();
}

absl::Status Coordinator::TakeOver(const std::string& update_id,
                                   absl::string_view by) {
  if (update_id.empty()) return absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr || update_->id != update_id) {
      return absl::OkStatus();  // ended already: nothing to take over
    }
    if (GroupHeldLocked()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "update '", Echo(update_id),
          "' belongs to a live trainer (it holds group ", group_id_,
          " through its Liveness stream): it is not taken over; that trainer "
          "finishes or aborts it"));
    }
  }
  LOG(WARNING) << Event("update.taken_over", update_id) << by
               << " takes over an update whose trainer holds no Liveness "
                  "stream; ending it";
  EndFailedUpdate(absl::AbortedError(
      absl::StrCat("update '", Echo(update_id), "' was taken over by ", by,
                   " (its trainer held no Liveness stream)")));
  return absl::OkStatus();
}

}  // namespace weightsync
