// GpuWorker's receipts: summed as an update goes (PrepareReceipts,
// EnqueueReceiptsAfter, CopyReceiptsOut) or on request (ComputeReceipts),
// over regions validated against the open allocations. Fused where the
// update allows (fused_receipts.h): the copies copy and sum in one pass
// (ReceiptCopyBatch), the direct quant kernel sums the FP8 weights and
// scales it writes; anything else falls back to the copies, the quant
// steps, then a pass that reads back every region (ReceiptSumBatch).
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/gpu_worker.h"
#include "backends/cuda/receipt_kernels.h"
#include "common/grpc_status.h"

namespace weightsync {

absl::Status GpuWorker::PrepareReceipts(
    const worker::v1::BeginUpdateRequest& held,
    const worker::v1::BeginUpdateRequest& request, bool may_fuse) {
  const worker::v1::ComputeReceiptsRequest& rr = held.receipts();
  uint64_t generation;
  {
    absl::MutexLock lock(&mu_);
    generation = allocations_generation_;
  }
  may_fuse = may_fuse && fused_receipts_;
  const int64_t chunks = request.chunk_sizes_size();
  if (rr.groups() > 0 && request.reuse_ops() &&
      receipts_ops_id_ == held.ops_id() && receipts_generation_ == generation &&
      receipts_may_fuse_ == may_fuse && receipt_groups_ == rr.groups() &&
      static_cast<int64_t>(receipt_batches_.size()) == chunks) {
    // The same ops into the same allocations: the tables on the device
    // (and the direct jobs' receipt fields) are this update's. Only the
    // sums start again.
    WS_CUDA(cudaSetDevice(scatter_device_));
    WS_CUDA(cudaMemsetAsync(receipt_dev_, 0, sizeof(uint64_t) * rr.groups(),
                            scatter_stream_));
    return absl::OkStatus();
  }
  receipt_batches_.clear();
  receipt_groups_ = 0;
  receipts_fused_ = false;
  receipts_ops_id_ = 0;
  // No direct job adds into sums of an earlier plan (receipts off, not
  // fused, or receipt_dev_ moved): fields cleared, set again below.
  for (cuda::DirectJob& job : direct_jobs_) job.receipt = cuda::DirectReceipt{};
  direct_upload_ = direct_upload_ || !direct_jobs_.empty();
  if (rr.groups() == 0) return absl::OkStatus();
  if (held.receipt_after_chunk_size() != rr.regions_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        rr.regions_size(), " receipt regions but ",
        held.receipt_after_chunk_size(), " receipt_after_chunk entries"));
  }
  std::vector<cuda::ReceiptRegion> regions;
  std::vector<int32_t> group_of;
  absl::Status s = ResolveReceiptRegions(rr, &regions, &group_of);
  if (!s.ok()) return s;
  std::vector<int64_t> chunk_of(held.receipt_after_chunk().begin(),
                                held.receipt_after_chunk().end());
  cuda::FusedReceiptPlan fused;
  if (may_fuse &&
      PlanFusedCopies(held, request.chunk_bytes(), regions, group_of, &fused)) {
    regions.swap(fused.copies);
    group_of.swap(fused.copy_group);
    chunk_of.swap(fused.copy_chunk);
    receipts_fused_ = true;
  }
  absl::Status uploaded =
      UploadReceiptBatches(regions, group_of, chunk_of, chunks, rr.groups());
  if (!uploaded.ok()) return uploaded;
  if (receipts_fused_) {
    // The direct jobs add into their group's sum (receipt_dev_ starts with
    // the sums; UploadReceiptBatches sized it).
    auto* sums = reinterpret_cast<unsigned long long*>(receipt_dev_);
    for (size_t i = 0; i < direct_jobs_.size(); ++i) {
      if (fused.direct_group[i] < 0) continue;
      direct_jobs_[i].receipt = fused.direct[i];
      direct_jobs_[i].receipt.out = sums + fused.direct_group[i];
    }
  }
  receipt_groups_ = rr.groups();
  if (held.ops_id() != 0) {
    receipts_ops_id_ = held.ops_id();
    receipts_generation_ = generation;
    receipts_may_fuse_ = may_fuse;
  }
  return absl::OkStatus();
}

absl::Status GpuWorker::UploadReceiptBatches(
    const std::vector<cuda::ReceiptRegion>& regions,
    const std::vector<int32_t>& group_of, const std::vector<int64_t>& chunk_of,
    int64_t chunks, int groups) {
  // Regions in chunk order, each chunk's batch planned on its own.
  std::vector<std::vector<int>> by_chunk(chunks);
  for (size_t i = 0; i < regions.size(); ++i) {
    const int64_t k = chunk_of[i];
    if (k < 0 || k >= chunks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "receipt region ", i, " follows chunk ", k, " of ", chunks));
    }
    by_chunk[k].push_back(i);
  }
  const int64_t sum_bytes = sizeof(uint64_t) * groups;
  const int64_t need = sum_bytes + sizeof(cuda::ReceiptRegion) * regions.size();
  WS_CUDA(cudaSetDevice(scatter_device_));
  absl::Status grown = Grow(&receipt_dev_, &receipt_dev_bytes_, need, false);
  if (grown.ok()) {
    grown = Grow(&receipt_host_, &receipt_host_bytes_, sum_bytes, true);
  }
  if (!grown.ok()) return grown;
  auto* out = reinterpret_cast<unsigned long long*>(receipt_dev_);
  std::vector<cuda::ReceiptRegion> ordered;
  ordered.reserve(regions.size());
  receipt_batches_.assign(chunks, ReceiptBatch());
  for (int64_t k = 0; k < chunks; ++k) {
    ReceiptBatch& b = receipt_batches_[k];
    b.first = ordered.size();
    for (int i : by_chunk[k]) {
      ordered.push_back(regions[i]);
      ordered.back().out = out + group_of[i];
    }
    b.count = ordered.size() - b.first;
    if (b.count == 0) continue;
    b.tiles = cuda::PlanReceiptRegions(ordered.data() + b.first, b.count);
    if (b.tiles < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("a receipt region after chunk ", k,
                       " is not readable as planned (alignment, stride)"));
    }
  }
  WS_CUDA(cudaMemsetAsync(out, 0, sum_bytes, scatter_stream_));
  if (!ordered.empty()) {
    // Synchronous: `ordered` is a local.
    WS_CUDA(cudaMemcpy(receipt_dev_ + sum_bytes, ordered.data(),
                       sizeof(cuda::ReceiptRegion) * ordered.size(),
                       cudaMemcpyHostToDevice));
  }
  return absl::OkStatus();
}

bool GpuWorker::PlanFusedCopies(const worker::v1::BeginUpdateRequest& held,
                                int64_t chunk_bytes,
                                const std::vector<cuda::ReceiptRegion>& regions,
                                const std::vector<int32_t>& group_of,
                                cuda::FusedReceiptPlan* plan) {
  std::vector<cuda::FusedCopyOp> ops;
  ops.reserve(held.ops_size());
  {
    absl::MutexLock lock(&mu_);
    for (const worker::v1::GpuOp& o : held.ops()) {
      if (o.src_dtype() != o.dst_dtype()) return false;
      if (o.rows() <= 0 || o.cols() <= 0) continue;
      auto dst_alloc = allocations_.find(o.allocation_id());
      if (dst_alloc == allocations_.end()) return false;
      const uint8_t* src;
      if (o.src_allocation_id() != 0) {
        auto it = allocations_.find(o.src_allocation_id());
        if (it == allocations_.end()) return false;
        src = it->second.ptr + o.src_offset();
      } else if (ipc_source_ != nullptr) {
        src = ipc_source_ + o.chunk() * chunk_bytes + o.src_offset();
      } else {
        return false;
      }
      ops.push_back({src, dst_alloc->second.ptr + o.dst_offset(), o.rows(),
                     o.cols(), o.src_stride(), o.dst_stride(),
                     static_cast<int32_t>(cuda::DTypeSize(o.dst_dtype())),
                     o.chunk()});
    }
  }
  // direct_jobs_: the held ops' direct quant steps (PrepareQuant ran).
  return cuda::PlanFusedReceipts(regions, group_of, ops, direct_jobs_, plan);
}

absl::Status GpuWorker::EnqueueReceiptsAfter(int64_t k) {
  if (receipt_groups_ == 0 ||
      k >= static_cast<int64_t>(receipt_batches_.size())) {
    return absl::OkStatus();
  }
  const ReceiptBatch& b = receipt_batches_[k];
  if (b.count == 0) return absl::OkStatus();
  const auto* regions = reinterpret_cast<const cuda::ReceiptRegion*>(
      receipt_dev_ + sizeof(uint64_t) * receipt_groups_);
  if (receipts_fused_) {
    WS_CUDA(cuda::ReceiptCopyBatch(regions + b.first, b.count, b.tiles,
                                   scatter_stream_));
  } else {
    WS_CUDA(cuda::ReceiptSumBatch(regions + b.first, b.count, b.tiles,
                                  scatter_stream_));
  }
  return absl::OkStatus();
}

absl::Status GpuWorker::CopyReceiptsOut() {
  if (receipt_groups_ == 0) return absl::OkStatus();
  WS_CUDA(cudaMemcpyAsync(receipt_host_, receipt_dev_,
                          sizeof(uint64_t) * receipt_groups_,
                          cudaMemcpyDeviceToHost, scatter_stream_));
  return absl::OkStatus();
}

absl::Status GpuWorker::ResolveReceiptRegions(
    const worker::v1::ComputeReceiptsRequest& request,
    std::vector<cuda::ReceiptRegion>* regions, std::vector<int32_t>* group_of) {
  const int groups = request.groups();
  if (groups < 0 || groups > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("groups is ", groups, "; use 0 to 2^20"));
  }
  regions->clear();
  group_of->clear();
  regions->reserve(request.regions_size());
  {
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < request.regions_size(); ++i) {
      const worker::v1::ReceiptRegionSpec& g = request.regions(i);
      const int64_t es = g.element_size();
      auto it = allocations_.find(g.allocation_id());
      if (it == allocations_.end()) {
        return absl::NotFoundError(
            absl::StrCat("receipt region ", i, ": allocation ",
                         g.allocation_id(), " is not open in the worker"));
      }
      constexpr int64_t kMax = int64_t{1} << 40;
      if (g.group() < 0 || g.group() >= groups ||
          (es != 1 && es != 2 && es != 4 && es != 8) || g.rows() < 0 ||
          g.cols() < 0 || g.rows() > kMax || g.cols() > kMax ||
          g.offset() < 0 || g.row_stride_bytes() < 0 ||
          g.row_stride_bytes() > kMax) {
        return absl::InvalidArgumentError(
            absl::StrCat("receipt region ", i, " is malformed (group ",
                         g.group(), " of ", groups, ", element size ", es, ", ",
                         g.rows(), " x ", g.cols(), ")"));
      }
      if (g.rows() > 0 && g.cols() > 0) {
        const int64_t end =
            g.offset() + (g.rows() - 1) * g.row_stride_bytes() + g.cols() * es;
        if (end > it->second.size) {
          return absl::InvalidArgumentError(absl::StrCat(
              "receipt region ", i, " ends at byte ", end, " of allocation ",
              g.allocation_id(), " (", it->second.size, " bytes)"));
        }
      }
      cuda::ReceiptRegion r{};
      r.base = it->second.ptr + g.offset();
      r.rows = g.rows();
      r.cols = g.cols();
      r.row_stride_bytes = g.row_stride_bytes();
      r.salt = g.salt();
      r.first_index = g.first_index();
      r.es = static_cast<int32_t>(es);
      regions->push_back(r);
      group_of->push_back(g.group());
    }
  }
  return absl::OkStatus();
}

grpc::Status GpuWorker::ComputeReceipts(
    grpc::ServerContext* ctx, const worker::v1::ComputeReceiptsRequest* request,
    worker::v1::ComputeReceiptsResponse* response) {
  const int groups = request->groups();
  // Validated against the open allocations before anything reaches CUDA.
  std::vector<cuda::ReceiptRegion> regions;
  std::vector<int32_t> group_of;
  absl::Status resolved = ResolveReceiptRegions(*request, &regions, &group_of);
  if (!resolved.ok()) return ToGrpcStatus(resolved);
  std::vector<uint64_t> sums(groups, 0);
  float ms = 0;
  absl::Status s = owner_.Run(
      [&]() -> absl::Status {
        if (groups == 0) return absl::OkStatus();
        absl::Status st = EnsureStreams();
        if (!st.ok()) return st;
        WS_CUDA(cudaSetDevice(scatter_device_));
        const size_t sum_bytes = sizeof(uint64_t) * groups;
        const size_t region_bytes =
            sizeof(cuda::ReceiptRegion) * regions.size();
        void* mem = nullptr;
        // Sums first: the regions array after them stays 8-byte aligned.
        WS_CUDA(cudaMalloc(&mem, sum_bytes + region_bytes));
        absl::Cleanup free_mem = [&] {
          cudaStreamSynchronize(scatter_stream_);
          cudaFree(mem);
        };
        auto* out = static_cast<unsigned long long*>(mem);
        auto* dev_regions = reinterpret_cast<cuda::ReceiptRegion*>(
            static_cast<uint8_t*>(mem) + sum_bytes);
        for (size_t i = 0; i < regions.size(); ++i) {
          regions[i].out = out + group_of[i];
        }
        const int64_t tiles =
            cuda::PlanReceiptRegions(regions.data(), regions.size());
        if (tiles < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("receipt region ", -1 - tiles,
                           " is not readable as planned (alignment, stride)"));
        }
        cudaEvent_t t0, t1;
        WS_CUDA(cudaEventCreate(&t0));
        WS_CUDA(cudaEventCreate(&t1));
        absl::Cleanup free_events = [&] {
          cudaEventDestroy(t0);
          cudaEventDestroy(t1);
        };
        WS_CUDA(cudaMemsetAsync(out, 0, sum_bytes, scatter_stream_));
        if (region_bytes > 0) {
          WS_CUDA(cudaMemcpyAsync(dev_regions, regions.data(), region_bytes,
                                  cudaMemcpyHostToDevice, scatter_stream_));
        }
        WS_CUDA(cudaEventRecord(t0, scatter_stream_));
        WS_CUDA(cuda::ReceiptSumBatch(dev_regions, regions.size(), tiles,
                                      scatter_stream_));
        WS_CUDA(cudaEventRecord(t1, scatter_stream_));
        WS_CUDA(cudaMemcpyAsync(sums.data(), out, sum_bytes,
                                cudaMemcpyDeviceToHost, scatter_stream_));
        WS_CUDA(cudaStreamSynchronize(scatter_stream_));
        cudaEventElapsedTime(&ms, t0, t1);
        return absl::OkStatus();
      },
      Deadline(ctx));
  if (!s.ok()) return ToGrpcStatus(s);
  for (uint64_t v : sums) response->add_sums(v);
  response->set_device_seconds(ms / 1e3);
  return grpc::Status::OK;
}

}  // namespace weightsync
