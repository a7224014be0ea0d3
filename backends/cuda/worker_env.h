// The GPU worker's process defaults for a long life of communicators
// (issue 36): every trainer forms a new NCCL communicator, and each one
// starts threads. Measured on 2 x H200 (tests/gpu/run_leak_ab.sh, 12
// trainers): glibc gives each new thread its own malloc arena (up to 8 per
// core) and keeps what NCCL freed in them, ~4 MB of resident memory per
// communicator that malloc_trim does not return; MALLOC_ARENA_MAX=2 kept
// it flat. NCCL's RAS thread kept a descriptor per dead peer;
// NCCL_RAS_ENABLE=0 kept them flat. What the operator set in the
// environment wins.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_WORKER_ENV_H_
#define WEIGHTSYNC_BACKENDS_CUDA_WORKER_ENV_H_

#include <string>

namespace weightsync {

struct WorkerEnvDefaults {
  bool arenas_capped = false;  // mallopt(M_ARENA_MAX, kWorkerMallocArenas)
  bool ras_disabled = false;   // NCCL_RAS_ENABLE=0 set for NCCL
};

inline constexpr int kWorkerMallocArenas = 2;

// Call first in main, before any thread starts (arenas are per thread) and
// before NCCL reads its environment. Caps glibc's arenas unless
// MALLOC_ARENA_MAX is set, and sets NCCL_RAS_ENABLE=0 unless it is set.
WorkerEnvDefaults ApplyWorkerEnvDefaults();

// One line for the worker's log: what was chosen and how to undo it.
std::string DescribeWorkerEnvDefaults(const WorkerEnvDefaults& d);

}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_WORKER_ENV_H_
