#include "daemon/server/server.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/server/cert_expiry.h"
#include "daemon/server/idle_priority.h"
#include "daemon/server/parse_errors.h"
#include "glog/logging.h"
#include "grpc/grpc.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_interceptor.h"

namespace weightsync {
namespace {

// Counts the calls in progress: one interceptor lives as long as its call.
class CallCounter : public grpc::experimental::Interceptor {
 public:
  explicit CallCounter(std::atomic<int>* open) : open_(open) {
    open_->fetch_add(1);
  }
  ~CallCounter() override { open_->fetch_sub(1); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    m->Proceed();
  }

 private:
  std::atomic<int>* const open_;
};

class CallCounterFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallCounterFactory(std::atomic<int>* open) : open_(open) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo*) override {
    return new CallCounter(open_);
  }

 private:
  std::atomic<int>* const open_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::BuildAndStart(
    const ServerOptions& options, Coordinator* core) {
  if (options.unix_socket.empty() && options.tcp_address.empty()) {
    return absl::InvalidArgumentError("no Unix socket and no TCP address");
  }
  std::unique_ptr<Server> server(new Server(core, options.call_limits));
  // Whole-engine reads (CheckEngine) at the lowest CPU priority, so that
  // checks can't slow updates.
  core->set_engine_read_runner(
      [](const std::function<void()>& read) { RunAtIdlePriority(read); });
  server->trainer_.set_limits(&server->limits_);
  server->engine_.set_limits(&server->limits_);
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
  // Bounds on streams, threads and header blocks (docs/security.md).
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             options.max_streams_per_connection);
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE,
                             options.max_metadata_bytes);
  grpc::ResourceQuota quota("weightsyncd");
  quota.SetMaxThreads(options.max_threads);
  builder.SetResourceQuota(quota);
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
    absl::StatusOr<absl::Time> not_after =
        CertificateNotAfter(options.tls_cert_pem);
    if (!not_after.ok()) return not_after.status();
    server->cert_not_after_ = *not_after;
    const std::string warning = CertificateWarning(*not_after, absl::Now());
    if (!warning.empty()) LOG(WARNING) << warning;
    auto creds = grpc::SslServerCredentials(ssl);
    // Accepted by the daemon, which recovers from running out of
    // descriptors (tcp_listener.h); TLS and the token check stay gRPC's.
    auto tcp = TcpListener::Bind(options.tcp_address);
    if (!tcp.ok()) return tcp.status();
    server->tcp_ = *std::move(tcp);
    server->tcp_->set_keepalive(options.keepalive_ms,
                                options.keepalive_timeout_ms);
    server->tcp_port_ = server->tcp_->port();
    TcpListener* t = server->tcp_.get();
    server->token_checker_ = std::make_shared<TokenChecker>(
        options.token, [t] { return t->RecentPeers(); });
    creds->SetAuthMetadataProcessor(server->token_checker_);
    server
        ->tcp_acceptor_ = builder.experimental().AddExternalConnectionAcceptor(
        grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD,
        creds);
  }
  // A request that does not parse: INVALID_ARGUMENT naming the method.
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(ParseErrorInterceptorFactory());
  // Calls open, for Shutdown.
  interceptors.push_back(
      std::make_unique<CallCounterFactory>(&server->open_calls_));
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
  SetActiveCallLimits(&server->limits_);
  if (server->listener_ != nullptr)
    server->listener_->Serve(server->server_.get());
  if (server->tcp_ != nullptr) server->tcp_->Serve(server->tcp_acceptor_.get());
  server->UpdateHealth();
  Server* s = server.get();
  server->health_ = std::thread([s] { s->WatchHealth(); });
  return server;
}

void Server::WatchHealth() {
  while (!stop_health_) {
    absl::SleepFor(absl::Milliseconds(250));
    UpdateHealth();
  }
}

void Server::UpdateHealth() {
  const absl::Time now = absl::Now();
  const bool unix_ok = unix_accepting();
  const bool tcp_ok = tcp_accepting();
  const bool cert_valid = !cert_not_after_ || *cert_not_after_ > now;
  const std::string warning =
      cert_not_after_ ? CertificateWarning(*cert_not_after_, now) : "";
  const int state = (unix_ok ? 1 : 0) | (tcp_ok ? 2 : 0) |
                    (cert_valid ? 4 : 0) | (warning.empty() ? 8 : 0);
  if (state == health_state_) return;
  if (health_state_ >= 0 && (health_state_ & 8) != 0 && !warning.empty()) {
    LOG(WARNING) << warning;
  }
  health_state_ = state;
  grpc::HealthCheckServiceInterface* h = server_->GetHealthCheckService();
  // "": every listener accepts. A certificate near its end or expired does
  // not stop local engines: it shows in its own service name.
  h->SetServingStatus("", unix_ok && tcp_ok);
  h->SetServingStatus("weightsync.unix", unix_ok);
  h->SetServingStatus("weightsync.tcp", tcp_ok && cert_valid);
  h->SetServingStatus("weightsync.tls_certificate", warning.empty());
}

Server::~Server() {
  if (server_ != nullptr) Shutdown(absl::ZeroDuration());
}

void Server::Wait() { server_->Wait(); }

void Server::Shutdown(absl::Duration grace) {
  if (server_ == nullptr) return;
  stop_health_ = true;
  if (health_.joinable()) health_.join();
  if (ActiveCallLimits() == &limits_) SetActiveCallLimits(nullptr);
  server_->GetHealthCheckService()->SetServingStatus(false);
  if (listener_ != nullptr) listener_->Stop();
  if (tcp_ != nullptr) tcp_->Stop();
  // Trainers' Liveness streams never end by themselves: end them now
  // rather than after the grace.
  trainer_.EndLivenessStreams();
  // The core has told the engines what they need (core Shutdown first); an
  // idle control stream must not hold the stop for the whole grace.
  engine_.CancelControlStreams();
  // Open calls get up to `grace`; idle connections get nothing: gRPC would
  // hold its Shutdown for the whole deadline on a connection whose client
  // is idle (it answers no GOAWAY ping while it does not poll), which made
  // SIGTERM take --shutdown_grace_ms with a trainer merely connected.
  const absl::Time end = absl::Now() + grace;
  while (open_calls_.load() > 0 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  server_->Shutdown(absl::ToChronoTime(absl::Now()));
  server_->Wait();
  server_.reset();
}

}  // namespace weightsync
