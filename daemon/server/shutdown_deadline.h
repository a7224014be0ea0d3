// Bounds how long the daemon takes to stop. Armed when SIGTERM arrives:
// if the orderly shutdown (abort the update, tell the engines, drain the
// server) has not finished within `limit`, `expire` runs on the deadline's
// own thread; weightsyncd's logs what is left and _exits. So no handler a
// peer managed to block (a system call on an object it controls, a stream
// it never reads) can keep the daemon alive after it was told to stop.
// Thread-safe; the destructor disarms the deadline and joins its thread.
#ifndef WEIGHTSYNC_DAEMON_SERVER_SHUTDOWN_DEADLINE_H_
#define WEIGHTSYNC_DAEMON_SERVER_SHUTDOWN_DEADLINE_H_

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace weightsync {

class ShutdownDeadline {
 public:
  ShutdownDeadline(absl::Duration limit, std::function<void()> expire);
  // Disarms: `expire` does not run once this returns.
  ~ShutdownDeadline();
  ShutdownDeadline(const ShutdownDeadline&) = delete;
  ShutdownDeadline& operator=(const ShutdownDeadline&) = delete;

 private:
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_SHUTDOWN_DEADLINE_H_
