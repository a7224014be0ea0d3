// Connecting to weightsyncd: a target string ("unix:/path" or "host:port")
// and deadlines shared by the trainer and engine clients.
#ifndef WEIGHTSYNC_CLIENT_CHANNEL_H_
#define WEIGHTSYNC_CLIENT_CHANNEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"

namespace weightsync {

struct ClientOptions {
  // "unix:/run/user/1000/weightsync/weightsyncd.sock" or "host:port".
  std::string target;
  // Deadline of each unary call that names none of its own.
  absl::Duration call_timeout = absl::Seconds(30);
  // Deadline of a whole PushChunks stream.
  absl::Duration stream_timeout = absl::Minutes(10);
  // How long Connect waits for the daemon to accept.
  absl::Duration connect_timeout = absl::Seconds(10);
  // How long a unary call that found the daemon unreachable is retried
  // (client/unary_call.h says which calls); never past the call's own
  // deadline. Zero: no retries.
  absl::Duration retry_window = absl::Seconds(5);
  int max_message_bytes = (64 << 20) + (1 << 20);
  // TCP targets (docs/security.md): PEM of the CA that signed the daemon's
  // certificate (a non-empty value turns TLS on), the bearer token sent with
  // every call, and optionally this client's certificate and key.
  std::string tls_ca_pem;
  std::string token;
  std::string tls_cert_pem, tls_key_pem;
};

// Opens a channel and waits until it is connected, or UNAVAILABLE.
absl::StatusOr<std::shared_ptr<grpc::Channel>> ConnectChannel(
    const ClientOptions& options);

}  // namespace weightsync

#endif  // WEIGHTSYNC_CLIENT_CHANNEL_H_
