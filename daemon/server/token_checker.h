// The bearer-token check of the TCP listener: every call must carry
// "authorization: Bearer <token>", compared in constant time and never
// logged. It runs in gRPC's auth filter, after the header block (bounded by
// --max_metadata_bytes) and before any message of the call is read.
//
// Failures are counted (auth_failures(), /metrics) and logged at most once
// per 10 s with how many there were and the addresses of the latest TCP
// connections (gRPC 1.51 does not tell a metadata processor which
// connection a call came on, so the log can't name the one that failed).
//
// Repeated failures are slowed: once kSlowAfter calls have failed within
// 10 s, the checker turns blocking (gRPC then runs it on its own thread
// pool), and past 2 * kSlowAfter a failing call waits kFailureDelay before
// its UNAUTHENTICATED,
// at most kMaxDelayed at a time (past that it fails at once, so waiting
// never costs more than kMaxDelayed threads). A right token is never
// delayed. The slowing is keyed by nothing finer than the listener, for
// the same reason.
//
// Thread safety: gRPC calls Process from its threads concurrently.
#ifndef WEIGHTSYNC_DAEMON_SERVER_TOKEN_CHECKER_H_
#define WEIGHTSYNC_DAEMON_SERVER_TOKEN_CHECKER_H_

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace weightsync {

class TokenChecker : public grpc::AuthMetadataProcessor {
 public:
  // `recent_peers` (may be empty) names the latest TCP peers for log lines.
  TokenChecker(std::string token,
               std::function<std::vector<std::string>()> recent_peers);

  static constexpr int kSlowAfter = 10;
  static constexpr absl::Duration kFailureDelay = absl::Milliseconds(250);
  static constexpr int kMaxDelayed = 4;

  bool IsBlocking() const override;
  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext*,
                       OutputMetadata* consumed,
                       OutputMetadata* response) override;

  // Calls refused for a missing or wrong token, ever.
  int64_t failures() const { return failures_.load(); }

 private:
  bool Equal(grpc::string_ref got) const;
  void LogFailure();

  const std::string expected_;
  const std::function<std::vector<std::string>()> recent_peers_;
  // Failures in the window that began at window_start_ns_.
  int RecentFailures(int64_t now_ns) const;

  std::atomic<int64_t> failures_{0};
  mutable std::atomic<int64_t> window_start_ns_{0};
  mutable std::atomic<int> window_failures_{0};
  std::atomic<int> delayed_{0};
  mutable std::atomic<bool> asked_{false};
  absl::Mutex log_mu_;
  absl::Time last_log_ ABSL_GUARDED_BY(log_mu_) = absl::InfinitePast();
  int64_t logged_ ABSL_GUARDED_BY(log_mu_) = 0;
};

// Calls refused by the process's TCP token check, ever (metrics); 0 when
// there is none.
int64_t AuthFailures();

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_TOKEN_CHECKER_H_
