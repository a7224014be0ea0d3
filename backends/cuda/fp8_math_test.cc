// The GPU quantisation kernel's arithmetic (fp8_math.h), run on the CPU
// thread by thread as the kernel runs it, against tests/vectors/fp8.json
// (exact rational arithmetic, tools/fp8_vectors.py) and against
// common/fp8.h (the host's function) over a wide sample of float32
// patterns: what the GPU writes is what the host writes, bit for bit.
#include "backends/cuda/fp8_math.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "common/dtype.h"
#include "common/fp8.h"
#include "google/protobuf/struct.pb.h"
#include "gtest/gtest.h"
#include "tests/testing/json_vectors.h"

namespace weightsync {
namespace cuda {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

uint32_t Hex(const Value& v) {
  uint32_t x = 0;
  EXPECT_TRUE(absl::SimpleHexAtoi(v.string_value(), &x)) << v.string_value();
  return x;
}

bool IsE5m2(const Value& v) { return v.string_value() == "FLOAT8_E5M2"; }

// The kernel's launch on the CPU: per block, every thread's amax part
// (combined in the order given by `reverse`: a maximum does not care),
// then every thread's writes.
void RunJob(const QuantJob& job, uint32_t threads, bool reverse) {
  for (int64_t b = 0; b < QuantJobBlocks(job); ++b) {
    float amax = 0.0f;
    for (uint32_t i = 0; i < threads; ++i) {
      const uint32_t t = reverse ? threads - 1 - i : i;
      const float part = QuantAmaxPart(job, b, t, threads);
      amax = part > amax ? part : amax;
    }
    for (uint32_t t = 0; t < threads; ++t) {
      QuantWritePart(job, b, amax, t, threads);
    }
  }
}

TEST(Fp8MathTest, RoundingVectors) {
  const Struct v = testing::LoadJsonVectors("tests/vectors/fp8.json");
  const auto& cases = v.fields().at("round").list_value().values();
  ASSERT_GE(cases.size(), 80);
  for (const Value& c : cases) {
    const auto& f = c.struct_value().fields();
    const Fp8Format format = Fp8FormatOf(IsE5m2(f.at("format")));
    EXPECT_EQ(Fp8Encode(Fp8FloatOf(Hex(f.at("f32"))), format), Hex(f.at("fp8")))
        << f.at("format").string_value() << " " << f.at("f32").string_value();
  }
}

TEST(Fp8MathTest, BlockVectorsThreadByThread) {
  const Struct v = testing::LoadJsonVectors("tests/vectors/fp8.json");
  const auto& cases = v.fields().at("blocks").list_value().values();
  ASSERT_GE(cases.size(), 20);
  for (const Value& c : cases) {
    const auto& f = c.struct_value().fields();
    SCOPED_TRACE(f.at("name").string_value());
    v1::DType src;
    ASSERT_TRUE(v1::DType_Parse(f.at("srcDtype").string_value(), &src));
    const std::string raw = absl::HexStringToBytes(f.at("hex").string_value());
    const auto& shape = f.at("shape").list_value().values();
    const int64_t rows = shape[0].number_value();
    const int64_t cols = shape[1].number_value();
    // Widened as the worker's gathers do (CopyConvert2D into float32).
    std::vector<float> x(rows * cols);
    ConvertElements(raw.data(), src, x.data(), v1::FLOAT32, rows * cols);
    const bool per_row = f.at("scheme").string_value() == "PER_ROW";
    QuantJob job{};
    job.x = x.data();
    job.rows = rows;
    job.width = cols;
    job.x_stride = cols;
    job.block_rows = per_row ? 1 : f.at("blockRows").number_value();
    job.block_cols = per_row ? cols : f.at("blockCols").number_value();
    job.e5m2 = IsE5m2(f.at("format"));
    job.reciprocal = f.at("scaleForm").string_value() == "RECIPROCAL";
    const int64_t grid_cols = (cols + job.block_cols - 1) / job.block_cols;
    const int64_t grid_rows = (rows + job.block_rows - 1) / job.block_rows;
    for (uint32_t threads : {1u, 7u, 256u}) {
      std::string out(rows * cols, '\xAA');
      std::string scales(grid_rows * grid_cols * 4, '\xAA');
      job.q = reinterpret_cast<uint8_t*>(out.data());
      job.q_stride = cols;
      job.scale = reinterpret_cast<uint8_t*>(scales.data());
      job.scale_stride = grid_cols;
      RunJob(job, threads, threads == 7);
      EXPECT_EQ(absl::BytesToHexString(out), f.at("fp8").string_value())
          << threads << " threads";
      EXPECT_EQ(absl::BytesToHexString(scales), f.at("scales").string_value())
          << threads << " threads";
    }
  }
}

TEST(Fp8MathTest, EncodeMatchesTheHostFunction) {
  for (v1::DType dtype : {v1::FLOAT8_E4M3FN, v1::FLOAT8_E5M2}) {
    const Fp8Format format = Fp8FormatOf(dtype == v1::FLOAT8_E5M2);
    // Every exponent and the top 13 mantissa bits, with low bits that make
    // ties, just below and just above them; every sign; NaN and inf.
    for (uint32_t hi = 0; hi < (1u << 22); ++hi) {
      for (uint32_t lo : {0u, 1u, 0x1FFu, 0x200u, 0x201u, 0x3FFu}) {
        const uint32_t bits = (hi << 10) | lo;
        ASSERT_EQ(Fp8Encode(Fp8FloatOf(bits), format),
                  FloatToFp8(Fp8FloatOf(bits), dtype))
            << std::hex << bits;
      }
    }
  }
}

TEST(Fp8MathTest, ScaleAndElementMatchTheHostFunction) {
  std::mt19937 rng(17);
  for (v1::DType dtype : {v1::FLOAT8_E4M3FN, v1::FLOAT8_E5M2}) {
    const bool e5m2 = dtype == v1::FLOAT8_E5M2;
    const Fp8Format format = Fp8FormatOf(e5m2);
    for (int i = 0; i < 200000; ++i) {
      // Any finite non-negative amax, tiny ones (d underflows) included.
      const float amax = Fp8FloatOf(rng() % 0x7F800000u);
      const float d = Fp8DequantScale(amax, format);
      ASSERT_EQ(Fp8BitsOf(d), Fp8BitsOf(DequantScale(amax, dtype)))
          << std::hex << Fp8BitsOf(amax);
      for (bool reciprocal : {false, true}) {
        ASSERT_EQ(Fp8BitsOf(Fp8StoredScale(d, reciprocal)),
                  Fp8BitsOf(StoredScale(d, reciprocal)));
      }
      const float x = Fp8FloatOf(static_cast<uint32_t>(rng()));
      const float q = std::isnan(x) ? x : x / d;
      ASSERT_EQ(Fp8QuantizeElement(x, d, format), FloatToFp8(q, dtype))
          << std::hex << Fp8BitsOf(x) << " / " << Fp8BitsOf(d);
    }
  }
}

TEST(Fp8MathTest, AmaxLeavesOutNanAndInfinity) {
  EXPECT_EQ(Fp8AmaxStep(1.0f, NAN), 1.0f);
  EXPECT_EQ(Fp8AmaxStep(1.0f, -NAN), 1.0f);
  EXPECT_EQ(Fp8AmaxStep(1.0f, INFINITY), 1.0f);
  EXPECT_EQ(Fp8AmaxStep(1.0f, -INFINITY), 1.0f);
  EXPECT_EQ(Fp8AmaxStep(1.0f, -3.0f), 3.0f);
  EXPECT_EQ(Fp8AmaxStep(0.0f, -0.0f), 0.0f);
  EXPECT_EQ(Fp8BitsOf(Fp8AmaxStep(0.0f, -0.0f)), 0u);
  EXPECT_EQ(Fp8AmaxStep(0.0f, Fp8FloatOf(0x80000001u)), Fp8FloatOf(1u));
}

// A block job over a strided input, unaligned outputs and partial edge
// blocks, against QuantizeBlocks.
TEST(Fp8MathTest, StridedJobMatchesQuantizeBlocks) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t rows = 37, width = 45, x_stride = 50, q_stride = 61;
  std::vector<float> x(rows * x_stride);
  for (float& v : x) v = normal(rng);
  x[3] = NAN;
  x[x_stride + 4] = -INFINITY;
  for (int64_t c = 0; c < width; ++c) x[20 * x_stride + c] = 0.0f;
  for (bool e5m2 : {false, true}) {
    for (bool reciprocal : {false, true}) {
      QuantJob job{};
      job.x = x.data();
      job.rows = rows;
      job.width = width;
      job.x_stride = x_stride;
      job.block_rows = 8;
      job.block_cols = 16;
      job.e5m2 = e5m2;
      job.reciprocal = reciprocal;
      const int64_t gr = (rows + 7) / 8, gc = (width + 15) / 16;
      std::string got(rows * q_stride + 1, '\0'), want = got;
      std::string got_s(gr * (gc + 1) * 4 + 1, '\0'), want_s = got_s;
      job.q = reinterpret_cast<uint8_t*>(&got[1]);
      job.q_stride = q_stride;
      job.scale = reinterpret_cast<uint8_t*>(&got_s[1]);
      job.scale_stride = gc + 1;
      RunJob(job, 256, false);
      Fp8Blocks q{e5m2 ? v1::FLOAT8_E5M2 : v1::FLOAT8_E4M3FN, 8, 16,
                  reciprocal};
      QuantizeBlocks(x.data(), rows, width, x_stride, q,
                     reinterpret_cast<uint8_t*>(&want[1]), q_stride,
                     reinterpret_cast<uint8_t*>(&want_s[1]), gc + 1);
      EXPECT_EQ(got, want);
      EXPECT_EQ(got_s, want_s);
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace weightsync
