// The import of memory into the GPU worker: allocations it opens from
// CUDA IPC handles (GpuMapper), an update's IPC source (the trainer's
// buffer or ring), and the copy ops that read a registered source's
// regions.

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/cuda/quant_steps.h"
#include "backends/cuda/worker_client.h"
#include "common/status_macros.h"

namespace weightsync {
absl::StatusOr<std::shared_ptr<MappedRegion>> GpuMapper::Open(
    const v1::Allocation& allocation) {
  absl::StatusOr<int64_t> id = sup_->OpenAllocation(allocation);
  if (!id.ok()) return id.status();
  return std::shared_ptr<MappedRegion>(std::make_shared<GpuRegion>(
      sup_, *id, allocation.size(), allocation.device_uuid()));
}

absl::Status GpuDataPlane::SetIpcSource(
    const CopyPlan& plan, const v1::StartWeightUpdateRequest& request,
    const Source* source, worker::v1::BeginUpdateRequest* req) {
  if (source != nullptr) {
    if (request.has_ipc_source() || request.ipc_ring_slots() != 0) {
      return absl::InvalidArgumentError(
          "an update from a source with registered memory copies from the "
          "trainer's tensors: leave ipc_source and ipc_ring_slots unset");
    }
    req->set_ipc_registered_source(true);
    return absl::OkStatus();
  }
  const v1::Allocation& src = request.ipc_source();
  if ((src.kind() != v1::MEMORY_CUDA_IPC &&
       src.kind() != v1::MEMORY_CUDA_VMM) ||
      src.handle().empty()) {
    return absl::InvalidArgumentError(
        "the ipc backend needs ipc_source: the CUDA IPC handle (or CUDA "
        "VMM \"pid:fd\") of the trainer's packed update");
  }
  const int slots = request.ipc_ring_slots();
  if (slots < 0 || slots == 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ipc_ring_slots is ", slots, "; use 0 (whole update) or >= 2"));
  }
  const int64_t need =
      slots > 0 ? slots * plan.chunks.chunk_bytes : plan.chunks.total_bytes;
  if (src.size() < need) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ipc_source holds ", src.size(), " bytes; ",
        slots > 0 ? absl::StrCat(slots, " ring slots of ",
                                 plan.chunks.chunk_bytes, " bytes need ")
                  : std::string("the update packs "),
        need));
  }
  req->set_ipc_ring_slots(slots);
  req->set_ipc_source_handle(src.handle());
  req->set_ipc_source_size(src.size());
  req->set_ipc_source_uuid(src.device_uuid());
  req->set_ipc_source_vmm(src.kind() == v1::MEMORY_CUDA_VMM);
  return absl::OkStatus();
}

namespace {

// The worker's id of each of a source's regions.
absl::StatusOr<std::vector<int64_t>> SourceRegionIds(const Source* source) {
  std::vector<int64_t> ids;
  if (source == nullptr) return ids;
  for (const auto& r : source->regions) {
    const auto* region = dynamic_cast<const GpuRegion*>(r.get());
    if (region == nullptr) {
      return absl::InvalidArgumentError(
          "a registered source's memory is not GPU memory");
    }
    ids.push_back(region->id());
  }
  return ids;
}

// The worker's id of region `r` of engine `e` of `plan`: GPU memory only.
absl::StatusOr<int64_t> WorkerRegionId(const CopyPlan& plan, int32_t e,
                                       int32_t r, const std::string& backend) {
  const auto* region =
      dynamic_cast<const GpuRegion*>(plan.engines[e]->regions[r].get());
  if (region == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine '", plan.engines[e]->engine_id,
                     "' registered host memory; the ", backend,
                     " backend writes GPU memory"));
  }
  return region->id();
}

}  // namespace

absl::Status GpuDataPlane::SetOps(const std::shared_ptr<const CopyPlan>& plan,
                                  const v1::StartWeightUpdateRequest& request,
                                  const Source* source, bool staged, bool reuse,
                                  int64_t quant_window,
                                  worker::v1::BeginUpdateRequest* req) {
  req->clear_ops();
  req->clear_receipts();
  req->clear_receipt_after_chunk();
  req->set_ops_id(0);
  req->set_reuse_ops(false);
  // Receipts (the GPU backends verify only when asked: VERIFY_ON) are
  // computed by the worker chunk by chunk, overlapping the transfer.
  const bool receipts =
      request.verify() == v1::VERIFY_ON && !plan->chunks.chunks.empty();
  // Only a registered source's streaming update names its ops.
  const bool named = source != nullptr && !staged;
  WS_ASSIGN_OR_RETURN(std::vector<int64_t> ids, SourceRegionIds(source));
  if (named && reuse && ops_id_ != 0 && ops_plan_.lock() == plan &&
      ops_sources_ == ids && ops_receipts_ == receipts &&
      ops_quant_window_ == quant_window) {
    req->set_ops_id(ops_id_);
    req->set_reuse_ops(true);
    absl::MutexLock lock(&mu_);
    inflight_receipts_ = ops_receipt_counts_;
    return absl::OkStatus();
  }
  WS_RETURN_IF_ERROR(AddOps(*plan, source, req));
  const bool whole = WholeSource(staged, *req);
  if (whole) MergeContiguousOps(req);
  WS_RETURN_IF_ERROR(AddQuantSteps(
      *plan, quant_window, whole,
      [&](int32_t e, int32_t r) -> absl::StatusOr<int64_t> {
        return WorkerRegionId(*plan, e, r, name());
      },
      source, ids, req));
  if (receipts) WS_RETURN_IF_ERROR(AddReceipts(*plan, request, req));
  ops_plan_.reset();
  ops_id_ = 0;
  if (named) {
    ops_plan_ = plan;
    ops_sources_ = std::move(ids);
    ops_receipts_ = receipts;
    ops_quant_window_ = quant_window;
    absl::MutexLock lock(&mu_);
    ops_receipt_counts_ = inflight_receipts_;
    ops_id_ = next_ops_id_++;
    req->set_ops_id(ops_id_);
  }
  return absl::OkStatus();
}

absl::Status GpuDataPlane::AddOps(const CopyPlan& plan, const Source* source,
                                  worker::v1::BeginUpdateRequest* req) {
  // The worker's id of each source region.
  WS_ASSIGN_OR_RETURN(std::vector<int64_t> source_ids, SourceRegionIds(source));
  for (size_t k = 0; k < plan.ops_by_chunk.size(); ++k) {
    for (const CopyOp& op : plan.ops_by_chunk[k]) {
      const auto* region = dynamic_cast<const GpuRegion*>(
          plan.engines[op.engine]->regions[op.region].get());
      if (region == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "engine '", plan.engines[op.engine]->engine_id,
            "' registered host memory; the nccl backend writes GPU memory"));
      }
      worker::v1::GpuOp g;
      g.set_chunk(k);
      g.set_allocation_id(region->id());
      g.set_src_offset(op.src_offset);
      g.set_src_stride(op.src_stride);
      g.set_dst_offset(op.dst_offset);
      g.set_dst_stride(op.dst_stride);
      g.set_rows(op.rows);
      g.set_cols(op.cols);
      g.set_src_dtype(op.src_dtype);
      g.set_dst_dtype(op.dst_dtype);
      if (source == nullptr) {
        *req->add_ops() = std::move(g);
      } else {
        WS_RETURN_IF_ERROR(SplitSourceOp(plan.chunks, *source, source_ids, k,
                                         std::move(g), req));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace weightsync
