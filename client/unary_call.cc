#include "client/unary_call.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace weightsync {
namespace {

// gRPC's words for "no connection was made" (the socket is missing, or
// nobody listens on it yet): the same list as weightsync._retry.NEVER_SENT.
constexpr absl::string_view kNeverSent[] = {
    "failed to connect to all addresses",
    "Connection refused",
    "No such file or directory",
    "connections to all backends failing",
};

constexpr absl::Duration kFirstDelay = absl::Milliseconds(20);
constexpr absl::Duration kMaxDelay = absl::Milliseconds(100);

}  // namespace

bool IsIdempotent(absl::string_view method) {
  return method == "GetStatus" || method == "GetWorldSize" ||
         method == "CheckEngine" || method == "Check";
}

bool NeverSent(const grpc::Status& status) {
  if (status.error_code() != grpc::StatusCode::UNAVAILABLE) return false;
  for (absl::string_view words : kNeverSent) {
    if (absl::StrContains(status.error_message(), words)) return true;
  }
  return false;
}

bool Retryable(absl::string_view method, const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE &&
         (IsIdempotent(method) || NeverSent(status));
}

absl::Status UserStatus(absl::string_view target, absl::string_view method,
                        const grpc::Status& status, absl::Duration timeout) {
  const std::string& words = status.error_message();
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
      if (NeverSent(status)) {
        return absl::UnavailableError(absl::StrCat(
            method, ": weightsyncd is not reachable at ", target,
            " (is it running, and listening there?); the request was not "
            "sent [",
            words, "]"));
      }
      // The daemon's own UNAVAILABLE answers are sentences it chose
      // ("daemon is shutting down", ...); gRPC's are short transport words.
      if (absl::StrContains(words, "Socket closed") ||
          absl::StrContains(words, "Connection reset") ||
          absl::StrContains(words, "Broken pipe") ||
          absl::StrContains(words, "GOAWAY") ||
          absl::StrContains(words, "transport closed")) {
        return absl::UnavailableError(absl::StrCat(
            method, ": the connection to weightsyncd at ", target,
            " broke during the call (a daemon restart?); ",
            IsIdempotent(method)
                ? "retry it"
                : "it may have reached the daemon, so it was not resent: "
                  "check GetStatus, or retry the whole update",
            " [", words, "]"));
      }
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      if (words == "Deadline Exceeded") {
        return absl::DeadlineExceededError(absl::StrCat(
            method, ": weightsyncd at ", target, " did not answer within ",
            absl::FormatDuration(timeout), " (ClientOptions::call_timeout) [",
            words, "]"));
      }
      break;
    default:
      break;
  }
  return FromGrpcStatus(status);
}

absl::Status CallUnary(
    grpc::Channel* channel, const ClientOptions& options,
    absl::string_view method,
    const std::function<grpc::Status(grpc::ClientContext*)>& attempt,
    bool retry) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options.call_timeout;
  const absl::Time give_up = std::min(
      deadline, start + std::max(options.retry_window, absl::ZeroDuration()));
  absl::Duration delay = kFirstDelay;
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    const grpc::Status s = attempt(&ctx);
    if (s.ok()) return absl::OkStatus();
    if (!retry || !Retryable(method, s) || absl::Now() + delay >= give_up) {
      return UserStatus(options.target, method, s, options.call_timeout);
    }
    // Without this, a channel that lost its daemon waits out gRPC's
    // reconnect back-off before it tries the new one; reset first, so the
    // connection is made while we sleep.
    grpc::experimental::ChannelResetConnectionBackoff(channel);
    absl::SleepFor(delay);
    delay = std::min(2 * delay, kMaxDelay);
  }
}

}  // namespace weightsync
