// Who owns each registered engine: the peer that registered it (uid and pid
// through the daemon's Unix socket; "no credentials" over TCP, where the
// bearer token is the identity). The gRPC front asks it before calls that
// speak for an engine (docs/security.md, "Who may do what to an engine"):
//
//   Control       the registering process only (same uid and pid); root
//                 too is refused: a stream speaks for the process whose
//                 memory the daemon writes
//   Unregister    the registering process, or root (an operator)
//   Register      an id registered by another uid (not root) is refused
//   Check         the registering uid (any of its processes), or root
//
// A caller without credentials (TCP) matches only engines registered
// without credentials. It also keeps the shared-memory names an engine
// registered, for the reaper once its stream closes.
// Thread-safe.
#ifndef WEIGHTSYNC_DAEMON_SERVER_ENGINE_OWNERS_H_
#define WEIGHTSYNC_DAEMON_SERVER_ENGINE_OWNERS_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "daemon/server/unix_listener.h"

namespace weightsync {

class EngineOwners {
 public:
  enum class Action { kControl, kUnregister, kRegister, kCheck };
  struct Owner {
    std::optional<PeerCred> peer;  // none: registered over TCP
    std::vector<std::string> shm_names;
  };

  // OK if `caller` may do `action` to `engine`; PERMISSION_DENIED naming
  // the engine, the owner and the caller otherwise. OK for an engine that
  // has no owner on record (the core answers NOT_FOUND, or it registers).
  absl::Status Check(const std::string& engine,
                     const std::optional<PeerCred>& caller,
                     Action action) const;
  // After a successful RegisterEngine: `owner` owns `engine` now.
  void Record(const std::string& engine, Owner owner);
  // The engine left (unregistered, stream closed): its owner, if any.
  std::optional<Owner> Remove(const std::string& engine);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Owner> owners_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_ENGINE_OWNERS_H_
