// The daemon's Unix socket, accepted by the daemon itself rather than by
// gRPC, so that every connection's peer is known before it can send a
// byte: the kernel's SO_PEERCRED (pid, uid, gid) is checked against an
// allow list, and a connection that passes is handed to the gRPC server
// (grpc::AddInsecureChannelFromFd), which names it "fd:N" in
// ServerContext::peer(); PeerOf maps that back to the credentials, so that
// services can tie requests to the process that sent them (an engine may
// register only its own memory). docs/security.md.
//
// The socket file is created with mode 0660 (and the configured group);
// the directory it lives in must not be enterable by others (mode o-x), or
// Start refuses (unless allow_open_dir), because the socket's own mode is
// only as good as the directory around it. A missing directory is created
// with mode 0750.
#ifndef WEIGHTSYNC_DAEMON_SERVER_UNIX_LISTENER_H_
#define WEIGHTSYNC_DAEMON_SERVER_UNIX_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/server/accept_gate.h"
#include "grpcpp/server.h"

namespace weightsync {

struct PeerCred {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

struct PeerPolicy {
  // A peer is let in when its uid is in `uids`, or its primary gid or one
  // of its supplementary groups (/proc/PID/status) is in `gids`. Both
  // empty: anyone who can reach the socket (the directory and the file
  // mode decide).
  std::vector<uid_t> uids;
  std::vector<gid_t> gids;
  // Group of the socket file and of a directory Start creates; -1: the
  // daemon's own.
  gid_t group = static_cast<gid_t>(-1);
  // Let the socket live in a directory others can enter (tests, demos).
  bool allow_open_dir = false;
};

// Whether `peer` (with supplementary groups `groups`) passes `policy`.
bool PeerAllowed(const PeerPolicy& policy, const PeerCred& peer,
                 const std::vector<gid_t>& groups);

class UnixListener {
 public:
  // Binds and listens on `path`; connections go to `server` (already
  // started) once Serve() is called.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(
      const std::string& path, const PeerPolicy& policy);
  ~UnixListener();

  // Starts the accept thread, handing connections to `server`.
  void Serve(grpc::Server* server);
  // Stops accepting (open connections stay with gRPC) and removes the
  // socket file.
  void Stop();

  // The credentials of the connection gRPC names `grpc_peer` ("fd:N"), if
  // it came through this listener.
  std::optional<PeerCred> PeerOf(const std::string& grpc_peer) const;
  int64_t refused() const { return refused_.load(); }
  // False while it can't accept for lack of descriptors (accept_gate.h).
  bool accepting() const { return gate_.accepting(); }

 private:
  UnixListener(std::string path, PeerPolicy policy, int fd)
      : path_(std::move(path)),
        policy_(std::move(policy)),
        fd_(fd),
        gate_("unix:" + path_) {}
  void AcceptLoop(grpc::Server* server);

  const std::string path_;
  const PeerPolicy policy_;
  int fd_;
  AcceptGate gate_;  // used by the accept thread
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> refused_{0};
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, PeerCred> peers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_UNIX_LISTENER_H_
