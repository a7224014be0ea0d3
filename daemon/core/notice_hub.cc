#include "daemon/core/notice_hub.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace weightsync {

void NoticeHub::Attach(const std::string& engine,
                       std::shared_ptr<ControlChannel> ch) {
  absl::MutexLock lock(&mu_);
  channels_[engine] = std::move(ch);
}

bool NoticeHub::Detach(const std::string& engine, const ControlChannel* ch) {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(engine);
  if (it == channels_.end() || it->second.get() != ch) return false;
  channels_.erase(it);
  for (auto& [id, p] : pending_) {
    if (p.engine == engine && !p.done) {
      p.done = true;
      p.status = absl::UnavailableError(
          absl::StrCat("engine '", engine, "' closed its control stream"));
    }
  }
  return true;
}

void NoticeHub::DetachEngine(const std::string& engine) {
  std::shared_ptr<ControlChannel> ch;
  {
    absl::MutexLock lock(&mu_);
    auto it = channels_.find(engine);
    if (it == channels_.end()) return;
    ch = it->second;
  }
  Detach(engine, ch.get());
}

bool NoticeHub::Connected(const std::string& engine) const {
  absl::MutexLock lock(&mu_);
  return channels_.contains(engine);
}

void NoticeHub::OnAck(const std::string& engine,
                      const v1::EngineMessage::Ack& ack) {
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(ack.notice_id());
  if (it == pending_.end() || it->second.engine != engine || it->second.done) {
    return;  // late or foreign acknowledgement: harmless
  }
  it->second.done = true;
  it->second.status =
      ack.ok() ? absl::OkStatus()
               : absl::AbortedError(absl::StrCat("engine '", engine,
                                                 "' refused: ", ack.message()));
}

std::map<std::string, absl::Status> NoticeHub::Broadcast(
    const std::vector<std::string>& engines, v1::DaemonMessage message,
    absl::Time deadline) {
  std::vector<Notices> notices;
  for (const std::string& e : engines) notices.push_back({e, {message}});
  return Broadcast(notices, deadline);
}

std::map<std::string, absl::Status> NoticeHub::Broadcast(
    const std::vector<Notices>& notices, absl::Time deadline) {
  std::map<std::string, absl::Status> result;
  struct Send {
    uint64_t id;
    std::shared_ptr<ControlChannel> channel;
    const v1::DaemonMessage* message;
  };
  std::vector<Send> sends;
  {
    absl::MutexLock lock(&mu_);
    for (const Notices& n : notices) {
      auto it = channels_.find(n.engine);
      if (it == channels_.end()) {
        result[n.engine] = absl::UnavailableError(
            absl::StrCat("engine '", n.engine, "' has no open control stream"));
        continue;
      }
      for (const v1::DaemonMessage& m : n.messages) {
        const uint64_t id = next_notice_++;
        pending_[id] = Pending{n.engine};
        sends.push_back({id, it->second, &m});
      }
    }
  }
  // Send everything before waiting for anything: an engine's notices are
  // acknowledged in order, so a sequence costs one round trip, not one per
  // notice. Sending happens outside the lock: a slow stream must not stall
  // other callers.
  for (const Send& s : sends) {
    v1::DaemonMessage message = *s.message;
    message.set_notice_id(s.id);
    if (!s.channel->Send(message)) {
      absl::MutexLock lock(&mu_);
      Pending& p = pending_[s.id];
      if (!p.done) {
        p.done = true;
        p.status = absl::UnavailableError(
            absl::StrCat("engine '", p.engine, "': control stream broke"));
      }
    }
  }
  absl::MutexLock lock(&mu_);
  auto all_done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const Send& s : sends) {
      if (!pending_[s.id].done) return false;
    }
    return true;
  };
  mu_.AwaitWithDeadline(absl::Condition(&all_done), deadline);
  for (const Send& s : sends) {
    Pending& p = pending_[s.id];
    absl::Status status =
        p.done ? p.status
               : absl::DeadlineExceededError(absl::StrCat(
                     "engine '", p.engine, "' did not acknowledge in time"));
    auto [it, fresh] = result.emplace(p.engine, status);
    if (!fresh && it->second.ok()) it->second = status;  // first failure
    pending_.erase(s.id);
  }
  return result;
}

}  // namespace weightsync
