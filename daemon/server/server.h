// The daemon's gRPC server: the trainer and engine services plus
// grpc.health.v1 on a Unix socket and, optionally, a TCP address.
// Lifecycle: BuildAndStart once, Wait or Shutdown from another thread.
#ifndef WEIGHTSYNC_DAEMON_SERVER_SERVER_H_
#define WEIGHTSYNC_DAEMON_SERVER_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/core/coordinator.h"
#include "daemon/server/services.h"
#include "daemon/server/unix_listener.h"
#include "grpcpp/server.h"

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
  // Connections the Unix listener refused (peer not allowed).
  int64_t refused_connections() const {
    return listener_ != nullptr ? listener_->refused() : 0;
  }

 private:
  Server(Coordinator* core)
      : trainer_(core, &owners_), engine_(core, &owners_) {}
  EngineOwners owners_;  // before the services, which hold it
  TrainerServiceImpl trainer_;
  EngineServiceImpl engine_;
  std::unique_ptr<UnixListener> listener_;
  std::unique_ptr<grpc::Server> server_;
  int tcp_port_ = 0;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_SERVER_H_
