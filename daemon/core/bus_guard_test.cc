// A peer that shrinks the shared memory it registered can't kill the
// daemon: accesses inside a guard window fail instead of raising SIGBUS.
#include "daemon/core/bus_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backends/host/shm_memory.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

constexpr int64_t kSize = 1 << 20;

// A name no earlier run left behind: a run killed mid-test leaves its
// objects, and in bazel's sandbox every run has the same pid.
std::string UniqueName(const std::string& prefix) {
  static std::atomic<int> n{0};
  return prefix + std::to_string(getpid()) + "-" +
         std::to_string(std::random_device()()) + "-" + std::to_string(++n);
}
const int64_t kPage = sysconf(_SC_PAGESIZE);

// `size` bytes at `data` of a mapping the test made: a window that is part
// of a larger mapping, or of anonymous memory.
class PartOf : public MappedRegion {
 public:
  PartOf(uint8_t* data, int64_t size) : data_(data), size_(size) {}
  uint8_t* data() const override { return data_; }
  int64_t size() const override { return size_; }
  v1::MemoryKind kind() const override { return v1::MEMORY_HOST_SHM; }
  const std::string& device_uuid() const override { return uuid_; }

 private:
  uint8_t* data_;
  int64_t size_;
  std::string uuid_ = "host";
};

void Touch(const uint8_t* p) {
  volatile uint8_t b = *p;
  (void)b;
}

// `bytes` of a shared object shrunk to nothing under its mapping (at `at`
// when given): every page raises SIGBUS. Null on a set-up failure.
uint8_t* ShrunkMapping(int64_t bytes, void* at = nullptr) {
  const std::string name = UniqueName("/wsbus-gone-");
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return nullptr;
  shm_unlink(name.c_str());
  void* p = MAP_FAILED;
  if (ftruncate(fd, bytes) == 0) {
    p = mmap(at, bytes, PROT_READ | PROT_WRITE,
             MAP_SHARED | (at != nullptr ? MAP_FIXED : 0), fd, 0);
  }
  if (p != MAP_FAILED && ftruncate(fd, 0) != 0) p = MAP_FAILED;
  close(fd);
  return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

uint8_t* AnonymousPage() {
  void* p = mmap(nullptr, kPage, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

class BusGuardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    name_ = UniqueName("/wsbus-");
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

// The window reaches the region's last byte, for a region of one page as
// for a larger one.
TEST_F(BusGuardTest, AFaultOnARegionsLastByteFailsTheAccess) {
  Shrink(0);
  PartOf first_page(daemon_->data(), kPage);
  EXPECT_FALSE(
      GuardedAccess(first_page, [&] { Touch(first_page.data() + kPage - 1); }));
  EXPECT_TRUE(first_page.faulted());
  EXPECT_FALSE(
      GuardedAccess(*daemon_, [&] { Touch(daemon_->data() + kSize - 1); }));
  EXPECT_TRUE(daemon_->faulted());
}

// Two regions armed at once (a copy from a source's memory into an
// engine's): the one that shrank is the one marked faulted, the copy
// fails, and the next copy is refused without running.
TEST_F(BusGuardTest, ACopyBetweenTwoRegionsFailsOnTheOneThatShrank) {
  const std::string name = name_ + "-src";
  auto created = ShmRegion::Create(name, kSize);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<ShmRegion> src = *std::move(created);
  std::memset(src->data(), 5, kSize);
  Shrink(kSize / 2);
  EXPECT_FALSE(GuardedAccess(*src, *daemon_, [&] {
    std::memcpy(daemon_->data(), src->data(), kSize);
  }));
  EXPECT_TRUE(daemon_->faulted());
  EXPECT_FALSE(src->faulted());
  bool ran = false;
  EXPECT_FALSE(GuardedAccess(*src, *daemon_, [&] { ran = true; }));
  EXPECT_FALSE(ran);
  src->Unlink();
}

// The death tests below: a child that never gets its SIGBUS (a guard that
// takes another mapping's fault for its region's and retries it for ever)
// ends by SIGALRM instead, and fails the test.
constexpr int kChildSeconds = 10;

// How a SIGBUS the guard passes on kills. Under AddressSanitizer the
// handler before the guard's is ASan's: it reports the fault ("BUS on
// unknown address") and aborts (CI's ASAN_OPTIONS abort_on_error=1).
#if defined(__SANITIZE_ADDRESS__)
#define WS_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define WS_UNDER_ASAN 1
#endif
#endif
#ifdef WS_UNDER_ASAN
const ::testing::KilledBySignal kKilledByTheFault(SIGABRT);
constexpr char kFaultReport[] = "AddressSanitizer: BUS";
#else
const ::testing::KilledBySignal kKilledByTheFault(SIGBUS);
constexpr char kFaultReport[] = "";
#endif

TEST(BusGuardDeathTest, ASigbusOutsideAnyWindowStillKills) {
  const std::string name = UniqueName("/wsbus-death-");
  auto region = ShmRegion::Create(name, kSize);
  ASSERT_TRUE(region.ok());
  (*region)->Unlink();
  // Install the handler, then fault outside a window.
  GuardedAccess(**region, [] {});
  EXPECT_EXIT(
      {
        alarm(kChildSeconds);
        const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT, 0600);
        // A set-up failure exits 0: "failed to die" fails the test.
        if (fd < 0 || ftruncate(fd, 4096) != 0) _exit(0);
        void* p = mmap(nullptr, kSize, PROT_READ, MAP_SHARED, fd, 0);
        shm_unlink(name.c_str());
        if (ftruncate(fd, 0) != 0) _exit(0);
        volatile uint8_t b = static_cast<uint8_t*>(p)[0];
        (void)b;
        _exit(0);
      },
      kKilledByTheFault, kFaultReport);
}

// While a window is armed, a SIGBUS on memory outside it (the page just
// before or just after it, or another mapping) is not the region's: it
// kills as without the guard, not papered over with zeros.
TEST(BusGuardDeathTest, ASigbusOutsideTheArmedWindowStillKills) {
  for (int64_t at : {int64_t{-1}, kPage, 2 * kPage}) {
    EXPECT_EXIT(
        {
          alarm(kChildSeconds);
          uint8_t* m = ShrunkMapping(5 * kPage);
          if (m == nullptr) _exit(0);
          // One page of the five, at an address with the page-size bit
          // set: a rounding that loses that bit moves the window.
          uint8_t* w = m + kPage;
          if ((reinterpret_cast<uintptr_t>(w) & kPage) == 0) w += kPage;
          PartOf region(w, kPage);
          uint8_t* other = ShrunkMapping(kPage);
          if (other == nullptr) _exit(0);
          GuardedAccess(region,
                        [&] { Touch(at == 2 * kPage ? other : w + at); });
          _exit(0);
        },
        kKilledByTheFault, kFaultReport)
        << "a fault " << at << " bytes from the window";
  }
}

// When the guard can't map zeros over the region (the address space used
// up: RLIMIT_AS here), the SIGBUS is not handled: the process dies of it
// rather than retrying the faulting access for ever at full CPU.
TEST(BusGuardDeathTest, AFaultTheGuardCantRepairStillKills) {
#ifdef WS_UNDER_ASAN
  GTEST_SKIP() << "ASan's shadow memory needs the address space that "
                  "RLIMIT_AS takes away here";
#endif
  EXPECT_EXIT(
      {
        alarm(kChildSeconds);
        // 64 MiB of address space of which only the first page is mapped
        // (an object shrunk under it): zeros over the region need the rest.
        const int64_t span = 64 << 20;
        void* r = mmap(nullptr, span, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (r == MAP_FAILED) _exit(0);
        uint8_t* m = ShrunkMapping(kPage, r);
        if (m == nullptr) _exit(0);
        munmap(m + kPage, span - kPage);
        PartOf region(m, span);
        GuardedAccess(region, [] {});  // the handler, before the limit
        long pages = 0;
        FILE* statm = fopen("/proc/self/statm", "r");
        if (statm == nullptr || fscanf(statm, "%ld", &pages) != 1) _exit(0);
        fclose(statm);
        const rlim_t limit = pages * kPage + (16 << 20);
        struct rlimit as;
        as.rlim_cur = as.rlim_max = limit;
        if (setrlimit(RLIMIT_AS, &as) != 0) _exit(0);
        GuardedAccess(region, [&] { Touch(m); });
        _exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
}

void ExitWith42(int, siginfo_t*, void*) { _exit(42); }
void ExitWith43(int) { _exit(43); }

// A SIGBUS outside every window goes to the handler the process had before
// the guard's (a runtime's, a crash reporter's), as if there were no
// guard; one that was ignored or left to the default kills.
TEST(BusGuardDeathTest, ASigbusOutsideWindowsGoesToThePreviousHandler) {
  // A new process per case: the guard's handler, installed once, must come
  // after the case's.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  struct Case {
    int flags;
    void (*info)(int, siginfo_t*, void*);
    void (*plain)(int);
    std::function<bool(int)> ends;
  };
  const std::vector<Case> cases = {
      {SA_SIGINFO, ExitWith42, nullptr, ::testing::ExitedWithCode(42)},
      {0, nullptr, ExitWith43, ::testing::ExitedWithCode(43)},
      {0, nullptr, SIG_IGN, ::testing::KilledBySignal(SIGBUS)},
      {SA_SIGINFO, nullptr, nullptr, ::testing::KilledBySignal(SIGBUS)},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    EXPECT_EXIT(
        {
          alarm(kChildSeconds);
          struct sigaction sa = {};
          sigemptyset(&sa.sa_mask);
          sa.sa_flags = c.flags;
          if (c.flags & SA_SIGINFO) {
            sa.sa_sigaction = c.info;
          } else {
            sa.sa_handler = c.plain;
          }
          if (sigaction(SIGBUS, &sa, nullptr) != 0) _exit(0);
          uint8_t* mine = AnonymousPage();
          uint8_t* other = ShrunkMapping(kPage);
          if (mine == nullptr || other == nullptr) _exit(0);
          PartOf region(mine, kPage);
          GuardedAccess(region, [] {});  // the guard's handler, over it
          Touch(other);
          _exit(0);
        },
        c.ends, "")
        << "case " << i;
  }
}

}  // namespace
}  // namespace weightsync
