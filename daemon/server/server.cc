#include "daemon/server/server.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/server/parse_errors.h"
#include "glog/logging.h"
#include "grpc/grpc.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace weightsync {
namespace {

// Every call on the TCP port must carry "authorization: Bearer <token>";
// compared in constant time, never logged.
class TokenChecker : public grpc::AuthMetadataProcessor {
 public:
  explicit TokenChecker(std::string token)
      : expected_("Bearer " + std::move(token)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext*,
                       OutputMetadata* consumed,
                       OutputMetadata* /*response*/) override {
    auto it = metadata.find("authorization");
    if (it != metadata.end() && Equal(it->second)) {
      consumed->insert(
          {"authorization", std::string(it->second.data(), it->second.size())});
      return grpc::Status::OK;
    }
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        it == metadata.end()
                            ? "no bearer token (authorization metadata)"
                            : "wrong bearer token");
  }

 private:
  bool Equal(grpc::string_ref got) const {
    unsigned diff = got.size() ^ expected_.size();
    for (size_t i = 0; i < expected_.size(); ++i) {
      diff |= static_cast<unsigned char>(expected_[i]) ^
              static_cast<unsigned char>(i < got.size() ? got.data()[i] : 0);
    }
    return diff == 0;
  }
  const std::string expected_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::BuildAndStart(
    const ServerOptions& options, Coordinator* core) {
  if (options.unix_socket.empty() && options.tcp_address.empty()) {
    return absl::InvalidArgumentError("no Unix socket and no TCP address");
  }
  std::unique_ptr<Server> server(new Server(core));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  // Sync-server pollers wake at this period; it bounds how long Shutdown
  // can wait for an idle poller (the library default is 10 s).
  builder.SetSyncServerOption(
      grpc::ServerBuilder::SyncServerOption::CQ_TIMEOUT_MSEC, 200);
  if (options.keepalive_ms > 0) {
    // Pings only while calls are open: an idle Python client does not poll
    // its channel and would never answer. Idle connections are closed by
    // max_idle_ms instead.
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                               options.keepalive_ms);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                               options.keepalive_timeout_ms);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
    // Else gRPC holds back pings on a connection that sends no data (at
    // most 2, one per 5 min) and the keepalive watchdog closes a healthy
    // connection in the middle of a long Finish.
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    builder.AddChannelArgument(
        GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS,
        options.keepalive_ms);
    builder.AddChannelArgument(
        GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
        options.keepalive_ms / 2);
  }
  if (options.max_idle_ms > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                               options.max_idle_ms);
  }
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  if (!options.unix_socket.empty()) {
    // Accepted by the daemon, which checks each peer (unix_listener.h).
    auto listener =
        UnixListener::Bind(options.unix_socket, options.peer_policy);
    if (!listener.ok()) return listener.status();
    server->listener_ = *std::move(listener);
    UnixListener* l = server->listener_.get();
    auto lookup = [l](const std::string& peer) { return l->PeerOf(peer); };
    server->engine_.set_peer_lookup(lookup);
    server->trainer_.set_peer_lookup(lookup);
  }
  if (options.peer_lookup_for_testing) {
    server->engine_.set_peer_lookup(options.peer_lookup_for_testing);
    server->trainer_.set_peer_lookup(options.peer_lookup_for_testing);
  }
  if (!options.tcp_address.empty()) {
    if (options.tls_cert_pem.empty() || options.tls_key_pem.empty() ||
        options.token.empty()) {
      return absl::InvalidArgumentError(
          "TCP needs TLS and a token: --tls_cert, --tls_key and --token_file "
          "(docs/security.md)");
    }
    grpc::SslServerCredentialsOptions ssl(
        options.tls_client_ca_pem.empty()
            ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_root_certs = options.tls_client_ca_pem;
    ssl.pem_key_cert_pairs.push_back(
        {options.tls_key_pem, options.tls_cert_pem});
    auto creds = grpc::SslServerCredentials(ssl);
    creds->SetAuthMetadataProcessor(
        std::make_shared<TokenChecker>(options.token));
    builder.AddListeningPort(options.tcp_address, creds, &server->tcp_port_);
  }
  // A request that does not parse: INVALID_ARGUMENT naming the method.
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(ParseErrorInterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.RegisterService(&server->trainer_);
  builder.RegisterService(&server->engine_);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr ||
      (!options.tcp_address.empty() && server->tcp_port_ == 0)) {
    return absl::UnavailableError(
        absl::StrCat("could not listen on ", options.tcp_address));
  }
  server->server_->GetHealthCheckService()->SetServingStatus(true);
  if (server->listener_ != nullptr)
    server->listener_->Serve(server->server_.get());
  return server;
}

Server::~Server() {
  if (server_ != nullptr) Shutdown(absl::ZeroDuration());
}

void Server::Wait() { server_->Wait(); }

void Server::Shutdown(absl::Duration grace) {
  if (server_ == nullptr) return;
  server_->GetHealthCheckService()->SetServingStatus(false);
  if (listener_ != nullptr) listener_->Stop();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
  server_.reset();
}

}  // namespace weightsync
