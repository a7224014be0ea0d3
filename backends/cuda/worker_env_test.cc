// ApplyWorkerEnvDefaults (backends/cuda/worker_env.h): the worker caps
// glibc's arenas and turns NCCL's RAS off unless the operator said
// otherwise in the environment.
#include "backends/cuda/worker_env.h"

#include <stdlib.h>

#include <string>

#include "gtest/gtest.h"

namespace weightsync {
namespace {

TEST(WorkerEnvTest, DefaultsWhereTheEnvironmentIsSilent) {
  unsetenv("MALLOC_ARENA_MAX");
  unsetenv("NCCL_RAS_ENABLE");
  const WorkerEnvDefaults d = ApplyWorkerEnvDefaults();
#if defined(__SANITIZE_ADDRESS__)
  // ASan's allocator replaces glibc's: there is no mallopt to take it.
  EXPECT_FALSE(d.arenas_capped);
#else
  EXPECT_TRUE(d.arenas_capped);
  EXPECT_NE(DescribeWorkerEnvDefaults(d).find("capped at 2"),
            std::string::npos);
#endif
  EXPECT_TRUE(d.ras_disabled);
  ASSERT_NE(getenv("NCCL_RAS_ENABLE"), nullptr);
  EXPECT_EQ(std::string(getenv("NCCL_RAS_ENABLE")), "0");
  EXPECT_NE(DescribeWorkerEnvDefaults(d).find("NCCL_RAS_ENABLE=0"),
            std::string::npos);
}

TEST(WorkerEnvTest, TheOperatorsChoiceWins) {
  setenv("MALLOC_ARENA_MAX", "8", 1);
  setenv("NCCL_RAS_ENABLE", "1", 1);
  const WorkerEnvDefaults d = ApplyWorkerEnvDefaults();
  EXPECT_FALSE(d.arenas_capped);
  EXPECT_FALSE(d.ras_disabled);
  EXPECT_EQ(std::string(getenv("NCCL_RAS_ENABLE")), "1");
  EXPECT_NE(DescribeWorkerEnvDefaults(d).find("as NCCL_RAS_ENABLE says"),
            std::string::npos);
  unsetenv("MALLOC_ARENA_MAX");
  unsetenv("NCCL_RAS_ENABLE");
}

}  // namespace
}  // namespace weightsync
