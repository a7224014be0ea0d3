// weightsync_gpu_trainer's sparse series (--sparse_densities): per step
// the weights change at about that fraction of the elements, the trainer
// diffs them on the GPU against the ones it sent last, sends the patches,
// then the same weights dense (gpu_trainer_main.cc describes the tool).
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

// The elements of tensor `t` (numel n, es bytes) that step `version`
// changes: about density * n of them, spread evenly with a pseudo-random
// jitter; each gets new bits in its upper mantissa (a change that survives
// conversion to bfloat16 or float16, never touches the sign or exponent).
void ChangeSome(uint8_t* t, int64_t n, int es, double density, int64_t version,
                uint64_t salt) {
  const int64_t want = std::max<int64_t>(1, static_cast<int64_t>(density * n));
  const int64_t step = std::max<int64_t>(1, n / want);
  for (int64_t k = 0; k < want && k * step < n; ++k) {
    uint64_t h =
        (salt + k * 0x9E3779B97F4A7C15ull) ^ (version * 0xBF58476D1CE4E5B9ull);
    h ^= h >> 31;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 29;
    const int64_t i =
        std::min(n - 1, k * step + static_cast<int64_t>(h % step));
    const int byte = es >= 4 ? 2 : 0;  // float32: bits 16..22; 16-bit: 0..6
    t[i * es + byte] ^= static_cast<uint8_t>(1 + (h >> 40) % 127);
  }
}

// The sparse steps of --sparse_densities. `flat` / `flat_dev`: the weights
// sent last, on the host and on the device. NCCL, or with `dense_source`
// (the IPC handle of `flat_dev`) the IPC backend: the patches then go in a
// buffer of their own, shared the same way.
int SparseSeries(const GpuTrainerOptions& o, TrainerClient& client,
                 const std::vector<v1::TensorSpec>& specs,
                 const ChunkPlan& dense_plan, std::vector<uint8_t>& flat,
                 uint8_t* flat_dev, ncclComm_t comm, cudaStream_t stream,
                 int64_t version, const v1::Allocation* dense_source) {
  std::vector<double> densities;
  for (absl::string_view d : absl::StrSplit(o.sparse_densities, ',')) {
    double v = 0;
    CHECK(absl::SimpleAtod(d, &v) && v > 0 && v <= 1) << d;
    densities.push_back(v);
  }
  const int n = specs.size();
  std::vector<int64_t> numel(n), es(n), ib(n), cap(n), scratch_at(n);
  int64_t scratch = 0;
  size_t work_bytes = 8;
  for (int i = 0; i < n; ++i) {
    es[i] = ElementSize(specs[i].dtype());
    numel[i] = dense_plan.payload_bytes[i] / es[i];
    ib[i] = numel[i] <= (int64_t{1} << 32) ? 4 : 8;
    cap[i] = static_cast<int64_t>(o.sparse_max_density * numel[i]);
    scratch_at[i] = scratch;
    scratch += (cap[i] * (ib[i] + es[i]) + 255) / 256 * 256;
    work_bytes =
        std::max(work_bytes, cuda::DiffWorkspaceBytes(numel[i], es[i]));
  }
  uint8_t *after_dev = nullptr, *scratch_dev = nullptr, *work = nullptr;
  int64_t* counts_dev = nullptr;
  CHECK_CUDA(cudaMalloc(&after_dev, dense_plan.total_bytes));
  CHECK_CUDA(cudaMalloc(&scratch_dev, std::max<int64_t>(scratch, 256)));
  CHECK_CUDA(cudaMalloc(&work, work_bytes));
  CHECK_CUDA(cudaMalloc(&counts_dev, n * sizeof(int64_t)));
  uint8_t* patch_dev = nullptr;
  int64_t patch_bytes = 0;
  v1::Allocation patch_source;
  std::vector<int> staged_steps;
  for (absl::string_view d :
       absl::StrSplit(o.sparse_staged_steps, ',', absl::SkipEmpty())) {
    int v = 0;
    CHECK(absl::SimpleAtoi(d, &v)) << d;
    staged_steps.push_back(v);
  }
  int64_t last_committed = version;
  for (int step = 0; step < static_cast<int>(densities.size()); ++step) {
    const double density = densities[step];
    // The next weights, on the host and on the GPU.
    ++version;
    for (int i = 0; i < n; ++i) {
      ChangeSome(flat.data() + dense_plan.tensor_offsets[i], numel[i], es[i],
                 density, version, i * 0x632BE59BD9B4E019ull);
    }
    CHECK_CUDA(cudaMemcpy(after_dev, flat.data(), flat.size(),
                          cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaDeviceSynchronize());
    // Diff on the GPU against what was sent last, then pack the patches
    // (and the tensors that changed too much, dense) as the plan says.
    const absl::Time t_diff = absl::Now();
    for (int i = 0; i < n; ++i) {
      uint8_t* idx = scratch_dev + scratch_at[i];
      CHECK_CUDA(cuda::DiffChanged(flat_dev + dense_plan.tensor_offsets[i],
                                   after_dev + dense_plan.tensor_offsets[i],
                                   numel[i], es[i], work, work_bytes, idx,
                                   idx + cap[i] * ib[i], cap[i], counts_dev + i,
                                   stream, ib[i]));
    }
    std::vector<int64_t> counts(n);
    CHECK_CUDA(cudaMemcpyAsync(counts.data(), counts_dev, n * sizeof(int64_t),
                               cudaMemcpyDeviceToHost, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    Manifest manifest;
    int sparse_tensors = 0;
    int64_t nnz_total = 0;
    for (int i = 0; i < n; ++i) {
      v1::TensorSpec* t = manifest.Add();
      *t = specs[i];
      if (counts[i] > 0 && counts[i] <= cap[i]) {
        t->set_sparse_nnz(counts[i]);
        t->set_sparse_index_bytes(ib[i]);
        ++sparse_tensors;
        nnz_total += counts[i];
      }
    }
    const int64_t patch_chunk =
        (o.sparse_chunk_mib > 0 ? o.sparse_chunk_mib : o.chunk_mib) << 20;
    auto plan = PlanChunks(manifest, patch_chunk);
    CHECK(plan.ok()) << plan.status();
    if (plan->total_bytes > patch_bytes) {
      if (patch_dev != nullptr) CHECK_CUDA(cudaFree(patch_dev));
      CHECK_CUDA(cudaMalloc(&patch_dev, plan->total_bytes));
      patch_bytes = plan->total_bytes;
      if (dense_source != nullptr) {
        patch_source = IpcSource(patch_dev, patch_bytes, o.device);
      }
    }
    for (int i = 0; i < n; ++i) {
      uint8_t* out = patch_dev + plan->tensor_offsets[i];
      if (manifest.Get(i).sparse_nnz() == 0) {
        CHECK_CUDA(cudaMemcpyAsync(
            out, after_dev + dense_plan.tensor_offsets[i],
            dense_plan.payload_bytes[i], cudaMemcpyDeviceToDevice, stream));
        continue;
      }
      const uint8_t* idx = scratch_dev + scratch_at[i];
      CHECK_CUDA(cudaMemcpyAsync(out, idx, counts[i] * ib[i],
                                 cudaMemcpyDeviceToDevice, stream));
      CHECK_CUDA(cudaMemcpyAsync(out + counts[i] * ib[i], idx + cap[i] * ib[i],
                                 counts[i] * es[i], cudaMemcpyDeviceToDevice,
                                 stream));
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    const double diff_s = absl::ToDoubleSeconds(absl::Now() - t_diff);

    const bool corrupt = step == o.sparse_corrupt_step;
    if (corrupt) {
      for (int i = 0; i < n; ++i) {
        if (manifest.Get(i).sparse_nnz() == 0) continue;
        const uint64_t far = ~uint64_t{0} >> 1;  // past any tensor
        CHECK_CUDA(cudaMemcpy(patch_dev + plan->tensor_offsets[i], &far, ib[i],
                              cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaDeviceSynchronize());
        std::printf("trainer: index 0 of the patch of '%s' set outside it\n",
                    specs[i].name().c_str());
        break;
      }
    }
    const bool staged = absl::c_linear_search(staged_steps, step);
    v1::StartWeightUpdateRequest req;
    req.set_update_id(absl::StrCat("update-", version));
    req.set_target_version(version);
    req.set_chunk_bytes(patch_chunk);
    req.set_sparse_base_version(last_committed);
    req.set_verify(v1::VERIFY_OFF);
    if (staged) req.set_mode(v1::UPDATE_MODE_STAGED);
    *req.mutable_tensors() = manifest;
    if (dense_source != nullptr) *req.mutable_ipc_source() = patch_source;
    absl::SleepFor(absl::Milliseconds(o.settle_ms));
    auto sparse = Send(client, req, *plan, patch_dev, comm, stream);
    if (!sparse.ok() && corrupt) {
      std::printf("sparse update v%lld (%s) refused: %s\n",
                  static_cast<long long>(version),
                  staged ? "staged" : "streaming",
                  sparse.status().ToString().c_str());
      PrintEngines(client);
      std::fflush(stdout);
    } else if (!sparse.ok()) {
      std::printf("sparse update v%lld failed: %s\n",
                  static_cast<long long>(version),
                  sparse.status().ToString().c_str());
      return 1;
    } else if (corrupt) {
      std::printf("sparse update v%lld with a bad index was NOT refused\n",
                  static_cast<long long>(version));
      return 1;
    }
    // The same weights, dense, as the next version.
    CHECK_CUDA(cudaMemcpy(flat_dev, after_dev, dense_plan.total_bytes,
                          cudaMemcpyDeviceToDevice));
    // cudaMemcpy returns before a device-to-device copy has run: without
    // this the daemon (IPC) or the broadcast on our non-blocking stream
    // read flat_dev while it was still being written, and the dense update
    // of the sparse benchmark raced this 16 GB copy for HBM (20 instead of
    // ~10-13 ms on one H200, 2026-11-24).
    CHECK_CUDA(cudaDeviceSynchronize());
    ++version;
    req.Clear();
    req.set_update_id(absl::StrCat("update-", version));
    req.set_target_version(version);
    req.set_chunk_bytes(o.chunk_mib << 20);
    req.set_verify(v1::VERIFY_OFF);
    for (const auto& s : specs) *req.add_tensors() = s;
    if (dense_source != nullptr) *req.mutable_ipc_source() = *dense_source;
    absl::SleepFor(absl::Milliseconds(o.settle_ms));
    auto dense = Send(client, req, dense_plan, flat_dev, comm, stream);
    if (!dense.ok()) {
      std::printf("dense update v%lld failed: %s\n",
                  static_cast<long long>(version),
                  dense.status().ToString().c_str());
      return 1;
    }
    last_committed = version;
    if (corrupt) continue;
    std::printf(
        "sparse step: density %g mode %s sparse v%lld dense v%lld: %d of %d "
        "tensors "
        "sparse, nnz %lld, bytes %lld of %lld (%.3f%%), sparse_s %.6f "
        "dense_s %.6f (%.2f%%), diff_pack_s %.6f (with it %.2f%%), "
        "sparse_device_s %.6f dense_device_s %.6f; sparse ms: %s; dense ms: "
        "%s\n",
        density, staged ? "staged" : "streaming",
        static_cast<long long>(version - 1), static_cast<long long>(version),
        sparse_tensors, n, static_cast<long long>(nnz_total),
        static_cast<long long>(plan->total_bytes),
        static_cast<long long>(dense_plan.total_bytes),
        100.0 * plan->total_bytes / dense_plan.total_bytes, sparse->seconds,
        dense->seconds, 100.0 * sparse->seconds / dense->seconds, diff_s,
        100.0 * (sparse->seconds + diff_s) / dense->seconds,
        sparse->done.timings().device_s(), dense->done.timings().device_s(),
        Breakdown(*sparse).c_str(), Breakdown(*dense).c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace weightsync
