// GPU memory shared between processes through the CUDA virtual memory
// management API (cuMemCreate + a POSIX file descriptor) instead of legacy
// cudaIpcGetMemHandle. Measured on an H200 (bench/ipc_probe): a copy
// between two legacy-IPC-opened buffers runs at 1.03 TB/s, half of a copy
// between the same process's own buffers (2.14 TB/s); memory imported here
// is mapped by the importer itself, at the allocation granularity.
//
// The driver API is reached through cudaGetDriverEntryPointByVersion, so
// binaries link only the runtime and still load where no driver is
// installed (CI). A file descriptor moves between processes either over a
// Unix socket (SCM_RIGHTS) or by pidfd_getfd from a process that the
// caller may ptrace (same uid, or CAP_SYS_PTRACE).
#ifndef WEIGHTSYNC_BACKENDS_CUDA_VMM_H_
#define WEIGHTSYNC_BACKENDS_CUDA_VMM_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace weightsync {
namespace cuda {

// Memory this process allocated and can export, or imported from another.
struct VmmMemory {
  void* ptr = nullptr;
  size_t size = 0;      // mapped bytes (a multiple of the granularity)
  uint64_t handle = 0;  // CUmemGenericAllocationHandle
  int fd = -1;          // exporter: the shareable POSIX fd (owned)
};

// Allocation granularity (recommended) of `device`, e.g. 2 MiB.
absl::StatusOr<size_t> VmmGranularity(int device);

// Allocates at least `bytes` on `device` (rounded up to the granularity),
// maps it read-write for `device` and exports a POSIX fd.
absl::StatusOr<VmmMemory> VmmAllocateExportable(int device, size_t bytes);

// Imports `fd` (this process's copy of an exporter's fd; not closed here)
// holding `size` bytes, maps it read-write for `device`.
absl::StatusOr<VmmMemory> VmmImport(int fd, size_t size, int device);

// Unmaps, releases, closes the fd if owned. Safe on an empty VmmMemory.
void VmmFree(VmmMemory* memory);

// Bytes of the allocation that `ptr` points into, counted from `ptr`
// (cuMemGetAddressRange): how much a mapping of another process's memory
// really holds.
absl::StatusOr<size_t> BytesFrom(const void* ptr);

// This process's copy of file descriptor `fd` of process `pid`
// (pidfd_open + pidfd_getfd). PERMISSION_DENIED names what to fix.
absl::StatusOr<int> DuplicatePeerFd(pid_t pid, int fd);

// Bytes to cudaMalloc for memory shared by a legacy cudaIpc handle: `bytes`
// rounded up to 2 MiB. Another process copies out of (or into) an import
// at half speed when the exported allocation is not a whole number of
// 2 MiB (measured on H200; docs/protocol.md, "CUDA IPC").
constexpr int64_t LegacyIpcAllocationBytes(int64_t bytes) {
  constexpr int64_t kTwoMiB = int64_t{2} << 20;
  return (bytes + kTwoMiB - 1) / kTwoMiB * kTwoMiB;
}

}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_VMM_H_
