// weightsync_engine: a fake inference engine on the host backend. It lays
// out a synthetic model's parameters in shared memory, registers them with
// weightsyncd, and serves its control stream until SIGTERM, printing every
// notice. Used by the demo, the end-to-end tests and benchmarks.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/engine_client.h"
#include "client/host_arena.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "tools/synthetic/fp8_layout.h"
#include "tools/synthetic/synthetic_model.h"

DEFINE_string(target, "", "daemon address, e.g. unix:/tmp/ws.sock");
DEFINE_string(engine_id, "engine-0", "engine id");
DEFINE_string(model, "tiny", "synthetic model (tiny, demo, qwen3-1.7b, ...)");
DEFINE_string(layout, "plain", "plain or tp");
DEFINE_int32(tp_rank, 0, "tensor-parallel rank");
DEFINE_int32(tp_size, 1, "tensor-parallel size");
DEFINE_string(dtype, "bfloat16", "parameter dtype: float32/bfloat16/float16");
DEFINE_string(shm_name, "",
              "shared memory name; default /weightsync-<engine_id>");
DEFINE_string(fp8, "",
              "e4m3fn or e5m2: the linear layers are FP8 targets the daemon "
              "quantises (tools/synthetic/fp8_layout.h)");
DEFINE_int64(fp8_block, 128, "FP8 block side (0: one scale per row)");
DEFINE_bool(hang_on_pause, false,
            "never acknowledge a pause (tests the daemon's deadline)");

namespace {
std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }
}  // namespace

namespace weightsync {

absl::StatusOr<v1::DType> ParseDType(const std::string& s) {
  if (s == "float32") return v1::FLOAT32;
  if (s == "bfloat16") return v1::BFLOAT16;
  if (s == "float16") return v1::FLOAT16;
  return absl::InvalidArgumentError("dtype must be float32/bfloat16/float16");
}

int EngineMain() {
  auto model = synthetic::ModelByName(FLAGS_model);
  auto dtype = ParseDType(FLAGS_dtype);
  if (!model.ok() || !dtype.ok()) {
    LOG(ERROR) << (model.ok() ? dtype.status() : model.status());
    return 2;
  }
  const synthetic::Layout layout = FLAGS_layout == "tp"
                                       ? synthetic::Layout::kTensorParallel
                                       : synthetic::Layout::kPlain;
  const std::string shm = FLAGS_shm_name.empty()
                              ? "/weightsync-" + FLAGS_engine_id
                              : FLAGS_shm_name;
  shm_unlink(shm.c_str());  // a stale object of an earlier run
  absl::StatusOr<std::vector<v1::Parameter>> params =
      synthetic::EngineParameters(*model, layout, FLAGS_tp_rank, FLAGS_tp_size,
                                  *dtype);
  if (!FLAGS_fp8.empty()) {
    params = synthetic::Fp8EngineParameters(
        *model, layout, FLAGS_tp_rank, FLAGS_tp_size, *dtype,
        FLAGS_fp8 == "e5m2" ? v1::FLOAT8_E5M2 : v1::FLOAT8_E4M3FN,
        FLAGS_fp8_block);
  }
  if (!params.ok()) {
    LOG(ERROR) << params.status();
    return 2;
  }
  auto arena = HostArena::Create(shm, *std::move(params));
  if (!arena.ok()) {
    LOG(ERROR) << arena.status();
    return 1;
  }
  ClientOptions options;
  options.target = FLAGS_target;
  auto client = EngineClient::Connect(options);
  if (!client.ok()) {
    LOG(ERROR) << client.status();
    return 1;
  }
  v1::RegisterEngineRequest request = (*arena)->Registration();
  request.set_engine_id(FLAGS_engine_id);
  auto registered = (*client)->Register(request);
  if (!registered.ok()) {
    LOG(ERROR) << registered.status();
    return 1;
  }
  const std::string id = FLAGS_engine_id;
  EngineHooks hooks;
  hooks.on_pause = [id](v1::PauseMode mode) {
    std::printf("[%s] pause (%s)\n", id.c_str(),
                v1::PauseMode_Name(mode).c_str());
    std::fflush(stdout);
    while (FLAGS_hang_on_pause && !g_stop)
      absl::SleepFor(absl::Milliseconds(50));
    return absl::OkStatus();
  };
  hooks.on_resume = [id] {
    std::printf("[%s] resume\n", id.c_str());
    std::fflush(stdout);
    return absl::OkStatus();
  };
  hooks.on_new_version = [id](int64_t v) {
    std::printf("[%s] now serving version %lld\n", id.c_str(),
                static_cast<long long>(v));
    std::fflush(stdout);
  };
  hooks.on_dirty = [id](const std::string& why) {
    std::printf("[%s] dirty: %s\n", id.c_str(), why.c_str());
    std::fflush(stdout);
  };
  absl::Status started = (*client)->StartControl(std::move(hooks));
  if (!started.ok()) {
    LOG(ERROR) << started;
    return 1;
  }
  std::printf("[%s] registered %lld parameters, %lld bytes in %s\n", id.c_str(),
              static_cast<long long>(registered->parameters()),
              static_cast<long long>(registered->bytes()), shm.c_str());
  std::fflush(stdout);
  while (!g_stop) absl::SleepFor(absl::Milliseconds(20));
  (*client)->Close();
  (*arena)->region().Unlink();
  return 0;
}

}  // namespace weightsync

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  signal(SIGTERM, OnSignal);
  signal(SIGINT, OnSignal);
  return weightsync::EngineMain();
}
