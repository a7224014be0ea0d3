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
  std::map<std::string, absl::Status> result;
  std::vector<std::pair<uint64_t, std::shared_ptr<ControlChannel>>> sends;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& e : engines) {
      auto it = channels_.find(e);
      if (it == channels_.end()) {
        result[e] = absl::UnavailableError(
            absl::StrCat("engine '", e, "' has no open control stream"));
        continue;
      }
      const uint64_t id = next_notice_++;
      pending_[id] = Pending{e};
      sends.push_back({id, it->second});
    }
  }
  // Send outside the lock: a slow stream must not stall other callers.
  for (auto& [id, ch] : sends) {
    message.set_notice_id(id);
    if (!ch->Send(message)) {
      absl::MutexLock lock(&mu_);
      Pending& p = pending_[id];
      if (!p.done) {
        p.done = true;
        p.status = absl::UnavailableError(
            absl::StrCat("engine '", p.engine, "': control stream broke"));
      }
    }
  }
  absl::MutexLock lock(&mu_);
  auto all_done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto& [id, ch] : sends) {
      if (!pending_[id].done) return false;
    }
    return true;
  };
  mu_.AwaitWithDeadline(absl::Condition(&all_done), deadline);
  for (auto& [id, ch] : sends) {
    Pending& p = pending_[id];
    result[p.engine] =
        p.done ? p.status
               : absl::DeadlineExceededError(absl::StrCat(
                     "engine '", p.engine, "' did not acknowledge in time"));
    pending_.erase(id);
  }
  return result;
}

}  // namespace weightsync
