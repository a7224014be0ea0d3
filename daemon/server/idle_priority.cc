#include "daemon/server/idle_priority.h"

#include <sched.h>

#include <thread>

namespace weightsync {

void RunAtIdlePriority(const std::function<void()>& fn) {
  std::thread t([&fn] {
    // A thread may lower itself to SCHED_IDLE without privileges; the
    // thread ends with the read, so nothing has to raise it again.
    sched_param p{};
    sched_setscheduler(0, SCHED_IDLE, &p);
    fn();
  });
  t.join();
}

}  // namespace weightsync
