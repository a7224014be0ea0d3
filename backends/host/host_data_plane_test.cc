// The host data plane's sparse apply and chunk scatter, as a peer's patch or
// a lost engine meets them (issue 33: the survivors of the sweep of
// host_data_plane.cc against the suites that reach it): an index outside the
// tensor refuses the whole patch before any element is written, naming the
// tensor and the index; uint32 indices are read as uint32; a lost engine's
// memory is never touched; a block use writes only its own rows and columns.
#include "backends/host/host_data_plane.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "daemon/core/copy_plan.h"
#include "daemon/core/engine_layout.h"
#include "daemon/core/source_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"

namespace weightsync {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr float kOld = -7.0f;  // what engine memory holds before a patch

// `engines` engines of one host region each, `floats` float32 elements all
// kOld; regions()[e] reads them back.
struct Engines {
  CopyPlan plan;
  std::vector<std::shared_ptr<testing::HeapRegion>> heap;

  Engines(int engines, int64_t floats) {
    for (int e = 0; e < engines; ++e) {
      auto layout = std::make_shared<EngineLayout>();
      layout->engine_id = "e" + std::to_string(e);
      auto region = std::make_shared<testing::HeapRegion>(floats * 4);
      std::vector<float> old(floats, kOld);
      std::memcpy(region->data(), old.data(), floats * 4);
      layout->regions.push_back(region);
      heap.push_back(region);
      plan.engines.push_back(layout);
    }
  }
  std::vector<float> Floats(int engine) const {
    std::vector<float> out(heap[engine]->size() / 4);
    std::memcpy(out.data(), heap[engine]->data(), heap[engine]->size());
    return out;
  }
};

// A patch of a float32 tensor of `numel` elements (`cols` to a row) with
// these indices (4 or 8 bytes each) and values 1, 2, 3, ...; no uses.
struct Patch {
  SparsePatch patch;
  std::string payload;

  Patch(int64_t numel, int64_t cols, const std::vector<int64_t>& indices,
        int index_bytes) {
    patch.name = "w";
    patch.nnz = indices.size();
    patch.numel = numel;
    patch.cols = cols;
    patch.index_bytes = index_bytes;
    patch.dtype = v1::FLOAT32;
    for (int64_t i : indices) {
      if (index_bytes == 4) {
        const uint32_t narrow = static_cast<uint32_t>(i);
        payload.append(reinterpret_cast<const char*>(&narrow), 4);
      } else {
        payload.append(reinterpret_cast<const char*>(&i), 8);
      }
    }
    for (size_t k = 0; k < indices.size(); ++k) {
      const float v = 1.0f + k;
      payload.append(reinterpret_cast<const char*>(&v), 4);
    }
    patch.payload_bytes = payload.size();
  }
  // The whole tensor is engine e's parameter at element `at` (flat).
  void UseWhole(int32_t engine, int64_t at) {
    SparsePatch::Use u;
    u.engine = engine;
    u.param_offset = at * 4;
    u.dtype = v1::FLOAT32;
    u.implicit = true;
    patch.uses.push_back(u);
  }
  absl::Status Apply(const CopyPlan& plan,
                     const std::atomic<bool>* lost = nullptr) const {
    return ApplySparsePatch(
        plan, patch, reinterpret_cast<const uint8_t*>(payload.data()), lost);
  }
};

TEST(ApplySparsePatchTest, ItsFirstAndLastElementsAreWritten) {
  for (int index_bytes : {8, 4}) {
    Engines engines(1, 6);
    Patch p(6, 6, {0, 5}, index_bytes);
    p.UseWhole(0, 0);
    ASSERT_TRUE(p.Apply(engines.plan).ok()) << index_bytes;
    EXPECT_THAT(engines.Floats(0), ElementsAre(1, kOld, kOld, kOld, kOld, 2))
        << index_bytes << "-byte indices";
  }
}

TEST(ApplySparsePatchTest, AnIndexOutsideTheTensorRefusesItWhole) {
  // One good index before the bad one: nothing at all is written.
  for (const auto& [bad, index_bytes, named] :
       std::vector<std::tuple<int64_t, int, std::string>>{
           {-1, 8, "-1"},
           {6, 8, "6"},
           {6, 4, "6"},
           {int64_t{1} << 40, 8, "1099511627776"},
           // A uint32 index is never negative: 0xffffffff is 4294967295.
           {-1, 4, "4294967295"}}) {
    Engines engines(1, 6);
    Patch p(6, 6, {0, bad}, index_bytes);
    p.UseWhole(0, 0);
    absl::Status s = p.Apply(engines.plan);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << named;
    EXPECT_THAT(s.message(), HasSubstr("tensor 'w': sparse index " + named +
                                       " is outside [0, 6)"));
    EXPECT_THAT(engines.Floats(0), Each(kOld)) << named;
  }
}

TEST(ApplySparsePatchTest, Uint32IndicesAreReadAsUint32) {
  // Read as int64, these four bytes pairs would be other indices entirely.
  Engines engines(1, 8);
  Patch p(8, 8, {7, 2, 4}, 4);
  p.UseWhole(0, 0);
  ASSERT_TRUE(p.Apply(engines.plan).ok());
  EXPECT_THAT(engines.Floats(0),
              ElementsAre(kOld, kOld, 2, kOld, 3, kOld, kOld, 1));
}

TEST(ApplySparsePatchTest, ALostEngineIsNotTouched) {
  Engines engines(2, 4);
  Patch p(4, 4, {1, 3}, 8);
  p.UseWhole(0, 0);
  p.UseWhole(1, 0);
  std::atomic<bool> lost[2] = {false, true};
  ASSERT_TRUE(p.Apply(engines.plan, lost).ok());
  EXPECT_THAT(engines.Floats(0), ElementsAre(kOld, 1, kOld, 2));
  EXPECT_THAT(engines.Floats(1), Each(kOld));
}

TEST(ApplySparsePatchTest, ABlockUseWritesOnlyItsRowsAndColumns) {
  // A [4, 4] tensor; the use holds rows 1-2, columns 1-2 at elements 5.. of
  // the engine's 16 (row stride 2). The patch touches every element on and
  // around the block's edges: only the four inside land.
  Engines engines(1, 16);
  std::vector<int64_t> all;
  for (int64_t i = 0; i < 16; ++i) all.push_back(i);
  Patch p(16, 4, all, 8);
  SparsePatch::Use u;
  u.dtype = v1::FLOAT32;
  u.row_begin = 1;
  u.row_count = 2;
  u.col_begin = 1;
  u.col_count = 2;
  u.dest_offset = 5;
  u.dest_row_stride = 2;
  p.patch.uses.push_back(u);
  ASSERT_TRUE(p.Apply(engines.plan).ok());
  // Element (r, c) carries value 1 + 4r + c: (1,1) 6, (1,2) 7, (2,1) 10,
  // (2,2) 11, at 5, 6, 7, 8.
  EXPECT_THAT(engines.Floats(0),
              ElementsAre(kOld, kOld, kOld, kOld, kOld, 6, 7, 10, 11, kOld,
                          kOld, kOld, kOld, kOld, kOld, kOld));
}

TEST(ScatterChunkTest, ALostEngineIsNotTouched) {
  Engines engines(2, 2);
  const float chunk[2] = {4, 5};
  std::vector<CopyOp> ops(2);
  for (int e = 0; e < 2; ++e) {
    ops[e].engine = e;
    ops[e].rows = 1;
    ops[e].cols = 2;
    ops[e].src_dtype = ops[e].dst_dtype = v1::FLOAT32;
  }
  std::atomic<bool> lost[2] = {true, false};
  ScatterChunk(engines.plan, ops, reinterpret_cast<const uint8_t*>(chunk),
               lost);
  EXPECT_THAT(engines.Floats(0), Each(kOld));
  EXPECT_THAT(engines.Floats(1), ElementsAre(4, 5));
  ScatterChunk(engines.plan, ops, reinterpret_cast<const uint8_t*>(chunk),
               nullptr);  // none lost
  EXPECT_THAT(engines.Floats(0), ElementsAre(4, 5));
}

// A registered source of two float32 tensors, "a" (64 elements, packed at
// 0) and "b" (1 element, packed at 256, right after a), whose bytes live
// apart in the trainer's memory (a at byte 16, b at byte 400): a copy of
// the packed stream is read where each tensor lives (issue 33: the
// survivors of CopyOpFromSource, host_data_plane.cc:100-108).
struct TwoTensorSource {
  Engines engines{1, 80};
  Source source;
  std::vector<float> a, b;

  TwoTensorSource() {
    engines.plan.chunks.tensor_offsets = {0, 256};
    engines.plan.chunks.payload_bytes = {256, 4};
    Chunk chunk;
    chunk.size = 260;
    engines.plan.chunks.chunks.push_back(chunk);
    auto memory = std::make_shared<testing::HeapRegion>(512);
    for (int i = 0; i < 64; ++i) a.push_back(100 + i);
    b.push_back(999);
    std::memcpy(memory->data() + 16, a.data(), 256);
    std::memcpy(memory->data() + 400, b.data(), 4);
    source.id = "s";
    source.regions.push_back(memory);
    source.placements = {{0, 16}, {0, 400}};
  }
  absl::Status Scatter(const CopyOp& op) {
    engines.plan.ops_by_chunk = {{op}};
    return ScatterFromSource(engines.plan, 0, source, nullptr);
  }
  static CopyOp Op(int64_t src_offset, int64_t rows, int64_t cols,
                   int64_t src_stride, int64_t dst_stride) {
    CopyOp op;
    op.src_offset = src_offset;
    op.rows = rows;
    op.cols = cols;
    op.src_stride = src_stride;
    op.dst_stride = dst_stride;
    op.src_dtype = op.dst_dtype = v1::FLOAT32;
    return op;
  }
};

TEST(ScatterFromSourceTest, ACopyAcrossTwoTensorsReadsEachWhereItLives) {
  // 65 elements (the plan joins ops contiguous in the stream): a's 64, then
  // b's one, the last piece a single element; as one row, and as 5 rows of
  // 13 packed back to back on both sides (one run all the same).
  for (const CopyOp& op : {TwoTensorSource::Op(0, 1, 65, 0, 0),
                           TwoTensorSource::Op(0, 5, 13, 52, 52)}) {
    TwoTensorSource t;
    ASSERT_TRUE(t.Scatter(op).ok()) << op.rows << " rows";
    std::vector<float> want = t.a;
    want.push_back(999);
    want.resize(80, kOld);
    EXPECT_EQ(t.engines.Floats(0), want) << op.rows << " rows";
  }
}

TEST(ScatterFromSourceTest, AStridedCopyMayEndOnItsTensorsLastByte) {
  TwoTensorSource t;
  // Rows of 2 every 3 elements, the second ending on a's last byte
  // (elements 59, 60 and 62, 63); one element more would be b's.
  ASSERT_TRUE(t.Scatter(TwoTensorSource::Op(236, 2, 2, 12, 8)).ok());
  const std::vector<float> got = t.engines.Floats(0);
  EXPECT_THAT(std::vector<float>(got.begin(), got.begin() + 5),
              ElementsAre(159, 160, 162, 163, kOld));
  // A strided copy that runs past its tensor is refused, naming the source.
  absl::Status past = t.Scatter(TwoTensorSource::Op(240, 2, 2, 12, 8));
  EXPECT_EQ(past.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(past.message(), HasSubstr("registered source 's'"));
}

TEST(ScatterFromSourceTest, ALostEngineIsNotTouched) {
  TwoTensorSource t;
  t.engines.plan.ops_by_chunk = {{TwoTensorSource::Op(0, 1, 65, 0, 0)}};
  std::atomic<bool> lost[1] = {true};
  ASSERT_TRUE(ScatterFromSource(t.engines.plan, 0, t.source, lost).ok());
  EXPECT_THAT(t.engines.Floats(0), Each(kOld));
}

// Byte-sized elements: a copy may read a tensor's very last byte, and a
// strided copy one byte past it is refused (a 16-byte UINT8 tensor "c").
TEST(ScatterFromSourceTest, ByteElementsToTheLastByteAndNotOnePast) {
  TwoTensorSource t;
  t.engines.plan.chunks.tensor_offsets = {0};
  t.engines.plan.chunks.payload_bytes = {16};
  t.source.placements = {{0, 16}};  // a's first 16 bytes, as bytes
  auto op = [](int64_t at, int64_t rows, int64_t cols, int64_t stride) {
    CopyOp o = TwoTensorSource::Op(at, rows, cols, stride, cols);
    o.src_dtype = o.dst_dtype = v1::UINT8;
    return o;
  };
  std::vector<uint8_t> bytes(16);
  std::memcpy(bytes.data(), t.a.data(), 16);
  ASSERT_TRUE(t.Scatter(op(15, 1, 1, 0)).ok());  // the last byte alone
  EXPECT_EQ(t.engines.heap[0]->data()[0], bytes[15]);
  ASSERT_TRUE(t.Scatter(op(11, 2, 2, 3)).ok());  // rows ending on it
  EXPECT_EQ(std::vector<uint8_t>(t.engines.heap[0]->data(),
                                 t.engines.heap[0]->data() + 4),
            std::vector<uint8_t>({bytes[11], bytes[12], bytes[14], bytes[15]}));
  EXPECT_EQ(t.Scatter(op(12, 2, 2, 3)).code(), absl::StatusCode::kInternal);
}

// A plan whose copy reads packed bytes no tensor holds (before the first
// tensor, in the padding after one) is refused, naming the source, and
// nothing is written: the daemon makes its plans, so this is a broken plan.
TEST(ScatterFromSourceTest, ACopyOfBytesNoTensorHoldsIsRefused) {
  for (const int64_t at :
       {int64_t{0}, int64_t{255}, int64_t{256 + 12}, int64_t{256 + 255}}) {
    TwoTensorSource t;
    // "a" is now 3 elements packed at 256 (12 bytes, padded to 256), "b"
    // one at 512.
    t.engines.plan.chunks.tensor_offsets = {256, 512};
    t.engines.plan.chunks.payload_bytes = {12, 4};
    absl::Status s = t.Scatter(TwoTensorSource::Op(at, 1, 1, 0, 0));
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << at;
    EXPECT_THAT(s.message(),
                HasSubstr("reads packed bytes at " + std::to_string(at) +
                          " that no tensor of the registered "
                          "source 's' holds"));
    EXPECT_THAT(t.engines.Floats(0), Each(kOld)) << at;
  }
}

}  // namespace
}  // namespace weightsync
