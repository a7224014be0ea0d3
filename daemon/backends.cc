#include "daemon/backends.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_support.h"
#include "backends/host/shm_memory.h"

namespace weightsync {
namespace {

absl::Status NoGpu(const std::string& what) {
  return absl::UnimplementedError(
      absl::StrCat(what,
                   " needs the GPU worker, which this daemon does not "
                   "have (",
                   CudaBuildInfo(),
                   "); use host shared memory and the host "
                   "backend"));
}

class Mapper : public MemoryMapper {
 public:
  explicit Mapper(std::shared_ptr<GpuWorkerSupervisor> gpu)
      : gpu_(std::move(gpu)) {}
  absl::StatusOr<std::shared_ptr<MappedRegion>> Open(
      const v1::Allocation& allocation) override {
    switch (allocation.kind()) {
      case v1::MEMORY_HOST_SHM:
        return shm_.Open(allocation);
      case v1::MEMORY_CUDA_IPC:
      case v1::MEMORY_CUDA_VMM:
        if (gpu_ == nullptr) return NoGpu("CUDA IPC memory");
        return GpuMapper(gpu_).Open(allocation);
      default:
        return absl::InvalidArgumentError("unknown memory kind");
    }
  }

 private:
  ShmMapper shm_;
  const std::shared_ptr<GpuWorkerSupervisor> gpu_;
};

class Factory : public DataPlaneFactory {
 public:
  Factory(HostDataPlane::Options host, std::shared_ptr<GpuWorkerSupervisor> gpu)
      : host_(host), gpu_(std::move(gpu)) {}
  absl::StatusOr<std::shared_ptr<DataPlane>> Create(
      const v1::InitWeightTransferRequest& request) override {
    switch (request.backend()) {
      case v1::BACKEND_HOST:
        return std::make_shared<HostDataPlane>(host_);
      case v1::BACKEND_NCCL: {
        if (gpu_ == nullptr) return NoGpu("the nccl backend");
        if (request.nccl_unique_id().size() != 128) {
          return absl::InvalidArgumentError(absl::StrCat(
              "nccl_unique_id must be the 128 bytes of an ncclUniqueId, not ",
              request.nccl_unique_id().size()));
        }
        if (request.world_size() < 2 || request.rank_offset() < 1) {
          return absl::InvalidArgumentError(
              "the nccl backend needs world_size >= 2 and rank_offset >= 1 "
              "(rank 0 is the trainer)");
        }
        worker::v1::InitGroupRequest init;
        init.set_nccl_unique_id(request.nccl_unique_id());
        init.set_world_size(request.world_size());
        init.set_rank(request.rank_offset());
        init.set_device(gpu_->options().device);
        init.set_timeout_ms(request.timeout_ms());
        absl::Status s = gpu_->InitGroup(init);
        if (!s.ok()) return s;
        return std::make_shared<GpuDataPlane>(gpu_, v1::BACKEND_NCCL);
      }
      case v1::BACKEND_IPC:
        if (gpu_ == nullptr) return NoGpu("the ipc backend");
        return std::make_shared<GpuDataPlane>(gpu_, v1::BACKEND_IPC);
      default:
        return absl::InvalidArgumentError("unknown backend");
    }
  }
  int LocalWorldSize(v1::Backend) const override { return 1; }

 private:
  const HostDataPlane::Options host_;
  const std::shared_ptr<GpuWorkerSupervisor> gpu_;
};

}  // namespace

std::shared_ptr<MemoryMapper> MakeMemoryMapper(
    std::shared_ptr<GpuWorkerSupervisor> gpu) {
  return std::make_shared<Mapper>(std::move(gpu));
}

std::shared_ptr<DataPlaneFactory> MakeDataPlaneFactory(
    HostDataPlane::Options host_options,
    std::shared_ptr<GpuWorkerSupervisor> gpu) {
  return std::make_shared<Factory>(host_options, std::move(gpu));
}

}  // namespace weightsync
