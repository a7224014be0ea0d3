// Expensive reads that must not slow updates: whole-engine reads
// (CheckEngine) run on a thread of their own at SCHED_IDLE, the lowest CPU
// priority, so that they use only CPU time nothing else wants. An update
// (the trainer's stream, the copies into engine memory) then runs as if
// the reads were not there; the reads take longer when the CPUs are busy.
// Their number is bounded by --max_engine_reads (call_limits.h).
#ifndef WEIGHTSYNC_DAEMON_SERVER_IDLE_PRIORITY_H_
#define WEIGHTSYNC_DAEMON_SERVER_IDLE_PRIORITY_H_

#include <functional>

namespace weightsync {

// Runs `fn` on a new thread at SCHED_IDLE (where the kernel allows it; at
// normal priority otherwise) and returns when it has. The calling thread
// waits without using the CPU.
void RunAtIdlePriority(const std::function<void()>& fn);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_IDLE_PRIORITY_H_
