// Tests of the GPU data plane's daemon side without a GPU: a supervisor
// whose worker never starts (its calls fail) and a mapper that opens every
// allocation as a GpuRegion of it, numbering them from 1.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_FAKE_GPU_MAPPER_H_
#define WEIGHTSYNC_BACKENDS_CUDA_FAKE_GPU_MAPPER_H_

#include <cstdint>
#include <memory>
#include <utility>

#include "backends/cuda/worker_client.h"

namespace weightsync {

class FakeGpuMapper : public MemoryMapper {
 public:
  explicit FakeGpuMapper(std::shared_ptr<GpuWorkerSupervisor> sup)
      : sup_(std::move(sup)) {}
  absl::StatusOr<std::shared_ptr<MappedRegion>> Open(
      const v1::Allocation& a) override {
    return std::shared_ptr<MappedRegion>(
        std::make_shared<GpuRegion>(sup_, next_++, a.size(), a.device_uuid()));
  }

 private:
  std::shared_ptr<GpuWorkerSupervisor> sup_;
  int64_t next_ = 1;
};

// A supervisor of no worker, with GPU staging budget `budget`.
inline std::shared_ptr<GpuWorkerSupervisor> FakeSupervisor(int64_t budget) {
  GpuWorkerSupervisor::Options o;
  o.worker_binary = "/nonexistent/weightsync_gpu_worker";
  o.socket_path = "/nonexistent/worker.sock";
  o.staging_budget = budget;
  return std::make_shared<GpuWorkerSupervisor>(o);
}

}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_FAKE_GPU_MAPPER_H_
