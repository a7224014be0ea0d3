// One unary call from a C++ client to weightsyncd: its deadline, which
// failures are retried, and the answer in the terms of the call the user
// made (docs/integration.md, "C++ clients: restarts and errors"). The same
// rules as the Python client's weightsync._retry:
//
//   * retried on UNAVAILABLE, within ClientOptions::retry_window and the
//     call's own deadline, 20 ms then doubling to 100 ms apart, the
//     channel's reconnect back-off reset before each try (so a restarted
//     daemon is reached as soon as it listens, not after gRPC's back-off):
//       - idempotent calls (IsIdempotent), whatever the UNAVAILABLE;
//       - any other call whose request provably never reached a daemon
//         (NeverSent: gRPC could not connect). A Start, Init, Register or
//         Finish is safe to resend then, and only then;
//   * never retried: streams (PushChunks, IpcChunks, Control, Liveness:
//     their owners handle a broken stream) and non-idempotent calls that
//     may have been sent (the connection broke mid-call): the caller gets
//     UNAVAILABLE and decides (for an update: retry the whole update).
//
// Stateless functions; safe from any thread.
#ifndef WEIGHTSYNC_CLIENT_UNARY_CALL_H_
#define WEIGHTSYNC_CLIENT_UNARY_CALL_H_

#include <functional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/channel.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/status.h"

namespace weightsync {

// GetStatus, GetWorldSize, CheckEngine and the health Check: answering
// twice changes nothing.
bool IsIdempotent(absl::string_view method);
// True if `status` says gRPC never made a connection, so the request was
// not sent ("failed to connect to all addresses", "Connection refused",
// a missing socket file).
bool NeverSent(const grpc::Status& status);
// True if an answer `status` to `method` may be retried (see above).
bool Retryable(absl::string_view method, const grpc::Status& status);

// `status` (the answer to `method` on `target`, whose deadline was
// `timeout`) as the client returns it: the same code; where gRPC itself
// answered (no daemon listening, the connection broke, the deadline
// passed) a message saying so in the user's terms, gRPC's words kept in
// brackets. The daemon's own answers pass unchanged.
absl::Status UserStatus(absl::string_view target, absl::string_view method,
                        const grpc::Status& status, absl::Duration timeout);

// Calls attempt(ctx) with a fresh context carrying the call's deadline
// (now + options.call_timeout) until it succeeds, fails in a way that is
// not Retryable(method, ...), or the retry window (options.retry_window,
// never past the deadline) ends; `retry` false makes one try only.
// Returns UserStatus of the last answer.
absl::Status CallUnary(
    grpc::Channel* channel, const ClientOptions& options,
    absl::string_view method,
    const std::function<grpc::Status(grpc::ClientContext*)>& attempt,
    bool retry = true);

}  // namespace weightsync

#endif  // WEIGHTSYNC_CLIENT_UNARY_CALL_H_
