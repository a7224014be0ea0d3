// Removes the shared-memory objects of engines that died (issue 6): a
// killed engine process can't unlink its /dev/shm object, and nobody else
// would; the daemon knows who registered which object. When an engine's
// control stream closes, UnlinkWhenGone watches its process; once the
// process is gone, each object it registered is unlinked if it is still
// there and still owned by the engine's uid. A process that stays alive
// (it closed its stream on purpose) keeps its objects. The daemon's own
// mapping stays valid until the engine is removed (the kernel frees the
// memory then).
#ifndef WEIGHTSYNC_DAEMON_SERVER_SHM_REAPER_H_
#define WEIGHTSYNC_DAEMON_SERVER_SHM_REAPER_H_

#include <signal.h>
#include <sys/types.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace weightsync {

// Whether process `pid` is gone: no such process (ESRCH), or a zombie
// (dead, not yet reaped by its parent). A process this one may not signal
// (EPERM: another user's) is alive. `signal` is kill(2); a test passes
// another.
bool ProcessGone(pid_t pid, int (*signal)(pid_t, int) = ::kill);
// The state letter of a /proc/<pid>/stat line ("pid (comm) S ...": the
// letter after the last ')'; comm may hold ')' and spaces), or '\0' when
// the line has none.
char ProcStatState(const std::string& line);
// Whether a /proc state letter is a dead process: 'Z' (a zombie) or 'X'
// (dead, being removed).
bool DeadProcessState(char state);

class ShmReaper {
 public:
  // How long a process is watched after its stream closed.
  explicit ShmReaper(absl::Duration patience = absl::Seconds(30));
  ~ShmReaper();  // stops watching; unlinks nothing more

  // `names`: the objects (as registered, "/name") `pid` of `uid`
  // registered.
  void UnlinkWhenGone(pid_t pid, uid_t uid, std::vector<std::string> names);
  // Objects unlinked so far (tests, logs).
  int unlinked() const;

 private:
  struct Watch {
    pid_t pid;
    uid_t uid;
    std::vector<std::string> names;
    absl::Time until;
  };
  void Run();

  const absl::Duration patience_;
  mutable absl::Mutex mu_;
  std::vector<Watch> watches_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int unlinked_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_SHM_REAPER_H_
