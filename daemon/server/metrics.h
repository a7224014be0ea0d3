// Prometheus metrics of the daemon (docs/operations.md, "Metrics"): an HTTP
// endpoint serving /metrics in the text exposition format. Update counters
// and histograms are fed by the core's UpdateListener as updates end;
// per-engine gauges (version, state, paused time) and the update in
// progress are read from a GetStatus snapshot at each scrape, so they are
// never stale. Off unless --metrics_address is set.
#ifndef WEIGHTSYNC_DAEMON_SERVER_METRICS_H_
#define WEIGHTSYNC_DAEMON_SERVER_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/core/coordinator.h"

namespace weightsync {

class Metrics {
 public:
  // Serves http://`address`/metrics ("host:port"; port 0 picks a free one)
  // and installs itself as `core`'s update listener. `core` outlives it.
  static absl::StatusOr<std::unique_ptr<Metrics>> Start(
      const std::string& address, Coordinator* core);
  ~Metrics();

  // The port it listens on.
  int port() const;
  // Counts an update that ended (the core's UpdateListener).
  void Observe(const UpdateOutcome& outcome);

 private:
  struct Impl;
  explicit Metrics(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_METRICS_H_
