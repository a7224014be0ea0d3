// Plan submission: an update's copy plan turned into the worker's
// BeginUpdate (chunk ops, quant steps, staging), then its chunks, drain,
// staged commit and abort.

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/cuda/p2p_rounds.h"
#include "backends/cuda/quant_steps.h"
#include "backends/cuda/worker_client.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace weightsync {
absl::Status GpuDataPlane::Begin(std::shared_ptr<const CopyPlan> plan,
                                 const v1::StartWeightUpdateRequest& request) {
  return BeginImpl(std::move(plan), request, /*staged=*/false, nullptr);
}

absl::Status GpuDataPlane::BeginFromSource(
    std::shared_ptr<const CopyPlan> plan,
    const v1::StartWeightUpdateRequest& request, const Source& source) {
  if (backend_ != v1::BACKEND_IPC || !source.has_memory()) {
    return absl::InvalidArgumentError(
        "only the ipc backend copies from a source's registered memory");
  }
  return BeginImpl(std::move(plan), request, /*staged=*/false, &source);
}

absl::Status GpuDataPlane::BeginStaged(
    std::shared_ptr<const CopyPlan> plan,
    const v1::StartWeightUpdateRequest& request) {
  return BeginImpl(std::move(plan), request, /*staged=*/true, nullptr);
}

// NCCL and IPC alike: a staged update is copied into GPU staging, one
// chunk-sized buffer per chunk, before the commit writes engine memory.
int64_t GpuDataPlane::DeviceStagingBudget() const {
  return sup_->options().staging_budget;
}

absl::Status GpuDataPlane::WaitStaged(absl::Time deadline) {
  return sup_->WaitUpdate(deadline, /*received_only=*/true).status();
}

absl::Status GpuDataPlane::CommitStaged(absl::Time deadline) {
  return sup_->CommitStaged(deadline);
}

namespace {

// The quant steps' window (quant_steps.h): kQuantWindowBytes where the
// scratch fits the staging budget beside `staging`, else one row of blocks
// per use; RESOURCE_EXHAUSTED where even that does not fit.
// `whole`, `source`: as for AddQuantSteps (direct uses need no scratch).
absl::StatusOr<int64_t> QuantWindow(const CopyPlan& plan, int64_t staging,
                                    int64_t budget, bool whole,
                                    const Source* source) {
  if (plan.quant.empty()) return 0;
  if (staging + QuantScratchBytes(plan, kQuantWindowBytes, whole, source) <=
      budget) {
    return kQuantWindowBytes;
  }
  const int64_t least = QuantScratchBytes(plan, 0, whole, source);
  if (staging + least <= budget) return 0;
  return absl::ResourceExhaustedError(absl::StrCat(
      "GPU staging of ", staging, " bytes and ", least,
      " bytes of FP8 targets' rows of blocks (float32) exceed the budget of ",
      budget,
      "; use a smaller chunk_bytes or raise --gpu_staging_budget_bytes"));
}

}  // namespace

absl::Status GpuDataPlane::SetChunkSources(std::shared_ptr<const CopyPlan> plan,
                                           ChunkSources sources) {
  if (backend_ != v1::BACKEND_NCCL) return DataPlane::SetChunkSources(plan, {});
  absl::MutexLock lock(&mu_);
  sources_plan_ = std::move(plan);
  sources_ = std::move(sources);
  return absl::OkStatus();
}

absl::Status GpuDataPlane::BeginImpl(
    std::shared_ptr<const CopyPlan> plan,
    const v1::StartWeightUpdateRequest& request, bool staged,
    const Source* source) {
  const absl::Time t_entry = absl::Now();
  const auto& o = sup_->options();
  // M->N (a transfer plan's update): chunks from their senders, in rounds;
  // staging for two rounds of them. Taken for this plan's Begin only.
  ChunkSources sources;
  bool mton = false;
  {
    absl::MutexLock lock(&mu_);
    mton = sources_plan_ != nullptr && sources_plan_ == plan;
    if (mton) sources = std::move(sources_);
    sources_plan_ = nullptr;
    sources_ = ChunkSources();
  }
  if (mton && staged) {
    return absl::UnimplementedError(
        "staged updates of a transfer plan on the nccl backend: M->N "
        "updates stream (mode STREAMING)");
  }
  const int64_t buffers =
      mton ? std::max<int64_t>(o.staging_buffers,
                               2 * MaxChunksPerRound(sources.round))
           : o.staging_buffers;
  // Staged: one buffer per chunk, the whole update.
  const int64_t staging =
      (staged ? static_cast<int64_t>(plan->chunks.chunks.size()) : buffers) *
      plan->chunks.chunk_bytes;
  worker::v1::BeginUpdateRequest req;
  req.set_staged(staged);
  if (backend_ == v1::BACKEND_IPC) {
    WS_RETURN_IF_ERROR(SetIpcSource(*plan, request, source, &req));
  } else if (staging > o.staging_budget) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "GPU staging of ",
        staged ? static_cast<int64_t>(plan->chunks.chunks.size()) : buffers,
        " x ", plan->chunks.chunk_bytes, " bytes exceeds the budget of ",
        o.staging_budget, "; use a smaller chunk_bytes",
        mton ? " (M->N: two rounds of chunks, one from each sender)" : ""));
  }
  // GPU staging the worker holds for this update (ipc streaming copies
  // straight from the trainer's buffer).
  const int64_t held_staging =
      backend_ == v1::BACKEND_NCCL || staged ? staging : 0;
  // FP8 targets: their rows of blocks (float32) in the worker's scratch,
  // in windows of several rows of blocks where the budget allows.
  // Where the whole source is there from the start, FP8 uses are
  // quantised straight from it (direct quant steps, no scratch).
  const bool whole = WholeSource(staged, req);
  WS_ASSIGN_OR_RETURN(
      const int64_t quant_window,
      QuantWindow(*plan, held_staging, o.staging_budget, whole, source));
  staging_bytes_ =
      held_staging + QuantScratchBytes(*plan, quant_window, whole, source);
  req.set_chunk_bytes(plan->chunks.chunk_bytes);
  req.set_staging_buffers(buffers);
  for (const Chunk& c : plan->chunks.chunks) req.add_chunk_sizes(c.size);
  {
    absl::MutexLock lock(&mu_);
    inflight_plan_ = nullptr;
    inflight_receipts_ready_ = false;
    inflight_receipts_.clear();
  }
  WS_RETURN_IF_ERROR(SetOps(plan, request, source, staged, /*reuse=*/true,
                            quant_window, &req));
  if (mton) {
    WS_RETURN_IF_ERROR(OrderChunksByRound(sources.sender, sources.round, &req));
  }
  // Sparse patches: assembled, checked and applied by the worker on its GPU.
  int64_t sparse_bytes = 0;
  for (const SparsePatch& patch : plan->sparse) {
    worker::v1::GpuSparsePatch* g = req.add_sparse();
    g->set_name(patch.name);
    g->set_nnz(patch.nnz);
    g->set_numel(patch.numel);
    g->set_index_bytes(patch.index_bytes);
    g->set_dtype(patch.dtype);
    g->set_cols(patch.cols);
    g->set_payload_bytes(patch.payload_bytes);
    sparse_bytes += (patch.payload_bytes + 255) / 256 * 256 + 32;
    for (const SparsePatch::Use& u : patch.uses) {
      const auto* region = dynamic_cast<const GpuRegion*>(
          plan->engines[u.engine]->regions[u.region].get());
      if (region == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("engine '", plan->engines[u.engine]->engine_id,
                         "' registered host memory; the ", name(),
                         " backend writes GPU "
                         "memory"));
      }
      worker::v1::GpuSparseUse* gu = g->add_uses();
      gu->set_allocation_id(region->id());
      gu->set_param_offset(u.param_offset);
      gu->set_dtype(u.dtype);
      gu->set_implicit(u.implicit);
      gu->set_row_begin(u.row_begin);
      gu->set_row_count(u.row_count);
      gu->set_col_begin(u.col_begin);
      gu->set_col_count(u.col_count);
      gu->set_dest_offset(u.dest_offset);
      gu->set_dest_row_stride(u.dest_row_stride);
    }
  }
  for (size_t k = 0; k < plan->sparse_pieces_by_chunk.size(); ++k) {
    for (const auto& [si, piece] : plan->sparse_pieces_by_chunk[k]) {
      worker::v1::GpuSparsePiece* g = req.add_sparse_pieces();
      g->set_chunk(k);
      g->set_patch(si);
      g->set_chunk_offset(piece.chunk_offset);
      g->set_patch_offset(piece.tensor_offset);
      g->set_length(piece.length);
    }
  }
  // The patches' payloads live in the worker's GPU memory until applied:
  // they count against the staging budget.
  if (sparse_bytes > 0 &&
      (backend_ == v1::BACKEND_IPC ? 0 : staging) + sparse_bytes >
          o.staging_budget) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "GPU staging of ", backend_ == v1::BACKEND_IPC ? 0 : staging,
        " bytes plus ", sparse_bytes,
        " bytes of sparse patches exceeds the "
        "budget of ",
        o.staging_budget,
        "; send the denser tensors dense or raise --gpu_staging_budget_bytes"));
  }
  const bool verify = request.verify() == v1::VERIFY_ON;
  const absl::Time t_rpc = absl::Now();
  absl::Status s =
      sup_->BeginUpdate(req, absl::Now() + sup_->options().call_timeout);
  if (absl::IsNotFound(s) && req.reuse_ops()) {
    // A worker that doesn't hold the ops (it was restarted): send them.
    WS_RETURN_IF_ERROR(SetOps(plan, request, source, staged, /*reuse=*/false,
                              quant_window, &req));
    if (mton) {
      WS_RETURN_IF_ERROR(
          OrderChunksByRound(sources.sender, sources.round, &req));
    }
    s = sup_->BeginUpdate(req, absl::Now() + sup_->options().call_timeout);
  }
  if (!s.ok()) ops_plan_.reset();  // send them again next time
  VLOG(1) << "begin: request of " << req.ByteSizeLong() << " bytes built in "
          << absl::ToDoubleMilliseconds(t_rpc - t_entry)
          << " ms, the worker's BeginUpdate answered in "
          << absl::ToDoubleMilliseconds(absl::Now() - t_rpc) << " ms";
  absl::MutexLock lock(&mu_);
  if (verify && !plan->chunks.chunks.empty()) inflight_plan_ = plan.get();
  chunks_ = plan->chunks.chunks.size();
  written_ = 0;
  ring_slots_ = request.ipc_ring_slots();
  return s;
}

absl::Status GpuDataPlane::SubmitChunk(int64_t index, std::string data,
                                       absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    if (ring_slots_ == 0) {
      return absl::FailedPreconditionError(
          "this update uses a GPU backend: its bytes travel by NCCL or CUDA "
          "IPC, not PushChunks");
    }
  }
  if (!data.empty()) {
    return absl::InvalidArgumentError(
        "an IPC ring chunk carries no bytes: they are in the trainer's slot");
  }
  return sup_->CopyChunk(index, deadline);
}

absl::Status GpuDataPlane::WaitChunks(int64_t n, absl::Time deadline) {
  return sup_->WaitChunks(n, deadline);
}

absl::Status GpuDataPlane::Drain(absl::Time deadline) {
  absl::StatusOr<GpuWorkerSupervisor::Waited> s = sup_->WaitUpdate(deadline);
  if (!s.ok() && s.status().code() == absl::StatusCode::kInvalidArgument) {
    // A refused sparse patch: the transfer itself completed and the worker
    // ended the update; the communicator is intact.
    return s.status();
  }
  if (!s.ok()) {
    sup_->AbortUpdate(absl::Now() + absl::Seconds(5));
    return absl::AbortedError(
        absl::StrCat(name(), " transfer failed: ", s.status().message(),
                     backend_ == v1::BACKEND_NCCL
                         ? " (communicator aborted; InitWeightTransfer again)"
                         : ""));
  }
  absl::MutexLock lock(&mu_);
  written_ = chunks_;
  device_time_ = s->device;
  if (inflight_plan_ != nullptr) {
    if (s->receipt_sums.size() != inflight_receipts_.size()) {
      return absl::InternalError(absl::StrCat(
          "the GPU worker returned ", s->receipt_sums.size(),
          " receipt sums for ", inflight_receipts_.size(), " engines"));
    }
    for (size_t e = 0; e < inflight_receipts_.size(); ++e) {
      inflight_receipts_[e].set_checksum(s->receipt_sums[e]);
    }
    inflight_receipts_ready_ = true;
  }
  return absl::OkStatus();
}

absl::Duration GpuDataPlane::device_time() const {
  absl::MutexLock lock(&mu_);
  return device_time_;
}

void GpuDataPlane::Abort() {
  sup_->AbortUpdate(absl::Now() + absl::Seconds(5));
}

void GpuDataPlane::Cancel() {
  sup_->AbortUpdate(absl::Now() + absl::Seconds(5));
}

int64_t GpuDataPlane::chunks_written() const {
  absl::MutexLock lock(&mu_);
  return written_;
}

}  // namespace weightsync
