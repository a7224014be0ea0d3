#include "daemon/server/systemd_notify.h"

#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "glog/logging.h"

namespace weightsync {
namespace {

// STATUS= is one line of the datagram's key=value list.
std::string StatusLine(absl::string_view status) {
  return absl::StrCat("STATUS=",
                      absl::StrReplaceAll(status, {{"\n", " "}, {"\r", " "}}));
}

}  // namespace

absl::Status SdNotify(const std::string& notify_socket,
                      absl::string_view state) {
  if (notify_socket.empty()) return absl::OkStatus();
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  // A path must keep its terminating NUL inside sun_path; an abstract name
  // ('@' becomes the leading NUL) is exactly as long as given.
  if (notify_socket.size() >= sizeof(addr.sun_path) ||
      (notify_socket[0] != '/' && notify_socket[0] != '@')) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NOTIFY_SOCKET '", notify_socket,
        "' is neither an absolute path nor an abstract name (@...)"));
  }
  memcpy(addr.sun_path, notify_socket.data(), notify_socket.size());
  if (addr.sun_path[0] == '@') addr.sun_path[0] = '\0';
  const socklen_t len = static_cast<socklen_t>(
      offsetof(sockaddr_un, sun_path) + notify_socket.size() +
      (notify_socket[0] == '@' ? 0 : 1));
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("socket(AF_UNIX, SOCK_DGRAM): ", strerror(errno)));
  }
  const ssize_t n = sendto(fd, state.data(), state.size(), MSG_NOSIGNAL,
                           reinterpret_cast<const sockaddr*>(&addr), len);
  const int err = errno;
  close(fd);
  if (n < 0) {
    return absl::UnavailableError(
        absl::StrCat("sd_notify to ", notify_socket, ": ", strerror(err)));
  }
  return absl::OkStatus();
}

SystemdNotifier::Options SystemdNotifier::FromEnvironment() {
  Options options;
  const char* socket = std::getenv("NOTIFY_SOCKET");
  if (socket != nullptr) options.notify_socket = socket;
  const char* usec = std::getenv("WATCHDOG_USEC");
  uint64_t watchdog_usec = 0;
  if (usec == nullptr || !absl::SimpleAtoi(usec, &watchdog_usec) ||
      watchdog_usec == 0) {
    return options;
  }
  // systemd sets WATCHDOG_PID to the main process; a child that inherited
  // the environment (or a wrapper's child) must not feed the watchdog.
  const char* pid = std::getenv("WATCHDOG_PID");
  int64_t watchdog_pid = 0;
  if (pid != nullptr && *pid != '\0' &&
      (!absl::SimpleAtoi(pid, &watchdog_pid) || watchdog_pid != getpid())) {
    return options;
  }
  options.watchdog_interval = absl::Microseconds(watchdog_usec) / 2;
  return options;
}

SystemdNotifier::SystemdNotifier(Options options, Probe probe)
    : options_(std::move(options)), probe_(std::move(probe)) {}

SystemdNotifier::~SystemdNotifier() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (watchdog_.joinable()) watchdog_.join();
}

void SystemdNotifier::Notify(absl::string_view state) {
  if (!enabled()) return;
  const absl::Status status = SdNotify(options_.notify_socket, state);
  if (status.ok()) return;
  absl::MutexLock lock(&mu_);
  if (!send_failed_) LOG(WARNING) << status << " (logged once)";
  send_failed_ = true;
}

void SystemdNotifier::Ready(absl::string_view status) {
  if (!enabled()) return;
  Notify(absl::StrCat("READY=1\n", StatusLine(status)));
  if (!watchdog_enabled() || watchdog_.joinable()) return;
  LOG(INFO) << "systemd watchdog: a ping every "
            << absl::FormatDuration(options_.watchdog_interval)
            << " while the daemon makes progress";
  watchdog_ = std::thread([this] { WatchdogLoop(); });
}

void SystemdNotifier::Stopping(absl::string_view status) {
  Notify(absl::StrCat("STOPPING=1\n", StatusLine(status)));
}

int64_t SystemdNotifier::watchdog_pings() const {
  absl::MutexLock lock(&mu_);
  return pings_;
}

int64_t SystemdNotifier::skipped_pings() const {
  absl::MutexLock lock(&mu_);
  return skipped_;
}

void SystemdNotifier::WatchdogLoop() {
  const absl::Duration interval = options_.watchdog_interval;
  const absl::Duration deadline = options_.probe_deadline > absl::ZeroDuration()
                                      ? options_.probe_deadline
                                      : interval / 2;
  bool was_skipping = false;
  absl::Time next = absl::Now();
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithDeadline(absl::Condition(&stop_), next)) return;
    }
    // The probe runs on this thread: one that never returns stops the pings
    // for good, which is what lets systemd restart a wedged daemon.
    const absl::Time start = absl::Now();
    const bool healthy = probe_ == nullptr || probe_();
    const absl::Duration took = absl::Now() - start;
    next = start + interval;
    if (healthy && took <= deadline) {
      Notify("WATCHDOG=1");
      absl::MutexLock lock(&mu_);
      ++pings_;
      if (was_skipping) LOG(INFO) << "systemd watchdog: pinging again";
      was_skipping = false;
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      ++skipped_;
    }
    if (!was_skipping) {
      LOG(WARNING) << "systemd watchdog: ping skipped, the liveness probe "
                   << (healthy ? "took " + absl::FormatDuration(took)
                               : std::string("failed"))
                   << " (deadline " << absl::FormatDuration(deadline) << ")";
    }
    was_skipping = true;
  }
}

}  // namespace weightsync
