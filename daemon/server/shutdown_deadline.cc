#include "daemon/server/shutdown_deadline.h"

#include <utility>

namespace weightsync {

ShutdownDeadline::ShutdownDeadline(absl::Duration limit,
                                   std::function<void()> expire) {
  const absl::Time deadline = absl::Now() + limit;
  thread_ = std::thread([this, deadline, expire = std::move(expire)] {
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithDeadline(absl::Condition(&done_), deadline)) return;
    expire();
  });
}

ShutdownDeadline::~ShutdownDeadline() {
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
  }
  thread_.join();
}

}  // namespace weightsync
