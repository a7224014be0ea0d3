// Engine memory as the daemon sees it: a region it opened itself from a
// handle the engine sent, held through shared leases so a region can't vanish
// while a copy still writes into it (the last lease unmaps it).
#ifndef WEIGHTSYNC_DAEMON_CORE_MEMORY_H_
#define WEIGHTSYNC_DAEMON_CORE_MEMORY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync {

// One opened engine allocation. Immutable after Open; safe to share across
// threads. The destructor closes the mapping.
struct EngineLayout;  // engine_layout.h

class MappedRegion {
 public:
  virtual ~MappedRegion() = default;
  // Start of the region in the daemon's address space (host pointer for
  // shared memory, device pointer for CUDA IPC).
  virtual uint8_t* data() const = 0;
  virtual int64_t size() const = 0;
  virtual v1::MemoryKind kind() const = 0;
  virtual const std::string& device_uuid() const = 0;

  // Set once the memory behind the region was found gone under the daemon
  // (its owner shrank the object: bus_guard.h); the region then maps
  // anonymous memory that reaches nobody, and the engine is failed.
  bool faulted() const { return faulted_.load(std::memory_order_acquire); }
  std::atomic<bool>* faulted_flag() const { return &faulted_; }

 private:
  mutable std::atomic<bool> faulted_{false};
};

// Opens allocations of the kinds it supports. Implementations live in
// backends/; the core never knows which. Thread-safe.
class MemoryMapper {
 public:
  virtual ~MemoryMapper() = default;
  // Opens `allocation` (already checked for a non-empty handle and a
  // positive size). The region is at least allocation.size() bytes.
  // UNIMPLEMENTED for a kind this build can't open.
  virtual absl::StatusOr<std::shared_ptr<MappedRegion>> Open(
      const v1::Allocation& allocation) = 0;
  // The receipt (common/checksum.h) of the segments of `engine` whose
  // source is in `sources`, for memory the daemon can't read itself (GPU
  // memory: computed on the GPU). UNIMPLEMENTED where it can't.
  virtual absl::StatusOr<v1::Receipt> DeviceReceipt(
      const EngineLayout& engine,
      const absl::flat_hash_set<std::string>& sources, absl::Time deadline) {
    return absl::UnimplementedError("receipts of device memory");
  }
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_MEMORY_H_
