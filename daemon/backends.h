// Wires the backends this build carries into the core: which memory kinds
// the daemon can open and which data plane serves a transfer group.
#ifndef WEIGHTSYNC_DAEMON_BACKENDS_H_
#define WEIGHTSYNC_DAEMON_BACKENDS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
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

// Makes the private directory (mode 0700) for the GPU worker's socket:
// `<parent>/weightsync-worker.<pid>.XXXXXX`, so only this uid (and root)
// can reach the worker. First removes the directories that daemons of this
// uid which no longer run left behind (killed with SIGKILL, they could not
// clean up): a directory is swept only if it is ours, its pid is gone and
// it holds nothing but a socket named worker.sock. Returns the new
// directory's path.
absl::StatusOr<std::string> MakeWorkerDir(const std::string& parent = "/tmp");

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_BACKENDS_H_
