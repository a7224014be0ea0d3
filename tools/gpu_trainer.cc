// weightsync_gpu_trainer's work; its flags and their parsing are in
// gpu_trainer_main.cc (which describes the tool).
#include "tools/gpu_trainer.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "backends/cuda/gpu_uuid.h"
#include "backends/cuda/receipt_kernels.h"
#include "backends/cuda/sparse_kernels.h"
#include "backends/cuda/vmm.h"
#include "client/receipts.h"
#include "client/trainer_client.h"
#include "common/chunk_planner.h"
#include "common/dtype.h"
#include "glog/logging.h"
#include "tools/gpu_trainer_steps.h"
#include "tools/synthetic/synthetic_model.h"

namespace weightsync {

// --stall_after_chunks: the first update stops here, after `index` chunks,
// as a frozen trainer would (SIGSTOP; the fault tests SIGCONT or kill it).
void StallAt(const GpuTrainerOptions& o, int64_t index, int64_t version) {
  static bool stalled = false;
  if (o.stall_after_chunks < 0 || index != o.stall_after_chunks || stalled) {
    return;
  }
  stalled = true;
  std::printf("trainer: stalled after %lld chunks of update-%lld\n",
              static_cast<long long>(index), static_cast<long long>(version));
  std::fflush(stdout);
  raise(SIGSTOP);
}

// Fills the flat host buffer with every tensor's contents at `version`.
void Fill(const std::vector<v1::TensorSpec>& specs, const ChunkPlan& plan,
          int64_t version, std::vector<uint8_t>* flat) {
  flat->assign(plan.total_bytes, 0);
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (size_t i = t; i < specs.size(); i += threads) {
        const std::vector<uint8_t> c = synthetic::Contents(specs[i], version);
        std::memcpy(flat->data() + plan.tensor_offsets[i], c.data(), c.size());
      }
    });
  }
  for (auto& th : pool) th.join();
}

// One line per engine: its state and version.
void PrintEngines(TrainerClient& client) {
  auto status = client.GetStatus();
  if (!status.ok()) return;
  for (const auto& e : status->engines()) {
    std::printf("engine %s: %s, version %lld\n", e.engine_id().c_str(),
                v1::EngineState_Name(e.state()).c_str(),
                static_cast<long long>(e.version()));
  }
}

int FinishOnly(const GpuTrainerOptions& o, TrainerClient& client) {
  const absl::Time t0 = absl::Now();
  auto done = client.FinishWeightUpdate(o.finish_only);
  const double s = absl::ToDoubleSeconds(absl::Now() - t0);
  std::printf("finish %s: %s after %.2f s\n", o.finish_only.c_str(),
              done.ok() ? "OK" : done.status().ToString().c_str(), s);
  PrintEngines(client);
  return done.ok() ? 0 : 3;
}

// Where an update's time went, in ms: "start S (validate V pause P begin
// B) transfer T device D commit C" (start_s: Start's round trip as the
// trainer saw it; the rest as the daemon timed it).
std::string Breakdown(double start_s, const v1::UpdateTimings& t) {
  return absl::StrFormat(
      "start %.2f (validate %.2f pause %.2f begin %.2f) transfer %.2f device "
      "%.2f commit %.2f",
      start_s * 1e3, t.validate_s() * 1e3, t.pause_s() * 1e3, t.begin_s() * 1e3,
      t.transfer_s() * 1e3, t.device_s() * 1e3, t.commit_s() * 1e3);
}
std::string Breakdown(const Sent& s) {
  return Breakdown(s.start_s, s.done.timings());
}

// Start, broadcast every chunk of `plan` from `buf`, Finish. With no
// `comm` (the IPC backend) the request names the shared buffer and the
// daemon pulls the bytes itself.
absl::StatusOr<Sent> Send(TrainerClient& client,
                          const v1::StartWeightUpdateRequest& req,
                          const ChunkPlan& plan, uint8_t* buf, ncclComm_t comm,
                          cudaStream_t stream) {
  const absl::Time t0 = absl::Now();
  auto started = client.StartWeightUpdate(req);
  if (!started.ok()) return started.status();
  const double start_s = absl::ToDoubleSeconds(absl::Now() - t0);
  for (const Chunk& c : plan.chunks) {
    if (comm == nullptr) break;
    CHECK_NCCL(ncclBroadcast(buf + c.offset, buf + c.offset, c.size, ncclUint8,
                             0, comm, stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  auto done = client.FinishWeightUpdate(req.update_id());
  if (!done.ok()) return done.status();
  return Sent{*done, absl::ToDoubleSeconds(absl::Now() - t0), start_s};
}

// A legacy CUDA IPC handle of `size` bytes at `ptr` on `device`.
v1::Allocation IpcSource(void* ptr, int64_t size, int device) {
  cudaIpcMemHandle_t handle;
  CHECK_CUDA(cudaIpcGetMemHandle(&handle, ptr));
  v1::Allocation source;
  source.set_kind(v1::MEMORY_CUDA_IPC);
  source.set_handle(
      std::string(reinterpret_cast<char*>(&handle), sizeof(handle)));
  source.set_size(size);
  source.set_device_uuid(GpuUuid(device));
  return source;
}

// The engines' layouts (GetStatus with include_layouts), fetched again only
// when an engine's layout_id is one not seen yet.
class Layouts {
 public:
  absl::StatusOr<const v1::GetStatusResponse*> For(
      TrainerClient& client, const v1::FinishWeightUpdateResponse& done) {
    bool known = status_.has_value();
    for (const v1::EngineResult& r : done.engines()) {
      known = known && !r.layout_id().empty() && ids_.contains(r.layout_id());
    }
    if (!known) {
      auto status = client.GetStatus(/*include_layouts=*/true);
      if (!status.ok()) return status.status();
      status_ = *status;
      ids_.clear();
      for (const v1::EngineStatus& e : status_->engines()) {
        ids_.insert(e.layout_id());
      }
    }
    return &*status_;
  }

 private:
  std::optional<v1::GetStatusResponse> status_;
  absl::flat_hash_set<std::string> ids_;
};

// CheckReceipts with the expectation summed on the GPU from `tensors`
// (device pointers): one ReceiptSumBatch over every engine's regions.
// UNIMPLEMENTED where a layout converts dtypes (then check on the host).
absl::Status CheckReceiptsOnGpu(const v1::FinishWeightUpdateResponse& done,
                                const v1::GetStatusResponse& status,
                                const std::vector<HostTensor>& tensors,
                                cudaStream_t stream) {
  static uint8_t* dev = nullptr;  // sums, then the regions (grown as needed)
  static size_t dev_bytes = 0;
  absl::flat_hash_map<std::string, const v1::EngineStatus*> layouts;
  for (const v1::EngineStatus& e : status.engines())
    layouts[e.engine_id()] = &e;
  const int n = done.engines_size();
  std::vector<cuda::ReceiptRegion> regions;
  std::vector<int> owner;  // the engine each region sums for
  std::vector<v1::Receipt> want(n);
  for (int e = 0; e < n; ++e) {
    const v1::EngineResult& r = done.engines(e);
    auto it = layouts.find(r.engine_id());
    if (!r.has_receipt() || r.lost() || it == layouts.end()) continue;
    // Sums are addressed once the device buffer is known (below).
    auto more = ExpectedReceiptRegions(it->second->layout(), tensors, nullptr,
                                       &want[e]);
    if (!more.ok()) return more.status();
    regions.insert(regions.end(), more->begin(), more->end());
    owner.resize(regions.size(), e);
  }
  const size_t sums = sizeof(uint64_t) * n;
  const size_t need = sums + sizeof(cuda::ReceiptRegion) * regions.size();
  if (need > dev_bytes) {
    if (dev != nullptr) CHECK_CUDA(cudaFree(dev));
    CHECK_CUDA(cudaMalloc(&dev, need));
    dev_bytes = need;
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    regions[i].out = reinterpret_cast<unsigned long long*>(dev) + owner[i];
  }
  const int64_t tiles =
      cuda::PlanReceiptRegions(regions.data(), regions.size());
  if (tiles < 0) {
    return absl::InternalError("an expected-receipt region can't be planned");
  }
  std::vector<uint64_t> got(n, 0);
  CHECK_CUDA(cudaMemsetAsync(dev, 0, sums, stream));
  CHECK_CUDA(cudaMemcpyAsync(dev + sums, regions.data(),
                             sizeof(cuda::ReceiptRegion) * regions.size(),
                             cudaMemcpyHostToDevice, stream));
  CHECK_CUDA(cuda::ReceiptSumBatch(
      reinterpret_cast<const cuda::ReceiptRegion*>(dev + sums), regions.size(),
      tiles, stream));
  CHECK_CUDA(
      cudaMemcpyAsync(got.data(), dev, sums, cudaMemcpyDeviceToHost, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  for (int e = 0; e < n; ++e) {
    const v1::EngineResult& r = done.engines(e);
    if (!r.has_receipt() || r.lost() || !layouts.contains(r.engine_id())) {
      continue;
    }
    if (got[e] != r.receipt().checksum() ||
        want[e].bytes() != r.receipt().bytes()) {
      return absl::DataLossError(absl::StrFormat(
          "engine '%s' receipt %016x over %d bytes does not match %016x over "
          "%d bytes computed on the GPU from what was sent",
          r.engine_id(), r.receipt().checksum(), r.receipt().bytes(), got[e],
          want[e].bytes()));
    }
  }
  return absl::OkStatus();
}

int RunGpuTrainer(const GpuTrainerOptions& o) {
  auto model = synthetic::ModelByName(o.model);
  if (!model.ok()) return 2;
  const v1::DType dtype = o.checkpoint_dtype;
  ClientOptions options;
  options.target = o.target;
  options.call_timeout = absl::Milliseconds(o.finish_timeout_ms);
  auto client = TrainerClient::Connect(options);
  if (!client.ok()) {
    LOG(ERROR) << client.status();
    return 1;
  }
  if (!o.finish_only.empty()) return FinishOnly(o, **client);

  CHECK_CUDA(cudaSetDevice(o.device));
  const bool ipc = o.backend == "ipc";
  ncclComm_t comm = nullptr;
  v1::InitWeightTransferRequest init;
  init.set_backend(ipc ? v1::BACKEND_IPC : v1::BACKEND_NCCL);
  ncclUniqueId id;
  if (!ipc) {
    CHECK_NCCL(ncclGetUniqueId(&id));
    init.set_world_size(2);
    init.set_rank_offset(1);
    init.set_nccl_unique_id(
        std::string(reinterpret_cast<char*>(&id), sizeof(id)));
    // The daemon refuses another major.minor than its own (issue 20).
    int nccl_version = 0;
    CHECK_NCCL(ncclGetVersion(&nccl_version));
    init.set_nccl_version(nccl_version);
  }
  const absl::Time t_init = absl::Now();
  auto group = (*client)->InitWeightTransfer(init);
  if (!group.ok()) {
    std::printf("init failed: %s\n", group.status().ToString().c_str());
    return 1;
  }
  if (!ipc) CHECK_NCCL(ncclCommInitRank(&comm, 2, id, 0));
  const absl::Status held = (*client)->liveness_status();
  std::printf("trainer: %s group %s formed in %.2f s (%s); liveness %s\n",
              o.backend.c_str(), group->group_id().c_str(),
              absl::ToDoubleSeconds(absl::Now() - t_init),
              group->build_info().c_str(),
              held.ok() ? "held" : held.ToString().c_str());

  const std::vector<v1::TensorSpec> specs =
      synthetic::Checkpoint(*model, dtype);
  Manifest manifest;
  for (const auto& s : specs) *manifest.Add() = s;
  auto plan = PlanChunks(manifest, o.chunk_mib << 20);
  CHECK(plan.ok()) << plan.status();
  // The trainer's packed update. The IPC backend reads the shared buffer
  // itself: the packed update (whole mode) or a ring of chunk slots that
  // the trainer fills from it chunk by chunk (--ipc_ring_slots).
  void* flat_dev = nullptr;
  const bool ring = ipc && o.ipc_ring_slots > 0;
  const int64_t shared_bytes =
      ring ? o.ipc_ring_slots * (o.chunk_mib << 20) : plan->total_bytes;
  void* shared = nullptr;
  v1::Allocation source;
  static cuda::VmmMemory vmm;  // --memory=vmm: alive until exit
  if (ring) CHECK_CUDA(cudaMalloc(&flat_dev, plan->total_bytes));
  if (ipc && o.memory == "vmm") {
    auto m = cuda::VmmAllocateExportable(o.device, shared_bytes);
    CHECK(m.ok()) << m.status();
    vmm = *m;
    shared = vmm.ptr;
    source.set_kind(v1::MEMORY_CUDA_VMM);
    source.set_handle(absl::StrCat(getpid(), ":", vmm.fd));
    source.set_size(vmm.size);
  } else {
    // A whole number of 2 MiB: memory shared by a legacy handle copies at
    // half speed otherwise (docs/protocol.md, "CUDA IPC").
    const int64_t rounded =
        (shared_bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
    CHECK_CUDA(cudaMalloc(&shared, rounded));
    if (ipc) source = IpcSource(shared, rounded, o.device);
  }
  source.set_device_uuid(GpuUuid(o.device));
  if (!ring) flat_dev = shared;
  std::string source_id;
  if (ipc && !ring && o.registered_source && o.sparse_densities.empty()) {
    v1::RegisterSourceRequest r;
    *r.mutable_tensors() = manifest;
    *r.add_allocations() = source;
    for (int64_t offset : plan->tensor_offsets) {
      v1::SourcePlacement* p = r.add_placements();
      p->set_allocation(0);
      p->set_offset(offset);
    }
    auto registered = (*client)->RegisterSource(r);
    CHECK(registered.ok()) << registered.status();
    source_id = registered->source_id();
    std::printf("trainer: registered source %s (%lld tensors)\n",
                source_id.c_str(),
                static_cast<long long>(registered->tensors()));
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<uint8_t> flat;
  int64_t filled = -1;
  static std::atomic<int64_t> finished{0};
  const bool pause_series = o.pause_series || o.stall_phase == "pause";
  if (pause_series) {
    // Engines paused once for the whole series: Start then pauses nothing
    // and Finish resumes nothing (the RL loop of a trainer that syncs
    // several times in a row).
    v1::PauseRequest pause;
    pause.set_mode(v1::PAUSE_MODE_KEEP);
    auto paused = (*client)->Pause(pause);
    CHECK(paused.ok()) << paused.status();
  }
  if (!o.stall_phase.empty()) {
    std::printf("trainer: stalled at %s, before update-%lld\n",
                o.stall_phase.c_str(), static_cast<long long>(o.first_version));
    std::fflush(stdout);
    raise(SIGSTOP);
  }
  Layouts layouts;  // the engines' layouts, for the receipts' expectation
  for (int u = 0; u < o.updates; ++u) {
    const int64_t version = o.first_version + u;
    const int64_t data_version = o.same_data ? o.first_version : version;
    if (filled != data_version) {
      Fill(specs, *plan, data_version, &flat);
      CHECK_CUDA(cudaMemcpy(flat_dev, flat.data(), flat.size(),
                            cudaMemcpyHostToDevice));
      // A pageable upload may return before its DMA lands: wait, since
      // the daemon (IPC) and our non-blocking stream read it next.
      CHECK_CUDA(cudaDeviceSynchronize());
      filled = data_version;
    }
    if (version == o.corrupt_version && !specs.empty()) {
      // An exponent bit of the first element of the first tensor: it
      // survives any dtype conversion. The host copy stays as it was.
      const int64_t at =
          plan->tensor_offsets[0] + ElementSize(specs[0].dtype()) - 1;
      uint8_t byte = flat[at] ^ 0x40;
      CHECK_CUDA(cudaMemcpy(static_cast<uint8_t*>(flat_dev) + at, &byte, 1,
                            cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaDeviceSynchronize());
      filled = -1;  // restore it for the next version
      std::printf("trainer: corrupted byte %lld of the v%lld broadcast\n",
                  static_cast<long long>(at), static_cast<long long>(version));
    }
    v1::StartWeightUpdateRequest req;
    req.set_update_id(absl::StrCat("update-", version));
    req.set_target_version(version);
    req.set_chunk_bytes(o.chunk_mib << 20);
    if (!source_id.empty()) {
      // One call: the daemon starts, copies from the source and finishes.
      req.set_source_id(source_id);
      req.set_finish(true);
      req.set_finish_timeout_ms(o.finish_timeout_ms);
    } else {
      *req.mutable_tensors() = manifest;
      if (ipc) *req.mutable_ipc_source() = source;
      if (ring) req.set_ipc_ring_slots(o.ipc_ring_slots);
    }
    req.set_verify(o.receipts ? v1::VERIFY_ON : v1::VERIFY_OFF);
    if (o.mode == "staged") {
      req.set_mode(v1::UPDATE_MODE_STAGED);
      req.set_allow_streaming_fallback(o.allow_streaming_fallback);
    }
    std::thread([version, limit = o.update_timeout_s,
                 &done_version = finished] {
      absl::SleepFor(absl::Seconds(limit));
      if (done_version.load() < version) {
        std::printf("trainer: update v%lld not done after %lld s; exiting\n",
                    static_cast<long long>(version),
                    static_cast<long long>(limit));
        std::fflush(stdout);
        _exit(4);
      }
    }).detach();
    const absl::Time t0 = absl::Now();  // the watchdog above is ours
    auto started = (*client)->StartWeightUpdate(req);
    const absl::Time t_started = absl::Now();
    if (!started.ok()) {
      std::printf("start failed: %s\n", started.status().ToString().c_str());
      return 1;
    }
    if (ring) {
      // Fill slot k % slots with chunk k once the daemon has read what was
      // there, announce it, go on.
      const int slots = o.ipc_ring_slots;
      auto chunks = (*client)->OpenIpcChunks(req.update_id());
      absl::Status s;
      for (const Chunk& c : plan->chunks) {
        if (o.die_after_chunks >= 0 && c.index == o.die_after_chunks) {
          std::printf("trainer: dying after %lld chunks of update-%lld\n",
                      static_cast<long long>(c.index),
                      static_cast<long long>(version));
          std::fflush(stdout);
          _exit(9);
        }
        StallAt(o, c.index, version);
        if (c.index >= slots) s = chunks->WaitDone(c.index - slots + 1);
        if (!s.ok()) break;
        CHECK_CUDA(cudaMemcpyAsync(static_cast<uint8_t*>(shared) +
                                       (c.index % slots) * (o.chunk_mib << 20),
                                   static_cast<uint8_t*>(flat_dev) + c.offset,
                                   c.size, cudaMemcpyDeviceToDevice, stream));
        CHECK_CUDA(cudaStreamSynchronize(stream));
        s = chunks->Ready(c.index);
        if (!s.ok()) break;
      }
      absl::Status closed = chunks->Close();
      if (s.ok()) s = closed;
      if (!s.ok()) std::printf("ipc ring: %s\n", s.ToString().c_str());
    }
    for (const Chunk& c : plan->chunks) {
      if (ipc) break;  // the daemon pulls the bytes itself
      if (o.die_after_chunks >= 0 && c.index == o.die_after_chunks) {
        CHECK_CUDA(cudaStreamSynchronize(stream));
        std::printf("trainer: dying after %lld chunks of update-%lld\n",
                    static_cast<long long>(c.index),
                    static_cast<long long>(version));
        std::fflush(stdout);
        _exit(9);
      }
      if (c.index == o.stall_after_chunks) {
        CHECK_CUDA(cudaStreamSynchronize(stream));
        StallAt(o, c.index, version);
      }
      uint8_t* p = static_cast<uint8_t*>(flat_dev) + c.offset;
      CHECK_NCCL(ncclBroadcast(p, p, c.size, ncclUint8, 0, comm, stream));
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    if (o.stall_after_chunks >= static_cast<int64_t>(plan->chunks.size())) {
      StallAt(o, o.stall_after_chunks, version);
    }
    auto done = source_id.empty()
                    ? (*client)->FinishWeightUpdate(req.update_id())
                    : absl::StatusOr<v1::FinishWeightUpdateResponse>(
                          started->finished());
    const double s = absl::ToDoubleSeconds(absl::Now() - t0);
    if (!done.ok()) {
      std::printf("update v%lld failed: %s\n", static_cast<long long>(version),
                  done.status().ToString().c_str());
      return 1;
    }
    const v1::UpdateTimings& t = done->timings();
    std::printf(
        "update v%lld: %zu tensors, %.1f MB, %lld chunks, %.4f s, "
        "%.1f GB/s, %d engines; ms: %s; receipts %.2f; "
        "mode %s pause_seconds %.6f receipts_s %.6f seconds %.6f bytes %lld\n",
        static_cast<long long>(version), specs.size(), plan->total_bytes / 1e6,
        static_cast<long long>(plan->chunks.size()), s,
        plan->total_bytes / s / 1e9, done->engines_size(),
        Breakdown(absl::ToDoubleSeconds(t_started - t0), t).c_str(),
        t.receipts_s() * 1e3,
        started->mode() == v1::UPDATE_MODE_STAGED ? "staged" : "streaming",
        done->pause_seconds(), t.receipts_s(), done->seconds(),
        static_cast<long long>(plan->total_bytes));
    std::fflush(stdout);
    if (o.receipts) {
      int with = 0;
      for (const v1::EngineResult& e : done->engines()) {
        with += e.has_receipt() ? 1 : 0;
      }
      if (!o.check_receipts) {
        std::printf("update v%lld: %d receipts (not checked)\n",
                    static_cast<long long>(version), with);
      } else {
        const absl::Time t_expect = absl::Now();
        auto status = layouts.For(**client, *done);
        absl::Status checked = status.status();
        const char* where = "host";
        if (checked.ok() && o.gpu_expectation && !ring &&
            o.corrupt_version != version) {
          std::vector<HostTensor> on_gpu;
          for (size_t i = 0; i < specs.size(); ++i) {
            on_gpu.push_back({specs[i], static_cast<uint8_t*>(flat_dev) +
                                            plan->tensor_offsets[i]});
          }
          checked = CheckReceiptsOnGpu(*done, **status, on_gpu, stream);
          where = "gpu";
        }
        if (checked.ok() ? false
                         : checked.code() == absl::StatusCode::kUnimplemented) {
          checked = absl::OkStatus();
          where = "host";
        }
        if (status.ok() && std::string(where) == "host") {
          std::vector<HostTensor> tensors;
          for (size_t i = 0; i < specs.size(); ++i) {
            tensors.push_back(
                {specs[i], flat.data() + plan->tensor_offsets[i]});
          }
          checked = CheckReceipts(*done, **status, tensors);
        }
        const double expect_s = absl::ToDoubleSeconds(absl::Now() - t_expect);
        if (checked.ok() && with != done->engines_size()) {
          checked = absl::InternalError(absl::StrCat(
              with, " receipts for ", done->engines_size(), " engines"));
        }
        std::printf("update v%lld: receipts %s, expectation on the %s %.6f s\n",
                    static_cast<long long>(version),
                    checked.ok()
                        ? absl::StrCat("ok (", with, " engines)").c_str()
                        : checked.ToString().c_str(),
                    where, expect_s);
        std::fflush(stdout);
        if (!checked.ok()) _exit(5);
      }
      std::fflush(stdout);
    }
  }
  if (!o.sparse_densities.empty()) {
    CHECK(!ipc || !ring) << "--sparse_densities: not with --ipc_ring_slots";
    CHECK_GE(o.updates, 1) << "--sparse_densities: the first step needs "
                              "a dense update to patch";
    const int rc = SparseSeries(
        o, **client, specs, *plan, flat, static_cast<uint8_t*>(flat_dev), comm,
        stream, o.first_version + o.updates - 1, ipc ? &source : nullptr);
    if (rc != 0) return rc;
  }
  if (pause_series) {
    auto resumed = (*client)->Resume(v1::ResumeRequest());
    CHECK(resumed.ok()) << resumed.status();
  }
  if (o.baseline_copy) {
    // The IPC ceiling: one plain on-GPU copy of the same bytes.
    void* dst = nullptr;
    CHECK_CUDA(cudaMalloc(&dst, plan->total_bytes));
    std::vector<double> secs;
    for (int r = 0; r < 6; ++r) {
      const absl::Time t0 = absl::Now();
      CHECK_CUDA(cudaMemcpyAsync(dst, flat_dev, plan->total_bytes,
                                 cudaMemcpyDeviceToDevice, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      if (r > 0) secs.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    }
    std::sort(secs.begin(), secs.end());
    const double s = secs[secs.size() / 2];
    std::printf("baseline on-GPU copy: %.1f MB, %.4f s, %.1f GB/s\n",
                plan->total_bytes / 1e6, s, plan->total_bytes / s / 1e9);
    std::fflush(stdout);
  }
  _exit(0);  // NCCL teardown can hang; nothing is left to flush
}

}  // namespace weightsync
