// Where does the colocated IPC path lose against a plain on-GPU copy? One
// GPU, two processes: the parent (like a trainer and an engine) allocates a
// source and a destination of the model's bytes with cudaMalloc and exports
// both by cudaIpcGetMemHandle; the child (like the daemon's worker) opens
// them and times, with CUDA events on one stream, median of --repeats after
// a warm-up:
//
//   local_1      its own two buffers, one cudaMemcpyAsync (the baseline)
//   local_each   its own buffers, one cudaMemcpyAsync per tensor
//   ipc_1        IPC source -> IPC destination, one cudaMemcpyAsync
//   ipc_each     IPC -> IPC, one cudaMemcpyAsync per tensor (what the
//                daemon does for a plain layout)
//   ipc_each_2s  the same spread over two streams
//   src_ipc      IPC source -> local destination, one copy
//   dst_ipc      local source -> IPC destination, one copy
//   vmm_1        memory the parent made with cuMemCreate and exported as
//                POSIX fds (taken by pidfd_getfd), imported and mapped by
//                the child: source -> destination, one copy
//   vmm_each     the same, one copy per tensor
//
// bash bench/run_ipc_probe.sh runs it; bytes are counted once.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "gflags/gflags.h"
#include "tools/synthetic/synthetic_model.h"

#if WEIGHTSYNC_HAS_CUDA
#include <cuda_runtime.h>

#include "backends/cuda/vmm.h"
#endif

DEFINE_int32(device, 0, "CUDA device ordinal");
DEFINE_string(model, "qwen3-8b", "synthetic model shapes");
DEFINE_int32(repeats, 5, "timed runs per figure (after one warm-up)");
DEFINE_bool(local, true, "also time the child's own buffers (needs 4x bytes)");

#if WEIGHTSYNC_HAS_CUDA
namespace {

#define CHECK_CUDA(x)                                                \
  do {                                                               \
    cudaError_t e_ = (x);                                            \
    if (e_ != cudaSuccess) {                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, \
                   cudaGetErrorString(e_));                          \
      std::fflush(stderr);                                           \
      _exit(1);                                                      \
    }                                                                \
  } while (0)

struct Handles {
  cudaIpcMemHandle_t src, dst;
  pid_t pid;             // the parent, for pidfd_getfd
  int vmm_src, vmm_dst;  // the parent's fds of its VMM buffers
  size_t vmm_size;
};

template <typename F>
double MedianSeconds(cudaStream_t s, F&& body) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = 0; r <= FLAGS_repeats; ++r) {
    CHECK_CUDA(cudaEventRecord(a, s));
    body();
    CHECK_CUDA(cudaEventRecord(b, s));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (r > 0) t.push_back(ms / 1e3);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int Child(int fd, const std::vector<int64_t>& sizes, int64_t total) {
  Handles h;
  if (read(fd, &h, sizeof(h)) != sizeof(h)) return 1;
  CHECK_CUDA(cudaSetDevice(FLAGS_device));
  void *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaIpcOpenMemHandle(&src, h.src, cudaIpcMemLazyEnablePeerAccess));
  CHECK_CUDA(cudaIpcOpenMemHandle(&dst, h.dst, cudaIpcMemLazyEnablePeerAccess));
  cudaStream_t s, s2;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CHECK_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CHECK_CUDA(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  auto one = [&](void* d, const void* from) {
    return [=] {
      CHECK_CUDA(cudaMemcpyAsync(d, from, total, cudaMemcpyDefault, s));
    };
  };
  auto each = [&](void* d, const void* from, bool two_streams) {
    return [=, &fork, &join] {
      if (two_streams) {
        CHECK_CUDA(cudaEventRecord(fork, s));
        CHECK_CUDA(cudaStreamWaitEvent(s2, fork, 0));
      }
      int64_t off = 0;
      for (size_t i = 0; i < sizes.size(); ++i) {
        cudaStream_t on = two_streams && (i % 2) ? s2 : s;
        CHECK_CUDA(cudaMemcpyAsync(static_cast<char*>(d) + off,
                                   static_cast<const char*>(from) + off,
                                   sizes[i], cudaMemcpyDefault, on));
        off += sizes[i];
      }
      if (two_streams) {
        CHECK_CUDA(cudaEventRecord(join, s2));
        CHECK_CUDA(cudaStreamWaitEvent(s, join, 0));
      }
    };
  };
  auto report = [&](const char* name, double sec) {
    std::printf("%-12s %8.2f ms %8.1f GB/s\n", name, sec * 1e3,
                total / sec / 1e9);
    std::fflush(stdout);
  };
  report("ipc_1", MedianSeconds(s, one(dst, src)));
  report("ipc_each", MedianSeconds(s, each(dst, src, false)));
  report("ipc_each_2s", MedianSeconds(s, each(dst, src, true)));
  if (FLAGS_local) {
    void *a = nullptr, *b = nullptr;
    CHECK_CUDA(cudaMalloc(&a, total));
    CHECK_CUDA(cudaMalloc(&b, total));
    CHECK_CUDA(cudaMemset(a, 1, total));
    report("local_1", MedianSeconds(s, one(b, a)));
    report("local_each", MedianSeconds(s, each(b, a, false)));
    report("src_ipc", MedianSeconds(s, one(b, src)));
    report("dst_ipc", MedianSeconds(s, one(dst, a)));
    CHECK_CUDA(cudaFree(a));
    CHECK_CUDA(cudaFree(b));
  }
  namespace wc = weightsync::cuda;
  wc::VmmMemory vs, vd;
  for (auto [fd, m] : {std::pair{h.vmm_src, &vs}, std::pair{h.vmm_dst, &vd}}) {
    absl::StatusOr<int> mine = wc::DuplicatePeerFd(h.pid, fd);
    if (!mine.ok()) {
      std::printf("vmm: %s\n", mine.status().ToString().c_str());
      return 1;
    }
    absl::StatusOr<wc::VmmMemory> im =
        wc::VmmImport(*mine, h.vmm_size, FLAGS_device);
    close(*mine);
    if (!im.ok()) {
      std::printf("vmm: %s\n", im.status().ToString().c_str());
      return 1;
    }
    *m = *im;
  }
  report("vmm_1", MedianSeconds(s, one(vd.ptr, vs.ptr)));
  report("vmm_each", MedianSeconds(s, each(vd.ptr, vs.ptr, false)));
  return 0;
}

}  // namespace
#endif

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
#if WEIGHTSYNC_HAS_CUDA
  auto model = weightsync::synthetic::ModelByName(FLAGS_model);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 2;
  }
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (const auto& t :
       weightsync::synthetic::Checkpoint(*model, weightsync::v1::BFLOAT16)) {
    int64_t n = weightsync::ElementSize(t.dtype());
    for (int64_t d : t.shape()) n *= d;
    sizes.push_back(n);
    total += n;
  }
  std::printf("%s: %zu tensors, %.2f GB\n", FLAGS_model.c_str(), sizes.size(),
              total / 1e9);
  int fds[2];
  if (pipe(fds) != 0) return 1;
  const pid_t pid = fork();  // before any CUDA call
  if (pid == 0) {
    close(fds[1]);
    _exit(Child(fds[0], sizes, total));
  }
  close(fds[0]);
  CHECK_CUDA(cudaSetDevice(FLAGS_device));
  Handles h;
  void *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaMalloc(&src, total));
  CHECK_CUDA(cudaMalloc(&dst, total));
  CHECK_CUDA(cudaMemset(src, 7, total));
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaIpcGetMemHandle(&h.src, src));
  CHECK_CUDA(cudaIpcGetMemHandle(&h.dst, dst));
  namespace wc = weightsync::cuda;
  absl::StatusOr<wc::VmmMemory> vs =
      wc::VmmAllocateExportable(FLAGS_device, total);
  absl::StatusOr<wc::VmmMemory> vd =
      wc::VmmAllocateExportable(FLAGS_device, total);
  if (!vs.ok() || !vd.ok()) {
    std::fprintf(stderr, "vmm: %s %s\n", vs.status().ToString().c_str(),
                 vd.status().ToString().c_str());
    return 1;
  }
  CHECK_CUDA(cudaMemset(vs->ptr, 7, total));
  CHECK_CUDA(cudaDeviceSynchronize());
  h.pid = getpid();
  h.vmm_src = vs->fd;
  h.vmm_dst = vd->fd;
  h.vmm_size = vs->size;
  if (write(fds[1], &h, sizeof(h)) != sizeof(h)) return 1;
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
#else
  std::fprintf(stderr, "built without CUDA\n");
  return 2;
#endif
}
