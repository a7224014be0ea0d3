// GpuWorker's IPC backend: the trainer's shared buffer (mapped, and the
// last few kept), a whole update copied straight out of it, and ring mode
// (CopyChunk, WaitChunks), where chunks are copied as the trainer announces
// them.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/gpu_worker.h"
#include "common/grpc_status.h"

namespace weightsync {

absl::Status GpuWorker::EnqueueIpcUpdate(
    const worker::v1::BeginUpdateRequest& request) {
  WS_CUDA(cudaSetDevice(scatter_device_));
  absl::flat_hash_map<int64_t, Allocation> allocs;
  {
    absl::MutexLock lock(&mu_);
    allocs = allocations_;
  }
  // Straight from the trainer's packed buffer into engine memory: no
  // staging, and same-dtype copies run on the copy engines (no SMs).
  // Ops the worker holds from an earlier request (reuse_ops), else the
  // request's own.
  const worker::v1::BeginUpdateRequest& ops =
      request.reuse_ops() ? held_ops_ : request;
  absl::Status batch = PrepareBatch(ops.ops_size());
  if (!batch.ok()) return batch;
  int op = 0;
  WS_CUDA(cudaEventRecord(first_op_, scatter_stream_));
  // The direct quant steps read only the source, whole from the start, and
  // write only FP8 targets: they run on their own stream, beside the
  // chunks' copies (the copy engines, or kernels sharing the SMs), from the
  // first op on, and join back before the chunk they were planned in (the
  // last: its receipts may read what they wrote). The join is enqueued on
  // every path, so whatever waits for scatter_stream_ waits for them too.
  int64_t join_at = -1;
  if (direct_next_batch_ < direct_batches_.size()) {
    join_at = direct_batches_[direct_next_batch_].chunk;
    WS_CUDA(cudaStreamWaitEvent(quant_stream_, first_op_, 0));
    absl::Status d = EnqueueDirect(-1, quant_stream_);
    WS_CUDA(cudaEventRecord(quant_done_, quant_stream_));
    if (!d.ok()) {
      WS_CUDA(cudaStreamWaitEvent(scatter_stream_, quant_done_, 0));
      return d;
    }
  }
  auto join = [&]() -> absl::Status {
    if (join_at < 0) return absl::OkStatus();
    join_at = -1;
    WS_CUDA(cudaStreamWaitEvent(scatter_stream_, quant_done_, 0));
    return absl::OkStatus();
  };
  for (int64_t k = 0; k < request.chunk_sizes_size(); ++k) {
    // A registered source has no packed buffer: its ops name their source.
    const uint8_t* chunk = ipc_source_ == nullptr
                               ? nullptr
                               : ipc_source_ + k * request.chunk_bytes();
    absl::Status s = k >= join_at && join_at >= 0 ? join() : absl::OkStatus();
    if (s.ok()) s = EnqueueChunkOps(ops, k, chunk, allocs, sm_copies_, &op);
    if (s.ok()) s = EnqueueChunkQuant(ops, k, chunk, allocs);
    if (s.ok())
      s = EnqueueChunkSparse(request, k, chunk, allocs, /*apply=*/true);
    if (s.ok()) s = EnqueueReceiptsAfter(k);
    if (!s.ok()) {
      join().IgnoreError();
      return s;
    }
  }
  absl::Status joined = join();
  if (!joined.ok()) return joined;
  absl::Status out = CopyReportsOut();
  if (out.ok()) out = CopyReceiptsOut();
  if (!out.ok()) return out;
  WS_CUDA(cudaEventRecord(last_op_, scatter_stream_));
  WS_CUDA(cudaEventRecord(all_done_, scatter_stream_));
  return absl::OkStatus();
}

absl::Status GpuWorker::OpenIpcSource(
    const worker::v1::BeginUpdateRequest& request) {
  for (size_t i = 0; i < ipc_sources_.size(); ++i) {
    if (ipc_sources_[i].handle == request.ipc_source_handle() &&
        ipc_sources_[i].size == request.ipc_source_size()) {
      std::rotate(ipc_sources_.begin() + i, ipc_sources_.begin() + i + 1,
                  ipc_sources_.end());
      ipc_source_ = ipc_sources_.back().mapping.ptr;
      return absl::OkStatus();
    }
  }
  ipc_source_ = nullptr;
  if (ipc_sources_.size() >= kIpcSources) {
    cudaSetDevice(scatter_device_);
    if (scatter_stream_ != nullptr) cudaStreamSynchronize(scatter_stream_);
    if (recv_stream_ != nullptr) cudaStreamSynchronize(recv_stream_);
    Unmap(&ipc_sources_.front().mapping);
    ipc_sources_.erase(ipc_sources_.begin());
  }
  absl::StatusOr<Allocation> m =
      MapShared(request.ipc_source_handle(), request.ipc_source_size(),
                request.ipc_source_vmm());
  if (!m.ok()) {
    return absl::Status(m.status().code(),
                        absl::StrCat("ipc_source: ", m.status().message()));
  }
  ipc_sources_.push_back(
      {request.ipc_source_handle(), request.ipc_source_size(), *m});
  ipc_source_ = m->ptr;
  return absl::OkStatus();
}

void GpuWorker::CloseIpcSource() {
  ipc_source_ = nullptr;
  if (ipc_sources_.empty()) return;
  cudaSetDevice(scatter_device_);
  if (scatter_stream_ != nullptr) cudaStreamSynchronize(scatter_stream_);
  if (recv_stream_ != nullptr) cudaStreamSynchronize(recv_stream_);
  for (IpcSource& source : ipc_sources_) Unmap(&source.mapping);
  ipc_sources_.clear();
}

grpc::Status GpuWorker::CopyChunk(grpc::ServerContext* ctx,
                                  const worker::v1::CopyChunkRequest* request,
                                  worker::v1::Empty*) {
  return ToGrpcStatus(owner_.Run(
      [&]() -> absl::Status {
        const int64_t k = request->chunk();
        if (!update_active_ || ring_.ipc_ring_slots() == 0) {
          return absl::FailedPreconditionError(
              "no IPC ring update in progress");
        }
        if (k != ring_next_chunk_ || k >= ring_.chunk_sizes_size()) {
          return absl::InvalidArgumentError(
              absl::StrCat("chunk ", k, " announced; expected ",
                           ring_next_chunk_, " of ", ring_.chunk_sizes_size()));
        }
        WS_CUDA(cudaSetDevice(scatter_device_));
        absl::flat_hash_map<int64_t, Allocation> allocs;
        {
          absl::MutexLock lock(&mu_);
          allocs = allocations_;
        }
        const int slot = k % ring_.ipc_ring_slots();
        const uint8_t* in = ipc_source_ + slot * ring_.chunk_bytes();
        absl::Status s;
        if (ring_.staged()) {
          // Into staging (and a patch's piece assembled and checked);
          // engine memory waits for CommitStaged.
          WS_CUDA(cudaMemcpyAsync(staging_[k], in, ring_.chunk_sizes(k),
                                  cudaMemcpyDeviceToDevice, scatter_stream_));
          if (sparse_next_piece_ < ring_.sparse_pieces_size() &&
              ring_.sparse_pieces(sparse_next_piece_).chunk() == k) {
            s = EnqueueChunkSparse(ring_, k, staging_[k], {}, false);
          }
        } else {
          if (k == 0) WS_CUDA(cudaEventRecord(first_op_, scatter_stream_));
          s = EnqueueChunk(ring_, k, in, allocs, sm_copies_, &ring_next_op_);
        }
        if (!s.ok()) return s;
        WS_CUDA(cudaEventRecord(slot_done_[slot], scatter_stream_));
        ++ring_next_chunk_;
        ring_enqueued_ = ring_next_chunk_;
        if (ring_next_chunk_ == ring_.chunk_sizes_size()) {
          s = CopyReportsOut();
          if (s.ok() && !ring_.staged()) s = CopyReceiptsOut();
          if (!s.ok()) return s;
          if (ring_.staged()) {
            WS_CUDA(cudaEventRecord(received_, scatter_stream_));
          } else {
            WS_CUDA(cudaEventRecord(last_op_, scatter_stream_));
            WS_CUDA(cudaEventRecord(all_done_, scatter_stream_));
          }
          absl::MutexLock lock(&enqueue_mu_);
          enqueue_done_ = true;
        }
        return absl::OkStatus();
      },
      Deadline(ctx)));
}

grpc::Status GpuWorker::WaitChunks(grpc::ServerContext* ctx,
                                   const worker::v1::WaitChunksRequest* request,
                                   worker::v1::WaitChunksResponse* response) {
  const absl::Time deadline =
      std::min(Deadline(ctx),
               absl::Now() + absl::Milliseconds(request->timeout_ms() > 0
                                                    ? request->timeout_ms()
                                                    : 60000));
  const int64_t n = request->chunks();
  const int slots = ring_slots_.load();
  if (!update_active_ || slots == 0) {
    return ToGrpcStatus(
        absl::FailedPreconditionError("no IPC ring update in progress"));
  }
  if (n <= 0) return grpc::Status::OK;
  // Slot (n-1) % slots holds chunk n-1 until chunk n-1+slots is announced,
  // which the trainer does only after this answer.
  if (n > ring_enqueued_.load() || n + slots <= ring_enqueued_.load()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("wait for ", n, " chunks with ", ring_enqueued_.load(),
                     " announced and ", slots, " slots")));
  }
  while (true) {
    const cudaError_t e = cudaEventQuery(slot_done_[(n - 1) % slots]);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) return ToGrpcStatus(CudaStatus(e, "copy"));
    if (abort_requested_) {
      return ToGrpcStatus(absl::AbortedError("update aborted"));
    }
    if (absl::Now() > deadline) {
      return ToGrpcStatus(absl::DeadlineExceededError(
          absl::StrCat("chunk ", n - 1, " not copied before the deadline")));
    }
    absl::SleepFor(absl::Microseconds(10));
  }
  response->set_chunks_done(n);
  return grpc::Status::OK;
}

}  // namespace weightsync
