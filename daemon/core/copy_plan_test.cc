#include "daemon/core/copy_plan.h"

#include <cstring>
#include <functional>
#include <limits>
#include <random>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "backends/host/host_data_plane.h"
#include "client/host_arena.h"
#include "common/dtype.h"
#include "daemon/core/receipt.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"
#include "tools/synthetic/synthetic_model.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

struct Engine {
  std::vector<v1::Parameter> params;
  std::shared_ptr<const EngineLayout> layout;
};

// Lays e.params out in one heap allocation and registers them as `id`.
void Register(const std::string& id, Engine& e, testing::HeapMapper& mapper) {
  const int64_t bytes = *HostArena::Layout(&e.params);
  v1::RegisterEngineRequest r;
  r.set_engine_id(id);
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle("/heap");
  a->set_size(bytes);
  for (const auto& p : e.params) *r.add_parameters() = p;
  auto built = BuildEngineLayout(r, mapper);
  EXPECT_TRUE(built.ok()) << built.status();
  e.layout = *built;
}

Engine MakeEngine(const std::string& id, synthetic::Layout layout, int rank,
                  int size, v1::DType dtype, testing::HeapMapper& mapper) {
  const auto model = *synthetic::ModelByName("tiny");
  Engine e;
  e.params = synthetic::EngineParameters(model, layout, rank, size, dtype);
  Register(id, e, mapper);
  return e;
}

// Packs the manifest's data into chunks exactly as a trainer client does
// and scatters each through the plan; then every parameter must equal the
// independent reference installer's answer.
void RunAndCompare(const std::vector<Engine>& engines, v1::DType ckpt_dtype,
                   int64_t chunk_bytes) {
  const auto model = *synthetic::ModelByName("tiny");
  Manifest manifest;
  synthetic::CheckpointData data;
  for (const v1::TensorSpec& t : synthetic::Checkpoint(model, ckpt_dtype)) {
    *manifest.Add() = t;
    data[t.name()] = {t, synthetic::Contents(t, 7)};
  }
  std::vector<std::shared_ptr<const EngineLayout>> layouts;
  for (const Engine& e : engines) layouts.push_back(e.layout);
  auto plan = BuildCopyPlan(manifest, chunk_bytes, layouts);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (const Chunk& c : (*plan)->chunks.chunks) {
    std::vector<uint8_t> buf(c.size, 0);
    for (const Piece& p : c.pieces) {
      std::memcpy(
          buf.data() + p.chunk_offset,
          data.at(manifest[p.tensor].name()).second.data() + p.tensor_offset,
          p.length);
    }
    ScatterChunk(**plan, (*plan)->ops_by_chunk[c.index], buf.data(), nullptr);
  }
  for (const Engine& e : engines) {
    const uint8_t* base = e.layout->regions[0]->data();
    for (const v1::Parameter& p : e.params) {
      const std::vector<uint8_t> want = synthetic::ExpectedParameter(p, data);
      ASSERT_EQ(std::memcmp(base + p.offset(), want.data(), want.size()), 0)
          << e.layout->engine_id << " " << p.name() << " chunk " << chunk_bytes;
    }
  }
  absl::flat_hash_set<std::string> names;
  for (const v1::TensorSpec& t : manifest) names.insert(t.name());
  for (size_t i = 0; i < engines.size(); ++i) {
    // Padded vocab rows (tp1) are in no segment: still fully rewritten.
    EXPECT_TRUE((*plan)->covers_engine[i])
        << "engine " << i << " should be fully rewritten";
    // The uses resolved with the plan sum what a walk by names sums.
    auto by_plan = ComputeReceipt(*engines[i].layout, (*plan)->dense_uses[i]);
    auto by_names = ComputeReceipt(*engines[i].layout, names);
    ASSERT_TRUE(by_plan.ok() && by_names.ok());
    EXPECT_EQ(by_plan->checksum(), by_names->checksum());
    EXPECT_EQ(by_plan->parameters(), engines[i].params.size());
    EXPECT_EQ(by_plan->bytes(), by_names->bytes());
  }
}

TEST(CopyPlanTest, TensorParallelSegmentsMatchReferenceAtEveryChunkSize) {
  testing::HeapMapper mapper;
  std::vector<Engine> engines = {
      MakeEngine("plain", synthetic::Layout::kPlain, 0, 1, v1::BFLOAT16,
                 mapper),
      MakeEngine("tp0", synthetic::Layout::kTensorParallel, 0, 2, v1::BFLOAT16,
                 mapper),
      MakeEngine("tp1", synthetic::Layout::kTensorParallel, 1, 2, v1::FLOAT16,
                 mapper)};
  // Odd chunk sizes cut rows and tensors at every possible place.
  for (int64_t chunk : {256, 768, 4096, 65536, 1 << 24}) {
    RunAndCompare(engines, v1::FLOAT32, chunk);
  }
  RunAndCompare(engines, v1::BFLOAT16, 1280);
}

// Engine "e0" with one 4 KiB host allocation and no parameters yet.
v1::RegisterEngineRequest OneAllocationEngine() {
  v1::RegisterEngineRequest r;
  r.set_engine_id("e0");
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle("/x");
  a->set_size(4096);
  return r;
}

// The plan of one update sending tensor "t" of `tensor_shape` (float32)
// to an engine whose float32 parameter "p" of `param_shape` is filled by
// `segment` from it.
absl::StatusOr<std::shared_ptr<const CopyPlan>> PlanOneSegment(
    const v1::Segment& segment, const std::vector<int64_t>& param_shape,
    const std::vector<int64_t>& tensor_shape, int64_t chunk_bytes = 4096) {
  v1::RegisterEngineRequest r = OneAllocationEngine();
  v1::Parameter* p = r.add_parameters();
  p->set_name("p");
  p->set_dtype(v1::FLOAT32);
  for (int64_t d : param_shape) p->add_shape(d);
  *p->add_segments() = segment;
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(r, mapper);
  if (!layout.ok()) return layout.status();
  Manifest manifest;
  v1::TensorSpec* t = manifest.Add();
  t->set_name("t");
  t->set_dtype(v1::FLOAT32);
  for (int64_t d : tensor_shape) t->add_shape(d);
  return BuildCopyPlan(manifest, chunk_bytes, {*layout});
}

// A segment registered without source_shape is checked against the
// tensor the update sends: its block must lie in the tensor's matrix.
// Rows [2, 4) or columns [2, 6) of a 3x4 tensor are refused, naming the
// tensor, before any copy is planned; the block just inside is planned.
TEST(CopyPlanTest, ASegmentsBlockMustLieInTheTensorSent) {
  v1::Segment s;
  s.set_source("t");
  s.set_row_begin(2);
  s.set_row_count(2);
  s.set_col_count(4);
  EXPECT_TRUE(PlanOneSegment(s, {2, 4}, {4, 4}).ok());  // rows 2, 3 exist
  auto refused = PlanOneSegment(s, {2, 4}, {3, 4});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("segment rows [2, 4) cols [0, 4) lie outside the "
                        "tensor's 3x4 matrix"));
  EXPECT_THAT(refused.status().message(), HasSubstr("tensor 't'"));
  s.set_row_begin(0);
  s.set_col_begin(2);
  s.set_col_count(2);
  EXPECT_TRUE(PlanOneSegment(s, {2, 2}, {3, 4}).ok());  // columns 2, 3
  s.set_col_count(4);
  refused = PlanOneSegment(s, {2, 4}, {3, 4});
  EXPECT_THAT(refused.status().message(),
              HasSubstr("cols [2, 6) lie outside the tensor's 3x4 matrix"));
  s.set_col_count(3);  // one column past
  refused = PlanOneSegment(s, {2, 3}, {3, 4});
  EXPECT_THAT(refused.status().message(),
              HasSubstr("cols [2, 5) lie outside the tensor's 3x4 matrix"));
  // A begin near INT64_MAX: begin + count does not fit in 64 bits, and
  // neither the check nor its message may add them (UBSan runs this).
  const int64_t huge = std::numeric_limits<int64_t>::max() - 1;
  s.set_col_begin(huge);
  s.set_col_count(2);
  refused = PlanOneSegment(s, {2, 2}, {3, 4});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("cols [", huge, ", +2) lie outside")));
  s.set_col_begin(0);
  s.set_row_begin(huge);
  refused = PlanOneSegment(s, {2, 2}, {3, 4});
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("rows [", huge, ", +2) cols [0, 2)")));
}

// The copies of a block use, chunk by chunk, as the plan's comment says:
// at most a partial first row, one strided copy of the whole rows, and a
// partial last row. Rows [1, 14) x cols [2, 9) of a 16 x 12 float32
// tensor in chunks of 64 elements (256 bytes), each cutting rows.
TEST(CopyPlanTest, ABlockUseIsAtMostThreeCopiesAChunk) {
  v1::Segment s;
  s.set_source("t");
  s.set_row_begin(1);
  s.set_row_count(13);
  s.set_col_begin(2);
  s.set_col_count(7);
  auto plan = PlanOneSegment(s, {13, 7}, {16, 12}, 256);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // (rows, cols, src_offset, dst_offset): strides are a source row (48
  // bytes) and a parameter row (28) throughout.
  using Op = std::tuple<int64_t, int64_t, int64_t, int64_t>;
  const std::vector<std::vector<Op>> want = {
      // [0, 64): rows 1-4 whole, row 5's first two columns.
      {{4, 7, 14 * 4, 0}, {1, 2, 62 * 4, 28 * 4}},
      // [64, 128): row 5's other five, rows 6-9, row 10's first six.
      {{1, 5, 0, 30 * 4}, {4, 7, 10 * 4, 35 * 4}, {1, 6, 58 * 4, 63 * 4}},
      // [128, 192): row 10's last column, rows 11-13.
      {{1, 1, 0, 69 * 4}, {3, 7, 6 * 4, 70 * 4}},
  };
  ASSERT_EQ((*plan)->ops_by_chunk.size(), want.size());
  for (size_t c = 0; c < want.size(); ++c) {
    std::vector<Op> got;
    for (const CopyOp& op : (*plan)->ops_by_chunk[c]) {
      got.emplace_back(op.rows, op.cols, op.src_offset, op.dst_offset);
      EXPECT_EQ(op.src_stride, 48) << "chunk " << c;
      EXPECT_EQ(op.dst_stride, 28) << "chunk " << c;
    }
    EXPECT_EQ(got, want[c]) << "chunk " << c;
  }
}

// Block uses drawn at random (a rows x cols float32 tensor, a segment of
// it, chunks of 256 to 1024 bytes that cut rows anywhere, the segment's
// first or last row among them): the parameter must hold exactly the
// tensor's block, and nothing past it may be written.
TEST(CopyPlanTest, RandomBlockUsesLandExactlyAtEveryChunkSize) {
  std::mt19937 rng(33);
  auto draw = [&](int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int k = 0; k < 300; ++k) {
    const int64_t rows = draw(1, 12), cols = draw(1, 80);
    const int64_t r0 = draw(0, rows - 1), rn = draw(1, rows - r0);
    const int64_t c0 = draw(0, cols - 1), cn = draw(1, cols - c0);
    const int64_t chunk_bytes = 256 * draw(1, 4);
    v1::Segment s;
    s.set_source("t");
    s.set_row_begin(r0);
    s.set_row_count(rn);
    s.set_col_begin(c0);
    s.set_col_count(cn);
    auto plan = PlanOneSegment(s, {rn, cn}, {rows, cols}, chunk_bytes);
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::vector<float> tensor(rows * cols);
    for (size_t i = 0; i < tensor.size(); ++i) tensor[i] = 1 + i;
    for (const Chunk& c : (*plan)->chunks.chunks) {
      std::vector<uint8_t> buf(c.size, 0);
      for (const Piece& piece : c.pieces) {
        std::memcpy(buf.data() + piece.chunk_offset,
                    reinterpret_cast<const uint8_t*>(tensor.data()) +
                        piece.tensor_offset,
                    piece.length);
      }
      ScatterChunk(**plan, (*plan)->ops_by_chunk[c.index], buf.data(), nullptr);
    }
    std::vector<float> want(1024, 0.0f);  // the whole 4 KiB allocation
    for (int64_t r = 0; r < rn; ++r) {
      for (int64_t j = 0; j < cn; ++j) {
        want[r * cn + j] = tensor[(r0 + r) * cols + c0 + j];
      }
    }
    std::vector<float> got(1024);
    std::memcpy(got.data(), (*plan)->engines[0]->regions[0]->data(), 4096);
    ASSERT_EQ(got, want) << "tensor " << rows << "x" << cols << ", rows [" << r0
                         << ", +" << rn << ") cols [" << c0 << ", +" << cn
                         << "), chunks of " << chunk_bytes;
  }
}

// A sparse patch rewrites only some of its tensor, even one of a single
// element: it is not one of the dense uses a receipt sums, nor does it
// make the update cover the engine; the dense tensor beside it is both.
TEST(CopyPlanTest, APatchOfOneElementIsNoDenseUse) {
  v1::RegisterEngineRequest r = OneAllocationEngine();
  for (const char* name : {"patched", "dense"}) {
    v1::Parameter* p = r.add_parameters();
    p->set_name(name);
    p->set_dtype(v1::FLOAT32);
    p->add_shape(16);
    p->set_offset(std::string(name) == "dense" ? 1024 : 0);
  }
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(r, mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  Manifest m;
  for (const char* name : {"patched", "dense"}) {
    v1::TensorSpec* t = m.Add();
    t->set_name(name);
    t->set_dtype(v1::FLOAT32);
    t->add_shape(16);
    if (std::string(name) == "patched") t->set_sparse_nnz(1);
  }
  auto plan = BuildCopyPlan(m, 4096, {*layout});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ((*plan)->dense_uses[0].size(), 1);
  EXPECT_EQ((*plan)->dense_uses[0][0].parameter, 1);  // "dense"
  EXPECT_EQ((*plan)->bytes_by_engine[0], 64);
  EXPECT_FALSE((*plan)->covers_engine[0]);
  ASSERT_EQ((*plan)->sparse.size(), 1);
  EXPECT_EQ((*plan)->sparse[0].name, "patched");
  // The receipt of the tensors named sums their uses only: "dense" alone
  // is the plan's dense uses, and both are two parameters.
  auto by_plan = ComputeReceipt(**layout, (*plan)->dense_uses[0]);
  auto dense =
      ComputeReceipt(**layout, absl::flat_hash_set<std::string>{"dense"});
  auto both = ComputeReceipt(
      **layout, absl::flat_hash_set<std::string>{"dense", "patched"});
  ASSERT_TRUE(by_plan.ok() && dense.ok() && both.ok());
  EXPECT_EQ(dense->parameters(), 1);
  EXPECT_EQ(dense->checksum(), by_plan->checksum());
  EXPECT_EQ(both->parameters(), 2);
  // Memory the daemon can't read (GPU, no host pointer): no receipt.
  auto gpu = std::make_shared<EngineLayout>(**layout);
  gpu->regions[0] = std::make_shared<testing::GpuRegion>("GPU-1");
  EXPECT_EQ(ComputeReceipt(*gpu, (*plan)->dense_uses[0]).status().code(),
            absl::StatusCode::kUnimplemented);
}

// A segment registered with source_shape takes only a tensor of that
// shape: the same bytes as [2, 8] instead of [4, 4] are refused.
TEST(CopyPlanTest, ASegmentsSourceShapeMustMatchTheTensorSent) {
  v1::Segment s;
  s.set_source("t");
  s.add_source_shape(4);
  s.add_source_shape(4);
  s.set_row_count(2);
  s.set_col_count(4);
  EXPECT_TRUE(PlanOneSegment(s, {2, 4}, {4, 4}).ok());
  auto refused = PlanOneSegment(s, {2, 4}, {2, 8});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("shape [2, 8] does not match the segment's source "
                        "shape [4, 4]"));
}

TEST(CopyPlanTest, AdjoiningTensorsCoalesceIntoOneCopy) {
  // A plain engine laid out in checkpoint order, same dtype: the packed
  // stream and the engine agree byte for byte wherever a tensor's size is a
  // multiple of 256, so consecutive tensors merge into one copy.
  testing::HeapMapper mapper;
  std::vector<Engine> engines = {MakeEngine("plain", synthetic::Layout::kPlain,
                                            0, 1, v1::BFLOAT16, mapper)};
  for (int64_t chunk : {4096, 1 << 24}) {
    RunAndCompare(engines, v1::BFLOAT16, chunk);  // still bit-exact
    const auto model = *synthetic::ModelByName("tiny");
    Manifest manifest;
    int64_t unaligned = 0;
    for (const v1::TensorSpec& t : synthetic::Checkpoint(model, v1::BFLOAT16)) {
      *manifest.Add() = t;
      int64_t bytes = 2;
      for (int64_t d : t.shape()) bytes *= d;
      unaligned += bytes % 256 != 0;
    }
    auto plan = BuildCopyPlan(manifest, chunk, {engines[0].layout});
    ASSERT_TRUE(plan.ok()) << plan.status();
    int64_t ops = 0;
    for (const auto& c : (*plan)->ops_by_chunk) ops += c.size();
    // Each op starts a chunk or follows an unaligned tensor's padding.
    EXPECT_LE(ops,
              static_cast<int64_t>((*plan)->chunks.chunks.size()) + unaligned)
        << "chunk " << chunk;
    if (chunk == 1 << 24) {
      EXPECT_LT(ops, manifest.size() / 2);
    }
  }
  // Eight replicas of that engine: each piece's copies go to the eight in
  // turn, and each still joins its own engine's previous copy (the last
  // eight copies are searched), so eight times as many copies, no more.
  std::vector<Engine> eight;
  for (int e = 0; e < 8; ++e) {
    eight.push_back(MakeEngine(absl::StrCat("plain", e),
                               synthetic::Layout::kPlain, 0, 1, v1::BFLOAT16,
                               mapper));
  }
  RunAndCompare(eight, v1::BFLOAT16, 1 << 24);
  const auto model = *synthetic::ModelByName("tiny");
  Manifest manifest;
  for (const v1::TensorSpec& t : synthetic::Checkpoint(model, v1::BFLOAT16)) {
    *manifest.Add() = t;
  }
  std::vector<std::shared_ptr<const EngineLayout>> one, layouts;
  one.push_back(engines[0].layout);
  for (const Engine& e : eight) layouts.push_back(e.layout);
  auto alone = BuildCopyPlan(manifest, 1 << 24, one);
  auto all = BuildCopyPlan(manifest, 1 << 24, layouts);
  ASSERT_TRUE(alone.ok() && all.ok());
  int64_t ops_alone = 0, ops_all = 0;
  for (const auto& c : (*alone)->ops_by_chunk) ops_alone += c.size();
  for (const auto& c : (*all)->ops_by_chunk) ops_all += c.size();
  EXPECT_EQ(ops_all, 8 * ops_alone);
}

// Two tensors of 128 two-byte elements, contiguous in the stream and in
// each engine: their copies join into one only where both convert alike
// (same source and engine dtype) into the same engine and allocation.
// Each case has exactly one of those differ; the bytes must still be
// each tensor's, converted as its own dtypes say.
TEST(CopyPlanTest, CopiesJoinOnlyWithinOneEngineAllocationAndConversion) {
  struct Case {
    std::string what;
    v1::DType a_src, a_dst, b_src, b_dst;
    int engines;
    bool b_in_second_allocation;
  };
  const v1::DType f16 = v1::FLOAT16, bf16 = v1::BFLOAT16;
  for (const Case& c : std::vector<Case>{
           {"source dtypes differ", f16, f16, bf16, f16, 1, false},
           {"engine dtypes differ", f16, f16, f16, bf16, 1, false},
           {"two engines", f16, f16, f16, f16, 2, false},
           {"two allocations", f16, f16, f16, f16, 1, true}}) {
    testing::HeapMapper mapper;
    std::vector<std::shared_ptr<const EngineLayout>> layouts;
    for (int e = 0; e < c.engines; ++e) {
      v1::RegisterEngineRequest r;
      r.set_engine_id(absl::StrCat("e", e));
      for (int k = 0; k < 2; ++k) {
        v1::Allocation* a = r.add_allocations();
        a->set_kind(v1::MEMORY_HOST_SHM);
        a->set_handle(absl::StrCat("/a", k));
        a->set_size(512);
      }
      for (const auto& [name, dtype, offset] :
           std::vector<std::tuple<std::string, v1::DType, int>>{
               {"a", c.a_dst, 0}, {"b", c.b_dst, 256}}) {
        v1::Parameter* p = r.add_parameters();
        p->set_name(name);
        p->set_dtype(dtype);
        p->add_shape(128);
        p->set_offset(offset);
        if (name == "b" && c.b_in_second_allocation) p->set_allocation(1);
      }
      auto layout = BuildEngineLayout(r, mapper);
      ASSERT_TRUE(layout.ok()) << c.what << ": " << layout.status();
      layouts.push_back(*layout);
    }
    Manifest manifest;
    for (const auto& [name, dtype] :
         std::vector<std::pair<std::string, v1::DType>>{{"a", c.a_src},
                                                        {"b", c.b_src}}) {
      v1::TensorSpec* t = manifest.Add();
      t->set_name(name);
      t->set_dtype(dtype);
      t->add_shape(128);
    }
    auto plan = BuildCopyPlan(manifest, 4096, layouts);
    ASSERT_TRUE(plan.ok()) << c.what << ": " << plan.status();
    // Elements 1.0 + k / 8 (a) and -1.0 - k / 8 (b), exact in both
    // formats, in each tensor's own dtype.
    std::vector<uint8_t> chunk(512);
    std::vector<float> a(128), b(128);
    for (int k = 0; k < 128; ++k) {
      a[k] = 1.0f + k / 8.0f;
      b[k] = -1.0f - k / 8.0f;
    }
    ConvertElements(a.data(), v1::FLOAT32, chunk.data(), c.a_src, 128);
    ConvertElements(b.data(), v1::FLOAT32, chunk.data() + 256, c.b_src, 128);
    ScatterChunk(**plan, (*plan)->ops_by_chunk[0], chunk.data(), nullptr);
    for (int e = 0; e < c.engines; ++e) {
      const EngineLayout& l = *layouts[e];
      std::vector<float> got_a(128), got_b(128);
      ConvertElements(l.regions[0]->data(), c.a_dst, got_a.data(), v1::FLOAT32,
                      128);
      ConvertElements(l.regions[c.b_in_second_allocation ? 1 : 0]->data() + 256,
                      c.b_dst, got_b.data(), v1::FLOAT32, 128);
      EXPECT_EQ(got_a, a) << c.what << ", engine " << e;
      EXPECT_EQ(got_b, b) << c.what << ", engine " << e;
    }
  }
}

TEST(CopyPlanTest, RejectsUnknownTensorShapeAndDtypeMismatches) {
  testing::HeapMapper mapper;
  std::vector<std::shared_ptr<const EngineLayout>> layouts = {
      MakeEngine("tp0", synthetic::Layout::kTensorParallel, 0, 2, v1::BFLOAT16,
                 mapper)
          .layout};
  Manifest m;
  v1::TensorSpec* t = m.Add();
  t->set_name("model.layers.9.nope");
  t->set_dtype(v1::FLOAT32);
  t->add_shape(4);
  auto plan = BuildCopyPlan(m, 4096, layouts);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("'model.layers.9.nope'"));

  t->set_name("model.norm.weight");  // registered as [64]
  plan = BuildCopyPlan(m, 4096, layouts);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("shape [4] does not match the registered [64]"));

  t->set_shape(0, 64);
  t->set_dtype(v1::INT32);
  plan = BuildCopyPlan(m, 4096, layouts);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("dtype int32 can't be converted to bfloat16"));

  t->set_name("model.layers.0.self_attn.q_proj.weight");  // segment source
  t->set_dtype(v1::FLOAT32);
  t->set_shape(0, 32);
  t->add_shape(64);
  plan = BuildCopyPlan(m, 4096, layouts);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("does not match the segment's source shape"));
}

// One pipeline stage of a model (issue 20): the engine holds only the
// parameters `keep` accepts; the manifest is the whole checkpoint.
Engine MakeStage(const std::string& id,
                 const std::function<bool(const std::string&)>& keep,
                 testing::HeapMapper& mapper) {
  const auto model = *synthetic::ModelByName("tiny");
  Engine e;
  for (const v1::Parameter& p : synthetic::EngineParameters(
           model, synthetic::Layout::kPlain, 0, 1, v1::FLOAT32)) {
    if (keep(p.name())) e.params.push_back(p);
  }
  Register(id, e, mapper);
  return e;
}

// A daemon of several gets the whole manifest and holds one stage: refused
// as before by default; with kSkip the stream is the whole manifest's and
// only the stage's tensors are copied; with kOmit the stream is the used
// tensors' only. Both land bit for bit, and list what they left out.
TEST(CopyPlanTest, UnusedTensorsAreRefusedSkippedOrOmitted) {
  testing::HeapMapper mapper;
  const Engine stage = MakeStage(
      "stage1",
      [](const std::string& n) { return n.find("layers.1.") != n.npos; },
      mapper);
  ASSERT_FALSE(stage.params.empty());
  const auto model = *synthetic::ModelByName("tiny");
  Manifest manifest;
  synthetic::CheckpointData data;
  for (const v1::TensorSpec& t : synthetic::Checkpoint(model, v1::FLOAT32)) {
    *manifest.Add() = t;
    data[t.name()] = {t, synthetic::Contents(t, 3)};
  }
  auto refused = BuildCopyPlan(manifest, 4096, {stage.layout});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("is not a parameter or segment source of any engine "
                        "in the update (stage1)"));
  auto full = PlanChunks(manifest, 4096);
  ASSERT_TRUE(full.ok());
  for (UnusedTensors mode : {UnusedTensors::kSkip, UnusedTensors::kOmit}) {
    auto plan = BuildCopyPlan(manifest, 4096, {stage.layout}, mode);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const CopyPlan& p = **plan;
    EXPECT_EQ(p.unused.size(), manifest.size() - stage.params.size());
    for (const std::string& name : p.unused) {
      EXPECT_EQ(name.find("layers.1."), std::string::npos) << name;
    }
    if (mode == UnusedTensors::kSkip) {
      EXPECT_EQ(p.chunks.total_bytes, full->total_bytes);
      EXPECT_EQ(p.manifest.size(), manifest.size());
    } else {
      EXPECT_LT(p.chunks.total_bytes, full->total_bytes / 2);
      EXPECT_EQ(p.manifest.size(), stage.params.size());
    }
    for (const Chunk& c : p.chunks.chunks) {
      std::vector<uint8_t> buf(c.size, 0);
      for (const Piece& piece : c.pieces) {
        std::memcpy(buf.data() + piece.chunk_offset,
                    data.at(p.manifest[piece.tensor].name()).second.data() +
                        piece.tensor_offset,
                    piece.length);
      }
      ScatterChunk(p, p.ops_by_chunk[c.index], buf.data(), nullptr);
    }
    for (const v1::Parameter& param : stage.params) {
      const std::vector<uint8_t> want =
          synthetic::ExpectedParameter(param, data);
      ASSERT_EQ(std::memcmp(stage.layout->regions[0]->data() + param.offset(),
                            want.data(), want.size()),
                0)
          << param.name();
    }
    EXPECT_TRUE(p.covers_engine[0]);
    EXPECT_EQ(p.dense_uses[0].size(), stage.params.size());
  }
  // With kOmit, a stage that uses every tensor but one in the middle keeps
  // the first and the last in its manifest, in order.
  const std::string middle = manifest[manifest.size() / 2].name();
  const Engine most = MakeStage(
      "most", [&](const std::string& n) { return n != middle; }, mapper);
  auto omitted =
      BuildCopyPlan(manifest, 4096, {most.layout}, UnusedTensors::kOmit);
  ASSERT_TRUE(omitted.ok()) << omitted.status();
  ASSERT_EQ((*omitted)->manifest.size(), manifest.size() - 1);
  EXPECT_EQ((*omitted)->manifest[0].name(), manifest[0].name());
  EXPECT_EQ((*omitted)->manifest[manifest.size() - 2].name(),
            manifest[manifest.size() - 1].name());
  EXPECT_THAT((*omitted)->unused, ::testing::ElementsAre(middle));
  // A stage that uses nothing of this update: an empty stream, no copies.
  const Engine other = MakeStage(
      "stage9", [](const std::string& n) { return n == "model.norm.weight"; },
      mapper);
  Manifest layer1;
  for (const v1::TensorSpec& t : manifest) {
    if (t.name().find("layers.1.") != std::string::npos) *layer1.Add() = t;
  }
  auto none = BuildCopyPlan(layer1, 4096, {other.layout}, UnusedTensors::kOmit);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ((*none)->chunks.chunks.size(), 0);
  EXPECT_EQ((*none)->unused.size(), layer1.size());
  EXPECT_FALSE((*none)->covers_engine[0]);
}

// A parameter of no elements registered without segments: a manifest
// tensor of its name and shape is planned (nothing to copy), not refused as
// unused; one of another shape still is.
TEST(CopyPlanTest, EmptyParametersAreNotUnused) {
  testing::HeapMapper mapper;
  v1::RegisterEngineRequest r;
  r.set_engine_id("empty");
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle("buf");
  a->set_size(64);
  v1::Parameter* w = r.add_parameters();
  w->set_name("w");
  w->set_dtype(v1::FLOAT32);
  w->add_shape(4);
  v1::Parameter* e = r.add_parameters();
  e->set_name("bias");
  e->set_dtype(v1::FLOAT32);
  e->add_shape(0);
  e->add_shape(8);
  e->set_offset(16);
  auto layout = BuildEngineLayout(r, mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  Manifest manifest;
  v1::TensorSpec* t = manifest.Add();
  t->set_name("w");
  t->set_dtype(v1::FLOAT32);
  t->add_shape(4);
  t = manifest.Add();
  t->set_name("bias");
  t->set_dtype(v1::BFLOAT16);
  t->add_shape(0);
  t->add_shape(8);
  auto plan = BuildCopyPlan(manifest, 4096, {*layout});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ((*plan)->manifest.size(), 2);
  EXPECT_TRUE((*plan)->unused.empty());
  manifest.Mutable(1)->set_shape(1, 9);
  auto other = BuildCopyPlan(manifest, 4096, {*layout});
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(other.status().message(), HasSubstr("'bias'"));
}

}  // namespace
}  // namespace weightsync
