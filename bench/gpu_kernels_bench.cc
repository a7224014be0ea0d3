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
#include <vector>

#include "gflags/gflags.h"
#include "tools/synthetic/synthetic_model.h"

#if WEIGHTSYNC_HAS_CUDA
#include <cuda_runtime.h>

#include "backends/cuda/receipt_kernels.h"
#include "backends/cuda/scatter.h"
#include "backends/cuda/sparse_kernels.h"
#endif

DEFINE_int32(device, 0, "CUDA device ordinal");
DEFINE_string(model, "qwen3-8b", "synthetic model shapes for the receipt");
DEFINE_int32(repeats, 5, "timed runs per figure (after one warm-up)");
DEFINE_double(sparse_gib, 1.0, "size of the patched tensor, GiB");
DEFINE_double(density, 0.01, "fraction of elements a patch changes");

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

// Random-ish bytes, fast: a pattern the receipt can't shortcut.
void FillPattern(uint8_t* dev, int64_t bytes, cudaStream_t stream) {
  std::vector<uint64_t> host(1 << 20);
  uint64_t x = 0x12345678;
  for (uint64_t& v : host) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = x;
  }
  const int64_t block = host.size() * 8;
  for (int64_t at = 0; at < bytes; at += block) {
    CHECK_CUDA(cudaMemcpyAsync(dev + at, host.data(),
                               std::min(block, bytes - at),
                               cudaMemcpyHostToDevice, stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
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

int Run() {
  CHECK_CUDA(cudaSetDevice(FLAGS_device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, FLAGS_device));
  std::printf("device %d: %s, %d SMs\n\n", FLAGS_device, prop.name,
              prop.multiProcessorCount);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Timer timer(stream);
  Receipts(stream, timer);
  Sparse(stream, timer);
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
