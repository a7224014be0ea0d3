// Coordinator: its life (construction, the watchdog thread, Shutdown), the
// engine registry and the engines' control streams, the transfer group,
// status and CheckEngine. Pause and resume are in pause.cc, registered
// sources in sources.cc, an update in the update_*.cc files (coordinator.h
// says which); the locking rules are coordinator.h's.
#include "daemon/core/coordinator.h"

#include <algorithm>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "daemon/core/event_log.h"
#include "daemon/core/nccl_version.h"
#include "daemon/core/parameter_table.h"
#include "daemon/core/receipt.h"
#include "glog/logging.h"

namespace weightsync {

// A caller's deadline, capped so no request can hold the control lock
// (and delay shutdown) for long.
absl::Time Coordinator::DeadlineFrom(int64_t timeout_ms,
                                     absl::Duration fallback) {
  constexpr int64_t kMaxMs = 10 * 60 * 1000;
  return absl::Now() + (timeout_ms > 0
                            ? absl::Milliseconds(std::min(timeout_ms, kMaxMs))
                            : fallback);
}

v1::DaemonMessage Coordinator::ResumeNotice() {
  v1::DaemonMessage m;
  m.mutable_resume();
  return m;
}

SourceLimits Coordinator::SourceLimitsOf(const CoordinatorOptions& o) {
  SourceLimits l;  // sources are bounded like manifests and registrations
  l.max_tensors = o.max_manifest_tensors;
  l.max_rank = CoordinatorOptions::kMaxTensorRank;
  l.max_name_length = o.limits.max_name_length;
  l.max_allocations = o.limits.max_allocations;
  return l;
}

Coordinator::Coordinator(CoordinatorOptions options,
                         std::shared_ptr<MemoryMapper> mapper,
                         std::shared_ptr<DataPlaneFactory> data_planes)
    : options_(std::move(options)),
      mapper_(std::move(mapper)),
      data_planes_(std::move(data_planes)),
      sources_(SourceLimitsOf(options_)) {
  if (options_.update_idle_timeout > absl::ZeroDuration() ||
      options_.engine_start_grace > absl::ZeroDuration()) {
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

void Coordinator::NoteTrainerCall() {
  absl::MutexLock lock(&mu_);
  last_trainer_call_ = absl::Now();
  if (update_ != nullptr) update_->last_activity = last_trainer_call_;
}

// ---------------------------------------------------------------- engines

absl::StatusOr<v1::RegisterEngineResponse> Coordinator::RegisterEngine(
    const v1::RegisterEngineRequest& request) {
  const absl::Time start = absl::Now();
  // Validate and open memory without the lock: it touches the OS.
  WS_ASSIGN_OR_RETURN(std::shared_ptr<const EngineLayout> layout,
                      BuildEngineLayout(request, *mapper_, options_.limits));
  // The copy of the parameters (GetStatus's layouts) is made, and the
  // record this one replaces freed, outside mu_: at 100k parameters either
  // takes tens of milliseconds, which every other call would wait out.
  google::protobuf::RepeatedPtrField<v1::Parameter> parameters =
      request.parameters();
  EngineRecord replaced;  // destroyed after the lock is released
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("daemon is shutting down");
  const std::string& id = request.engine_id();
  if (auto it = engines_.find(id); it != engines_.end()) {
    if (hub_.Connected(id)) {
      return absl::AlreadyExistsError(
          absl::StrCat("engine '", id,
                       "' is registered and its control stream is open; "
                       "unregister it first"));
    }
    replaced = std::move(it->second);
    RemoveEngineLocked(id, "re-registered");
  }
  removed_why_.erase(id);
  EngineRecord& r = engines_[id];
  r.layout = layout;
  // Unique across daemon restarts too: clients cache layouts by this id.
  r.layout_id = absl::StrCat("layout-", layout_prefix_, "-", ++next_layout_);
  r.parameters.Swap(&parameters);
  r.version = request.version();
  r.registered_at = absl::Now();
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
            << layout->total_bytes << " bytes in "
            << absl::ToDoubleMilliseconds(absl::Now() - start) << " ms"
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
  removed_why_[engine_id] = why;
  // A cached plan holds the layouts, and so the engine's mappings.
  last_plan_.reset();
  last_plan_layouts_.clear();
  LOG(INFO) << Event("engine.removed", "", -1, engine_id) << why;
  if (update_ == nullptr) return;
  for (size_t i = 0; i < update_->engine_ids.size(); ++i) {
    if (update_->engine_ids[i] == engine_id && !update_->lost[i]) {
      update_->lost[i] = true;
      update_->lost_why[i] = why;
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
  if (hub_.Connected(engine_id)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "engine '", engine_id,
        "' already has a control stream open; one stream speaks for an "
        "engine (close it, or unregister and register again)"));
  }
  hub_.Attach(engine_id, std::move(channel));
  return absl::OkStatus();
}

bool Coordinator::DetachControl(const std::string& engine_id,
                                const ControlChannel* ch) {
  // False once the engine was unregistered (and perhaps registered again).
  if (!hub_.Detach(engine_id, ch)) return false;
  absl::MutexLock lock(&mu_);
  if (!engines_.contains(engine_id)) return false;
  RemoveEngineLocked(engine_id, "control stream closed");
  return true;
}

bool Coordinator::EngineLost(const std::string& engine_id,
                             const std::string& reason) {
  absl::MutexLock lock(&mu_);
  if (!engines_.contains(engine_id)) return false;
  LOG(WARNING) << Event("engine.lost_memory", "",
                        engines_.at(engine_id).version, engine_id)
               << reason;
  RemoveEngineLocked(
      engine_id,
      absl::StrCat("engine '", engine_id,
                   "' reported that its registered memory is no longer its "
                   "weights (",
                   reason,
                   "); it was unregistered: register the engine's weights "
                   "again (unregister before freeing them)"));
  hub_.DetachEngine(engine_id);
  return true;
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
  WS_RETURN_IF_ERROR(TakeOver(request.take_over_update_id(),
                              "a new trainer's InitWeightTransfer"));
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
  if (request.backend() == v1::BACKEND_NCCL) {
    // Before the worker joins a communicator that might hang.
    WS_RETURN_IF_ERROR(CheckNcclVersions(request.nccl_version(),
                                         options_.nccl_version,
                                         options_.allow_nccl_version_mismatch));
    if (request.nccl_version() != 0 && options_.nccl_version != 0 &&
        !CheckNcclVersions(request.nccl_version(), options_.nccl_version,
                           /*allow_mismatch=*/false)
             .ok()) {
      LOG(WARNING) << Event("group.nccl_mismatch") << "trainer NCCL "
                   << NcclVersionString(request.nccl_version())
                   << ", daemon NCCL "
                   << NcclVersionString(options_.nccl_version)
                   << ": allowed by --allow_nccl_version_mismatch";
    }
  }
  WS_ASSIGN_OR_RETURN(std::shared_ptr<DataPlane> plane,
                      data_planes_->Create(request));
  // A new group: the old one's sources (and their memory) go.
  sources_.Clear();
  absl::MutexLock lock(&mu_);
  transfer_plans_.clear();  // so do its transfer plans
  backend_ = request.backend();
  rank_offset_ = request.rank_offset();
  senders_on_this_host_ = request.senders_on_this_host();
  data_plane_ = std::move(plane);
  v1::InitWeightTransferResponse response;
  response.set_group_id(
      absl::StrFormat("%016x", absl::Uniform<uint64_t>(absl::BitGen())));
  group_id_ = response.group_id();
  response.set_local_world_size(data_planes_->LocalWorldSize(backend_));
  response.set_build_info(options_.build_info);
  LOG(INFO) << Event("group.formed") << "transfer group " << response.group_id()
            << " on " << data_plane_->name() << ", world size "
            << request.world_size();
  return response;
}

v1::GetWorldSizeResponse Coordinator::GetWorldSize(
    const v1::GetWorldSizeRequest& request) {
  absl::MutexLock lock(&mu_);
  // A trainer lays out the ranks of several daemons before it forms the
  // group, so it asks for a backend.
  const v1::Backend backend = request.backend() != v1::BACKEND_UNSPECIFIED
                                  ? request.backend()
                                  : backend_;
  v1::GetWorldSizeResponse response;
  response.set_world_size(backend == v1::BACKEND_UNSPECIFIED
                              ? 0
                              : data_planes_->LocalWorldSize(backend));
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
  s.set_layout_id(r.layout_id);
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
    if (include_layouts) {
      const EngineRecord& r = engines_.at(id);
      *e->mutable_layout() = r.parameters;
      // The parameter_table's rows, as the messages they stand for.
      AppendParameterMessages(*r.layout, r.parameters.size(),
                              e->mutable_layout());
    }
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
  response.set_version(kVersion);
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

absl::StatusOr<v1::CheckEngineResponse> Coordinator::CheckEngine(
    const v1::CheckEngineRequest& request) {
  const std::string& id = request.engine_id();
  std::shared_ptr<const EngineLayout> layout;
  // The read this call runs (and shares), or the running one it waits for.
  std::shared_ptr<EngineRead> mine, joined;
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
    std::shared_ptr<EngineRead>& slot = engine_reads_[id];
    if (slot == nullptr) {
      slot = std::make_shared<EngineRead>();
      slot->layout = layout.get();
      slot->version = response.version();
      mine = slot;
    } else if (slot->layout == layout.get() &&
               slot->version == response.version()) {
      joined = slot;
    }  // else a read of what the engine was still runs: read on our own
  }
  absl::StatusOr<v1::Receipt> receipt;
  double seconds = 0;
  if (joined != nullptr) {
    joined->done.WaitForNotification();
    receipt = joined->receipt;
    seconds = joined->seconds;
  } else {
    absl::flat_hash_set<std::string> sources;
    for (const auto& [source, uses] : layout->uses_by_source) {
      sources.emplace(source);
    }
    const absl::Time t0 = absl::Now();
    const auto read = [&] { receipt = ComputeReceipt(*layout, sources); };
    if (engine_read_runner_) {
      engine_read_runner_(read);
    } else {
      read();
    }
    if (receipt.status().code() == absl::StatusCode::kUnimplemented) {
      // GPU memory: the GPU worker reads it.
      receipt = mapper_->DeviceReceipt(*layout, sources,
                                       absl::Now() + options_.finish_timeout);
    }
    seconds = absl::ToDoubleSeconds(absl::Now() - t0);
    if (mine != nullptr) {
      mine->receipt = receipt;
      mine->seconds = seconds;
      {
        absl::MutexLock lock(&mu_);
        auto it = engine_reads_.find(id);
        if (it != engine_reads_.end() && it->second == mine) {
          engine_reads_.erase(it);
        }
      }
      mine->done.Notify();
    }
  }
  if (!receipt.ok()) {
    if (AnyRegionFaulted(*layout)) {
      absl::MutexLock lock(&mu_);
      DropFaultedLocked(id, layout.get());
    }
    return absl::Status(
        receipt.status().code(),
        absl::StrCat("engine '", id, "': ", receipt.status().message()));
  }
  response.set_seconds(seconds);
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
  sources_.Clear();
  absl::MutexLock lock(&mu_);
  engines_.clear();  // closes every mapping (last lease)
  last_plan_.reset();
  last_plan_layouts_.clear();
  last_linked_ = LinkedCopyPlan();
  last_linked_layouts_.clear();
  transfer_plans_.clear();
  data_plane_.reset();
}

}  // namespace weightsync
