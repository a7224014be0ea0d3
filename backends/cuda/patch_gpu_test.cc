// The receipt, sparse-patch and diff kernels on a real GPU, bit for bit
// against the daemon's host code: ComputeReceipt (daemon/core/receipt.cc)
// and common/checksum.h for receipts, ApplySparsePatch
// (backends/host/host_data_plane.cc) for patches, a plain loop for diffs.
// Needs a GPU: tagged "gpu" and "manual" in BUILD, and skips itself where no
// device is visible.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/gpu_test_util.h"
#include "backends/cuda/kernel_math.h"
#include "backends/cuda/patch_test_util.h"
#include "backends/cuda/receipt_kernels.h"
#include "backends/cuda/sparse_kernels.h"
#include "backends/host/host_data_plane.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/engine_layout.h"
#include "daemon/core/receipt.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync {
namespace cuda {
namespace {

using patch_test::FillRandom;

using gpu_testing::DeviceBuffer;
using gpu_testing::HaveGpu;
using PatchGpuTest = gpu_testing::GpuStreamTest;

// Index of the first differing byte, or -1.
int64_t FirstDifference(const std::vector<uint8_t>& a,
                        const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  const auto m = std::mismatch(a.begin(), a.end(), b.begin());
  return m.first == a.end() ? -1 : m.first - a.begin();
}

// ---------------------------------------------------------------------------
// Receipts.

// Every segment of patch_test::ReceiptEngine() (all element sizes, strided,
// misaligned, narrow and wide rows) in one batched launch, and region by
// region with ReceiptSum: both equal ComputeReceipt of the same bytes.
TEST_F(PatchGpuTest, ReceiptOfAnEngineMatchesComputeReceipt) {
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(patch_test::ReceiptEngine(), mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  MappedRegion& host = *(*layout)->regions[0];
  FillRandom(host.data(), host.size(), 5);
  const auto sources = patch_test::ReceiptSources();
  auto want = ComputeReceipt(**layout, sources);
  ASSERT_TRUE(want.ok()) << want.status();

  DeviceBuffer region(host.size()), outs(2 * sizeof(uint64_t));
  ASSERT_NE(region.get(), nullptr);
  ASSERT_NE(outs.get(), nullptr);
  ASSERT_CUDA_OK(cudaMemcpy(region.get(), host.data(), host.size(),
                            cudaMemcpyHostToDevice));
  ASSERT_CUDA_OK(cudaMemset(outs.get(), 0, outs.bytes()));
  auto* out = reinterpret_cast<unsigned long long*>(outs.get());

  std::vector<ReceiptRegion> regions =
      patch_test::ReceiptRegionsOf(**layout, sources, region.get(), out);
  for (const ReceiptRegion& r : regions) {
    ASSERT_CUDA_OK(ReceiptSum(r.base, r.rows, r.cols, r.row_stride_bytes, r.es,
                              r.salt, r.first_index,
                              reinterpret_cast<uint64_t*>(out + 1), stream_));
  }
  const int64_t total = PlanReceiptRegions(regions.data(), regions.size());
  ASSERT_GT(total, 0);
  DeviceBuffer table(regions.size() * sizeof(ReceiptRegion));
  ASSERT_CUDA_OK(cudaMemcpyAsync(table.get(), regions.data(), table.bytes(),
                                 cudaMemcpyHostToDevice, stream_));
  ASSERT_CUDA_OK(
      ReceiptSumBatch(reinterpret_cast<const ReceiptRegion*>(table.get()),
                      regions.size(), total, stream_));
  uint64_t got[2];
  ASSERT_CUDA_OK(cudaMemcpyAsync(got, outs.get(), sizeof(got),
                                 cudaMemcpyDeviceToHost, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(got[0], want->checksum()) << "batched";
  EXPECT_EQ(got[1], want->checksum()) << "one region at a time";
}

struct RandomRegions {
  std::vector<ReceiptRegion> regions;  // bases into the device buffer
  std::vector<uint64_t> want;
};

// `count` random regions over `host` (mirrored at `device`): every element
// size, misaligned starts, dense and strided rows, narrow to multi-tile
// rows, empty ones, indices wrapping around 2^64; region i adds to outs[i].
RandomRegions MakeRandomRegions(const std::vector<uint8_t>& host,
                                const uint8_t* device, int count,
                                unsigned long long* outs, uint64_t seed) {
  std::mt19937_64 rng(seed);
  RandomRegions out;
  const int64_t size = host.size();
  for (int i = 0; i < count; ++i) {
    ReceiptRegion r{};
    r.es = 1 << (rng() % 4);
    const int64_t tile = kReceiptTileBytes / r.es;
    int64_t rows = 0, cols = 0;
    switch (rng() % 7) {
      case 0:
        rows = 1;
        cols = 1 + rng() % (40 * tile);
        break;
      case 1:
        rows = 1 + rng() % 2000;
        cols = 1 + rng() % 20;
        break;
      case 2:
        rows = 1 + rng() % 6;
        cols = tile - 3 + rng() % 7;
        break;
      case 3:
        rows = 1 + rng() % 5;
        cols = 1 + rng() % (5 * tile);
        break;
      case 4:
        rows = rng() % 2;
        cols = rows == 0 ? rng() % 5 : 0;
        break;
      case 5:  // large: many blocks on one region
        rows = 1 + rng() % 3;
        cols = (1 << 20) / r.es + rng() % 1000;
        break;
      default:
        rows = 1 + rng() % 100;
        cols = 1 + rng() % 3000;
        break;
    }
    const int64_t stride =
        rng() % 3 == 0 ? cols : cols + static_cast<int64_t>(rng() % 40);
    const int64_t span =
        rows == 0 || cols == 0 ? 0 : ((rows - 1) * stride + cols) * r.es;
    int64_t at = static_cast<int64_t>(rng() % (size - span - 64));
    at = at / 16 * 16 + (rng() % 16) / r.es * r.es;
    r.rows = rows;
    r.cols = cols;
    r.row_stride_bytes = stride * r.es;
    r.salt = rng();
    r.first_index = rng() % 4 == 0 ? ~uint64_t{0} - rng() % 100 : rng() % 1000;
    r.out = outs + i;
    r.base = host.data() + at;  // for the reference
    out.want.push_back(patch_test::ReferenceRegionSum(r, host.data() + at));
    r.base = device + at;
    out.regions.push_back(r);
  }
  return out;
}

TEST_F(PatchGpuTest, RandomRegionsMatchTheReferenceLoop) {
  constexpr int kRegions = 400;
  std::vector<uint8_t> host(64 << 20);
  FillRandom(host.data(), host.size(), 9);
  DeviceBuffer buffer(host.size()), outs(2 * kRegions * 8);
  ASSERT_NE(buffer.get(), nullptr);
  ASSERT_NE(outs.get(), nullptr);
  ASSERT_CUDA_OK(cudaMemcpy(buffer.get(), host.data(), host.size(),
                            cudaMemcpyHostToDevice));
  for (uint64_t seed : {1, 2, 3}) {
    SCOPED_TRACE(seed);
    auto* batch_out = reinterpret_cast<unsigned long long*>(outs.get());
    auto* single_out = batch_out + kRegions;
    RandomRegions rr =
        MakeRandomRegions(host, buffer.get(), kRegions, batch_out, seed);
    ASSERT_CUDA_OK(cudaMemsetAsync(outs.get(), 0, outs.bytes(), stream_));
    for (int i = 0; i < kRegions; ++i) {
      const ReceiptRegion& r = rr.regions[i];
      ASSERT_CUDA_OK(ReceiptSum(
          r.base, r.rows, r.cols, r.row_stride_bytes, r.es, r.salt,
          r.first_index, reinterpret_cast<uint64_t*>(single_out + i), stream_));
    }
    const int64_t total =
        PlanReceiptRegions(rr.regions.data(), rr.regions.size());
    ASSERT_GT(total, 0);
    DeviceBuffer table(rr.regions.size() * sizeof(ReceiptRegion));
    ASSERT_CUDA_OK(cudaMemcpyAsync(table.get(), rr.regions.data(),
                                   table.bytes(), cudaMemcpyHostToDevice,
                                   stream_));
    ASSERT_CUDA_OK(
        ReceiptSumBatch(reinterpret_cast<const ReceiptRegion*>(table.get()),
                        rr.regions.size(), total, stream_));
    std::vector<uint64_t> got(2 * kRegions);
    ASSERT_CUDA_OK(cudaMemcpyAsync(got.data(), outs.get(), outs.bytes(),
                                   cudaMemcpyDeviceToHost, stream_));
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    for (int i = 0; i < kRegions; ++i) {
      const ReceiptRegion& r = rr.regions[i];
      ASSERT_EQ(got[i], rr.want[i])
          << "batched, region " << i << ": rows " << r.rows << " cols "
          << r.cols << " es " << r.es;
      ASSERT_EQ(got[kRegions + i], rr.want[i])
          << "single, region " << i << ": rows " << r.rows << " cols " << r.cols
          << " es " << r.es;
    }
  }
}

// Copy regions (ReceiptCopyBatch, the receipt of an IPC update fused with
// its copy): the random regions copied to the same offsets of a second
// buffer, every region's bytes there equal to the source, every other byte
// untouched, and each sum the receipt of the source region.
TEST_F(PatchGpuTest, CopyRegionsCopyAndSum) {
  constexpr int kRegions = 400;
  std::vector<uint8_t> host(64 << 20), before(64 << 20);
  FillRandom(host.data(), host.size(), 10);
  FillRandom(before.data(), before.size(), 11);
  DeviceBuffer src(host.size()), dst(host.size()), outs(kRegions * 8);
  ASSERT_NE(src.get(), nullptr);
  ASSERT_NE(dst.get(), nullptr);
  ASSERT_CUDA_OK(
      cudaMemcpy(src.get(), host.data(), host.size(), cudaMemcpyHostToDevice));
  ASSERT_CUDA_OK(cudaMemcpy(dst.get(), before.data(), before.size(),
                            cudaMemcpyHostToDevice));
  auto* out = reinterpret_cast<unsigned long long*>(outs.get());
  RandomRegions rr = MakeRandomRegions(host, src.get(), kRegions, out, 4);
  std::vector<uint8_t> want = before;
  for (ReceiptRegion& r : rr.regions) {
    const int64_t at = static_cast<const uint8_t*>(r.base) - src.get();
    r.dst = dst.get() + at;
    r.dst_row_stride_bytes = r.row_stride_bytes;
    for (int64_t row = 0; row < r.rows; ++row) {
      std::memcpy(want.data() + at + row * r.row_stride_bytes,
                  host.data() + at + row * r.row_stride_bytes, r.cols * r.es);
    }
  }
  const int64_t total = PlanReceiptRegions(rr.regions.data(), kRegions);
  ASSERT_GT(total, 0);
  DeviceBuffer table(rr.regions.size() * sizeof(ReceiptRegion));
  ASSERT_CUDA_OK(cudaMemsetAsync(outs.get(), 0, outs.bytes(), stream_));
  ASSERT_CUDA_OK(cudaMemcpyAsync(table.get(), rr.regions.data(), table.bytes(),
                                 cudaMemcpyHostToDevice, stream_));
  ASSERT_CUDA_OK(
      ReceiptCopyBatch(reinterpret_cast<const ReceiptRegion*>(table.get()),
                       kRegions, total, stream_));
  std::vector<uint64_t> got(kRegions);
  std::vector<uint8_t> after(host.size());
  ASSERT_CUDA_OK(cudaMemcpyAsync(got.data(), outs.get(), outs.bytes(),
                                 cudaMemcpyDeviceToHost, stream_));
  ASSERT_CUDA_OK(cudaMemcpyAsync(after.data(), dst.get(), after.size(),
                                 cudaMemcpyDeviceToHost, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(FirstDifference(after, want), -1);
  for (int i = 0; i < kRegions; ++i) {
    ASSERT_EQ(got[i], rr.want[i]) << "region " << i;
  }
}

// A receipt over 64 MiB changes when any one byte does.
TEST_F(PatchGpuTest, ReceiptSeesOneFlippedBit) {
  constexpr int64_t kBytes = 64 << 20;
  std::vector<uint8_t> host(kBytes);
  FillRandom(host.data(), kBytes, 4);
  DeviceBuffer buf(kBytes), out(8);
  ASSERT_CUDA_OK(
      cudaMemcpy(buf.get(), host.data(), kBytes, cudaMemcpyHostToDevice));
  auto sum = [&](uint64_t* result) {
    ASSERT_CUDA_OK(cudaMemsetAsync(out.get(), 0, 8, stream_));
    ASSERT_CUDA_OK(ReceiptSum(buf.get(), 1, kBytes / 2, 0, 2, 77, 0,
                              reinterpret_cast<uint64_t*>(out.get()), stream_));
    ASSERT_CUDA_OK(
        cudaMemcpyAsync(result, out.get(), 8, cudaMemcpyDeviceToHost, stream_));
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  };
  uint64_t base = 0;
  sum(&base);
  EXPECT_EQ(base, RunTerms(77, 0, host.data(), kBytes / 2, 2));
  for (int64_t at : {int64_t{0}, int64_t{12345}, kBytes - 1}) {
    uint8_t b = host[at] ^ 0x10;
    ASSERT_CUDA_OK(cudaMemcpy(buf.get() + at, &b, 1, cudaMemcpyHostToDevice));
    uint64_t flipped = 0;
    sum(&flipped);
    EXPECT_NE(flipped, base) << "byte " << at;
    ASSERT_CUDA_OK(
        cudaMemcpy(buf.get() + at, &host[at], 1, cudaMemcpyHostToDevice));
  }
}

TEST_F(PatchGpuTest, ReceiptRefusesWhatItCannotRead) {
  DeviceBuffer buf(4096), out(8);
  auto* o = reinterpret_cast<uint64_t*>(out.get());
  uint8_t* p = buf.get();
  EXPECT_EQ(ReceiptSum(p, 1, 8, 0, 3, 0, 0, o, stream_), cudaErrorInvalidValue);
  EXPECT_EQ(ReceiptSum(p + 2, 1, 8, 0, 4, 0, 0, o, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(ReceiptSum(p, 2, 8, 14, 2, 0, 0, o, stream_),
            cudaErrorInvalidValue);  // stride shorter than a row
  EXPECT_EQ(ReceiptSum(p, 2, 8, 17, 2, 0, 0, o, stream_),
            cudaErrorInvalidValue);  // stride not a multiple of es
  EXPECT_EQ(ReceiptSum(p, 1, 8, 0, 2, 0, 0, nullptr, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(ReceiptSum(nullptr, 0, 8, 0, 2, 0, 0, nullptr, stream_),
            cudaSuccess);  // empty: a no-op
  EXPECT_EQ(ReceiptSumBatch(nullptr, 0, 0, stream_), cudaSuccess);
  EXPECT_EQ(ReceiptSumBatch(nullptr, 3, 5, stream_), cudaErrorInvalidValue);
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
}

// ---------------------------------------------------------------------------
// Sparse patches.

// Runs every patch of `update` through the host path on its engine's heap
// memory and through SparseCheckIndices and SparseApply on a device copy of
// the same bytes, and compares the whole region.
// Every patch of `update` through SparseCheckBatch + SparseApplyBatch at
// once, as the GPU worker launches them, into `region` (device); the host
// path has written `host` already. Checks the reports.
void ApplyBatched(cudaStream_t stream, const patch_test::PatchUpdate& update,
                  const CopyPlan& plan, uint8_t* region, bool expect_sorted) {
  const int n = plan.sparse.size();
  std::vector<int64_t> at(n);
  int64_t total = 0;
  for (int p = 0; p < n; ++p) {
    at[p] = total;
    total += (plan.sparse[p].payload_bytes + 255) / 256 * 256;
  }
  DeviceBuffer payloads(std::max<int64_t>(total, 256));
  DeviceBuffer reports(n * sizeof(SparseIndexReport) + 8);
  auto* report0 = reinterpret_cast<SparseIndexReport*>(reports.get());
  std::vector<SparseJob> checks, applies;
  for (int p = 0; p < n; ++p) {
    const SparsePatch& patch = plan.sparse[p];
    const std::string& payload = update.payloads[patch.tensor];
    ASSERT_CUDA_OK(cudaMemcpy(payloads.get() + at[p], payload.data(),
                              payload.size(), cudaMemcpyHostToDevice));
    SparseJob j{};
    j.indices = payloads.get() + at[p];
    j.values = payloads.get() + at[p] + patch.nnz * patch.index_bytes;
    j.report = report0 + p;
    j.nnz = patch.nnz;
    j.cols = patch.cols;
    j.numel = patch.numel;
    j.index_bytes = patch.index_bytes;
    j.value_dtype = patch.dtype;
    checks.push_back(j);
    for (const SparsePatch::Use& u : patch.uses) {
      j.use = patch_test::SparseUseOf(u, region);
      applies.push_back(j);
    }
  }
  int64_t check_tiles = 0, apply_tiles = 0;
  ASSERT_CUDA_OK(
      PlanSparseJobs(checks.data(), checks.size(), false, &check_tiles));
  ASSERT_CUDA_OK(
      PlanSparseJobs(applies.data(), applies.size(), true, &apply_tiles));
  DeviceBuffer check_jobs(checks.size() * sizeof(SparseJob) + 8);
  DeviceBuffer apply_jobs(applies.size() * sizeof(SparseJob) + 8);
  ASSERT_CUDA_OK(cudaMemcpy(check_jobs.get(), checks.data(),
                            checks.size() * sizeof(SparseJob),
                            cudaMemcpyHostToDevice));
  ASSERT_CUDA_OK(cudaMemcpy(apply_jobs.get(), applies.data(),
                            applies.size() * sizeof(SparseJob),
                            cudaMemcpyHostToDevice));
  // One tile table serves both batches (stream order).
  DeviceBuffer tile_jobs(std::max(check_tiles, apply_tiles) * 4 + 4);
  auto* table = reinterpret_cast<int32_t*>(tile_jobs.get());
  ASSERT_CUDA_OK(SparseResetReports(report0, n, stream));
  ASSERT_CUDA_OK(
      SparseCheckBatch(reinterpret_cast<const SparseJob*>(check_jobs.get()),
                       checks.size(), check_tiles, table, stream));
  ASSERT_CUDA_OK(
      SparseApplyBatch(reinterpret_cast<const SparseJob*>(apply_jobs.get()),
                       applies.size(), apply_tiles, table, stream));
  std::vector<SparseIndexReport> got(n);
  ASSERT_CUDA_OK(cudaMemcpyAsync(got.data(), report0, n * sizeof(got[0]),
                                 cudaMemcpyDeviceToHost, stream));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
  for (int p = 0; p < n; ++p) {
    SCOPED_TRACE(plan.sparse[p].name);
    EXPECT_EQ(got[p].out_of_range, 0);
    EXPECT_EQ(got[p].first_out_of_range, ~0ull);
    if (expect_sorted) {
      EXPECT_EQ(got[p].unsorted, 0);
    }
  }
}

void CheckPatchesAgainstHost(cudaStream_t stream,
                             const patch_test::PatchUpdate& update,
                             uint64_t seed, bool expect_sorted,
                             bool batched = false) {
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(update.engine, mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  MappedRegion& host = *(*layout)->regions[0];
  FillRandom(host.data(), host.size(), seed);
  DeviceBuffer region(host.size());
  ASSERT_NE(region.get(), nullptr);
  ASSERT_CUDA_OK(cudaMemcpy(region.get(), host.data(), host.size(),
                            cudaMemcpyHostToDevice));

  auto plan = BuildCopyPlan(update.manifest, 1 << 20, {*layout});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ((*plan)->sparse.size(), update.manifest.size());
  DeviceBuffer report_buf(sizeof(SparseIndexReport));
  for (const SparsePatch& patch : (*plan)->sparse) {
    SCOPED_TRACE(patch.name);
    const std::string& payload = update.payloads[patch.tensor];
    ASSERT_EQ(static_cast<int64_t>(payload.size()), patch.payload_bytes);
    ASSERT_TRUE(ApplySparsePatch(
                    **plan, patch,
                    reinterpret_cast<const uint8_t*>(payload.data()), nullptr)
                    .ok());
    if (batched) continue;

    DeviceBuffer dev_payload(payload.size());
    ASSERT_CUDA_OK(cudaMemcpyAsync(dev_payload.get(), payload.data(),
                                   payload.size(), cudaMemcpyHostToDevice,
                                   stream));
    const void* indices = dev_payload.get();
    const uint8_t* values = dev_payload.get() + patch.nnz * patch.index_bytes;
    auto* report = reinterpret_cast<SparseIndexReport*>(report_buf.get());
    ASSERT_CUDA_OK(SparseCheckIndices(indices, patch.nnz, patch.numel, report,
                                      stream, patch.index_bytes));
    for (const SparsePatch::Use& u : patch.uses) {
      // Guarded by the check, as the GPU worker applies them.
      ASSERT_CUDA_OK(SparseApply(indices, values, patch.dtype, patch.nnz,
                                 patch.cols, patch.numel,
                                 patch_test::SparseUseOf(u, region.get()),
                                 stream, patch.index_bytes, report));
    }
    SparseIndexReport got{};
    ASSERT_CUDA_OK(cudaMemcpyAsync(&got, report, sizeof(got),
                                   cudaMemcpyDeviceToHost, stream));
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_EQ(got.out_of_range, 0);
    EXPECT_EQ(got.first_out_of_range, ~0ull);
    if (expect_sorted) {
      EXPECT_EQ(got.unsorted, 0);
    }
  }
  if (batched) {
    ApplyBatched(stream, update, **plan, region.get(), expect_sorted);
    if (::testing::Test::HasFatalFailure()) return;
  }
  std::vector<uint8_t> want(host.data(), host.data() + host.size());
  std::vector<uint8_t> got(host.size());
  ASSERT_CUDA_OK(
      cudaMemcpy(got.data(), region.get(), got.size(), cudaMemcpyDeviceToHost));
  const int64_t at = FirstDifference(got, want);
  EXPECT_EQ(at, -1) << "first differing byte of engine memory";
}

// patch_test::SparseEngine: float32 and bfloat16 patches into bfloat16,
// float16 and float32 parameters, whole (implicit), through shards that cut
// rows and columns, side by side and fused; int32 bytewise.
TEST_F(PatchGpuTest, SparsePatchesMatchTheHostPath) {
  struct Case {
    double density;
    bool repeats, shuffle;
  };
  const Case cases[] = {
      {0.01, false, false}, {0.1, false, false},
      {0.9, false, false},  {0.05, true, false},  // repeats: the last one wins
      {0.6, true, false},   {0.3, false, true}};  // unsorted, unique
  uint64_t seed = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "density " << c.density << " repeats "
                                      << c.repeats << " shuffle " << c.shuffle);
    for (bool batched : {false, true}) {
      SCOPED_TRACE(batched ? "batched" : "one by one");
      CheckPatchesAgainstHost(
          stream_,
          patch_test::SparseEngineUpdate(c.density, c.repeats, c.shuffle, seed),
          seed, !c.shuffle, batched);
    }
    ++seed;
  }
}

// The same patches with 4-byte (uint32) indices on the wire
// (sparse_index_bytes = 4).
TEST_F(PatchGpuTest, FourByteIndicesMatchTheHostPath) {
  for (bool repeats : {false, true}) {
    patch_test::PatchUpdate u =
        patch_test::SparseEngineUpdate(0.2, repeats, false, 21);
    for (int i = 0; i < u.manifest.size(); ++i) {
      const int64_t n = u.manifest.Get(i).sparse_nnz();
      const std::string& wide = u.payloads[i];
      std::string narrow(wide.size() - 4 * n, '\0');
      for (int64_t k = 0; k < n; ++k) {
        int64_t v;
        std::memcpy(&v, &wide[k * 8], 8);
        const uint32_t w = static_cast<uint32_t>(v);
        std::memcpy(&narrow[k * 4], &w, 4);
      }
      std::memcpy(&narrow[n * 4], &wide[n * 8], wide.size() - 8 * n);
      u.payloads[i] = std::move(narrow);
      u.manifest.Mutable(i)->set_sparse_index_bytes(4);
    }
    SCOPED_TRACE(repeats);
    CheckPatchesAgainstHost(stream_, u, 22, true);
    CheckPatchesAgainstHost(stream_, u, 22, true, /*batched=*/true);
  }
}

// A patch with an index outside its tensor is refused whole when its apply
// is guarded by the check's report (the GPU worker's way), while an
// unguarded apply writes the indices in range and skips the other.
TEST_F(PatchGpuTest, GuardedApplyWritesNothingOfABadPatch) {
  for (int index_bytes : {8, 4}) {
    SCOPED_TRACE(index_bytes);
    const std::vector<int64_t> wide = {1, 4, 9, index_bytes == 8 ? -3 : 100};
    DeviceBuffer idx(64), vals(64), param(64), report_buf(32);
    std::vector<uint8_t> packed(wide.size() * index_bytes);
    for (size_t k = 0; k < wide.size(); ++k) {
      const uint32_t w = static_cast<uint32_t>(wide[k]);
      std::memcpy(&packed[k * index_bytes],
                  index_bytes == 8 ? static_cast<const void*>(&wide[k]) : &w,
                  index_bytes);
    }
    const std::vector<float> values = {1.5f, 2.5f, 3.5f, 4.5f};
    ASSERT_CUDA_OK(cudaMemcpy(idx.get(), packed.data(), packed.size(),
                              cudaMemcpyHostToDevice));
    ASSERT_CUDA_OK(
        cudaMemcpy(vals.get(), values.data(), 16, cudaMemcpyHostToDevice));
    ASSERT_CUDA_OK(cudaMemset(param.get(), 0, 64));
    auto* report = reinterpret_cast<SparseIndexReport*>(report_buf.get());
    SparseUse use{};
    use.param = param.get();
    use.dtype = v1::FLOAT32;
    use.implicit = true;
    ASSERT_CUDA_OK(
        SparseCheckIndices(idx.get(), 4, 16, report, stream_, index_bytes));
    ASSERT_CUDA_OK(SparseApply(idx.get(), vals.get(), v1::FLOAT32, 4, 1, 16,
                               use, stream_, index_bytes, report));
    std::vector<float> got(16, -1.0f);
    ASSERT_CUDA_OK(cudaMemcpyAsync(got.data(), param.get(), 64,
                                   cudaMemcpyDeviceToHost, stream_));
    SparseIndexReport r{};
    ASSERT_CUDA_OK(cudaMemcpyAsync(&r, report, sizeof(r),
                                   cudaMemcpyDeviceToHost, stream_));
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    EXPECT_EQ(r.out_of_range, 1);
    EXPECT_EQ(r.first_out_of_range, 3);
    EXPECT_EQ(got, std::vector<float>(16, 0.0f)) << "guarded: nothing written";
    ASSERT_CUDA_OK(SparseApply(idx.get(), vals.get(), v1::FLOAT32, 4, 1, 16,
                               use, stream_, index_bytes, nullptr));
    ASSERT_CUDA_OK(cudaMemcpyAsync(got.data(), param.get(), 64,
                                   cudaMemcpyDeviceToHost, stream_));
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    std::vector<float> want(16, 0.0f);
    want[1] = 1.5f;
    want[4] = 2.5f;
    want[9] = 3.5f;
    EXPECT_EQ(got, want) << "unguarded: the indices in range";
  }
}

// Every float pair on every bfloat16 / float16 pattern and 2^20 random
// float32 patterns, and every other dtype bytewise
// (patch_test::ConversionUpdate): bit for bit as ConvertElements.
// In a batch, a patch with an index outside its tensor writes nothing
// while the good patches beside it land; the planner refuses what
// SparseApply refuses.
TEST_F(PatchGpuTest, BatchRefusesOnlyTheBadPatch) {
  DeviceBuffer buf(1 << 16);
  uint8_t* p = buf.get();
  auto* reports = reinterpret_cast<SparseIndexReport*>(p);  // 2 reports
  auto* idx = reinterpret_cast<uint32_t*>(p + 1024);        // 2 x 4 indices
  auto* vals = reinterpret_cast<float*>(p + 2048);          // 2 x 4 values
  auto* param = reinterpret_cast<float*>(p + 4096);         // 2 x 16 floats
  const uint32_t host_idx[8] = {1, 4, 9, 15, 0, 2, 99, 3};  // 99: bad
  const float host_vals[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_CUDA_OK(cudaMemcpy(idx, host_idx, 32, cudaMemcpyHostToDevice));
  ASSERT_CUDA_OK(cudaMemcpy(vals, host_vals, 32, cudaMemcpyHostToDevice));
  ASSERT_CUDA_OK(cudaMemset(param, 0, 128));
  std::vector<SparseJob> jobs(2);
  for (int k = 0; k < 2; ++k) {
    SparseJob& j = jobs[k];
    j = SparseJob{};
    j.indices = idx + 4 * k;
    j.values = vals + 4 * k;
    j.report = reports + k;
    j.nnz = 4;
    j.cols = 16;
    j.numel = 16;
    j.index_bytes = 4;
    j.value_dtype = v1::FLOAT32;
    j.use.param = param + 16 * k;
    j.use.dtype = v1::FLOAT32;
    j.use.implicit = true;
  }
  int64_t tiles = 0;
  ASSERT_CUDA_OK(PlanSparseJobs(jobs.data(), 2, true, &tiles));
  EXPECT_EQ(tiles, 2);
  DeviceBuffer dev_jobs(2 * sizeof(SparseJob));
  ASSERT_CUDA_OK(cudaMemcpy(dev_jobs.get(), jobs.data(), 2 * sizeof(SparseJob),
                            cudaMemcpyHostToDevice));
  const auto* dj = reinterpret_cast<const SparseJob*>(dev_jobs.get());
  DeviceBuffer tile_jobs(2 * sizeof(int32_t));
  auto* table = reinterpret_cast<int32_t*>(tile_jobs.get());
  ASSERT_CUDA_OK(SparseResetReports(reports, 2, stream_));
  ASSERT_CUDA_OK(SparseCheckBatch(dj, 2, tiles, table, stream_));
  ASSERT_CUDA_OK(SparseApplyBatch(dj, 2, tiles, table, stream_));
  std::vector<float> got(32, -1.0f);
  SparseIndexReport r[2];
  ASSERT_CUDA_OK(
      cudaMemcpyAsync(got.data(), param, 128, cudaMemcpyDeviceToHost, stream_));
  ASSERT_CUDA_OK(
      cudaMemcpyAsync(r, reports, sizeof(r), cudaMemcpyDeviceToHost, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  std::vector<float> want(32, 0.0f);
  want[1] = 1;
  want[4] = 2;
  want[9] = 3;
  want[15] = 4;
  EXPECT_EQ(got, want);  // the second patch: nothing
  EXPECT_EQ(r[0].out_of_range, 0u);
  EXPECT_EQ(r[0].first_out_of_range, ~0ull);
  EXPECT_EQ(r[1].out_of_range, 1u);
  EXPECT_EQ(r[1].first_out_of_range, 2u);
  EXPECT_EQ(r[1].unsorted, 1u);  // 3 after 99

  // What SparseApply refuses, the planner refuses.
  SparseJob bad = jobs[0];
  bad.use.dtype = v1::INT32;  // float32 -> int32: no conversion
  EXPECT_EQ(PlanSparseJobs(&bad, 1, true, &tiles), cudaErrorInvalidValue);
  bad = jobs[0];
  bad.index_bytes = 2;
  EXPECT_EQ(PlanSparseJobs(&bad, 1, false, &tiles), cudaErrorInvalidValue);
  bad = jobs[0];
  bad.report = nullptr;  // a check needs somewhere to write
  EXPECT_EQ(PlanSparseJobs(&bad, 1, false, &tiles), cudaErrorInvalidValue);
  bad = jobs[0];
  bad.values = vals + 1;  // fine: 4-byte aligned
  bad.indices = reinterpret_cast<const uint8_t*>(idx) + 2;  // misaligned
  EXPECT_EQ(PlanSparseJobs(&bad, 1, true, &tiles), cudaErrorInvalidValue);
  EXPECT_EQ(SparseApplyBatch(nullptr, 1, 1, table, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(SparseApplyBatch(dj, 2, 2, nullptr, stream_),
            cudaErrorInvalidValue);  // no tile table
  EXPECT_EQ(SparseApplyBatch(dj, 2, 0, table, stream_), cudaSuccess);
}

TEST_F(PatchGpuTest, EveryConversionMatchesTheHostPath) {
  CheckPatchesAgainstHost(stream_, patch_test::ConversionUpdate(), 8, true);
}

TEST_F(PatchGpuTest, CheckIndicesReportsWhatIsWrong) {
  const std::vector<int64_t> indices = {0, 3, 3, 7, 2, 100, 5, -1, 6, 6, 6};
  DeviceBuffer dev(indices.size() * 8), report_buf(sizeof(SparseIndexReport));
  ASSERT_CUDA_OK(cudaMemcpy(dev.get(), indices.data(), dev.bytes(),
                            cudaMemcpyHostToDevice));
  auto* report = reinterpret_cast<SparseIndexReport*>(report_buf.get());
  ASSERT_CUDA_OK(SparseCheckIndices(reinterpret_cast<const int64_t*>(dev.get()),
                                    indices.size(), 100, report, stream_));
  SparseIndexReport got{};
  ASSERT_CUDA_OK(cudaMemcpyAsync(&got, report, sizeof(got),
                                 cudaMemcpyDeviceToHost, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(got.out_of_range, 2);        // 100 and -1
  EXPECT_EQ(got.first_out_of_range, 5);  // position of 100
  EXPECT_EQ(got.unsorted, 3);            // 7>2, 100>5, 5>-1
  EXPECT_EQ(got.repeated, 3);            // 3 3, 6 6, 6 6
  // An empty patch: a clean report.
  ASSERT_CUDA_OK(SparseCheckIndices(nullptr, 0, 100, report, stream_));
  ASSERT_CUDA_OK(cudaMemcpyAsync(&got, report, sizeof(got),
                                 cudaMemcpyDeviceToHost, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(got.out_of_range + got.unsorted + got.repeated, 0);
  EXPECT_EQ(got.first_out_of_range, ~0ull);
}

TEST_F(PatchGpuTest, SparseApplyRefusesWhatItCannotDo) {
  DeviceBuffer buf(4096);
  const auto* idx = reinterpret_cast<const int64_t*>(buf.get());
  const uint8_t* vals = buf.get() + 1024;
  SparseUse use{};
  use.param = buf.get() + 2048;
  use.implicit = true;
  use.dtype = v1::INT32;
  EXPECT_EQ(SparseApply(idx, vals, v1::FLOAT32, 4, 1, 4, use, stream_),
            cudaErrorInvalidValue);
  use.dtype = v1::FLOAT32;
  EXPECT_EQ(SparseApply(idx, vals, v1::FLOAT64, 4, 1, 4, use, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(SparseApply(idx, vals, 0, 4, 1, 4, use, stream_),
            cudaErrorInvalidValue);
  use.param = buf.get() + 2050;  // not aligned to 4
  EXPECT_EQ(SparseApply(idx, vals, v1::BFLOAT16, 4, 1, 4, use, stream_),
            cudaErrorInvalidValue);
  use.param = buf.get() + 2048;
  use.implicit = false;
  EXPECT_EQ(SparseApply(idx, vals, v1::BFLOAT16, 4, 0, 4, use, stream_),
            cudaErrorInvalidValue);  // no columns
  EXPECT_EQ(SparseApply(nullptr, nullptr, v1::BFLOAT16, 0, 1, 4, use, stream_),
            cudaSuccess);  // empty: a no-op
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
}

// ---------------------------------------------------------------------------
// The diff helper.

// `before` random; `after` equal but for about `density` of the elements:
// random new bits, or, for 2 bytes and more, +0.0 becoming -0.0 (equal as
// numbers, a change in bits).
void MakeDiffPair(int64_t n, int es, double density, uint64_t seed,
                  std::vector<uint8_t>* before, std::vector<uint8_t>* after) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  before->resize(n * es);
  FillRandom(before->data(), before->size(), seed);
  *after = *before;
  for (int64_t i = 0; i < n; ++i) {
    if (u(rng) >= density) continue;
    uint8_t* p = after->data() + i * es;
    if (es >= 2 && rng() % 8 == 0) {  // +0 <-> -0: bits differ
      std::memset(before->data() + i * es, 0, es);
      std::memset(p, 0, es);
      p[es - 1] = 0x80;
    } else {
      do {  // es <= 8: one draw (seeding a generator per element is slow)
        const uint64_t r = rng();
        std::memcpy(p, &r, es);
      } while (std::memcmp(p, before->data() + i * es, es) == 0);
    }
  }
}

void CheckDiff(cudaStream_t stream, int64_t n, int es, double density,
               int misalign_elems, int64_t capacity_cut, uint64_t seed,
               int index_bytes = 8) {
  SCOPED_TRACE(::testing::Message()
               << "n " << n << " es " << es << " density " << density
               << " misalign " << misalign_elems << " cut " << capacity_cut
               << " index bytes " << index_bytes);
  std::vector<uint8_t> before, after;
  MakeDiffPair(n, es, density, seed, &before, &after);
  std::vector<int64_t> want_index;
  std::vector<uint8_t> want_values;
  patch_test::ReferenceDiff(before.data(), after.data(), n, es, &want_index,
                            &want_values);
  const int64_t want_count = want_index.size();
  const int64_t capacity = std::max<int64_t>(0, want_count - capacity_cut);
  const int64_t written = std::min(capacity, want_count);

  const size_t off = misalign_elems * es;
  DeviceBuffer b(n * es + 64), a(n * es + 64);
  DeviceBuffer index((capacity + 4) * 8), values((capacity + 4) * es);
  DeviceBuffer count(8);
  DeviceBuffer work(std::max<size_t>(DiffWorkspaceBytes(n, es), 8));
  ASSERT_CUDA_OK(cudaMemcpy(b.get() + off, before.data(), before.size(),
                            cudaMemcpyHostToDevice));
  ASSERT_CUDA_OK(cudaMemcpy(a.get() + off, after.data(), after.size(),
                            cudaMemcpyHostToDevice));
  ASSERT_CUDA_OK(cudaMemset(index.get(), 0xEE, index.bytes()));
  ASSERT_CUDA_OK(cudaMemset(values.get(), 0xEE, values.bytes()));
  ASSERT_CUDA_OK(DiffChanged(b.get() + off, a.get() + off, n, es, work.get(),
                             work.bytes(), index.get(), values.get(), capacity,
                             reinterpret_cast<int64_t*>(count.get()), stream,
                             index_bytes));
  int64_t got_count = -1;
  std::vector<uint8_t> got_index_bytes(index.bytes());
  std::vector<uint8_t> got_values((capacity + 4) * es);
  ASSERT_CUDA_OK(cudaMemcpyAsync(&got_count, count.get(), 8,
                                 cudaMemcpyDeviceToHost, stream));
  ASSERT_CUDA_OK(cudaMemcpyAsync(got_index_bytes.data(), index.get(),
                                 index.bytes(), cudaMemcpyDeviceToHost,
                                 stream));
  ASSERT_CUDA_OK(cudaMemcpyAsync(got_values.data(), values.get(),
                                 values.bytes(), cudaMemcpyDeviceToHost,
                                 stream));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
  // Entry k as written (index_bytes wide), zero-extended.
  std::vector<uint64_t> got_index(capacity + 4, 0);
  for (int64_t k = 0; k < capacity + 4; ++k) {
    std::memcpy(&got_index[k], &got_index_bytes[k * index_bytes], index_bytes);
  }
  const uint64_t untouched =
      index_bytes == 8 ? 0xEEEEEEEEEEEEEEEEull : 0xEEEEEEEEull;
  ASSERT_EQ(got_count, want_count);
  for (int64_t k = 0; k < written; ++k) {
    ASSERT_EQ(got_index[k], static_cast<uint64_t>(want_index[k]))
        << "entry " << k;
    ASSERT_EQ(std::memcmp(&got_values[k * es], &want_values[k * es], es), 0)
        << "value of entry " << k;
  }
  // Nothing past what fits.
  for (int64_t k = written; k < capacity + 4; ++k) {
    ASSERT_EQ(got_index[k], untouched)
        << "entry " << k << " written past the count or capacity";
  }
}

TEST_F(PatchGpuTest, DiffMatchesAPlainLoop) {
  uint64_t seed = 1;
  for (int es : {1, 2, 4, 8}) {
    const int64_t tile = DiffTileElems(es);
    for (int64_t n :
         {int64_t{1}, int64_t{1000}, tile, 3 * tile + 5, int64_t{3000017}}) {
      for (double density : {0.0, 0.01, 0.3, 1.0}) {
        CheckDiff(stream_, n, es, density, 0, 0, seed++);
        if (HasFatalFailure()) return;
      }
      CheckDiff(stream_, n, es, 0.05, 1, 0, seed++);  // element by element
      CheckDiff(stream_, n, es, 0.05, 0, 7, seed++);  // capacity too small
      CheckDiff(stream_, n, es, 0.5, 3, n / 3, seed++);
      CheckDiff(stream_, n, es, 0.05, 0, 0, seed++, /*index_bytes=*/4);
      CheckDiff(stream_, n, es, 0.3, 1, 5, seed++, /*index_bytes=*/4);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(PatchGpuTest, DiffRefusesWhatItCannotDo) {
  DeviceBuffer buf(1 << 16);
  uint8_t* p = buf.get();
  auto* count = reinterpret_cast<int64_t*>(p + 60000);
  auto* idx = reinterpret_cast<int64_t*>(p + 40000);
  EXPECT_EQ(DiffChanged(p, p + 1024, 16, 3, p + 50000, 8, idx, p + 45000, 16,
                        count, stream_),
            cudaErrorInvalidValue);  // element size
  EXPECT_EQ(DiffChanged(p + 2, p + 1024, 16, 4, p + 50000, 8, idx, p + 45000,
                        16, count, stream_),
            cudaErrorInvalidValue);  // misaligned
  EXPECT_EQ(DiffChanged(p, p + 1024, 1 << 20, 4, p + 50000, 8, idx, p + 45000,
                        16, count, stream_),
            cudaErrorInvalidValue);  // workspace too small
  EXPECT_EQ(DiffChanged(p, p + 1024, 16, 4, p + 50000, 8, nullptr, nullptr, 16,
                        count, stream_),
            cudaErrorInvalidValue);  // nowhere to write
  EXPECT_EQ(DiffChanged(p, p + 1024, 16, 4, p + 50000, 8, idx, p + 45000, 16,
                        count, stream_, 2),
            cudaErrorInvalidValue);  // index width
  EXPECT_EQ(DiffChanged(p, p + 1024, (int64_t{1} << 32) + 1, 1, p + 50000, 8,
                        idx, p + 45000, 16, count, stream_, 4),
            cudaErrorInvalidValue);  // too many elements for 4-byte indices
  EXPECT_EQ(DiffWorkspaceBytes(0, 4), 0);
  EXPECT_EQ(DiffWorkspaceBytes(1, 4), 8);
  ASSERT_CUDA_OK(DiffChanged(nullptr, nullptr, 0, 2, nullptr, 0, nullptr,
                             nullptr, 0, count, stream_));
  int64_t got = -1;
  ASSERT_CUDA_OK(
      cudaMemcpyAsync(&got, count, 8, cudaMemcpyDeviceToHost, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(got, 0);
}

}  // namespace
}  // namespace cuda
}  // namespace weightsync
