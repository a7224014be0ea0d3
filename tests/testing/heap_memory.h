// An in-memory MemoryMapper for tests: every allocation is a zeroed heap
// buffer, whatever its kind or handle. Thread-safe.
#ifndef WEIGHTSYNC_TESTS_TESTING_HEAP_MEMORY_H_
#define WEIGHTSYNC_TESTS_TESTING_HEAP_MEMORY_H_

#include <sys/mman.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "daemon/core/memory.h"

namespace weightsync::testing {

class HeapRegion : public MappedRegion {
 public:
  explicit HeapRegion(int64_t size) : bytes_(size, 0) {}
  uint8_t* data() const override { return const_cast<uint8_t*>(bytes_.data()); }
  int64_t size() const override { return bytes_.size(); }
  v1::MemoryKind kind() const override { return v1::MEMORY_HOST_SHM; }
  const std::string& device_uuid() const override { return uuid_; }

 private:
  std::vector<uint8_t> bytes_;
  std::string uuid_ = "host";
};

// GPU memory as the host backend and the daemon's own reads see it: no
// host pointer (data() is null).
class GpuRegion : public MappedRegion {
 public:
  explicit GpuRegion(std::string uuid = "GPU-7") : uuid_(std::move(uuid)) {}
  uint8_t* data() const override { return nullptr; }
  int64_t size() const override { return 4096; }
  v1::MemoryKind kind() const override { return v1::MEMORY_CUDA_IPC; }
  const std::string& device_uuid() const override { return uuid_; }

 private:
  std::string uuid_;
};

// `bytes` of memory its owner truncated under the mapping (a memfd shrunk
// to nothing once mapped): every page raises SIGBUS, as a peer's
// ftruncate of its shared memory makes it. data() is null if the set-up
// failed.
class ShrunkRegion : public MappedRegion {
 public:
  explicit ShrunkRegion(int64_t bytes) : size_(bytes) {
    const int fd = memfd_create("ws-shrunk", MFD_CLOEXEC);
    if (fd < 0) return;
    void* p = MAP_FAILED;
    if (ftruncate(fd, bytes) == 0) {
      p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    if (p != MAP_FAILED && ftruncate(fd, 0) == 0) {
      data_ = static_cast<uint8_t*>(p);
    } else if (p != MAP_FAILED) {
      munmap(p, bytes);
    }
    close(fd);
  }
  ~ShrunkRegion() override {
    if (data_ != nullptr) munmap(data_, size_);
  }
  uint8_t* data() const override { return data_; }
  int64_t size() const override { return size_; }
  v1::MemoryKind kind() const override { return v1::MEMORY_HOST_SHM; }
  const std::string& device_uuid() const override { return uuid_; }

 private:
  uint8_t* data_ = nullptr;
  const int64_t size_;
  std::string uuid_ = "host";
};

class HeapMapper : public MemoryMapper {
 public:
  absl::StatusOr<std::shared_ptr<MappedRegion>> Open(
      const v1::Allocation& allocation) override {
    auto r = std::make_shared<HeapRegion>(allocation.size());
    absl::MutexLock lock(&mu_);
    opened.push_back(r);
    return std::shared_ptr<MappedRegion>(r);
  }
  absl::Mutex mu_;
  std::vector<std::shared_ptr<HeapRegion>> opened;
};

}  // namespace weightsync::testing

#endif  // WEIGHTSYNC_TESTS_TESTING_HEAP_MEMORY_H_
