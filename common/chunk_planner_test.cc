#include "common/chunk_planner.h"

#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/vectors/vectors.pb.h"

namespace weightsync {
namespace {

vectors::PlanVectors LoadVectors() {
  std::ifstream in("tests/vectors/chunk_plan.json");
  EXPECT_TRUE(in.good()) << "tests/vectors/chunk_plan.json not found";
  std::stringstream text;
  text << in.rdbuf();
  vectors::PlanVectors v;
  const auto status =
      google::protobuf::util::JsonStringToMessage(text.str(), &v);
  EXPECT_TRUE(status.ok()) << status.ToString();
  return v;
}

TEST(ChunkPlannerTest, MatchesSharedVectors) {
  const vectors::PlanVectors v = LoadVectors();
  ASSERT_EQ(v.alignment(), kChunkAlignment);
  ASSERT_GE(v.cases_size(), 10);
  for (const vectors::PlanCase& c : v.cases()) {
    SCOPED_TRACE(c.name());
    absl::StatusOr<ChunkPlan> plan = PlanChunks(c.tensors(), c.chunk_bytes());
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->total_bytes, c.total_bytes());
    EXPECT_EQ(plan->tensor_offsets,
              std::vector<int64_t>(c.tensor_offsets().begin(),
                                   c.tensor_offsets().end()));
    EXPECT_EQ(plan->payload_bytes,
              std::vector<int64_t>(c.payload_bytes().begin(),
                                   c.payload_bytes().end()));
    ASSERT_EQ(plan->chunks.size(), c.chunks_size());
    for (int k = 0; k < c.chunks_size(); ++k) {
      const Chunk& got = plan->chunks[k];
      const vectors::ChunkVector& want = c.chunks(k);
      EXPECT_EQ(got.index, want.index());
      EXPECT_EQ(got.offset, want.offset());
      EXPECT_EQ(got.size, want.size());
      ASSERT_EQ(got.pieces.size(), want.pieces_size()) << "chunk " << k;
      for (int p = 0; p < want.pieces_size(); ++p) {
        EXPECT_EQ(got.pieces[p].tensor, want.pieces(p).tensor());
        EXPECT_EQ(got.pieces[p].tensor_offset, want.pieces(p).tensor_offset());
        EXPECT_EQ(got.pieces[p].chunk_offset, want.pieces(p).chunk_offset());
        EXPECT_EQ(got.pieces[p].length, want.pieces(p).length());
      }
    }
  }
}

TEST(ChunkPlannerTest, RejectsSharedErrorVectors) {
  const vectors::PlanVectors v = LoadVectors();
  ASSERT_GE(v.errors_size(), 6);
  for (const vectors::ErrorCase& c : v.errors()) {
    SCOPED_TRACE(c.name());
    absl::StatusOr<ChunkPlan> plan = PlanChunks(c.tensors(), c.chunk_bytes());
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(plan.status().message().find(c.error_contains()),
              std::string::npos)
        << plan.status();
  }
}

TEST(ChunkPlannerTest, PiecesTileEveryPayloadOnce) {
  Manifest m;
  const int64_t dims[][2] = {{7, 3}, {1000, 33}, {0, 5}, {1, 1}, {257, 129}};
  for (int i = 0; i < 5; ++i) {
    v1::TensorSpec* t = m.Add();
    t->set_name("t" + std::to_string(i));
    t->set_dtype(i % 2 ? v1::BFLOAT16 : v1::FLOAT32);
    t->add_shape(dims[i][0]);
    t->add_shape(dims[i][1]);
  }
  for (int64_t chunk : {256, 768, 4096, 1 << 20}) {
    absl::StatusOr<ChunkPlan> plan = PlanChunks(m, chunk);
    ASSERT_TRUE(plan.ok());
    std::vector<int64_t> covered(m.size(), 0);
    int64_t sum = 0;
    for (const Chunk& c : plan->chunks) {
      sum += c.size;
      EXPECT_LE(c.size, chunk);
      for (const Piece& p : c.pieces) {
        EXPECT_EQ(p.tensor_offset, covered[p.tensor]) << "out of order";
        EXPECT_EQ(c.offset + p.chunk_offset,
                  plan->tensor_offsets[p.tensor] + p.tensor_offset);
        covered[p.tensor] += p.length;
      }
    }
    EXPECT_EQ(sum, plan->total_bytes);
    for (int i = 0; i < m.size(); ++i) {
      EXPECT_EQ(covered[i], plan->payload_bytes[i]) << "tensor " << i;
    }
  }
}

// The stream's byte offsets are bounded by 2^62 (so sums never overflow):
// a tensor of 2^62 one-byte elements fits alone (and is refused later for
// its chunk count), one more byte after it is refused naming that tensor.
TEST(ChunkPlannerTest, AnUpdatePast2To62BytesIsRefusedNamingTheTensor) {
  Manifest m;
  v1::TensorSpec* big = m.Add();
  big->set_name("big");
  big->set_dtype(v1::UINT8);
  big->add_shape(int64_t{1} << 62);
  absl::StatusOr<ChunkPlan> plan = PlanChunks(m, 1 << 20);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("use larger chunks"),
            std::string::npos)
      << plan.status();
  v1::TensorSpec* one = m.Add();
  one->set_name("one_more");
  one->set_dtype(v1::UINT8);
  one->add_shape(1);
  plan = PlanChunks(m, 1 << 20);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.status().message(),
            "tensor 'one_more' takes the update past 2^62 bytes");
}

// 4-byte sparse indices address at most 2^32 elements (0 .. 2^32 - 1): a
// tensor of exactly 2^32 takes them, one element more is refused.
TEST(ChunkPlannerTest, FourByteIndicesHoldExactly2To32Elements) {
  Manifest m;
  v1::TensorSpec* t = m.Add();
  t->set_name("t");
  t->set_dtype(v1::UINT8);
  t->add_shape(int64_t{1} << 32);
  t->set_sparse_nnz(10);
  t->set_sparse_index_bytes(4);
  absl::StatusOr<ChunkPlan> plan = PlanChunks(m, 4096);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->payload_bytes[0], 10 * (4 + 1));
  m.Mutable(0)->set_shape(0, (int64_t{1} << 32) + 1);
  plan = PlanChunks(m, 4096);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("at most 2^32 elements"),
            std::string::npos)
      << plan.status();
}

// A tensor quantised on the wire weighs a byte per element, then from the
// next multiple of 4 its float32 scales, one per block (per row: one per
// row); what can't be such a tensor is refused naming it and the field.
TEST(ChunkPlannerTest, QuantisedOnTheWireIsElementsThenScales) {
  auto spec = [](std::vector<int64_t> shape) {
    v1::TensorSpec t;
    t.set_name("w");
    t.set_dtype(v1::FLOAT8_E4M3FN);
    for (int64_t d : shape) t.add_shape(d);
    t.mutable_quantization()->set_format(v1::FLOAT8_E4M3FN);
    return t;
  };
  // [3, 5, 7] is the 3 x 35 matrix: 105 bytes, padded to 108, then one
  // 128 x 128 block's scale.
  EXPECT_EQ(*PayloadBytes(spec({3, 5, 7})), 108 + 4);
  v1::TensorSpec t = spec({300, 260});
  EXPECT_EQ(*PayloadBytes(t), 78000 + 3 * 3 * 4);
  t.mutable_quantization()->set_block_rows(100);
  t.mutable_quantization()->set_block_cols(1);
  EXPECT_EQ(*PayloadBytes(t), 78000 + 3 * 260 * 4);
  t = spec({300, 260});
  t.mutable_quantization()->set_scheme(v1::QUANT_SCHEME_PER_ROW);
  EXPECT_EQ(*PayloadBytes(t), 78000 + 300 * 4);
  absl::StatusOr<WireQuant> w = ResolveWireQuant(t);
  ASSERT_TRUE(w.ok());
  EXPECT_TRUE(w->per_row);
  EXPECT_EQ(w->block_cols, 260);
  EXPECT_EQ(w->scales_offset, 78000);
  // Both FP8 formats, and block sides up to 2^24 either way.
  t = spec({300, 260});
  t.set_dtype(v1::FLOAT8_E5M2);
  t.mutable_quantization()->set_format(v1::FLOAT8_E5M2);
  EXPECT_EQ(*PayloadBytes(t), 78000 + 3 * 3 * 4);
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {int64_t{1} << 24, 1}, {1, int64_t{1} << 24}}) {
    t = spec({300, 260});
    t.mutable_quantization()->set_block_rows(rows);
    t.mutable_quantization()->set_block_cols(cols);
    EXPECT_TRUE(PayloadBytes(t).ok()) << rows << " x " << cols;
  }

  struct Bad {
    std::function<void(v1::TensorSpec&)> make;
    std::string says;
  };
  const std::vector<Bad> bad = {
      {[](v1::TensorSpec& t) { t.set_dtype(v1::BFLOAT16); },
       "dtype bfloat16 and quantization.format float8_e4m3fn"},
      {[](v1::TensorSpec& t) {
         t.mutable_quantization()->set_format(v1::FLOAT8_E5M2);
       },
       "quantization.format float8_e5m2 must be one FP8 format"},
      {[](v1::TensorSpec& t) {
         t.mutable_quantization()->set_scale_parameter("w_scale");
       },
       "leave it empty"},
      {[](v1::TensorSpec& t) {
         t.mutable_quantization()->set_scheme(static_cast<v1::QuantScheme>(9));
       },
       "quantization.scheme 9"},
      {[](v1::TensorSpec& t) {
         t.mutable_quantization()->set_scale_form(
             static_cast<v1::ScaleForm>(7));
       },
       "or scale_form 7 is not a value this daemon knows"},
      {[](v1::TensorSpec& t) { t.mutable_quantization()->set_block_rows(-1); },
       "block -1 x 0 must be 0 (128) or 1 to 16777216"},
      {[](v1::TensorSpec& t) { t.mutable_quantization()->set_block_cols(-1); },
       "block 0 x -1 must be 0 (128) or 1 to 16777216"},
      {[](v1::TensorSpec& t) {
         t.mutable_quantization()->set_block_rows((int64_t{1} << 24) + 1);
       },
       "block 16777217 x 0"},
      {[](v1::TensorSpec& t) {
         t.mutable_quantization()->set_block_cols((int64_t{1} << 24) + 1);
       },
       "block 0 x 16777217"},
      {[](v1::TensorSpec& t) {
         t.mutable_quantization()->set_scheme(v1::QUANT_SCHEME_PER_ROW);
         t.mutable_quantization()->set_block_cols(128);
       },
       "leave them 0 with QUANT_SCHEME_PER_ROW"},
      {[](v1::TensorSpec& t) { t.set_sparse_nnz(3); },
       "a sparse patch can't be quantised"},
      {[](v1::TensorSpec& t) { t.set_shape(0, 0); },
       "an empty tensor has nothing to quantise"},
  };
  for (const Bad& b : bad) {
    v1::TensorSpec t = spec({300, 260});
    b.make(t);
    absl::StatusOr<int64_t> bytes = PayloadBytes(t);
    EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bytes.status().message().find("tensor 'w' (quantised on the "
                                            "wire): "),
              std::string::npos)
        << bytes.status();
    EXPECT_NE(bytes.status().message().find(b.says), std::string::npos)
        << bytes.status() << " should say " << b.says;
  }
}

// An update of exactly kMaxChunks chunks is planned; one chunk more is
// refused before anything is allocated.
TEST(ChunkPlannerTest, AtMostKMaxChunksChunks) {
  Manifest m;
  v1::TensorSpec* t = m.Add();
  t->set_name("t");
  t->set_dtype(v1::UINT8);
  t->add_shape(kMaxChunks * kChunkAlignment);
  absl::StatusOr<ChunkPlan> plan = PlanChunks(m, kChunkAlignment);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(static_cast<int64_t>(plan->chunks.size()), kMaxChunks);
  m.Mutable(0)->set_shape(0, kMaxChunks * kChunkAlignment + 1);
  plan = PlanChunks(m, kChunkAlignment);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("use larger chunks"),
            std::string::npos)
      << plan.status();
}

}  // namespace
}  // namespace weightsync
