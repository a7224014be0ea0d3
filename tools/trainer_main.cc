// weightsync_trainer: a fake trainer on the host backend. It pushes
// `--updates` versions of a synthetic model through weightsyncd and, for
// each engine named in --verify, reads that engine's shared memory and
// compares every parameter byte with what the trainer sent (mapped through
// the engine's layout by an independent reference installer). It prints
// "verified" only after that comparison.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "backends/host/shm_memory.h"
#include "client/host_arena.h"
#include "client/multi_trainer.h"
#include "client/trainer_client.h"
#include "common/dtype.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "tools/synthetic/fp8_layout.h"
#include "tools/synthetic/synthetic_model.h"

DEFINE_string(target, "",
              "daemon address, e.g. unix:/tmp/ws.sock; several, comma "
              "separated, for one update over several daemons (each is sent "
              "the tensors its engines use; committed on all or none)");
DEFINE_string(model, "tiny", "synthetic model");
DEFINE_string(dtype, "float32", "checkpoint dtype sent by the trainer");
DEFINE_int32(updates, 3, "number of updates");
DEFINE_int64(first_version, 1, "version of the first update");
DEFINE_int64(chunk_bytes, 0, "chunk size (0: the daemon's default)");
DEFINE_string(verify, "",
              "engines to verify after each update: id:plain or "
              "id:tp:rank:size, with :dtype appended, comma separated");
DEFINE_string(verify_fp8, "",
              "e4m3fn or e5m2: the engines in --verify are FP8 engines "
              "(weightsync_engine --fp8), checked against the reference "
              "quantisation");
DEFINE_int64(verify_fp8_block, 128, "their FP8 block side (0: per row)");
DEFINE_bool(receipts, true,
            "ask for receipts (the daemon checksums what it installed and the "
            "client checks it; costs about 2x the update on the host backend)");
DEFINE_int32(repeat_bytes, 1,
             "send the model this many times as one update "
             "(scales the update for benchmarks; names get a suffix)");

namespace weightsync {

struct VerifySpec {
  std::string id;
  std::vector<v1::Parameter> params;
  int64_t size = 0;
};

absl::StatusOr<std::vector<VerifySpec>> ParseVerify(
    const synthetic::ModelConfig& model) {
  std::vector<VerifySpec> out;
  if (FLAGS_verify.empty()) return out;
  for (absl::string_view item : absl::StrSplit(FLAGS_verify, ',')) {
    std::vector<std::string> f = absl::StrSplit(item, ':');
    if (f.size() < 3) return absl::InvalidArgumentError("bad --verify item");
    VerifySpec v;
    v.id = f[0];
    const bool tp = f[1] == "tp";
    if (tp && f.size() < 5)
      return absl::InvalidArgumentError("tp needs rank:size");
    const std::string dtype_name = f.back();
    v1::DType dtype = dtype_name == "float32"   ? v1::FLOAT32
                      : dtype_name == "float16" ? v1::FLOAT16
                                                : v1::BFLOAT16;
    const synthetic::Layout layout =
        tp ? synthetic::Layout::kTensorParallel : synthetic::Layout::kPlain;
    const int rank = tp ? std::stoi(f[2]) : 0;
    const int tp_size = tp ? std::stoi(f[3]) : 1;
    if (FLAGS_verify_fp8.empty()) {
      v.params =
          synthetic::EngineParameters(model, layout, rank, tp_size, dtype);
    } else {
      auto params = synthetic::Fp8EngineParameters(
          model, layout, rank, tp_size, dtype,
          FLAGS_verify_fp8 == "e5m2" ? v1::FLOAT8_E5M2 : v1::FLOAT8_E4M3FN,
          FLAGS_verify_fp8_block);
      if (!params.ok()) return params.status();
      v.params = *std::move(params);
    }
    auto size = HostArena::Layout(&v.params);
    if (!size.ok()) return size.status();
    v.size = *size;
    out.push_back(std::move(v));
  }
  return out;
}

// Compares an engine's memory with the reference; returns mismatches.
absl::StatusOr<int64_t> Verify(const VerifySpec& v,
                               const synthetic::CheckpointData& sent) {
  auto region = ShmRegion::Open("/weightsync-" + v.id, v.size);
  if (!region.ok()) return region.status();
  int64_t bad = 0;
  std::vector<std::vector<uint8_t>> fp8;
  if (!FLAGS_verify_fp8.empty())
    fp8 = synthetic::ExpectedFp8Engine(v.params, sent);
  for (size_t i = 0; i < v.params.size(); ++i) {
    const v1::Parameter& p = v.params[i];
    const std::vector<uint8_t> want =
        fp8.empty() ? synthetic::ExpectedParameter(p, sent) : fp8[i];
    const uint8_t* got = (*region)->data() + p.offset();
    if (std::memcmp(got, want.data(), want.size()) != 0) {
      if (bad < 3)
        LOG(ERROR) << v.id << ": parameter " << p.name() << " differs";
      ++bad;
    }
  }
  return bad;
}

int TrainerMain() {
  auto model = synthetic::ModelByName(FLAGS_model);
  if (!model.ok()) {
    LOG(ERROR) << model.status();
    return 2;
  }
  const v1::DType dtype = FLAGS_dtype == "bfloat16"  ? v1::BFLOAT16
                          : FLAGS_dtype == "float16" ? v1::FLOAT16
                                                     : v1::FLOAT32;
  auto verify = ParseVerify(*model);
  if (!verify.ok()) {
    LOG(ERROR) << verify.status();
    return 2;
  }
  std::vector<ClientOptions> daemons;
  for (absl::string_view target : absl::StrSplit(FLAGS_target, ',')) {
    ClientOptions& options = daemons.emplace_back();
    options.target = std::string(target);
    options.call_timeout = absl::Minutes(5);
  }
  auto client = MultiTrainer::Connect(daemons);
  if (!client.ok()) {
    LOG(ERROR) << client.status();
    return 1;
  }
  const bool several = daemons.size() > 1;
  if (several) {
    if (absl::Status s = (*client)->InitHost(); !s.ok()) {
      LOG(ERROR) << s;
      return 1;
    }
    std::printf("trainer: host groups on %zu daemons\n", daemons.size());
  } else {
    v1::InitWeightTransferRequest init;
    init.set_backend(v1::BACKEND_HOST);
    auto group = (*client)->daemon(0).InitWeightTransfer(init);
    if (!group.ok()) {
      LOG(ERROR) << group.status();
      return 1;
    }
    std::printf("trainer: group %s (%s)\n", group->group_id().c_str(),
                group->build_info().c_str());
  }
  const std::vector<v1::TensorSpec> specs =
      synthetic::Checkpoint(*model, dtype);
  for (int u = 0; u < FLAGS_updates; ++u) {
    const int64_t version = FLAGS_first_version + u;
    synthetic::CheckpointData sent;
    std::vector<HostTensor> tensors;
    for (int r = 0; r < FLAGS_repeat_bytes; ++r) {
      for (v1::TensorSpec spec : specs) {
        if (r > 0) spec.set_name(absl::StrCat(spec.name(), ".copy", r));
        auto& entry = sent[spec.name()];
        entry = {spec, synthetic::Contents(spec, version)};
        tensors.push_back({spec, entry.second.data()});
      }
    }
    v1::StartWeightUpdateRequest request;
    request.set_update_id(absl::StrCat("update-", version));
    request.set_target_version(version);
    request.set_chunk_bytes(FLAGS_chunk_bytes);
    request.set_verify(FLAGS_receipts ? v1::VERIFY_ON : v1::VERIFY_OFF);
    const absl::Time t0 = absl::Now();
    // One daemon: Update (Finish = prepare + commit); several: MultiTrainer.
    absl::StatusOr<std::vector<v1::FinishWeightUpdateResponse>> done;
    if (several) {
      done = (*client)->Update(request, tensors);
    } else {
      auto one = (*client)->daemon(0).Update(request, tensors);
      if (one.ok()) done = std::vector<v1::FinishWeightUpdateResponse>{*one};
      if (!one.ok()) done = one.status();
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
    if (!done.ok()) {
      LOG(ERROR) << "update " << version << ": " << done.status();
      return 1;
    }
    int64_t bytes = 0;
    int engines = 0;
    for (const v1::FinishWeightUpdateResponse& d : *done) {
      bytes += d.bytes();
      engines += d.engines_size();
    }
    bool ok = true;
    std::string verdict = FLAGS_receipts ? "receipts ok, verified" : "verified";
    for (const VerifySpec& v : *verify) {
      auto bad = Verify(v, sent);
      if (!bad.ok() || *bad != 0) {
        ok = false;
        verdict = absl::StrCat("MISMATCH on ", v.id, " (",
                               bad.ok() ? absl::StrCat(*bad, " parameters")
                                        : bad.status().ToString(),
                               ")");
        break;
      }
    }
    if (verify->empty()) verdict = "not verified (no --verify)";
    std::printf(
        "update v%lld: %lld tensors, %.1f MB, %.3f s, %.2f GB/s, %d engines: "
        "%s\n",
        static_cast<long long>(version), static_cast<long long>(tensors.size()),
        bytes / 1e6, seconds, bytes / seconds / 1e9, engines, verdict.c_str());
    std::fflush(stdout);
    if (!ok) return 1;
  }
  return 0;
}

}  // namespace weightsync

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  return weightsync::TrainerMain();
}
