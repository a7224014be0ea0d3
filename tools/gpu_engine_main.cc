// weightsync_gpu_engine: a fake inference engine on a GPU. It lays out a
// synthetic model's parameters in one cudaMalloc allocation, registers it
// with weightsyncd by CUDA IPC handle and GPU UUID, and serves its control
// stream. With --verify, after each new version it copies its parameters
// back and compares them with the reference installer's answer for that
// version, printing "verified" or "MISMATCH".
#include <cuda_runtime_api.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
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
DEFINE_string(memory, "ipc",
              "how the parameters' memory is shared: ipc (cudaMalloc + "
              "cudaIpcGetMemHandle) or vmm (cuMemCreate + POSIX fd)");

namespace {
std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }
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
  v1::RegisterEngineRequest request;
  request.set_engine_id(FLAGS_engine_id);
  v1::Allocation* a = request.add_allocations();
  a->set_device_uuid(GpuUuid(FLAGS_device));
  if (FLAGS_memory == "vmm") {
    // Kept for the process's life: the daemon takes the fd by pidfd_getfd.
    static cuda::VmmMemory memory;
    auto m = cuda::VmmAllocateExportable(FLAGS_device, *size);
    if (!m.ok()) {
      LOG(ERROR) << "VMM allocation of " << *size << " bytes: " << m.status();
      return 1;
    }
    memory = *m;
    base = memory.ptr;
    a->set_kind(v1::MEMORY_CUDA_VMM);
    a->set_handle(absl::StrCat(getpid(), ":", memory.fd));
    a->set_size(memory.size);
  } else {
    cudaIpcMemHandle_t handle;
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
  EngineHooks hooks;
  hooks.on_dirty = [id](const std::string& why) {
    std::printf("[%s] dirty: %s\n", id.c_str(), why.c_str());
    std::fflush(stdout);
  };
  // Verify inside the notice, before acknowledging it: Finish waits for the
  // acknowledgement, so the next update can't overwrite memory mid-check.
  hooks.on_new_version = [&](int64_t v) {
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
  if (!(*client)->StartControl(std::move(hooks)).ok()) return 1;
  std::printf("[%s] registered %lld parameters, %.1f MB on GPU %d (%s)\n",
              id.c_str(), static_cast<long long>(registered->parameters()),
              registered->bytes() / 1e6, FLAGS_device,
              a->device_uuid().c_str());
  std::fflush(stdout);
  while (!g_stop) absl::SleepFor(absl::Milliseconds(20));
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
  return weightsync::Main();
}
