#include "backends/cuda/worker_env.h"

#include <malloc.h>
#include <stdlib.h>

#include "absl/strings/str_cat.h"

namespace weightsync {

WorkerEnvDefaults ApplyWorkerEnvDefaults() {
  WorkerEnvDefaults d;
  if (getenv("MALLOC_ARENA_MAX") == nullptr) {
    d.arenas_capped = mallopt(M_ARENA_MAX, kWorkerMallocArenas) == 1;
  }
  if (getenv("NCCL_RAS_ENABLE") == nullptr) {
    d.ras_disabled = setenv("NCCL_RAS_ENABLE", "0", /*overwrite=*/0) == 0;
  }
  return d;
}

std::string DescribeWorkerEnvDefaults(const WorkerEnvDefaults& d) {
  return absl::StrCat(
      "malloc arenas ",
      d.arenas_capped ? absl::StrCat("capped at ", kWorkerMallocArenas)
                      : "as MALLOC_ARENA_MAX or glibc says",
      "; NCCL RAS ",
      d.ras_disabled ? "off (NCCL_RAS_ENABLE=0; set it to 1 to keep it)"
                     : "as NCCL_RAS_ENABLE says");
}

}  // namespace weightsync
