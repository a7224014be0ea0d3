// FP8 targets at registration (quant_layout.h through BuildEngineLayout):
// what is accepted and recorded, and every refusal, each before any memory
// is opened.
#include "daemon/core/quant_layout.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

v1::Parameter* AddParameter(v1::RegisterEngineRequest& r,
                            const std::string& name, v1::DType dtype,
                            std::vector<int64_t> shape, int64_t offset) {
  v1::Parameter* p = r.add_parameters();
  p->set_name(name);
  p->set_dtype(dtype);
  for (int64_t d : shape) p->add_shape(d);
  p->set_offset(offset);
  return p;
}

// "w": float8_e4m3fn [300, 260] in 128 x 128 blocks, scales "w_scale_inv"
// float32 [3, 3]; "norm": bfloat16 [260].
v1::RegisterEngineRequest Fp8Engine() {
  v1::RegisterEngineRequest r;
  r.set_engine_id("e0");
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle("/x");
  a->set_size(1 << 20);
  v1::Parameter* w =
      AddParameter(r, "w", v1::FLOAT8_E4M3FN, {300, 260}, /*offset=*/0);
  v1::Quantization* q = w->mutable_quantization();
  q->set_format(v1::FLOAT8_E4M3FN);
  q->set_scale_parameter("w_scale_inv");
  AddParameter(r, "w_scale_inv", v1::FLOAT32, {3, 3}, 100 * 1024);
  AddParameter(r, "norm", v1::BFLOAT16, {260}, 110 * 1024);
  return r;
}

v1::Segment* AddSegment(v1::Parameter* p, const std::string& source,
                        int64_t row_begin, int64_t rows, int64_t col_begin,
                        int64_t cols, int64_t dest, int64_t stride) {
  v1::Segment* s = p->add_segments();
  s->set_source(source);
  s->set_row_begin(row_begin);
  s->set_row_count(rows);
  s->set_col_begin(col_begin);
  s->set_col_count(cols);
  s->set_dest_offset(dest);
  s->set_dest_row_stride(stride);
  return s;
}

// The refusal of `r`, checking that no memory was opened.
absl::Status Refusal(const v1::RegisterEngineRequest& r,
                     const RegistrationLimits& limits = {}) {
  testing::HeapMapper mapper;
  absl::Status s = BuildEngineLayout(r, mapper, limits).status();
  EXPECT_TRUE(mapper.opened.empty()) << "memory opened before a refusal";
  return s;
}

TEST(QuantLayoutTest, RecordsBlocksAndKeepsTheScaleOutOfTheSources) {
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(Fp8Engine(), mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const ParameterLayout& w = (*layout)->parameters[0];
  ASSERT_TRUE(w.quant.has_value());
  EXPECT_EQ(w.quant->format, v1::FLOAT8_E4M3FN);
  EXPECT_EQ(w.quant->scale_parameter, 1);
  EXPECT_EQ(w.quant->block_rows, 128);
  EXPECT_EQ(w.quant->block_cols, 128);
  EXPECT_EQ(w.quant->grid_cols, 3);
  EXPECT_FALSE(w.quant->reciprocal);
  EXPECT_TRUE((*layout)->parameters[1].is_scale);
  EXPECT_TRUE((*layout)->parameters[1].segments.empty());
  EXPECT_FALSE((*layout)->uses_by_source.contains("w_scale_inv"));
  EXPECT_TRUE((*layout)->uses_by_source.contains("w"));
  EXPECT_FALSE((*layout)->parameters[2].quant.has_value());
}

// Block sides given explicitly are taken, up to exactly 2^24 (one block
// row for the whole weight: scales [1, 3]).
TEST(QuantLayoutTest, AcceptsExplicitBlockSidesUpTo2To24) {
  for (int64_t rows : {int64_t{128}, int64_t{1} << 24}) {
    SCOPED_TRACE(rows);
    v1::RegisterEngineRequest r = Fp8Engine();
    v1::Quantization* q = r.mutable_parameters(0)->mutable_quantization();
    q->set_scheme(v1::QUANT_SCHEME_BLOCK);
    q->set_block_rows(rows);
    q->set_block_cols(128);
    if (rows > 300) r.mutable_parameters(1)->set_shape(0, 1);  // [1, 3]
    testing::HeapMapper mapper;
    auto layout = BuildEngineLayout(r, mapper);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ((*layout)->parameters[0].quant->block_rows, rows);
    EXPECT_EQ((*layout)->parameters[0].quant->block_cols, 128);
  }
}

TEST(QuantLayoutTest, AcceptsPerRowScalesAndReciprocalForms) {
  for (std::vector<int64_t> shape :
       {std::vector<int64_t>{300}, std::vector<int64_t>{300, 1}}) {
    v1::RegisterEngineRequest r = Fp8Engine();
    v1::Quantization* q = r.mutable_parameters(0)->mutable_quantization();
    q->set_scheme(v1::QUANT_SCHEME_PER_ROW);
    q->set_scale_form(v1::SCALE_FORM_RECIPROCAL);
    r.mutable_parameters(1)->clear_shape();
    for (int64_t d : shape) r.mutable_parameters(1)->add_shape(d);
    testing::HeapMapper mapper;
    auto layout = BuildEngineLayout(r, mapper);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const QuantLayout& ql = *(*layout)->parameters[0].quant;
    EXPECT_EQ(ql.block_rows, 1);
    EXPECT_EQ(ql.block_cols, 260);
    EXPECT_EQ(ql.grid_cols, 1);
    EXPECT_TRUE(ql.reciprocal);
  }
}

// Stacked expert weights (vLLM's w13_weight [E, 2I, H] with
// w13_weight_scale_inv [E, 2I / 128, H / 128]): quantised as the matrix of
// their rows, with the scale per matrix or flat, per block or per row.
TEST(QuantLayoutTest, AcceptsStackedExpertWeights) {
  struct Case {
    std::vector<int64_t> scale;
    bool per_row;
  };
  for (const Case& c :
       {Case{{4, 2, 3}, false}, Case{{8, 3}, false}, Case{{4, 256}, true},
        Case{{4, 256, 1}, true}, Case{{1024}, true}, Case{{1024, 1}, true}}) {
    v1::RegisterEngineRequest r = Fp8Engine();
    r.mutable_allocations(0)->set_size(4 << 20);
    v1::Parameter* w = r.mutable_parameters(0);
    w->clear_shape();
    for (int64_t d : {4, 256, 260}) w->add_shape(d);
    if (c.per_row) {
      w->mutable_quantization()->set_scheme(v1::QUANT_SCHEME_PER_ROW);
    }
    v1::Parameter* s = r.mutable_parameters(1);
    s->set_offset(2 << 20);
    s->clear_shape();
    for (int64_t d : c.scale) s->add_shape(d);
    r.mutable_parameters(2)->set_offset(3 << 20);
    testing::HeapMapper mapper;
    auto layout = BuildEngineLayout(r, mapper);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const QuantLayout& q = *(*layout)->parameters[0].quant;
    EXPECT_EQ(q.rows, 1024);
    EXPECT_EQ(q.cols, 260);
    EXPECT_EQ(q.block_rows, c.per_row ? 1 : 128);
    EXPECT_EQ(q.grid_cols, c.per_row ? 1 : 3);
  }
}

TEST(QuantLayoutTest, RefusesStackedBlocksAcrossMatrices) {
  v1::RegisterEngineRequest r = Fp8Engine();
  v1::Parameter* w = r.mutable_parameters(0);
  w->clear_shape();
  for (int64_t d : {3, 100, 260}) w->add_shape(d);  // 100 rows: part blocks
  r.mutable_parameters(1)->set_shape(0, 3);
  const absl::Status s = Refusal(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'w'"));
  EXPECT_THAT(s.message(),
              HasSubstr("a stacked FP8 target [3, 100, 260] needs the rows "
                        "of each matrix (100) in whole blocks of 128 rows"));
  // A scale of neither the flat nor the stacked shape.
  w->set_shape(1, 128);
  r.mutable_parameters(1)->set_shape(0, 2);
  const absl::Status t = Refusal(r);
  EXPECT_THAT(t.message(), HasSubstr("needs float32 [3, 3] (or the same per "
                                     "stacked matrix)"));
}

// Rank 1 of 2 of a fused qkv in 128 x 128 blocks: q 256 rows a rank, k and
// v 128; and a row-parallel (column) shard of 256 columns.
TEST(QuantLayoutTest, AcceptsTensorParallelShardsOnBlockBoundaries) {
  v1::RegisterEngineRequest r = Fp8Engine();
  r.mutable_allocations(0)->set_size(4 << 20);
  v1::Parameter* qkv = r.mutable_parameters(0);
  qkv->set_name("qkv");
  qkv->set_shape(0, 512);
  qkv->set_shape(1, 200);  // the last column block is partial
  qkv->mutable_quantization()->set_scale_parameter("qkv_scale");
  AddSegment(qkv, "q", 256, 256, 0, 200, 0, 200);
  AddSegment(qkv, "k", 128, 128, 0, 200, 256 * 200, 200);
  AddSegment(qkv, "v", 128, 128, 0, 200, 384 * 200, 200);
  r.mutable_parameters(1)->set_name("qkv_scale");
  r.mutable_parameters(1)->set_shape(0, 4);
  r.mutable_parameters(1)->set_shape(1, 2);
  v1::Parameter* o = AddParameter(r, "o", v1::FLOAT8_E5M2, {200, 256}, 1 << 20);
  o->mutable_quantization()->set_format(v1::FLOAT8_E5M2);
  o->mutable_quantization()->set_scale_parameter("o_scale");
  AddSegment(o, "o_proj", 0, 200, 256, 256, 0, 0);
  AddParameter(r, "o_scale", v1::FLOAT32, {2, 2}, 2 << 20);
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(r, mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_TRUE((*layout)->parameters[3].quant.has_value());
}

TEST(QuantLayoutTest, RefusesAShardThatCutsABlockNamingIt) {
  v1::RegisterEngineRequest r = Fp8Engine();
  v1::Parameter* w = r.mutable_parameters(0);
  w->set_shape(0, 256);
  r.mutable_parameters(1)->set_shape(0, 2);
  // k/v of 64 rows a rank: rows [128, 192) end inside a block.
  AddSegment(w, "q", 0, 128, 0, 260, 0, 260);
  AddSegment(w, "k", 64, 64, 0, 260, 128 * 260, 260);
  AddSegment(w, "v", 64, 64, 0, 260, 192 * 260, 260);
  const absl::Status s = Refusal(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("engine 'e0': parameter 'w'"));
  EXPECT_THAT(s.message(), HasSubstr("segment 1 (source 'k')"));
  EXPECT_THAT(s.message(), HasSubstr("rows [128, 192)"));
  EXPECT_THAT(s.message(), HasSubstr("cuts a 128 x 128 block"));
}

TEST(QuantLayoutTest, RefusesEveryBadDeclarationBeforeOpeningMemory) {
  struct Case {
    std::string what;
    std::function<void(v1::RegisterEngineRequest&)> change;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"format not FP8",
       [](auto& r) {
         r.mutable_parameters(0)->mutable_quantization()->set_format(
             v1::BFLOAT16);
       },
       absl::StatusCode::kInvalidArgument, "FP8 targets are FLOAT8_E4M3FN"},
      {"dtype differs from the format",
       [](auto& r) { r.mutable_parameters(0)->set_dtype(v1::FLOAT8_E5M2); },
       absl::StatusCode::kInvalidArgument,
       "dtype float8_e5m2 differs from its quantization.format"},
      {"scale parameter missing",
       [](auto& r) {
         r.mutable_parameters(0)->mutable_quantization()->set_scale_parameter(
             "nope");
       },
       absl::StatusCode::kInvalidArgument, "'nope' is not a parameter"},
      {"scale parameter is itself",
       [](auto& r) {
         r.mutable_parameters(0)->mutable_quantization()->set_scale_parameter(
             "w");
       },
       absl::StatusCode::kInvalidArgument, "is the parameter itself"},
      {"scale parameter quantised",
       [](auto& r) {
         v1::Quantization* q = r.mutable_parameters(1)->mutable_quantization();
         q->set_format(v1::FLOAT8_E4M3FN);
         q->set_scale_parameter("norm");
       },
       absl::StatusCode::kInvalidArgument, "is itself quantised"},
      {"one scale for two parameters",
       [](auto& r) {
         v1::Parameter* p =
             AddParameter(r, "w2", v1::FLOAT8_E4M3FN, {300, 260}, 200 * 1024);
         p->mutable_quantization()->set_format(v1::FLOAT8_E4M3FN);
         p->mutable_quantization()->set_scale_parameter("w_scale_inv");
       },
       absl::StatusCode::kInvalidArgument, "already holds the scales of 'w'"},
      {"scale not float32",
       [](auto& r) { r.mutable_parameters(1)->set_dtype(v1::BFLOAT16); },
       absl::StatusCode::kInvalidArgument, "needs float32 [3, 3]"},
      {"scale of the wrong shape",
       [](auto& r) { r.mutable_parameters(1)->set_shape(1, 2); },
       absl::StatusCode::kInvalidArgument, "'w_scale_inv' is float32 [3, 2]"},
      {"per-row scale of the wrong shape",
       [](auto& r) {
         r.mutable_parameters(0)->mutable_quantization()->set_scheme(
             v1::QUANT_SCHEME_PER_ROW);
       },
       absl::StatusCode::kInvalidArgument, "needs float32 [300] or [300, 1]"},
      {"scale with segments",
       [](auto& r) {
         AddSegment(r.mutable_parameters(1), "s", 0, 1, 0, 1, 0, 0);
       },
       absl::StatusCode::kInvalidArgument,
       "'w_scale_inv' holds an FP8 target's scales"},
      {"a 1-D weight",
       [](auto& r) { r.mutable_parameters(0)->mutable_shape()->RemoveLast(); },
       absl::StatusCode::kInvalidArgument,
       "non-empty weight of 2 or more dimensions"},
      {"negative block",
       [](auto& r) {
         r.mutable_parameters(0)->mutable_quantization()->set_block_rows(-1);
       },
       absl::StatusCode::kInvalidArgument, "block -1 x 0"},
      {"negative block columns",
       [](auto& r) {
         r.mutable_parameters(0)->mutable_quantization()->set_block_cols(-1);
       },
       absl::StatusCode::kInvalidArgument, "block 0 x -1"},
      {"block rows past 2^24",
       [](auto& r) {
         r.mutable_parameters(0)->mutable_quantization()->set_block_rows(
             (int64_t{1} << 24) + 1);
       },
       absl::StatusCode::kInvalidArgument, "or 1 to 16777216"},
      {"block columns past 2^24",
       [](auto& r) {
         r.mutable_parameters(0)->mutable_quantization()->set_block_cols(
             (int64_t{1} << 24) + 1);
       },
       absl::StatusCode::kInvalidArgument, "or 1 to 16777216"},
      {"unknown scale form",
       [](auto& r) {
         r.mutable_parameters(0)->mutable_quantization()->set_scale_form(
             static_cast<v1::ScaleForm>(99));
       },
       absl::StatusCode::kInvalidArgument, "not a value this daemon knows"},
      {"block sizes with per-row",
       [](auto& r) {
         v1::Quantization* q = r.mutable_parameters(0)->mutable_quantization();
         q->set_scheme(v1::QUANT_SCHEME_PER_ROW);
         q->set_block_cols(128);
       },
       absl::StatusCode::kInvalidArgument, "leave them 0"},
      {"unknown scheme",
       [](auto& r) {
         r.mutable_parameters(0)->mutable_quantization()->set_scheme(
             static_cast<v1::QuantScheme>(99));
       },
       absl::StatusCode::kInvalidArgument, "not a value this daemon knows"},
      {"rows landing off the parameter's rows",
       [](auto& r) {
         AddSegment(r.mutable_parameters(0), "w", 0, 2, 0, 128, 0, 300);
       },
       absl::StatusCode::kInvalidArgument, "not a rectangle"},
      {"a column shard off the block grid",
       [](auto& r) {
         AddSegment(r.mutable_parameters(0), "w", 0, 300, 0, 100, 0, 260);
       },
       absl::StatusCode::kInvalidArgument, "cols [0, 100)"},
      {"the weight in GPU memory, its scales in host memory",
       [](auto& r) {
         r.mutable_allocations(0)->set_kind(v1::MEMORY_CUDA_IPC);
         v1::Allocation* a = r.add_allocations();
         a->set_kind(v1::MEMORY_HOST_SHM);
         a->set_handle("/scales");
         a->set_size(4096);
         r.mutable_parameters(1)->set_allocation(1);
         r.mutable_parameters(1)->set_offset(0);
       },
       absl::StatusCode::kInvalidArgument,
       "both must be host shared memory (host backend) or both GPU memory"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    v1::RegisterEngineRequest r = Fp8Engine();
    c.change(r);
    const absl::Status s = Refusal(r);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
    EXPECT_THAT(s.message(), HasSubstr("engine 'e0'"));
  }
}

// The GPU backends quantise too (issue 17): an FP8 target and its scales
// in GPU memory, one allocation or two (CUDA IPC and VMM), are accepted.
TEST(QuantLayoutTest, AcceptsFp8TargetsInGpuMemory) {
  for (v1::MemoryKind scale_kind : {v1::MEMORY_CUDA_IPC, v1::MEMORY_CUDA_VMM}) {
    v1::RegisterEngineRequest r = Fp8Engine();
    r.mutable_allocations(0)->set_kind(v1::MEMORY_CUDA_IPC);
    v1::Allocation* a = r.add_allocations();
    a->set_kind(scale_kind);
    a->set_handle("/scales");
    a->set_size(4096);
    r.mutable_parameters(1)->set_allocation(1);
    r.mutable_parameters(1)->set_offset(0);
    testing::HeapMapper mapper;
    auto layout = BuildEngineLayout(r, mapper);
    ASSERT_TRUE(layout.ok()) << layout.status();
    ASSERT_TRUE((*layout)->parameters[0].quant.has_value());
    EXPECT_EQ((*layout)->parameters[0].quant->scale_parameter, 1);
  }
}

TEST(QuantLayoutTest, BoundsTheRowOfBlocksHeldPerUse) {
  RegistrationLimits limits;
  limits.max_quant_band_bytes = 128 * 260 * 4 - 1;
  const absl::Status s = Refusal(Fp8Engine(), limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("a row of its blocks (128 x 260"));
}

// The edges: a block exactly 2^24 columns wide; a band of exactly the
// bytes the daemon holds; a registration of which only the last
// parameter, or only the one whose scale is parameter 0, is bad.
TEST(QuantLayoutTest, EdgesOfTheBoundsAreAccepted) {
  {
    v1::RegisterEngineRequest r = Fp8Engine();
    v1::Quantization* q = r.mutable_parameters(0)->mutable_quantization();
    q->set_scheme(v1::QUANT_SCHEME_BLOCK);
    q->set_block_rows(128);
    q->set_block_cols(int64_t{1} << 24);
    r.mutable_parameters(1)->set_shape(1, 1);  // [3, 1]
    testing::HeapMapper mapper;
    auto layout = BuildEngineLayout(r, mapper);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ((*layout)->parameters[0].quant->block_cols, int64_t{1} << 24);
  }
  RegistrationLimits limits;
  limits.max_quant_band_bytes = 128 * 260 * 4;
  testing::HeapMapper mapper;
  EXPECT_TRUE(BuildEngineLayout(Fp8Engine(), mapper, limits).ok());
}

TEST(QuantLayoutTest, EveryQuantisedParameterIsChecked) {
  // The scale first, the FP8 weight last, its scale the wrong shape.
  v1::RegisterEngineRequest r;
  r.set_engine_id("e0");
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle("/x");
  a->set_size(1 << 20);
  AddParameter(r, "w_scale_inv", v1::FLOAT32, {2, 3}, 100 * 1024);
  v1::Parameter* w = AddParameter(r, "w", v1::FLOAT8_E4M3FN, {300, 260}, 0);
  w->mutable_quantization()->set_format(v1::FLOAT8_E4M3FN);
  w->mutable_quantization()->set_scale_parameter("w_scale_inv");
  absl::Status s = Refusal(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("needs float32 [3, 3]"));
  // A 2-D weight's message says nothing of stacked matrices.
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("stacked")));
  r.mutable_parameters(0)->set_shape(0, 3);
  testing::HeapMapper mapper;
  EXPECT_TRUE(BuildEngineLayout(r, mapper).ok());
}

TEST(QuantLayoutTest, MoreRefusals) {
  // The scale parameter is the last message and is itself quantised.
  v1::RegisterEngineRequest r = Fp8Engine();
  r.mutable_parameters(0)->mutable_quantization()->set_scale_parameter("w2");
  v1::Parameter* w2 =
      AddParameter(r, "w2", v1::FLOAT8_E4M3FN, {128, 128}, 200 * 1024);
  w2->mutable_quantization()->set_format(v1::FLOAT8_E4M3FN);
  w2->mutable_quantization()->set_scale_parameter("w_scale_inv");
  absl::Status s = Refusal(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("its scale parameter 'w2' is itself "
                                     "quantised"));
  // The weight in host memory, its scales on a GPU.
  r = Fp8Engine();
  v1::Allocation* gpu = r.add_allocations();
  gpu->set_kind(v1::MEMORY_CUDA_IPC);
  gpu->set_handle("/scales");
  gpu->set_size(4096);
  r.mutable_parameters(1)->set_allocation(1);
  r.mutable_parameters(1)->set_offset(0);
  s = Refusal(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // An empty FP8 weight.
  r = Fp8Engine();
  r.mutable_parameters(0)->set_shape(0, 0);
  s = Refusal(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("non-empty weight"));
  // Shards on block boundaries but one: starting one row in (ending at the
  // weight's last row), or one column in (ending at its last column).
  for (int side = 0; side < 2; ++side) {
    SCOPED_TRACE(side);
    r = Fp8Engine();
    v1::Parameter* w = r.mutable_parameters(0);
    if (side == 0) {
      AddSegment(w, "a", 0, 299, 0, 260, 260, 260);  // rows [1, 300)
    } else {
      AddSegment(w, "a", 0, 300, 0, 259, 1, 260);  // cols [1, 260)
    }
    s = Refusal(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("cuts a 128 x 128 block"));
  }
}

// Scale parameters as rows of the parameter table (the first and the
// last row), for two FP8 weights that are messages.
TEST(QuantLayoutTest, ScalesInTheParameterTable) {
  v1::RegisterEngineRequest r = Fp8Engine();
  r.mutable_parameters()->DeleteSubrange(1, 2);  // w only
  v1::Parameter* w2 =
      AddParameter(r, "w2", v1::FLOAT8_E4M3FN, {128, 128}, 200 * 1024);
  w2->mutable_quantization()->set_format(v1::FLOAT8_E4M3FN);
  w2->mutable_quantization()->set_scale_parameter("w2_scale");
  v1::ParameterTable* t = r.mutable_parameter_table();
  auto row = [t](const std::string& name, v1::DType dtype,
                 std::vector<int64_t> shape, int64_t offset) {
    t->add_names(name);
    t->add_dtypes(dtype);
    t->add_ranks(static_cast<int32_t>(shape.size()));
    for (int64_t d : shape) t->add_dims(d);
    t->add_allocations(0);
    t->add_offsets(offset);
  };
  row("w_scale_inv", v1::FLOAT32, {3, 3}, 100 * 1024);
  row("norm", v1::BFLOAT16, {260}, 110 * 1024);
  row("w2_scale", v1::FLOAT32, {1, 1}, 120 * 1024);
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(r, mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_TRUE((*layout)->parameters[0].quant.has_value());
  ASSERT_TRUE((*layout)->parameters[1].quant.has_value());
  EXPECT_EQ((*layout)->parameters[0].quant->scale_parameter, 2);
  EXPECT_EQ((*layout)->parameters[1].quant->scale_parameter, 4);
}

TEST(QuantLayoutTest, ScaleBlocksOfARectangle) {
  QuantLayout q;
  q.cols = 260;
  q.block_rows = 128;
  q.block_cols = 128;
  q.grid_cols = 3;
  SegmentLayout s;
  s.row_count = 128;  // rows [128, 256) x cols [128, 256): block (1, 1)
  s.col_count = 128;
  s.dest_offset = 128 * 260 + 128;
  s.dest_row_stride = 260;
  ScaleBlocks b = ScaleBlocksOf(q, s);
  EXPECT_EQ(b.i0, 1);
  EXPECT_EQ(b.i1, 2);
  EXPECT_EQ(b.j0, 1);
  EXPECT_EQ(b.j1, 2);
  EXPECT_EQ(b.first, 1 * 3 + 1);
  s.row_count = 129;  // one row into block row 2; to the last column
  s.col_count = 132;
  b = ScaleBlocksOf(q, s);
  EXPECT_EQ(b.i1, 3);
  EXPECT_EQ(b.j1, 3);
}

TEST(QuantLayoutTest, SegmentRectanglesAtTheirEdges) {
  SegmentLayout s;
  // A rectangle that ends exactly at the last column.
  s.row_count = 2;
  s.col_count = 5;
  s.dest_offset = 10 + 5;
  s.dest_row_stride = 10;
  auto r = SegmentRect(10, s);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->c1, 10);
  s.col_count = 6;  // one column past the row: not a rectangle
  EXPECT_FALSE(SegmentRect(10, s).has_value());
  // One row with any stride: a run; exactly to the row's end, or not.
  s.row_count = 1;
  s.col_count = 5;
  s.dest_row_stride = 0;
  r = SegmentRect(10, s);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->r0, 1);
  EXPECT_EQ(r->r1, 2);
  EXPECT_EQ(r->c1, 10);
  s.col_count = 6;  // from (1, 5) past the row's end, not at column 0
  EXPECT_FALSE(SegmentRect(10, s).has_value());
  s.dest_offset = 10;  // from (1, 0): 6 elements, within the row
  r = SegmentRect(10, s);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->c1, 6);
  // 20 elements from (1, 5): two rows' worth, not from column 0.
  s.dest_offset = 15;
  s.col_count = 20;
  EXPECT_FALSE(SegmentRect(10, s).has_value());
}

TEST(QuantLayoutTest, SegmentRectangles) {
  SegmentLayout s;
  s.row_count = 4;
  s.col_count = 3;
  s.dest_offset = 2 * 10 + 5;
  s.dest_row_stride = 10;
  auto r = SegmentRect(10, s);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->r0, 2);
  EXPECT_EQ(r->r1, 6);
  EXPECT_EQ(r->c0, 5);
  EXPECT_EQ(r->c1, 8);
  s.dest_row_stride = 3;  // contiguous 12 elements from (2, 5): crosses rows
  EXPECT_FALSE(SegmentRect(10, s).has_value());
  s.dest_offset = 20;  // whole rows 2..3 (and 2 over): not whole rows
  EXPECT_FALSE(SegmentRect(10, s).has_value());
  s.col_count = 5;  // 20 elements from row 2: rows [2, 4)
  s.dest_row_stride = 5;
  r = SegmentRect(10, s);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->r1, 4);
  EXPECT_EQ(r->c1, 10);
}

}  // namespace
}  // namespace weightsync
