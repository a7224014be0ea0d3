// Engine memory for the fuzzers: heap regions of exactly the registered
// size (so AddressSanitizer sees any write past a parameter's allocation),
// refusing allocations above kMaxRegionBytes as a real mapper refuses
// memory that isn't there.
#ifndef WEIGHTSYNC_TESTS_FUZZ_FUZZ_MEMORY_H_
#define WEIGHTSYNC_TESTS_FUZZ_FUZZ_MEMORY_H_

#include <memory>

#include "absl/status/status.h"
#include "tests/testing/heap_memory.h"

namespace weightsync::fuzz {

inline constexpr int64_t kMaxRegionBytes = int64_t{4} << 20;

class BoundedHeapMapper : public MemoryMapper {
 public:
  absl::StatusOr<std::shared_ptr<MappedRegion>> Open(
      const v1::Allocation& allocation) override {
    if (allocation.size() <= 0 || allocation.size() > kMaxRegionBytes) {
      return absl::InvalidArgumentError("allocation size out of range");
    }
    return std::shared_ptr<MappedRegion>(
        std::make_shared<testing::HeapRegion>(allocation.size()));
  }
};

}  // namespace weightsync::fuzz

#endif  // WEIGHTSYNC_TESTS_FUZZ_FUZZ_MEMORY_H_
