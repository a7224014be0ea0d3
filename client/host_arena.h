// HostArena: an engine's parameters in one POSIX shared-memory object, laid
// out at 256-byte aligned offsets, ready to register with the host backend.
// Not thread-safe; the memory it hands out is the engine's to read.
#ifndef WEIGHTSYNC_CLIENT_HOST_ARENA_H_
#define WEIGHTSYNC_CLIENT_HOST_ARENA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "backends/host/shm_memory.h"
#include "weightsync/v1/engine_service.pb.h"

namespace weightsync {

class HostArena {
 public:
  // Lays out `parameters` (allocation and offset are filled in) and creates
  // the shared memory `shm_name` ("/name") to hold them, zero-filled.
  static absl::StatusOr<std::unique_ptr<HostArena>> Create(
      const std::string& shm_name, std::vector<v1::Parameter> parameters);

  // Assigns allocation 0 and 256-byte aligned offsets, in order; returns
  // the bytes needed. Create uses it; a reader of the arena can too.
  static absl::StatusOr<int64_t> Layout(std::vector<v1::Parameter>* params);

  // The registration for these parameters (engine_id and version unset).
  v1::RegisterEngineRequest Registration() const;
  // Start of parameter `name`'s bytes, or nullptr.
  uint8_t* data(const std::string& name) const;
  const std::vector<v1::Parameter>& parameters() const { return params_; }
  ShmRegion& region() { return *region_; }

 private:
  std::unique_ptr<ShmRegion> region_;
  std::vector<v1::Parameter> params_;
  absl::flat_hash_map<std::string, int64_t> offsets_;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_CLIENT_HOST_ARENA_H_
