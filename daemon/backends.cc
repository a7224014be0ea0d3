#include "daemon/backends.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_support.h"
#include "backends/host/shm_memory.h"

namespace weightsync {
namespace {

class Mapper : public MemoryMapper {
 public:
  absl::StatusOr<std::shared_ptr<MappedRegion>> Open(
      const v1::Allocation& allocation) override {
    switch (allocation.kind()) {
      case v1::MEMORY_HOST_SHM:
        return shm_.Open(allocation);
      case v1::MEMORY_CUDA_IPC:
        return absl::UnimplementedError(absl::StrCat(
            "CUDA IPC memory is not supported by this daemon yet (",
            CudaBuildInfo(), "); register host shared memory instead"));
      default:
        return absl::InvalidArgumentError("unknown memory kind");
    }
  }

 private:
  ShmMapper shm_;
};

class Factory : public DataPlaneFactory {
 public:
  explicit Factory(HostDataPlane::Options host) : host_(host) {}
  absl::StatusOr<std::shared_ptr<DataPlane>> Create(
      const v1::InitWeightTransferRequest& request) override {
    switch (request.backend()) {
      case v1::BACKEND_HOST:
        return std::make_shared<HostDataPlane>(host_);
      case v1::BACKEND_NCCL:
      case v1::BACKEND_IPC:
        return absl::UnimplementedError(absl::StrCat(
            "the ", request.backend() == v1::BACKEND_NCCL ? "nccl" : "ipc",
            " backend is not available in this daemon (", CudaBuildInfo(),
            "); use the host backend"));
      default:
        return absl::InvalidArgumentError("unknown backend");
    }
  }
  int LocalWorldSize(v1::Backend) const override { return 1; }

 private:
  const HostDataPlane::Options host_;
};

}  // namespace

std::shared_ptr<MemoryMapper> MakeMemoryMapper() {
  return std::make_shared<Mapper>();
}

std::shared_ptr<DataPlaneFactory> MakeDataPlaneFactory(
    HostDataPlane::Options host_options) {
  return std::make_shared<Factory>(host_options);
}

}  // namespace weightsync
