// PlanFusedReceipts on the CPU, over host buffers standing for engine
// memory: which receipt regions the copies and the direct quant jobs sum,
// the receipt fields the jobs get (checked by summing, with them, the
// terms of what the jobs write against common/checksum.h over the
// regions), and every plan that must fall back.
#include "backends/cuda/fused_receipts.h"

#include <cstring>
#include <random>
#include <vector>

#include "common/checksum.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace cuda {
namespace {

// An engine: fused "qkv" FP8 [96, 80] fed by three row segments (q rows
// 0-31, k rows 32-63, v rows 64-95), 32 x 32 blocks (the last column of
// blocks partial), its scale parameter [3, 3] float32, a per-row FP8 "o"
// [8, 40] with scale [8, 1], and a bf16 "norm" [64] written by a copy.
// Offsets odd where FP8 allows. Receipt regions as the daemon makes them
// (worker_receipts.cc, ReceiptRegionsOf): one per segment, one per
// segment's scales.
struct Engine {
  std::vector<uint8_t> memory = std::vector<uint8_t>(1 << 16);
  std::vector<uint8_t> source = std::vector<uint8_t>(1 << 12);
  uint8_t* qkv = memory.data() + 1;
  uint8_t* qkv_scale = memory.data() + 8192 + 3;
  uint8_t* o = memory.data() + 9000 + 5;
  uint8_t* o_scale = memory.data() + 9500 + 2;
  uint8_t* norm = memory.data() + 10240;
  uint64_t qkv_salt = ParameterSalt("qkv"), qkv_scale_salt = ParameterSalt("s");
  uint64_t o_salt = ParameterSalt("o"), o_scale_salt = ParameterSalt("os");
  uint64_t norm_salt = ParameterSalt("norm");
  std::vector<ReceiptRegion> regions;
  std::vector<int32_t> group_of;
  std::vector<FusedCopyOp> ops;
  std::vector<DirectJob> jobs;

  Engine() {
    std::mt19937 rng(5);
    for (uint8_t& b : memory) b = rng();
    for (uint8_t& b : source) b = rng();
    for (int seg = 0; seg < 3; ++seg) {
      Region(qkv + seg * 32 * 80, 32, 80, 80, 1, qkv_salt, seg * 32 * 80, 0);
      Region(qkv_scale + seg * 3 * 4, 1, 3, 12, 4, qkv_scale_salt, seg * 3, 0);
      jobs.push_back(Job(qkv + seg * 32 * 80, 32, 80, 80, 32, 32,
                         qkv_scale + seg * 12, 3));
    }
    Region(o, 8, 40, 40, 1, o_salt, 0, 0);
    Region(o_scale, 8, 1, 4, 4, o_scale_salt, 0, 0);
    jobs.push_back(Job(o, 8, 40, 40, 1, 40, o_scale, 1));
    Region(norm, 1, 64, 128, 2, norm_salt, 0, 0);
    ops.push_back({source.data(), norm, 1, 64, 128, 128, 2, 0});
  }

  void Region(uint8_t* base, int64_t rows, int64_t cols, int64_t stride, int es,
              uint64_t salt, uint64_t first, int32_t group) {
    ReceiptRegion r{};
    r.base = base;
    r.rows = rows;
    r.cols = cols;
    r.row_stride_bytes = stride;
    r.es = es;
    r.salt = salt;
    r.first_index = first;
    regions.push_back(r);
    group_of.push_back(group);
  }

  static DirectJob Job(uint8_t* q, int64_t rows, int64_t width, int64_t stride,
                       int64_t br, int64_t bc, uint8_t* scale,
                       int64_t scale_stride) {
    DirectJob j{};
    j.out.rows = rows;
    j.out.width = width;
    j.out.q = q;
    j.out.q_stride = stride;
    j.out.block_rows = br;
    j.out.block_cols = bc;
    j.out.scale = scale;
    j.out.scale_stride = scale_stride;
    return j;
  }
};

// The receipt terms of what job j writes, keyed by its receipt fields as
// the kernel keys them (fp8_math.h: DirectQTerm, DirectScaleTerm).
uint64_t JobTerms(const DirectJob& j) {
  uint64_t sum = 0;
  for (int64_t r = 0; r < j.out.rows; ++r) {
    for (int64_t c = 0; c < j.out.width; ++c) {
      const int64_t at = r * j.out.q_stride + c;
      sum += DirectQTerm(j.receipt, at, j.out.q[at]);
    }
  }
  const int64_t gr = (j.out.rows + j.out.block_rows - 1) / j.out.block_rows;
  const int64_t gc = (j.out.width + j.out.block_cols - 1) / j.out.block_cols;
  for (int64_t i = 0; i < gr; ++i) {
    for (int64_t k = 0; k < gc; ++k) {
      float v;
      std::memcpy(&v, j.out.scale + 4 * (i * j.out.scale_stride + k), 4);
      sum += DirectScaleTerm(j, i, k, v);
    }
  }
  return sum;
}

// common/checksum.h over the regions (the host's receipt of them).
uint64_t RegionTerms(const std::vector<ReceiptRegion>& regions) {
  uint64_t sum = 0;
  for (const ReceiptRegion& g : regions) {
    for (int64_t r = 0; r < g.rows; ++r) {
      sum +=
          RunTerms(g.salt, g.first_index + r * (g.row_stride_bytes / g.es),
                   static_cast<const uint8_t*>(g.base) + r * g.row_stride_bytes,
                   g.cols, g.es);
    }
  }
  return sum;
}

TEST(FusedReceiptsTest, DirectJobsAndCopiesCoverTheRegions) {
  Engine e;
  FusedReceiptPlan plan;
  ASSERT_TRUE(PlanFusedReceipts(e.regions, e.group_of, e.ops, e.jobs, &plan));
  // The copy: one region of norm's 64 elements, from the source.
  ASSERT_EQ(plan.copies.size(), 1u);
  EXPECT_EQ(plan.copies[0].base, e.source.data());
  EXPECT_EQ(plan.copies[0].dst, e.norm);
  EXPECT_EQ(plan.copies[0].cols, 64);
  ASSERT_EQ(plan.direct.size(), 4u);
  for (int seg = 0; seg < 3; ++seg) {
    EXPECT_EQ(plan.direct_group[seg], 0);
    EXPECT_EQ(plan.direct[seg].q_salt, Salt32(e.qkv_salt));
    EXPECT_EQ(plan.direct[seg].q_first, seg * 32u * 80u);
    EXPECT_EQ(plan.direct[seg].scale_salt, Salt32(e.qkv_scale_salt));
    EXPECT_EQ(plan.direct[seg].scale_first, seg * 3u);
    EXPECT_EQ(plan.direct[seg].out, nullptr);  // the worker's to set
  }
  // With the planned fields, the jobs' terms (over the bytes they would
  // have written: the memory as it is) are the host's receipt of their
  // regions; the copy's the rest.
  uint64_t sum = 0;
  for (size_t j = 0; j < e.jobs.size(); ++j) {
    e.jobs[j].receipt = plan.direct[j];
    sum += JobTerms(e.jobs[j]);
  }
  std::memcpy(e.norm, e.source.data(), 128);  // what the copy writes
  sum += RegionTerms(plan.copies);
  EXPECT_EQ(sum, RegionTerms(e.regions));
  // A wrong salt or index gives another sum.
  e.jobs[1].receipt.q_first += 1;
  EXPECT_NE(JobTerms(e.jobs[1]), RegionTerms({e.regions[2], e.regions[3]}));
  e.jobs[1].receipt = plan.direct[1];
  EXPECT_EQ(JobTerms(e.jobs[1]), RegionTerms({e.regions[2], e.regions[3]}));
  e.jobs[1].receipt.scale_salt ^= 1;
  EXPECT_NE(JobTerms(e.jobs[1]), RegionTerms({e.regions[2], e.regions[3]}));
}

// A parameter registered whole (one region row of all its elements): a
// job over all of its rows, and a job over some of them, keyed on their
// place in it.
TEST(FusedReceiptsTest, AWholeParameterIsOneRegionRow) {
  Engine e;
  e.regions.resize(6);  // qkv and its scales
  e.group_of.resize(6);
  e.ops.clear();
  e.jobs.resize(3);
  // o as one row of 320 elements; its scales one row of 8.
  e.Region(e.o, 1, 320, 0, 1, e.o_salt, 0, 1);
  e.Region(e.o_scale, 1, 8, 0, 4, e.o_scale_salt, 0, 1);
  e.jobs.push_back(Engine::Job(e.o, 3, 40, 40, 1, 40, e.o_scale, 1));
  e.jobs.push_back(Engine::Job(e.o + 120, 5, 40, 40, 1, 40, e.o_scale + 12, 1));
  FusedReceiptPlan plan;
  ASSERT_TRUE(PlanFusedReceipts(e.regions, e.group_of, e.ops, e.jobs, &plan));
  EXPECT_EQ(plan.direct_group[3], 1);
  EXPECT_EQ(plan.direct[4].q_first, 120u);
  EXPECT_EQ(plan.direct[4].scale_first, 3u);
  uint64_t sum = 0;
  for (size_t j = 0; j < e.jobs.size(); ++j) {
    e.jobs[j].receipt = plan.direct[j];
    sum += JobTerms(e.jobs[j]);
  }
  EXPECT_EQ(sum, RegionTerms(e.regions));
}

TEST(FusedReceiptsTest, AnythingButAnExactCoverFallsBack) {
  FusedReceiptPlan plan;
  {
    Engine e;  // a job missing: its regions not covered
    e.jobs.erase(e.jobs.begin() + 1);
    EXPECT_FALSE(
        PlanFusedReceipts(e.regions, e.group_of, e.ops, e.jobs, &plan));
  }
  {
    Engine e;  // the copy missing
    e.ops.clear();
    EXPECT_FALSE(
        PlanFusedReceipts(e.regions, e.group_of, e.ops, e.jobs, &plan));
  }
  {
    Engine e;  // a region no one writes
    e.Region(e.memory.data() + 20000, 1, 16, 16, 1, 7, 0, 0);
    EXPECT_FALSE(
        PlanFusedReceipts(e.regions, e.group_of, e.ops, e.jobs, &plan));
  }
  {
    Engine e;  // a job writing past its region (o's last row not in it)
    e.regions[6].rows = 7;
    EXPECT_FALSE(
        PlanFusedReceipts(e.regions, e.group_of, e.ops, e.jobs, &plan));
  }
  {
    Engine e;  // scales summed as 2-byte elements
    e.regions[7].es = 2;
    e.regions[7].cols = 2;
    EXPECT_FALSE(
        PlanFusedReceipts(e.regions, e.group_of, e.ops, e.jobs, &plan));
  }
  {
    Engine e;  // a job's weight and scales in two groups (two sums)
    e.group_of[7] = 1;
    EXPECT_FALSE(
        PlanFusedReceipts(e.regions, e.group_of, e.ops, e.jobs, &plan));
  }
  {
    Engine e;  // a job across two parameters (salts)
    e.regions[2].salt = 99;
    e.jobs[0].out.rows = 64;  // q and k in one job
    e.jobs.erase(e.jobs.begin() + 1);
    EXPECT_FALSE(
        PlanFusedReceipts(e.regions, e.group_of, e.ops, e.jobs, &plan));
  }
  {
    Engine e;  // keyed with a jump in the index between rows 3 and 4
    e.regions[6].row_stride_bytes = 40;
    e.regions[6].first_index = 0;
    e.regions[6].rows = 4;
    e.regions[6].cols = 40;
    e.Region(e.o + 160, 4, 40, 40, 1, e.o_salt, 400, 0);
    EXPECT_FALSE(
        PlanFusedReceipts(e.regions, e.group_of, e.ops, e.jobs, &plan));
  }
  {
    Engine e;  // a copy whose two sides are not equally misaligned
    e.ops[0].src += 2;
    EXPECT_FALSE(
        PlanFusedReceipts(e.regions, e.group_of, e.ops, e.jobs, &plan));
  }
  {
    Engine e;  // the control: as made, it fuses
    EXPECT_TRUE(PlanFusedReceipts(e.regions, e.group_of, e.ops, e.jobs, &plan));
  }
}

}  // namespace
}  // namespace cuda
}  // namespace weightsync
