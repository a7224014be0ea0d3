// weightsync_gpu_engine: a fake inference engine on a GPU. It lays out a
// synthetic model's parameters in one cudaMalloc allocation, registers it
// with weightsyncd by CUDA IPC handle and GPU UUID, and serves its control
// stream. With --verify, after each new version it copies its parameters
// back and compares them with the reference installer's answer for that
// version, printing "verified" or "MISMATCH". With --read_loop (issue 5's
// staged-mode proof) a thread keeps copying its parameters to the host while
// it is not paused, as a serving engine reads its weights, and checks that
// each snapshot equals the whole reference of one version (the last one
// seen or the next), never a mix; it prints the counts. --time_copy prints
// the time of one plain on-GPU copy of the parameters' bytes on its GPU.
// --hash prints, after each new version, a 64-bit FNV-1a hash of all its
// parameters' bytes (to compare two versions bit for bit: a sparse update
// and a dense update of the same weights). SIGUSR1 frees the parameters'
// memory (cudaFree, or the VMM unmap + release + close) and keeps the
// process and its control stream alive: an engine that frees under the
// daemon's import (tests/gpu/gpu_faults.py, engine_freed).
#include <cuda_runtime_api.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "backends/cuda/gpu_uuid.h"
#include "backends/cuda/vmm.h"
#include "client/engine_client.h"
#include "client/host_arena.h"
#include "common/dtype.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "tools/synthetic/synthetic_model.h"

DEFINE_string(target, "", "daemon address");
DEFINE_string(engine_id, "gpu-engine-0", "engine id");
DEFINE_string(model, "tiny", "synthetic model");
DEFINE_string(layout, "plain", "plain or tp");
DEFINE_int32(tp_rank, 0, "tensor-parallel rank");
DEFINE_int32(tp_size, 1, "tensor-parallel size");
DEFINE_string(dtype, "bfloat16", "parameter dtype");
DEFINE_string(ckpt_dtype, "float32", "dtype the trainer sends (for --verify)");
DEFINE_int32(device, 0, "CUDA ordinal");
DEFINE_bool(verify, true, "verify every new version against the reference");
DEFINE_bool(read_loop, false,
            "keep reading the parameters while serving and check every "
            "snapshot is one whole version");
DEFINE_bool(time_copy, false,
            "time a plain on-GPU copy of the parameters' bytes at start");
DEFINE_bool(hash, false,
            "print a hash of the parameters' bytes after each new version");
DEFINE_string(memory, "ipc",
              "how the parameters' memory is shared: ipc (cudaMalloc + "
              "cudaIpcGetMemHandle) or vmm (cuMemCreate + POSIX fd)");

namespace {
std::atomic<bool> g_stop{false};
std::atomic<bool> g_free{false};
void OnSignal(int) { g_stop = true; }
// SIGUSR1: free the parameters' memory and go on running (the GPU fault
// suite's engine_freed: an engine that frees under the daemon's import).
void OnFree(int) { g_free = true; }
}  // namespace

namespace weightsync {

v1::DType ParseDType(const std::string& s) {
  return s == "float32"   ? v1::FLOAT32
         : s == "float16" ? v1::FLOAT16
                          : v1::BFLOAT16;
}

// Compares device memory with the reference for `version`: mismatching
// parameters, or -1 on a CUDA error.
int64_t Verify(const synthetic::ModelConfig& model,
               const std::vector<v1::Parameter>& params, const uint8_t* base,
               int64_t version) {
  synthetic::CheckpointData data;
  for (const v1::TensorSpec& t :
       synthetic::Checkpoint(model, ParseDType(FLAGS_ckpt_dtype))) {
    data[t.name()] = {t, synthetic::Contents(t, version)};
  }
  int64_t bad = 0;
  std::vector<uint8_t> got;
  for (const v1::Parameter& p : params) {
    const std::vector<uint8_t> want = synthetic::ExpectedParameter(p, data);
    got.resize(want.size());
    if (cudaMemcpy(got.data(), base + p.offset(), want.size(),
                   cudaMemcpyDeviceToHost) != cudaSuccess) {
      return -1;
    }
    if (got != want) {
      if (bad < 3) LOG(ERROR) << "parameter " << p.name() << " differs";
      ++bad;
    }
  }
  return bad;
}

// FNV-1a 64 of the `bytes` bytes at device address `base` (0 on a CUDA
// error), over 8-byte words.
uint64_t HashDevice(const uint8_t* base, int64_t bytes) {
  std::vector<uint8_t> host(bytes);
  if (cudaMemcpy(host.data(), base, bytes, cudaMemcpyDeviceToHost) !=
      cudaSuccess) {
    return 0;
  }
  uint64_t h = 0xcbf29ce484222325ull;
  int64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, host.data() + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
  }
  for (; i < bytes; ++i) h = (h ^ host[i]) * 0x100000001b3ull;
  return h;
}

// The parameters' bytes at `version`, concatenated in `params` order
// (version 0: zeros, as registered).
std::vector<uint8_t> Image(const synthetic::ModelConfig& model,
                           const std::vector<v1::Parameter>& params,
                           int64_t version, int64_t bytes) {
  if (version == 0) return std::vector<uint8_t>(bytes, 0);
  synthetic::CheckpointData data;
  for (const v1::TensorSpec& t :
       synthetic::Checkpoint(model, ParseDType(FLAGS_ckpt_dtype))) {
    data[t.name()] = {t, synthetic::Contents(t, version)};
  }
  std::vector<uint8_t> out;
  out.reserve(bytes);
  for (const v1::Parameter& p : params) {
    const std::vector<uint8_t> want = synthetic::ExpectedParameter(p, data);
    out.insert(out.end(), want.begin(), want.end());
  }
  return out;
}

// The read loop: snapshots only while not paused (on_pause waits for the one
// in progress, as an engine finishes its step before acknowledging).
struct Reader {
  std::mutex serving;  // held for each snapshot
  std::atomic<bool> paused{false};
  std::atomic<bool> stop{false};
  std::atomic<int64_t> known{0};  // last version announced (on_new_version)
  std::mutex counts_mu;
  std::map<int64_t, int64_t> per_version;
  int64_t mixed = 0;

  std::string Summary() {
    std::lock_guard<std::mutex> lock(counts_mu);
    std::string s;
    for (const auto& [v, n] : per_version) {
      absl::StrAppend(&s, s.empty() ? "" : " ", "v", v, "=", n);
    }
    return absl::StrCat("snapshots ", s.empty() ? "none" : s, ", mixed ",
                        mixed);
  }
};

void ReadLoop(Reader* reader, const synthetic::ModelConfig& model,
              const std::vector<v1::Parameter>& params, const uint8_t* base,
              int device, const std::string& id) {
  cudaSetDevice(device);
  int64_t bytes = 0;
  std::vector<int64_t> sizes;
  for (const v1::Parameter& p : params) {
    int64_t n = ElementSize(p.dtype());
    for (int64_t d : p.shape()) n *= d;
    sizes.push_back(n);
    bytes += n;
  }
  uint8_t* host = nullptr;
  if (cudaMallocHost(reinterpret_cast<void**>(&host), bytes) != cudaSuccess) {
    std::printf("[%s] read_loop: no pinned memory\n", id.c_str());
    return;
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  std::map<int64_t, std::vector<uint8_t>> images;
  while (!reader->stop) {
    // Unpaused, memory holds the last announced version (the new-version
    // notice comes before the resume), or the next one where a commit
    // raced the notice: anything else is a mix.
    const int64_t k0 = reader->known.load();
    {
      std::unique_lock<std::mutex> lock(reader->serving);
      if (reader->paused) {
        lock.unlock();
        absl::SleepFor(absl::Microseconds(200));
        continue;
      }
      int64_t at = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        cudaMemcpyAsync(host + at, base + params[i].offset(), sizes[i],
                        cudaMemcpyDeviceToHost, stream);
        at += sizes[i];
      }
      if (cudaStreamSynchronize(stream) != cudaSuccess) {
        std::printf("[%s] read_loop: copy failed\n", id.c_str());
        return;
      }
    }
    const int64_t k1 = reader->known.load();
    images.erase(images.begin(), images.lower_bound(k0));
    int64_t matched = -1;
    for (int64_t v = k0; v <= k1 + 1; ++v) {
      auto it = images.find(v);
      if (it == images.end()) {
        it = images.emplace(v, Image(model, params, v, bytes)).first;
      }
      if (std::memcmp(it->second.data(), host, bytes) == 0) {
        matched = v;
        break;
      }
    }
    std::lock_guard<std::mutex> lock(reader->counts_mu);
    if (matched < 0) {
      ++reader->mixed;
      std::printf(
          "[%s] read_loop: MIXED snapshot (no whole version of v%lld..v%lld)\n",
          id.c_str(), static_cast<long long>(k0),
          static_cast<long long>(k1 + 1));
      std::fflush(stdout);
    } else {
      ++reader->per_version[matched];
    }
  }
}

int Main() {
  auto model = synthetic::ModelByName(FLAGS_model);
  if (!model.ok()) {
    LOG(ERROR) << model.status();
    return 2;
  }
  if (cudaSetDevice(FLAGS_device) != cudaSuccess) {
    LOG(ERROR) << "no GPU " << FLAGS_device;
    return 2;
  }
  std::vector<v1::Parameter> params = synthetic::EngineParameters(
      *model,
      FLAGS_layout == "tp" ? synthetic::Layout::kTensorParallel
                           : synthetic::Layout::kPlain,
      FLAGS_tp_rank, FLAGS_tp_size, ParseDType(FLAGS_dtype));
  auto size = HostArena::Layout(&params);
  if (!size.ok()) return 2;
  void* base = nullptr;
  // Kept for the process's life (or until SIGUSR1): the daemon takes the fd
  // by pidfd_getfd.
  static cuda::VmmMemory vmm_memory;
  v1::RegisterEngineRequest request;
  request.set_engine_id(FLAGS_engine_id);
  v1::Allocation* a = request.add_allocations();
  a->set_device_uuid(GpuUuid(FLAGS_device));
  if (FLAGS_memory == "vmm") {
    auto m = cuda::VmmAllocateExportable(FLAGS_device, *size);
    if (!m.ok()) {
      LOG(ERROR) << "VMM allocation of " << *size << " bytes: " << m.status();
      return 1;
    }
    vmm_memory = *m;
    base = vmm_memory.ptr;
    a->set_kind(v1::MEMORY_CUDA_VMM);
    a->set_handle(absl::StrCat(getpid(), ":", vmm_memory.fd));
    a->set_size(vmm_memory.size);
  } else {
    cudaIpcMemHandle_t handle;
    *size = cuda::LegacyIpcAllocationBytes(*size);
    if (cudaMalloc(&base, *size) != cudaSuccess ||
        cudaIpcGetMemHandle(&handle, base) != cudaSuccess) {
      LOG(ERROR) << "cudaMalloc of " << *size << " bytes failed";
      return 1;
    }
    a->set_kind(v1::MEMORY_CUDA_IPC);
    a->set_handle(
        std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
    a->set_size(*size);
  }
  if (cudaMemset(base, 0, *size) != cudaSuccess) {
    LOG(ERROR) << "cudaMemset failed";
    return 1;
  }
  for (const v1::Parameter& p : params) *request.add_parameters() = p;
  if (FLAGS_time_copy) {
    // The bound for a commit: one plain copy of the same bytes on this GPU.
    void* scratch = nullptr;
    if (cudaMalloc(&scratch, *size) == cudaSuccess) {
      std::vector<double> secs;
      for (int r = 0; r < 6; ++r) {
        const absl::Time t0 = absl::Now();
        cudaMemcpy(scratch, base, *size, cudaMemcpyDeviceToDevice);
        cudaDeviceSynchronize();
        if (r > 0) secs.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
      }
      std::sort(secs.begin(), secs.end());
      std::printf("[%s] copy baseline: %lld bytes, %.6f s on GPU %d\n",
                  FLAGS_engine_id.c_str(), static_cast<long long>(*size),
                  secs[secs.size() / 2], FLAGS_device);
      std::fflush(stdout);
      cudaFree(scratch);
    }
  }

  ClientOptions options;
  options.target = FLAGS_target;
  options.call_timeout = absl::Seconds(60);
  auto client = EngineClient::Connect(options);
  if (!client.ok()) {
    LOG(ERROR) << client.status();
    return 1;
  }
  auto registered = (*client)->Register(request);
  if (!registered.ok()) {
    std::printf("[%s] registration failed: %s\n", FLAGS_engine_id.c_str(),
                registered.status().ToString().c_str());
    return 1;
  }
  const std::string id = FLAGS_engine_id;
  // Held while the notice reads the parameters and while they are freed.
  static std::mutex memory_mu;
  static bool freed = false;
  EngineHooks hooks;
  static Reader reader;
  hooks.on_pause = [](v1::PauseMode) {
    reader.paused = true;
    std::lock_guard<std::mutex> wait(reader.serving);  // snapshot in flight
    return absl::OkStatus();
  };
  hooks.on_resume = []() {
    reader.paused = false;
    return absl::OkStatus();
  };
  hooks.on_dirty = [id](const std::string& why) {
    std::printf("[%s] dirty: %s\n", id.c_str(), why.c_str());
    std::fflush(stdout);
  };
  // Verify inside the notice, before acknowledging it: Finish waits for the
  // acknowledgement, so the next update can't overwrite memory mid-check.
  hooks.on_new_version = [&](int64_t v) {
    // The client's control thread: its current device is 0, and VMM memory
    // is mapped for --device only.
    cudaSetDevice(FLAGS_device);
    std::lock_guard<std::mutex> hold(memory_mu);
    reader.known = v;
    if (freed) {
      std::printf("[%s] version %lld: memory freed, not read\n", id.c_str(),
                  static_cast<long long>(v));
      std::fflush(stdout);
      return;
    }
    if (FLAGS_read_loop) {
      std::printf("[%s] read_loop at version %lld: %s\n", id.c_str(),
                  static_cast<long long>(v), reader.Summary().c_str());
    }
    if (FLAGS_hash) {
      std::printf("[%s] version %lld hash %016llx\n", id.c_str(),
                  static_cast<long long>(v),
                  static_cast<unsigned long long>(
                      HashDevice(static_cast<const uint8_t*>(base), *size)));
    }
    if (!FLAGS_verify) {
      std::printf("[%s] now serving version %lld\n", id.c_str(),
                  static_cast<long long>(v));
    } else {
      const int64_t bad =
          Verify(*model, params, static_cast<uint8_t*>(base), v);
      std::printf(
          "[%s] version %lld: %s\n", id.c_str(), static_cast<long long>(v),
          bad == 0 ? "verified"
                   : absl::StrCat("MISMATCH (", bad, " parameters)").c_str());
    }
    std::fflush(stdout);
  };
  // Run after each pause and resume is acknowledged: memory this engine
  // freed (SIGUSR1) is no longer its weights, so the daemon unregisters it
  // and stops calling it READY (issue 30; gpu_faults.py engine_freed).
  hooks.check_memory = []() {
    std::lock_guard<std::mutex> hold(memory_mu);
    return freed ? absl::FailedPreconditionError(absl::StrCat(
                       "weightsync_gpu_engine freed its parameters' memory (",
                       FLAGS_memory, ") while registered"))
                 : absl::OkStatus();
  };
  if (!(*client)->StartControl(std::move(hooks)).ok()) return 1;
  std::printf("[%s] registered %lld parameters, %.1f MB on GPU %d (%s)\n",
              id.c_str(), static_cast<long long>(registered->parameters()),
              registered->bytes() / 1e6, FLAGS_device,
              a->device_uuid().c_str());
  std::fflush(stdout);
  std::thread read_loop;
  if (FLAGS_read_loop) {
    read_loop =
        std::thread(ReadLoop, &reader, std::cref(*model), std::cref(params),
                    static_cast<const uint8_t*>(base), FLAGS_device, id);
  }
  while (!g_stop) {
    absl::SleepFor(absl::Milliseconds(20));
    if (!g_free.exchange(false)) continue;
    std::lock_guard<std::mutex> hold(memory_mu);
    if (freed || FLAGS_read_loop) continue;
    cudaSetDevice(FLAGS_device);
    cudaDeviceSynchronize();
    const cudaError_t e = FLAGS_memory == "vmm"
                              ? (cuda::VmmFree(&vmm_memory), cudaSuccess)
                              : cudaFree(base);
    freed = true;
    std::printf("[%s] freed its parameters' memory (%s): %s\n", id.c_str(),
                FLAGS_memory.c_str(), cudaGetErrorString(e));
    std::fflush(stdout);
  }
  if (FLAGS_read_loop) {
    reader.stop = true;
    read_loop.join();
    std::printf("[%s] read_loop final: %s\n", id.c_str(),
                reader.Summary().c_str());
    std::fflush(stdout);
  }
  (*client)->Close();
  _exit(0);
}

}  // namespace weightsync

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  signal(SIGTERM, OnSignal);
  signal(SIGINT, OnSignal);
  signal(SIGUSR1, OnFree);
  return weightsync::Main();
}
