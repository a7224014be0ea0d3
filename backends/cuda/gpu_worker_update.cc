// GpuWorker's update life cycle: BeginUpdate, the NCCL pipeline through
// the staging buffers (streaming and staged), WaitUpdate, CommitStaged and
// AbortUpdate.
#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/gpu_worker.h"
#include "backends/cuda/scatter.h"
#include "common/grpc_status.h"
#include "glog/logging.h"

namespace weightsync {

absl::StatusOr<uint8_t*> GpuWorker::BaseOf(
    const absl::flat_hash_map<int64_t, Allocation>& allocs, int64_t id) {
  auto it = allocs.find(id);
  if (it == allocs.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("allocation ", id, " is not open in the worker"));
  }
  return it->second.ptr;
}

namespace {

// Same-dtype copies up to this size go into the batch kernel (one block
// each), whatever --sm_copies says: their SM time is tiny, and issuing each
// to the copy engines would cost more than moving the bytes.
constexpr int64_t kBatchedCopyBytes = int64_t{64} << 10;

}  // namespace

absl::Status GpuWorker::PrepareBatch(int64_t ops) {
  if (scatter_stream_ != nullptr) {
    WS_CUDA(cudaStreamSynchronize(scatter_stream_));
  }
  batch_used_ = 0;
  const int64_t bytes = ops * static_cast<int64_t>(sizeof(cuda::BatchCopy));
  absl::Status s = Grow(&batch_host_, &batch_host_bytes_, bytes, true);
  if (s.ok()) s = Grow(&batch_dev_, &batch_dev_bytes_, bytes, false);
  return s;
}

absl::Status GpuWorker::FlushBatch(int64_t n) {
  if (n == 0) return absl::OkStatus();
  WS_CUDA(cudaMemcpyAsync(batch_dev_ + batch_used_, batch_host_ + batch_used_,
                          n * sizeof(cuda::BatchCopy), cudaMemcpyHostToDevice,
                          scatter_stream_));
  WS_CUDA(cuda::CopyBatchWithSMs(batch_dev_ + batch_used_, n, scatter_stream_));
  batch_used_ += n;
  return absl::OkStatus();
}

absl::Status GpuWorker::EnqueueChunkOps(
    const worker::v1::BeginUpdateRequest& request, int64_t k,
    const uint8_t* chunk,
    const absl::flat_hash_map<int64_t, Allocation>& allocs, bool sm_copies,
    int* op) {
  if (receipts_fused_) {
    // EnqueueReceiptsAfter(k) copies this chunk's ops as it sums them.
    while (*op < request.ops_size() && request.ops(*op).chunk() == k) ++*op;
    return absl::OkStatus();
  }
  const int64_t capacity =
      batch_host_bytes_ / static_cast<int64_t>(sizeof(cuda::BatchCopy));
  int64_t pending = 0;  // batch entries not flushed yet
  for (; *op < request.ops_size() && request.ops(*op).chunk() == k; ++*op) {
    const worker::v1::GpuOp& o = request.ops(*op);
    absl::StatusOr<uint8_t*> base = BaseOf(allocs, o.allocation_id());
    if (!base.ok()) return base.status();
    uint8_t* dst = *base + o.dst_offset();
    // A registered source: the op reads the trainer's tensor in place.
    const uint8_t* src = chunk + o.src_offset();
    if (o.src_allocation_id() != 0) {
      absl::StatusOr<uint8_t*> from = BaseOf(allocs, o.src_allocation_id());
      if (!from.ok()) return from.status();
      src = *from + o.src_offset();
    }
    const bool same_dtype = o.src_dtype() == o.dst_dtype();
    const int64_t width = o.cols() * cuda::DTypeSize(o.src_dtype());
    if (same_dtype && width * o.rows() <= kBatchedCopyBytes &&
        batch_used_ + pending < capacity) {
      // Small: one batched kernel for all of them (a copy-engine transfer
      // costs ~5 us to issue; a mixture of experts has 100k of them).
      batch_host_[batch_used_ + pending++] = {
          src, dst, width, o.rows(), o.src_stride(), o.dst_stride()};
      continue;
    }
    absl::Status flushed = FlushBatch(pending);
    if (!flushed.ok()) return flushed;
    pending = 0;
    if (sm_copies_ && (ipc_source_ != nullptr || o.src_allocation_id() != 0) &&
        same_dtype) {
      WS_CUDA(cuda::CopyBytes2DWithSMs(src, o.src_stride(), dst, o.dst_stride(),
                                       width, o.rows(), scatter_stream_));
      continue;
    }
    WS_CUDA(cuda::CopyConvert2D(src, o.src_stride(), o.src_dtype(), dst,
                                o.dst_stride(), o.dst_dtype(), o.rows(),
                                o.cols(), scatter_stream_));
  }
  return FlushBatch(pending);
}

absl::Status GpuWorker::EnqueueChunk(
    const worker::v1::BeginUpdateRequest& request, int64_t k,
    const uint8_t* chunk,
    const absl::flat_hash_map<int64_t, Allocation>& allocs, bool sm_copies,
    int* op, const worker::v1::BeginUpdateRequest* ops) {
  const worker::v1::BeginUpdateRequest& held = ops != nullptr ? *ops : request;
  absl::Status s = EnqueueChunkOps(held, k, chunk, allocs, sm_copies, op);
  if (s.ok()) s = EnqueueChunkQuant(held, k, chunk, allocs);
  if (!s.ok()) return s;
  s = EnqueueChunkSparse(request, k, chunk, allocs, /*apply=*/true);
  if (!s.ok()) return s;
  return EnqueueReceiptsAfter(k);
}

absl::Status GpuWorker::EnsureStaging(int64_t chunk_bytes, int buffers,
                                      bool larger_ok) {
  if ((staging_chunk_ == chunk_bytes ||
       (larger_ok && staging_chunk_ > chunk_bytes)) &&
      static_cast<int>(staging_.size()) == buffers) {
    return absl::OkStatus();
  }
  WS_CUDA(cudaSetDevice(device_));
  WS_CUDA(cudaDeviceSynchronize());
  for (uint8_t* p : staging_) cudaFree(p);
  for (cudaEvent_t e : recv_done_) cudaEventDestroy(e);
  for (cudaEvent_t e : scatter_done_) cudaEventDestroy(e);
  staging_.clear();
  recv_done_.clear();
  scatter_done_.clear();
  staging_chunk_ = 0;
  for (int i = 0; i < buffers; ++i) {
    void* p = nullptr;
    WS_CUDA(cudaMalloc(&p, chunk_bytes));
    staging_.push_back(static_cast<uint8_t*>(p));
    cudaEvent_t r, s;
    WS_CUDA(cudaEventCreateWithFlags(&r, cudaEventDisableTiming));
    WS_CUDA(cudaEventCreateWithFlags(&s, cudaEventDisableTiming));
    recv_done_.push_back(r);
    scatter_done_.push_back(s);
  }
  staging_chunk_ = chunk_bytes;
  return absl::OkStatus();
}

absl::Status GpuWorker::EnqueueUpdate(
    const worker::v1::BeginUpdateRequest& request) {
  if (request.chunk_peers_size() > 0) return EnqueueP2pUpdate(request);
  // Other owner tasks (OpenAllocation) may have switched the device.
  WS_CUDA(cudaSetDevice(device_));
  absl::Status batch = PrepareBatch(request.ops_size());
  if (!batch.ok()) return batch;
  const int n = staging_.size();
  absl::flat_hash_map<int64_t, Allocation> allocs;
  {
    absl::MutexLock lock(&mu_);
    allocs = allocations_;
  }
  // Buffers start free: the first wait on each scatter_done is a no-op.
  for (int i = 0; i < n; ++i) {
    WS_CUDA(cudaEventRecord(scatter_done_[i], scatter_stream_));
  }
  int op = 0;
  WS_CUDA(cudaEventRecord(first_op_, recv_stream_));
  for (int64_t k = 0; k < request.chunk_sizes_size(); ++k) {
    const int b = k % n;
    uint8_t* buf = staging_[b];
    // Receive chunk k only once chunk k-n has left this buffer.
    WS_CUDA(cudaStreamWaitEvent(recv_stream_, scatter_done_[b], 0));
    absl::Status received = ReceiveChunk(buf, request.chunk_sizes(k));
    if (!received.ok()) return received;
    WS_CUDA(cudaEventRecord(recv_done_[b], recv_stream_));
    WS_CUDA(cudaStreamWaitEvent(scatter_stream_, recv_done_[b], 0));
    absl::Status s = EnqueueChunk(request, k, buf, allocs, false, &op);
    if (!s.ok()) return s;
    WS_CUDA(cudaEventRecord(scatter_done_[b], scatter_stream_));
  }
  absl::Status out = CopyReportsOut();
  if (out.ok()) out = CopyReceiptsOut();
  if (!out.ok()) return out;
  WS_CUDA(cudaEventRecord(last_op_, scatter_stream_));
  WS_CUDA(cudaEventRecord(all_done_, scatter_stream_));
  return absl::OkStatus();
}

absl::Status GpuWorker::ReceiveChunk(uint8_t* buf, int64_t bytes) {
  return AwaitEnqueue(
      ncclBroadcast(buf, buf, bytes, ncclUint8, 0, comm_, recv_stream_),
      "broadcast");
}

absl::Status GpuWorker::AwaitEnqueue(ncclResult_t r, const char* what) {
  WS_NCCL(r);
  if (r == ncclInProgress) {
    // Non-blocking communicator: the enqueue completes asynchronously (the
    // first one waits for the trainer to connect).
    const absl::Time deadline = absl::Now() + enqueue_timeout_;
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress) {
      WS_NCCL(ncclCommGetAsyncError(comm_, &state));
      if (state != ncclInProgress) break;
      if (abort_requested_) return absl::AbortedError("update aborted");
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            what, " enqueue timed out after ",
            absl::FormatDuration(enqueue_timeout_),
            " (InitWeightTransfer timeout_ms): is the trainer sending?"));
      }
      absl::SleepFor(absl::Microseconds(10));
    }
    WS_NCCL(state);
  }
  return absl::OkStatus();
}

absl::Status GpuWorker::EnqueueP2pUpdate(
    const worker::v1::BeginUpdateRequest& request) {
  WS_CUDA(cudaSetDevice(device_));
  absl::Status batch = PrepareBatch(request.ops_size());
  if (!batch.ok()) return batch;
  const int n = staging_.size();
  absl::flat_hash_map<int64_t, Allocation> allocs;
  {
    absl::MutexLock lock(&mu_);
    allocs = allocations_;
  }
  for (int i = 0; i < n; ++i) {
    WS_CUDA(cudaEventRecord(scatter_done_[i], scatter_stream_));
  }
  int op = 0;
  int64_t next_buf = 0;
  std::vector<int> buf_of;
  std::vector<uint8_t*> dst_of;
  WS_CUDA(cudaEventRecord(first_op_, recv_stream_));
  for (const P2pRound& round : p2p_.rounds) {
    buf_of.assign(round.end - round.first, -1);
    dst_of.assign(round.end - round.first, nullptr);
    for (int64_t k = round.first; k < round.end; ++k) {
      if (p2p_.direct[k]) {
        const worker::v1::GpuOp& o = request.ops(p2p_.direct_op[k]);
        absl::StatusOr<uint8_t*> base = BaseOf(allocs, o.allocation_id());
        if (!base.ok()) return base.status();
        dst_of[k - round.first] = *base + o.dst_offset();
        continue;
      }
      const int b = next_buf++ % n;
      buf_of[k - round.first] = b;
      dst_of[k - round.first] = staging_[b];
      // Into buffer b only once its previous chunk has left it.
      WS_CUDA(cudaStreamWaitEvent(recv_stream_, scatter_done_[b], 0));
    }
    WS_NCCL(ncclGroupStart());
    for (int64_t k = round.first; k < round.end; ++k) {
      const ncclResult_t r =
          ncclRecv(dst_of[k - round.first], request.chunk_sizes(k), ncclUint8,
                   request.chunk_peers(k), comm_, recv_stream_);
      if (r != ncclSuccess && r != ncclInProgress) {
        ncclGroupEnd();
        WS_NCCL(r);
      }
    }
    absl::Status received = AwaitEnqueue(ncclGroupEnd(), "receive");
    if (!received.ok()) return received;
    WS_CUDA(cudaEventRecord(round_done_, recv_stream_));
    WS_CUDA(cudaStreamWaitEvent(scatter_stream_, round_done_, 0));
    for (int64_t k = round.first; k < round.end; ++k) {
      const int b = buf_of[k - round.first];
      if (b < 0) {
        // Received in place: its one op is done; the regions it completes
        // are summed now (the scatter stream waited for the round).
        while (op < request.ops_size() && request.ops(op).chunk() == k) ++op;
        absl::Status summed = EnqueueReceiptsAfter(k);
        if (!summed.ok()) return summed;
        continue;
      }
      absl::Status s =
          EnqueueChunk(request, k, staging_[b], allocs, false, &op);
      if (!s.ok()) return s;
      WS_CUDA(cudaEventRecord(scatter_done_[b], scatter_stream_));
    }
  }
  absl::Status out = CopyReportsOut();
  if (out.ok()) out = CopyReceiptsOut();
  if (!out.ok()) return out;
  WS_CUDA(cudaEventRecord(last_op_, scatter_stream_));
  WS_CUDA(cudaEventRecord(all_done_, scatter_stream_));
  return absl::OkStatus();
}

absl::Status GpuWorker::EnqueueStagedReceive(
    const worker::v1::BeginUpdateRequest& request) {
  WS_CUDA(cudaSetDevice(device_));
  // Every chunk has its own buffer: nothing waits for a scatter, and engine
  // memory is not touched until CommitStaged. Sparse payloads are assembled
  // and their indices checked as their chunks arrive (scatter stream), so
  // that a bad patch is refused before the commit.
  // IPC (the whole update shared): each chunk is copied out of the
  // trainer's buffer instead of broadcast.
  const absl::flat_hash_map<int64_t, Allocation> none;
  const bool ipc = !request.ipc_source_handle().empty();
  for (int64_t k = 0; k < request.chunk_sizes_size(); ++k) {
    uint8_t* buf = staging_[k];
    if (ipc) {
      WS_CUDA(cudaMemcpyAsync(buf, ipc_source_ + k * request.chunk_bytes(),
                              request.chunk_sizes(k), cudaMemcpyDeviceToDevice,
                              recv_stream_));
    } else {
      absl::Status received = ReceiveChunk(buf, request.chunk_sizes(k));
      if (!received.ok()) return received;
    }
    if (sparse_next_piece_ < request.sparse_pieces_size() &&
        request.sparse_pieces(sparse_next_piece_).chunk() == k) {
      WS_CUDA(cudaEventRecord(recv_done_[k], recv_stream_));
      WS_CUDA(cudaStreamWaitEvent(scatter_stream_, recv_done_[k], 0));
      absl::Status s = EnqueueChunkSparse(request, k, buf, none, false);
      if (!s.ok()) return s;
    }
  }
  WS_CUDA(cudaEventRecord(received_, recv_stream_));
  if (request.sparse_size() > 0) {
    WS_CUDA(cudaStreamWaitEvent(scatter_stream_, received_, 0));
    absl::Status s = CopyReportsOut();
    if (!s.ok()) return s;
    WS_CUDA(cudaEventRecord(received_, scatter_stream_));
  }
  return absl::OkStatus();
}

grpc::Status GpuWorker::BeginUpdate(
    grpc::ServerContext* ctx, const worker::v1::BeginUpdateRequest* request,
    worker::v1::Empty*) {
  const absl::Time deadline = Deadline(ctx);
  const absl::Time t_call = absl::Now();
  const absl::Cleanup answered = [t_call] {
    VLOG(1) << "BeginUpdate answers after "
            << absl::ToDoubleMilliseconds(absl::Now() - t_call) << " ms";
  };
  return ToGrpcStatus(owner_.Run(
      [&]() -> absl::Status {
        return BeginOnOwner(*request, deadline, t_call);
      },
      deadline));
}

absl::Status GpuWorker::BeginOnOwner(
    const worker::v1::BeginUpdateRequest& request, absl::Time deadline,
    absl::Time t_call) {
  if (update_active_) {
    return absl::FailedPreconditionError("an update is in progress");
  }
  const absl::Time t_run = absl::Now();
  const bool ipc =
      !request.ipc_source_handle().empty() || request.ipc_registered_source();
  if (request.reuse_ops() &&
      (!request.ipc_registered_source() || request.ops_size() != 0 ||
       request.ops_id() == 0 || request.ops_id() != held_ops_id_)) {
    return absl::NotFoundError(absl::StrCat("the worker holds no ops ",
                                            request.ops_id(), ": send them"));
  }
  if (request.chunk_peers_size() > 0) {
    // M->N: refused here, before anything is enqueued, if the rounds or
    // peers are wrong (p2p_rounds.h).
    absl::flat_hash_map<int64_t, Allocation> allocs;
    {
      absl::MutexLock lock(&mu_);
      allocs = allocations_;
    }
    if (comm_ == nullptr) {
      return absl::FailedPreconditionError("no NCCL group: InitGroup first");
    }
    absl::StatusOr<P2pSchedule> sched =
        PlanP2pRounds(request, world_size_, rank_, [&](int64_t id) {
          auto it = allocs.find(id);
          return it != allocs.end() && it->second.device == device_;
        });
    if (!sched.ok()) return sched.status();
    p2p_ = *std::move(sched);
    VLOG(1) << "M->N update: " << p2p_.rounds.size() << " rounds, "
            << p2p_.staged_chunks << " chunks staged, " << p2p_.direct_bytes
            << " bytes received in place";
  }
  if (!request.reuse_ops() && request.ops_id() != 0) {
    held_ops_ = request;
    held_ops_id_ = request.ops_id();
  }
  // What a reuse_ops request leaves out (ops, receipt regions) is held.
  const worker::v1::BeginUpdateRequest& held =
      request.reuse_ops() ? held_ops_ : request;
  absl::Status s = PrepareDataPath(request, deadline);
  if (!s.ok()) return s;
  const absl::Time t_data = absl::Now();
  s = PrepareSparse(request);
  const absl::Time t_sparse = absl::Now();
  // An IPC update straight from the trainer's memory (no staging, no ring,
  // no patches) may copy and sum its receipts in one pass; its FP8 targets
  // too where direct quant steps write them all (the direct kernel sums
  // what it writes). Gathers and flushes (quant scratch) never fuse.
  bool all_direct = true;
  for (const worker::v1::GpuQuantStep& q : held.quant_steps()) {
    all_direct = all_direct && q.has_direct();
  }
  const bool may_fuse = ipc && !request.staged() &&
                        request.ipc_ring_slots() == 0 &&
                        request.sparse_size() == 0 && all_direct;
  if (s.ok()) s = PrepareQuant(held, request);
  if (s.ok()) s = PrepareReceipts(held, request, may_fuse);
  if (s.ok()) s = UploadDirect();
  if (!s.ok()) return s;
  VLOG(1) << "begin update (" << request.chunk_sizes_size() << " chunks, "
          << request.ops_size() << " copies, " << request.sparse_size()
          << " patches), ms: owner thread "
          << absl::ToDoubleMilliseconds(t_run - t_call)
          << ", streams + source/staging "
          << absl::ToDoubleMilliseconds(t_data - t_run) << ", sparse "
          << absl::ToDoubleMilliseconds(t_sparse - t_data) << ", receipts "
          << absl::ToDoubleMilliseconds(absl::Now() - t_sparse)
          << (receipts_fused_ ? " (fused with the copies and direct quant)"
                              : "");
  ended_clean_ = false;
  update_active_ = true;
  update_chunks_ = request.chunk_sizes_size();
  abort_requested_ = false;
  {
    absl::MutexLock lock(&enqueue_mu_);
    enqueue_done_ = false;
    enqueue_status_ = absl::OkStatus();
  }
  ring_.Clear();
  ring_slots_ = 0;
  if (ipc && request.ipc_ring_slots() > 0) return StartRing(request);
  staged_pending_ = request.staged();
  if (request.staged()) staged_ = request;
  PostEnqueue(request, ipc);
  return absl::OkStatus();
}

absl::Status GpuWorker::PrepareDataPath(
    const worker::v1::BeginUpdateRequest& request, absl::Time deadline) {
  absl::Status s = EnsureStreams();
  if (!s.ok()) return s;
  if (request.ipc_registered_source()) {
    // Every op reads the trainer's tensor it names (src_allocation_id).
    if (request.staged() || request.ipc_ring_slots() != 0) {
      return absl::InvalidArgumentError(
          "a registered source is copied in place: not staged, no ring");
    }
    ipc_source_ = nullptr;
    return absl::OkStatus();
  }
  if (!request.ipc_source_handle().empty()) {
    s = OpenIpcSource(request);
    if (!s.ok()) return s;
    // Staged: the chunks are copied into staging as they are read.
    if (request.staged()) {
      s = EnsureStaging(request.chunk_bytes(), request.chunk_sizes_size(),
                        /*larger_ok=*/false);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  if (request.staging_buffers() < 2 && !request.staged()) {
    return absl::InvalidArgumentError("at least 2 staging buffers");
  }
  s = WaitComm(deadline);
  if (!s.ok()) return s;
  WS_CUDA(cudaSetDevice(device_));
  // Staged: one buffer per chunk (the daemon checked the budget).
  // Streaming keeps larger buffers it already has: a trainer that sends
  // sparse updates in small chunks (to overlap their apply with the
  // receive) between dense ones in large chunks would otherwise reallocate
  // them, synchronising the GPU, every update.
  return EnsureStaging(
      request.chunk_bytes(),
      request.staged() ? request.chunk_sizes_size() : request.staging_buffers(),
      /*larger_ok=*/!request.staged());
}

absl::Status GpuWorker::StartRing(
    const worker::v1::BeginUpdateRequest& request) {
  // Chunks are copied as the trainer announces them (CopyChunk).
  if (request.ipc_ring_slots() < 2 ||
      request.ipc_source_size() <
          request.ipc_ring_slots() * request.chunk_bytes()) {
    update_active_ = false;
    return absl::InvalidArgumentError(
        absl::StrCat("an IPC ring needs >= 2 slots of ", request.chunk_bytes(),
                     " bytes; got ", request.ipc_ring_slots(), " slots in ",
                     request.ipc_source_size(), " bytes"));
  }
  absl::Status batch = PrepareBatch(request.ops_size());
  if (!batch.ok()) {
    update_active_ = false;
    return batch;
  }
  ring_ = request;
  staged_pending_ = request.staged();
  if (request.staged()) staged_ = request;
  ring_slots_ = request.ipc_ring_slots();
  ring_next_chunk_ = 0;
  ring_next_op_ = 0;
  ring_enqueued_ = 0;
  while (slot_done_.size() < static_cast<size_t>(request.ipc_ring_slots())) {
    cudaEvent_t e;
    WS_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    slot_done_.push_back(e);
  }
  absl::MutexLock lock(&enqueue_mu_);
  enqueue_done_ = false;
  return absl::OkStatus();
}

void GpuWorker::PostEnqueue(const worker::v1::BeginUpdateRequest& request,
                            bool ipc) {
  owner_.Post([this, ipc, req = request] {
    const absl::Time t_enqueue = absl::Now();
    absl::Status s = req.staged() ? EnqueueStagedReceive(req)
                     : ipc        ? EnqueueIpcUpdate(req)
                                  : EnqueueUpdate(req);
    if (!s.ok()) LOG(WARNING) << "update enqueue: " << s;
    VLOG(1) << "update enqueued in "
            << absl::ToDoubleMilliseconds(absl::Now() - t_enqueue) << " ms";
    absl::MutexLock lock(&enqueue_mu_);
    enqueue_status_ = s;
    enqueue_done_ = true;
  });
}

grpc::Status GpuWorker::WaitUpdate(grpc::ServerContext* ctx,
                                   const worker::v1::WaitUpdateRequest* request,
                                   worker::v1::WaitUpdateResponse* response) {
  const absl::Time deadline =
      std::min(Deadline(ctx),
               absl::Now() + absl::Milliseconds(request->timeout_ms() > 0
                                                    ? request->timeout_ms()
                                                    : 60000));
  // Poll without the owner thread (it may be enqueuing): event queries and
  // the communicator's async error are safe from any thread, never block.
  ++waiters_;
  struct Leave {
    std::atomic<int>& n;
    ~Leave() { --n; }
  } leave{waiters_};
  if (!update_active_) {
    return ToGrpcStatus(absl::FailedPreconditionError("no update in progress"));
  }
  const bool received_only = request->received_only();
  if (received_only != staged_pending_.load()) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        received_only ? "no staged update awaits its commit"
                      : "the staged update is not committed (CommitStaged)"));
  }
  // Staged, before the commit: every chunk in staging is the goal.
  const absl::Status done =
      AwaitEvent(received_only ? received_ : all_done_, deadline);
  if (!done.ok()) return ToGrpcStatus(done);
  // Every patch was checked by now; one refused ends the update here, with
  // its GPU work complete (AbortUpdate will leave the communicator alone).
  const absl::Status verdict = SparseVerdict();
  if (!verdict.ok()) {
    ended_clean_ = true;
    staged_pending_ = false;
    update_active_ = false;
    return ToGrpcStatus(verdict);
  }
  if (received_only) {  // the update goes on: CommitStaged is next
    response->set_chunks_done(0);
    return grpc::Status::OK;
  }
  update_active_ = false;
  response->set_chunks_done(update_chunks_);
  for (int g = 0; g < receipt_groups_; ++g) {
    response->add_receipt_sums(receipt_host_[g]);
  }
  float ms = 0;
  if (cudaEventElapsedTime(&ms, first_op_, last_op_) == cudaSuccess) {
    response->set_device_seconds(ms / 1e3);
  }
  return grpc::Status::OK;
}

absl::Status GpuWorker::AwaitEvent(cudaEvent_t goal, absl::Time deadline) {
  while (true) {
    if (abort_requested_) return absl::AbortedError("update aborted");
    bool enqueued;
    {
      absl::MutexLock lock(&enqueue_mu_);
      if (!enqueue_status_.ok()) return enqueue_status_;
      enqueued = enqueue_done_;
    }
    // all_done_ is recorded last by the enqueue: query it only after that.
    const cudaError_t e = enqueued ? cudaEventQuery(goal) : cudaErrorNotReady;
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return CudaStatus(e, "scatter");
    if (enqueued && comm_ != nullptr) {  // while enqueuing, the owner watches
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        return NcclStatus(state, "broadcast");
      }
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          "update not complete before the deadline (trainer gone or slow?)");
    }
    absl::SleepFor(absl::Microseconds(20));
  }
}

grpc::Status GpuWorker::AbortUpdate(grpc::ServerContext* ctx,
                                    const worker::v1::Empty*,
                                    worker::v1::Empty*) {
  if (!update_active_ && ended_clean_) {
    return grpc::Status::OK;  // nothing in flight; the communicator is fine
  }
  abort_requested_ = true;  // stops an enqueue waiting for the trainer
  // ... and a WaitUpdate polling the communicator this aborts.
  const absl::Time left = absl::Now() + absl::Seconds(1);
  while (waiters_.load() > 0 && absl::Now() < left) {
    absl::SleepFor(absl::Microseconds(50));
  }
  return ToGrpcStatus(owner_.Run(
      [&]() -> absl::Status {
        update_active_ = false;
        staged_pending_ = false;
        CloseIpcSource();
        DropCommunicator();
        if (scatter_stream_ != nullptr) {
          WS_CUDA(cudaStreamSynchronize(scatter_stream_));
          WS_CUDA(cudaStreamSynchronize(recv_stream_));
        }
        return absl::OkStatus();
      },
      Deadline(ctx)));
}

grpc::Status GpuWorker::CommitStaged(grpc::ServerContext* ctx,
                                     const worker::v1::Empty*,
                                     worker::v1::Empty*) {
  return ToGrpcStatus(owner_.Run(
      [&]() -> absl::Status {
        if (!update_active_ || !staged_pending_) {
          return absl::FailedPreconditionError(
              "no staged update awaits its commit");
        }
        {
          absl::MutexLock lock(&enqueue_mu_);
          if (!enqueue_status_.ok()) return enqueue_status_;
          if (!enqueue_done_) {
            return absl::FailedPreconditionError(
                "the staged chunks are still being received");
          }
        }
        WS_CUDA(cudaSetDevice(device_));
        absl::flat_hash_map<int64_t, Allocation> allocs;
        {
          absl::MutexLock lock(&mu_);
          allocs = allocations_;
        }
        absl::Status batch = PrepareBatch(staged_.ops_size());
        if (!batch.ok()) return batch;
        // Only now does engine memory change: staging -> engines, by the
        // plan's ops, after the last receive.
        WS_CUDA(cudaStreamWaitEvent(scatter_stream_, received_, 0));
        WS_CUDA(cudaEventRecord(first_op_, scatter_stream_));
        int op = 0;
        quant_next_step_ = 0;
        for (int64_t k = 0; k < staged_.chunk_sizes_size(); ++k) {
          absl::Status s =
              EnqueueChunkOps(staged_, k, staging_[k], allocs, false, &op);
          // FP8 targets are quantised here, at the commit.
          if (s.ok()) s = EnqueueChunkQuant(staged_, k, staging_[k], allocs);
          if (!s.ok()) return s;
        }
        // The patches were assembled and checked while receiving: one
        // apply launch for all of them.
        const int64_t applies = jobs_used_;
        for (int p = 0; p < staged_.sparse_size(); ++p) {
          absl::Status s = AddApplyJobs(staged_, p, allocs);
          if (!s.ok()) return s;
        }
        absl::Status applied = LaunchJobs(applies, /*apply=*/true);
        if (!applied.ok()) return applied;
        for (int64_t k = 0; k < staged_.chunk_sizes_size(); ++k) {
          absl::Status s = EnqueueReceiptsAfter(k);
          if (!s.ok()) return s;
        }
        absl::Status out = CopyReceiptsOut();
        if (!out.ok()) return out;
        WS_CUDA(cudaEventRecord(last_op_, scatter_stream_));
        WS_CUDA(cudaEventRecord(all_done_, scatter_stream_));
        staged_pending_ = false;
        return absl::OkStatus();
      },
      Deadline(ctx)));
}

}  // namespace weightsync
