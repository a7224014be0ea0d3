// The daemon's gRPC server: the trainer and engine services plus
// grpc.health.v1 on a Unix socket and, optionally, a TCP address.
// Lifecycle: BuildAndStart once, Wait or Shutdown from another thread.
#ifndef WEIGHTSYNC_DAEMON_SERVER_SERVER_H_
#define WEIGHTSYNC_DAEMON_SERVER_SERVER_H_

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "daemon/core/coordinator.h"
#include "daemon/server/call_limits.h"
#include "daemon/server/services.h"
#include "daemon/server/tcp_listener.h"
#include "daemon/server/token_checker.h"
#include "daemon/server/unix_listener.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

namespace weightsync {

struct ServerOptions {
  // Path of the Unix socket; a stale socket file there is replaced. Empty:
  // no Unix socket.
  std::string unix_socket;
  // "host:port" to listen on TCP; empty: off. Port 0 picks a free port
  // (see Server::tcp_port). TCP needs TLS (tls_cert_pem, tls_key_pem) and a
  // bearer token checked on every call (docs/security.md).
  std::string tcp_address;
  std::string tls_cert_pem, tls_key_pem;
  // PEM of the CAs whose client certificates are required; empty: clients
  // need no certificate.
  std::string tls_client_ca_pem;
  // Every call on TCP must carry "authorization: Bearer <token>".
  std::string token;
  // Largest message accepted; must hold one chunk plus framing.
  int max_message_bytes = (64 << 20) + (1 << 20);
  // HTTP/2 keepalive while calls are open: the daemon pings a connection
  // after `keepalive_ms` without traffic and closes it when no answer comes
  // within `keepalive_timeout_ms`, so a peer cut off the network (no FIN, no
  // RST) does not hold a handler thread and its stream forever. Clients may
  // ping as often as every `keepalive_ms / 2`. 0 turns the pings off.
  int keepalive_ms = 10000;
  int keepalive_timeout_ms = 5000;
  // A connection with no call open for this long is closed (clients
  // reconnect on their next call); it also frees the connections of peers
  // cut off between calls. 0: never.
  int max_idle_ms = 300000;
  // Bounds on what peers may hold (docs/security.md, "Limits"). HTTP/2
  // streams one connection may have open at once (SETTINGS); a client past
  // it waits for a free stream, a peer that ignores it gets REFUSED_STREAM.
  int max_streams_per_connection = 100;
  // Threads gRPC may run handlers on (a resource quota); a call that finds
  // none gets RESOURCE_EXHAUSTED ("Server Threadpool Exhausted").
  int max_threads = 256;
  // Largest header block (metadata) a call may send; advertised to peers
  // (SETTINGS_MAX_HEADER_LIST_SIZE) so that a gRPC client fails such a call
  // itself, and checked before the token.
  int max_metadata_bytes = 16 << 10;
  // Per-peer caps on calls and Control streams, whole-engine reads.
  CallLimitOptions call_limits;
  // Who may connect to the Unix socket, its group and directory rules
  // (unix_listener.h).
  PeerPolicy peer_policy;
  // Tests: replaces the Unix listener's credentials lookup, so that calls
  // can act as other users and processes (the ownership rules).
  PeerLookup peer_lookup_for_testing;
};

class Server {
 public:
  static absl::StatusOr<std::unique_ptr<Server>> BuildAndStart(
      const ServerOptions& options, Coordinator* core);
  ~Server();

  void Wait();
  // Stops accepting, cancels open streams after `grace`, returns when done.
  void Shutdown(absl::Duration grace);
  int tcp_port() const { return tcp_port_; }
  // Calls the TCP token check refused.
  int64_t auth_failures() const {
    return token_checker_ != nullptr ? token_checker_->failures() : 0;
  }
  // Whether each listener accepts connections (false while out of
  // descriptors; health says NOT_SERVING then).
  bool unix_accepting() const {
    return listener_ == nullptr || listener_->accepting();
  }
  bool tcp_accepting() const { return tcp_ == nullptr || tcp_->accepting(); }
  // Connections the Unix listener refused (peer not allowed).
  int64_t refused_connections() const {
    return listener_ != nullptr ? listener_->refused() : 0;
  }

 private:
  Server(Coordinator* core, const CallLimitOptions& limits)
      : limits_(limits), trainer_(core, &owners_), engine_(core, &owners_) {}
  // Keeps health in step with the listeners and the certificate: "" and
  // "weightsync.unix" / "weightsync.tcp" NOT_SERVING while a listener can't
  // accept, "weightsync.tls_certificate" while the certificate has expired
  // or expires within a week (docs/operations.md, "Health").
  void WatchHealth();
  void UpdateHealth();

  EngineOwners owners_;  // before the services, which hold it
  CallLimits limits_;    // likewise
  TrainerServiceImpl trainer_;
  EngineServiceImpl engine_;
  std::unique_ptr<UnixListener> listener_;
  std::unique_ptr<TcpListener> tcp_;
  std::shared_ptr<TokenChecker> token_checker_;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> tcp_acceptor_;
  std::optional<absl::Time> cert_not_after_;
  std::unique_ptr<grpc::Server> server_;
  int tcp_port_ = 0;
  std::atomic<bool> stop_health_{false};
  std::thread health_;
  int health_state_ = -1;  // the last UpdateHealth's bits; health_ thread
  // Calls open now, every service (a counting interceptor): Shutdown
  // waits for these, not for idle connections.
  std::atomic<int> open_calls_{0};
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_SERVER_H_
