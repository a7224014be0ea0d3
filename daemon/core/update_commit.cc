// Coordinator: the two halves of an update's end (issue 20). Prepare puts
// every byte in engine memory (a staged update's commit copy included) and
// reads the receipts; the engines stay paused and keep their old version.
// Commit then sets the versions and sends NewVersion and Resume. One daemon
// runs both in FinishWeightUpdate; a trainer driving several daemons calls
// PrepareWeightUpdate on each and CommitWeightUpdate on each only once
// every daemon prepared (docs/protocol.md, "Several daemons"). A prepared
// update that ends any other way (Abort, a new Start or Init, the idle
// deadline, SIGTERM) leaves its engines DIRTY and paused: the trainer may
// have committed the other daemons, so nothing here may resume the old
// weights. The locking rules are coordinator.h's.
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "daemon/core/coordinator.h"
#include "daemon/core/event_log.h"
#include "glog/logging.h"

namespace weightsync {

absl::StatusOr<absl::Time> Coordinator::Prepare(
    const std::string& update_id, const std::shared_ptr<DataPlane>& plane,
    absl::Time deadline) {
  absl::Status status = WaitForSubmits(deadline);
  bool staged;
  {
    absl::MutexLock lock(&mu_);
    if (update_->phase == Phase::kPrepared) return update_->t_prepared;
    if (update_->phase == Phase::kFailed) status = update_->error;
    staged = update_->staged;
  }
  if (status.ok() && staged) status = CommitStaged(deadline);
  if (status.ok()) status = plane->Drain(deadline);
  {
    absl::MutexLock lock(&mu_);
    DropFaultedEnginesLocked();
    // Its trainer left while the bytes drained (trainer_liveness.cc): the
    // update failed, whatever landed. Its reason came first, so it is the
    // one told, also where the drain failed (the departure is what stopped
    // the bytes: "trainer gone" says more than the transport's abort).
    if (update_->phase == Phase::kFailed) status = update_->error;
  }
  const absl::Time t_drained = absl::Now();
  std::vector<absl::StatusOr<v1::Receipt>> receipts;
  if (status.ok()) status = CollectReceipts(*plane, deadline, &receipts);
  if (!status.ok()) return FailFinish(update_id, status);
  absl::MutexLock lock(&mu_);
  update_->phase = Phase::kPrepared;
  update_->receipts = std::move(receipts);
  update_->t_prepared = absl::Now();
  v1::UpdateTimings& t = update_->timings;
  t.set_transfer_s(absl::ToDoubleSeconds(t_drained - update_->begun));
  t.set_device_s(absl::ToDoubleSeconds(plane->device_time()));
  t.set_receipts_s(absl::ToDoubleSeconds(update_->t_prepared - t_drained));
  RecordUpdateStatusLocked("prepared");
  return update_->t_prepared;
}

absl::StatusOr<v1::FinishWeightUpdateResponse> Coordinator::CommitPrepared(
    const DataPlane& plane, absl::Time t_commit) {
  v1::FinishWeightUpdateResponse response;
  Committed c;
  bool staged;
  {
    absl::MutexLock lock(&mu_);
    c = CommitVersionsLocked(update_->receipts, response);
    *response.mutable_timings() = update_->timings;
    staged = update_->staged;
    RecordUpdateStatusLocked("committed");
    update_.reset();
  }
  if (c.engines.empty()) {
    return absl::AbortedError(absl::StrCat(
        "update '", c.id, "': every engine disconnected during the update"));
  }
  NotifyCommitted(c);
  ReportCommitted(c, plane, staged, t_commit, response);
  return response;
}

absl::StatusOr<v1::PrepareWeightUpdateResponse>
Coordinator::PrepareWeightUpdate(
    const v1::PrepareWeightUpdateRequest& request) {
  absl::MutexLock control(&control_mu_);
  NoteTrainerCall();
  const absl::Time deadline =
      DeadlineFrom(request.timeout_ms(), options_.finish_timeout);
  WS_ASSIGN_OR_RETURN(const std::shared_ptr<DataPlane> plane,
                      CheckFinish(request.update_id()));
  WS_RETURN_IF_ERROR(Prepare(request.update_id(), plane, deadline).status());
  absl::MutexLock lock(&mu_);
  v1::PrepareWeightUpdateResponse response;
  for (size_t i = 0; i < update_->engine_ids.size(); ++i) {
    const std::string& e = update_->engine_ids[i];
    v1::EngineResult* result = response.add_engines();
    auto it = UpdateEngineResultLocked(i, result);
    if (it == engines_.end()) continue;
    result->set_version(it->second.version);
    result->set_state(EngineStatusLocked(e, it->second).state());
    result->set_layout_id(it->second.layout_id);
    if (i < update_->receipts.size() && update_->receipts[i].ok()) {
      *result->mutable_receipt() = *update_->receipts[i];
    }
  }
  response.set_bytes(update_->plan->chunks.total_bytes);
  *response.mutable_timings() = update_->timings;
  LOG(INFO) << Event("update.prepared", update_->id, update_->target_version)
            << "every byte in engine memory; waiting for the commit";
  return response;
}

absl::StatusOr<v1::FinishWeightUpdateResponse> Coordinator::CommitWeightUpdate(
    const v1::CommitWeightUpdateRequest& request) {
  absl::MutexLock control(&control_mu_);
  NoteTrainerCall();
  const absl::Time t_commit = absl::Now();
  std::shared_ptr<DataPlane> plane;
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr || update_->id != request.update_id()) {
      const bool done = last_update_.update_id() == request.update_id() &&
                        last_update_.phase() == "committed";
      return absl::FailedPreconditionError(absl::StrCat(
          "no update '", request.update_id(), "' in progress",
          done ? absl::StrCat("; it is already committed (version ",
                              last_update_.target_version(), ")")
               : "; it was never prepared here, or it ended (Abort, a new "
                 "Start, the idle deadline): its engines are DIRTY"));
    }
    if (update_->phase != Phase::kPrepared) {
      return absl::FailedPreconditionError(absl::StrCat(
          "update '", update_->id, "' is ",
          update_->phase == Phase::kFailed ? "failed" : "not prepared",
          ": call PrepareWeightUpdate first (a failed update can only be "
          "aborted)"));
    }
    plane = update_->data_plane;
  }
  return CommitPrepared(*plane, t_commit);
}

}  // namespace weightsync
