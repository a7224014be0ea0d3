// A peer that shrinks the shared memory it registered can't kill the
// daemon: accesses inside a guard window fail instead of raising SIGBUS.
#include "daemon/core/bus_guard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "backends/host/shm_memory.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

constexpr int64_t kSize = 1 << 20;

class BusGuardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    name_ = "/wsbus-" + std::to_string(getpid());
    auto created = ShmRegion::Create(name_, kSize);  // the peer's side
    ASSERT_TRUE(created.ok()) << created.status();
    peer_ = *std::move(created);
    auto opened = ShmRegion::Open(name_, kSize);  // the daemon's side
    ASSERT_TRUE(opened.ok()) << opened.status();
    daemon_ = *std::move(opened);
  }
  void TearDown() override { peer_->Unlink(); }
  // What a hostile peer does: ftruncate(fd, bytes).
  void Shrink(int64_t bytes) {
    const int fd = shm_open(name_.c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, bytes), 0);
    close(fd);
  }
  std::string name_;
  std::unique_ptr<ShmRegion> peer_, daemon_;
};

TEST_F(BusGuardTest, AnIntactRegionIsReadAndWritten) {
  EXPECT_TRUE(
      GuardedAccess(*daemon_, [&] { std::memset(daemon_->data(), 7, kSize); }));
  EXPECT_EQ(peer_->data()[kSize - 1], 7);
  EXPECT_FALSE(daemon_->faulted());
}

TEST_F(BusGuardTest, AShrunkRegionFailsTheAccessInsteadOfKilling) {
  Shrink(0);
  uint64_t sum = 0;
  EXPECT_FALSE(GuardedAccess(*daemon_, [&] {
    for (int64_t i = 0; i < kSize; i += 4096) sum += daemon_->data()[i];
  }));
  EXPECT_EQ(sum, 0u);
  EXPECT_TRUE(daemon_->faulted());
  // Refused from now on, without another signal.
  bool ran = false;
  EXPECT_FALSE(GuardedAccess(*daemon_, [&] { ran = true; }));
  EXPECT_FALSE(ran);
}

TEST_F(BusGuardTest, WritesPastAPartialShrinkFailOnAnyThread) {
  Shrink(kSize / 2);
  bool ok = true;
  std::thread t([&] {
    ok = GuardedAccess(*daemon_,
                       [&] { std::memset(daemon_->data(), 1, kSize); });
  });
  t.join();
  EXPECT_FALSE(ok);
  // Nothing the daemon wrote after the fault reached the peer's object.
  EXPECT_TRUE(daemon_->faulted());
}

TEST(BusGuardDeathTest, ASigbusOutsideAnyWindowStillKills) {
  const std::string name = "/wsbus-death-" + std::to_string(getpid());
  auto region = ShmRegion::Create(name, kSize);
  ASSERT_TRUE(region.ok());
  (*region)->Unlink();
  // Install the handler, then fault outside a window.
  GuardedAccess(**region, [] {});
  EXPECT_DEATH(
      {
        const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT, 0600);
        // A set-up failure exits 0: "failed to die" fails the test.
        if (fd < 0 || ftruncate(fd, 4096) != 0) _exit(0);
        void* p = mmap(nullptr, kSize, PROT_READ, MAP_SHARED, fd, 0);
        shm_unlink(name.c_str());
        if (ftruncate(fd, 0) != 0) _exit(0);
        volatile uint8_t b = static_cast<uint8_t*>(p)[0];
        (void)b;
      },
      "");
}

}  // namespace
}  // namespace weightsync
