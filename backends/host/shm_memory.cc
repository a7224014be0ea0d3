#include "backends/host/shm_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/echo.h"

namespace weightsync {
namespace {

absl::Status Errno(const std::string& what) {
  const int e = errno;
  const std::string msg = absl::StrCat(what, ": ", std::strerror(e));
  return e == ENOENT ? absl::NotFoundError(msg)
                     : absl::FailedPreconditionError(msg);
}

bool ValidName(const std::string& name) {
  // One leading slash, no other, printable, bounded (shm_open's rules).
  if (name.size() < 2 || name.size() > 255 || name[0] != '/') return false;
  for (size_t i = 1; i < name.size(); ++i) {
    if (name[i] == '/' || name[i] < 0x21 || name[i] > 0x7e) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<int> OpenShmObject(const std::string& name, int access,
                                  struct stat* st) {
  if (!ValidName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", Echo(name), "' is not a shared-memory name (\"/name\")"));
  }
  const int fd =
      shm_open(name.c_str(), access | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) return Errno(absl::StrCat("shm_open(", name, ")"));
  if (fstat(fd, st) != 0) {
    absl::Status s = Errno(absl::StrCat("fstat(", name, ")"));
    close(fd);
    return s;
  }
  if (!S_ISREG(st->st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("'", name,
                     "' is not a shared-memory object (a FIFO, device or "
                     "directory in /dev/shm)"));
  }
  return fd;
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Create(
    const std::string& name, int64_t size) {
  if (!ValidName(name) || size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad shared-memory name '", name, "' or size ", size));
  }
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return Errno(absl::StrCat("shm_open(", name, ")"));
  if (ftruncate(fd, size) != 0) {
    absl::Status s = Errno(absl::StrCat("ftruncate(", name, ")"));
    close(fd);
    shm_unlink(name.c_str());
    return s;
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    absl::Status s = Errno(absl::StrCat("mmap(", name, ")"));
    shm_unlink(name.c_str());
    return s;
  }
  return std::unique_ptr<ShmRegion>(
      new ShmRegion(name, static_cast<uint8_t*>(p), size));
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Open(
    const std::string& name, int64_t size) {
  struct stat st;
  absl::StatusOr<int> opened = OpenShmObject(name, O_RDWR, &st);
  if (!opened.ok()) return opened.status();
  const int fd = *opened;
  if (st.st_size < size) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory '", name, "' holds ", st.st_size,
                     " bytes, fewer than the registered ", size));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return Errno(absl::StrCat("mmap(", name, ")"));
  return std::unique_ptr<ShmRegion>(
      new ShmRegion(name, static_cast<uint8_t*>(p), size));
}

ShmRegion::~ShmRegion() { munmap(data_, size_); }

void ShmRegion::Unlink() { shm_unlink(name_.c_str()); }

absl::StatusOr<std::shared_ptr<MappedRegion>> ShmMapper::Open(
    const v1::Allocation& allocation) {
  if (allocation.kind() != v1::MEMORY_HOST_SHM) {
    return absl::UnimplementedError("not a shared-memory allocation");
  }
  absl::StatusOr<std::unique_ptr<ShmRegion>> r =
      ShmRegion::Open(allocation.handle(), allocation.size());
  if (!r.ok()) return r.status();
  return std::shared_ptr<MappedRegion>(*std::move(r));
}

}  // namespace weightsync
