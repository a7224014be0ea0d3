// Both listeners' accept step (docs/security.md, "Listeners that
// recover"): a connection accepted as the listeners need it, nothing
// accepted when none came, and when accept4 fails for lack of descriptors
// or memory a back-off (10 ms doubling to 1 s) instead of a spin, counted,
// logged once in 10 s, with the gate not accepting until an accept works.
//
// accept4 is this binary's own (below): it fails with the errno a test
// sets, else calls the C library's.
#include "daemon/server/accept_gate.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/log_lines.h"

namespace {
std::atomic<int> g_fail_with{0};  // the errno accept4 fails with; 0: real
std::atomic<int> g_accept_calls{0};
}  // namespace

extern "C" int accept4(int fd, sockaddr* addr, socklen_t* len, int flags) {
  ++g_accept_calls;
  if (const int err = g_fail_with.load(); err != 0) {
    errno = err;
    return -1;
  }
  using Fn = int (*)(int, sockaddr*, socklen_t*, int);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "accept4"));
  return real(fd, addr, len, flags);
}

namespace weightsync {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

using Lines = testing::LogLines;

class AcceptGateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g_fail_with = 0;
    listen_ = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    ASSERT_GE(listen_, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    ASSERT_EQ(listen(listen_, 16), 0);
    socklen_t n = sizeof(a);
    getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &n);
    port_ = ntohs(a.sin_port);
  }
  void TearDown() override {
    g_fail_with = 0;
    for (int fd : fds_) close(fd);
    close(listen_);
  }
  // A client connection, pending in the listener's backlog.
  int Connect() {
    const int c = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port_);
    EXPECT_EQ(connect(c, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    fds_.push_back(c);
    return c;
  }
  // One Accept, and how long it took.
  int TimedAccept(AcceptGate& gate, absl::Duration* took) {
    const absl::Time t0 = absl::Now();
    const int fd = gate.Accept(listen_);
    *took = absl::Now() - t0;
    if (fd >= 0) fds_.push_back(fd);
    return fd;
  }

  int listen_ = -1;
  int port_ = 0;
  std::vector<int> fds_;
};

TEST_F(AcceptGateTest, AcceptsAPendingConnectionAsTheListenersNeedIt) {
  AcceptGate gate("tcp:test");
  Connect();
  sockaddr_in peer{};
  socklen_t len = sizeof(peer);
  const int fd = gate.Accept(listen_, reinterpret_cast<sockaddr*>(&peer), &len);
  ASSERT_GE(fd, 0);
  fds_.push_back(fd);
  // Non-blocking, and not inherited by what the daemon runs.
  EXPECT_NE(fcntl(fd, F_GETFL) & O_NONBLOCK, 0);
  EXPECT_NE(fcntl(fd, F_GETFD) & FD_CLOEXEC, 0);
  EXPECT_EQ(len, sizeof(sockaddr_in));
  EXPECT_EQ(peer.sin_family, AF_INET);
  EXPECT_EQ(ntohl(peer.sin_addr.s_addr), INADDR_LOOPBACK);
  EXPECT_TRUE(gate.accepting());
  EXPECT_EQ(gate.exhausted(), 0);
  // Without an address wanted, still accepted.
  Connect();
  const int second = gate.Accept(listen_);
  ASSERT_GE(second, 0);
  fds_.push_back(second);
}

TEST_F(AcceptGateTest, NoConnectionIsAHundredMillisecondWaitAndNoAccept) {
  AcceptGate gate("tcp:test");
  const int calls = g_accept_calls;
  absl::Duration took;
  EXPECT_EQ(TimedAccept(gate, &took), -1);
  EXPECT_GE(took, absl::Milliseconds(95));
  // The caller learns of a stop within the poll's timeout.
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_EQ(g_accept_calls - calls, 0);
  EXPECT_TRUE(gate.accepting());
}

// Errors that are not exhaustion (the peer gone before the accept, a
// signal, a spurious wake-up) are tried again at once: no back-off, no
// count, still accepting.
TEST_F(AcceptGateTest, OtherAcceptErrorsAreRetriedAtOnce) {
  AcceptGate gate("tcp:test");
  Lines lines;
  Connect();
  for (int err : {ECONNABORTED, EINTR, EAGAIN, EPROTO, EPERM}) {
    g_fail_with = err;
    EXPECT_EQ(gate.Accept(listen_), -1) << err;
    EXPECT_TRUE(gate.accepting()) << err;
  }
  EXPECT_EQ(gate.exhausted(), 0);
  EXPECT_THAT(lines.Take(), IsEmpty());
  g_fail_with = 0;
  EXPECT_GE(gate.Accept(listen_), 0);
}

TEST_F(AcceptGateTest, ExhaustionBacksOffDoublingToASecondThenRecovers) {
  AcceptGate gate("unix:/run/test.sock");
  Lines lines;
  const int64_t total = AcceptExhaustedTotal();
  Connect();  // pending all along: the socket stays readable
  const std::vector<int> errs = {EMFILE, ENFILE, ENOBUFS, ENOMEM};
  // 10, 20, 40, ... 640 ms, then 1 s (not 1.28 s), and 1 s again.
  const std::vector<int64_t> want_ms = {10,  20,  40,   80,  160,
                                        320, 640, 1000, 1000};
  for (size_t i = 0; i < want_ms.size(); ++i) {
    g_fail_with = errs[i % errs.size()];
    absl::Duration took;
    EXPECT_EQ(TimedAccept(gate, &took), -1);
    EXPECT_GE(took, absl::Milliseconds(want_ms[i])) << "failure " << i + 1;
    // Loose above (a loaded machine oversleeps), but below 1.28 s.
    EXPECT_LT(took, absl::Milliseconds(want_ms[i] +
                                       std::max<int64_t>(want_ms[i] / 4, 100)))
        << "failure " << i + 1;
    EXPECT_FALSE(gate.accepting());
    EXPECT_EQ(gate.exhausted(), static_cast<int64_t>(i) + 1);
  }
  EXPECT_EQ(AcceptExhaustedTotal() - total,
            static_cast<int64_t>(want_ms.size()));
  // One line at the start (within 10 s no more), naming the listener and
  // what to do.
  std::vector<std::string> got = lines.Take();
  ASSERT_THAT(got, SizeIs(1));
  EXPECT_THAT(got[0], HasSubstr("unix:/run/test.sock: can't accept"));
  EXPECT_THAT(got[0], HasSubstr("Too many open files"));
  EXPECT_THAT(got[0], HasSubstr("(1 failed accepts so far)"));
  EXPECT_THAT(got[0], HasSubstr("LimitNOFILE"));

  // Descriptors free again: the pending connection is accepted, the gate
  // says so once, and the back-off starts from 10 ms again.
  g_fail_with = 0;
  const int fd = gate.Accept(listen_);
  ASSERT_GE(fd, 0);
  fds_.push_back(fd);
  EXPECT_TRUE(gate.accepting());
  got = lines.Take();
  ASSERT_THAT(got, SizeIs(1));
  EXPECT_THAT(got[0], HasSubstr("unix:/run/test.sock: accepting connections "
                                "again"));
  Connect();
  g_fail_with = EMFILE;
  absl::Duration took;
  EXPECT_EQ(TimedAccept(gate, &took), -1);
  EXPECT_GE(took, absl::Milliseconds(10));
  EXPECT_LT(took, absl::Milliseconds(500));  // not the 1 s it had reached
  EXPECT_FALSE(gate.accepting());
  // Within 10 s of the first line: counted, not logged.
  EXPECT_THAT(lines.Take(), IsEmpty());
  g_fail_with = 0;
  ASSERT_GE(TimedAccept(gate, &took), 0);
  EXPECT_TRUE(gate.accepting());
  // An accept that works while accepting says nothing.
  Connect();
  ASSERT_GE(TimedAccept(gate, &took), 0);
  EXPECT_THAT(lines.Take(), SizeIs(1));  // the recovery above, only
}

// The gates count apart; the process's total counts them all.
TEST_F(AcceptGateTest, EachGateCountsItsOwnTheTotalAll) {
  AcceptGate a("tcp:a"), b("tcp:b");
  const int64_t total = AcceptExhaustedTotal();
  Connect();
  g_fail_with = EMFILE;
  a.Accept(listen_);
  a.Accept(listen_);
  b.Accept(listen_);
  EXPECT_EQ(a.exhausted(), 2);
  EXPECT_EQ(b.exhausted(), 1);
  EXPECT_EQ(AcceptExhaustedTotal() - total, 3);
}

}  // namespace
}  // namespace weightsync
