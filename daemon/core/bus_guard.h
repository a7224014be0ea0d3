// Access to memory a peer shared with the daemon that survives the peer.
// A peer can shrink the object behind a mapping (ftruncate) at any time;
// touching a page past its new end raises SIGBUS, whose default action
// kills the daemon. As Wayland compositors do for wl_shm pools, the daemon
// arms a per-thread window around each access to a peer's region: a SIGBUS
// inside the window maps anonymous memory over the whole region (MAP_FIXED)
// and marks it faulted, and the access runs on to its end over zeros that
// reach nobody. The caller then fails that engine's part: the region stays
// faulted, and every later access is refused at once. A SIGBUS outside any
// window goes to the previous handler (or the default action), as before.
// (docs/reliability.md, "Peer memory".)
#ifndef WEIGHTSYNC_DAEMON_CORE_BUS_GUARD_H_
#define WEIGHTSYNC_DAEMON_CORE_BUS_GUARD_H_

#include "absl/functional/function_ref.h"
#include "daemon/core/memory.h"

namespace weightsync {

// Runs `access`, which touches no memory of `region` outside [data(),
// data() + size()), with the window armed on this thread. Returns false,
// without running `access`, if the region is already faulted, and false
// if it faulted during `access`. `access` must not allocate, lock or
// recurse into GuardedAccess. Any thread; one window per thread at a time.
bool GuardedAccess(const MappedRegion& region,
                   absl::FunctionRef<void()> access);

// The same with two regions armed at once (a copy from one into the
// other): false if either is faulted before or during `access` (check each
// region's faulted() to tell which).
bool GuardedAccess(const MappedRegion& a, const MappedRegion& b,
                   absl::FunctionRef<void()> access);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_BUS_GUARD_H_
