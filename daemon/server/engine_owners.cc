#include "daemon/server/engine_owners.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/echo.h"

namespace weightsync {
namespace {

std::string Who(const std::optional<PeerCred>& p) {
  if (!p.has_value()) return "a caller without credentials (TCP)";
  return absl::StrCat("uid ", p->uid, " pid ", p->pid);
}

const char* Verb(EngineOwners::Action action) {
  switch (action) {
    case EngineOwners::Action::kControl:
      return "open its control stream";
    case EngineOwners::Action::kUnregister:
      return "unregister it";
    case EngineOwners::Action::kRegister:
      return "register it again";
    case EngineOwners::Action::kCheck:
      return "check it";
  }
  return "";
}

// Whether `caller` may do `action` to an engine `owner` registered.
bool Allowed(const std::optional<PeerCred>& owner,
             const std::optional<PeerCred>& caller,
             EngineOwners::Action action) {
  if (!owner.has_value() || !caller.has_value()) {
    return owner.has_value() == caller.has_value();
  }
  const bool same_uid = owner->uid == caller->uid;
  const bool same_process = same_uid && owner->pid == caller->pid;
  const bool root = caller->uid == 0;
  switch (action) {
    case EngineOwners::Action::kControl:
      return same_process;
    case EngineOwners::Action::kUnregister:
      return same_process || root;
    case EngineOwners::Action::kRegister:
    case EngineOwners::Action::kCheck:
      return same_uid || root;
  }
  return false;
}

}  // namespace

absl::Status EngineOwners::Check(const std::string& engine,
                                 const std::optional<PeerCred>& caller,
                                 Action action) const {
  absl::MutexLock lock(&mu_);
  auto it = owners_.find(engine);
  if (it == owners_.end() || Allowed(it->second.peer, caller, action)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat("engine '", Echo(engine), "' belongs to ",
                   Who(it->second.peer), ", which registered it; ", Who(caller),
                   " may not ", Verb(action), " (docs/security.md)"));
}

void EngineOwners::Record(const std::string& engine, Owner owner) {
  absl::MutexLock lock(&mu_);
  owners_[engine] = std::move(owner);
}

std::optional<EngineOwners::Owner> EngineOwners::Remove(
    const std::string& engine) {
  absl::MutexLock lock(&mu_);
  auto it = owners_.find(engine);
  if (it == owners_.end()) return std::nullopt;
  Owner owner = std::move(it->second);
  owners_.erase(it);
  return owner;
}

}  // namespace weightsync
