#include "client/channel.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace weightsync {

absl::StatusOr<std::shared_ptr<grpc::Channel>> ConnectChannel(
    const ClientOptions& options) {
  if (options.target.empty()) {
    return absl::InvalidArgumentError("no daemon target given");
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // A channel of its own (not gRPC's process-wide subchannel pool, whose
  // back-off every channel to the target would share) that tries again
  // soon after losing the daemon: a restart is over in moments, and gRPC's
  // default (1 s, growing to 2 min) kept calls failing for seconds. gRPC
  // raises each of these to at least 100 ms.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  if (options.target.rfind("unix:", 0) == 0) {
    // The minimum time a connect may take: a local socket accepts at once
    // (left at gRPC's 20 s for TCP, where a TLS handshake crosses a network).
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  } else {
    // A daemon cut off the network sends no FIN or RST: pings during calls
    // find it (the daemon allows one every --keepalive_ms / 2). gRPC would
    // otherwise hold back pings on a call that sends no data.
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    args.SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  }
  std::shared_ptr<grpc::ChannelCredentials> creds =
      grpc::InsecureChannelCredentials();
  if (!options.tls_ca_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca_pem;
    ssl.pem_private_key = options.tls_key_pem;
    ssl.pem_cert_chain = options.tls_cert_pem;
    creds = grpc::SslCredentials(ssl);
    if (!options.token.empty()) {
      creds = grpc::CompositeChannelCredentials(
          creds, grpc::AccessTokenCredentials(options.token));
    }
  }
  auto channel = grpc::CreateCustomChannel(options.target, creds, args);
  if (!channel->WaitForConnected(
          absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat(
        "weightsyncd is not reachable at ", options.target, " within ",
        absl::FormatDuration(options.connect_timeout)));
  }
  return channel;
}

}  // namespace weightsync
