// The arithmetic of the receipt and sparse-patch kernels (kernel_math.h),
// run on the CPU exactly as the GPU threads run it (every block, every
// thread, the same functions), against the daemon's host references:
// ComputeReceipt (daemon/core/receipt.cc) and ApplySparsePatch
// (backends/host/host_data_plane.cc). Needs no GPU and no CUDA toolkit;
// patch_gpu_test checks the kernels themselves on a GPU.
#include "backends/cuda/kernel_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/patch_test_util.h"
#include "backends/host/host_data_plane.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/engine_layout.h"
#include "daemon/core/receipt.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"

namespace weightsync {
namespace cuda {
namespace {

using patch_test::FillRandom;

template <bool COPY>
uint64_t TileThreadSumOf(const ReceiptRegion& r, int64_t t, int tid) {
  switch (r.es) {
    case 1:
      return ReceiptTileThreadSum<1, COPY>(r, t, tid);
    case 2:
      return ReceiptTileThreadSum<2, COPY>(r, t, tid);
    case 4:
      return ReceiptTileThreadSum<4, COPY>(r, t, tid);
    default:
      return ReceiptTileThreadSum<8, COPY>(r, t, tid);
  }
}

uint64_t TileThreadSum(const ReceiptRegion& r, int64_t t, int tid) {
  return r.dst != nullptr ? TileThreadSumOf<true>(r, t, tid)
                          : TileThreadSumOf<false>(r, t, tid);
}

// ReceiptKernel on the CPU with `grid` blocks: each block's contiguous
// tiles, the region search and skip, every thread's share; flushes to each
// region's out (here: host memory) whenever the region's out changes.
void EmulateReceiptKernel(const std::vector<ReceiptRegion>& regions,
                          int64_t total_tiles, int64_t grid) {
  const int64_t n = static_cast<int64_t>(regions.size());
  for (int64_t b = 0; b < grid; ++b) {
    int64_t lo, hi;
    ReceiptBlockTiles(total_tiles, grid, b, &lo, &hi);
    if (lo >= hi) continue;
    int64_t d = FindReceiptRegion(regions.data(), n, lo);
    unsigned long long* out = nullptr;
    uint64_t sum = 0;
    for (int64_t t = lo; t < hi; ++t) {
      while (t >= regions[d].tile_begin + regions[d].tiles) ++d;
      const ReceiptRegion& r = regions[d];
      if (r.out != out) {
        if (out != nullptr) *out += sum;
        out = r.out;
        sum = 0;
      }
      for (int tid = 0; tid < kReceiptThreads; ++tid) {
        sum += TileThreadSum(r, t - r.tile_begin, tid);
      }
    }
    if (out != nullptr) *out += sum;
  }
}

// The kernel's 32-bit pieces are common/checksum.h's function, including
// keys whose lo32(index) wraps inside a 16-byte vector.
TEST(KernelMathTest, TermsAreTheHostFunction) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 1000; ++i) {
    const uint64_t salt = rng(), index = rng(), bits = rng();
    EXPECT_EQ(TermOf(KeyOf(SaltOf(salt), index), Bits32(bits)),
              ElementTerm(salt, index, bits));
    EXPECT_EQ(Mix32(static_cast<uint32_t>(bits)),
              weightsync::Mix32(static_cast<uint32_t>(bits)));
  }
  for (uint64_t index : {uint64_t{0}, uint64_t{0xFFFFFFFAull},
                         uint64_t{0x1FFFFFFFFull}, ~uint64_t{0} - 3}) {
    Words4 v;
    for (int w = 0; w < 4; ++w) v.w[w] = static_cast<uint32_t>(rng());
    const uint64_t salt = rng();
    uint8_t bytes[16];
    std::memcpy(bytes, v.w, 16);
    EXPECT_EQ(VecTerms<1>(SaltOf(salt), index, v),
              RunTerms(salt, index, bytes, 16, 1));
    EXPECT_EQ(VecTerms<2>(SaltOf(salt), index, v),
              RunTerms(salt, index, bytes, 8, 2));
    EXPECT_EQ(VecTerms<4>(SaltOf(salt), index, v),
              RunTerms(salt, index, bytes, 4, 4));
    EXPECT_EQ(VecTerms<8>(SaltOf(salt), index, v),
              RunTerms(salt, index, bytes, 2, 8));
    EXPECT_EQ(LoadBits<8>(reinterpret_cast<const char*>(bytes)),
              Bits32(ElementBits(bytes, 8)));
  }
}

TEST(KernelMathTest, ReceiptOfAnEngineMatchesComputeReceipt) {
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(patch_test::ReceiptEngine(), mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  MappedRegion& region = *(*layout)->regions[0];
  FillRandom(region.data(), region.size(), 7);
  const auto sources = patch_test::ReceiptSources();
  auto want = ComputeReceipt(**layout, sources);
  ASSERT_TRUE(want.ok()) << want.status();

  unsigned long long got = 0;
  std::vector<ReceiptRegion> regions =
      patch_test::ReceiptRegionsOf(**layout, sources, region.data(), &got);
  // One region per segment in the update ("f.other" is not).
  EXPECT_EQ(regions.size(), 12);
  // Each region alone, by the reference loop, before planning rewrites it.
  uint64_t by_region = 0;
  for (const ReceiptRegion& r : regions) {
    by_region +=
        patch_test::ReferenceRegionSum(r, static_cast<const uint8_t*>(r.base));
  }
  EXPECT_EQ(by_region, want->checksum());

  const int64_t total = PlanReceiptRegions(regions.data(), regions.size());
  ASSERT_GT(total, 0);
  for (int64_t grid : {1, 2, 7, 64, 1000, 100000}) {
    got = 0;
    EmulateReceiptKernel(regions, total, grid);
    EXPECT_EQ(got, want->checksum()) << "grid " << grid;
  }
}

// Random regions in a buffer: every element size, misaligned starts,
// strides from dense to wide, rows from narrow to many tiles, indices that
// wrap around 2^64, one out per region.
TEST(KernelMathTest, RandomRegionsMatchTheReferenceLoop) {
  std::mt19937_64 rng(11);
  std::vector<uint8_t> buffer(8 << 20);
  FillRandom(buffer.data(), buffer.size(), 3);
  const int kRegions = 300;
  std::vector<ReceiptRegion> regions;
  std::vector<uint64_t> want;
  std::vector<unsigned long long> outs(kRegions, 0);
  int64_t at = 0;
  for (int i = 0; i < kRegions; ++i) {
    ReceiptRegion r{};
    r.es = 1 << (rng() % 4);
    const int shape = rng() % 6;
    int64_t rows, cols;
    switch (shape) {
      case 0:  // one long row
        rows = 1;
        cols = 1 + rng() % 40000;
        break;
      case 1:  // narrow rows
        rows = 1 + rng() % 300;
        cols = 1 + rng() % 20;
        break;
      case 2:  // rows of a tile or so
        rows = 1 + rng() % 4;
        cols = kReceiptTileBytes / r.es - 3 + rng() % 7;
        break;
      case 3:  // wide rows
        rows = 1 + rng() % 3;
        cols = 1 + rng() % (3 * kReceiptTileBytes / r.es);
        break;
      case 4:  // empty
        rows = rng() % 2;
        cols = rows == 0 ? rng() % 5 : 0;
        break;
      default:
        rows = 1 + rng() % 50;
        cols = 1 + rng() % 2000;
        break;
    }
    const int64_t stride_elems =
        rng() % 3 == 0 ? cols : cols + static_cast<int64_t>(rng() % 40);
    r.rows = rows;
    r.cols = cols;
    r.row_stride_bytes = stride_elems * r.es;
    const int64_t span =
        rows == 0 || cols == 0 ? 0 : ((rows - 1) * stride_elems + cols) * r.es;
    at = (at + 15) / 16 * 16 + (rng() % 16) / r.es * r.es;
    if (at + span > static_cast<int64_t>(buffer.size())) at = 0;
    r.base = buffer.data() + at;
    at += span;
    r.salt = rng();
    r.first_index = rng() % 4 == 0 ? ~uint64_t{0} - rng() % 100 : rng() % 1000;
    r.out = &outs[i];
    want.push_back(
        patch_test::ReferenceRegionSum(r, static_cast<const uint8_t*>(r.base)));
    regions.push_back(r);
  }
  const int64_t total = PlanReceiptRegions(regions.data(), regions.size());
  ASSERT_GT(total, 0);
  for (int64_t grid : {1, 13, 528}) {
    std::fill(outs.begin(), outs.end(), 0);
    EmulateReceiptKernel(regions, total, grid);
    for (int i = 0; i < kRegions; ++i) {
      ASSERT_EQ(outs[i], want[i])
          << "region " << i << " grid " << grid << ": rows " << regions[i].rows
          << " cols " << regions[i].cols << " es " << regions[i].es;
    }
  }
}

// Copy regions (ReceiptCopyBatch): every element lands at its place at dst,
// nothing else at dst is written, and the sum is the receipt of the
// destination region, the sum-only kernel's over the bytes as written.
TEST(KernelMathTest, CopyRegionsCopyAndSumTheDestination) {
  std::mt19937_64 rng(23);
  std::vector<uint8_t> src(8 << 20), dst(8 << 20), want_dst;
  FillRandom(src.data(), src.size(), 5);
  FillRandom(dst.data(), dst.size(), 6);
  want_dst = dst;
  const int kRegions = 200;
  std::vector<ReceiptRegion> regions;
  std::vector<ReceiptRegion> readback;  // sum-only over the destination
  std::vector<unsigned long long> outs(kRegions, 0), back(kRegions, 0);
  int64_t at_src = 0, at_dst = 0;
  for (int i = 0; i < kRegions; ++i) {
    ReceiptRegion r{};
    r.es = 1 << (rng() % 4);
    const int shape = rng() % 4;
    const int64_t rows = shape == 0 ? 1 : 1 + rng() % (shape == 1 ? 200 : 6);
    const int64_t cols =
        shape == 1
            ? 1 + rng() % 24
            : 1 + rng() % (shape == 3 ? 3 * kReceiptTileBytes / r.es : 5000);
    // Strides equal modulo 16 bytes (what the plan asks of a copy), one of
    // them sometimes contiguous.
    const int64_t pad = (rng() % 3) * 16 / r.es;
    const int64_t src_stride = (cols + pad) * r.es;
    const int64_t dst_stride =
        rng() % 2 == 0 ? src_stride : src_stride + 16 * (1 + rng() % 3);
    const int64_t mis = (rng() % 16) / r.es * r.es;
    auto place = [&](int64_t* at, int64_t stride, size_t size) {
      const int64_t span = (rows - 1) * stride + cols * r.es;
      *at = (*at + 15) / 16 * 16 + mis;
      if (*at + span > static_cast<int64_t>(size)) *at = mis;
      const int64_t begin = *at;
      *at += span;
      return begin;
    };
    const int64_t s0 = place(&at_src, src_stride, src.size());
    const int64_t d0 = place(&at_dst, dst_stride, dst.size());
    r.base = src.data() + s0;
    r.dst = dst.data() + d0;
    r.rows = rows;
    r.cols = cols;
    r.row_stride_bytes = src_stride;
    r.dst_row_stride_bytes = dst_stride;
    r.salt = rng();
    r.first_index = rng() % 1000;
    r.out = &outs[i];
    for (int64_t row = 0; row < rows; ++row) {
      std::memcpy(want_dst.data() + d0 + row * dst_stride,
                  src.data() + s0 + row * src_stride, cols * r.es);
    }
    ReceiptRegion b{};
    b.base = want_dst.data() + d0;
    b.rows = rows;
    b.cols = cols;
    b.row_stride_bytes = dst_stride;
    b.salt = r.salt;
    b.first_index = r.first_index;
    b.es = r.es;
    b.out = &back[i];
    regions.push_back(r);
    readback.push_back(b);
  }
  // Regions placed later may overlap earlier ones at dst (the placement
  // wraps): keep only those that don't, as the worker's plan guarantees.
  std::vector<uint8_t> owner(dst.size(), 0);
  std::vector<ReceiptRegion> copies, sums;
  for (int i = 0; i < kRegions; ++i) {
    const ReceiptRegion& r = regions[i];
    const int64_t d0 = static_cast<uint8_t*>(r.dst) - dst.data();
    const int64_t span = (r.rows - 1) * r.dst_row_stride_bytes + r.cols * r.es;
    if (std::any_of(owner.begin() + d0, owner.begin() + d0 + span,
                    [](uint8_t o) { return o != 0; })) {
      continue;
    }
    std::fill(owner.begin() + d0, owner.begin() + d0 + span, 1);
    copies.push_back(r);
    sums.push_back(readback[i]);
  }
  ASSERT_GT(copies.size(), 150u);
  // want_dst was written in region order; redo it for the kept ones only.
  want_dst = dst;
  for (const ReceiptRegion& r : copies) {
    const int64_t d0 = static_cast<uint8_t*>(r.dst) - dst.data();
    const auto* from = static_cast<const uint8_t*>(r.base);
    for (int64_t row = 0; row < r.rows; ++row) {
      std::memcpy(want_dst.data() + d0 + row * r.dst_row_stride_bytes,
                  from + row * r.row_stride_bytes, r.cols * r.es);
    }
  }
  for (size_t i = 0; i < sums.size(); ++i) {
    sums[i].base =
        want_dst.data() + (static_cast<uint8_t*>(copies[i].dst) - dst.data());
  }
  const int64_t total = PlanReceiptRegions(copies.data(), copies.size());
  const int64_t total_back = PlanReceiptRegions(sums.data(), sums.size());
  ASSERT_GT(total, 0);
  ASSERT_GT(total_back, 0);
  EmulateReceiptKernel(copies, total, 37);
  EmulateReceiptKernel(sums, total_back, 37);
  const auto m = std::mismatch(dst.begin(), dst.end(), want_dst.begin());
  ASSERT_TRUE(m.first == dst.end())
      << "first difference at byte " << (m.first - dst.begin());
  for (size_t i = 0; i < copies.size(); ++i) {
    const size_t k =
        static_cast<unsigned long long*>(copies[i].out) - outs.data();
    EXPECT_EQ(outs[k], back[k]) << "region " << k;
  }
}

TEST(KernelMathTest, PlanRefusesWhatTheKernelCannotRead) {
  alignas(16) static uint8_t buf[4096];
  unsigned long long out = 0;
  auto region = [&](int es, int64_t rows, int64_t cols, int64_t stride,
                    const void* base) {
    ReceiptRegion r{};
    r.base = base;
    r.rows = rows;
    r.cols = cols;
    r.row_stride_bytes = stride;
    r.es = es;
    r.out = &out;
    return r;
  };
  auto ok = [](ReceiptRegion r) { return PlanReceiptRegion(r, 0); };
  EXPECT_TRUE(ok(region(2, 4, 8, 16, buf)));
  EXPECT_FALSE(ok(region(2, 4, 8, 0, buf + 2)));   // stride < row
  EXPECT_FALSE(ok(region(3, 1, 8, 24, buf)));      // element size
  EXPECT_FALSE(ok(region(4, 1, 8, 32, buf + 2)));  // misaligned
  EXPECT_FALSE(ok(region(4, 2, 8, 34, buf)));  // stride not a multiple of es
  EXPECT_FALSE(ok(region(2, -1, 8, 16, buf)));
  ReceiptRegion null_out = region(2, 1, 8, 16, buf);
  null_out.out = nullptr;
  EXPECT_FALSE(ok(null_out));
  // Empty regions plan to no tiles, whatever their pointers.
  ReceiptRegion empty = region(2, 0, 8, 16, nullptr);
  ASSERT_TRUE(PlanReceiptRegion(empty, 5));
  EXPECT_EQ(empty.tiles, 0);
  EXPECT_EQ(empty.tile_begin, 5);
  // Contiguous rows merge; one row ignores its stride.
  ReceiptRegion dense = region(2, 4, 8, 16, buf);
  ASSERT_TRUE(PlanReceiptRegion(dense, 0));
  EXPECT_EQ(dense.rows, 1);
  EXPECT_EQ(dense.cols, 32);
  // Copy regions: both sides equally misaligned modulo 16, rows merged only
  // where both are contiguous.
  alignas(16) static uint8_t to[4096];
  ReceiptRegion copy = region(2, 4, 8, 16, buf);
  copy.dst = to;
  copy.dst_row_stride_bytes = 32;
  ASSERT_TRUE(PlanReceiptRegion(copy, 0));
  EXPECT_EQ(copy.rows, 4);
  EXPECT_EQ(copy.index_row_stride, 16);
  ReceiptRegion skew = region(2, 1, 8, 16, buf);
  skew.dst = to + 2;
  EXPECT_FALSE(ok(skew));
  ReceiptRegion skew_rows = region(2, 2, 8, 16, buf);
  skew_rows.dst = to;
  skew_rows.dst_row_stride_bytes = 18;
  EXPECT_FALSE(ok(skew_rows));
  ReceiptRegion short_rows = region(2, 2, 8, 16, buf);
  short_rows.dst = to;
  short_rows.dst_row_stride_bytes = 8;
  EXPECT_FALSE(ok(short_rows));
  std::vector<ReceiptRegion> batch = {region(2, 4, 8, 16, buf),
                                      region(5, 1, 1, 0, buf)};
  EXPECT_EQ(PlanReceiptRegions(batch.data(), 2), -2);
}

// ApplySparsePatch on the host, and the kernel's per-entry decisions
// (SparseEntryWins, SparseDestination) with the host's conversion, on two
// copies of the same engine memory: every byte equal.
void CheckSparseAgainstHost(const patch_test::PatchUpdate& update,
                            uint64_t seed) {
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(update.engine, mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  MappedRegion& region = *(*layout)->regions[0];
  FillRandom(region.data(), region.size(), seed);
  std::vector<uint8_t> emulated(region.data(), region.data() + region.size());

  auto plan = BuildCopyPlan(update.manifest, 1 << 20, {*layout});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ((*plan)->sparse.size(), update.manifest.size());
  for (const SparsePatch& patch : (*plan)->sparse) {
    const std::string& bytes = update.payloads[patch.tensor];
    ASSERT_EQ(static_cast<int64_t>(bytes.size()), patch.payload_bytes);
    const auto* payload = reinterpret_cast<const uint8_t*>(bytes.data());
    ASSERT_TRUE(ApplySparsePatch(**plan, patch, payload, nullptr).ok());
    std::vector<int64_t> index(patch.nnz);
    std::memcpy(index.data(), payload, patch.nnz * 8);
    const uint8_t* values = payload + patch.nnz * 8;
    const int64_t ses = ElementSize(patch.dtype);
    for (const SparsePatch::Use& u : patch.uses) {
      const SparseUse use = patch_test::SparseUseOf(u, emulated.data());
      const int64_t des = ElementSize(u.dtype);
      for (int64_t k = 0; k < patch.nnz; ++k) {
        int64_t dst;
        if (!SparseEntryWins(index.data(), patch.nnz, k) ||
            !SparseDestination(use, patch.cols, patch.numel, index[k], &dst)) {
          continue;
        }
        ConvertElements(values + k * ses, patch.dtype,
                        static_cast<uint8_t*>(use.param) + dst * des, u.dtype,
                        1);
      }
    }
  }
  const std::vector<uint8_t> host(region.data(), region.data() + region.size());
  const auto m = std::mismatch(host.begin(), host.end(), emulated.begin());
  EXPECT_TRUE(m.first == host.end())
      << "first difference at byte " << (m.first - host.begin());
}

TEST(KernelMathTest, SparseDecisionsMatchApplySparsePatch) {
  struct Case {
    double density;
    bool repeats, shuffle;
  };
  const Case cases[] = {{0.05, false, false},
                        {0.6, false, false},
                        {0.05, true, false},  // adjacent repeats: last wins
                        {0.7, true, false},
                        {0.3, false, true}};  // unsorted, unique
  uint64_t seed = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "density " << c.density << " repeats "
                                      << c.repeats << " shuffle " << c.shuffle);
    const patch_test::PatchUpdate update =
        patch_test::SparseEngineUpdate(c.density, c.repeats, c.shuffle, seed);
    auto plan_uses = [&] {
      testing::HeapMapper mapper;
      auto layout = BuildEngineLayout(update.engine, mapper);
      auto plan = BuildCopyPlan(update.manifest, 1 << 20, {*layout});
      std::vector<size_t> uses;
      for (const SparsePatch& p : (*plan)->sparse)
        uses.push_back(p.uses.size());
      return uses;
    };
    // w: implicit, shard, side by side, two fused blocks; bias: 2; ids: 1.
    EXPECT_EQ(plan_uses(), (std::vector<size_t>{5, 2, 1}));
    CheckSparseAgainstHost(update, seed++);
  }
}

// The scenario patch_gpu_test converts on the GPU is valid, and the
// destinations are right for it.
TEST(KernelMathTest, ConversionScenarioMatchesApplySparsePatch) {
  CheckSparseAgainstHost(patch_test::ConversionUpdate(), 3);
}

TEST(KernelMathTest, SparseDestinationSkipsIndicesOutsideTheTensor) {
  SparseUse implicit{};
  implicit.implicit = true;
  int64_t dst = -7;
  EXPECT_FALSE(SparseDestination(implicit, 10, 100, -1, &dst));
  EXPECT_FALSE(SparseDestination(implicit, 10, 100, 100, &dst));
  EXPECT_TRUE(SparseDestination(implicit, 10, 100, 99, &dst));
  EXPECT_EQ(dst, 99);
  SparseUse block{};
  block.row_begin = 2;
  block.row_count = 3;
  block.col_begin = 4;
  block.col_count = 5;
  block.dest_offset = 1;
  block.dest_row_stride = 7;
  EXPECT_FALSE(SparseDestination(block, 10, 100, -6, &dst));
  EXPECT_FALSE(SparseDestination(block, 10, 100, 23, &dst));  // col 3
  EXPECT_FALSE(SparseDestination(block, 10, 100, 29, &dst));  // col 9
  EXPECT_FALSE(SparseDestination(block, 10, 100, 54, &dst));  // row 5
  ASSERT_TRUE(SparseDestination(block, 10, 100, 48, &dst));   // (4, 8)
  EXPECT_EQ(dst, 1 + 2 * 7 + 4);
}

TEST(KernelMathTest, DiffTiles) {
  EXPECT_EQ(DiffTileElems(2), 256 * 8 * 8);
  EXPECT_EQ(DiffTiles(1, 4), 1);
  EXPECT_EQ(DiffTiles(256 * 8 * 4, 4), 1);
  EXPECT_EQ(DiffTiles(256 * 8 * 4 + 1, 4), 2);
}

}  // namespace
}  // namespace cuda
}  // namespace weightsync
