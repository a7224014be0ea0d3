#include "daemon/server/shm_reaper.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/core/event_log.h"
#include "glog/logging.h"

namespace weightsync {

char ProcStatState(const std::string& line) {
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() ? line[paren + 2]
                                                               : '\0';
}

bool DeadProcessState(char state) { return state == 'Z' || state == 'X'; }

bool ProcessGone(pid_t pid, int (*signal)(pid_t, int)) {
  if (signal(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return false;
  return DeadProcessState(ProcStatState(line));
}

namespace {

// Unlinks `name` if it exists and `uid` owns it.
bool UnlinkIfOwned(const std::string& name, uid_t uid) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;  // already gone
  struct stat st;
  const bool owned = fstat(fd, &st) == 0 && st.st_uid == uid;
  close(fd);
  return owned && shm_unlink(name.c_str()) == 0;
}

}  // namespace

ShmReaper::ShmReaper(absl::Duration patience)
    : patience_(patience), thread_([this] { Run(); }) {}

ShmReaper::~ShmReaper() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void ShmReaper::UnlinkWhenGone(pid_t pid, uid_t uid,
                               std::vector<std::string> names) {
  if (pid <= 0 || names.empty()) return;
  absl::MutexLock lock(&mu_);
  watches_.push_back({pid, uid, std::move(names), absl::Now() + patience_});
}

int ShmReaper::unlinked() const {
  absl::MutexLock lock(&mu_);
  return unlinked_;
}

void ShmReaper::Run() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(100));
    const absl::Time now = absl::Now();
    for (auto it = watches_.begin(); it != watches_.end();) {
      if (ProcessGone(it->pid)) {
        std::vector<std::string> removed;
        for (const std::string& name : it->names) {
          if (UnlinkIfOwned(name, it->uid)) removed.push_back(name);
        }
        unlinked_ += removed.size();
        if (!removed.empty()) {
          LOG(INFO) << Event("engine.shm_removed") << "process " << it->pid
                    << " is gone: removed its shared memory "
                    << absl::StrJoin(removed, ", ");
        }
        it = watches_.erase(it);
      } else if (now >= it->until) {
        it = watches_.erase(it);  // alive: it closed its stream on purpose
      } else {
        ++it;
      }
    }
  }
}

}  // namespace weightsync
