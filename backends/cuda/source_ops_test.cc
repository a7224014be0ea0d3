// The registered source's copies, on the CPU: which trainer bytes each op
// reads (SplitSourceOp) and which ops are joined (MergeContiguousOps). A
// wrong offset here copies another tensor's bytes (the GPU test found one:
// an op the copy plan had joined across two tensors read the second from
// where it used to be).
#include <string>
#include <vector>

#include "backends/cuda/worker_client.h"
#include "common/chunk_planner.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

// Three bf16 tensors of 128, 256 and 64 elements: packed at 0, 256, 768.
ChunkPlan Plan() {
  Manifest m;
  for (auto [name, n] : std::vector<std::pair<std::string, int>>{
           {"a", 128}, {"b", 256}, {"c", 64}}) {
    v1::TensorSpec* t = m.Add();
    t->set_name(name);
    t->set_dtype(v1::BFLOAT16);
    t->add_shape(n);
  }
  return PlanChunks(m, 1 << 20).value();
}

// a and c in region 0 at 4096 and 8192; b moved to region 1 at 100.
Source MovedB() {
  Source s;
  s.placements = {{0, 4096}, {1, 100}, {0, 8192}};
  return s;
}

worker::v1::GpuOp Op(int64_t src, int64_t dst, int64_t elems) {
  worker::v1::GpuOp g;
  g.set_chunk(0);
  g.set_allocation_id(7);
  g.set_src_offset(src);
  g.set_dst_offset(dst);
  g.set_rows(1);
  g.set_cols(elems);
  g.set_src_stride(elems * 2);
  g.set_dst_stride(elems * 2);
  g.set_src_dtype(v1::BFLOAT16);
  g.set_dst_dtype(v1::BFLOAT16);
  return g;
}

TEST(SourceOpsTest, AnOpJoinedAcrossTensorsReadsEachWhereItLives) {
  const ChunkPlan plan = Plan();
  ASSERT_EQ(plan.tensor_offsets, (std::vector<int64_t>{0, 256, 768}));
  worker::v1::BeginUpdateRequest req;
  // The copy plan's op for a and b together (contiguous in the stream and
  // in the engine at 1000), then b's second half alone.
  ASSERT_TRUE(
      SplitSourceOp(plan, MovedB(), {11, 12}, 0, Op(0, 1000, 384), &req).ok());
  ASSERT_EQ(req.ops_size(), 2);
  EXPECT_EQ(req.ops(0).src_allocation_id(), 11);  // a, in region 0
  EXPECT_EQ(req.ops(0).src_offset(), 4096);
  EXPECT_EQ(req.ops(0).cols(), 128);
  EXPECT_EQ(req.ops(0).dst_offset(), 1000);
  EXPECT_EQ(req.ops(1).src_allocation_id(), 12);  // b, moved to region 1
  EXPECT_EQ(req.ops(1).src_offset(), 100);
  EXPECT_EQ(req.ops(1).cols(), 256);
  EXPECT_EQ(req.ops(1).dst_offset(), 1000 + 256);
  req.Clear();
  ASSERT_TRUE(
      SplitSourceOp(plan, MovedB(), {11, 12}, 0, Op(512, 3000, 128), &req)
          .ok());
  ASSERT_EQ(req.ops_size(), 1);
  EXPECT_EQ(req.ops(0).src_offset(), 100 + 256);  // into b, not past a
}

TEST(SourceOpsTest, ConversionAdvancesEachSideByItsElementSize) {
  const ChunkPlan plan = Plan();
  worker::v1::GpuOp g = Op(0, 0, 384);
  g.set_dst_dtype(v1::FLOAT32);
  g.set_dst_stride(384 * 4);
  worker::v1::BeginUpdateRequest req;
  ASSERT_TRUE(SplitSourceOp(plan, MovedB(), {11, 12}, 0, g, &req).ok());
  ASSERT_EQ(req.ops_size(), 2);
  EXPECT_EQ(req.ops(1).dst_offset(), 128 * 4);  // float32 in the engine
  EXPECT_EQ(req.ops(1).src_offset(), 100);
}

TEST(SourceOpsTest, BytesNoTensorHoldsAreRefused) {
  const ChunkPlan plan = Plan();
  worker::v1::BeginUpdateRequest req;
  // c ends at 768 + 128: an op running past it reads padding.
  const absl::Status s =
      SplitSourceOp(plan, MovedB(), {11, 12}, 0, Op(768, 0, 128), &req);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
}

TEST(SourceOpsTest, MergeJoinsOnlyWhatContinuesOnBothSides) {
  worker::v1::BeginUpdateRequest req;
  worker::v1::GpuOp a = Op(4096, 1000, 128);
  a.set_src_allocation_id(11);
  worker::v1::GpuOp c = Op(4096 + 256, 1000 + 256, 64);  // follows a
  c.set_src_allocation_id(11);
  worker::v1::GpuOp b = Op(100, 1000 + 384, 256);  // another region
  b.set_src_allocation_id(12);
  worker::v1::GpuOp d = Op(4096 + 384, 1000 + 999, 8);  // dst doesn't follow
  d.set_src_allocation_id(11);
  *req.add_ops() = a;
  *req.add_ops() = b;
  *req.add_ops() = c;
  *req.add_ops() = d;
  MergeContiguousOps(&req);
  ASSERT_EQ(req.ops_size(), 3);
  EXPECT_EQ(req.ops(0).cols(), 128 + 64);  // a + c
  EXPECT_EQ(req.ops(0).src_stride(), (128 + 64) * 2);
  EXPECT_EQ(req.ops(1).src_allocation_id(), 12);
  EXPECT_EQ(req.ops(2).cols(), 8);
}

TEST(SourceOpsTest, MergeFollowsThePackedStreamAcrossChunks) {
  worker::v1::BeginUpdateRequest req;
  req.set_chunk_bytes(1024);
  worker::v1::GpuOp tail = Op(768, 0, 128);  // chunk 0's last 256 bytes
  worker::v1::GpuOp head = Op(0, 256, 64);   // chunk 1 continues it
  head.set_chunk(1);
  *req.add_ops() = tail;
  *req.add_ops() = head;
  MergeContiguousOps(&req);
  ASSERT_EQ(req.ops_size(), 1);
  EXPECT_EQ(req.ops(0).chunk(), 0);  // runs with the earlier chunk
  EXPECT_EQ(req.ops(0).cols(), 192);
}

}  // namespace
}  // namespace weightsync
