// The GPU worker: the only process that touches CUDA and NCCL. It opens
// engines' CUDA IPC handles, owns the NCCL communicator and the GPU staging
// buffers, and runs each update as a GPU-side pipeline: chunk k+1 is
// received (NCCL broadcast, recv stream) into staging buffer (k+1) % N
// while chunk k is scattered into engine memory (copy engines or the
// conversion kernel, scatter stream), ordered by events, so the host never
// waits between chunks.
//
// Threading: every CUDA/NCCL call that touches the communicator runs on one
// owner thread; gRPC handlers post work to it and wait with a deadline, so
// a hung NCCL call never holds a gRPC thread forever. The daemon supervises
// this process and kills it when a deadline passes (invariant 5).
#ifndef WEIGHTSYNC_BACKENDS_CUDA_GPU_WORKER_H_
#define WEIGHTSYNC_BACKENDS_CUDA_GPU_WORKER_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/fp8_direct_vec.h"
#include "backends/cuda/fused_receipts.h"
#include "backends/cuda/kernel_math.h"
#include "backends/cuda/p2p_rounds.h"
#include "backends/cuda/scatter.h"
#include "backends/cuda/vmm.h"
#include "weightsync/worker/v1/gpu_worker.grpc.pb.h"

namespace weightsync {
namespace cuda {
struct SparseJob;  // sparse_kernels.h
}  // namespace cuda

// GpuWorker's members are defined by topic: gpu_worker.cc (the owner
// thread, allocations, the NCCL group), gpu_worker_update.cc (an update's
// life cycle and the NCCL pipeline), gpu_worker_ipc.cc (the IPC backend),
// gpu_worker_sparse.cc (sparse patches), gpu_worker_receipts.cc (receipts),
// gpu_worker_quant.cc (FP8 targets).

// One thread that runs posted closures in order. Joined on destruction.
class OwnerThread {
 public:
  OwnerThread();
  ~OwnerThread();
  // Queues `fn` on the owner thread without waiting for it.
  void Post(std::function<void()> fn);
  // Runs `fn` on the owner thread; waits for it until `deadline`.
  // DEADLINE_EXCEEDED leaves `fn` running (the daemon then kills us).
  absl::Status Run(std::function<absl::Status()> fn, absl::Time deadline);

 private:
  struct Task;
  void Loop();
  absl::Mutex mu_;
  std::deque<std::shared_ptr<Task>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// How long one NCCL broadcast's enqueue waits for the trainer's side when
// InitGroupRequest.timeout_ms is 0 (InitWeightTransferRequest.timeout_ms
// reaches the worker as that field).
inline constexpr absl::Duration kDefaultEnqueueTimeout = absl::Minutes(10);

class GpuWorker final : public worker::v1::GpuWorker::Service {
 public:
  // `device` receives and scatters every update; all engine allocations
  // are mapped into it (peer access where they live on another GPU).
  // `sm_copies`: IPC updates copy same-dtype blocks with a kernel rather
  // than the copy engines (faster on one GPU; takes SMs from the engine).
  // `fused_receipts`: an IPC update with receipts copies and sums in one
  // pass where its ops allow (PlanFusedCopies). `fp8_direct_kernel`: the
  // direct FP8 quantisation kernel's variant (--fp8_direct_kernel).
  GpuWorker(
      int device, bool sm_copies, bool fused_receipts = true,
      cuda::Fp8DirectKernel fp8_direct_kernel = cuda::Fp8DirectKernel::kRegs);
  ~GpuWorker() override;

  grpc::Status Ping(grpc::ServerContext*, const worker::v1::PingRequest*,
                    worker::v1::PingResponse*) override;
  grpc::Status OpenAllocation(grpc::ServerContext*,
                              const worker::v1::OpenAllocationRequest*,
                              worker::v1::OpenAllocationResponse*) override;
  grpc::Status CloseAllocation(grpc::ServerContext*,
                               const worker::v1::CloseAllocationRequest*,
                               worker::v1::Empty*) override;
  grpc::Status InitGroup(grpc::ServerContext*,
                         const worker::v1::InitGroupRequest*,
                         worker::v1::Empty*) override;
  grpc::Status BeginUpdate(grpc::ServerContext*,
                           const worker::v1::BeginUpdateRequest*,
                           worker::v1::Empty*) override;
  grpc::Status WaitUpdate(grpc::ServerContext*,
                          const worker::v1::WaitUpdateRequest*,
                          worker::v1::WaitUpdateResponse*) override;
  grpc::Status AbortUpdate(grpc::ServerContext*, const worker::v1::Empty*,
                           worker::v1::Empty*) override;
  grpc::Status CopyChunk(grpc::ServerContext*,
                         const worker::v1::CopyChunkRequest*,
                         worker::v1::Empty*) override;
  grpc::Status WaitChunks(grpc::ServerContext*,
                          const worker::v1::WaitChunksRequest*,
                          worker::v1::WaitChunksResponse*) override;
  grpc::Status ComputeReceipts(grpc::ServerContext*,
                               const worker::v1::ComputeReceiptsRequest*,
                               worker::v1::ComputeReceiptsResponse*) override;
  grpc::Status CommitStaged(grpc::ServerContext*, const worker::v1::Empty*,
                            worker::v1::Empty*) override;

 private:
  struct Allocation {
    uint8_t* ptr = nullptr;
    int64_t size = 0;
    int device = 0;
    cuda::VmmMemory vmm;  // set where the memory is CUDA VMM (else legacy)
  };
  // Maps another process's GPU memory for the scatter GPU: a legacy
  // cudaIpcMemHandle_t, or (vmm) "<pid>:<fd>" of CUDA VMM memory. Owner
  // thread only.
  absl::StatusOr<Allocation> MapShared(const std::string& handle, int64_t size,
                                       bool vmm);
  void Unmap(Allocation* a);
  // `buffers` staging buffers of at least `chunk_bytes` (exactly, unless
  // `larger_ok`).
  absl::Status EnsureStaging(int64_t chunk_bytes, int buffers, bool larger_ok);
  absl::Status EnsureStreams();
  // Aborts comm_ (a new group replaces it, or an update is aborted) and
  // hands the heap NCCL freed back to the kernel (malloc_trim: each
  // communicator's init and proxy threads free multi-MB blocks into
  // glibc's per-thread arenas). Logs RSS before and after. Measured on 2 x
  // H200: 2-4 MiB given back per communicator, while RSS still grows
  // ~10 MiB per trainer (tests/gpu/RESULTS_leak_trim_h200x2.txt): the rest
  // is memory in use. Owner thread only.
  void DropCommunicator();
  // Enqueues the NCCL receive of `bytes` into `buf` on recv_stream_,
  // waiting (bounded, abortable) while the non-blocking enqueue completes.
  absl::Status ReceiveChunk(uint8_t* buf, int64_t bytes);
  // Waits (bounded by the enqueue timeout, abortable) while a non-blocking
  // NCCL enqueue that returned `r` completes; `what` names it in errors.
  absl::Status AwaitEnqueue(ncclResult_t r, const char* what);
  // M->N (chunk_peers set): the rounds of p2p_, each one NCCL group of
  // ncclRecv into staging (or straight into engine memory), each chunk
  // scattered as in EnqueueUpdate (gpu_worker_update.cc).
  absl::Status EnqueueP2pUpdate(const worker::v1::BeginUpdateRequest& request);
  // The IPC backend: the trainer's packed update, opened per update.
  absl::Status OpenIpcSource(const worker::v1::BeginUpdateRequest& request);
  void CloseIpcSource();
  absl::Status EnqueueIpcUpdate(const worker::v1::BeginUpdateRequest& request);
  // Where allocation `id` of `allocs` is mapped (FAILED_PRECONDITION if it
  // is not open).
  static absl::StatusOr<uint8_t*> BaseOf(
      const absl::flat_hash_map<int64_t, Allocation>& allocs, int64_t id);
  // Enqueues the ops of chunk `k` (from *op on) reading from `chunk`;
  // `sm_copies`: same-dtype blocks by kernel rather than copy engines.
  // Room in the batch tables for `ops` copies, none used yet; waits for
  // the scatter stream first (an earlier update's tables are read no more).
  absl::Status PrepareBatch(int64_t ops);
  // Enqueues entries [batch_used_, batch_used_ + n) of the batch table:
  // their upload and one CopyBatchWithSMs.
  absl::Status FlushBatch(int64_t n);
  absl::Status EnqueueChunkOps(
      const worker::v1::BeginUpdateRequest& request, int64_t k,
      const uint8_t* chunk,
      const absl::flat_hash_map<int64_t, Allocation>& allocs, bool sm_copies,
      int* op);
  // Enqueues chunk k's dense ops (EnqueueChunkOps; of `ops` where given:
  // the ops held for a reuse_ops request) and its sparse pieces
  // (EnqueueChunkSparse, applying patches it completes).
  absl::Status EnqueueChunk(
      const worker::v1::BeginUpdateRequest& request, int64_t k,
      const uint8_t* chunk,
      const absl::flat_hash_map<int64_t, Allocation>& allocs, bool sm_copies,
      int* op, const worker::v1::BeginUpdateRequest* ops = nullptr);
  // FP8 targets (owner thread; gpu_worker_quant.cc). PrepareQuant, at
  // BeginUpdate: the quant scratch `held` (the request, or the held ops)
  // addresses. EnqueueChunkQuant: chunk k's quant steps of `held`, on
  // scatter_stream_ after the chunk's ops: gathers from `chunk` (or the
  // source allocation they name) into the scratch, and flushes that
  // quantise complete rows of blocks into engine memory.
  // `request`: the update's own request (mode, ipc source). Direct quant
  // steps (held.quant_steps' `direct`) are resolved into a table of
  // cuda::DirectJob (direct_jobs_), one batch per chunk, kept for the next
  // update of the same held ops and allocation generation (PrepareDirect;
  // a table resolved again makes PrepareReceipts plan again, as the
  // receipt fields of the jobs follow the receipt tables).
  // PrepareReceipts then sets or clears the jobs' receipt fields, and
  // UploadDirect copies the table to the device where it changed.
  absl::Status PrepareQuant(const worker::v1::BeginUpdateRequest& held,
                            const worker::v1::BeginUpdateRequest& request);
  absl::Status PrepareDirect(const worker::v1::BeginUpdateRequest& held,
                             const worker::v1::BeginUpdateRequest& request);
  absl::Status UploadDirect();
  // The direct batches of chunk k (all of them: k < 0) on `stream`, the
  // next ones in order (direct_next_batch_).
  absl::Status EnqueueDirect(int64_t k, cudaStream_t stream);
  absl::Status EnqueueChunkQuant(
      const worker::v1::BeginUpdateRequest& held, int64_t k,
      const uint8_t* chunk,
      const absl::flat_hash_map<int64_t, Allocation>& allocs);
  // Sparse patches (owner thread). PrepareSparse, at BeginUpdate: checks the
  // patches and pieces, lays out their payloads and reports in sparse_dev_.
  absl::Status PrepareSparse(const worker::v1::BeginUpdateRequest& request);
  // Chunk k's sparse pieces, on scatter_stream_: a patch whole in the chunk
  // is used where it lies (the chunk's buffer outlives its apply), pieces
  // are copied into the patch's payload; the patches the chunk completes
  // get their indices checked (one batched launch) and, with `apply`, are
  // applied (one more, guarded by the checks).
  absl::Status EnqueueChunkSparse(
      const worker::v1::BeginUpdateRequest& request, int64_t k,
      const uint8_t* chunk,
      const absl::flat_hash_map<int64_t, Allocation>& allocs, bool apply);
  // Adds patch p's check job, or one apply job per use, to jobs_host_.
  void AddCheckJob(const worker::v1::BeginUpdateRequest& request, int p);
  absl::Status AddApplyJobs(
      const worker::v1::BeginUpdateRequest& request, int p,
      const absl::flat_hash_map<int64_t, Allocation>& allocs);
  // Plans jobs [first, jobs_used_), copies them to the device and launches
  // SparseCheckBatch or SparseApplyBatch on scatter_stream_.
  absl::Status LaunchJobs(int64_t first, bool apply);
  // Copies the index reports to the host (scatter_stream_), to be read by
  // SparseVerdict once the update's last event has completed.
  absl::Status CopyReportsOut();
  // OK, or INVALID_ARGUMENT naming the first patch refused for an index
  // outside its tensor. Any thread, after the event that follows
  // CopyReportsOut.
  absl::Status SparseVerdict() const;
  // Receipt regions of `request` resolved against the open allocations.
  absl::Status ResolveReceiptRegions(
      const worker::v1::ComputeReceiptsRequest& request,
      std::vector<cuda::ReceiptRegion>* regions, std::vector<int32_t>* group_of)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Receipts as the update goes (owner thread): PrepareReceipts, at
  // BeginUpdate, uploads the regions grouped by the chunk after which they
  // are summed; EnqueueReceiptsAfter(k) launches chunk k's batch;
  // CopyReceiptsOut copies the sums to the host before the update's last
  // event.
  // `held`: the ops and regions (a reuse_ops request's held ones);
  // `request`: the update's own request. Where `may_fuse` and every op
  // allows it, the batches hold copy regions instead (receipts_fused_),
  // and the FP8 weights and scales that direct quant jobs write are summed
  // by the direct kernel (their receipt fields in direct_jobs_). Called
  // after PrepareQuant, before UploadDirect.
  absl::Status PrepareReceipts(const worker::v1::BeginUpdateRequest& held,
                               const worker::v1::BeginUpdateRequest& request,
                               bool may_fuse);
  // Uploads `regions` (summing into group_of[i], after chunk chunk_of[i])
  // as receipt_batches_, each chunk's batch planned on its own, and zeroes
  // the `groups` sums.
  absl::Status UploadReceiptBatches(
      const std::vector<cuda::ReceiptRegion>& regions,
      const std::vector<int32_t>& group_of,
      const std::vector<int64_t>& chunk_of, int64_t chunks, int groups);
  // The fused receipts of an IPC update (fused_receipts.h): every op of
  // `held` (same dtypes) cut at the boundaries of the resolved receipt
  // `regions` it writes into, each piece keyed on its destination and
  // summed into its region's group; the direct jobs (direct_jobs_) keyed on
  // the FP8 weights and scales they write. False (nothing fused: the
  // copies and then the receipt pass run as usual) where an op converts
  // dtypes or reads no source the worker knows, or PlanFusedReceipts
  // refuses (a byte outside the regions, regions not covered exactly).
  bool PlanFusedCopies(const worker::v1::BeginUpdateRequest& held,
                       int64_t chunk_bytes,
                       const std::vector<cuda::ReceiptRegion>& regions,
                       const std::vector<int32_t>& group_of,
                       cuda::FusedReceiptPlan* plan) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status EnqueueReceiptsAfter(int64_t k);
  absl::Status CopyReceiptsOut();
  absl::Status WaitComm(absl::Time deadline);
  // BeginUpdate on the owner thread: checks, prepares the data path, the
  // sparse patches and the receipts, then starts the ring (StartRing) or
  // posts the enqueue (PostEnqueue). `t_call`: when BeginUpdate was called.
  absl::Status BeginOnOwner(const worker::v1::BeginUpdateRequest& request,
                            absl::Time deadline, absl::Time t_call);
  // The streams, and the IPC source or (NCCL) the group and the staging
  // buffers the update needs.
  absl::Status PrepareDataPath(const worker::v1::BeginUpdateRequest& request,
                               absl::Time deadline);
  // IPC ring mode: chunks are copied as the trainer announces them.
  absl::Status StartRing(const worker::v1::BeginUpdateRequest& request);
  // Queues the update's enqueue as its own owner task.
  void PostEnqueue(const worker::v1::BeginUpdateRequest& request, bool ipc);
  // WaitUpdate's poll: OK once `goal` has completed; the enqueue's or the
  // communicator's error, or DEADLINE_EXCEEDED, otherwise.
  absl::Status AwaitEvent(cudaEvent_t goal, absl::Time deadline);
  absl::Status EnqueueUpdate(const worker::v1::BeginUpdateRequest& request);
  // Staged: chunk k broadcast into staging_[k]; records received_.
  absl::Status EnqueueStagedReceive(
      const worker::v1::BeginUpdateRequest& request);
  absl::Time Deadline(const grpc::ServerContext* ctx) const;
  // Grows a buffer of device memory (pinned host memory with `pinned`) on
  // the current device to at least `bytes`, keeping nothing of its contents.
  template <typename T>
  static absl::Status Grow(T** p, int64_t* have, int64_t bytes, bool pinned);

  OwnerThread owner_;
  const int scatter_device_;
  const bool sm_copies_;
  const bool fused_receipts_;
  const cuda::Fp8DirectKernel fp8_direct_kernel_;
  std::vector<std::string> uuids_;  // by device ordinal

  absl::Mutex mu_;
  absl::flat_hash_map<int64_t, Allocation> allocations_ ABSL_GUARDED_BY(mu_);
  // Bumped whenever an allocation opens or closes: tables holding resolved
  // addresses (the receipts') are valid for one generation.
  uint64_t allocations_generation_ ABSL_GUARDED_BY(mu_) = 0;

  // Owned by the owner thread.
  ncclComm_t comm_ = nullptr;
  bool comm_ready_ = false;
  int world_size_ = 0;  // of comm_ (InitGroup)
  int rank_ = -1;
  // The M->N schedule of the update being enqueued (BeginOnOwner; owner
  // thread only) and the event each round's receive records.
  P2pSchedule p2p_;
  cudaEvent_t round_done_ = nullptr;
  // How long one broadcast's enqueue may wait for the trainer's side (the
  // group's InitGroupRequest.timeout_ms; kDefaultEnqueueTimeout for 0).
  absl::Duration enqueue_timeout_ = kDefaultEnqueueTimeout;
  int device_ = -1;
  cudaStream_t recv_stream_ = nullptr, scatter_stream_ = nullptr;
  // An IPC update's direct quant steps run here, beside the chunks' copies
  // on scatter_stream_ (EnqueueIpcUpdate); quant_done_ joins them back.
  cudaStream_t quant_stream_ = nullptr;
  cudaEvent_t quant_done_ = nullptr;
  std::vector<uint8_t*> staging_;
  int64_t staging_chunk_ = 0;
  std::vector<cudaEvent_t> recv_done_, scatter_done_;
  cudaEvent_t all_done_ = nullptr;
  // Timed: the update's first GPU operation and its last (recorded just
  // before all_done_, so it has completed once all_done_ has).
  cudaEvent_t first_op_ = nullptr, last_op_ = nullptr;
  // The trainer's shared buffer of the current IPC update, and the last
  // kIpcSources buffers mapped (most recent last): mapping a large
  // allocation costs far more than copying it, and a trainer may alternate
  // between buffers (weights and patches, double buffering).
  static constexpr int kIpcSources = 2;
  struct IpcSource {
    std::string handle;  // its bytes
    int64_t size = 0;
    Allocation mapping;
  };
  uint8_t* ipc_source_ = nullptr;
  std::vector<IpcSource> ipc_sources_;
  std::atomic<bool> update_active_{false};
  std::atomic<int64_t> update_chunks_{0};
  // IPC ring mode (owner thread): the update's ops, the next chunk and op
  // to enqueue, and per slot the event of the last chunk copied out of it.
  worker::v1::BeginUpdateRequest ring_;
  int64_t ring_next_chunk_ = 0;
  int ring_next_op_ = 0;
  std::vector<cudaEvent_t> slot_done_;
  // Chunks whose copies are enqueued (any thread reads it).
  std::atomic<int64_t> ring_enqueued_{0};
  std::atomic<int> ring_slots_{0};  // 0: not a ring update
  // Staged update (owner thread, but staged_pending_): its request, and the
  // event recorded after its last receive. Pending from BeginUpdate to
  // CommitStaged.
  worker::v1::BeginUpdateRequest staged_;
  cudaEvent_t received_ = nullptr;
  std::atomic<bool> staged_pending_{false};

  // FP8 targets: the quant scratch (device, grown as needed) and the next
  // quant step of the update to enqueue (owner thread).
  uint8_t* quant_scratch_ = nullptr;
  int64_t quant_scratch_bytes_ = 0;
  int quant_next_step_ = 0;
  // Direct quant steps: the jobs on the host and on the device (grown as
  // needed; direct_upload_: the device's copy is stale), per chunk that has
  // some its batch (in chunk order) and the next to launch; the held ops,
  // allocation generation and packed source they were resolved for
  // (direct_ops_id_ 0: resolved for one update only).
  struct DirectBatch {
    int64_t chunk = 0;
    int64_t first = 0;  // index of its first job in direct_dev_
    int count = 0;
    int64_t blocks = 0;
    bool receipts = false;   // some job of it sums a receipt
    int32_t lean_dtype = 0;  // > 0: all DirectLeanOk, of this source dtype
  };
  // --fp8_direct_kernel=lean: each batch cut into runs of the lean kernel
  // (one per source dtype) and the rest (the cvt kernel).
  void SplitDirectBatches();
  std::vector<cuda::DirectJob> direct_jobs_;
  bool direct_upload_ = false;
  uint8_t* direct_dev_ = nullptr;
  int64_t direct_dev_bytes_ = 0;
  std::vector<DirectBatch> direct_batches_;
  size_t direct_next_batch_ = 0;
  uint64_t direct_ops_id_ = 0;
  uint64_t direct_generation_ = 0;

  // Sparse patches of the update: per patch a SparseIndexReport (32 bytes)
  // then the payloads, each at sparse_offsets_[p] in sparse_dev_ (device,
  // grown as needed); the reports' host copy (pinned); bytes assembled per
  // patch and the next piece (owner thread). sparse_names_/sparse_numel_
  // are set before update_active_ and read by SparseVerdict.
  uint8_t* sparse_dev_ = nullptr;
  int64_t sparse_dev_bytes_ = 0;
  void* sparse_host_ = nullptr;
  int64_t sparse_host_bytes_ = 0;
  std::vector<int64_t> sparse_offsets_, sparse_have_;
  int sparse_next_piece_ = 0;
  std::vector<std::string> sparse_names_;
  std::vector<int64_t> sparse_numel_;
  // Per patch: where its complete payload is (device).
  std::vector<const uint8_t*> sparse_payload_;
  // The update's sparse jobs, each slot used once (one check per patch, one
  // apply per patch use): pinned host array, its device copy, capacity,
  // slots used.
  cuda::SparseJob* jobs_host_ = nullptr;
  cuda::SparseJob* jobs_dev_ = nullptr;
  int64_t jobs_host_bytes_ = 0, jobs_dev_bytes_ = 0, jobs_used_ = 0;
  // Which job each tile of a batch belongs to (device; sized by
  // PrepareSparse for the update's largest batch, reused batch after batch
  // on scatter_stream_).
  int32_t* tile_jobs_dev_ = nullptr;
  int64_t tile_jobs_bytes_ = 0;
  // Receipts of the update (PrepareReceipts): per chunk its batch (first
  // region, count, tiles) in receipt_dev_ (sums, then the regions); the
  // sums' host copy (pinned); receipt_groups_ is set before update_active_.
  struct ReceiptBatch {
    int64_t first = 0, count = 0, tiles = 0;
  };
  std::vector<ReceiptBatch> receipt_batches_;
  uint8_t* receipt_dev_ = nullptr;
  int64_t receipt_dev_bytes_ = 0;
  uint64_t* receipt_host_ = nullptr;
  int64_t receipt_host_bytes_ = 0;
  // An update's small same-dtype SM copies, batched (CopyBatchWithSMs):
  // the tables in pinned host memory and on the device, entries used since
  // PrepareBatch (each flush takes the next entries: no entry is rewritten
  // while a copy of it may be pending).
  // The last request that named its ops (ops_id), for the ops and receipt
  // regions of requests that reuse them (reuse_ops).
  worker::v1::BeginUpdateRequest held_ops_;
  uint64_t held_ops_id_ = 0;
  cuda::BatchCopy* batch_host_ = nullptr;
  cuda::BatchCopy* batch_dev_ = nullptr;
  int64_t batch_host_bytes_ = 0, batch_dev_bytes_ = 0, batch_used_ = 0;
  int receipt_groups_ = 0;
  // This update's receipt batches are copy regions (PlanFusedCopies): its
  // ops are not enqueued on their own, EnqueueReceiptsAfter copies.
  bool receipts_fused_ = false;
  // What the receipt tables on the device were built from: a reuse_ops
  // update of the same held ops, allocation generation and fusing reuses
  // them (100k regions cost milliseconds to resolve and upload).
  uint64_t receipts_ops_id_ = 0;
  uint64_t receipts_generation_ = 0;
  bool receipts_may_fuse_ = false;
  // The worker ended the last update itself with its GPU work complete (a
  // refused patch): AbortUpdate then leaves the communicator alone.
  std::atomic<bool> ended_clean_{false};

  // The enqueue of an update's broadcasts and scatters runs as its own owner
  // task after BeginUpdate returns: NCCL connects lazily, so the first
  // broadcast can't be enqueued until the trainer broadcasts too.
  absl::Mutex enqueue_mu_;
  bool enqueue_done_ ABSL_GUARDED_BY(enqueue_mu_) = true;
  absl::Status enqueue_status_ ABSL_GUARDED_BY(enqueue_mu_);
  std::atomic<bool> abort_requested_{false};
  // WaitUpdate calls polling the update now. AbortUpdate may come while one
  // polls (the daemon's trainer died during Finish, issue 36): it asks them
  // to stop (abort_requested_) and waits for them to leave before it
  // aborts the communicator they query.
  std::atomic<int> waiters_{0};
};

template <typename T>
absl::Status GpuWorker::Grow(T** p, int64_t* have, int64_t bytes, bool pinned) {
  if (bytes <= *have) return absl::OkStatus();
  if (*p != nullptr) pinned ? cudaFreeHost(*p) : cudaFree(*p);
  *p = nullptr;
  *have = 0;
  void* d = nullptr;
  WS_CUDA(pinned ? cudaMallocHost(&d, bytes) : cudaMalloc(&d, bytes));
  *p = static_cast<T*>(d);
  *have = bytes;
  return absl::OkStatus();
}

}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_GPU_WORKER_H_
