#include "daemon/server/token_checker.h"

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "glog/logging.h"

namespace weightsync {
namespace {

std::atomic<int64_t> g_failures{0};

}  // namespace

int64_t AuthFailures() { return g_failures.load(); }

TokenChecker::TokenChecker(
    std::string token, std::function<std::vector<std::string>()> recent_peers)
    : expected_("Bearer " + std::move(token)),
      recent_peers_(std::move(recent_peers)) {}

grpc::Status TokenChecker::Process(const InputMetadata& metadata,
                                   grpc::AuthContext*, OutputMetadata* consumed,
                                   OutputMetadata* /*response*/) {
  auto it = metadata.find("authorization");
  if (it != metadata.end() && Equal(it->second)) {
    consumed->insert(
        {"authorization", std::string(it->second.data(), it->second.size())});
    return grpc::Status::OK;
  }
  ++failures_;
  ++g_failures;
  const int64_t now_ns = absl::GetCurrentTimeNanos();
  RecentFailures(now_ns);  // starts a new window when the old one is over
  const int recent = ++window_failures_;
  LogFailure();
  // Past twice the threshold, so that IsBlocking said true when gRPC asked
  // before this call (only a blocking processor runs on gRPC's pool).
  if (recent > 2 * kSlowAfter) {
    if (delayed_.fetch_add(1) < kMaxDelayed) absl::SleepFor(kFailureDelay);
    --delayed_;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      it == metadata.end()
                          ? "no bearer token (authorization metadata)"
                          : "wrong bearer token");
}

int TokenChecker::RecentFailures(int64_t now_ns) const {
  constexpr int64_t kWindowNs = 10'000'000'000;
  int64_t start = window_start_ns_.load();
  if (now_ns - start > kWindowNs &&
      window_start_ns_.compare_exchange_strong(start, now_ns)) {
    window_failures_ = 0;
  }
  return window_failures_.load();
}

bool TokenChecker::IsBlocking() const {
  // gRPC 1.51 asks once when the processor is installed, and makes the
  // thread pool for blocking calls only if the answer is yes; then once
  // per call.
  if (!asked_.exchange(true)) return true;
  // Blocking only while failures come fast: gRPC then hands every call to
  // its thread pool, where a failing one may wait without stalling gRPC's
  // event threads.
  return RecentFailures(absl::GetCurrentTimeNanos()) >= kSlowAfter;
}

bool TokenChecker::Equal(grpc::string_ref got) const {
  unsigned diff = got.size() ^ expected_.size();
  for (size_t i = 0; i < expected_.size(); ++i) {
    diff |= static_cast<unsigned char>(expected_[i]) ^
            static_cast<unsigned char>(i < got.size() ? got.data()[i] : 0);
  }
  return diff == 0;
}

void TokenChecker::LogFailure() {
  const absl::Time now = absl::Now();
  int64_t since;
  {
    absl::MutexLock lock(&log_mu_);
    if (now - last_log_ < absl::Seconds(10)) return;
    last_log_ = now;
    since = failures_.load() - logged_;
    logged_ = failures_.load();
  }
  const std::vector<std::string> peers =
      recent_peers_ ? recent_peers_() : std::vector<std::string>{};
  LOG(WARNING) << "TCP: " << since
               << " call(s) refused for a missing or wrong bearer token since "
                  "the last such line ("
               << failures_.load() << " in all; at most one line per 10 s)"
               << (peers.empty() ? ""
                                 : "; latest TCP connections from " +
                                       absl::StrJoin(peers, ", "));
}

}  // namespace weightsync
