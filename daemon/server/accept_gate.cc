#include "daemon/server/accept_gate.h"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/time/clock.h"
#include "glog/logging.h"

namespace weightsync {
namespace {

std::atomic<int64_t> g_exhausted{0};

}  // namespace

int64_t AcceptExhaustedTotal() { return g_exhausted.load(); }

int AcceptGate::Accept(int listen_fd, sockaddr* addr, socklen_t* len) {
  pollfd p{listen_fd, POLLIN, 0};
  if (poll(&p, 1, 100) <= 0) return -1;
  const int c = accept4(listen_fd, addr, len, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (c >= 0) {
    if (!accepting_.exchange(true)) {
      LOG(WARNING) << what_ << ": accepting connections again";
    }
    backoff_ = absl::ZeroDuration();
    return c;
  }
  const int err = errno;
  if (err != EMFILE && err != ENFILE && err != ENOBUFS && err != ENOMEM) {
    // The connection went away before it was accepted (ECONNABORTED), a
    // signal (EINTR), a spurious wake-up (EAGAIN): try again.
    return -1;
  }
  ++exhausted_;
  ++g_exhausted;
  accepting_ = false;
  backoff_ = std::min(absl::Seconds(1),
                      std::max(absl::Milliseconds(10), backoff_ * 2));
  // One line when it starts, then at most one every 10 s.
  const absl::Time now = absl::Now();
  if (now - last_log_ > absl::Seconds(10)) {
    last_log_ = now;
    LOG(ERROR) << what_ << ": can't accept connections: " << std::strerror(err)
               << " (" << exhausted_.load()
               << " failed accepts so far); retrying with back-off up to 1 s; "
                  "health says NOT_SERVING meanwhile. Raise the descriptor "
                  "limit (LimitNOFILE=, ulimit -n) or find who holds them";
  }
  absl::SleepFor(backoff_);
  return -1;
}

}  // namespace weightsync
