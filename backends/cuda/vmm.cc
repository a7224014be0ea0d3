#include "backends/cuda/vmm.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace weightsync {
namespace cuda {
namespace {

struct Driver {
  decltype(&cuGetErrorString) get_error_string = nullptr;
  decltype(&cuDeviceGet) device_get = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemGetAddressRange) address_range = nullptr;
  absl::Status status;
};

template <typename F>
absl::Status Load(const char* name, F* f) {
  cudaDriverEntryPointQueryResult q;
  void* p = nullptr;
  const cudaError_t e =
      cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || p == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("CUDA driver entry point ", name,
                     " unavailable: ", cudaGetErrorString(e)));
  }
  *f = reinterpret_cast<F>(p);
  return absl::OkStatus();
}

const Driver& D() {
  static const Driver* d = [] {
    auto* d = new Driver;
    absl::Status s;
    for (absl::Status x :
         {Load("cuGetErrorString", &d->get_error_string),
          Load("cuDeviceGet", &d->device_get),
          Load("cuMemGetAllocationGranularity", &d->granularity),
          Load("cuMemCreate", &d->create),
          Load("cuMemExportToShareableHandle", &d->export_handle),
          Load("cuMemImportFromShareableHandle", &d->import_handle),
          Load("cuMemAddressReserve", &d->reserve),
          Load("cuMemAddressFree", &d->address_free), Load("cuMemMap", &d->map),
          Load("cuMemUnmap", &d->unmap), Load("cuMemSetAccess", &d->set_access),
          Load("cuMemRelease", &d->release),
          Load("cuMemGetAddressRange", &d->address_range)}) {
      if (s.ok()) s = x;
    }
    d->status = s;
    return d;
  }();
  return *d;
}

absl::Status Cu(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const char* msg = nullptr;
  if (D().get_error_string != nullptr) D().get_error_string(r, &msg);
  return absl::InternalError(absl::StrCat(what, ": ", msg ? msg : "?", " (",
                                          static_cast<int>(r), ")"));
}

#define WS_CU(x)                   \
  do {                             \
    absl::Status s_ = Cu((x), #x); \
    if (!s_.ok()) return s_;       \
  } while (0)

absl::StatusOr<CUmemAllocationProp> Prop(int device) {
  if (!D().status.ok()) return D().status;
  // The primary context must exist before driver calls use it.
  if (cudaSetDevice(device) != cudaSuccess ||
      cudaFree(nullptr) != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot use GPU ", device));
  }
  CUdevice dev;
  WS_CU(D().device_get(&dev, device));
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

absl::Status MapReadWrite(VmmMemory* m, int device, size_t align) {
  CUdeviceptr p = 0;
  WS_CU(D().reserve(&p, m->size, align, 0, 0));
  m->ptr = reinterpret_cast<void*>(p);
  WS_CU(D().map(p, m->size, 0, m->handle, 0));
  CUmemAccessDesc access;
  std::memset(&access, 0, sizeof(access));
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUdevice dev;
  WS_CU(D().device_get(&dev, device));
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  WS_CU(D().set_access(p, m->size, &access, 1));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<size_t> VmmGranularity(int device) {
  absl::StatusOr<CUmemAllocationProp> prop = Prop(device);
  if (!prop.ok()) return prop.status();
  size_t g = 0;
  WS_CU(D().granularity(&g, &*prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  return g;
}

absl::StatusOr<VmmMemory> VmmAllocateExportable(int device, size_t bytes) {
  absl::StatusOr<CUmemAllocationProp> prop = Prop(device);
  if (!prop.ok()) return prop.status();
  absl::StatusOr<size_t> g = VmmGranularity(device);
  if (!g.ok()) return g.status();
  VmmMemory m;
  m.size = (bytes + *g - 1) / *g * *g;
  CUmemGenericAllocationHandle h;
  absl::Status s = Cu(D().create(&h, m.size, &*prop, 0), "cuMemCreate");
  if (!s.ok()) return s;
  m.handle = h;
  s = Cu(
      D().export_handle(&m.fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
      "cuMemExportToShareableHandle");
  if (s.ok()) s = MapReadWrite(&m, device, *g);
  if (!s.ok()) {
    VmmFree(&m);
    return s;
  }
  return m;
}

absl::StatusOr<VmmMemory> VmmImport(int fd, size_t size, int device) {
  absl::StatusOr<size_t> g = VmmGranularity(device);
  if (!g.ok()) return g.status();
  if (size == 0 || size % *g != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory of ", size,
                     " bytes is not a multiple of the allocation "
                     "granularity (",
                     *g, ")"));
  }
  VmmMemory m;
  m.size = size;
  CUmemGenericAllocationHandle h;
  absl::Status s = Cu(
      D().import_handle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      "cuMemImportFromShareableHandle");
  if (!s.ok()) return s;
  m.handle = h;
  s = MapReadWrite(&m, device, *g);
  if (!s.ok()) {
    VmmFree(&m);
    return s;
  }
  return m;
}

void VmmFree(VmmMemory* m) {
  if (m->ptr != nullptr) {
    const auto p = reinterpret_cast<CUdeviceptr>(m->ptr);
    D().unmap(p, m->size);
    D().address_free(p, m->size);
    m->ptr = nullptr;
  }
  if (m->handle != 0) {
    D().release(m->handle);
    m->handle = 0;
  }
  if (m->fd >= 0) {
    close(m->fd);
    m->fd = -1;
  }
}

absl::StatusOr<size_t> BytesFrom(const void* ptr) {
  if (!D().status.ok()) return D().status;
  CUdeviceptr base = 0;
  size_t size = 0;
  WS_CU(D().address_range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)));
  return size - (reinterpret_cast<CUdeviceptr>(ptr) - base);
}

absl::StatusOr<int> DuplicatePeerFd(pid_t pid, int fd) {
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) {
    return absl::NotFoundError(
        absl::StrCat("process ", pid, ": ", std::strerror(errno)));
  }
  const int copy = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, fd, 0));
  const int err = errno;
  close(pidfd);
  if (copy < 0) {
    if (err == EPERM) {
      return absl::PermissionDeniedError(absl::StrCat(
          "may not take fd ", fd, " of process ", pid,
          " (pidfd_getfd needs the same uid and ptrace permission: "
          "kernel.yama.ptrace_scope, or CAP_SYS_PTRACE)"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("fd ", fd, " of process ", pid, ": ", std::strerror(err)));
  }
  return copy;
}

}  // namespace cuda
}  // namespace weightsync
