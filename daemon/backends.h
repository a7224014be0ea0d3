// Wires the backends this build carries into the core: which memory kinds
// the daemon can open and which data plane serves a transfer group.
#ifndef WEIGHTSYNC_DAEMON_BACKENDS_H_
#define WEIGHTSYNC_DAEMON_BACKENDS_H_

#include <memory>

#include "backends/cuda/worker_client.h"
#include "backends/host/host_data_plane.h"
#include "daemon/core/coordinator.h"
#include "daemon/core/memory.h"

namespace weightsync {

// Opens MEMORY_HOST_SHM through the host backend and MEMORY_CUDA_IPC
// through the GPU worker (`gpu` may be null: then UNIMPLEMENTED naming the
// build).
std::shared_ptr<MemoryMapper> MakeMemoryMapper(
    std::shared_ptr<GpuWorkerSupervisor> gpu = nullptr);

std::shared_ptr<DataPlaneFactory> MakeDataPlaneFactory(
    HostDataPlane::Options host_options,
    std::shared_ptr<GpuWorkerSupervisor> gpu = nullptr);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_BACKENDS_H_
