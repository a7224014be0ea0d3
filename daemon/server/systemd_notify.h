// Tells systemd how the daemon is doing (a `Type=notify` unit, with an
// optional `WatchdogSec=`), by the datagram protocol of sd_notify(3) written
// here without libsystemd: "READY=1", "STATUS=...", "STOPPING=1" and
// "WATCHDOG=1" sent to the socket named by $NOTIFY_SOCKET (a path, or an
// abstract name starting with '@').
//
// The watchdog pings only while the daemon makes progress: before each ping
// a thread runs a probe passed in by the caller (main.cc: a Coordinator
// status snapshot, which takes the same state lock every request takes). A
// probe that fails or does not return within its deadline skips the ping, so
// systemd kills and restarts a wedged daemon after WatchdogSec.
//
// Without $NOTIFY_SOCKET every method does nothing. Lifecycle: construct,
// Ready() once the server listens, Stopping() on shutdown; the destructor
// stops the watchdog thread. Thread-safety: Ready, Stopping and Notify may be
// called from any thread.
#ifndef WEIGHTSYNC_DAEMON_SERVER_SYSTEMD_NOTIFY_H_
#define WEIGHTSYNC_DAEMON_SERVER_SYSTEMD_NOTIFY_H_

#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace weightsync {

// Sends one sd_notify datagram (`state`, e.g. "READY=1\nSTATUS=up") to
// `notify_socket`: a filesystem path, or '@' and an abstract socket name.
// Errors name the socket; an empty `notify_socket` is OK and sends nothing.
absl::Status SdNotify(const std::string& notify_socket,
                      absl::string_view state);

class SystemdNotifier {
 public:
  struct Options {
    // $NOTIFY_SOCKET; empty: systemd is not listening, do nothing.
    std::string notify_socket;
    // How often to ping: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3)
    // recommends. Zero: no watchdog ($WATCHDOG_USEC unset, not a positive
    // number, or $WATCHDOG_PID set to another process).
    absl::Duration watchdog_interval = absl::ZeroDuration();
    // A probe that has not returned after this long counts as stuck: that
    // ping is skipped. Zero: half of watchdog_interval, so consecutive pings
    // are never more than 1.5 intervals (0.75 WatchdogSec) apart.
    absl::Duration probe_deadline = absl::ZeroDuration();
  };
  // Options from $NOTIFY_SOCKET, $WATCHDOG_USEC and $WATCHDOG_PID.
  static Options FromEnvironment();

  // True when the daemon is healthy enough to be kept alive. It runs on the
  // watchdog thread and must not take longer than a status request would.
  using Probe = std::function<bool()>;

  SystemdNotifier(Options options, Probe probe);
  // Stops the watchdog thread; waits for a probe in progress to return.
  ~SystemdNotifier();
  SystemdNotifier(const SystemdNotifier&) = delete;
  SystemdNotifier& operator=(const SystemdNotifier&) = delete;

  bool enabled() const { return !options_.notify_socket.empty(); }
  bool watchdog_enabled() const {
    return enabled() && options_.watchdog_interval > absl::ZeroDuration();
  }

  // "READY=1" with "STATUS=<status>"; starts the watchdog thread.
  void Ready(absl::string_view status);
  // "STOPPING=1" with "STATUS=<status>". The watchdog keeps pinging (while
  // the probe passes) until destruction: a clean shutdown that makes
  // progress is not killed.
  void Stopping(absl::string_view status);
  // Sends `state` as is; failures are logged (once) and otherwise ignored,
  // as systemd going away must not stop the daemon.
  void Notify(absl::string_view state);

  // Pings sent and pings skipped for a failed or late probe.
  int64_t watchdog_pings() const;
  int64_t skipped_pings() const;

 private:
  void WatchdogLoop();

  const Options options_;
  const Probe probe_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool send_failed_ ABSL_GUARDED_BY(mu_) = false;
  int64_t pings_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t skipped_ ABSL_GUARDED_BY(mu_) = 0;
  // Runs WatchdogLoop from Ready() on; joined by the destructor.
  std::thread watchdog_;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_SYSTEMD_NOTIFY_H_
