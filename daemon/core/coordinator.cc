#include "daemon/core/coordinator.h"

#include <algorithm>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "daemon/core/event_log.h"
#include "daemon/core/receipt.h"
#include "glog/logging.h"

namespace weightsync {
namespace {

// A caller's deadline, capped so no request can hold the control lock
// (and delay shutdown) for long.
absl::Time DeadlineFrom(int64_t timeout_ms, absl::Duration fallback) {
  constexpr int64_t kMaxMs = 10 * 60 * 1000;
  return absl::Now() + (timeout_ms > 0
                            ? absl::Milliseconds(std::min(timeout_ms, kMaxMs))
                            : fallback);
}

// The first failure of a broadcast, or OK.
absl::Status FirstError(const std::map<std::string, absl::Status>& results) {
  for (const auto& [engine, status] : results) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

v1::DaemonMessage ResumeNotice() {
  v1::DaemonMessage m;
  m.mutable_resume();
  return m;
}

v1::DaemonMessage PauseNotice(v1::PauseMode mode) {
  v1::DaemonMessage m;
  m.mutable_pause()->set_mode(
      mode == v1::PAUSE_MODE_UNSPECIFIED ? v1::PAUSE_MODE_KEEP : mode);
  return m;
}

}  // namespace

Coordinator::Coordinator(CoordinatorOptions options,
                         std::shared_ptr<MemoryMapper> mapper,
                         std::shared_ptr<DataPlaneFactory> data_planes)
    : options_(std::move(options)),
      mapper_(std::move(mapper)),
      data_planes_(std::move(data_planes)) {
  if (options_.update_idle_timeout > absl::ZeroDuration()) {
    watchdog_ = std::thread([this] { WatchIdle(); });
  }
}

Coordinator::~Coordinator() {
  {
    absl::MutexLock lock(&watch_mu_);
    watch_stop_ = true;
  }
  if (watchdog_.joinable()) watchdog_.join();
  Shutdown();
}

// How long a failed update waits for its trainer's Finish or Abort before
// the daemon ends it (WatchIdle).
constexpr absl::Duration kFailedGrace = absl::Seconds(2);

void Coordinator::NoteTrainerCall() {
  absl::MutexLock lock(&mu_);
  last_trainer_call_ = absl::Now();
  if (update_ != nullptr) update_->last_activity = last_trainer_call_;
}

void Coordinator::EndIfFailed(absl::string_view by) {
  bool failed;
  {
    absl::MutexLock lock(&mu_);
    failed = update_ != nullptr && update_->phase == Phase::kFailed;
    if (failed) {
      LOG(WARNING) << Event("update.ended", update_->id,
                            update_->target_version)
                   << "failed (" << update_->error << ") and nobody ended it; "
                   << by << " ends it";
    }
  }
  if (failed) EndFailedUpdate(absl::AbortedError("superseded"));
}

void Coordinator::WatchIdle() {
  const absl::Duration period =
      std::min(absl::Milliseconds(200), options_.update_idle_timeout / 4);
  while (true) {
    {
      absl::MutexLock lock(&watch_mu_);
      auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(watch_mu_) {
        return watch_stop_;
      };
      if (watch_mu_.AwaitWithTimeout(absl::Condition(&stop), period)) return;
    }
    std::string id;
    absl::Duration idle;
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
    if (!orphaned.empty()) {
      absl::MutexLock control(&control_mu_);
      {
        absl::MutexLock lock(&mu_);
        if (update_ != nullptr ||
            absl::Now() - last_trainer_call_ < options_.update_idle_timeout) {
          continue;
        }
      }
      LOG(WARNING) << Event("engine.pause_expired", "", -1,
                            absl::StrJoin(orphaned, ","))
                   << "paused by a trainer that has not called for "
                   << options_.update_idle_timeout << "; resuming them";
      ResumeEngines(orphaned, absl::Now() + options_.notice_timeout)
          .IgnoreError();
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      if (update_ == nullptr || shut_down_) continue;
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
      if (idle < options_.update_idle_timeout && !failed_long) continue;
      id = update_->id;
    }
    // As Abort does, after a Finish or Abort in progress (they hold
    // control_mu_ and end the update themselves).
    absl::MutexLock control(&control_mu_);
    {
      absl::MutexLock lock(&mu_);
      if (update_ == nullptr || update_->id != id ||
          (absl::Now() - update_->last_activity <
               options_.update_idle_timeout &&
           update_->phase != Phase::kFailed)) {
        continue;
      }
    }
    LOG(WARNING) << Event("update.abandoned", id)
                 << (idle < options_.update_idle_timeout
                         ? "failed, and its trainer did not end it"
                         : absl::StrCat("no word from its trainer for ",
                                        absl::FormatDuration(idle)))
                 << "; ending it";
    EndFailedUpdate(absl::DeadlineExceededError(absl::StrCat(
        "update '", id,
        "' abandoned: no chunk, call or progress from its "
        "trainer for ",
        absl::FormatDuration(idle), " (--update_idle_timeout_ms)")));
  }
}

// ---------------------------------------------------------------- engines

absl::StatusOr<v1::RegisterEngineResponse> Coordinator::RegisterEngine(
    const v1::RegisterEngineRequest& request) {
  // Validate and open memory without the lock: it touches the OS.
  WS_ASSIGN_OR_RETURN(std::shared_ptr<const EngineLayout> layout,
                      BuildEngineLayout(request, *mapper_, options_.limits));
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("daemon is shutting down");
  const std::string& id = request.engine_id();
  if (engines_.contains(id)) {
    if (hub_.Connected(id)) {
      return absl::AlreadyExistsError(
          absl::StrCat("engine '", id,
                       "' is registered and its control stream is open; "
                       "unregister it first"));
    }
    RemoveEngineLocked(id, "re-registered");
  }
  EngineRecord& r = engines_[id];
  r.layout = layout;
  r.parameters = request.parameters();
  r.version = request.version();
  r.trainer_uids.assign(request.trainer_uids().begin(),
                        request.trainer_uids().end());
  if (request.dirty()) {
    // Paused by an update its old daemon never finished: dirty, and paused
    // until an update cleans it, which then resumes it.
    r.dirty = true;
    SetPaused(r, true);
    r.paused_by_update = true;
  }
  LOG(INFO) << Event("engine.registered", "", r.version, id)
            << layout->parameters.size() << " parameters, "
            << layout->total_bytes << " bytes"
            << (request.dirty() ? ", dirty (its old daemon did not finish "
                                  "an update)"
                                : "");
  v1::RegisterEngineResponse response;
  response.set_parameters(layout->parameters.size());
  response.set_bytes(layout->total_bytes);
  response.set_version(r.version);
  return response;
}

absl::Status Coordinator::UnregisterEngine(const std::string& engine_id) {
  absl::MutexLock lock(&mu_);
  if (!engines_.contains(engine_id)) {
    return absl::NotFoundError(
        absl::StrCat("engine '", engine_id, "' is not registered"));
  }
  RemoveEngineLocked(engine_id, "unregistered");
  // Its control stream no longer speaks for any registration.
  hub_.DetachEngine(engine_id);
  return absl::OkStatus();
}

void Coordinator::RemoveEngineLocked(const std::string& engine_id,
                                     const std::string& why) {
  engines_.erase(engine_id);
  // A cached plan holds the layouts, and so the engine's mappings.
  last_plan_.reset();
  last_plan_layouts_.clear();
  LOG(INFO) << Event("engine.removed", "", -1, engine_id) << why;
  if (update_ == nullptr) return;
  for (size_t i = 0; i < update_->engine_ids.size(); ++i) {
    if (update_->engine_ids[i] == engine_id && !update_->lost[i]) {
      update_->lost[i] = true;
      update_->data_plane->MarkEngineLost(i);
      LOG(WARNING) << Event("engine.lost", update_->id, update_->target_version,
                            engine_id)
                   << why;
    }
  }
  // The update's plan keeps the regions mapped until it ends; then the last
  // lease closes them.
}

absl::Status Coordinator::AttachControl(
    const std::string& engine_id, std::shared_ptr<ControlChannel> channel) {
  absl::MutexLock lock(&mu_);
  if (!engines_.contains(engine_id)) {
    return absl::NotFoundError(
        absl::StrCat("engine '", engine_id,
                     "' is not registered; call RegisterEngine "
                     "before opening the control stream"));
  }
  hub_.Attach(engine_id, std::move(channel));
  return absl::OkStatus();
}

void Coordinator::DetachControl(const std::string& engine_id,
                                const ControlChannel* ch) {
  if (!hub_.Detach(engine_id, ch)) return;  // superseded by a newer stream
  absl::MutexLock lock(&mu_);
  if (engines_.contains(engine_id)) {
    RemoveEngineLocked(engine_id, "control stream closed");
  }
}

void Coordinator::OnAck(const std::string& engine_id,
                        const v1::EngineMessage::Ack& ack) {
  hub_.OnAck(engine_id, ack);
}

absl::StatusOr<std::vector<std::string>> Coordinator::SelectEngines(
    const google::protobuf::RepeatedPtrField<std::string>& ids) {
  std::vector<std::string> out;
  if (ids.empty()) {
    for (const auto& [id, r] : engines_) out.push_back(id);
    std::sort(out.begin(), out.end());
    if (out.empty()) {
      return absl::FailedPreconditionError("no engine is registered");
    }
    return out;
  }
  for (const std::string& id : ids) {
    if (!engines_.contains(id)) {
      return absl::NotFoundError(
          absl::StrCat("engine '", id, "' is not registered"));
    }
    if (std::find(out.begin(), out.end(), id) == out.end()) out.push_back(id);
  }
  return out;
}

// ---------------------------------------------------------------- group

absl::StatusOr<v1::InitWeightTransferResponse> Coordinator::InitWeightTransfer(
    const v1::InitWeightTransferRequest& request) {
  absl::MutexLock control(&control_mu_);
  NoteTrainerCall();
  EndIfFailed("InitWeightTransfer");
  {
    absl::MutexLock lock(&mu_);
    if (update_ != nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("update '", update_->id,
                       "' is in progress; finish or abort it "
                       "before InitWeightTransfer"));
    }
  }
  if (request.backend() == v1::BACKEND_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        "InitWeightTransfer needs a backend (host, nccl or ipc)");
  }
  if (request.world_size() < 0 || request.rank_offset() < 0 ||
      (request.world_size() > 0 &&
       request.rank_offset() >= request.world_size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank_offset ", request.rank_offset(),
                     " must lie inside world_size ", request.world_size()));
  }
  if (request.timeout_ms() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms must be >= 0 (0: the default, 10 min), not ",
                     request.timeout_ms()));
  }
  WS_ASSIGN_OR_RETURN(std::shared_ptr<DataPlane> plane,
                      data_planes_->Create(request));
  absl::MutexLock lock(&mu_);
  backend_ = request.backend();
  data_plane_ = std::move(plane);
  v1::InitWeightTransferResponse response;
  response.set_group_id(
      absl::StrFormat("%016x", absl::Uniform<uint64_t>(absl::BitGen())));
  response.set_local_world_size(data_planes_->LocalWorldSize(backend_));
  response.set_build_info(options_.build_info);
  LOG(INFO) << Event("group.formed") << "transfer group " << response.group_id()
            << " on " << data_plane_->name() << ", world size "
            << request.world_size();
  return response;
}

v1::GetWorldSizeResponse Coordinator::GetWorldSize() {
  absl::MutexLock lock(&mu_);
  v1::GetWorldSizeResponse response;
  response.set_world_size(backend_ == v1::BACKEND_UNSPECIFIED
                              ? 0
                              : data_planes_->LocalWorldSize(backend_));
  return response;
}

// ---------------------------------------------------------------- updates

absl::StatusOr<v1::StartWeightUpdateResponse> Coordinator::StartWeightUpdate(
    const v1::StartWeightUpdateRequest& request) {
  absl::MutexLock control(&control_mu_);
  const absl::Time t_entry = absl::Now();
  if (request.update_id().empty() || request.update_id().size() > 256) {
    return absl::InvalidArgumentError("update_id must be 1-256 characters");
  }
  if (request.tensors_size() > options_.max_manifest_tensors) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest has ", request.tensors_size(),
                     " tensors; the limit is ", options_.max_manifest_tensors));
  }
  // Bounded like registrations (issue 6): names and ranks.
  for (int i = 0; i < request.tensors_size(); ++i) {
    const v1::TensorSpec& t = request.tensors(i);
    if (static_cast<int64_t>(t.name().size()) >
            options_.limits.max_name_length ||
        t.shape_size() > CoordinatorOptions::kMaxTensorRank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", i, " ('", t.name().substr(0, 64), "'): a name of ",
          t.name().size(), " bytes and ", t.shape_size(),
          " dimensions; the limits are ", options_.limits.max_name_length,
          " and ", CoordinatorOptions::kMaxTensorRank));
    }
  }
  const int64_t chunk_bytes = request.chunk_bytes() == 0
                                  ? options_.default_chunk_bytes
                                  : request.chunk_bytes();
  if (chunk_bytes > options_.max_chunk_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_bytes ", chunk_bytes,
                                                   " is above the daemon's "
                                                   "limit of ",
                                                   options_.max_chunk_bytes));
  }
  std::vector<std::string> ids;
  std::vector<std::shared_ptr<const EngineLayout>> layouts;
  std::vector<std::string> to_pause;
  std::shared_ptr<DataPlane> plane;
  NoteTrainerCall();
  // A failed update that nobody ended (its trainer gone) can never
  // complete: a new Start supersedes it.
  EndIfFailed("StartWeightUpdate");
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("daemon is shutting down");
    if (data_plane_ == nullptr) {
      return absl::FailedPreconditionError(
          "no transfer group: call InitWeightTransfer before "
          "StartWeightUpdate");
    }
    if (update_ != nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("update '", update_->id,
                       "' is in progress; finish or abort it "
                       "before starting '",
                       request.update_id(), "'"));
    }
    WS_ASSIGN_OR_RETURN(ids, SelectEngines(request.engine_ids()));
    bool sparse = false;
    for (const v1::TensorSpec& t : request.tensors()) {
      sparse = sparse || t.sparse_nnz() > 0;
    }
    for (const std::string& id : ids) {
      const EngineRecord& r = engines_.at(id);
      // A patch is a difference against one version: it applies only there.
      if (sparse && request.sparse_base_version() != r.version) {
        return absl::FailedPreconditionError(absl::StrCat(
            "update '", request.update_id(),
            "' holds sparse patches against "
            "version ",
            request.sparse_base_version(), ", but engine '", id,
            "' is at version ", r.version, "; send it a dense update"));
      }
      if (sparse && r.dirty) {
        return absl::FailedPreconditionError(
            absl::StrCat("engine '", id,
                         "' is dirty: a sparse patch can't repair it; "
                         "send a dense update"));
      }
      if (request.target_version() <= r.version) {
        return absl::FailedPreconditionError(
            absl::StrCat("target version ", request.target_version(),
                         " is not above engine '", id, "' version ", r.version,
                         "; versions only go up"));
      }
      layouts.push_back(r.layout);
      if (!r.paused) to_pause.push_back(id);
    }
    plane = data_plane_;
  }
  // Planning and the pause come first: time enough to wake the data plane
  // for Begin (GPU: ~0.4 ms of a call after idle time).
  plane->Warm();
  if (request.ipc_ring_slots() != 0 && plane->name() != "ipc") {
    return absl::InvalidArgumentError(
        absl::StrCat("ipc_ring_slots is for the ipc backend; this group uses ",
                     plane->name()));
  }
  // Plan every byte before moving any (invariant 2).
  WS_ASSIGN_OR_RETURN(std::shared_ptr<const CopyPlan> plan,
                      PlanFor(request.tensors(), chunk_bytes, layouts));
  bool staged = request.mode() == v1::UPDATE_MODE_STAGED;
  // Where bytes arrive by themselves (NCCL, IPC), the data plane stages them
  // in its own (GPU) memory, one chunk-sized buffer per chunk.
  const bool device_staging = plane->ReceivesOwnBytes();
  if (staged && device_staging && plane->DeviceStagingBudget() < 0) {
    return absl::UnimplementedError(absl::StrCat(
        "staged updates on the ", plane->name(),
        " backend are not supported yet; use streaming, the nccl backend or "
        "the host backend"));
  }
  const int64_t staging_need =
      device_staging ? static_cast<int64_t>(plan->chunks.chunks.size()) *
                           plan->chunks.chunk_bytes
                     : plan->chunks.total_bytes;
  const int64_t staging_budget = device_staging ? plane->DeviceStagingBudget()
                                                : options_.staged_budget_bytes;
  if (staged && staging_need > staging_budget) {
    if (!request.allow_streaming_fallback()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "staged update '", request.update_id(), "' needs ", staging_need,
          " bytes of ", device_staging ? "GPU " : "", "staging; the budget is ",
          staging_budget, " (allow_streaming_fallback to stream instead)"));
    }
    LOG(INFO) << Event("update.fallback", request.update_id(),
                       request.target_version())
              << "over the staging budget, falling back to streaming";
    staged = false;
  }
  // Streaming writes into live memory: pause the engines first (an IPC data
  // plane starts copying as soon as Begin returns). Staged updates pause
  // only for their commit.
  if (staged) to_pause.clear();
  const absl::Time t_planned = absl::Now();
  WS_ASSIGN_OR_RETURN(const std::vector<std::string> paused,
                      PauseAll(to_pause, v1::PAUSE_MODE_KEEP,
                               absl::Now() + options_.notice_timeout,
                               absl::StrCat("could not pause for update '",
                                            request.update_id(), "'")));
  const absl::Time t_paused = absl::Now();
  // Staging may refuse the budget: then nothing moved, and the engines this
  // call paused serve again.
  const absl::Status begun = !staged ? plane->Begin(plan, request)
                             : device_staging
                                 ? plane->BeginStaged(plan, request)
                                 : absl::OkStatus();
  const absl::Time t_begun = absl::Now();
  if (!begun.ok()) {
    hub_.Broadcast(paused, ResumeNotice(),
                   absl::Now() + options_.notice_timeout);
    return begun;
  }

  absl::MutexLock lock(&mu_);
  auto update = std::make_unique<Update>();
  update->id = request.update_id();
  update->target_version = request.target_version();
  update->plan = plan;
  update->engine_ids = ids;
  update->lost.assign(ids.size(), false);
  update->data_plane = plane;
  update->started = t_entry;
  update->last_activity = absl::Now();
  update->ipc_ring_slots = request.ipc_ring_slots();
  update->begun = t_begun;
  update->timings.set_validate_s(absl::ToDoubleSeconds(t_planned - t_entry));
  update->timings.set_pause_s(absl::ToDoubleSeconds(t_paused - t_planned));
  update->timings.set_begin_s(absl::ToDoubleSeconds(t_begun - t_paused));
  update->staged = staged;
  update->device_staged = staged && device_staging;
  // Receipts are on unless the trainer turns them off (VERIFY_OFF), on
  // every backend (docs/protocol.md, "Receipts").
  update->verify = request.verify() != v1::VERIFY_OFF;
  for (const v1::TensorSpec& t : request.tensors()) {
    // Receipts cover dense tensors: a patch's other elements are not the
    // trainer's to vouch for.
    if (t.sparse_nnz() == 0) update->sources.insert(t.name());
  }
  if (staged && !device_staging) {
    update->staged_chunks.resize(plan->chunks.chunks.size());
    update->request = request;
  } else if (staged) {
    update->request = request;
  } else {
    update->paused_at = t_paused;
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    auto it = engines_.find(ids[i]);
    // Gone since the snapshot (or replaced by a new registration).
    if (it == engines_.end() || it->second.layout != layouts[i]) {
      update->lost[i] = true;
      plane->MarkEngineLost(i);
      continue;
    }
    if (staged) continue;  // the engines serve on until the commit
    EngineRecord& r = it->second;
    r.updating = true;
    if (!r.paused) {
      SetPaused(r, true);
      r.paused_by_update = true;
    }
  }
  update_ = std::move(update);
  RecordUpdateStatusLocked("receiving");
  v1::StartWeightUpdateResponse response;
  response.set_update_id(request.update_id());
  response.set_total_bytes(plan->chunks.total_bytes);
  response.set_num_chunks(plan->chunks.chunks.size());
  response.set_chunk_bytes(chunk_bytes);
  response.set_mode(staged ? v1::UPDATE_MODE_STAGED
                           : v1::UPDATE_MODE_STREAMING);
  for (const std::string& id : ids) response.add_engine_ids(id);
  LOG(INFO) << Event("update.started", request.update_id(),
                     request.target_version(), absl::StrJoin(ids, ","))
            << (staged ? "staged, " : "streaming, ") << request.tensors_size()
            << " tensors, " << plan->chunks.total_bytes << " bytes in "
            << plan->chunks.chunks.size() << " chunks";
  return response;
}

absl::StatusOr<std::shared_ptr<const CopyPlan>> Coordinator::PlanFor(
    const Manifest& manifest, int64_t chunk_bytes,
    const std::vector<std::shared_ptr<const EngineLayout>>& layouts) {
  // An RL loop sends the same manifest to the same engines every step: the
  // plan is a pure function of (manifest, chunk size, layouts), so the last
  // one is reused when all three are identical (layouts by identity: a
  // re-registration makes a new layout).
  std::string key;
  for (const v1::TensorSpec& t : manifest) {
    std::string bytes;
    t.SerializeToString(&bytes);
    absl::StrAppend(&key, bytes.size(), ":", bytes);
  }
  absl::StrAppend(&key, "|", chunk_bytes);
  {
    absl::MutexLock lock(&mu_);
    if (last_plan_ != nullptr && key == last_plan_key_ &&
        layouts == last_plan_layouts_) {
      return last_plan_;
    }
  }
  WS_ASSIGN_OR_RETURN(std::shared_ptr<const CopyPlan> plan,
                      BuildCopyPlan(manifest, chunk_bytes, layouts));
  absl::MutexLock lock(&mu_);
  for (const auto& l : layouts) {
    // An engine left while planning: don't keep its mappings alive.
    bool registered = false;
    for (const auto& [id, r] : engines_) registered |= r.layout == l;
    if (!registered) return plan;
  }
  last_plan_ = plan;
  last_plan_key_ = std::move(key);
  last_plan_layouts_ = layouts;
  return plan;
}

absl::Status Coordinator::BeginPushStream(const std::string& update_id) {
  absl::MutexLock lock(&mu_);
  if (update_ == nullptr || update_->id != update_id) {
    return absl::FailedPreconditionError(
        absl::StrCat("no update '", update_id,
                     "' in progress; call StartWeightUpdate "
                     "before PushChunks"));
  }
  if (update_->stream_open) {
    return absl::FailedPreconditionError(absl::StrCat(
        "update '", update_id, "' already has a PushChunks stream open"));
  }
  update_->stream_open = true;
  update_->last_activity = absl::Now();
  return absl::OkStatus();
}

absl::Status Coordinator::PushChunk(const std::string& update_id, int64_t index,
                                    std::string data, absl::Time deadline) {
  std::shared_ptr<DataPlane> plane;
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr || update_->id != update_id) {
      return absl::FailedPreconditionError(
          absl::StrCat("no update '", update_id, "' in progress"));
    }
    if (update_->phase == Phase::kFailed) {
      return absl::AbortedError(absl::StrCat(
          "update '", update_id, "' failed: ", update_->error.message()));
    }
    const bool ring = update_->ipc_ring_slots > 0;
    if (update_->data_plane->ReceivesOwnBytes() && !ring) {
      return absl::FailedPreconditionError(absl::StrCat(
          "update '", update_id, "' uses the ", update_->data_plane->name(),
          " backend: its bytes do not travel through PushChunks"));
    }
    const auto& chunks = update_->plan->chunks.chunks;
    absl::Status bad;
    if (index < 0 || index >= static_cast<int64_t>(chunks.size())) {
      bad = absl::InvalidArgumentError(absl::StrCat("update '", update_id,
                                                    "': chunk ", index,
                                                    " arrived, but the plan "
                                                    "has ",
                                                    chunks.size(), " chunks"));
    } else if (index != update_->next_chunk) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          "update '", update_id, "': chunk ", index, " arrived, expected ",
          update_->next_chunk, " of ", chunks.size()));
    } else if (!ring &&
               static_cast<int64_t>(data.size()) != chunks[index].size) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          "update '", update_id, "': chunk ", index, " has ", data.size(),
          " bytes, the plan says ", chunks[index].size));
    }
    if (!bad.ok()) {
      // The stream is out of step with the plan: nothing of this chunk is
      // written and the update can't complete.
      FailUpdateLocked(bad);
      return bad;
    }
    ++update_->next_chunk;
    update_->received_bytes += chunks[index].size;
    update_->last_activity = absl::Now();
    if (update_->staged && !update_->device_staged) {
      update_->staged_chunks[index] = std::move(data);
      return absl::OkStatus();
    }
    // Device staging (an IPC ring): the data plane copies the chunk out of
    // its slot into GPU staging; engine memory waits for the commit.
    ++update_->submits_in_flight;
    plane = update_->data_plane;
  }
  absl::Status s = plane->SubmitChunk(index, std::move(data), deadline);
  absl::MutexLock lock(&mu_);
  // Finish and Abort wait for this count to drop before they end the update,
  // so update_ is still this update here.
  --update_->submits_in_flight;
  if (!s.ok()) FailUpdateLocked(s);
  return s;
}

absl::StatusOr<int64_t> Coordinator::IpcChunkAck(const std::string& update_id,
                                                 int64_t index,
                                                 absl::Time deadline) {
  std::shared_ptr<DataPlane> plane;
  int64_t need;
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr || update_->id != update_id) {
      return absl::FailedPreconditionError(
          absl::StrCat("no update '", update_id, "' in progress"));
    }
    // Before it packs chunk index+1 into slot (index+1) % slots, the
    // trainer needs chunk index+1-slots out of it.
    update_->last_activity = absl::Now();
    need = index + 2 - update_->ipc_ring_slots;
    if (need <= 0) return 0;
    ++update_->submits_in_flight;
    plane = update_->data_plane;
  }
  absl::Status s = plane->WaitChunks(need, deadline);
  absl::MutexLock lock(&mu_);
  --update_->submits_in_flight;
  if (!s.ok()) {
    FailUpdateLocked(s);
    return s;
  }
  return need;
}

void Coordinator::PushStreamEnded(const std::string& update_id,
                                  bool cancelled) {
  absl::MutexLock lock(&mu_);
  if (update_ == nullptr || update_->id != update_id) return;
  update_->stream_open = false;
  const int64_t total = update_->plan->chunks.chunks.size();
  if (cancelled && update_->next_chunk < total) {
    FailUpdateLocked(absl::AbortedError(
        absl::StrCat("trainer disconnected mid-stream after ",
                     update_->next_chunk, " of ", total, " chunks")));
  }
}

void Coordinator::FailUpdateLocked(const absl::Status& reason) {
  if (update_->phase == Phase::kFailed) return;
  update_->phase = Phase::kFailed;
  update_->failed_at = absl::Now();
  update_->error = reason;
  if (listener_) {
    UpdateOutcome o;
    o.update_id = update_->id;
    o.backend = update_->data_plane->name();
    o.staged = update_->staged;
    o.code = reason.code() == absl::StatusCode::kOk ? absl::StatusCode::kUnknown
                                                    : reason.code();
    o.version = update_->target_version;
    o.bytes = update_->received_bytes;
    o.seconds = absl::ToDoubleSeconds(update_->failed_at - update_->started);
    listener_(o);
  }
  // Engines that may hold part of this update are dirty from now on. Bytes
  // that arrive by themselves (NCCL) may have landed from Begin on.
  const bool wrote =
      update_->staged
          ? update_->committing
          : update_->next_chunk > 0 || update_->data_plane->ReceivesOwnBytes();
  if (wrote) {
    for (size_t i = 0; i < update_->engine_ids.size(); ++i) {
      auto it = engines_.find(update_->engine_ids[i]);
      if (!update_->lost[i] && it != engines_.end()) it->second.dirty = true;
    }
  }
  LOG(WARNING) << Event("update.failed", update_->id, update_->target_version,
                        absl::StrJoin(update_->engine_ids, ","))
               << reason;
  RecordUpdateStatusLocked("failed");
}

absl::Status Coordinator::WaitForSubmits(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return update_->submits_in_flight == 0;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&idle), deadline)) {
    return absl::DeadlineExceededError("a chunk was still being received");
  }
  return absl::OkStatus();
}

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
  // The engines generated on the old weights all along; they stop only for
  // the copy from staging into their memory.
  absl::StatusOr<std::vector<std::string>> pause = PauseAll(
      to_pause, v1::PAUSE_MODE_KEEP, absl::Now() + options_.notice_timeout,
      "could not pause for the commit");
  if (!pause.ok()) {
    // Engines that left (died, unregistered) while being paused are lost to
    // this update, as in a streaming one: commit the others. PauseAll
    // resumed them; pause them again.
    std::vector<std::string> staying;
    {
      absl::MutexLock lock(&mu_);
      for (size_t i = 0; i < update_->engine_ids.size(); ++i) {
        const std::string& id = update_->engine_ids[i];
        if (std::find(to_pause.begin(), to_pause.end(), id) == to_pause.end())
          continue;
        if (engines_.contains(id) && hub_.Connected(id)) {
          staying.push_back(id);
        } else if (!update_->lost[i]) {
          update_->lost[i] = true;
          update_->data_plane->MarkEngineLost(i);
          LOG(WARNING) << Event("engine.lost", update_->id,
                                update_->target_version, id)
                       << "left while the commit paused it";
        }
      }
    }
    if (staying.size() < to_pause.size()) {
      pause = PauseAll(staying, v1::PAUSE_MODE_KEEP,
                       absl::Now() + options_.notice_timeout,
                       "could not pause for the commit");
    }
  }
  WS_RETURN_IF_ERROR(pause.status());
  const std::vector<std::string>& paused = *pause;
  std::vector<std::string> chunks;
  {
    absl::MutexLock lock(&mu_);
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
    chunks = std::move(update_->staged_chunks);
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

absl::StatusOr<v1::FinishWeightUpdateResponse> Coordinator::FinishWeightUpdate(
    const v1::FinishWeightUpdateRequest& request) {
  absl::MutexLock control(&control_mu_);
  NoteTrainerCall();
  const absl::Time deadline =
      DeadlineFrom(request.timeout_ms(), options_.finish_timeout);
  std::shared_ptr<DataPlane> plane;
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr || update_->id != request.update_id()) {
      return absl::FailedPreconditionError(
          absl::StrCat("no update '", request.update_id(),
                       "' in progress; call "
                       "StartWeightUpdate first"));
    }
    const int64_t total = update_->plan->chunks.chunks.size();
    if (update_->phase == Phase::kReceiving && update_->next_chunk < total &&
        (!update_->data_plane->ReceivesOwnBytes() ||
         update_->ipc_ring_slots > 0)) {
      FailUpdateLocked(absl::AbortedError(
          absl::StrCat("finish after ", update_->next_chunk, " of ", total,
                       " chunks (", update_->received_bytes, " of ",
                       update_->plan->chunks.total_bytes, " bytes)")));
    }
    plane = update_->data_plane;
  }
  absl::Status status = WaitForSubmits(deadline);
  bool staged;
  {
    absl::MutexLock lock(&mu_);
    if (update_->phase == Phase::kFailed) status = update_->error;
    staged = update_->staged;
  }
  if (status.ok() && staged) status = CommitStaged(deadline);
  if (status.ok()) status = plane->Drain(deadline);
  const absl::Time t_drained = absl::Now();
  // Every byte is in engine memory: read back what was installed. Host
  // memory here; GPU memory by the data plane, where a failure fails the
  // update (its receipts were asked for and can't be given).
  std::vector<absl::StatusOr<v1::Receipt>> receipts;
  if (status.ok()) {
    std::shared_ptr<const CopyPlan> plan;
    const absl::flat_hash_set<std::string>* sources;
    bool verify;
    std::vector<bool> lost;
    {
      absl::MutexLock lock(&mu_);
      plan = update_->plan;
      sources = &update_->sources;  // stable: only control ops end updates
      verify = update_->verify;
      lost = update_->lost;
    }
    if (verify && plane->ReceivesOwnBytes()) {
      absl::StatusOr<std::vector<v1::Receipt>> device =
          plane->DeviceReceipts(*plan, *sources, lost, deadline);
      if (device.ok()) {
        for (v1::Receipt& r : *device) receipts.push_back(std::move(r));
      } else {
        status =
            absl::Status(device.status().code(),
                         absl::StrCat("receipts: ", device.status().message()));
      }
    } else if (verify) {
      for (const auto& engine : plan->engines) {
        receipts.push_back(ComputeReceipt(*engine, *sources));
      }
    }
  }
  const absl::Time t_receipts = absl::Now();
  if (!status.ok()) {
    const std::vector<v1::EngineResult> results = EndFailedUpdate(status);
    std::vector<std::string> dirty;
    for (const auto& r : results) {
      if (r.state() == v1::ENGINE_DIRTY) dirty.push_back(r.engine_id());
    }
    return absl::AbortedError(absl::StrCat(
        "update '", request.update_id(), "' failed: ", status.message(),
        dirty.empty() ? "; engines untouched"
                      : absl::StrCat("; engines left dirty: ",
                                     absl::StrJoin(dirty, ", "))));
  }

  // Commit.
  v1::FinishWeightUpdateResponse response;
  std::vector<std::string> committed, resume;
  std::string id;
  int64_t version;
  absl::Time paused_at = absl::InfiniteFuture();
  absl::Time started;
  {
    absl::MutexLock lock(&mu_);
    id = update_->id;
    version = update_->target_version;
    for (size_t i = 0; i < update_->engine_ids.size(); ++i) {
      const std::string& e = update_->engine_ids[i];
      v1::EngineResult* result = response.add_engines();
      result->set_engine_id(e);
      auto it = engines_.find(e);
      if (update_->lost[i] || it == engines_.end()) {
        result->set_lost(true);
        result->set_code(static_cast<int>(absl::StatusCode::kUnavailable));
        result->set_message("engine disconnected during the update");
        continue;
      }
      EngineRecord& r = it->second;
      r.version = version;
      r.updating = false;
      r.dirty = r.dirty && !update_->plan->covers_engine[i];
      result->set_version(version);
      result->set_state(r.dirty ? v1::ENGINE_DIRTY : v1::ENGINE_READY);
      if (i < receipts.size() && receipts[i].ok()) {
        *result->mutable_receipt() = *receipts[i];
      }
      committed.push_back(e);
      // A dirty engine stays paused: Resume needs allow_dirty.
      if (r.paused_by_update && !r.dirty) resume.push_back(e);
    }
    response.set_version(version);
    paused_at = update_->paused_at;
    response.set_bytes(update_->plan->chunks.total_bytes);
    started = update_->started;
    v1::UpdateTimings* t = response.mutable_timings();
    *t = update_->timings;
    t->set_transfer_s(absl::ToDoubleSeconds(t_drained - update_->begun));
    t->set_device_s(absl::ToDoubleSeconds(plane->device_time()));
    t->set_receipts_s(absl::ToDoubleSeconds(t_receipts - t_drained));
    RecordUpdateStatusLocked("committed");
    update_.reset();
  }
  if (committed.empty()) {
    return absl::AbortedError(absl::StrCat(
        "update '", id, "': every engine disconnected during the update"));
  }
  v1::DaemonMessage notice;
  notice.mutable_new_version()->set_version(version);
  notice.mutable_new_version()->set_update_id(id);
  // New version, then (for engines this update paused) resume: one round
  // trip for both.
  std::vector<NoticeHub::Notices> notices;
  for (const std::string& e : committed) {
    NoticeHub::Notices& n = notices.emplace_back();
    n.engine = e;
    n.messages.push_back(notice);
    if (std::find(resume.begin(), resume.end(), e) != resume.end()) {
      n.messages.push_back(ResumeNotice());
    }
  }
  const auto acks =
      hub_.Broadcast(notices, absl::Now() + options_.notice_timeout);
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& e : resume) {
      auto it = engines_.find(e);
      if (acks.at(e).ok() && it != engines_.end()) {
        SetPaused(it->second, false);
        it->second.paused_by_update = false;
      }
    }
  }
  for (const auto& [e, s] : acks) {
    if (s.ok()) VLOG(1) << Event("engine.new_version", id, version, e);
    if (!s.ok()) {
      LOG(WARNING) << Event("engine.notice_failed", id, version, e) << s;
    }
  }
  const absl::Time t_committed = absl::Now();
  // The whole update, its commit notices included (as the pause is).
  response.set_seconds(absl::ToDoubleSeconds(t_committed - started));
  if (paused_at != absl::InfiniteFuture()) {
    response.set_pause_seconds(absl::ToDoubleSeconds(t_committed - paused_at));
  }
  v1::UpdateTimings* t = response.mutable_timings();
  t->set_commit_s(absl::ToDoubleSeconds(t_committed - t_receipts));
  if (listener_) {
    UpdateOutcome o;
    o.update_id = id;
    o.backend = plane->name();
    o.staged = staged;
    o.version = version;
    o.bytes = response.bytes();
    o.seconds = response.seconds();
    o.pause_seconds = response.pause_seconds();
    absl::MutexLock lock(&mu_);  // as for the failures' calls
    listener_(o);
  }
  LOG(INFO) << Event("update.committed", id, version,
                     absl::StrJoin(committed, ","))
            << "in " << response.seconds() << " s (pause " << t->pause_s()
            << ", begin " << t->begin_s() << ", transfer " << t->transfer_s()
            << ", device " << t->device_s() << ", receipts " << t->receipts_s()
            << ", commit " << t->commit_s() << ")";
  return response;
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

// ---------------------------------------------------------------- pause

absl::StatusOr<std::vector<std::string>> Coordinator::PauseAll(
    const std::vector<std::string>& engines, v1::PauseMode mode,
    absl::Time deadline, absl::string_view why) {
  if (engines.empty()) return std::vector<std::string>();
  const auto acks = hub_.Broadcast(engines, PauseNotice(mode), deadline);
  std::vector<std::string> paused, failed;
  for (const auto& [id, s] : acks) {
    (s.ok() ? paused : failed).push_back(id);
    if (s.ok()) VLOG(1) << Event("engine.paused", "", -1, id) << why;
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
    WS_ASSIGN_OR_RETURN(ids, SelectEngines(request.engine_ids()));
    for (const std::string& id : ids) {
      EngineRecord& r = engines_.at(id);
      if (r.paused) {
        r.paused_by_update = false;  // the trainer owns this pause now
      } else {
        to_pause.push_back(id);
      }
    }
  }
  WS_RETURN_IF_ERROR(
      PauseAll(to_pause, request.mode(),
               DeadlineFrom(request.timeout_ms(), options_.notice_timeout),
               "Pause")
          .status());
  absl::MutexLock lock(&mu_);
  v1::PauseResponse response;
  for (const std::string& id : ids) {
    auto it = engines_.find(id);
    if (it == engines_.end()) continue;
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
    WS_ASSIGN_OR_RETURN(ids, SelectEngines(request.engine_ids()));
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

// ---------------------------------------------------------------- status

v1::EngineStatus Coordinator::EngineStatusLocked(const std::string& id,
                                                 const EngineRecord& r) const {
  v1::EngineStatus s;
  s.set_engine_id(id);
  s.set_version(r.version);
  s.set_parameters(r.layout->parameters.size());
  s.set_bytes(r.layout->total_bytes);
  for (const std::string& u : r.layout->device_uuids) s.add_device_uuids(u);
  s.set_connected(hub_.Connected(id));
  absl::Duration paused = r.paused_total;
  if (r.paused_since != absl::InfiniteFuture()) {
    paused += absl::Now() - r.paused_since;
  }
  s.set_paused_seconds(absl::ToDoubleSeconds(paused));
  s.set_state(r.dirty      ? v1::ENGINE_DIRTY
              : r.updating ? v1::ENGINE_UPDATING
              : r.paused   ? v1::ENGINE_PAUSED
                           : v1::ENGINE_READY);
  return s;
}

void Coordinator::RecordUpdateStatusLocked(const std::string& phase) {
  if (update_ == nullptr) return;
  v1::UpdateStatus& s = last_update_;
  s.set_update_id(update_->id);
  s.set_target_version(update_->target_version);
  s.set_mode(update_->staged ? v1::UPDATE_MODE_STAGED
                             : v1::UPDATE_MODE_STREAMING);
  s.set_phase(phase);
  s.set_total_bytes(update_->plan->chunks.total_bytes);
  s.set_total_chunks(update_->plan->chunks.chunks.size());
  s.clear_engine_ids();
  for (const std::string& e : update_->engine_ids) s.add_engine_ids(e);
  s.set_error(std::string(update_->error.message()));
}

v1::GetStatusResponse Coordinator::GetStatus(bool include_layouts) {
  absl::MutexLock lock(&mu_);
  v1::GetStatusResponse response;
  std::vector<std::string> ids;
  for (const auto& [id, r] : engines_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  for (const std::string& id : ids) {
    v1::EngineStatus* e = response.add_engines();
    *e = EngineStatusLocked(id, engines_.at(id));
    if (include_layouts) *e->mutable_layout() = engines_.at(id).parameters;
  }
  if (update_ != nullptr || !last_update_.update_id().empty()) {
    v1::UpdateStatus* u = response.mutable_update();
    *u = last_update_;
    if (update_ != nullptr) {
      u->set_received_bytes(update_->received_bytes);
      u->set_received_chunks(update_->next_chunk);
      int64_t staging = update_->data_plane->staging_bytes();
      for (const std::string& c : update_->staged_chunks) staging += c.size();
      u->set_staging_bytes(staging);
    } else if (u->phase() == "committed") {
      u->set_received_bytes(u->total_bytes());
      u->set_received_chunks(u->total_chunks());
    }
  }
  response.set_backend(backend_);
  response.set_build_info(options_.build_info);
  return response;
}

absl::Status Coordinator::CheckTrainerUid(
    const google::protobuf::RepeatedPtrField<std::string>& engine_ids,
    uint32_t uid) {
  if (uid == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  WS_ASSIGN_OR_RETURN(const std::vector<std::string> ids,
                      SelectEngines(engine_ids));
  for (const std::string& id : ids) {
    const std::vector<uint32_t>& allowed = engines_.at(id).trainer_uids;
    if (allowed.empty() ||
        std::find(allowed.begin(), allowed.end(), uid) != allowed.end()) {
      continue;
    }
    return absl::PermissionDeniedError(absl::StrCat(
        "engine '", id, "' accepts updates only from trainers of uid ",
        absl::StrJoin(allowed, ", "), " (and root), not uid ", uid));
  }
  return absl::OkStatus();
}

void Coordinator::SetPaused(EngineRecord& r, bool paused) {
  if (paused && !r.paused) r.paused_since = absl::Now();
  if (!paused && r.paused && r.paused_since != absl::InfiniteFuture()) {
    r.paused_total += absl::Now() - r.paused_since;
    r.paused_since = absl::InfiniteFuture();
  }
  r.paused = paused;
}

absl::StatusOr<v1::CheckEngineResponse> Coordinator::CheckEngine(
    const v1::CheckEngineRequest& request) {
  const std::string& id = request.engine_id();
  std::shared_ptr<const EngineLayout> layout;
  v1::CheckEngineResponse response;
  response.set_engine_id(id);
  auto busy = [&](const EngineRecord& r) -> absl::Status {
    if (!r.updating) return absl::OkStatus();
    if (update_ != nullptr && update_->phase == Phase::kFailed) {
      return absl::FailedPreconditionError(absl::StrCat(
          "engine '", id, "' was being written by update '", update_->id,
          "', which failed and is not ended yet (by its trainer's Finish or "
          "Abort, the next Start, or the daemon within seconds); check it "
          "then"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "engine '", id, "' is being written by update '",
        update_ != nullptr ? update_->id : "", "'; check it after Finish"));
  };
  {
    absl::MutexLock lock(&mu_);
    auto it = engines_.find(id);
    if (it == engines_.end()) {
      return absl::NotFoundError(
          absl::StrCat("no engine '", id, "' is registered"));
    }
    WS_RETURN_IF_ERROR(busy(it->second));
    layout = it->second.layout;
    const v1::EngineStatus status = EngineStatusLocked(id, it->second);
    response.set_version(status.version());
    response.set_state(status.state());
  }
  absl::flat_hash_set<std::string> sources;
  for (const auto& [source, uses] : layout->uses_by_source) {
    sources.insert(source);
  }
  const absl::Time t0 = absl::Now();
  absl::StatusOr<v1::Receipt> receipt = ComputeReceipt(*layout, sources);
  if (receipt.status().code() == absl::StatusCode::kUnimplemented) {
    // GPU memory: the GPU worker reads it.
    receipt = mapper_->DeviceReceipt(*layout, sources,
                                     absl::Now() + options_.finish_timeout);
  }
  if (!receipt.ok()) {
    return absl::Status(
        receipt.status().code(),
        absl::StrCat("engine '", id, "': ", receipt.status().message()));
  }
  response.set_seconds(absl::ToDoubleSeconds(absl::Now() - t0));
  *response.mutable_receipt() = *std::move(receipt);
  absl::MutexLock lock(&mu_);
  auto it = engines_.find(id);
  if (it == engines_.end() || it->second.layout != layout ||
      it->second.version != response.version() || !busy(it->second).ok()) {
    return absl::AbortedError(absl::StrCat(
        "engine '", id,
        "' changed while it was read (an update or a new registration); "
        "check again"));
  }
  return response;
}

void Coordinator::Shutdown() {
  absl::MutexLock control(&control_mu_);
  bool active;
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    active = update_ != nullptr;
  }
  if (active) EndFailedUpdate(absl::AbortedError("daemon is shutting down"));
  absl::MutexLock lock(&mu_);
  engines_.clear();  // closes every mapping (last lease)
  last_plan_.reset();
  last_plan_layouts_.clear();
  data_plane_.reset();
}

}  // namespace weightsync
