#include "daemon/core/bus_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace weightsync {
namespace {

struct Window {
  uintptr_t begin = 0, end = 0;  // whole pages
  std::atomic<bool>* faulted = nullptr;
};

// This thread's armed windows (one or two), or null. Written only by its
// own thread; the handler runs on the faulting thread, so it reads the same
// variable.
struct Armed {
  Window w[2];
  int n = 0;
};
thread_local Armed* t_armed = nullptr;

struct sigaction g_previous;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const Armed* armed = t_armed;
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  const Window* w = nullptr;
  if (armed != nullptr) {
    // Both windows, armed or not: an unarmed one is [0, 0), holding no
    // address (so no count to read, or misread, here).
    for (const Window& win : armed->w) {
      if (addr >= win.begin && addr < win.end) w = &win;
    }
  }
  if (w != nullptr) {
    // mmap is not on POSIX's async-signal-safe list but is a plain system
    // call on Linux; the faulting instruction restarts on the new pages.
    void* p = mmap(reinterpret_cast<void*>(w->begin), w->end - w->begin,
                   PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (p != MAP_FAILED) {
      w->faulted->store(true, std::memory_order_release);
      return;
    }
  }
  // Not a peer's memory: what would have happened without the guard.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 &&
      g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  signal(SIGBUS, SIG_DFL);  // the access faults again and kills the process
}

void InstallHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa = {};
    sa.sa_sigaction = OnSigbus;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigaction(SIGBUS, &sa, &g_previous);
  });
}

Window WindowOf(const MappedRegion& region) {
  static const uintptr_t page = sysconf(_SC_PAGESIZE);
  const auto begin = reinterpret_cast<uintptr_t>(region.data());
  const uintptr_t end =
      begin +
      ((static_cast<uintptr_t>(region.size()) + page - 1) & ~(page - 1));
  return Window{begin & ~(page - 1), end, region.faulted_flag()};
}

bool Run(Armed& armed, absl::FunctionRef<void()> access) {
  for (int i = 0; i < armed.n; ++i) {
    if (armed.w[i].faulted->load(std::memory_order_acquire)) return false;
  }
  InstallHandler();
  t_armed = &armed;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  access();
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_armed = nullptr;
  for (int i = 0; i < armed.n; ++i) {
    if (armed.w[i].faulted->load(std::memory_order_acquire)) return false;
  }
  return true;
}

}  // namespace

bool GuardedAccess(const MappedRegion& region,
                   absl::FunctionRef<void()> access) {
  Armed armed;
  armed.w[0] = WindowOf(region);
  armed.n = 1;
  return Run(armed, access);
}

bool GuardedAccess(const MappedRegion& a, const MappedRegion& b,
                   absl::FunctionRef<void()> access) {
  Armed armed;
  armed.w[0] = WindowOf(a);
  armed.w[1] = WindowOf(b);
  armed.n = 2;
  return Run(armed, access);
}

}  // namespace weightsync
