// Host-backend throughput: a 1 GiB update from this process (trainer)
// through a running weightsyncd into an engine's shared memory (an engine
// client in this process, memory written by the daemon process), against a
// plain memcpy of the same bytes measured in the same run. Prints a table
// and writes JSON. Run through bench/run_host_bench.sh.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/engine_client.h"
#include "client/host_arena.h"
#include "client/trainer_client.h"
#include "gflags/gflags.h"
#include "glog/logging.h"

DEFINE_string(target, "", "daemon address");
DEFINE_int64(total_mib, 1024, "update size in MiB");
DEFINE_int64(tensor_mib, 16, "size of each tensor in MiB");
DEFINE_string(chunk_mib, "4,8,16,32,64", "chunk sizes to sweep (MiB)");
DEFINE_int32(repeats, 5, "timed updates per chunk size (after one warm-up)");
DEFINE_string(json, "", "write results here");

namespace weightsync {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int BenchMain() {
  const int64_t tensor_bytes = FLAGS_tensor_mib << 20;
  const int n = FLAGS_total_mib / FLAGS_tensor_mib;
  const int64_t total = n * tensor_bytes;
  // Trainer tensors (float32, random) and the engine's parameters.
  std::vector<std::vector<uint8_t>> data(n, std::vector<uint8_t>(tensor_bytes));
  std::mt19937_64 rng(42);
  for (auto& d : data) {
    for (size_t i = 0; i < d.size(); i += 8) {
      const uint64_t r = rng();
      std::memcpy(&d[i], &r, 8);
    }
  }
  std::vector<v1::Parameter> params;
  std::vector<HostTensor> tensors;
  for (int i = 0; i < n; ++i) {
    v1::Parameter p;
    p.set_name(absl::StrCat("layer.", i, ".weight"));
    p.set_dtype(v1::FLOAT32);
    p.add_shape(tensor_bytes / 4 / 1024);
    p.add_shape(1024);
    params.push_back(p);
    HostTensor t;
    t.spec.set_name(p.name());
    t.spec.set_dtype(v1::FLOAT32);
    *t.spec.mutable_shape() = p.shape();
    t.data = data[i].data();
    tensors.push_back(t);
  }

  // Baseline: memcpy of the same bytes, warm destination, best of repeats.
  std::vector<uint8_t> dst(total);
  std::vector<double> memcpy_s;
  for (int r = 0; r <= FLAGS_repeats; ++r) {
    const absl::Time t0 = absl::Now();
    for (int i = 0; i < n; ++i) {
      std::memcpy(dst.data() + i * tensor_bytes, data[i].data(), tensor_bytes);
    }
    if (r > 0) memcpy_s.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
  }
  dst.clear();
  dst.shrink_to_fit();
  const double memcpy_gbs = total / Median(memcpy_s) / 1e9;

  ClientOptions options;
  options.target = FLAGS_target;
  options.call_timeout = absl::Minutes(5);
  auto arena =
      HostArena::Create(absl::StrCat("/weightsync-bench-", getpid()), params);
  if (!arena.ok()) {
    LOG(ERROR) << arena.status();
    return 1;
  }
  std::memset((*arena)->region().data(), 0, (*arena)->region().size());
  auto engine = EngineClient::Connect(options);
  auto trainer = TrainerClient::Connect(options);
  if (!engine.ok() || !trainer.ok()) {
    LOG(ERROR) << "connect failed";
    return 1;
  }
  v1::RegisterEngineRequest reg = (*arena)->Registration();
  reg.set_engine_id(absl::StrCat("bench-", getpid()));
  if (!(*engine)->Register(reg).ok() || !(*engine)->StartControl({}).ok()) {
    LOG(ERROR) << "engine registration failed";
    return 1;
  }
  (*arena)->region().Unlink();
  v1::InitWeightTransferRequest init;
  init.set_backend(v1::BACKEND_HOST);
  if (!(*trainer)->InitWeightTransfer(init).ok()) return 1;

  std::printf("host backend, %lld MiB update (%d float32 tensors)\n",
              static_cast<long long>(total >> 20), n);
  std::printf("%-28s %10s %10s %8s\n", "what", "median s", "GB/s", "ratio");
  std::printf("%-28s %10.4f %10.2f %8.2f\n", "memcpy (baseline)",
              Median(memcpy_s), memcpy_gbs, 1.0);
  std::string json = absl::StrFormat(
      "{\n  \"machine\": \"%s\",\n  \"total_bytes\": %lld,\n"
      "  \"memcpy_gbs\": %.3f,\n  \"weightsync\": [",
      "this machine", static_cast<long long>(total), memcpy_gbs);
  int64_t version = 0;
  bool first = true;
  for (absl::string_view c : absl::StrSplit(FLAGS_chunk_mib, ',')) {
    const int64_t chunk = std::stoll(std::string(c)) << 20;
    std::vector<double> secs;
    for (int r = 0; r <= FLAGS_repeats; ++r) {
      v1::StartWeightUpdateRequest req;
      req.set_update_id(absl::StrCat("bench-", ++version));
      req.set_target_version(version);
      req.set_chunk_bytes(chunk);
      req.set_verify(v1::VERIFY_OFF);  // receipts are measured below
      const absl::Time t0 = absl::Now();
      auto done = (*trainer)->Update(req, tensors);
      const double s = absl::ToDoubleSeconds(absl::Now() - t0);
      if (!done.ok()) {
        LOG(ERROR) << done.status();
        return 1;
      }
      if (r > 0) secs.push_back(s);
    }
    const double gbs = total / Median(secs) / 1e9;
    std::printf("%-28s %10.4f %10.2f %8.2f\n",
                absl::StrCat("weightsync, chunk ", c, " MiB").c_str(),
                Median(secs), gbs, gbs / memcpy_gbs);
    json += absl::StrFormat(
        "%s\n    {\"chunk_bytes\": %lld, \"median_s\": %.4f, \"gbs\": %.3f, "
        "\"ratio_to_memcpy\": %.3f}",
        first ? "" : ",", static_cast<long long>(chunk), Median(secs), gbs,
        gbs / memcpy_gbs);
    first = false;
  }
  json += "\n  ],";
  // Staged mode: the engine serves while the bytes arrive and pauses only
  // for the commit copy; compare that pause with a memcpy of the bytes.
  {
    std::vector<double> pauses, totals;
    for (int r = 0; r <= FLAGS_repeats; ++r) {
      v1::StartWeightUpdateRequest req;
      req.set_update_id(absl::StrCat("bench-", ++version));
      req.set_target_version(version);
      req.set_chunk_bytes(8 << 20);
      req.set_mode(v1::UPDATE_MODE_STAGED);
      req.set_verify(v1::VERIFY_OFF);
      auto done = (*trainer)->Update(req, tensors);
      if (!done.ok()) {
        LOG(ERROR) << done.status();
        return 1;
      }
      if (r > 0) {
        pauses.push_back(done->pause_seconds());
        totals.push_back(done->seconds());
      }
    }
    const double pause = Median(pauses);
    std::printf("%-28s %10.4f %10s %8.2f   (update %.4f s; pause / memcpy)\n",
                "staged: engine paused", pause, "", pause / Median(memcpy_s),
                Median(totals));
    json += absl::StrFormat(
        "\n  \"staged\": {\"pause_s\": %.4f, \"update_s\": %.4f, "
        "\"memcpy_s\": %.4f, \"pause_to_memcpy\": %.3f}",
        pause, Median(totals), Median(memcpy_s), pause / Median(memcpy_s));
  }
  // Sparse: a 1% patch of every tensor (every 100th element) against the
  // dense update of the same tensors: bytes on the wire and time.
  {
    std::vector<std::vector<uint8_t>> payloads;
    std::vector<HostTensor> patch;
    for (int i = 0; i < n; ++i) {
      const int64_t numel = tensor_bytes / 4;
      // 4-byte indices (sparse_index_bytes = 4): 8 bytes per change.
      std::vector<uint32_t> index;
      for (int64_t k = 0; k < numel; k += 100) index.push_back(k);
      std::vector<uint8_t> payload(index.size() * 8);
      std::memcpy(payload.data(), index.data(), index.size() * 4);
      for (size_t k = 0; k < index.size(); ++k) {
        std::memcpy(payload.data() + index.size() * 4 + k * 4,
                    data[i].data() + int64_t{index[k]} * 4, 4);
      }
      payloads.push_back(std::move(payload));
      HostTensor h = tensors[i];
      h.spec.set_sparse_nnz(index.size());
      h.spec.set_sparse_index_bytes(4);
      h.data = payloads.back().data();
      patch.push_back(h);
    }
    std::vector<double> secs;
    int64_t wire = 0;
    for (int r = 0; r <= FLAGS_repeats; ++r) {
      v1::StartWeightUpdateRequest req;
      req.set_update_id(absl::StrCat("bench-", ++version));
      req.set_target_version(version);
      req.set_sparse_base_version(version - 1);
      req.set_chunk_bytes(8 << 20);
      req.set_verify(v1::VERIFY_OFF);
      const absl::Time t0 = absl::Now();
      auto done = (*trainer)->Update(req, patch);
      if (!done.ok()) {
        LOG(ERROR) << done.status();
        return 1;
      }
      wire = done->bytes();
      if (r > 0) secs.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    }
    std::printf("%-28s %10.4f %10s %8s   (%.1f%% of the bytes)\n",
                "sparse 1% patch", Median(secs), "", "", 100.0 * wire / total);
    json += absl::StrFormat(
        ",\n  \"sparse_1pct\": {\"update_s\": %.4f, \"wire_bytes\": %d}",
        Median(secs), wire);
  }
  // Receipts: the same 8 MiB-chunk update with the daemon's checksum and
  // the client's check, against it without.
  {
    std::vector<double> with;
    for (int r = 0; r <= FLAGS_repeats; ++r) {
      v1::StartWeightUpdateRequest req;
      req.set_update_id(absl::StrCat("bench-", ++version));
      req.set_target_version(version);
      req.set_chunk_bytes(8 << 20);
      req.set_verify(v1::VERIFY_ON);
      const absl::Time t0 = absl::Now();
      auto done = (*trainer)->Update(req, tensors);
      if (!done.ok()) {
        LOG(ERROR) << done.status();
        return 1;
      }
      if (r > 0) with.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    }
    std::printf("%-28s %10.4f %10.2f %8.2f   (receipts checked)\n",
                "weightsync + receipts", Median(with),
                total / Median(with) / 1e9,
                total / Median(with) / 1e9 / memcpy_gbs);
    json += absl::StrFormat(",\n  \"receipts\": {\"update_s\": %.4f}",
                            Median(with));
  }
  json += "\n}\n";
  // The engine holds exactly what was sent.
  for (int i = 0; i < n; ++i) {
    if (std::memcmp((*arena)->data(params[i].name()), data[i].data(),
                    tensor_bytes) != 0) {
      std::printf("MISMATCH in %s\n", params[i].name().c_str());
      return 1;
    }
  }
  std::printf("engine memory verified byte for byte\n");
  if (!FLAGS_json.empty()) std::ofstream(FLAGS_json) << json;
  (*engine)->Close();
  return 0;
}

}  // namespace weightsync

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  return weightsync::BenchMain();
}
