// Micro-benchmark of the issue 5 GPU kernels on one GPU, each against a
// cudaMemcpy (device to device) of the same bytes on the same GPU:
//
//   receipt: ReceiptSumBatch over every parameter of --model in bfloat16
//       (Qwen3-8B: 399 tensors, 16.4 GB) packed in one buffer, one launch;
//       then ReceiptSum over the whole buffer seen as one run of elements of
//       1, 2, 4 and 8 bytes. GB/s = bytes read / time.
//   sparse: a --density patch (sorted indices, one per 1/density elements)
//       of a --sparse_gib tensor: SparseCheckIndices, SparseApply float32 ->
//       bfloat16 (whole parameter; and a column shard, half the columns),
//       bfloat16 -> bfloat16; against the dense copies of the same tensor
//       (cudaMemcpy; CopyConvert2D float32 -> bfloat16).
//   sparse_model: a --density patch of every bfloat16 parameter of
//       --sparse_model through the worker's batched check and apply
//       (SparseCheckBatch, SparseApplyBatch), against a cudaMemcpy of all
//       the parameters, and probe kernels (bench/sparse_probe.h) that tell
//       how much of the apply is the scattered 2-byte writes themselves.
//   diff: DiffChanged of two bfloat16 tensors of --sparse_gib differing at
//       --density, and of two equal ones.
//
// Each figure is the median of --repeats runs after one warm-up, timed with
// CUDA events on one stream. Run on a GPU machine:
//   bazel run //bench:gpu_kernels_bench -- --repeats=10
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "gflags/gflags.h"
#include "tools/synthetic/synthetic_model.h"

#if WEIGHTSYNC_HAS_CUDA
#include <cuda_runtime.h>

#include "backends/cuda/quant_kernels.h"
#include "backends/cuda/receipt_kernels.h"
#include "backends/cuda/scatter.h"
#include "backends/cuda/sparse_kernels.h"
#include "bench/fp8_probe.h"
#include "bench/sparse_probe.h"
#endif

DEFINE_int32(device, 0, "CUDA device ordinal");
DEFINE_string(model, "qwen3-8b", "synthetic model shapes for the receipt");
DEFINE_int32(repeats, 5, "timed runs per figure (after one warm-up)");
DEFINE_double(sparse_gib, 1.0, "size of the patched tensor, GiB");
DEFINE_double(density, 0.01, "fraction of elements a patch changes");
DEFINE_string(sparse_model, "qwen3-8b",
              "model whose every bfloat16 parameter gets a --density patch "
              "for the batched apply and its probes (empty: skip)");
DEFINE_string(sections, "receipt,sparse,sparse_model",
              "which sections to run, comma-separated");

namespace weightsync {
namespace {

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "gpu_kernels_bench: %s\n", what.c_str());
  std::exit(1);
}

#if WEIGHTSYNC_HAS_CUDA

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    Die(std::string(what) + ": " + cudaGetErrorString(err));
  }
}
#define CHECK_CUDA(x) Check((x), #x)

class Timer {
 public:
  explicit Timer(cudaStream_t stream) : stream_(stream) {
    CHECK_CUDA(cudaEventCreate(&start_));
    CHECK_CUDA(cudaEventCreate(&stop_));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  // Median seconds of `fn` (which enqueues on the stream) over --repeats
  // runs after one warm-up.
  double Median(const std::function<void()>& fn) {
    fn();
    CHECK_CUDA(cudaStreamSynchronize(stream_));
    std::vector<double> s;
    for (int i = 0; i < FLAGS_repeats; ++i) {
      CHECK_CUDA(cudaEventRecord(start_, stream_));
      fn();
      CHECK_CUDA(cudaEventRecord(stop_, stream_));
      CHECK_CUDA(cudaEventSynchronize(stop_));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
      s.push_back(ms / 1e3);
    }
    std::sort(s.begin(), s.end());
    return s[s.size() / 2];
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_, stop_;
};

uint8_t* Malloc(int64_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, static_cast<size_t>(bytes)));
  return static_cast<uint8_t*>(p);
}

void Line(const char* what, int64_t bytes, double sec, double memcpy_sec) {
  std::printf("%-52s %9.3f ms %8.1f GB/s %7.2fx memcpy\n", what, sec * 1e3,
              bytes / sec / 1e9, sec / memcpy_sec);
}

// `bytes` of device memory filled with `host`'s bytes over and over.
template <typename T>
void FillRepeated(uint8_t* dev, int64_t bytes, const std::vector<T>& host,
                  cudaStream_t stream) {
  const int64_t block = static_cast<int64_t>(host.size() * sizeof(T));
  for (int64_t at = 0; at < bytes; at += block) {
    CHECK_CUDA(cudaMemcpyAsync(dev + at, host.data(),
                               std::min(block, bytes - at),
                               cudaMemcpyHostToDevice, stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
}

// Random-ish bytes, fast: a pattern the receipt can't shortcut.
void FillPattern(uint8_t* dev, int64_t bytes, cudaStream_t stream) {
  std::vector<uint64_t> host(1 << 20);
  uint64_t x = 0x12345678;
  for (uint64_t& v : host) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = x;
  }
  FillRepeated(dev, bytes, host, stream);
}

void Receipts(cudaStream_t stream, Timer& timer) {
  auto model = synthetic::ModelByName(FLAGS_model);
  if (!model.ok()) Die(model.status().ToString());
  const std::vector<v1::TensorSpec> tensors =
      synthetic::Checkpoint(*model, v1::BFLOAT16);
  std::vector<int64_t> numel;
  int64_t total = 0;
  for (const v1::TensorSpec& t : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape()) n *= d;
    numel.push_back(n);
    total += (n * 2 + 255) / 256 * 256;
  }
  std::printf("receipt: %s, %zu bfloat16 parameters, %.2f GB\n",
              FLAGS_model.c_str(), tensors.size(), total / 1e9);
  uint8_t* buf = Malloc(total);
  uint8_t* copy = Malloc(total);
  uint8_t* outs = Malloc(8 * 8);
  FillPattern(buf, total, stream);
  auto* out = reinterpret_cast<unsigned long long*>(outs);

  std::vector<cuda::ReceiptRegion> regions;
  int64_t at = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    cuda::ReceiptRegion r{};
    r.base = buf + at;
    r.rows = 1;
    r.cols = numel[i];
    r.es = 2;
    r.salt = 0x9E3779B97F4A7C15ull * (i + 1);
    r.out = out;
    regions.push_back(r);
    at += (numel[i] * 2 + 255) / 256 * 256;
  }
  const int64_t tiles =
      cuda::PlanReceiptRegions(regions.data(), regions.size());
  if (tiles < 0) Die("bad receipt region");
  uint8_t* table = Malloc(regions.size() * sizeof(cuda::ReceiptRegion));
  CHECK_CUDA(cudaMemcpy(table, regions.data(),
                        regions.size() * sizeof(cuda::ReceiptRegion),
                        cudaMemcpyHostToDevice));

  const double memcpy_sec = timer.Median([&] {
    CHECK_CUDA(
        cudaMemcpyAsync(copy, buf, total, cudaMemcpyDeviceToDevice, stream));
  });
  Line("cudaMemcpy D2D (same bytes)", total, memcpy_sec, memcpy_sec);
  const double batch_sec = timer.Median([&] {
    CHECK_CUDA(cudaMemsetAsync(outs, 0, 8, stream));
    CHECK_CUDA(cuda::ReceiptSumBatch(
        reinterpret_cast<const cuda::ReceiptRegion*>(table), regions.size(),
        tiles, stream));
  });
  Line("ReceiptSumBatch, every parameter, one launch", total, batch_sec,
       memcpy_sec);
  for (int es : {1, 2, 4, 8}) {
    const double sec = timer.Median([&] {
      CHECK_CUDA(cudaMemsetAsync(outs + 8, 0, 8, stream));
      CHECK_CUDA(cuda::ReceiptSum(buf, 1, total / es, 0, es, 42, 0,
                                  reinterpret_cast<uint64_t*>(outs + 8),
                                  stream));
    });
    const std::string what =
        "ReceiptSum, one run of " + std::to_string(es) + "-byte elements";
    Line(what.c_str(), total, sec, memcpy_sec);
  }
  CHECK_CUDA(cudaFree(table));
  CHECK_CUDA(cudaFree(outs));
  CHECK_CUDA(cudaFree(copy));
  CHECK_CUDA(cudaFree(buf));
}

void Sparse(cudaStream_t stream, Timer& timer) {
  const int64_t n = static_cast<int64_t>(FLAGS_sparse_gib * (1 << 30)) / 4;
  const int64_t step = std::max<int64_t>(1, std::llround(1 / FLAGS_density));
  const int64_t nnz = n / step;
  std::printf(
      "\nsparse: float32 tensor of %lld elements (%.2f GiB), patch of %lld "
      "(%.3f%%)\n",
      static_cast<long long>(n), n * 4.0 / (1 << 30),
      static_cast<long long>(nnz), 100.0 * nnz / n);
  // One index per `step` elements at a random offset in its step: sorted,
  // unique, spread over the whole tensor.
  std::vector<int64_t> index(nnz);
  uint64_t x = 99;
  for (int64_t k = 0; k < nnz; ++k) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    index[k] = k * step + static_cast<int64_t>((x >> 33) % step);
  }
  uint8_t* src32 = Malloc(n * 4);
  uint8_t* dst32 = Malloc(n * 4);
  uint8_t* bf_a = Malloc(n * 2);
  uint8_t* bf_b = Malloc(n * 2);
  uint8_t* payload = Malloc(nnz * (8 + 4));
  uint8_t* report = Malloc(sizeof(cuda::SparseIndexReport));
  FillPattern(src32, n * 4, stream);
  FillPattern(bf_a, n * 2, stream);
  CHECK_CUDA(
      cudaMemcpy(payload, index.data(), nnz * 8, cudaMemcpyHostToDevice));
  FillPattern(payload + nnz * 8, nnz * 4, stream);
  const auto* idx = reinterpret_cast<const int64_t*>(payload);
  const uint8_t* values = payload + nnz * 8;
  constexpr int kF32 = 1, kBf16 = 2;

  const double memcpy_sec = timer.Median([&] {
    CHECK_CUDA(
        cudaMemcpyAsync(dst32, src32, n * 4, cudaMemcpyDeviceToDevice, stream));
  });
  Line("dense: cudaMemcpy D2D of the float32 tensor", n * 4, memcpy_sec,
       memcpy_sec);
  const double convert_sec = timer.Median([&] {
    CHECK_CUDA(
        cuda::CopyConvert2D(src32, 0, kF32, bf_b, 0, kBf16, 1, n, stream));
  });
  Line("dense: CopyConvert2D float32 -> bfloat16", n * 6, convert_sec,
       memcpy_sec);
  const double check_sec = timer.Median([&] {
    CHECK_CUDA(cuda::SparseCheckIndices(
        idx, nnz, n, reinterpret_cast<cuda::SparseIndexReport*>(report),
        stream));
  });
  Line("sparse: SparseCheckIndices", nnz * 8, check_sec, memcpy_sec);
  cuda::SparseUse whole{};
  whole.param = bf_b;
  whole.dtype = kBf16;
  whole.implicit = true;
  const double apply_sec = timer.Median([&] {
    CHECK_CUDA(cuda::SparseApply(idx, values, kF32, nnz, 1, n, whole, stream));
  });
  Line("sparse: SparseApply float32 -> bfloat16, whole", nnz * 14, apply_sec,
       memcpy_sec);
  // The tensor as [n / 4096, 4096]; the use takes columns [2048, 4096).
  const int64_t cols = 4096, rows = n / cols;
  cuda::SparseUse shard{};
  shard.param = bf_b;
  shard.dtype = kBf16;
  shard.row_begin = 0;
  shard.row_count = rows;
  shard.col_begin = cols / 2;
  shard.col_count = cols / 2;
  shard.dest_offset = 0;
  shard.dest_row_stride = cols / 2;
  const double shard_sec = timer.Median([&] {
    CHECK_CUDA(cuda::SparseApply(idx, values, kF32, nnz, cols, rows * cols,
                                 shard, stream));
  });
  Line("sparse: SparseApply float32 -> bfloat16, column shard", nnz * 14,
       shard_sec, memcpy_sec);
  // bfloat16 values: the first nnz * 2 bytes of the float32 values.
  const double same_sec = timer.Median([&] {
    CHECK_CUDA(cuda::SparseApply(idx, values, kBf16, nnz, 1, n, whole, stream));
  });
  Line("sparse: SparseApply bfloat16 -> bfloat16, whole", nnz * 12, same_sec,
       memcpy_sec);
  std::printf(
      "sparse apply + check / dense convert copy: %.3f; patch bytes / dense "
      "float32 bytes: %.4f\n",
      (apply_sec + check_sec) / convert_sec, nnz * 12.0 / (n * 4.0));

  // Diff: bf_a vs bf_b = bf_a patched at the same indices.
  std::printf("\ndiff: two bfloat16 tensors of %lld elements (%.2f GiB)\n",
              static_cast<long long>(n), n * 2.0 / (1 << 30));
  const int64_t capacity = nnz + 1024;
  uint8_t* out_idx = Malloc(capacity * 8);
  uint8_t* out_val = Malloc(capacity * 2);
  uint8_t* count = Malloc(8);
  const size_t work_bytes = cuda::DiffWorkspaceBytes(n, 2);
  uint8_t* work = Malloc(work_bytes);
  CHECK_CUDA(cudaMemcpy(bf_b, bf_a, n * 2, cudaMemcpyDeviceToDevice));
  const double memcpy_bf_sec = timer.Median([&] {
    CHECK_CUDA(
        cudaMemcpyAsync(dst32, bf_a, n * 2, cudaMemcpyDeviceToDevice, stream));
  });
  Line("cudaMemcpy D2D of one bfloat16 tensor", n * 2, memcpy_bf_sec,
       memcpy_bf_sec);
  auto diff = [&] {
    CHECK_CUDA(cuda::DiffChanged(
        bf_a, bf_b, n, 2, work, work_bytes, reinterpret_cast<int64_t*>(out_idx),
        out_val, capacity, reinterpret_cast<int64_t*>(count), stream));
  };
  const double equal_sec = timer.Median(diff);
  Line("DiffChanged, equal tensors (reads both)", n * 4, equal_sec,
       memcpy_bf_sec);
  // Changes: the float32 patch values' high halves, almost all different.
  CHECK_CUDA(cuda::SparseApply(idx, values, kBf16, nnz, 1, n, whole, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const double diff_sec = timer.Median(diff);
  int64_t changed = 0;
  CHECK_CUDA(cudaMemcpy(&changed, count, 8, cudaMemcpyDeviceToHost));
  const std::string what = "DiffChanged, " + std::to_string(changed) +
                           " changed (reads both, twice)";
  Line(what.c_str(), n * 4, diff_sec, memcpy_bf_sec);

  for (uint8_t* p : {src32, dst32, bf_a, bf_b, payload, report, out_idx,
                     out_val, count, work}) {
    CHECK_CUDA(cudaFree(p));
  }
}

// A --density patch of every bfloat16 parameter of --sparse_model (uint32
// indices, one per 1/density elements at a random offset in its step), laid
// out as one chunk of the wire would hold them (indices then values per
// patch, 256-byte aligned), applied by the worker's batched launches into
// parameters that sit in one allocation like an engine's: how long the
// check and the apply take, against a cudaMemcpy of all the parameters'
// bytes (a dense on-GPU update), and against probe kernels that isolate
// the cost of the scattered 2-byte writes (bench/sparse_probe.h).
void SparseModel(cudaStream_t stream, Timer& timer) {
  auto model = synthetic::ModelByName(FLAGS_sparse_model);
  if (!model.ok()) Die(model.status().ToString());
  const std::vector<v1::TensorSpec> tensors =
      synthetic::Checkpoint(*model, v1::BFLOAT16);
  const int64_t step = std::max<int64_t>(1, std::llround(1 / FLAGS_density));
  auto align = [](int64_t b) { return (b + 255) / 256 * 256; };
  std::vector<int64_t> numel, nnz, param_at, patch_at;
  int64_t param_bytes = 0, patch_bytes = 0, total_nnz = 0;
  for (const v1::TensorSpec& t : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape()) n *= d;
    numel.push_back(n);
    nnz.push_back(n / step);
    param_at.push_back(param_bytes);
    patch_at.push_back(patch_bytes);
    param_bytes += align(n * 2);
    patch_bytes += align(nnz.back() * 4) + align(nnz.back() * 2);
    total_nnz += nnz.back();
  }
  std::printf(
      "\nsparse model: %s, %zu bfloat16 parameters (%.2f GB), a %.3f%% patch "
      "of each: %lld entries, %.1f MB with 4-byte indices\n",
      FLAGS_sparse_model.c_str(), tensors.size(), param_bytes / 1e9,
      100.0 / step, static_cast<long long>(total_nnz), patch_bytes / 1e6);
  uint8_t* params = Malloc(param_bytes);
  uint8_t* copy = Malloc(param_bytes);
  uint8_t* patch = Malloc(patch_bytes);
  FillPattern(params, param_bytes, stream);
  FillPattern(patch, patch_bytes, stream);  // values; indices below
  {
    std::vector<uint32_t> host;
    uint64_t x = 7;
    for (size_t i = 0; i < tensors.size(); ++i) {
      host.resize(nnz[i]);
      for (int64_t k = 0; k < nnz[i]; ++k) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        host[k] = static_cast<uint32_t>(k * step +
                                        static_cast<int64_t>((x >> 33) % step));
      }
      CHECK_CUDA(cudaMemcpy(patch + patch_at[i], host.data(), nnz[i] * 4,
                            cudaMemcpyHostToDevice));
    }
  }
  const int64_t n = tensors.size();
  uint8_t* reports = Malloc(n * sizeof(cuda::SparseIndexReport));
  std::vector<cuda::SparseJob> checks(n), applies(n);
  for (int64_t i = 0; i < n; ++i) {
    cuda::SparseJob& j = checks[i];
    j = cuda::SparseJob{};
    j.indices = patch + patch_at[i];
    j.values = patch + patch_at[i] + align(nnz[i] * 4);
    j.report = reinterpret_cast<cuda::SparseIndexReport*>(reports) + i;
    j.nnz = nnz[i];
    j.cols = 1;
    j.numel = numel[i];
    j.index_bytes = 4;
    j.value_dtype = 2;  // BFLOAT16
    applies[i] = j;
    applies[i].use.param = params + param_at[i];
    applies[i].use.dtype = 2;
    applies[i].use.implicit = true;
  }
  int64_t check_tiles = 0, apply_tiles = 0;
  CHECK_CUDA(cuda::PlanSparseJobs(checks.data(), n, false, &check_tiles));
  CHECK_CUDA(cuda::PlanSparseJobs(applies.data(), n, true, &apply_tiles));
  uint8_t* jobs = Malloc(2 * n * sizeof(cuda::SparseJob) +
                         std::max(check_tiles, apply_tiles) * 4);
  auto* check_dev = reinterpret_cast<cuda::SparseJob*>(jobs);
  auto* apply_dev = check_dev + n;
  auto* tile_jobs = reinterpret_cast<int32_t*>(apply_dev + n);
  CHECK_CUDA(cudaMemcpy(check_dev, checks.data(), n * sizeof(cuda::SparseJob),
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(apply_dev, applies.data(), n * sizeof(cuda::SparseJob),
                        cudaMemcpyHostToDevice));

  const double memcpy_sec = timer.Median([&] {
    CHECK_CUDA(cudaMemcpyAsync(copy, params, param_bytes,
                               cudaMemcpyDeviceToDevice, stream));
  });
  Line("cudaMemcpy D2D of every parameter (dense)", param_bytes, memcpy_sec,
       memcpy_sec);
  const double check_sec = timer.Median([&] {
    CHECK_CUDA(cuda::SparseResetReports(
        reinterpret_cast<cuda::SparseIndexReport*>(reports), n, stream));
    CHECK_CUDA(
        cuda::SparseCheckBatch(check_dev, n, check_tiles, tile_jobs, stream));
  });
  Line("SparseCheckBatch (+ reset), every patch", total_nnz * 4, check_sec,
       memcpy_sec);
  const double apply_sec = timer.Median([&] {
    CHECK_CUDA(
        cuda::SparseApplyBatch(apply_dev, n, apply_tiles, tile_jobs, stream));
  });
  Line("SparseApplyBatch, every patch (guarded)", total_nnz * 6, apply_sec,
       memcpy_sec);

  // The probes' tile tables.
  std::vector<bench::ProbePatch> probes(n);
  std::vector<int32_t> tile_patch;
  std::vector<int64_t> tile_first;
  for (int64_t i = 0; i < n; ++i) {
    probes[i] = bench::ProbePatch{
        reinterpret_cast<const uint32_t*>(patch + patch_at[i]),
        reinterpret_cast<const uint16_t*>(patch + patch_at[i] +
                                          align(nnz[i] * 4)),
        reinterpret_cast<uint16_t*>(params + param_at[i]), nnz[i]};
    for (int64_t k = 0; k < nnz[i]; k += bench::kProbeTileEntries) {
      tile_patch.push_back(static_cast<int32_t>(i));
      tile_first.push_back(k);
    }
  }
  const int64_t tiles = tile_patch.size();
  uint8_t* probe_mem = Malloc(n * sizeof(bench::ProbePatch) + tiles * 12 + 16);
  auto* probe_dev = reinterpret_cast<bench::ProbePatch*>(probe_mem);
  auto* first_dev =
      reinterpret_cast<int64_t*>(probe_mem + n * sizeof(bench::ProbePatch));
  auto* tp_dev = reinterpret_cast<int32_t*>(first_dev + tiles);
  CHECK_CUDA(cudaMemcpy(probe_dev, probes.data(), n * sizeof(bench::ProbePatch),
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(first_dev, tile_first.data(), tiles * 8,
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(
      cudaMemcpy(tp_dev, tile_patch.data(), tiles * 4, cudaMemcpyHostToDevice));
  const std::pair<bench::Probe, const char*> kProbes[] = {
      {bench::Probe::kStoreOnly, "probe: scattered stores only"},
      {bench::Probe::kStridedRegs, "probe: apply, strided, loads first"},
      {bench::Probe::kRunPerThread, "probe: apply, 8 consecutive per thread"},
      {bench::Probe::kStreaming, "probe: apply, strided, streaming stores"},
      {bench::Probe::kQuarterTiles, "probe: apply, a quarter tile per block"},
      {bench::Probe::kEighthTiles, "probe: apply, an eighth tile per block"},
      {bench::Probe::kSectorRmw, "probe: read + write whole 32 B sectors"},
  };
  for (const auto& [probe, what] : kProbes) {
    const double sec = timer.Median([&, probe = probe] {
      CHECK_CUDA(bench::LaunchProbe(probe, probe_dev, tp_dev, first_dev, tiles,
                                    stream));
    });
    Line(what, total_nnz * 6, sec, memcpy_sec);
  }
  std::printf(
      "sparse model: (check + apply) / dense copy = %.3f; %.1f G entries/s "
      "applied\n",
      (check_sec + apply_sec) / memcpy_sec, total_nnz / apply_sec / 1e9);
  for (uint8_t* p : {params, copy, patch, reports, jobs, probe_mem}) {
    CHECK_CUDA(cudaFree(p));
  }
}

// The linear weights of --model (2-D, "proj" in the name: what an FP8
// engine holds in float8_e4m3fn with 128 x 128 block scales) in bfloat16,
// small normal-ish values (no NaN, inf or subnormal: the kernels' common
// path), quantised by QuantizeFp8Direct (one launch, every kernel) and the
// probe variants (bench/fp8_probe.h), against a cudaMemcpy of the same
// source bytes (what a bf16 engine's update of these weights moves) and
// with the daemon's receipt pass over the FP8 bytes written. Each probe's
// output is compared with cvt's (a checksum of both).
void Fp8(cudaStream_t stream, Timer& timer) {
  auto model = synthetic::ModelByName(FLAGS_model);
  if (!model.ok()) Die(model.status().ToString());
  const std::vector<v1::TensorSpec> tensors =
      synthetic::Checkpoint(*model, v1::BFLOAT16);
  std::vector<std::pair<int64_t, int64_t>> shapes;
  int64_t src_bytes = 0, q_bytes = 0, scale_bytes = 0;
  for (const v1::TensorSpec& t : tensors) {
    if (t.shape_size() != 2 || t.name().find("proj") == std::string::npos ||
        t.shape(0) % 128 != 0 || t.shape(1) % 128 != 0) {
      continue;
    }
    shapes.emplace_back(t.shape(0), t.shape(1));
    src_bytes += t.shape(0) * t.shape(1) * 2;
    q_bytes += t.shape(0) * t.shape(1);
    scale_bytes += (t.shape(0) / 128) * (t.shape(1) / 128) * 4;
  }
  std::printf(
      "\nfp8: %s, %zu linear weights, %.2f GB bfloat16 -> %.2f GB "
      "e4m3 + %.1f MB scales\n",
      FLAGS_model.c_str(), shapes.size(), src_bytes / 1e9, q_bytes / 1e9,
      scale_bytes / 1e6);
  uint8_t* src = Malloc(src_bytes);
  uint8_t* copy = Malloc(src_bytes);
  uint8_t* q = Malloc(q_bytes);
  uint8_t* scales = Malloc(scale_bytes);
  uint8_t* outs = Malloc(16);
  {
    // bf16 of x * 2^-7 for x roughly uniform in (-2, 2): weights' range.
    std::vector<uint16_t> host(1 << 22);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (uint16_t& v : host) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const uint32_t e = 119 + static_cast<uint32_t>((x >> 33) % 8);
      v = static_cast<uint16_t>(((x >> 63) << 15) | (e << 7) |
                                ((x >> 20) & 0x7F));
    }
    FillRepeated(src, src_bytes, host, stream);
  }
  std::vector<cuda::DirectJob> jobs;
  int64_t s_at = 0, q_at = 0, sc_at = 0, blocks = 0;
  for (const auto& [rows, cols] : shapes) {
    cuda::DirectJob job{};
    job.src = src + s_at;
    job.src_stride = cols;
    job.src_dtype = cuda::kFp8SrcBfloat16;
    job.out.rows = rows;
    job.out.width = cols;
    job.out.block_rows = 128;
    job.out.block_cols = 128;
    job.out.q = q + q_at;
    job.out.q_stride = cols;
    job.out.scale = scales + sc_at;
    job.out.scale_stride = cols / 128;
    job.first_block = blocks;
    jobs.push_back(job);
    blocks += (rows / 128) * (cols / 128);
    s_at += rows * cols * 2;
    q_at += rows * cols;
    sc_at += (rows / 128) * (cols / 128) * 4;
  }
  uint8_t* jobs_dev = Malloc(sizeof(cuda::DirectJob) * jobs.size());
  CHECK_CUDA(cudaMemcpy(jobs_dev, jobs.data(),
                        sizeof(cuda::DirectJob) * jobs.size(),
                        cudaMemcpyHostToDevice));
  const auto* jd = reinterpret_cast<const cuda::DirectJob*>(jobs_dev);
  const int n = static_cast<int>(jobs.size());
  const double memcpy_sec = timer.Median([&] {
    CHECK_CUDA(cudaMemcpyAsync(copy, src, src_bytes, cudaMemcpyDeviceToDevice,
                               stream));
  });
  Line("cudaMemcpy D2D of the bf16 source", src_bytes, memcpy_sec, memcpy_sec);
  auto* out = reinterpret_cast<unsigned long long*>(outs);
  auto checksum = [&](unsigned long long* at) {
    CHECK_CUDA(cudaMemsetAsync(at, 0, 8, stream));
    CHECK_CUDA(cuda::ReceiptSum(q, 1, q_bytes, 0, 1, 7, 0,
                                reinterpret_cast<uint64_t*>(at), stream));
    CHECK_CUDA(cuda::ReceiptSum(scales, 1, scale_bytes / 4, 0, 4, 9, 0,
                                reinterpret_cast<uint64_t*>(at), stream));
    unsigned long long h = 0;
    CHECK_CUDA(cudaMemcpyAsync(&h, at, 8, cudaMemcpyDeviceToHost, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    return h;
  };
  const char* names[3] = {"regs", "vec", "cvt"};
  unsigned long long want = 0;
  for (int k = 0; k < 3; ++k) {
    const double sec = timer.Median([&] {
      CHECK_CUDA(cuda::QuantizeFp8Direct(
          jd, n, blocks, stream, static_cast<cuda::Fp8DirectKernel>(k)));
    });
    const unsigned long long h = checksum(out);
    if (k == 0) want = h;
    const std::string what = std::string("QuantizeFp8Direct ") + names[k] +
                             (h == want ? "" : " (DIFFERS from regs)");
    Line(what.c_str(), src_bytes, sec, memcpy_sec);
  }
  for (bool receipts : {false, true}) {
    // The lean kernel (the default's kernel for these jobs), without and
    // with its fused receipt (into outs + 8), keyed so that its sum is the
    // checksum pass's over the bytes and scales it wrote (every job's
    // bytes and scales numbered on from the job before).
    int64_t q_first = 0, scale_first = 0;
    for (cuda::DirectJob& job : jobs) {
      job.receipt = cuda::DirectReceipt{};
      if (receipts) {
        job.receipt.out = reinterpret_cast<unsigned long long*>(outs + 8);
        job.receipt.q_salt = 7;
        job.receipt.scale_salt = 9;
        job.receipt.q_first = static_cast<uint64_t>(q_first);
        job.receipt.scale_first = static_cast<uint64_t>(scale_first);
      }
      q_first += job.out.rows * job.out.width;
      scale_first += (job.out.rows / 128) * (job.out.width / 128);
    }
    CHECK_CUDA(cudaMemcpy(jobs_dev, jobs.data(),
                          sizeof(cuda::DirectJob) * jobs.size(),
                          cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemsetAsync(q, 0, q_bytes, stream));
    const double sec = timer.Median([&] {
      CHECK_CUDA(cuda::QuantizeFp8DirectLean(
          jd, n, blocks, cuda::kFp8SrcBfloat16, stream, receipts));
    });
    const unsigned long long h = checksum(out);
    bool fused_ok = true;
    if (receipts) {  // one more run for the fused sum alone
      unsigned long long f = 0;
      CHECK_CUDA(cudaMemsetAsync(outs + 8, 0, 8, stream));
      CHECK_CUDA(cuda::QuantizeFp8DirectLean(
          jd, n, blocks, cuda::kFp8SrcBfloat16, stream, true));
      CHECK_CUDA(
          cudaMemcpyAsync(&f, outs + 8, 8, cudaMemcpyDeviceToHost, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      fused_ok = f == h;
    }
    const std::string what =
        std::string("QuantizeFp8DirectLean") +
        (receipts ? " + fused receipt" : "") +
        (h == want ? "" : " (DIFFERS from regs)") +
        (fused_ok ? "" : " (FUSED SUM != the receipt pass's)");
    Line(what.c_str(), src_bytes, sec, memcpy_sec);
  }
  {
    // What the lean kernel's finite blocks rely on (VecEncode2, kFinite).
    unsigned long long* bad = reinterpret_cast<unsigned long long*>(copy);
    unsigned long long h[3] = {0, 0, 0};
    CHECK_CUDA(cudaMemsetAsync(bad, 0, sizeof(h), stream));
    CHECK_CUDA(bench::Fp8SatfiniteCheck(bad, stream));
    CHECK_CUDA(
        cudaMemcpyAsync(h, bad, sizeof(h), cudaMemcpyDeviceToHost, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::printf(
        "satfinite cvt vs Fp8Encode, every finite float32: e4m3fn %llu "
        "differ, e5m2 %llu differ (first 0x%08llx) %s\n",
        h[0], h[1], h[2], h[0] == 0 && h[1] == 0 ? "OK" : "FAIL");
  }
  const double receipt_sec = timer.Median([&] { checksum(out + 1); });
  Line("receipt pass over the FP8 bytes and scales (+ sync)", q_bytes,
       receipt_sec, memcpy_sec);
  for (int threads : {256, 512}) {
    for (int variant : {0, 1, 2, 3, 4, 5, 8, 16}) {
      if (threads == 512 && variant >= 8) continue;
      CHECK_CUDA(cudaMemsetAsync(q, 0, q_bytes, stream));
      const double sec = timer.Median([&] {
        CHECK_CUDA(bench::Fp8Probe(variant, threads, jd, n, blocks, stream));
      });
      const unsigned long long h = checksum(out);
      char what[128];
      std::snprintf(what, sizeof(what), "probe %d threads%s%s%s%s", threads,
                    (variant & 1) ? " +ahead" : "",
                    (variant & 2) ? " +markstein" : "",
                    (variant & 4)    ? " +mul-only"
                    : (variant & 8)  ? " lean's quotient"
                    : (variant & 16) ? " lean's write"
                                     : "",
                    h == want ? "" : " (DIFFERS)");
      Line(what, src_bytes, sec, memcpy_sec);
    }
  }
  for (uint8_t* p : {src, copy, q, scales, outs, jobs_dev}) {
    CHECK_CUDA(cudaFree(p));
  }
}

bool Section(const char* name) {
  for (absl::string_view s : absl::StrSplit(FLAGS_sections, ',')) {
    if (s == name) return true;
  }
  return false;
}

int Run() {
  CHECK_CUDA(cudaSetDevice(FLAGS_device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, FLAGS_device));
  std::printf("device %d: %s, %d SMs\n\n", FLAGS_device, prop.name,
              prop.multiProcessorCount);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Timer timer(stream);
  if (Section("receipt")) Receipts(stream, timer);
  if (Section("sparse")) Sparse(stream, timer);
  if (Section("fp8")) Fp8(stream, timer);
  if (Section("sparse_model") && !FLAGS_sparse_model.empty()) {
    SparseModel(stream, timer);
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

#endif  // WEIGHTSYNC_HAS_CUDA

int Main() {
  if (FLAGS_repeats < 1) Die("--repeats must be >= 1");
  if (!(FLAGS_density > 0 && FLAGS_density <= 1)) {
    Die("--density must be in (0, 1]");
  }
#if WEIGHTSYNC_HAS_CUDA
  return Run();
#else
  Die("built without CUDA");
#endif
}

}  // namespace
}  // namespace weightsync

int main(int argc, char** argv) {
  gflags::SetUsageMessage("receipt, sparse and diff kernels vs cudaMemcpy");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  setvbuf(stdout, nullptr, _IOLBF, 0);
  return weightsync::Main();
}
