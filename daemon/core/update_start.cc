// Coordinator: an update's start (StartWeightUpdate). It validates the
// request (ValidateStart, ResolveSource), selects the engines and checks
// their versions (SelectForStart), plans every byte before any moves
// (PlanStart; PlanFor keeps the last plan for the next identical update),
// pauses the engines and begins the data plane (PauseAndBegin), then
// installs the update (InstallUpdateLocked). The bytes that follow are in
// update_session.cc; the locking rules are coordinator.h's.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/echo.h"
#include "common/status_macros.h"
#include "daemon/core/coordinator.h"
#include "daemon/core/event_log.h"
#include "glog/logging.h"

namespace weightsync {

absl::StatusOr<v1::StartWeightUpdateResponse> Coordinator::StartWeightUpdate(
    const v1::StartWeightUpdateRequest& request) {
  absl::MutexLock control(&control_mu_);
  StartState s;
  s.t_entry = absl::Now();
  WS_RETURN_IF_ERROR(ValidateStart(request, s));
  WS_RETURN_IF_ERROR(ResolveSource(request, s));
  if (s.manifest->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "update '", Echo(request.update_id()),
        "' sends no tensors: an update moves at least one tensor (a version "
        "is a set of weights, not a counter)"));
  }
  NoteTrainerCall();
  // A failed update that nobody ended (its trainer gone) can never
  // complete: a new Start supersedes it.
  EndIfFailed("StartWeightUpdate");
  if (!request.plan_only()) {
    WS_RETURN_IF_ERROR(TakeOver(
        request.take_over_update_id(),
        absl::StrCat("a new trainer's Start of '", request.update_id(), "'")));
  }
  WS_RETURN_IF_ERROR(SelectForStart(request, s));
  WS_RETURN_IF_ERROR(PlanStart(request, s));
  if (request.plan_only()) return StartResponse(request, s);
  WS_RETURN_IF_ERROR(PauseAndBegin(request, s));

  absl::MutexLock lock(&mu_);
  InstallUpdateLocked(request, s);
  LOG(INFO) << Event("update.started", request.update_id(),
                     request.target_version(), absl::StrJoin(s.ids, ","))
            << (s.staged ? "staged, " : "streaming, ") << s.manifest->size()
            << " tensors (" << s.plan->unused.size() << " unused), "
            << s.plan->chunks.total_bytes << " bytes in "
            << s.plan->chunks.chunks.size() << " chunks";
  return StartResponse(request, s);
}

v1::StartWeightUpdateResponse Coordinator::StartResponse(
    const v1::StartWeightUpdateRequest& request, const StartState& s) {
  v1::StartWeightUpdateResponse response;
  response.set_update_id(request.update_id());
  response.set_total_bytes(s.plan->chunks.total_bytes);
  response.set_num_chunks(s.plan->chunks.chunks.size());
  response.set_chunk_bytes(s.chunk_bytes);
  response.set_mode(s.staged ? v1::UPDATE_MODE_STAGED
                             : v1::UPDATE_MODE_STREAMING);
  for (const std::string& id : s.ids) response.add_engine_ids(id);
  for (const std::string& t : s.plan->unused) response.add_unused_tensors(t);
  response.set_stream_omits_unused(s.unused == UnusedTensors::kOmit);
  return response;
}

absl::Status Coordinator::ValidateStart(
    const v1::StartWeightUpdateRequest& request, StartState& s) const {
  if (request.update_id().empty() || request.update_id().size() > 256) {
    return absl::InvalidArgumentError("update_id must be 1-256 characters");
  }
  if (request.target_version() <= 0 || request.target_version() > kMaxVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target_version ", request.target_version(), " is outside [1, ",
        kMaxVersion, "] (docs/protocol.md, \"Versions\")"));
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
  if (request.chunk_bytes() != 0) {
    s.chunk_bytes = request.chunk_bytes();
  } else {
    absl::MutexLock lock(&mu_);
    s.chunk_bytes = backend_ == v1::BACKEND_NCCL
                        ? options_.default_nccl_chunk_bytes
                        : options_.default_chunk_bytes;
  }
  if (s.chunk_bytes > options_.max_chunk_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_bytes ",
                                                   s.chunk_bytes,
                                                   " is above the daemon's "
                                                   "limit of ",
                                                   options_.max_chunk_bytes));
  }
  return absl::OkStatus();
}

int64_t Coordinator::FittingChunkBytes(const TransferPlan& plan,
                                       const std::vector<int32_t>& receivers,
                                       int64_t chunk_bytes) const {
  // The GPU worker stages the larger of its buffers and two rounds of
  // chunks, one from each sender with a link to the receiver
  // (backends/cuda/p2p_rounds.h): 256 senders at 64 MiB would want 32 GiB.
  int64_t links = 0;
  for (int32_t r : receivers) {
    int64_t n = 0;
    for (int32_t sender = 0; sender < plan.num_senders; ++sender) {
      if (r >= 0 && r < plan.num_receivers && !plan.links[sender][r].empty()) {
        ++n;
      }
    }
    links = std::max(links, n);
  }
  const int64_t buffers =
      std::max<int64_t>(options_.device_staging_buffers, 2 * links);
  const int64_t fits = options_.device_staging_budget_bytes /
                       std::max<int64_t>(buffers, 1) / 256 * 256;
  return std::max<int64_t>(256, std::min(chunk_bytes, fits));
}

absl::Status Coordinator::ResolveSource(
    const v1::StartWeightUpdateRequest& request, StartState& s) {
  s.manifest = &request.tensors();
  if (!request.transfer_plan_id().empty()) {
    if (request.tensors_size() != 0 || !request.source_id().empty() ||
        request.has_ipc_source() || request.finish()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "update '", request.update_id(), "' names transfer plan '",
          Echo(request.transfer_plan_id()),
          "': its tensors are the plan's; leave tensors, source_id, "
          "ipc_source and finish unset"));
    }
    absl::MutexLock lock(&mu_);
    for (const TransferPlanEntry& e : transfer_plans_) {
      if (e.plan->id != request.transfer_plan_id()) continue;
      s.transfer = e.plan;
      s.receivers = e.receivers;
      s.manifest = &e.plan->manifest;
      if (request.chunk_bytes() == 0 && backend_ == v1::BACKEND_NCCL) {
        s.chunk_bytes = FittingChunkBytes(
            *e.plan, e.receivers,
            senders_on_this_host_ ? options_.default_plan_chunk_bytes
                                  : options_.default_nccl_chunk_bytes);
      }
      return absl::OkStatus();
    }
    return absl::NotFoundError(absl::StrCat(
        "no transfer plan '", Echo(request.transfer_plan_id()),
        "' (the group was re-Initialised or the plan dropped): register it "
        "again with RegisterTransferPlan"));
  }
  if (request.finish() && request.plan_only()) {
    return absl::InvalidArgumentError(
        "plan_only opens no update, so it can't finish one: leave finish "
        "unset");
  }
  if (request.source_id().empty()) {
    if (request.finish()) {
      return absl::InvalidArgumentError(
          "finish (one-call update) needs a source_id of a source with "
          "registered memory");
    }
    return absl::OkStatus();
  }
  if (request.tensors_size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "update '", request.update_id(), "' names source '",
        request.source_id().substr(0, 64), "' and lists ",
        request.tensors_size(),
        " tensors; a source update takes its tensors from the source"));
  }
  WS_ASSIGN_OR_RETURN(s.source, sources_.Find(request.source_id()));
  if (s.source->has_memory() &&
      (request.has_ipc_source() || request.ipc_ring_slots() != 0)) {
    return absl::InvalidArgumentError(
        "an update from a source with registered memory copies from the "
        "trainer's tensors: leave ipc_source and ipc_ring_slots unset");
  }
  if (s.source->has_memory() && request.mode() == v1::UPDATE_MODE_STAGED) {
    return absl::InvalidArgumentError(
        "staged updates don't copy from registered memory yet; send the "
        "staged update with ipc_source (the packed path)");
  }
  if (request.finish() && !s.source->has_memory()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "finish (one-call update) needs a source with registered memory; "
        "source '",
        s.source->id, "' is a manifest only: send its bytes, then Finish"));
  }
  s.manifest = &s.source->manifest;
  return absl::OkStatus();
}

absl::Status Coordinator::SelectForStart(
    const v1::StartWeightUpdateRequest& request, StartState& s) {
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
  WS_ASSIGN_OR_RETURN(
      s.ids, SelectReachableEngines(request.engine_ids(), &s.left_out));
  bool sparse = request.plan_sparse_size() > 0;
  for (const v1::TensorSpec& t : request.tensors()) {
    sparse = sparse || t.sparse_nnz() > 0;
  }
  for (const std::string& id : s.ids) {
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
      return absl::FailedPreconditionError(absl::StrCat(
          "target version ", request.target_version(), " is not above engine '",
          id, "' version ", r.version, "; versions only go up"));
    }
    s.layouts.push_back(r.layout);
    if (!r.paused) s.to_pause.push_back(id);
  }
  s.plane = data_plane_;
  return absl::OkStatus();
}

absl::Status Coordinator::PlanStart(const v1::StartWeightUpdateRequest& request,
                                    StartState& s) {
  // Planning and the pause come first: time enough to wake the data plane
  // for Begin (GPU: ~0.4 ms of a call after idle time).
  DataPlane& plane = *s.plane;
  plane.Warm();
  if (request.ipc_ring_slots() != 0 && plane.name() != "ipc") {
    return absl::InvalidArgumentError(
        absl::StrCat("ipc_ring_slots is for the ipc backend; this group uses ",
                     plane.name()));
  }
  // Several daemons share one manifest: each skips what its engines don't
  // use. Bytes this daemon is sent alone (PushChunks) leave those tensors
  // out of its stream; bytes that reach it anyway (NCCL broadcasts) or that
  // it reads in place (a source's memory) are planned but copied nowhere.
  if (request.skip_unused()) {
    const bool sent_as_chunks =
        !plane.ReceivesOwnBytes() &&
        (s.source == nullptr || !s.source->has_memory());
    s.unused = sent_as_chunks ? UnusedTensors::kOmit : UnusedTensors::kSkip;
  }
  // Plan every byte before moving any (invariant 2).
  if (s.transfer != nullptr) {
    // The patches of links to this daemon's receiver(s); the others are
    // other daemons'.
    std::vector<LinkPatch> patches;
    for (const v1::PlanSparsePiece& p : request.plan_sparse()) {
      if (p.receiver() < 0 || p.receiver() >= s.transfer->num_receivers) {
        return absl::InvalidArgumentError(
            absl::StrCat("update '", request.update_id(),
                         "': a plan_sparse entry names "
                         "receiver ",
                         p.receiver(), "; transfer plan '", s.transfer->id,
                         "' has ", s.transfer->num_receivers));
      }
      if (std::find(s.receivers.begin(), s.receivers.end(), p.receiver()) ==
          s.receivers.end()) {
        continue;
      }
      patches.push_back({p.sender(), p.piece(), p.nnz(),
                         p.index_bytes() == 0 ? 8 : p.index_bytes()});
    }
    // FP8 on the wire: the tensors every sender sends quantised.
    std::vector<WireTensor> wire;
    for (const v1::PlanWireTensor& w : request.plan_wire()) {
      wire.push_back({w.tensor(), w.quantization()});
    }
    if (!wire.empty() && !plane.TakesPlanFp8AndPatches()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "update '", request.update_id(), "' sends ", wire.size(),
          " tensors quantised through a transfer plan (plan_wire): the ",
          plane.name(),
          " backend does not take them yet (the host backend does); send "
          "them unquantised"));
    }
    WS_ASSIGN_OR_RETURN(LinkedCopyPlan linked,
                        LinkedPlanFor(*s.transfer, s.receivers, s.chunk_bytes,
                                      s.layouts, patches, wire));
    if (!linked.copy->sparse.empty() && !plane.TakesPlanFp8AndPatches()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "update '", request.update_id(), "' sends ", patches.size(),
          " pieces as sparse patches: the ", plane.name(),
          " backend does not apply the patches of many senders yet (the "
          "host backend does); send them dense"));
    }
    if (!linked.copy->quant.empty() && !plane.TakesPlanFp8AndPatches()) {
      const QuantTarget& q = linked.copy->quant[0];
      const EngineLayout& e = *linked.copy->engines[q.engine];
      return absl::FailedPreconditionError(absl::StrCat(
          "engine '", e.engine_id, "' parameter '",
          e.parameters[q.parameter].name, "' is an FP8 target: the ",
          plane.name(),
          " backend does not quantise the pieces of many senders yet (the "
          "host backend does); send it through an ordinary update"));
    }
    if (plane.ReceivesOwnBytes()) {
      // NCCL: each chunk comes from its link's sender (NCCL rank = the
      // plan's sender index), round r = chunk r of every link.
      DataPlane::ChunkSources sources;
      sources.sender.assign(linked.copy->chunks.chunks.size(), -1);
      sources.round.assign(linked.copy->chunks.chunks.size(), 0);
      for (const RoundChunk& c : ChunksByRound(linked)) {
        sources.sender[c.chunk] = c.sender;
        sources.round[c.chunk] = c.round;
      }
      WS_RETURN_IF_ERROR(
          plane.SetChunkSources(linked.copy, std::move(sources)));
      // This daemon's rank must not be one of the senders'.
      int32_t rank_offset;
      {
        absl::MutexLock lock(&mu_);
        rank_offset = rank_offset_;
      }
      if (rank_offset < s.transfer->num_senders) {
        return absl::FailedPreconditionError(absl::StrCat(
            "transfer plan '", s.transfer->id, "' has ",
            s.transfer->num_senders, " senders, NCCL ranks 0..",
            s.transfer->num_senders - 1, "; this daemon's rank_offset is ",
            rank_offset, ": InitWeightTransfer with rank_offset >= ",
            s.transfer->num_senders));
      }
    }
    s.plan = linked.copy;
    s.links = std::move(linked.links);
  } else {
    WS_ASSIGN_OR_RETURN(s.plan, PlanFor(*s.manifest, s.chunk_bytes, s.layouts,
                                        s.source.get(), s.unused));
  }
  s.staged = request.mode() == v1::UPDATE_MODE_STAGED;
  // Where bytes arrive by themselves (NCCL, IPC), the data plane stages them
  // in its own (GPU) memory, one chunk-sized buffer per chunk.
  s.device_staging = plane.ReceivesOwnBytes();
  if (s.staged && s.device_staging && plane.DeviceStagingBudget() < 0) {
    return absl::UnimplementedError(absl::StrCat(
        "staged updates on the ", plane.name(),
        " backend are not supported yet; use streaming, the nccl backend or "
        "the host backend"));
  }
  const int64_t staging_need =
      s.device_staging ? static_cast<int64_t>(s.plan->chunks.chunks.size()) *
                             s.plan->chunks.chunk_bytes
                       : s.plan->chunks.total_bytes;
  const int64_t staging_budget = s.device_staging
                                     ? plane.DeviceStagingBudget()
                                     : options_.staged_budget_bytes;
  if (s.staged && staging_need > staging_budget) {
    if (!request.allow_streaming_fallback()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "staged update '", request.update_id(), "' needs ", staging_need,
          " bytes of ", s.device_staging ? "GPU " : "",
          "staging; the budget is ", staging_budget,
          " (allow_streaming_fallback to stream instead)"));
    }
    LOG(INFO) << Event("update.fallback", request.update_id(),
                       request.target_version())
              << "over the staging budget, falling back to streaming";
    s.staged = false;
  }
  return absl::OkStatus();
}

absl::Status Coordinator::PauseAndBegin(
    const v1::StartWeightUpdateRequest& request, StartState& s) {
  // Streaming writes into live memory: pause the engines first (an IPC data
  // plane starts copying as soon as Begin returns). Staged updates pause
  // only for their commit.
  if (s.staged) s.to_pause.clear();
  s.t_planned = absl::Now();
  WS_ASSIGN_OR_RETURN(s.paused,
                      PauseAll(s.to_pause, v1::PAUSE_MODE_KEEP,
                               absl::Now() + options_.notice_timeout,
                               absl::StrCat("could not pause for update '",
                                            request.update_id(), "'")));
  s.t_paused = absl::Now();
  // Staging may refuse the budget: then nothing moved, and the engines this
  // call paused serve again.
  const absl::Status begun =
      s.source != nullptr && s.source->has_memory()
          ? s.plane->BeginFromSource(s.plan, request, *s.source)
      : !s.staged        ? s.plane->Begin(s.plan, request)
      : s.device_staging ? s.plane->BeginStaged(s.plan, request)
                         : absl::OkStatus();
  s.t_begun = absl::Now();
  if (!begun.ok()) {
    hub_.Broadcast(s.paused, ResumeNotice(),
                   absl::Now() + options_.notice_timeout);
    return begun;
  }
  return absl::OkStatus();
}

void Coordinator::InstallUpdateLocked(
    const v1::StartWeightUpdateRequest& request, const StartState& s) {
  auto update = std::make_unique<Update>();
  update->id = request.update_id();
  update->target_version = request.target_version();
  update->plan = s.plan;
  update->engine_ids = s.ids;
  update->lost.assign(s.ids.size(), false);
  update->lost_why.assign(s.ids.size(), "");
  update->left_out = s.left_out;
  update->data_plane = s.plane;
  update->started = s.t_entry;
  update->last_activity = absl::Now();
  update->ipc_ring_slots = request.ipc_ring_slots();
  update->begun = s.t_begun;
  update->timings.set_validate_s(
      absl::ToDoubleSeconds(s.t_planned - s.t_entry));
  update->timings.set_pause_s(absl::ToDoubleSeconds(s.t_paused - s.t_planned));
  update->timings.set_begin_s(absl::ToDoubleSeconds(s.t_begun - s.t_paused));
  update->staged = s.staged;
  update->device_staged = s.staged && s.device_staging;
  // Receipts are on unless the trainer turns them off (VERIFY_OFF), on
  // every backend (docs/protocol.md, "Receipts").
  update->verify = request.verify() != v1::VERIFY_OFF;
  update->source = s.source;
  for (const LinkChunks& l : s.links) update->links.push_back({l, 0, false});
  update->bytes_by_plane = s.plane->ReceivesOwnBytes() ||
                           (s.source != nullptr && s.source->has_memory());
  if (s.staged && !s.device_staging) {
    update->staged_chunks.resize(s.plan->chunks.chunks.size());
    update->request = request;
  } else if (s.staged) {
    update->request = request;
  } else {
    update->paused_at = s.t_paused;
  }
  // Lost before it is marked as receiving: an engine that left while the
  // pause reached it (its removal may come later).
  MarkLeftWhilePausedLocked(*update, s.to_pause, s.paused, "the update");
  for (size_t i = 0; i < s.ids.size(); ++i) {
    if (update->lost[i]) continue;
    auto it = engines_.find(s.ids[i]);
    // Gone since the snapshot (or replaced by a new registration).
    if (it == engines_.end() || it->second.layout != s.layouts[i]) {
      update->lost[i] = true;
      if (auto w = removed_why_.find(s.ids[i]); w != removed_why_.end()) {
        update->lost_why[i] = w->second;
      }
      s.plane->MarkEngineLost(i);
      continue;
    }
    if (s.staged) continue;  // the engines serve on until the commit
    EngineRecord& r = it->second;
    r.updating = true;
    if (!r.paused) {
      SetPaused(r, true);
      r.paused_by_update = true;
    }
  }
  update_ = std::move(update);
  RecordUpdateStatusLocked("receiving");
}

absl::StatusOr<std::shared_ptr<const CopyPlan>> Coordinator::PlanFor(
    const Manifest& manifest, int64_t chunk_bytes,
    const std::vector<std::shared_ptr<const EngineLayout>>& layouts,
    const Source* source, UnusedTensors unused) {
  // An RL loop sends the same manifest to the same engines every step: the
  // plan is a pure function of (manifest, chunk size, layouts), so the last
  // one is reused when all three are identical (layouts by identity: a
  // re-registration makes a new layout).
  // A registered source's id names its manifest (ids are never reused
  // within a daemon's life), so its key costs nothing per tensor.
  std::string key;
  if (source != nullptr) {
    key = absl::StrCat("source ", source->id);
  } else {
    for (const v1::TensorSpec& t : manifest) {
      std::string bytes;
      t.SerializeToString(&bytes);
      absl::StrAppend(&key, bytes.size(), ":", bytes);
    }
  }
  absl::StrAppend(&key, "|", chunk_bytes, "|", static_cast<int>(unused));
  {
    absl::MutexLock lock(&mu_);
    if (last_plan_ != nullptr && key == last_plan_key_ &&
        layouts == last_plan_layouts_) {
      return last_plan_;
    }
  }
  WS_ASSIGN_OR_RETURN(std::shared_ptr<const CopyPlan> plan,
                      BuildCopyPlan(manifest, chunk_bytes, layouts, unused));
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

}  // namespace weightsync
