// The accept step both of the daemon's listeners (Unix, TCP) share: it
// never spins when the process runs out of descriptors. On EMFILE, ENFILE,
// ENOBUFS or ENOMEM the pending connection stays in the kernel's backlog,
// the listening socket stays readable, and a plain poll/accept loop would
// burn a core; the gate instead sleeps, doubling from 10 ms up to 1 s, and
// reports the listener as not accepting (health, docs/operations.md) until
// an accept succeeds again.
//
// Thread safety: Accept is called by the listener's one accept thread;
// accepting() and exhausted() from any thread.
#ifndef WEIGHTSYNC_DAEMON_SERVER_ACCEPT_GATE_H_
#define WEIGHTSYNC_DAEMON_SERVER_ACCEPT_GATE_H_

#include <sys/socket.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace weightsync {

class AcceptGate {
 public:
  // `what` names the listener in log lines ("unix:/run/...", "tcp:...").
  explicit AcceptGate(std::string what) : what_(std::move(what)) {}

  // Waits up to 100 ms for a connection on `listen_fd` and accepts it
  // (SOCK_CLOEXEC | SOCK_NONBLOCK; the peer's address into addr/len when
  // given). -1 when none came, after a failed accept, or after a back-off
  // sleep; the caller checks whether it should stop and calls again.
  int Accept(int listen_fd, sockaddr* addr = nullptr, socklen_t* len = nullptr);

  // False while the last accept failed for lack of descriptors or memory.
  bool accepting() const { return accepting_.load(); }
  // Accepts that failed for lack of descriptors or memory, ever.
  int64_t exhausted() const { return exhausted_.load(); }

 private:
  const std::string what_;
  std::atomic<bool> accepting_{true};
  std::atomic<int64_t> exhausted_{0};
  absl::Duration backoff_ = absl::ZeroDuration();
  absl::Time last_log_ = absl::InfinitePast();
};

// Accepts that failed for lack of descriptors or memory, every listener of
// the process together (metrics).
int64_t AcceptExhaustedTotal();

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_ACCEPT_GATE_H_
