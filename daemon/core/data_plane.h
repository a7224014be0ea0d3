// The data plane moves an update's bytes into engine memory following a
// CopyPlan. One implementation per backend (backends/host, later NCCL and
// IPC); the core drives it and never learns how bytes travel.
#ifndef WEIGHTSYNC_DAEMON_CORE_DATA_PLANE_H_
#define WEIGHTSYNC_DAEMON_CORE_DATA_PLANE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/source_registry.h"
#include "weightsync/v1/trainer_service.pb.h"

namespace weightsync {

// Thread-safety: Begin/Drain/Abort are called by the coordinator (one at a
// time); SubmitChunk by one stream thread at a time; MarkEngineLost from any
// thread. Implementations own their threads and join them on destruction.
class DataPlane {
 public:
  virtual ~DataPlane() = default;

  // A hint, at the start of StartWeightUpdate, that Begin follows within a
  // millisecond or two: wake what a call after idle time would find asleep
  // (the GPU worker's channel). Returns at once; changes nothing.
  virtual void Warm() {}

  // Prepares for `plan` (staging, streams) of `request`. FAILED_PRECONDITION
  // if an update is still in progress; RESOURCE_EXHAUSTED over the staging
  // budget.
  virtual absl::Status Begin(std::shared_ptr<const CopyPlan> plan,
                             const v1::StartWeightUpdateRequest& request) = 0;

  // M->N (issue 32): where the chunks of `plan` (a transfer plan's linked
  // copy plan) come from when every trainer rank sends: chunk k from NCCL
  // rank sender[k] in round round[k] (round r = chunk r of every link).
  // Called before Begin of that same plan; a data plane that receives its
  // own bytes but can't take them from several senders answers
  // UNIMPLEMENTED.
  struct ChunkSources {
    std::vector<int32_t> sender;
    std::vector<int64_t> round;
  };
  virtual absl::Status SetChunkSources(std::shared_ptr<const CopyPlan> plan,
                                       ChunkSources sources) {
    return absl::UnimplementedError(absl::StrCat(
        "updates of a transfer plan on the ", name(),
        " backend: the host backend (PushChunks per link) and the nccl "
        "backend (ncclSend per link, in rounds) take them"));
  }

  // Begin for an update from a registered source with memory
  // (source_registry.h): the bytes are copied from the source's tensors,
  // where the trainer keeps them, instead of from a packed buffer. The
  // caller keeps `source` alive until the update ends. UNIMPLEMENTED where
  // the backend can't read the trainer's memory.
  virtual absl::Status BeginFromSource(
      std::shared_ptr<const CopyPlan> plan,
      const v1::StartWeightUpdateRequest& request, const Source& source) {
    return absl::UnimplementedError(
        "copying from a registered source's memory (the ipc backend does)");
  }

  // Queues chunk `index` (exactly its planned size) for writing. Blocks
  // while every staging buffer is busy, at most until `deadline`.
  // UNIMPLEMENTED where bytes arrive some other way (NCCL).
  virtual absl::Status SubmitChunk(int64_t index, std::string data,
                                   absl::Time deadline) = 0;

  // Waits until the first `n` chunks are in engine memory (their source
  // buffers free again). UNIMPLEMENTED where chunks are not tracked so.
  virtual absl::Status WaitChunks(int64_t n, absl::Time deadline) {
    return absl::UnimplementedError("WaitChunks");
  }

  // Waits until every submitted chunk is in engine memory. Returns the first
  // copy failure, or DEADLINE_EXCEEDED.
  virtual absl::Status Drain(absl::Time deadline) = 0;

  // Drops queued chunks and waits for the copy in progress to end.
  virtual void Abort() = 0;

  // From any thread, while the coordinator may be inside Drain, WaitStaged
  // or WaitChunks: the update's trainer is gone, so bytes it was to send
  // will never come; make such a wait return an error soon (Abort still
  // follows). Nothing to do where every byte already arrived when those
  // are called (host).
  virtual void Cancel() {}

  // Stops writing into engine `engine` (index into the plan's engines).
  virtual void MarkEngineLost(int engine) = 0;

  // Chunks fully written into engine memory in the current update.
  virtual int64_t chunks_written() const = 0;

  // GPU time of the last drained update (first operation to last), zero
  // where the data plane does not measure it.
  virtual absl::Duration device_time() const { return absl::ZeroDuration(); }

  // True where bytes reach the data plane by themselves (NCCL broadcast)
  // rather than through SubmitChunk.
  virtual bool ReceivesOwnBytes() const { return false; }

  // True where the data plane takes the transfer-plan updates that are more
  // than dense copies: FP8 targets fed by several links
  // (QuantTarget::gathered) and sparse patches of pieces; Start refuses
  // such an update, before anything pauses, on a data plane that does not.
  virtual bool TakesPlanFp8AndPatches() const { return false; }

  virtual std::string name() const = 0;
  // Bytes of staging the update in progress holds now (metrics).
  virtual int64_t staging_bytes() const { return 0; }

  // Receipts of memory only the data plane can read (GPU): per engine of
  // `plan`, bit for bit what ComputeReceipt (daemon/core/receipt.h) returns
  // for the plan's dense tensors; an empty receipt where skip[i]. Call after
  // Drain.
  virtual absl::StatusOr<std::vector<v1::Receipt>> DeviceReceipts(
      const CopyPlan& plan, const std::vector<bool>& skip,
      absl::Time deadline) {
    return absl::UnimplementedError("receipts of device memory");
  }

  // Staged updates whose bytes arrive by themselves (NCCL) are held in the
  // data plane's own (device) staging: the bytes that may be staged, or -1
  // where it can't stage.
  virtual int64_t DeviceStagingBudget() const { return -1; }
  // Like Begin, but every chunk stays in staging; engine memory is not
  // touched until CommitStaged.
  virtual absl::Status BeginStaged(
      std::shared_ptr<const CopyPlan> plan,
      const v1::StartWeightUpdateRequest& request) {
    return absl::UnimplementedError("staged updates in device memory");
  }
  // Waits until every chunk of a staged update is in staging.
  virtual absl::Status WaitStaged(absl::Time deadline) {
    return absl::UnimplementedError("WaitStaged");
  }
  // Starts copying staging into engine memory; Drain waits for it.
  virtual absl::Status CommitStaged(absl::Time deadline) {
    return absl::UnimplementedError("CommitStaged");
  }
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_DATA_PLANE_H_
