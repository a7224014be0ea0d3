// The host backend's data plane: chunks arrive as gRPC messages whose byte
// strings become the host staging buffers (no extra copy); one owner thread
// scatters them into engine shared memory following the CopyPlan, with
// dtype conversion, quantising FP8 targets as their rows of blocks complete
// (quant_scatter.h). While it writes chunk k the stream thread is already
// receiving chunk k+1 (up to `staging_buffers` chunks in flight). An update
// from a registered source with memory (the trainer's tensors in its own
// shared memory) has no stream: the owner thread copies each chunk's ops
// straight from the trainer's tensors into the engines (docs/protocol.md,
// "Registered sources").
#ifndef WEIGHTSYNC_BACKENDS_HOST_HOST_DATA_PLANE_H_
#define WEIGHTSYNC_BACKENDS_HOST_HOST_DATA_PLANE_H_

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "backends/host/quant_scatter.h"
#include "daemon/core/data_plane.h"

namespace weightsync {

// Writes `ops` of one chunk held at `chunk` into the plan's engine regions,
// skipping engines flagged in `lost` (may be null). Exposed for tests.
void ScatterChunk(const CopyPlan& plan, const std::vector<CopyOp>& ops,
                  const uint8_t* chunk, const std::atomic<bool>* lost);

// ScatterChunk of chunk `index` of an update from a registered source with
// host memory: each op reads the trainer's tensor where it lives. DATA_LOSS
// naming the source if its memory shrank under the daemon.
absl::Status ScatterFromSource(const CopyPlan& plan, int64_t index,
                               const Source& source,
                               const std::atomic<bool>* lost);

// Applies a complete sparse patch payload (nnz int64 indices, then nnz
// values) through every use of its tensor. INVALID_ARGUMENT, naming the
// tensor, for an index outside the tensor; then nothing of it is written.
absl::Status ApplySparsePatch(const CopyPlan& plan, const SparsePatch& patch,
                              const uint8_t* payload,
                              const std::atomic<bool>* lost);

class HostDataPlane : public DataPlane {
 public:
  struct Options {
    int staging_buffers = 4;                    // chunks in flight, at least 2
    int64_t staging_budget = int64_t{1} << 30;  // bytes of staging, at most
  };
  explicit HostDataPlane(Options options);
  ~HostDataPlane() override;  // joins the worker

  absl::Status Begin(std::shared_ptr<const CopyPlan> plan,
                     const v1::StartWeightUpdateRequest& request) override;
  absl::Status BeginFromSource(std::shared_ptr<const CopyPlan> plan,
                               const v1::StartWeightUpdateRequest& request,
                               const Source& source) override;
  absl::Status SubmitChunk(int64_t index, std::string data,
                           absl::Time deadline) override;
  absl::Status Drain(absl::Time deadline) override;
  void Abort() override;
  void MarkEngineLost(int engine) override;
  int64_t chunks_written() const override;
  std::string name() const override { return "host"; }
  bool TakesPlanFp8AndPatches() const override { return true; }
  int64_t staging_bytes() const override;

 private:
  void Run();

  const Options options_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const CopyPlan> plan_ ABSL_GUARDED_BY(mu_);
  // The update's registered source (BeginFromSource; its caller keeps it
  // alive until the update ends), or null: chunks arrive by SubmitChunk.
  const Source* source_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::deque<std::pair<int64_t, std::string>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // worker is writing a chunk
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<std::atomic<bool>[]> lost_;  // per plan engine
  // The first failure of a sparse patch or of reading a source's memory.
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  // Sparse payloads being assembled from chunk pieces (worker thread only).
  std::vector<std::string> assembly_;
  std::vector<int64_t> assembled_;
  // FP8 targets' rows of blocks being gathered (worker thread only).
  QuantScatter quant_;
  int lost_size_ = 0;
  std::thread worker_;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_HOST_HOST_DATA_PLANE_H_
