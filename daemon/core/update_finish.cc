// Coordinator: how an update ends. FinishWeightUpdate commits it (the
// staged commit first, then the receipts, the versions and the notices);
// AbortWeightUpdate and EndFailedUpdate end it as failed. Start is in
// update_start.cc, the chunks in update_session.cc; the locking rules are
// coordinator.h's.
#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "daemon/core/coordinator.h"
#include "daemon/core/event_log.h"
#include "daemon/core/receipt.h"
#include "glog/logging.h"

namespace weightsync {

std::vector<v1::EngineResult> Coordinator::EndFailedUpdate(
    const absl::Status& reason) {
  std::shared_ptr<DataPlane> plane;
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr) return {};
    FailUpdateLocked(reason);
    plane = update_->data_plane;
  }
  plane->Abort();  // no lock: it waits for the copy in progress
  // Submits fail fast once aborted, so this wait is short and always OK.
  WaitForSubmits(absl::InfiniteFuture()).IgnoreError();
  std::vector<std::string> dirty, resume;
  std::vector<v1::EngineResult> results;
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    id = update_->id;
    for (size_t i = 0; i < update_->engine_ids.size(); ++i) {
      const std::string& e = update_->engine_ids[i];
      v1::EngineResult& result = results.emplace_back();
      result.set_engine_id(e);
      result.set_code(static_cast<int>(absl::StatusCode::kAborted));
      result.set_message(std::string(update_->error.message()));
      auto it = engines_.find(e);
      if (update_->lost[i] || it == engines_.end()) {
        result.set_lost(true);
        continue;
      }
      EngineRecord& r = it->second;
      r.updating = false;
      result.set_version(r.version);
      if (r.dirty) {
        dirty.push_back(e);
        result.set_state(v1::ENGINE_DIRTY);
      } else if (r.paused_by_update) {
        resume.push_back(e);
        result.set_state(v1::ENGINE_READY);
      } else {
        result.set_state(r.paused ? v1::ENGINE_PAUSED : v1::ENGINE_READY);
      }
    }
    RecordUpdateStatusLocked("failed");
    update_.reset();
  }
  const absl::Time deadline = absl::Now() + options_.notice_timeout;
  if (!dirty.empty()) {
    v1::DaemonMessage m;
    m.mutable_dirty()->set_update_id(id);
    m.mutable_dirty()->set_reason(std::string(reason.message()));
    hub_.Broadcast(dirty, m, deadline);
  }
  // Dirty engines stay paused: Resume needs allow_dirty.
  ResumeEngines(resume, deadline).IgnoreError();
  return results;
}

absl::Status Coordinator::CommitStaged(absl::Time deadline) {
  std::vector<std::string> to_pause;
  std::shared_ptr<DataPlane> plane;
  bool device_staged;
  {
    absl::MutexLock lock(&mu_);
    device_staged = update_->device_staged;
    plane = update_->data_plane;
  }
  // Every byte must be in staging before anything is paused: a trainer that
  // died mid-transfer fails here, with the engines untouched.
  if (device_staged) WS_RETURN_IF_ERROR(plane->WaitStaged(deadline));
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < update_->engine_ids.size(); ++i) {
      auto it = engines_.find(update_->engine_ids[i]);
      if (update_->lost[i] || it == engines_.end()) continue;
      if (!it->second.paused) to_pause.push_back(update_->engine_ids[i]);
    }
    plane = update_->data_plane;
  }
  WS_ASSIGN_OR_RETURN(const std::vector<std::string> paused,
                      PauseForCommit(to_pause));
  std::vector<std::string> chunks;
  {
    absl::MutexLock lock(&mu_);
    chunks = StartCommitLocked(paused);
  }
  if (device_staged) {
    {
      absl::MutexLock lock(&mu_);
      update_->committing = true;  // from here a failure leaves engines dirty
    }
    // The copies run on the GPU; Finish's Drain waits for them.
    return plane->CommitStaged(deadline);
  }
  const absl::Time t0 = absl::Now();
  WS_RETURN_IF_ERROR(plane->Begin(update_->plan, update_->request));
  {
    absl::MutexLock lock(&mu_);
    update_->committing = true;  // from here a failure leaves engines dirty
  }
  for (size_t k = 0; k < chunks.size(); ++k) {
    WS_RETURN_IF_ERROR(plane->SubmitChunk(k, std::move(chunks[k]), deadline));
  }
  VLOG(1) << "staged commit: paused at " << update_->paused_at
          << ", chunks handed over in " << absl::Now() - t0;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> Coordinator::PauseForCommit(
    const std::vector<std::string>& to_pause) {
  // The engines generated on the old weights all along; they stop only for
  // the copy from staging into their memory.
  // An engine that refuses fails the update before any byte moves. One
  // that leaves (dies, unregisters) while being paused is no failed pause:
  // PauseAll leaves it out, and it is lost to this update, as in a
  // streaming one, while the others are committed.
  WS_ASSIGN_OR_RETURN(std::vector<std::string> paused,
                      PauseAll(to_pause, v1::PAUSE_MODE_KEEP,
                               absl::Now() + options_.notice_timeout,
                               "could not pause for the commit"));
  absl::MutexLock lock(&mu_);
  MarkLeftWhilePausedLocked(*update_, to_pause, paused, "the commit");
  return paused;
}

void Coordinator::MarkLeftWhilePausedLocked(
    Update& update, const std::vector<std::string>& to_pause,
    const std::vector<std::string>& paused, absl::string_view what) {
  // Its stream's close reaches the pause before its removal does: mark it
  // now, or the update would write it and count it committed.
  for (size_t i = 0; i < update.engine_ids.size(); ++i) {
    const std::string& id = update.engine_ids[i];
    if (update.lost[i] ||
        std::find(to_pause.begin(), to_pause.end(), id) == to_pause.end() ||
        std::find(paused.begin(), paused.end(), id) != paused.end()) {
      continue;
    }
    update.lost[i] = true;
    // Removed already (unregistered, its memory gone): that is why.
    const auto why = removed_why_.find(id);
    update.lost_why[i] =
        why != removed_why_.end() ? why->second : "left while being paused";
    update.data_plane->MarkEngineLost(i);
    LOG(WARNING) << Event("engine.lost", update.id, update.target_version, id)
                 << "left while " << what << " paused it";
  }
}

std::vector<std::string> Coordinator::StartCommitLocked(
    const std::vector<std::string>& paused) {
  update_->paused_at = absl::Now();
  for (const std::string& id : paused) {
    auto it = engines_.find(id);
    if (it == engines_.end()) continue;
    SetPaused(it->second, true);
    it->second.paused_by_update = true;
  }
  for (size_t i = 0; i < update_->engine_ids.size(); ++i) {
    auto it = engines_.find(update_->engine_ids[i]);
    if (!update_->lost[i] && it != engines_.end()) it->second.updating = true;
  }
  return std::move(update_->staged_chunks);
}

absl::StatusOr<v1::FinishWeightUpdateResponse> Coordinator::FinishWeightUpdate(
    const v1::FinishWeightUpdateRequest& request) {
  absl::MutexLock control(&control_mu_);
  NoteTrainerCall();
  const absl::Time deadline =
      DeadlineFrom(request.timeout_ms(), options_.finish_timeout);
  // Prepare and commit in one call: one daemon needs to wait for nobody
  // (update_commit.cc; a prepared update is only committed here).
  WS_ASSIGN_OR_RETURN(const std::shared_ptr<DataPlane> plane,
                      CheckFinish(request.update_id()));
  WS_ASSIGN_OR_RETURN(const absl::Time t_receipts,
                      Prepare(request.update_id(), plane, deadline));
  return CommitPrepared(*plane, t_receipts);
}

absl::StatusOr<std::shared_ptr<DataPlane>> Coordinator::CheckFinish(
    const std::string& update_id) {
  absl::MutexLock lock(&mu_);
  if (update_ == nullptr || update_->id != update_id) {
    return absl::FailedPreconditionError(
        absl::StrCat("no update '", update_id,
                     "' in progress; call "
                     "StartWeightUpdate first"));
  }
  const int64_t total = update_->plan->chunks.chunks.size();
  if (update_->phase == Phase::kReceiving && update_->next_chunk < total &&
      (!update_->bytes_by_plane || update_->ipc_ring_slots > 0)) {
    FailUpdateLocked(absl::AbortedError(
        absl::StrCat("finish after ", update_->next_chunk, " of ", total,
                     " chunks (", update_->received_bytes, " of ",
                     update_->plan->chunks.total_bytes, " bytes)")));
  }
  return update_->data_plane;
}

absl::Status Coordinator::CollectReceipts(
    DataPlane& plane, absl::Time deadline,
    std::vector<absl::StatusOr<v1::Receipt>>* receipts) {
  // Every byte is in engine memory: read back what was installed. Host
  // memory here; GPU memory by the data plane, where a failure fails the
  // update (its receipts were asked for and can't be given).
  std::shared_ptr<const CopyPlan> plan;
  bool verify;
  std::vector<bool> lost;
  {
    absl::MutexLock lock(&mu_);
    plan = update_->plan;
    verify = update_->verify;
    lost = update_->lost;
  }
  if (verify && plane.ReceivesOwnBytes()) {
    absl::StatusOr<std::vector<v1::Receipt>> device =
        plane.DeviceReceipts(*plan, lost, deadline);
    if (!device.ok()) {
      return absl::Status(
          device.status().code(),
          absl::StrCat("receipts: ", device.status().message()));
    }
    for (v1::Receipt& r : *device) receipts->push_back(std::move(r));
  } else if (verify) {
    // From the plan's manifest: no set of names per update (a mixture of
    // experts sends 100k tensors every step).
    for (size_t e = 0; e < plan->engines.size(); ++e) {
      receipts->push_back(
          ComputeReceipt(*plan->engines[e], plan->dense_uses[e]));
    }
  }
  return absl::OkStatus();
}

absl::Status Coordinator::FailFinish(const std::string& update_id,
                                     const absl::Status& status) {
  const std::vector<v1::EngineResult> results = EndFailedUpdate(status);
  std::vector<std::string> dirty;
  for (const auto& r : results) {
    if (r.state() == v1::ENGINE_DIRTY) dirty.push_back(r.engine_id());
  }
  return absl::AbortedError(
      absl::StrCat("update '", update_id, "' failed: ", status.message(),
                   dirty.empty() ? "; engines untouched"
                                 : absl::StrCat("; engines left dirty: ",
                                                absl::StrJoin(dirty, ", "))));
}

// The result of the update's engine i: its id, and where it was lost (it
// disconnected, or its registration is gone) UNAVAILABLE with why. Returns
// its record, or engines_.end() for a lost one.
Coordinator::EngineMap::iterator Coordinator::UpdateEngineResultLocked(
    size_t i, v1::EngineResult* result) {
  const std::string& e = update_->engine_ids[i];
  result->set_engine_id(e);
  auto it = engines_.find(e);
  if (update_->lost[i] || it == engines_.end()) {
    result->set_lost(true);
    result->set_code(static_cast<int>(absl::StatusCode::kUnavailable));
    result->set_message(update_->lost_why[i].empty()
                            ? "engine disconnected during the update"
                            : update_->lost_why[i]);
    return engines_.end();
  }
  return it;
}

Coordinator::Committed Coordinator::CommitVersionsLocked(
    const std::vector<absl::StatusOr<v1::Receipt>>& receipts,
    v1::FinishWeightUpdateResponse& response) {
  Committed c;
  c.id = update_->id;
  c.version = update_->target_version;
  for (size_t i = 0; i < update_->engine_ids.size(); ++i) {
    const std::string& e = update_->engine_ids[i];
    v1::EngineResult* result = response.add_engines();
    auto it = UpdateEngineResultLocked(i, result);
    if (it == engines_.end()) continue;
    EngineRecord& r = it->second;
    r.version = c.version;
    result->set_layout_id(r.layout_id);
    r.updating = false;
    r.dirty = r.dirty && !update_->plan->covers_engine[i];
    result->set_version(c.version);
    result->set_state(r.dirty ? v1::ENGINE_DIRTY : v1::ENGINE_READY);
    if (i < receipts.size() && receipts[i].ok()) {
      *result->mutable_receipt() = *receipts[i];
    }
    c.engines.push_back(e);
    // A dirty engine stays paused: Resume needs allow_dirty.
    if (r.paused_by_update && !r.dirty) c.resume.push_back(e);
  }
  // Engines an update of every engine left out (no control stream): lost
  // to it, as FAILED_PRECONDITION saying why (engine_expiry.cc).
  for (const auto& [e, why] : update_->left_out) {
    v1::EngineResult* result = response.add_engines();
    result->set_engine_id(e);
    result->set_lost(true);
    result->set_code(static_cast<int>(absl::StatusCode::kFailedPrecondition));
    result->set_message(
        absl::StrCat("left out of update '", update_->id, "': ", why));
    if (auto it = engines_.find(e); it != engines_.end()) {
      result->set_version(it->second.version);
    }
  }
  response.set_version(c.version);
  c.paused_at = update_->paused_at;
  response.set_bytes(update_->plan->chunks.total_bytes);
  c.started = update_->started;
  return c;
}

void Coordinator::NotifyCommitted(const Committed& c) {
  v1::DaemonMessage notice;
  notice.mutable_new_version()->set_version(c.version);
  notice.mutable_new_version()->set_update_id(c.id);
  // New version, then (for engines this update paused) resume: one round
  // trip for both.
  std::vector<NoticeHub::Notices> notices;
  for (const std::string& e : c.engines) {
    NoticeHub::Notices& n = notices.emplace_back();
    n.engine = e;
    n.messages.push_back(notice);
    if (std::find(c.resume.begin(), c.resume.end(), e) != c.resume.end()) {
      n.messages.push_back(ResumeNotice());
    }
  }
  const auto acks =
      hub_.Broadcast(notices, absl::Now() + options_.notice_timeout);
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& e : c.resume) {
      auto it = engines_.find(e);
      if (acks.at(e).ok() && it != engines_.end()) {
        SetPaused(it->second, false);
        it->second.paused_by_update = false;
      }
    }
  }
  for (const auto& [e, s] : acks) {
    if (s.ok()) VLOG(1) << Event("engine.new_version", c.id, c.version, e);
    if (!s.ok()) {
      LOG(WARNING) << Event("engine.notice_failed", c.id, c.version, e) << s;
    }
  }
}

void Coordinator::ReportCommitted(const Committed& c, const DataPlane& plane,
                                  bool staged, absl::Time t_commit,
                                  v1::FinishWeightUpdateResponse& response) {
  const absl::Time t_committed = absl::Now();
  // The whole update, its commit notices included (as the pause is).
  response.set_seconds(absl::ToDoubleSeconds(t_committed - c.started));
  if (c.paused_at != absl::InfiniteFuture()) {
    response.set_pause_seconds(
        absl::ToDoubleSeconds(t_committed - c.paused_at));
  }
  v1::UpdateTimings* t = response.mutable_timings();
  t->set_commit_s(absl::ToDoubleSeconds(t_committed - t_commit));
  if (listener_) {
    UpdateOutcome o;
    o.update_id = c.id;
    o.backend = plane.name();
    o.staged = staged;
    o.version = c.version;
    o.bytes = response.bytes();
    o.seconds = response.seconds();
    o.pause_seconds = response.pause_seconds();
    absl::MutexLock lock(&mu_);  // as for the failures' calls
    listener_(o);
  }
  LOG(INFO) << Event("update.committed", c.id, c.version,
                     absl::StrJoin(c.engines, ","))
            << "in " << response.seconds() << " s (pause " << t->pause_s()
            << ", begin " << t->begin_s() << ", transfer " << t->transfer_s()
            << ", device " << t->device_s() << ", receipts " << t->receipts_s()
            << ", commit " << t->commit_s() << ")";
}

absl::StatusOr<v1::AbortWeightUpdateResponse> Coordinator::AbortWeightUpdate(
    const v1::AbortWeightUpdateRequest& request) {
  absl::MutexLock control(&control_mu_);
  NoteTrainerCall();
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr || update_->id != request.update_id()) {
      return absl::FailedPreconditionError(
          absl::StrCat("no update '", request.update_id(), "' in progress"));
    }
  }
  v1::AbortWeightUpdateResponse response;
  for (v1::EngineResult& r : EndFailedUpdate(absl::AbortedError(
           absl::StrCat("aborted by the trainer: ", request.reason())))) {
    *response.add_engines() = std::move(r);
  }
  return response;
}

void Coordinator::DropFaultedEnginesLocked() {
  if (update_ == nullptr) return;
  for (size_t i = 0; i < update_->engine_ids.size(); ++i) {
    if (update_->lost[i] || !AnyRegionFaulted(*update_->plan->engines[i])) {
      continue;
    }
    DropFaultedLocked(update_->engine_ids[i], update_->plan->engines[i].get());
  }
}

void Coordinator::DropFaultedLocked(const std::string& id,
                                    const EngineLayout* layout) {
  auto it = engines_.find(id);
  if (it == engines_.end() || it->second.layout.get() != layout) {
    return;  // unregistered, or registered again meanwhile
  }
  RemoveEngineLocked(id,
                     "its shared memory is gone: the owner shrank the object "
                     "under the daemon (SIGBUS caught); register it again");
  hub_.DetachEngine(id);
}

}  // namespace weightsync
