// Baselines for the GPU benchmark, measured on the same machine and in the
// same run as weightsync: two processes (rank 0 = trainer on one GPU, rank 1 =
// engine on another), NCCL C API directly, no torch.
//
//   raw_1g / raw_256m / raw_16m: the manifest's total bytes broadcast from a
//       flat buffer on rank 0 into a flat buffer on rank 1 as a sequence of
//       messages of that size (last one smaller). raw_1g is the ceiling.
//   naive: what hand-rolled RL code does: per parameter, a broadcast into a
//       temporary buffer, then a device-to-device copy into the engine's own
//       tensor (one cudaMalloc per parameter), all on one stream.
//   ondevice_copy: rank 1 alone, a plain on-GPU copy of the total bytes in
//       1 GiB pieces from one flat buffer to another.
//
// Each figure is the median of --repeats timed runs after one warm-up, timed
// with CUDA events on the rank's stream, starting right after a two-rank
// barrier (wall-clock figures are reported too). The ncclUniqueId travels
// through --id_file: rank 0 writes it (atomically, by rename), rank 1 polls.
// Every wait is bounded (watchdog per phase plus bounded stream polling); on
// any error the process prints it and calls _exit(1); at the end _exit(0)
// without tearing NCCL down unless --destroy. Started by
// bench/run_nccl_baseline.sh.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "gflags/gflags.h"
#include "tools/synthetic/synthetic_model.h"

#if WEIGHTSYNC_HAS_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#endif

DEFINE_int32(rank, -1, "0 = trainer (broadcast root), 1 = engine");
DEFINE_int32(device, -1, "CUDA device ordinal (default: same as --rank)");
DEFINE_string(id_file, "", "path through which the ncclUniqueId travels");
DEFINE_string(model, "qwen3-8b", "synthetic model shapes (qwen3-8b, ...)");
DEFINE_int32(repeats, 5, "timed runs per figure (after one warm-up)");
DEFINE_string(json, "", "write results here");
DEFINE_int32(id_timeout_s, 120, "how long rank 1 waits for the id file");
DEFINE_int32(phase_timeout_s, 120, "watchdog limit for each phase");
DEFINE_bool(destroy, false, "call ncclCommDestroy before exiting");
DEFINE_bool(verify, true, "check bytes at message/tensor edges afterwards");
DEFINE_bool(print_manifest, false,
            "print the manifest totals and exit "
            "(no GPU needed)");

namespace weightsync {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

[[noreturn]] void Die(const std::string& msg) {
  std::fprintf(stderr, "nccl_baseline rank %d: FATAL: %s\n", FLAGS_rank,
               msg.c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(1);
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Manifest {
  std::vector<std::string> names;
  std::vector<int64_t> bytes;  // per tensor
  int64_t total = 0;
  int64_t max_tensor = 0;
};

Manifest LoadManifest(const std::string& model_name) {
  auto model = synthetic::ModelByName(model_name);
  if (!model.ok()) Die(std::string(model.status().message()));
  Manifest m;
  for (const auto& spec : synthetic::Checkpoint(*model, v1::BFLOAT16)) {
    int64_t n = ElementSize(spec.dtype());
    for (int64_t d : spec.shape()) n *= d;
    if (n <= 0) Die("tensor " + spec.name() + " has no bytes");
    m.names.push_back(spec.name());
    m.bytes.push_back(n);
    m.total += n;
    m.max_tensor = std::max(m.max_tensor, n);
  }
  return m;
}

#if WEIGHTSYNC_HAS_CUDA

// ---- Watchdog: one deadline for the current phase; past it, _exit(1). ----

std::atomic<int64_t> g_deadline_ns{0};  // 0 = disarmed
std::atomic<const char*> g_phase{"start"};

void Arm(const char* phase, int seconds) {
  g_phase.store(phase);
  g_deadline_ns.store(NowNs() + int64_t{seconds} * 1000000000);
}

void StartWatchdog() {
  std::thread([] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const int64_t d = g_deadline_ns.load();
      if (d != 0 && NowNs() > d) {
        std::fprintf(stderr,
                     "nccl_baseline rank %d: FATAL: watchdog: phase '%s' "
                     "exceeded %d s\n",
                     FLAGS_rank, g_phase.load(), FLAGS_phase_timeout_s);
        std::fflush(stdout);
        std::fflush(stderr);
        _exit(1);
      }
    }
  }).detach();
}

#define CUDA_CHECK(expr)                                                \
  do {                                                                  \
    cudaError_t e_ = (expr);                                            \
    if (e_ != cudaSuccess) {                                            \
      Die(std::string(__FILE__ ":") + std::to_string(__LINE__) + ": " + \
          #expr + ": " + cudaGetErrorName(e_) + ": " +                  \
          cudaGetErrorString(e_));                                      \
    }                                                                   \
  } while (0)

#define NCCL_CHECK(expr)                                                \
  do {                                                                  \
    ncclResult_t r_ = (expr);                                           \
    if (r_ != ncclSuccess) {                                            \
      const char* last_ = ncclGetLastError(nullptr);                    \
      Die(std::string(__FILE__ ":") + std::to_string(__LINE__) + ": " + \
          #expr + ": " + ncclGetErrorString(r_) +                       \
          (last_ && *last_ ? std::string(" (") + last_ + ")" : ""));    \
    }                                                                   \
  } while (0)

struct Ctx {
  int rank = -1;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  float* sync_buf = nullptr;  // 1 float, for the barrier
};

// Polls `c.stream` until idle, failing on a CUDA error, an asynchronous NCCL
// error or the phase deadline.
void WaitStream(const Ctx& c, const char* what) {
  const int64_t deadline = g_deadline_ns.load();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(c.stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      Die(std::string(what) + ": stream: " + cudaGetErrorName(e) + ": " +
          cudaGetErrorString(e));
    }
    if (c.comm != nullptr) {
      ncclResult_t async = ncclSuccess;
      NCCL_CHECK(ncclCommGetAsyncError(c.comm, &async));
      if (async != ncclSuccess && async != ncclInProgress) {
        Die(std::string(what) + ": NCCL async error: " +
            ncclGetErrorString(async) + " (" + ncclGetLastError(c.comm) + ")");
      }
    }
    if (deadline != 0 && NowNs() > deadline) {
      Die(std::string(what) + ": timed out waiting for the stream");
    }
    std::this_thread::yield();
  }
}

// Both ranks: a one-float all-reduce, waited for on the host.
void Barrier(const Ctx& c, const char* what) {
  NCCL_CHECK(ncclAllReduce(c.sync_buf, c.sync_buf, 1, ncclFloat, ncclSum,
                           c.comm, c.stream));
  WaitStream(c, what);
}

struct Sample {
  double gpu_s = 0, wall_s = 0;
};

// One timed run: barrier (if `two_ranks`), start event, `enqueue`, end
// event, bounded wait.
template <typename F>
Sample TimedOnce(const Ctx& c, const char* what, bool two_ranks, F enqueue) {
  if (two_ranks) Barrier(c, what);
  const int64_t t0 = NowNs();
  CUDA_CHECK(cudaEventRecord(c.ev0, c.stream));
  enqueue();
  CUDA_CHECK(cudaEventRecord(c.ev1, c.stream));
  WaitStream(c, what);
  const int64_t t1 = NowNs();
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, c.ev0, c.ev1));
  return Sample{ms / 1e3, (t1 - t0) / 1e9};
}

struct Figure {
  std::string key;    // JSON prefix, e.g. "raw_1g"
  std::string label;  // table row
  int64_t bytes = 0;
  double gpu_s = 0, wall_s = 0;  // medians
  std::vector<double> gpu_samples;
  double GBps() const { return gpu_s > 0 ? bytes / gpu_s / 1e9 : 0; }
};

template <typename F>
Figure Measure(const Ctx& c, const char* key, const char* label, int64_t bytes,
               bool two_ranks, F enqueue) {
  Arm(key, FLAGS_phase_timeout_s);
  std::fprintf(stderr, "rank %d: %s ...\n", c.rank, key);
  TimedOnce(c, key, two_ranks, enqueue);  // warm-up
  Figure f;
  f.key = key;
  f.label = label;
  f.bytes = bytes;
  std::vector<double> wall;
  for (int i = 0; i < FLAGS_repeats; ++i) {
    const Sample s = TimedOnce(c, key, two_ranks, enqueue);
    f.gpu_samples.push_back(s.gpu_s);
    wall.push_back(s.wall_s);
  }
  f.gpu_s = Median(f.gpu_samples);
  f.wall_s = Median(wall);
  return f;
}

// Reads one byte at each of `ptrs` (device) and compares with `want`.
void CheckBytes(const Ctx& c, const char* what,
                const std::vector<const uint8_t*>& ptrs,
                const std::vector<uint8_t>& want) {
  if (ptrs.empty()) return;
  uint8_t* host = nullptr;
  CUDA_CHECK(cudaMallocHost(&host, ptrs.size()));
  std::memset(host, 0, ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) {
    CUDA_CHECK(cudaMemcpyAsync(host + i, ptrs[i], 1, cudaMemcpyDeviceToHost,
                               c.stream));
  }
  WaitStream(c, what);
  for (size_t i = 0; i < ptrs.size(); ++i) {
    if (host[i] != want[i]) {
      char buf[160];
      std::snprintf(buf, sizeof(buf),
                    "%s: verification failed at check %zu of %zu: byte 0x%02x,"
                    " want 0x%02x",
                    what, i, ptrs.size(), host[i], want[i]);
      Die(buf);
    }
  }
  CUDA_CHECK(cudaFreeHost(host));
}

constexpr uint8_t kFlatByte = 0xA5;
uint8_t ParamByte(size_t i) { return static_cast<uint8_t>(i * 37 + 1); }

// Edge bytes of each `piece`-sized message of a flat buffer.
void CheckFlat(const Ctx& c, const char* what, const uint8_t* buf,
               int64_t total, int64_t piece, uint8_t want) {
  std::vector<const uint8_t*> ptrs;
  for (int64_t off = 0; off < total; off += piece) {
    const int64_t n = std::min(piece, total - off);
    ptrs.push_back(buf + off);
    ptrs.push_back(buf + off + n - 1);
  }
  CheckBytes(c, what, ptrs, std::vector<uint8_t>(ptrs.size(), want));
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "(unset)";
}

void WriteIdFile(const ncclUniqueId& id, const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) == 0) {
    Die("id file " + path +
        " already exists (stale from an earlier run?); "
        "remove it first");
  }
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) Die("open " + tmp + ": " + std::strerror(errno));
  if (write(fd, &id, sizeof(id)) != static_cast<ssize_t>(sizeof(id))) {
    Die("write " + tmp + ": " + std::strerror(errno));
  }
  if (fsync(fd) != 0) Die("fsync " + tmp + ": " + std::strerror(errno));
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    Die("rename " + tmp + " -> " + path + ": " + std::strerror(errno));
  }
}

ncclUniqueId ReadIdFile(const std::string& path, int timeout_s) {
  const int64_t deadline = NowNs() + int64_t{timeout_s} * 1000000000;
  for (;;) {
    const int fd = open(path.c_str(), O_RDONLY);
    if (fd >= 0) {
      ncclUniqueId id;
      const ssize_t n = read(fd, &id, sizeof(id));
      close(fd);
      // The file appears by rename, so it is complete when it exists.
      if (n != static_cast<ssize_t>(sizeof(id))) {
        Die("id file " + path + " has " + std::to_string(n) + " bytes, want " +
            std::to_string(sizeof(id)));
      }
      return id;
    }
    if (errno != ENOENT) Die("open " + path + ": " + std::strerror(errno));
    if (NowNs() > deadline) {
      Die("no id file " + path + " after " + std::to_string(timeout_s) + " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int Run(const Manifest& m) {
  const int rank = FLAGS_rank;
  const int device = FLAGS_device >= 0 ? FLAGS_device : rank;
  Ctx c;
  c.rank = rank;
  StartWatchdog();
  Arm("setup", FLAGS_phase_timeout_s);

  if (std::getenv("NCCL_NVLS_ENABLE") == nullptr) {
    setenv("NCCL_NVLS_ENABLE", "0", 0);  // keep NVLS off (DEVICE.md)
  } else if (std::string(std::getenv("NCCL_NVLS_ENABLE")) != "0") {
    std::fprintf(stderr, "rank %d: WARNING: NCCL_NVLS_ENABLE=%s, expected 0\n",
                 rank, std::getenv("NCCL_NVLS_ENABLE"));
  }

  CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  int nccl_version = 0;
  NCCL_CHECK(ncclGetVersion(&nccl_version));
  std::fprintf(stderr,
               "rank %d: device %d (%s), %.1f of %.1f GB free, NCCL %d, "
               "NCCL_NVLS_ENABLE=%s\n",
               rank, device, prop.name, free_b / 1e9, total_b / 1e9,
               nccl_version, Env("NCCL_NVLS_ENABLE").c_str());

  CUDA_CHECK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreate(&c.ev0));
  CUDA_CHECK(cudaEventCreate(&c.ev1));
  CUDA_CHECK(cudaMalloc(&c.sync_buf, sizeof(float)));
  CUDA_CHECK(cudaMemset(c.sync_buf, 0, sizeof(float)));

  // Buffers. Rank 0: the flat source and the trainer's per-parameter
  // tensors. Rank 1: the flat destination, the engine's per-parameter
  // tensors, the temporary receive buffer, and the on-GPU copy target.
  const size_t n = m.bytes.size();
  uint8_t* flat = nullptr;
  CUDA_CHECK(cudaMalloc(&flat, m.total));
  std::vector<uint8_t*> params(n, nullptr);
  for (size_t i = 0; i < n; ++i) CUDA_CHECK(cudaMalloc(&params[i], m.bytes[i]));
  uint8_t* temp = nullptr;
  uint8_t* copy_dst = nullptr;
  if (rank == 0) {
    CUDA_CHECK(cudaMemset(flat, kFlatByte, m.total));
    for (size_t i = 0; i < n; ++i) {
      CUDA_CHECK(cudaMemset(params[i], ParamByte(i), m.bytes[i]));
    }
  } else {
    CUDA_CHECK(cudaMalloc(&temp, m.max_tensor));
    CUDA_CHECK(cudaMalloc(&copy_dst, m.total));
    CUDA_CHECK(cudaMemset(flat, 0, m.total));
    for (size_t i = 0; i < n; ++i) {
      CUDA_CHECK(cudaMemset(params[i], 0, m.bytes[i]));
    }
  }
  CUDA_CHECK(cudaDeviceSynchronize());

  // Communicator.
  Arm("nccl_init", FLAGS_phase_timeout_s);
  ncclUniqueId id;
  if (rank == 0) {
    NCCL_CHECK(ncclGetUniqueId(&id));
    WriteIdFile(id, FLAGS_id_file);
  } else {
    Arm("id_file", FLAGS_id_timeout_s + 5);
    id = ReadIdFile(FLAGS_id_file, FLAGS_id_timeout_s);
    Arm("nccl_init", FLAGS_phase_timeout_s);
  }
  NCCL_CHECK(ncclCommInitRank(&c.comm, 2, id, rank));

  // Both ranks must run the same sequence of collectives: compare settings.
  {
    Arm("handshake", FLAGS_phase_timeout_s);
    // Pinned host memory, so that no copy blocks the host unboundedly.
    int64_t* mine = nullptr;
    int64_t* root = nullptr;
    CUDA_CHECK(cudaMallocHost(&mine, 3 * sizeof(int64_t)));
    CUDA_CHECK(cudaMallocHost(&root, 3 * sizeof(int64_t)));
    mine[0] = m.total;
    mine[1] = static_cast<int64_t>(n);
    mine[2] = FLAGS_repeats;
    root[0] = root[1] = root[2] = 0;
    int64_t* dev = nullptr;
    CUDA_CHECK(cudaMalloc(&dev, 3 * sizeof(int64_t)));
    CUDA_CHECK(cudaMemcpyAsync(dev, mine, 3 * sizeof(int64_t),
                               cudaMemcpyHostToDevice, c.stream));
    NCCL_CHECK(ncclBroadcast(dev, dev, 3, ncclInt64, 0, c.comm, c.stream));
    CUDA_CHECK(cudaMemcpyAsync(root, dev, 3 * sizeof(int64_t),
                               cudaMemcpyDeviceToHost, c.stream));
    WaitStream(c, "handshake");
    if (std::memcmp(root, mine, 3 * sizeof(int64_t)) != 0) {
      Die("rank 0 has bytes=" + std::to_string(root[0]) + " tensors=" +
          std::to_string(root[1]) + " repeats=" + std::to_string(root[2]) +
          ", this rank bytes=" + std::to_string(mine[0]) +
          " tensors=" + std::to_string(mine[1]) +
          " repeats=" + std::to_string(mine[2]) + ": same flags needed");
    }
    CUDA_CHECK(cudaFree(dev));
    CUDA_CHECK(cudaFreeHost(mine));
    CUDA_CHECK(cudaFreeHost(root));
  }

  std::vector<Figure> figs;

  // 1 + 4. Raw flat broadcast at 1 GiB, 256 MiB and 16 MiB messages.
  struct RawCase {
    const char* key;
    const char* label;
    int64_t piece;
  };
  const RawCase raw_cases[] = {
      {"raw_1g", "raw broadcast, 1 GiB msgs", kGiB},
      {"raw_256m", "raw broadcast, 256 MiB msgs", 256 * kMiB},
      {"raw_16m", "raw broadcast, 16 MiB msgs", 16 * kMiB},
  };
  for (const RawCase& rc : raw_cases) {
    Arm(rc.key, FLAGS_phase_timeout_s);
    if (rank == 1 && FLAGS_verify) {
      CUDA_CHECK(cudaMemsetAsync(flat, 0, m.total, c.stream));
      WaitStream(c, rc.key);
    }
    figs.push_back(Measure(c, rc.key, rc.label, m.total, true, [&] {
      for (int64_t off = 0; off < m.total; off += rc.piece) {
        const size_t count = std::min(rc.piece, m.total - off);
        NCCL_CHECK(ncclBroadcast(flat + off, flat + off, count, ncclUint8, 0,
                                 c.comm, c.stream));
      }
    }));
    if (rank == 1 && FLAGS_verify) {
      CheckFlat(c, rc.key, flat, m.total, rc.piece, kFlatByte);
    }
  }

  // 2. Naive: per parameter, broadcast into a temporary, then copy into the
  // engine's tensor; one stream.
  figs.push_back(
      Measure(c, "naive", "naive per-param bcast + copy", m.total, true, [&] {
        for (size_t i = 0; i < n; ++i) {
          if (rank == 0) {
            NCCL_CHECK(ncclBroadcast(params[i], params[i], m.bytes[i],
                                     ncclUint8, 0, c.comm, c.stream));
          } else {
            NCCL_CHECK(ncclBroadcast(temp, temp, m.bytes[i], ncclUint8, 0,
                                     c.comm, c.stream));
            CUDA_CHECK(cudaMemcpyAsync(params[i], temp, m.bytes[i],
                                       cudaMemcpyDeviceToDevice, c.stream));
          }
        }
      }));
  if (rank == 1 && FLAGS_verify) {
    std::vector<const uint8_t*> ptrs;
    std::vector<uint8_t> want;
    for (size_t i = 0; i < n; ++i) {
      ptrs.push_back(params[i]);
      ptrs.push_back(params[i] + m.bytes[i] - 1);
      want.push_back(ParamByte(i));
      want.push_back(ParamByte(i));
    }
    CheckBytes(c, "naive", ptrs, want);
  }

  // 3. On-GPU copy on rank 1 alone (rank 0 waits in the final barrier).
  if (rank == 1) {
    Arm("ondevice_copy", FLAGS_phase_timeout_s);
    if (FLAGS_verify) {
      CUDA_CHECK(cudaMemsetAsync(copy_dst, 0, m.total, c.stream));
      WaitStream(c, "ondevice_copy");
    }
    figs.push_back(Measure(
        c, "ondevice_copy", "on-GPU copy, 1 GiB pieces", m.total, false, [&] {
          for (int64_t off = 0; off < m.total; off += kGiB) {
            CUDA_CHECK(cudaMemcpyAsync(copy_dst + off, flat + off,
                                       std::min(kGiB, m.total - off),
                                       cudaMemcpyDeviceToDevice, c.stream));
          }
        }));
    if (FLAGS_verify) {
      CheckFlat(c, "ondevice_copy", copy_dst, m.total, kGiB, kFlatByte);
    }
  }

  Arm("final_barrier", FLAGS_phase_timeout_s);
  Barrier(c, "final_barrier");

  // Report.
  auto find = [&](const char* key) -> const Figure* {
    for (const Figure& f : figs) {
      if (f.key == key) return &f;
    }
    return nullptr;
  };
  const Figure* raw1g = find("raw_1g");
  std::printf("=== nccl_baseline table ===\n");
  std::printf(
      "nccl_baseline rank %d (%s, device %d), model %s: %.3f GB in %zu bf16 "
      "tensors, NCCL %d, NCCL_NVLS_ENABLE=%s, median of %d (CUDA events)\n",
      rank, prop.name, device, FLAGS_model.c_str(), m.total / 1e9, n,
      nccl_version, Env("NCCL_NVLS_ENABLE").c_str(), FLAGS_repeats);
  std::printf("%-34s %10s %10s %10s %10s\n", "what", "ms", "GB/s", "vs raw_1g",
              "wall ms");
  for (const Figure& f : figs) {
    std::printf("%-34s %10.2f %10.1f %10.3f %10.2f\n", f.label.c_str(),
                f.gpu_s * 1e3, f.GBps(),
                raw1g && raw1g->GBps() > 0 ? f.GBps() / raw1g->GBps() : 0.0,
                f.wall_s * 1e3);
    if (f.key == "ondevice_copy") {
      std::printf("%-34s %10s %10.1f\n", "  (read + write counted, 2x)", "",
                  2 * f.GBps());
    }
  }
  std::printf("=== end ===\n");
  std::fflush(stdout);

  if (!FLAGS_json.empty()) {
    FILE* j = std::fopen(FLAGS_json.c_str(), "w");
    if (j == nullptr) Die("open " + FLAGS_json + ": " + std::strerror(errno));
    auto get = [&](const char* key) -> const Figure& {
      static const Figure kNone;
      const Figure* f = find(key);
      return f ? *f : kNone;
    };
    const Figure& naive = get("naive");
    const Figure& odc = get("ondevice_copy");
    std::fprintf(j, "{\n");
    std::fprintf(j, "  \"model\": \"%s\",\n", FLAGS_model.c_str());
    std::fprintf(j, "  \"bytes\": %lld,\n", static_cast<long long>(m.total));
    std::fprintf(j, "  \"tensors\": %zu,\n", n);
    std::fprintf(j, "  \"raw_1g_s\": %.6f,\n", get("raw_1g").gpu_s);
    std::fprintf(j, "  \"raw_1g_GBps\": %.2f,\n", get("raw_1g").GBps());
    std::fprintf(j, "  \"raw_16m_GBps\": %.2f,\n", get("raw_16m").GBps());
    std::fprintf(j, "  \"raw_256m_GBps\": %.2f,\n", get("raw_256m").GBps());
    std::fprintf(j, "  \"naive_s\": %.6f,\n", naive.gpu_s);
    std::fprintf(j, "  \"naive_GBps\": %.2f,\n", naive.GBps());
    std::fprintf(j, "  \"ondevice_copy_GBps\": %.2f,\n", odc.GBps());
    std::fprintf(j, "  \"ondevice_copy_rw_GBps\": %.2f,\n", 2 * odc.GBps());
    std::fprintf(
        j, "  \"naive_vs_raw_1g\": %.4f,\n",
        get("raw_1g").GBps() > 0 ? naive.GBps() / get("raw_1g").GBps() : 0.0);
    std::fprintf(j, "  \"rank\": %d,\n", rank);
    std::fprintf(j, "  \"device\": \"%s\",\n", prop.name);
    std::fprintf(j, "  \"nccl_version\": %d,\n", nccl_version);
    std::fprintf(j, "  \"repeats\": %d,\n", FLAGS_repeats);
    std::fprintf(j,
                 "  \"timing\": \"median of CUDA-event times on the "
                 "reporting rank's stream, after one warm-up\",\n");
    std::fprintf(j, "  \"wall_s\": {");
    for (size_t i = 0; i < figs.size(); ++i) {
      std::fprintf(j, "%s\"%s\": %.6f", i ? ", " : "", figs[i].key.c_str(),
                   figs[i].wall_s);
    }
    std::fprintf(j, "},\n  \"samples_s\": {");
    for (size_t i = 0; i < figs.size(); ++i) {
      std::fprintf(j, "%s\"%s\": [", i ? ", " : "", figs[i].key.c_str());
      for (size_t k = 0; k < figs[i].gpu_samples.size(); ++k) {
        std::fprintf(j, "%s%.6f", k ? ", " : "", figs[i].gpu_samples[k]);
      }
      std::fprintf(j, "]");
    }
    std::fprintf(j, "}\n}\n");
    if (std::fclose(j) != 0) Die("close " + FLAGS_json);
  }

  if (FLAGS_destroy) {
    Arm("destroy", FLAGS_phase_timeout_s);
    NCCL_CHECK(ncclCommDestroy(c.comm));
  }
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(0);
}

#endif  // WEIGHTSYNC_HAS_CUDA

int Main() {
  const Manifest m = LoadManifest(FLAGS_model);
  if (FLAGS_print_manifest) {
    std::printf("model %s: %zu tensors, %lld bytes (%.3f GB), largest %lld\n",
                FLAGS_model.c_str(), m.bytes.size(),
                static_cast<long long>(m.total), m.total / 1e9,
                static_cast<long long>(m.max_tensor));
    std::fflush(stdout);
    _exit(0);
  }
  if (FLAGS_rank != 0 && FLAGS_rank != 1) Die("--rank must be 0 or 1");
  if (FLAGS_id_file.empty()) Die("--id_file is required");
  if (FLAGS_repeats < 1) Die("--repeats must be >= 1");
#if WEIGHTSYNC_HAS_CUDA
  return Run(m);
#else
  Die("built without CUDA");
#endif
}

}  // namespace
}  // namespace weightsync

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "two-process NCCL baselines; see bench/run_nccl_baseline.sh");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  setvbuf(stdout, nullptr, _IOLBF, 0);
  weightsync::Main();
  _exit(1);
}
