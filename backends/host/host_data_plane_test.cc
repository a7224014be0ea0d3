// The host data plane's sparse apply and chunk scatter, as a peer's patch or
// a lost engine meets them (issue 33: the survivors of the sweep of
// host_data_plane.cc against the suites that reach it): an index outside the
// tensor refuses the whole patch before any element is written, naming the
// tensor and the index; uint32 indices are read as uint32; a lost engine's
// memory is never touched; a block use writes only its own rows and columns.
#include "backends/host/host_data_plane.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
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

// A source whose tensors live in two allocations (a in the first, b in the
// second): one pass per allocation, each copying what lives there, until
// no piece of a later one is left.
TEST(ScatterFromSourceTest, ATensorInALaterAllocationIsCopiedFromIt) {
  for (int regions : {2, 3}) {
    TwoTensorSource t;
    auto second = std::make_shared<testing::HeapRegion>(64);
    std::memcpy(second->data() + 8, t.b.data(), 4);
    t.source.regions.push_back(second);
    if (regions == 3) {  // b in the third, the second unused
      t.source.regions.push_back(second);
      t.source.placements[1] = {2, 8};
    } else {
      t.source.placements[1] = {1, 8};
    }
    ASSERT_TRUE(t.Scatter(TwoTensorSource::Op(0, 1, 65, 0, 0)).ok());
    std::vector<float> want = t.a;
    want.push_back(999);
    want.resize(80, kOld);
    EXPECT_EQ(t.engines.Floats(0), want) << regions << " allocations";
  }
}

// The SIGBUS handler flags an allocation the trainer truncated
// (bus_guard.h): the chunk fails as DATA_LOSS, naming the source.
TEST(ScatterFromSourceTest, AnAllocationThatFaultedFailsTheChunk) {
  TwoTensorSource t;
  t.source.regions[0]->faulted_flag()->store(true);
  absl::Status s = t.Scatter(TwoTensorSource::Op(0, 1, 65, 0, 0));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("allocation 0 of source 's' shrank "
                                     "under the daemon"));
}

// Ops of several engines in one chunk: a lost engine's are skipped, and
// only those, whichever engine comes first.
TEST(ScatterFromSourceTest, ALostEngineSkipsOnlyItsOwnCopies) {
  for (int lost_engine : {0, 1}) {
    TwoTensorSource t;
    t.engines = Engines(2, 80);
    t.engines.plan.chunks.tensor_offsets = {0, 256};
    t.engines.plan.chunks.payload_bytes = {256, 4};
    t.engines.plan.chunks.chunks.resize(1);
    t.engines.plan.chunks.chunks[0].size = 260;
    std::vector<CopyOp> ops;
    for (int e : {0, 0, 1, 1}) {
      const bool second = ops.size() % 2;
      CopyOp op = TwoTensorSource::Op(second ? 128 : 0, 1, 32, 0, 0);
      op.engine = e;
      op.dst_offset = second ? 128 : 0;
      ops.push_back(op);
    }
    t.engines.plan.ops_by_chunk = {ops};
    std::atomic<bool> lost[2] = {lost_engine == 0, lost_engine == 1};
    ASSERT_TRUE(ScatterFromSource(t.engines.plan, 0, t.source, lost).ok());
    std::vector<float> want = t.a;
    want.resize(80, kOld);
    EXPECT_THAT(t.engines.Floats(lost_engine), Each(kOld)) << lost_engine;
    EXPECT_EQ(t.engines.Floats(1 - lost_engine), want) << lost_engine;
  }
}

// Copies into two regions of one engine, the second truncated: each run of
// copies is guarded on the region it writes, so the fault fails that
// region (dropped at Finish) instead of killing the daemon, and the first
// region is written.
TEST(ScatterFromSourceTest, ATruncatedEngineRegionFaultsAloneAndKillsNothing) {
  TwoTensorSource t;
  auto truncated = std::make_shared<testing::ShrunkRegion>(4096);
  ASSERT_NE(truncated->data(), nullptr);
  auto layout = std::make_shared<EngineLayout>(*t.engines.plan.engines[0]);
  layout->regions.push_back(truncated);
  t.engines.plan.engines[0] = layout;
  CopyOp first = TwoTensorSource::Op(0, 1, 32, 0, 0);
  CopyOp second = TwoTensorSource::Op(128, 1, 32, 0, 0);
  second.region = 1;
  t.engines.plan.ops_by_chunk = {{first, second}};
  EXPECT_TRUE(ScatterFromSource(t.engines.plan, 0, t.source, nullptr).ok());
  EXPECT_TRUE(truncated->faulted());
  EXPECT_FALSE(t.engines.heap[0]->faulted());
  std::vector<float> want(t.a.begin(), t.a.begin() + 32);
  want.resize(80, kOld);
  EXPECT_EQ(t.engines.Floats(0), want);
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

// ---- HostDataPlane: the life of an update on the host backend ----------

// Engine memory whose data() holds any thread but the test's (the plane's
// worker, in the middle of a chunk) until the test opens the gate: the
// plane is then busy with one chunk for as long as the test needs.
class GatedRegion : public MappedRegion {
 public:
  explicit GatedRegion(int64_t floats) : bytes_(floats * 4, 0) {}
  uint8_t* data() const override {
    if (std::this_thread::get_id() != test_thread_) {
      if (!told_.exchange(true)) entered_.Notify();
      gate_.WaitForNotification();
    }
    return const_cast<uint8_t*>(bytes_.data());
  }
  int64_t size() const override { return bytes_.size(); }
  v1::MemoryKind kind() const override { return v1::MEMORY_HOST_SHM; }
  const std::string& device_uuid() const override { return uuid_; }
  void WaitEntered() const { entered_.WaitForNotification(); }
  void Open() const {
    if (!gate_.HasBeenNotified()) gate_.Notify();
  }
  std::vector<float> Floats() const {
    std::vector<float> out(bytes_.size() / 4);
    std::memcpy(out.data(), bytes_.data(), bytes_.size());
    return out;
  }

 private:
  std::vector<uint8_t> bytes_;
  std::string uuid_ = "host";
  const std::thread::id test_thread_ = std::this_thread::get_id();
  mutable std::atomic<bool> told_{false};
  mutable absl::Notification entered_, gate_;
};

// A plan of `chunks` chunks of `floats` float32 elements each: chunk k
// copies its elements to floats [k * floats, (k + 1) * floats) of every
// engine of `engines` (each of chunks * floats elements).
std::shared_ptr<CopyPlan> ChunkedPlan(const Engines& engines, int chunks,
                                      int64_t floats) {
  auto plan = std::make_shared<CopyPlan>(engines.plan);
  plan->chunks.chunk_bytes = floats * 4;
  for (int k = 0; k < chunks; ++k) {
    Chunk c;
    c.index = k;
    c.offset = k * floats * 4;
    c.size = floats * 4;
    plan->chunks.chunks.push_back(c);
    std::vector<CopyOp> ops;
    for (int e = 0; e < static_cast<int>(engines.plan.engines.size()); ++e) {
      CopyOp op;
      op.engine = e;
      op.dst_offset = c.offset;
      op.rows = 1;
      op.cols = floats;
      op.src_dtype = op.dst_dtype = v1::FLOAT32;
      ops.push_back(op);
    }
    plan->ops_by_chunk.push_back(ops);
  }
  plan->sparse_pieces_by_chunk.resize(chunks);
  return plan;
}

// Chunk k's bytes: `floats` elements 100 k + 1, 100 k + 2, ...
std::string ChunkData(int k, int64_t floats) {
  std::vector<float> v(floats);
  for (int64_t i = 0; i < floats; ++i) v[i] = 100.0f * k + 1 + i;
  return std::string(reinterpret_cast<const char*>(v.data()), floats * 4);
}

std::vector<float> Expected(int chunks, int64_t floats) {
  std::vector<float> out;
  for (int k = 0; k < chunks; ++k) {
    const std::string d = ChunkData(k, floats);
    const float* f = reinterpret_cast<const float*>(d.data());
    out.insert(out.end(), f, f + floats);
  }
  return out;
}

absl::Time Soon() { return absl::Now() + absl::Milliseconds(100); }
absl::Time Later() { return absl::Now() + absl::Seconds(20); }

TEST(HostDataPlaneTest, StagingIsRefusedPastTheBudgetNotAtIt) {
  Engines engines(1, 256);
  std::shared_ptr<CopyPlan> plan = ChunkedPlan(engines, 1, 256);  // 1 KiB
  struct Case {
    int buffers;
    int64_t budget, band;
    bool ok;
    std::string words;
  };
  for (const Case& c : std::vector<Case>{
           {2, 2048, 0, true, ""},
           {2, 2047, 0, false, "2 x 1024 bytes exceeds the budget of 2047"},
           {1, 2048, 0, true, ""},  // fewer than 2 buffers count as 2
           {1, 2047, 0, false, "2 x 1024 bytes exceeds the budget of 2047"},
           {3, 3071, 0, false, "3 x 1024 bytes exceeds the budget of 3071"},
           {2, 2148, 100, true, ""},
           {2, 2147, 100, false,
            "host staging of 2048 bytes and 100 bytes of FP8 targets' rows "
            "of blocks (float32) exceed the budget of 2147"}}) {
    HostDataPlane plane({c.buffers, c.budget});
    plan->quant_band_bytes = c.band;
    absl::Status s = plane.Begin(plan, {});
    const std::string what = absl::StrCat(c.buffers, " buffers, budget ",
                                          c.budget, ", band ", c.band);
    if (c.ok) {
      EXPECT_TRUE(s.ok()) << what << ": " << s;
      EXPECT_TRUE(plane.Drain(Later()).ok()) << what;
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << what;
      EXPECT_THAT(s.message(), HasSubstr(c.words)) << what;
      // Refused before anything began: no update to feed.
      EXPECT_EQ(plane.SubmitChunk(0, ChunkData(0, 256), Soon()).code(),
                absl::StatusCode::kFailedPrecondition)
          << what;
    }
  }
}

TEST(HostDataPlaneTest, GpuMemoryIsRefusedNamingWhoseItIs) {
  Engines engines(2, 4);
  auto layout = std::make_shared<EngineLayout>(*engines.plan.engines[1]);
  layout->regions.push_back(std::make_shared<testing::GpuRegion>());
  engines.plan.engines[1] = layout;  // engine e1's second region
  HostDataPlane plane({});
  absl::Status s = plane.Begin(ChunkedPlan(engines, 1, 4), {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("engine 'e1' registered GPU memory "
                                     "(GPU-7); the host backend writes host "
                                     "shared memory only"));
  // A source of GPU memory, first or last of its allocations.
  Engines host(1, 4);
  for (int at : {0, 1}) {
    Source source;
    source.id = "s";
    source.regions = {std::make_shared<testing::HeapRegion>(16),
                      std::make_shared<testing::HeapRegion>(16)};
    source.regions[at] = std::make_shared<testing::GpuRegion>();
    absl::Status g = plane.BeginFromSource(ChunkedPlan(host, 1, 4), {}, source);
    EXPECT_EQ(g.code(), absl::StatusCode::kInvalidArgument) << at;
    EXPECT_THAT(g.message(), HasSubstr(absl::StrCat("source allocation ", at,
                                                    " of 's' is GPU memory")));
  }
  EXPECT_EQ(plane.SubmitChunk(0, ChunkData(0, 4), Soon()).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(HostDataPlaneTest, EveryChunkIsWrittenBeforeDrainReturns) {
  Engines engines(2, 3 * 8);
  HostDataPlane plane({});
  ASSERT_TRUE(plane.Begin(ChunkedPlan(engines, 3, 8), {}).ok());
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(plane.SubmitChunk(k, ChunkData(k, 8), Later()).ok()) << k;
  }
  ASSERT_TRUE(plane.Drain(Later()).ok());
  EXPECT_EQ(plane.chunks_written(), 3);
  EXPECT_EQ(engines.Floats(0), Expected(3, 8));
  EXPECT_EQ(engines.Floats(1), Expected(3, 8));
  // The update is over: a late chunk is refused and writes nothing.
  absl::Status late = plane.SubmitChunk(0, ChunkData(5, 8), Soon());
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.message(), HasSubstr("no update in progress"));
  EXPECT_EQ(engines.Floats(0), Expected(3, 8));
}

TEST(HostDataPlaneTest, ALostEngineIsLeftAloneForThatUpdateOnly) {
  Engines engines(2, 8);
  HostDataPlane plane({});
  plane.MarkEngineLost(0);  // no update yet: nothing to mark
  ASSERT_TRUE(plane.Begin(ChunkedPlan(engines, 1, 8), {}).ok());
  for (int bad : {-1, 2, 1 << 20}) plane.MarkEngineLost(bad);  // ignored
  plane.MarkEngineLost(0);
  ASSERT_TRUE(plane.SubmitChunk(0, ChunkData(0, 8), Later()).ok());
  ASSERT_TRUE(plane.Drain(Later()).ok());
  EXPECT_THAT(engines.Floats(0), Each(kOld));
  EXPECT_EQ(engines.Floats(1), Expected(1, 8));
  // The next update starts with every engine whole again; now the last
  // engine is the lost one.
  ASSERT_TRUE(plane.Begin(ChunkedPlan(engines, 1, 8), {}).ok());
  plane.MarkEngineLost(1);
  ASSERT_TRUE(plane.SubmitChunk(0, ChunkData(7, 8), Later()).ok());
  ASSERT_TRUE(plane.Drain(Later()).ok());
  const std::string seven = ChunkData(7, 8);
  EXPECT_EQ(
      engines.Floats(0),
      std::vector<float>(reinterpret_cast<const float*>(seven.data()),
                         reinterpret_cast<const float*>(seven.data()) + 8));
  EXPECT_EQ(engines.Floats(1), Expected(1, 8));
}

// One engine of gated memory: the worker holds chunk 0 until the gate
// opens.
struct GatedPlane {
  Engines none{0, 0};
  std::shared_ptr<GatedRegion> memory = std::make_shared<GatedRegion>(3 * 4);
  std::shared_ptr<CopyPlan> plan;
  HostDataPlane plane{{2, int64_t{1} << 20}};  // two chunks in flight

  GatedPlane() {
    auto layout = std::make_shared<EngineLayout>();
    layout->engine_id = "gated";
    layout->regions.push_back(memory);
    none.plan.engines.push_back(layout);
    plan = ChunkedPlan(none, 3, 4);
  }
  ~GatedPlane() { memory->Open(); }
};

TEST(HostDataPlaneTest, NoMoreChunksThanBuffersAreHeldAndDrainWaitsForAll) {
  GatedPlane g;
  ASSERT_TRUE(g.plane.Begin(g.plan, {}).ok());
  ASSERT_TRUE(g.plane.SubmitChunk(0, ChunkData(0, 4), Later()).ok());
  g.memory->WaitEntered();  // the worker is in chunk 0
  // Busy with a chunk, even with nothing queued: no new update.
  absl::Status busy = g.plane.Begin(g.plan, {});
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(busy.message(), HasSubstr("still busy"));
  // Two buffers: chunk 1 waits in the second, chunk 2 finds none.
  ASSERT_TRUE(g.plane.SubmitChunk(1, ChunkData(1, 4), Soon()).ok());
  absl::Status full = g.plane.SubmitChunk(2, ChunkData(2, 4), Soon());
  EXPECT_EQ(full.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(full.message(),
              HasSubstr("chunk 2: no free staging buffer before the deadline"));
  EXPECT_EQ(g.plane.Begin(g.plan, {}).code(),
            absl::StatusCode::kFailedPrecondition);
  absl::Status slow = g.plane.Drain(Soon());
  EXPECT_EQ(slow.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(slow.message(), HasSubstr("wrote 0 of 2 chunks"));
  g.memory->Open();
  ASSERT_TRUE(g.plane.Drain(Later()).ok());
  EXPECT_EQ(g.plane.chunks_written(), 2);
  std::vector<float> want = Expected(2, 4);
  want.resize(12, 0);  // chunk 2 was refused: its floats untouched
  EXPECT_EQ(g.memory->Floats(), want);
}

// A chunk queued and not yet taken by the worker is an update in progress
// too: Begin right after a SubmitChunk is refused whether the worker took
// it yet or not (tried many times to meet both).
TEST(HostDataPlaneTest, AQueuedChunkIsAnUpdateInProgress) {
  for (int i = 0; i < 100; ++i) {
    GatedPlane g;
    ASSERT_TRUE(g.plane.Begin(g.plan, {}).ok());
    ASSERT_TRUE(g.plane.SubmitChunk(0, ChunkData(0, 4), Later()).ok());
    ASSERT_EQ(g.plane.Begin(g.plan, {}).code(),
              absl::StatusCode::kFailedPrecondition)
        << i;
  }
}

TEST(HostDataPlaneTest, AbortWakesAChunkWaitingForABuffer) {
  // A sender that comes after the Abort is told "no update in progress"
  // instead: the case is tried again until the sender was there first.
  for (int attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 20) << "the sender never waited before the Abort";
    GatedPlane g;
    ASSERT_TRUE(g.plane.Begin(g.plan, {}).ok());
    ASSERT_TRUE(g.plane.SubmitChunk(0, ChunkData(0, 4), Later()).ok());
    g.memory->WaitEntered();
    ASSERT_TRUE(g.plane.SubmitChunk(1, ChunkData(1, 4), Later()).ok());
    absl::Status waited;
    absl::Notification returned;
    std::thread sender([&] {
      waited = g.plane.SubmitChunk(2, ChunkData(2, 4), Later());
      returned.Notify();
    });
    absl::SleepFor(absl::Milliseconds(20 * (attempt + 1)));
    // Abort returns once the worker leaves chunk 0; the waiting chunk is
    // told at once, not at its deadline.
    std::thread aborter([&] { g.plane.Abort(); });
    EXPECT_TRUE(returned.WaitForNotificationWithTimeout(absl::Seconds(10)));
    g.memory->Open();
    sender.join();
    aborter.join();
    if (waited.code() == absl::StatusCode::kFailedPrecondition) continue;
    EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
    EXPECT_THAT(waited.message(), HasSubstr("update aborted"));
    // Chunk 1 was dropped with the queue: only chunk 0 reached the engine.
    std::vector<float> want = Expected(1, 4);
    want.resize(12, 0);
    EXPECT_EQ(g.memory->Floats(), want);
    // The plane takes the next update.
    EXPECT_TRUE(g.plane.Begin(g.plan, {}).ok());
    break;
  }
}

TEST(HostDataPlaneTest, AnUpdateFromASourceReadsEveryChunkFromIt) {
  TwoTensorSource t;
  auto plan = std::make_shared<CopyPlan>(t.engines.plan);
  plan->ops_by_chunk = {{TwoTensorSource::Op(0, 1, 65, 0, 0)}};
  plan->sparse_pieces_by_chunk.resize(1);
  HostDataPlane plane({});
  ASSERT_TRUE(plane.BeginFromSource(plan, {}, t.source).ok());
  ASSERT_TRUE(plane.Drain(Later()).ok());
  EXPECT_EQ(plane.chunks_written(), 1);
  std::vector<float> want = t.a;
  want.push_back(999);
  want.resize(80, kOld);
  EXPECT_EQ(t.engines.Floats(0), want);
}

// Sparse patches ride the chunks as pieces of their payload: a patch is
// applied once all of it arrived (split over two chunks here), and Drain
// reports the update's first bad patch, not a later one.
TEST(HostDataPlaneTest, APatchIsAppliedWholeAndTheFirstBadOneReported) {
  Engines engines(1, 16);
  Patch good(16, 16, {3, 9}, 8);
  good.UseWhole(0, 0);
  auto plan = std::make_shared<CopyPlan>(engines.plan);
  plan->sparse = {good.patch};
  const int64_t half = good.payload.size() / 2;
  plan->chunks.chunk_bytes = half;
  plan->ops_by_chunk.resize(2);
  plan->sparse_pieces_by_chunk = {{{0, Piece{0, 0, 0, half}}},
                                  {{0, Piece{0, half, 0, half}}}};
  for (int k = 0; k < 2; ++k) {
    Chunk c;
    c.index = k;
    plan->chunks.chunks.push_back(c);
  }
  HostDataPlane plane({});
  // The good patch's two halves, one a chunk.
  auto send_good = [&] {
    for (int k = 0; k < 2; ++k) {
      if (!plane.SubmitChunk(k, good.payload.substr(k * half, half), Later())
               .ok()) {
        return false;
      }
    }
    return true;
  };
  ASSERT_TRUE(plane.Begin(plan, {}).ok());
  ASSERT_TRUE(send_good());
  ASSERT_TRUE(plane.Drain(Later()).ok());
  std::vector<float> want(16, kOld);
  want[3] = 1;
  want[9] = 2;
  EXPECT_EQ(engines.Floats(0), want);

  // Patches 'a' and 'b' (an index past the tensor each) in chunk 0 and
  // 'c' in chunk 1: 'a' is what the update reports.
  std::vector<Patch> bad;
  for (const char* name : {"a", "b", "c"}) {
    bad.emplace_back(16, 16, std::vector<int64_t>{1, 16}, 8);
    bad.back().UseWhole(0, 0);
    bad.back().patch.name = name;
  }
  const int64_t size = bad[0].payload.size();
  auto plan2 = std::make_shared<CopyPlan>(*plan);
  plan2->sparse = {bad[0].patch, bad[1].patch, bad[2].patch};
  plan2->chunks.chunk_bytes = 2 * size;
  plan2->sparse_pieces_by_chunk = {
      {{0, Piece{0, 0, 0, size}}, {1, Piece{0, 0, size, size}}},
      {{2, Piece{0, 0, 0, size}}}};
  ASSERT_TRUE(plane.Begin(plan2, {}).ok());
  ASSERT_TRUE(
      plane.SubmitChunk(0, bad[0].payload + bad[1].payload, Later()).ok());
  ASSERT_TRUE(plane.SubmitChunk(1, bad[2].payload, Later()).ok());
  absl::Status s = plane.Drain(Later());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tensor 'a': sparse index 16"));
  EXPECT_EQ(engines.Floats(0), want);  // no bad patch wrote anything
  // The next update starts clean.
  ASSERT_TRUE(plane.Begin(plan, {}).ok());
  ASSERT_TRUE(send_good());
  EXPECT_TRUE(plane.Drain(Later()).ok());
}

}  // namespace
}  // namespace weightsync
