// The daemon's TCP port, accepted by the daemon itself and handed to gRPC
// (an external connection acceptor, TLS and the token check done by gRPC
// as for any port). Why not gRPC's own listener: in gRPC 1.51 (Debian 12)
// one failed accept (EMFILE: the descriptor limit reached) stops its TCP
// listener for good, while the port stays bound and the kernel keeps
// queueing connections nobody accepts. This loop backs off and recovers
// (accept_gate.h).
//
// Thread safety: Bind, Serve and Stop from one thread; the rest from any.
#ifndef WEIGHTSYNC_DAEMON_SERVER_TCP_LISTENER_H_
#define WEIGHTSYNC_DAEMON_SERVER_TCP_LISTENER_H_

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/server/accept_gate.h"
#include "grpcpp/server_builder.h"

namespace weightsync {

class TcpListener {
 public:
  // Binds and listens on `address`: "host:port", "[v6]:port"; port 0
  // picks a free one. An IPv6 wildcard also takes IPv4 connections.
  static absl::StatusOr<std::unique_ptr<TcpListener>> Bind(
      const std::string& address);
  ~TcpListener();

  int port() const { return port_; }
  // Starts the accept thread; every connection goes to `acceptor` (owned by
  // the caller, valid until Stop).
  void Serve(grpc::experimental::ExternalConnectionAcceptor* acceptor);
  // Stops accepting and closes the port; open connections stay with gRPC.
  void Stop();

  bool accepting() const { return gate_.accepting(); }

  // Kernel TCP keepalive on every accepted connection: idle after
  // `keepalive_ms`, dropped once probes or data go unacknowledged for
  // `keepalive_ms + timeout_ms` (TCP_USER_TIMEOUT). gRPC's own keepalive
  // pings did not close a cut connection handed over by descriptor
  // (tests/faults tcp_cut); this closes it in the kernel. 0: off.
  void set_keepalive(int keepalive_ms, int timeout_ms) {
    keepalive_ms_ = keepalive_ms;
    keepalive_timeout_ms_ = timeout_ms;
  }
  // "ipv4:a.b.c.d:port" of the last few connections accepted, newest last.
  std::vector<std::string> RecentPeers() const;

 private:
  TcpListener(std::string address, int fd, int port)
      : address_(std::move(address)),
        fd_(fd),
        port_(port),
        gate_("tcp:" + address_) {}
  void AcceptLoop(grpc::experimental::ExternalConnectionAcceptor* acceptor);

  const std::string address_;
  int fd_;
  int keepalive_ms_ = 0;
  int keepalive_timeout_ms_ = 0;
  const int port_;
  AcceptGate gate_;  // used by the accept thread
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  mutable absl::Mutex mu_;
  std::deque<std::string> recent_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_TCP_LISTENER_H_
