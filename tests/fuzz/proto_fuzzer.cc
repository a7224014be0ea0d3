// libFuzzer target over raw request bytes, as they arrive from a client:
// the first byte picks the request, the rest is parsed as its protobuf
// (RegisterEngineRequest -> BuildEngineLayout; StartWeightUpdateRequest ->
// PlanChunks over its manifest). Whatever parses must be validated without
// crashing, hanging or allocating unboundedly. Built with --config=fuzz
// (clang); docs/reliability.md says how to run it.
#include <cstdint>
#include <cstdlib>

#include "common/chunk_planner.h"
#include "daemon/core/engine_layout.h"
#include "tests/fuzz/fuzz_memory.h"
#include "weightsync/v1/engine_service.pb.h"
#include "weightsync/v1/trainer_service.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightsync;  // NOLINT
  if (size < 1) return 0;
  if (data[0] % 2 == 0) {
    v1::RegisterEngineRequest r;
    if (!r.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
    fuzz::BoundedHeapMapper mapper;
    BuildEngineLayout(r, mapper).IgnoreError();
  } else {
    v1::StartWeightUpdateRequest r;
    if (!r.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
    const int64_t chunk = r.chunk_bytes() > 0 && r.chunk_bytes() <= (1 << 20)
                              ? r.chunk_bytes()
                              : 4096;
    auto plan = PlanChunks(r.tensors(), chunk);
    if (plan.ok() && plan->chunks.size() > (int64_t{1} << 22)) abort();
  }
  return 0;
}
