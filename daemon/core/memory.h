// Engine memory as the daemon sees it: a region it opened itself from a
// handle the engine sent, held through shared leases so a region can't vanish
// while a copy still writes into it (the last lease unmaps it).
#ifndef WEIGHTSYNC_DAEMON_CORE_MEMORY_H_
#define WEIGHTSYNC_DAEMON_CORE_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync {

// One opened engine allocation. Immutable after Open; safe to share across
// threads. The destructor closes the mapping.
class MappedRegion {
 public:
  virtual ~MappedRegion() = default;
  // Start of the region in the daemon's address space (host pointer for
  // shared memory, device pointer for CUDA IPC).
  virtual uint8_t* data() const = 0;
  virtual int64_t size() const = 0;
  virtual v1::MemoryKind kind() const = 0;
  virtual const std::string& device_uuid() const = 0;
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
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_MEMORY_H_
