#include "daemon/server/shutdown_deadline.h"

#include <atomic>

#include "gtest/gtest.h"

namespace weightsync {
namespace {

TEST(ShutdownDeadlineTest, ExpiresWhenTheShutdownOverruns) {
  std::atomic<bool> expired{false};
  {
    ShutdownDeadline deadline(absl::Milliseconds(50), [&] { expired = true; });
    absl::SleepFor(absl::Milliseconds(300));  // a shutdown that hangs
    EXPECT_TRUE(expired);
  }
}

TEST(ShutdownDeadlineTest, AShutdownInTimeDisarmsIt) {
  std::atomic<bool> expired{false};
  const absl::Time t0 = absl::Now();
  {
    ShutdownDeadline deadline(absl::Seconds(30), [&] { expired = true; });
  }
  EXPECT_FALSE(expired);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(1));  // joined at once
}

}  // namespace
}  // namespace weightsync
