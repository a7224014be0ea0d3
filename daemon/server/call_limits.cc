#include "daemon/server/call_limits.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace weightsync {
namespace {

std::atomic<const CallLimits*> g_active{nullptr};

std::string Key(CallLimits::Kind kind, const std::string& peer) {
  return absl::StrCat(kind == CallLimits::Kind::kControl ? "c/" : "u/", peer);
}

}  // namespace

const CallLimits* ActiveCallLimits() { return g_active.load(); }
void SetActiveCallLimits(const CallLimits* limits) { g_active = limits; }

CallLimits::Ticket& CallLimits::Ticket::operator=(Ticket&& other) noexcept {
  if (this != &other) {
    Release();
    limits_ = other.limits_;
    kind_ = other.kind_;
    peer_ = std::move(other.peer_);
    other.limits_ = nullptr;
  }
  return *this;
}

void CallLimits::Ticket::Release() {
  if (limits_ != nullptr) limits_->Leave(kind_, peer_);
  limits_ = nullptr;
}

absl::StatusOr<CallLimits::Ticket> CallLimits::Enter(Kind kind,
                                                     const std::string& peer) {
  absl::MutexLock lock(&mu_);
  if (kind == Kind::kEngineRead) {
    if (engine_reads_ >= options_.max_engine_reads) {
      ++refused_[static_cast<int>(kind)];
      return absl::ResourceExhaustedError(absl::StrCat(
          "CheckEngine: ", engine_reads_,
          " reads of whole engines are running, the most allowed at once "
          "(--max_engine_reads=",
          options_.max_engine_reads, "); retry after a back-off"));
    }
    ++engine_reads_;
    return Ticket(this, kind, "");
  }
  const bool control = kind == Kind::kControl;
  const int all_cap =
      std::max(1, options_.max_threads - CallLimitOptions::kSpareThreads);
  if (options_.max_threads > 0 && open_all_ >= all_cap) {
    ++refused_all_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "the daemon runs ", open_all_,
        " calls and Control streams for all peers, the most it takes at once "
        "(--max_threads=",
        options_.max_threads, ", less ", CallLimitOptions::kSpareThreads,
        " threads kept to refuse the rest); retry after a back-off"));
  }
  const int cap = control ? options_.max_control_streams_per_peer
                          : options_.max_calls_per_peer;
  int& open = open_[Key(kind, peer)];
  if (open >= cap) {
    ++refused_[static_cast<int>(kind)];
    return absl::ResourceExhaustedError(absl::StrCat(
        peer, " has ", open,
        control ? " engine Control streams open, the most one peer may hold "
                  "(--max_control_streams_per_peer="
                : " calls open, the most one peer may hold "
                  "(--max_calls_per_peer=",
        cap, "); close some or retry after a back-off"));
  }
  ++open;
  ++open_all_;
  return Ticket(this, kind, peer);
}

void CallLimits::Leave(Kind kind, const std::string& peer) {
  absl::MutexLock lock(&mu_);
  if (kind == Kind::kEngineRead) {
    --engine_reads_;
    return;
  }
  --open_all_;
  auto it = open_.find(Key(kind, peer));
  if (it != open_.end() && --it->second <= 0) open_.erase(it);
}

}  // namespace weightsync
