// The FP8 function (common/fp8.h) against tests/vectors/fp8.json, written
// by tools/fp8_vectors.py with exact rational arithmetic, and the rounding
// against a nearest-value search over the format's grid for a wide sample
// of float32 patterns.
#include "common/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "common/dtype.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/testing/json_vectors.h"

namespace weightsync {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

Struct LoadVectors() {
  return testing::LoadJsonVectors("tests/vectors/fp8.json");
}

uint32_t Hex(const Value& v) {
  uint32_t x = 0;
  EXPECT_TRUE(absl::SimpleHexAtoi(v.string_value(), &x)) << v.string_value();
  return x;
}

v1::DType Format(const Value& v) {
  v1::DType d = v1::DTYPE_UNSPECIFIED;
  EXPECT_TRUE(v1::DType_Parse(v.string_value(), &d)) << v.string_value();
  return d;
}

float FloatOf(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(Fp8VectorsTest, Rounding) {
  const Struct v = LoadVectors();
  const auto& cases = v.fields().at("round").list_value().values();
  ASSERT_GE(cases.size(), 80);
  for (const Value& c : cases) {
    const auto& f = c.struct_value().fields();
    const uint32_t bits = Hex(f.at("f32"));
    EXPECT_EQ(FloatToFp8(FloatOf(bits), Format(f.at("format"))),
              Hex(f.at("fp8")))
        << f.at("format").string_value() << " " << f.at("f32").string_value();
  }
}

TEST(Fp8VectorsTest, Blocks) {
  const Struct v = LoadVectors();
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
    ASSERT_EQ(static_cast<int64_t>(raw.size()), rows * cols * ElementSize(src));
    std::vector<float> x(rows * cols);
    ConvertElements(raw.data(), src, x.data(), v1::FLOAT32, rows * cols);
    Fp8Blocks q;
    q.format = Format(f.at("format"));
    q.block_rows = f.at("blockRows").number_value();
    q.block_cols = f.at("blockCols").number_value();
    q.reciprocal = f.at("scaleForm").string_value() == "RECIPROCAL";
    const int64_t grid_cols = (cols + q.block_cols - 1) / q.block_cols;
    const int64_t grid_rows = (rows + q.block_rows - 1) / q.block_rows;
    std::string out(rows * cols, '\0');
    std::string scales(grid_rows * grid_cols * 4, '\0');
    QuantizeBlocks(x.data(), rows, cols, cols, q,
                   reinterpret_cast<uint8_t*>(out.data()), cols,
                   reinterpret_cast<uint8_t*>(scales.data()), grid_cols);
    EXPECT_EQ(absl::BytesToHexString(out), f.at("fp8").string_value());
    EXPECT_EQ(absl::BytesToHexString(scales), f.at("scales").string_value());
  }
}

// The format's finite non-negative values by a formula of their own.
std::vector<std::pair<double, int>> Grid(v1::DType format) {
  const bool e5 = format == v1::FLOAT8_E5M2;
  const int mb = e5 ? 2 : 3, bias = e5 ? 15 : 7;
  std::vector<std::pair<double, int>> grid;
  for (int enc = 0; enc < 0x80; ++enc) {
    const int e = enc >> mb, m = enc & ((1 << mb) - 1);
    if (e5 && e == 31) continue;       // inf, NaN
    if (!e5 && enc == 0x7F) continue;  // NaN
    const double v = e == 0 ? std::ldexp(m, 1 - bias - mb)
                            : std::ldexp((1 << mb) | m, e - bias - mb);
    grid.push_back({v, enc});
  }
  return grid;
}

// The encoding nearest to x >= 0 (ties: the even encoding), saturating.
int Nearest(const std::vector<std::pair<double, int>>& grid, double x) {
  if (x >= grid.back().first) return grid.back().second;
  const auto hi = std::lower_bound(
      grid.begin(), grid.end(), x,
      [](const std::pair<double, int>& g, double v) { return g.first < v; });
  if (hi->first == x || hi == grid.begin()) return hi->second;
  const auto lo = hi - 1;
  const double below = x - lo->first, above = hi->first - x;
  if (below < above || (below == above && lo->second % 2 == 0)) {
    return lo->second;
  }
  return hi->second;
}

TEST(Fp8Test, RoundingMatchesTheNearestGridValue) {
  for (v1::DType format : {v1::FLOAT8_E4M3FN, v1::FLOAT8_E5M2}) {
    const auto grid = Grid(format);
    // Every exponent and the top 12 mantissa bits, with low bits that make
    // exact ties, just-below and just-above ties.
    for (uint32_t hi = 0; hi < (1u << 20); ++hi) {
      for (uint32_t lo : {0u, 1u, 0x7FFu, 0x800u, 0x801u}) {
        const uint32_t bits = (hi << 11) | lo;
        const float f = FloatOf(bits);
        if (std::isnan(f) || std::fabs(f) > 1e6) continue;
        const int want = Nearest(grid, std::fabs(f)) | (bits >> 31 << 7);
        ASSERT_EQ(FloatToFp8(f, format), want) << std::hex << bits;
      }
    }
  }
}

TEST(Fp8Test, DecodesEveryEncodingBack) {
  for (v1::DType format : {v1::FLOAT8_E4M3FN, v1::FLOAT8_E5M2}) {
    for (int enc = 0; enc < 256; ++enc) {
      const float v = Fp8ToFloat(enc, format);
      if (std::isnan(v)) {
        EXPECT_EQ(FloatToFp8(v, format) & 0x80, enc & 0x80);
        continue;
      }
      if (std::isinf(v)) continue;  // e5m2 inf saturates
      EXPECT_EQ(FloatToFp8(v, format), enc) << enc;
    }
  }
  EXPECT_EQ(Fp8Max(v1::FLOAT8_E4M3FN), 448.0f);
  EXPECT_EQ(Fp8ToFloat(0x7E, v1::FLOAT8_E4M3FN), 448.0f);
  EXPECT_EQ(Fp8ToFloat(0x7B, v1::FLOAT8_E5M2), 57344.0f);
}

TEST(Fp8Test, ScalesOfZeroAndTinyBlocksAreOne) {
  EXPECT_EQ(DequantScale(0.0f, v1::FLOAT8_E4M3FN), 1.0f);
  EXPECT_EQ(DequantScale(FloatOf(1), v1::FLOAT8_E4M3FN), 1.0f);
  EXPECT_EQ(DequantScale(448.0f, v1::FLOAT8_E4M3FN), 1.0f);
  EXPECT_EQ(DequantScale(57344.0f * 2, v1::FLOAT8_E5M2), 2.0f);
  EXPECT_EQ(StoredScale(0.25f, true), 4.0f);
  EXPECT_EQ(StoredScale(0.25f, false), 0.25f);
}

// float -> FP8 against a reference written another way: the nearest of
// the format's finite values (decoded by Fp8ToFloat), ties to the even
// encoding, saturating at the largest finite one. Tried at every value,
// every midpoint between neighbours and one float ulp either side, both
// signs, both formats: every rounding edge, subnormals and the top.
uint8_t ReferenceFp8(float x, v1::DType format) {
  const uint8_t max_bits = format == v1::FLOAT8_E5M2 ? 0x7B : 0x7E;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= Fp8ToFloat(max_bits, format)) return sign | max_bits;
  uint8_t k = 0;
  while (k < max_bits && Fp8ToFloat(k + 1, format) <= a) ++k;
  const double down = a - Fp8ToFloat(k, format);
  const double up = Fp8ToFloat(k + 1, format) - a;
  if (down < up || (down == up && k % 2 == 0)) return sign | k;
  return sign | (k + 1);
}

TEST(Fp8Test, RoundsToNearestEvenAtEveryEdge) {
  for (v1::DType format : {v1::FLOAT8_E4M3FN, v1::FLOAT8_E5M2}) {
    const uint8_t max_bits = format == v1::FLOAT8_E5M2 ? 0x7B : 0x7E;
    std::vector<float> edges = {
        std::ldexp(1.0f, -149), 1e-30f, 0.0f,
        std::nextafter(Fp8ToFloat(max_bits, format), 1e30f), 1e30f};
    for (int k = 0; k < max_bits; ++k) {
      const float lo = Fp8ToFloat(k, format);
      const float mid = (lo + Fp8ToFloat(k + 1, format)) / 2;  // exact
      for (float f :
           {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
        edges.push_back(f);
      }
    }
    for (float f : edges) {
      for (float g : {f, -f}) {
        ASSERT_EQ(FloatToFp8(g, format), ReferenceFp8(g, format))
            << std::hexfloat << g << " format " << format;
      }
    }
  }
  EXPECT_TRUE(IsFp8(v1::FLOAT8_E4M3FN));
  EXPECT_TRUE(IsFp8(v1::FLOAT8_E5M2));
  EXPECT_FALSE(IsFp8(v1::BFLOAT16));
}

// QuantizeBlocks writes its rows x cols values and one scale per block,
// nothing past them (guard bytes after both outputs stay as they were),
// also when the blocks tile the matrix exactly.
TEST(Fp8Test, QuantizeBlocksWritesNothingPastItsOutputs) {
  const int64_t rows = 4, cols = 8;
  std::vector<float> x(rows * cols);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) - 10;
  Fp8Blocks q;
  q.format = v1::FLOAT8_E4M3FN;
  q.block_rows = 2;
  q.block_cols = 4;
  q.reciprocal = false;
  const int64_t srows = 2, scols = 2;  // 4 / 2, 8 / 4
  std::vector<uint8_t> values(rows * cols + 16, 0xAB);
  std::vector<uint8_t> scales(srows * scols * 4 + 16, 0xCD);
  QuantizeBlocks(x.data(), rows, cols, cols, q, values.data(), cols,
                 scales.data(), scols);
  for (size_t i = rows * cols; i < values.size(); ++i) {
    EXPECT_EQ(values[i], 0xAB) << "value byte " << i;
  }
  for (size_t i = srows * scols * 4; i < scales.size(); ++i) {
    EXPECT_EQ(scales[i], 0xCD) << "scale byte " << i;
  }
  EXPECT_NE(values[0], 0xAB);
  EXPECT_NE(scales[srows * scols * 4 - 1], 0xCD);  // the last scale written
}

}  // namespace
}  // namespace weightsync
