// Registered sources (docs/protocol.md, "Registered sources"): manifests a
// trainer registered once, validated once and named by id, so that an
// update of the same tensors (every RL step) neither resends nor
// revalidates them; on the ipc backend also where each tensor lives in the
// trainer's own GPU memory, so the daemon copies from the trainer's tensors
// straight into the engines' through the copy plan, with no pack buffer.
//
// A source belongs to the transfer group: InitWeightTransfer drops them all
// (Clear). The registry holds at most `max_sources`; registering one more
// drops the least recently used. A source is immutable once registered and
// shared by the updates that use it, so its memory stays open until the
// last update using it ends.
//
// Thread-safety: every method may be called from any thread.
#ifndef WEIGHTSYNC_DAEMON_CORE_SOURCE_REGISTRY_H_
#define WEIGHTSYNC_DAEMON_CORE_SOURCE_REGISTRY_H_

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/chunk_planner.h"
#include "daemon/core/memory.h"
#include "weightsync/v1/trainer_service.pb.h"

namespace weightsync {

struct Source {
  std::string id;
  Manifest manifest;                   // dense tensors, validated
  std::vector<int64_t> payload_bytes;  // per tensor
  int64_t total_bytes = 0;
  // Registered memory (empty: a manifest only): the opened allocations and
  // where each manifest tensor's bytes start.
  struct Placement {
    int32_t region = 0;  // index into regions
    int64_t offset = 0;  // bytes into the region
  };
  std::vector<std::shared_ptr<MappedRegion>> regions;
  std::vector<Placement> placements;  // index = manifest index
  bool has_memory() const { return !regions.empty(); }
};

struct SourceLimits {
  int max_sources = 8;
  int64_t max_tensors = 1 << 20;
  int max_rank = 16;
  int64_t max_name_length = 1024;
  int64_t max_allocations = 1 << 16;
};

class SourceRegistry {
 public:
  explicit SourceRegistry(SourceLimits limits) : limits_(limits) {}

  // Validates `request` (INVALID_ARGUMENT naming the tensor or allocation
  // concerned; nothing is kept then), opens its allocations through
  // `mapper` and keeps it. `memory` is the kind of memory the backend
  // copies from (MEMORY_HOST_SHM for the host backend, MEMORY_CUDA_IPC for
  // the ipc backend, which also takes MEMORY_CUDA_VMM);
  // MEMORY_KIND_UNSPECIFIED: a manifest only, INVALID_ARGUMENT if the
  // request has memory. The same content registered again returns the
  // source already kept.
  absl::StatusOr<std::shared_ptr<const Source>> Register(
      const v1::RegisterSourceRequest& request, MemoryMapper& mapper,
      v1::MemoryKind memory);
  // NOT_FOUND for an id this registry does not hold (any more).
  absl::StatusOr<std::shared_ptr<const Source>> Find(const std::string& id);
  absl::Status Unregister(const std::string& id);
  // Drops every source (a new transfer group).
  void Clear();
  int size() const;

 private:
  absl::Status Validate(const v1::RegisterSourceRequest& request,
                        v1::MemoryKind memory, Source* source) const;
  absl::Status ValidateMemory(const v1::RegisterSourceRequest& request,
                              v1::MemoryKind memory,
                              const Source& source) const;

  struct Entry {
    std::string content;  // the serialized request: equality, not a hash
    std::shared_ptr<const Source> source;
  };
  const SourceLimits limits_;
  mutable absl::Mutex mu_;
  std::list<Entry> entries_ ABSL_GUARDED_BY(mu_);  // most recent first
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_SOURCE_REGISTRY_H_
