// Caps on what peers may hold open at once, so that no peer can turn the
// daemon's threads, memory or CPU into its own (docs/security.md,
// "Limits"). A call past a cap ends at once with RESOURCE_EXHAUSTED naming
// the cap and its flag, before it reads a message or touches the core.
//
// A peer is its credential: the uid of a Unix-socket caller (every process
// of one user shares the cap), the bearer token on TCP (one token: every
// TCP caller shares it), else gRPC's peer name.
//
// Thread safety: every method may be called from any thread.
#ifndef WEIGHTSYNC_DAEMON_SERVER_CALL_LIMITS_H_
#define WEIGHTSYNC_DAEMON_SERVER_CALL_LIMITS_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace weightsync {

struct CallLimitOptions {
  // Calls one peer may have open at once, Control streams apart
  // (--max_calls_per_peer).
  int max_calls_per_peer = 64;
  // Engine Control streams one peer may have open at once
  // (--max_control_streams_per_peer); a stream that never sends holds one.
  int max_control_streams_per_peer = 64;
  // Reads of a whole engine's memory (CheckEngine) running at once, all
  // peers together (--max_engine_reads).
  int max_engine_reads = 2;
  // The server's threads (--max_threads; 0: no cap here). Calls and Control
  // streams of all peers together hold at most max_threads - kSpareThreads
  // places, so the call past them is refused by this cap, naming the flag,
  // while gRPC still has threads to run the refusal; gRPC's own quota
  // ("Server Threadpool Exhausted", no flag named) is then only met when
  // the spare threads are busy too.
  int max_threads = 0;
  static constexpr int kSpareThreads = 8;
};

class CallLimits {
 public:
  enum class Kind { kCall, kControl, kEngineRead };

  // A held place; gives it back when destroyed. Empty (holds nothing) when
  // default-constructed.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& other) noexcept { *this = std::move(other); }
    Ticket& operator=(Ticket&& other) noexcept;
    ~Ticket() { Release(); }

   private:
    friend class CallLimits;
    Ticket(CallLimits* limits, Kind kind, std::string peer)
        : limits_(limits), kind_(kind), peer_(std::move(peer)) {}
    void Release();
    CallLimits* limits_ = nullptr;
    Kind kind_ = Kind::kCall;
    std::string peer_;
  };

  explicit CallLimits(CallLimitOptions options) : options_(options) {}

  // A place of `kind` for `peer` (ignored for kEngineRead), or
  // RESOURCE_EXHAUSTED naming the cap and its flag.
  absl::StatusOr<Ticket> Enter(Kind kind, const std::string& peer);

  // Calls refused by each cap, ever (metrics).
  int64_t refused(Kind kind) const {
    return refused_[static_cast<int>(kind)].load();
  }
  // Calls and Control streams refused by the all-peers cap (max_threads).
  int64_t refused_all_peers() const { return refused_all_.load(); }

  // (kind, peer) pairs with a place taken now: each is forgotten when its
  // last place is given back, so the table does not grow with every peer
  // the daemon ever saw.
  int tracked() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(open_.size());
  }

 private:
  void Leave(Kind kind, const std::string& peer);

  const CallLimitOptions options_;
  std::atomic<int64_t> refused_[3] = {};
  std::atomic<int64_t> refused_all_{0};
  mutable absl::Mutex mu_;
  // Open places by (kind, peer); entries at zero are erased.
  absl::flat_hash_map<std::string, int> open_ ABSL_GUARDED_BY(mu_);
  int engine_reads_ ABSL_GUARDED_BY(mu_) = 0;
  int open_all_ ABSL_GUARDED_BY(mu_) = 0;  // calls + Control streams
};

// The process's CallLimits counters, for /metrics; null until a server
// starts. Set by Server::BuildAndStart.
const CallLimits* ActiveCallLimits();
void SetActiveCallLimits(const CallLimits* limits);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_CALL_LIMITS_H_
