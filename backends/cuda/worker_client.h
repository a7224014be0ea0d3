// The daemon's side of the GPU data plane. It never touches CUDA: it starts
// the weightsync_gpu_worker process, talks to it over a private Unix socket
// with a deadline on every call, and when a call misses its deadline (an
// NCCL abort that hangs, a wedged GPU) kills and respawns it, re-opening
// every engine allocation so registrations survive (invariant 5).
//
// GpuWorkerSupervisor is thread-safe. GpuMapper and GpuDataPlane are the
// core's MemoryMapper and DataPlane for CUDA IPC memory and the NCCL
// backend.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_WORKER_CLIENT_H_
#define WEIGHTSYNC_BACKENDS_CUDA_WORKER_CLIENT_H_

#include <sys/types.h>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backends/cuda/source_ops.h"
#include "daemon/core/data_plane.h"
#include "daemon/core/memory.h"
#include "weightsync/v1/trainer_service.pb.h"
#include "weightsync/worker/v1/gpu_worker.grpc.pb.h"

namespace weightsync {

class GpuWorkerSupervisor {
 public:
  struct Options {
    std::string worker_binary;  // path of weightsync_gpu_worker
    std::string socket_path;    // private socket for the worker
    absl::Duration start_timeout = absl::Seconds(60);
    absl::Duration call_timeout = absl::Seconds(30);
    int device = 0;                  // GPU of the daemon's NCCL rank
    bool ipc_sm_copies = false;      // IPC: kernel copies, not copy engines
    bool ipc_fused_receipts = true;  // IPC: copy and receipts in one pass
    std::string fp8_direct_kernel = "lean";  // --fp8_direct_kernel
    int staging_buffers = 4;
    int64_t staging_budget = int64_t{4} << 30;  // GPU staging bytes
  };
  explicit GpuWorkerSupervisor(Options options);
  ~GpuWorkerSupervisor();  // kills the worker

  const Options& options() const { return options_; }
  // Opens a CUDA IPC allocation in the worker; returns its id.
  absl::StatusOr<int64_t> OpenAllocation(const v1::Allocation& allocation);
  // Closes it in the background (safe to call under any lock).
  void CloseAllocation(int64_t id);
  absl::Status InitGroup(const worker::v1::InitGroupRequest& request);
  absl::Status BeginUpdate(const worker::v1::BeginUpdateRequest& request,
                           absl::Time deadline);
  // Returns the update's GPU time (first operation to last, CUDA events).
  // received_only: a staged update's chunks are all in staging (not yet
  // committed; returns zero).
  struct Waited {
    absl::Duration device;               // GPU time of the update
    std::vector<uint64_t> receipt_sums;  // BeginUpdateRequest.receipts'
  };
  absl::StatusOr<Waited> WaitUpdate(absl::Time deadline,
                                    bool received_only = false);
  // Staged update: copy staging into engine memory (WaitUpdate waits).
  absl::Status CommitStaged(absl::Time deadline);
  // One checksum per group of regions (docs/protocol.md, "Receipts").
  absl::StatusOr<std::vector<uint64_t>> ComputeReceipts(
      const worker::v1::ComputeReceiptsRequest& request, absl::Time deadline);
  // IPC ring mode: chunk k is in its slot / wait until n chunks are copied.
  absl::Status CopyChunk(int64_t k, absl::Time deadline);
  absl::Status WaitChunks(int64_t n, absl::Time deadline);
  // A no-op call to a running worker (none is started).
  absl::Status Ping(absl::Time deadline);
  // Pings the worker from a background thread and returns at once: a call
  // after idle time costs ~0.4 ms more than one that follows another
  // (both ends' threads asleep), and a Ping ~1 ms ahead wakes them
  // (bench/results/worker_rpc_probe.txt). Requests made while one is in
  // flight fold into it.
  void WarmAsync();
  // Starts the worker (its process, CUDA context and socket) on the warmer
  // thread now rather than at first use, so that the first registration or
  // update does not wait ~0.3 s for it. A failure is logged; the first use
  // tries again and reports its own error.
  void StartAsync();
  // Aborts the communicator; if that misses `deadline`, restarts the worker.
  void AbortUpdate(absl::Time deadline);
  // Kills the worker and starts a fresh one with every allocation re-opened.
  absl::Status Restart(const std::string& why);
  int restarts() const;

 private:
  absl::Status EnsureStartedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void KillLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<worker::v1::GpuWorker::Stub> Stub();
  void CloserLoop();
  void WarmerLoop();

  const Options options_;
  mutable absl::Mutex mu_;
  pid_t pid_ ABSL_GUARDED_BY(mu_) = -1;
  // Shared: calls made without mu_ keep the stub they started on alive
  // through a concurrent restart.
  std::shared_ptr<worker::v1::GpuWorker::Stub> stub_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, v1::Allocation> allocations_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  int restarts_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<int64_t> to_close_ ABSL_GUARDED_BY(mu_);
  bool warm_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool start_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread closer_;
  std::thread warmer_;
};

// An engine allocation opened in the worker. data() is null: only the
// worker can address it.
class GpuRegion : public MappedRegion {
 public:
  GpuRegion(std::shared_ptr<GpuWorkerSupervisor> sup, int64_t id, int64_t size,
            std::string uuid)
      : sup_(std::move(sup)), id_(id), size_(size), uuid_(std::move(uuid)) {}
  ~GpuRegion() override { sup_->CloseAllocation(id_); }
  uint8_t* data() const override { return nullptr; }
  int64_t size() const override { return size_; }
  v1::MemoryKind kind() const override { return v1::MEMORY_CUDA_IPC; }
  const std::string& device_uuid() const override { return uuid_; }
  int64_t id() const { return id_; }

 private:
  const std::shared_ptr<GpuWorkerSupervisor> sup_;
  const int64_t id_, size_;
  const std::string uuid_;
};

class GpuMapper : public MemoryMapper {
 public:
  explicit GpuMapper(std::shared_ptr<GpuWorkerSupervisor> sup)
      : sup_(std::move(sup)) {}
  absl::StatusOr<std::shared_ptr<MappedRegion>> Open(
      const v1::Allocation& allocation) override;
  // Computed by the worker from the engine's GPU memory.
  absl::StatusOr<v1::Receipt> DeviceReceipt(
      const EngineLayout& engine,
      const absl::flat_hash_set<std::string>& sources,
      absl::Time deadline) override;

 private:
  const std::shared_ptr<GpuWorkerSupervisor> sup_;
};

// The regions ComputeReceipt walks on the host (daemon/core/receipt.cc),
// for the worker to sum (exposed for tests), one group per engine: segment
// s of parameter p is rows x cols elements from element s.dest_offset, rows
// s.dest_row_stride elements apart; an FP8 target's segment also has the
// region of the scales of the blocks it writes. Fills *req, the receipts'
// parameter and byte counts in *out (one per engine), and each region's
// source tensor in *region_sources. Engines flagged in `skip` get none.
// INVALID_ARGUMENT for memory that is not the worker's (host memory).
absl::Status ReceiptRegionsOf(const std::vector<const EngineLayout*>& engines,
                              const absl::flat_hash_set<std::string>& sources,
                              const std::vector<bool>& skip,
                              worker::v1::ComputeReceiptsRequest* req,
                              std::vector<v1::Receipt>* out,
                              std::vector<std::string>* region_sources);

// The checkpoint tensors an update's receipts cover: the sources of the
// plan's dense uses (a patch's other elements are not the trainer's to
// vouch for). A transfer plan's update (daemon/core/link_plan.h) streams
// pieces whose names are not the tensors' the engines' segments name: its
// receipts cover the tensors all the same.
absl::flat_hash_set<std::string> ReceiptSources(const CopyPlan& plan);

// The GPU backends' data plane. nccl: bytes arrive by broadcast straight
// into the worker's GPU staging. ipc: the worker copies them with the copy
// engines from the trainer's packed buffer on the same node (shared as a
// CUDA IPC handle in Start). Either way they never pass through the daemon.
class GpuDataPlane : public DataPlane {
 public:
  GpuDataPlane(std::shared_ptr<GpuWorkerSupervisor> sup, v1::Backend backend)
      : sup_(std::move(sup)), backend_(backend) {}
  void Warm() override { sup_->WarmAsync(); }
  absl::Status Begin(std::shared_ptr<const CopyPlan> plan,
                     const v1::StartWeightUpdateRequest& request) override;
  // nccl only: the next Begin of `plan` receives chunk k from rank
  // sources.sender[k] in its round (p2p_rounds.h: OrderChunksByRound).
  absl::Status SetChunkSources(std::shared_ptr<const CopyPlan> plan,
                               ChunkSources sources) override;
  // ipc only: copies from the trainer's registered tensors.
  absl::Status BeginFromSource(std::shared_ptr<const CopyPlan> plan,
                               const v1::StartWeightUpdateRequest& request,
                               const Source& source) override;
  // IPC ring mode only: chunk `index` is in its slot (data empty).
  absl::Status SubmitChunk(int64_t index, std::string data,
                           absl::Time deadline) override;
  absl::Status WaitChunks(int64_t n, absl::Time deadline) override;
  absl::Status Drain(absl::Time deadline) override;
  void Abort() override;
  // Aborts the update in the worker: a WaitUpdate in flight (Drain,
  // WaitStaged) returns ABORTED.
  void Cancel() override;
  void MarkEngineLost(int engine) override {}
  int64_t chunks_written() const override;
  absl::Duration device_time() const override;
  bool ReceivesOwnBytes() const override { return true; }
  int64_t staging_bytes() const override { return staging_bytes_; }
  std::string name() const override {
    return backend_ == v1::BACKEND_IPC ? "ipc" : "nccl";
  }
  absl::StatusOr<std::vector<v1::Receipt>> DeviceReceipts(
      const CopyPlan& plan, const std::vector<bool>& skip,
      absl::Time deadline) override;
  // nccl only (ipc: -1, UNIMPLEMENTED): one GPU staging buffer per chunk,
  // within the worker's staging budget.
  int64_t DeviceStagingBudget() const override;
  absl::Status BeginStaged(
      std::shared_ptr<const CopyPlan> plan,
      const v1::StartWeightUpdateRequest& request) override;
  absl::Status WaitStaged(absl::Time deadline) override;
  absl::Status CommitStaged(absl::Time deadline) override;

 private:
  // Fills req's ops from `plan` (AddOps, MergeContiguousOps) and, when
  // `request` verifies, its receipt regions (AddReceipts); or with `reuse`
  // names the ops and regions the worker already holds when they are the
  // ones (a registered source's streaming update of the same plan, source
  // regions and verify: worker::v1::BeginUpdateRequest.reuse_ops).
  // FP8 targets' quant steps (AddQuantSteps, windows of `quant_window`)
  // go with the ops.
  absl::Status SetOps(const std::shared_ptr<const CopyPlan>& plan,
                      const v1::StartWeightUpdateRequest& request,
                      const Source* source, bool staged, bool reuse,
                      int64_t quant_window,
                      worker::v1::BeginUpdateRequest* req);
  // Whether `req`'s whole source is readable from its first step: the ipc
  // backend, not staged (staging copies each chunk before the commit, and
  // the trainer may reuse its buffer by then), no ring (a slot holds a
  // chunk only until the trainer refills it). Copies then merge across
  // chunks and FP8 uses get direct quant steps (quant_steps.h).
  bool WholeSource(bool staged,
                   const worker::v1::BeginUpdateRequest& req) const {
    return backend_ == v1::BACKEND_IPC && !staged && req.ipc_ring_slots() == 0;
  }
  absl::Status BeginImpl(std::shared_ptr<const CopyPlan> plan,
                         const v1::StartWeightUpdateRequest& request,
                         bool staged, const Source* source);
  // The ipc source of `req`: the trainer's packed buffer (ipc_source), or
  // with `source` its registered tensors (set on each op by AddOps).
  absl::Status SetIpcSource(const CopyPlan& plan,
                            const v1::StartWeightUpdateRequest& request,
                            const Source* source,
                            worker::v1::BeginUpdateRequest* req);
  // The plan's copies as worker ops; with `source`, each reads the trainer's
  // tensor in place of the packed stream.
  absl::Status AddOps(const CopyPlan& plan, const Source* source,
                      worker::v1::BeginUpdateRequest* req);
  // VERIFY_ON: the receipts the worker computes as the update goes, for
  // DeviceReceipts to return (their checksums filled in by Drain).
  absl::Status AddReceipts(const CopyPlan& plan,
                           const v1::StartWeightUpdateRequest& request,
                           worker::v1::BeginUpdateRequest* req);

  const std::shared_ptr<GpuWorkerSupervisor> sup_;
  const v1::Backend backend_;
  std::atomic<int64_t> staging_bytes_{0};
  // SetChunkSources' table, for the Begin of that plan only.
  std::shared_ptr<const CopyPlan> sources_plan_ ABSL_GUARDED_BY(mu_);
  ChunkSources sources_ ABSL_GUARDED_BY(mu_);
  // The ops the worker last received for a registered source's plan
  // (worker::v1::BeginUpdateRequest.ops_id): the plan (weak: an engine
  // that goes away must not be kept mapped) and the source regions' worker
  // ids they were built for. Used only by BeginImpl, one update at a time.
  std::weak_ptr<const CopyPlan> ops_plan_;
  std::vector<int64_t> ops_sources_;
  bool ops_receipts_ = false;                    // they include receipt regions
  int64_t ops_quant_window_ = 0;                 // their quant steps' window
  std::vector<v1::Receipt> ops_receipt_counts_;  // AddReceipts' counts
  uint64_t ops_id_ = 0, next_ops_id_ = 1;
  mutable absl::Mutex mu_;
  int64_t chunks_ ABSL_GUARDED_BY(mu_) = 0;
  int ring_slots_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration device_time_ ABSL_GUARDED_BY(mu_);
  // The update's receipts computed by the worker as it went; valid once
  // Drain succeeded (inflight_receipts_ready_).
  const CopyPlan* inflight_plan_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::vector<v1::Receipt> inflight_receipts_ ABSL_GUARDED_BY(mu_);
  bool inflight_receipts_ready_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_WORKER_CLIENT_H_
