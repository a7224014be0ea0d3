// Host-backend engine memory: POSIX shared-memory objects. An engine
// creates one with shm_open, sizes and maps it, puts its parameters in it,
// and registers it with kind MEMORY_HOST_SHM and handle = the object's name
// ("/weightsync-<engine>-<random>"). The daemon opens the name once and maps
// it shared; the engine may shm_unlink the name after RegisterEngine
// returns, and the mapping lives on until both sides unmap it.
#ifndef WEIGHTSYNC_BACKENDS_HOST_SHM_MEMORY_H_
#define WEIGHTSYNC_BACKENDS_HOST_SHM_MEMORY_H_

#include <sys/stat.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/core/memory.h"

namespace weightsync {

// Opens the shared-memory object a peer named, with `access` (O_RDONLY or
// O_RDWR), for the caller to fstat or map: the name must be "/name"; the
// open never blocks (O_NONBLOCK: a FIFO a peer made in /dev/shm can't hold
// a handler) and never follows a symbolic link (O_NOFOLLOW); anything but a
// regular file is refused (INVALID_ARGUMENT naming the object). On success
// the caller owns the descriptor (close-on-exec) and *st describes it.
absl::StatusOr<int> OpenShmObject(const std::string& name, int access,
                                  struct stat* st);

// A mapped shared-memory object; unmapped on destruction.
class ShmRegion : public MappedRegion {
 public:
  // Creates a new object of `size` bytes named `name` (O_EXCL), maps it.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Create(
      const std::string& name, int64_t size);
  // Opens an existing object; it must hold at least `size` bytes.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Open(
      const std::string& name, int64_t size);
  ~ShmRegion() override;

  uint8_t* data() const override { return data_; }
  int64_t size() const override { return size_; }
  v1::MemoryKind kind() const override { return v1::MEMORY_HOST_SHM; }
  const std::string& device_uuid() const override { return uuid_; }
  const std::string& name() const { return name_; }
  // Removes the name (the mapping stays valid).
  void Unlink();

 private:
  ShmRegion(std::string name, uint8_t* data, int64_t size)
      : name_(std::move(name)), data_(data), size_(size) {}
  const std::string name_;
  const std::string uuid_ = "host";
  uint8_t* const data_;
  const int64_t size_;
};

// Opens MEMORY_HOST_SHM allocations. Thread-safe.
class ShmMapper : public MemoryMapper {
 public:
  absl::StatusOr<std::shared_ptr<MappedRegion>> Open(
      const v1::Allocation& allocation) override;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_HOST_SHM_MEMORY_H_
