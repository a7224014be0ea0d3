// SystemdNotifier against a fake systemd: a Unix datagram socket bound by
// the test and named in $NOTIFY_SOCKET, as systemd does for Type=notify.
#include "daemon/server/systemd_notify.h"

#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

// A datagram socket at a path (or an abstract name: '@...') that collects
// what the notifier sends.
class FakeSystemd {
 public:
  explicit FakeSystemd(const std::string& name) : name_(name) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    EXPECT_GE(fd_, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, name.data(), name.size());
    socklen_t len = offsetof(sockaddr_un, sun_path) + name.size();
    if (name[0] == '@') {
      addr.sun_path[0] = '\0';
    } else {
      unlink(name.c_str());
      ++len;
    }
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), len), 0)
        << strerror(errno);
  }
  ~FakeSystemd() {
    close(fd_);
    if (name_[0] == '/') unlink(name_.c_str());
  }

  // Every datagram that arrives within `wait`.
  std::vector<std::string> Receive(absl::Duration wait) {
    std::vector<std::string> out;
    const absl::Time deadline = absl::Now() + wait;
    while (true) {
      const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      pollfd p{fd_, POLLIN, 0};
      if (ms <= 0 || poll(&p, 1, static_cast<int>(ms)) <= 0) return out;
      char buf[4096];
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n > 0) out.emplace_back(buf, n);
    }
  }

  // The first datagram within `wait`, or "".
  std::string ReceiveOne(absl::Duration wait) {
    const absl::Time deadline = absl::Now() + wait;
    pollfd p{fd_, POLLIN, 0};
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (poll(&p, 1, static_cast<int>(ms)) <= 0) return "";
    char buf[4096];
    const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, n) : "";
  }

 private:
  std::string name_;
  int fd_ = -1;
};

int Count(const std::vector<std::string>& msgs, const std::string& what) {
  int n = 0;
  for (const std::string& m : msgs) n += m == what;
  return n;
}

class SystemdNotifyTest : public testing::Test {
 protected:
  void SetUp() override {
    ClearEnvironment();
    // Not TEST_TMPDIR: a socket path must fit in 108 bytes. A directory of
    // its own: sandboxed runs share /tmp and may share a pid.
    char dir[] = "/tmp/ws-notify-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/notify.sock";
  }
  void TearDown() override {
    ClearEnvironment();
    rmdir(dir_.c_str());
  }
  static void ClearEnvironment() {
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
  }
  std::string dir_;
  std::string path_;
};

TEST_F(SystemdNotifyTest, ReadyStatusAndStoppingArrive) {
  FakeSystemd systemd(path_);
  setenv("NOTIFY_SOCKET", path_.c_str(), 1);
  SystemdNotifier notifier(SystemdNotifier::FromEnvironment(), nullptr);
  EXPECT_TRUE(notifier.enabled());
  EXPECT_FALSE(notifier.watchdog_enabled());  // no WATCHDOG_USEC
  notifier.Ready("serving on\nunix:/x");
  EXPECT_EQ(systemd.ReceiveOne(absl::Seconds(5)),
            "READY=1\nSTATUS=serving on unix:/x");
  notifier.Stopping("shutting down");
  EXPECT_EQ(systemd.ReceiveOne(absl::Seconds(5)),
            "STOPPING=1\nSTATUS=shutting down");
  EXPECT_TRUE(systemd.Receive(absl::Milliseconds(100)).empty());
}

TEST_F(SystemdNotifyTest, AbstractSocketNames) {
  // Abstract names live in the network namespace: unique by directory.
  const std::string name = "@" + path_;
  FakeSystemd systemd(name);
  EXPECT_TRUE(SdNotify(name, "READY=1").ok());
  EXPECT_EQ(systemd.ReceiveOne(absl::Seconds(5)), "READY=1");
  EXPECT_FALSE(SdNotify("relative/path", "READY=1").ok());
  EXPECT_FALSE(SdNotify("/nonexistent/weightsync/notify", "READY=1").ok());
  EXPECT_TRUE(SdNotify("", "READY=1").ok());  // nothing to do
}

TEST_F(SystemdNotifyTest, WatchdogPingsWhileTheProbePasses) {
  FakeSystemd systemd(path_);
  setenv("NOTIFY_SOCKET", path_.c_str(), 1);
  setenv("WATCHDOG_USEC", "200000", 1);  // 200 ms: a ping every 100 ms
  setenv("WATCHDOG_PID", std::to_string(getpid()).c_str(), 1);
  const SystemdNotifier::Options options = SystemdNotifier::FromEnvironment();
  EXPECT_EQ(options.watchdog_interval, absl::Milliseconds(100));
  std::atomic<int> probes{0};
  SystemdNotifier notifier(options, [&] {
    ++probes;
    return true;
  });
  ASSERT_TRUE(notifier.watchdog_enabled());
  notifier.Ready("up");
  const std::vector<std::string> msgs = systemd.Receive(absl::Seconds(1));
  ASSERT_FALSE(msgs.empty());
  EXPECT_EQ(msgs[0], "READY=1\nSTATUS=up");  // READY before any ping
  EXPECT_GE(Count(msgs, "WATCHDOG=1"), 3);
  EXPECT_EQ(Count(msgs, "WATCHDOG=1") + 1, static_cast<int>(msgs.size()));
  EXPECT_GE(probes.load(), Count(msgs, "WATCHDOG=1"));
  EXPECT_EQ(notifier.skipped_pings(), 0);
}

TEST_F(SystemdNotifyTest, AStuckOrFailingProbeSuppressesThePings) {
  FakeSystemd systemd(path_);
  setenv("NOTIFY_SOCKET", path_.c_str(), 1);
  setenv("WATCHDOG_USEC", "200000", 1);  // a ping every 100 ms
  std::atomic<bool> stuck{false};
  std::atomic<bool> failing{false};
  absl::Notification release;
  SystemdNotifier notifier(SystemdNotifier::FromEnvironment(), [&] {
    if (stuck) {
      release.WaitForNotification();
      stuck = false;
    }
    return !failing;
  });
  notifier.Ready("up");
  std::vector<std::string> msgs = systemd.Receive(absl::Milliseconds(600));
  ASSERT_GE(Count(msgs, "WATCHDOG=1"), 2);

  // Wedged: the probe does not return, so no ping for as long as it lasts
  // (systemd would kill the daemon after WatchdogSec).
  stuck = true;
  systemd.Receive(absl::Milliseconds(150));  // a ping already under way
  msgs = systemd.Receive(absl::Milliseconds(600));
  EXPECT_EQ(Count(msgs, "WATCHDOG=1"), 0);
  // It returns, late: that ping is skipped, the next ones go out.
  release.Notify();
  msgs = systemd.Receive(absl::Milliseconds(600));
  EXPECT_GE(Count(msgs, "WATCHDOG=1"), 2);
  EXPECT_GE(notifier.skipped_pings(), 1);

  // A probe that reports failure skips its pings too.
  failing = true;
  systemd.Receive(absl::Milliseconds(150));
  msgs = systemd.Receive(absl::Milliseconds(600));
  EXPECT_EQ(Count(msgs, "WATCHDOG=1"), 0);
  failing = false;
  msgs = systemd.Receive(absl::Milliseconds(600));
  EXPECT_GE(Count(msgs, "WATCHDOG=1"), 2);
}

TEST_F(SystemdNotifyTest, NothingWithoutNotifySocket) {
  FakeSystemd systemd(path_);
  setenv("WATCHDOG_USEC", "100000", 1);  // a watchdog alone means nothing
  bool probed = false;
  SystemdNotifier notifier(SystemdNotifier::FromEnvironment(), [&] {
    probed = true;
    return true;
  });
  EXPECT_FALSE(notifier.enabled());
  EXPECT_FALSE(notifier.watchdog_enabled());
  notifier.Ready("up");
  notifier.Notify("WATCHDOG=1");
  notifier.Stopping("down");
  EXPECT_TRUE(systemd.Receive(absl::Milliseconds(300)).empty());
  EXPECT_FALSE(probed);
  EXPECT_EQ(notifier.watchdog_pings(), 0);
}

TEST_F(SystemdNotifyTest, NoWatchdogForAnotherPidOrABadValue) {
  setenv("NOTIFY_SOCKET", path_.c_str(), 1);
  setenv("WATCHDOG_USEC", "100000", 1);
  setenv("WATCHDOG_PID", std::to_string(getpid() + 1).c_str(), 1);
  EXPECT_EQ(SystemdNotifier::FromEnvironment().watchdog_interval,
            absl::ZeroDuration());
  unsetenv("WATCHDOG_PID");
  setenv("WATCHDOG_USEC", "soon", 1);
  EXPECT_EQ(SystemdNotifier::FromEnvironment().watchdog_interval,
            absl::ZeroDuration());
  setenv("WATCHDOG_USEC", "0", 1);
  EXPECT_EQ(SystemdNotifier::FromEnvironment().watchdog_interval,
            absl::ZeroDuration());
  EXPECT_EQ(SystemdNotifier::FromEnvironment().notify_socket, path_);
}

}  // namespace
}  // namespace weightsync
