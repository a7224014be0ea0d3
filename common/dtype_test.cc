#include "common/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

TEST(DTypeTest, Sizes) {
  EXPECT_EQ(ElementSize(v1::FLOAT32), 4);
  EXPECT_EQ(ElementSize(v1::BFLOAT16), 2);
  EXPECT_EQ(ElementSize(v1::INT64), 8);
  EXPECT_EQ(ElementSize(v1::DTYPE_UNSPECIFIED), 0);
}

TEST(DTypeTest, ConvertibilityIsFloatFamilyOnly) {
  EXPECT_TRUE(CanConvert(v1::FLOAT32, v1::BFLOAT16));
  EXPECT_TRUE(CanConvert(v1::FLOAT16, v1::BFLOAT16));
  EXPECT_TRUE(CanConvert(v1::INT64, v1::INT64));
  EXPECT_FALSE(CanConvert(v1::INT32, v1::FLOAT32));
  EXPECT_FALSE(CanConvert(v1::FLOAT32, v1::INT32));
  EXPECT_FALSE(CanConvert(v1::FLOAT64, v1::FLOAT32));
}

TEST(DTypeTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  // 1 + 2^-8 is exactly half way between two bf16 values: ties to even.
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(-2.5f)), -2.5f);
}

TEST(DTypeTest, HalfRoundTripsEveryHalfValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToHalf(f), h) << std::hex << h;
  }
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // overflow to inf
  EXPECT_EQ(FloatToHalf(1e-9f), 0);
}

TEST(DTypeTest, ConvertElementsFloat32ToBf16AndBack) {
  std::vector<float> src = {0.f, 1.f, -3.25f, 1e10f, 6.1e-5f};
  std::vector<uint16_t> mid(src.size());
  std::vector<float> back(src.size());
  ConvertElements(src.data(), v1::FLOAT32, mid.data(), v1::BFLOAT16,
                  src.size());
  ConvertElements(mid.data(), v1::BFLOAT16, back.data(), v1::FLOAT32,
                  src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    EXPECT_EQ(mid[i], FloatToBf16(src[i]));
    EXPECT_NEAR(back[i], src[i], std::fabs(src[i]) / 128);
  }
}

TEST(DTypeTest, NumElementsRejectsNegativeAndHuge) {
  EXPECT_EQ(*NumElements({3, 4}, v1::FLOAT32, "x"), 12);
  EXPECT_EQ(*NumElements({}, v1::FLOAT32, "x"), 1);
  EXPECT_THAT(
      std::string(NumElements({4, -1}, v1::FLOAT32, "x").status().message()),
      ::testing::HasSubstr("negative dimension in shape [4, -1]"));
  EXPECT_FALSE(NumElements({1LL << 40, 1LL << 40}, v1::FLOAT32, "x").ok());
  absl::StatusOr<int64_t> bad = NumElements({2}, v1::DTYPE_UNSPECIFIED, "w");
  EXPECT_NE(bad.status().message().find("w"), std::string::npos);
}

// float -> half against a reference written another way: the nearest of
// the finite halves (their values from HalfToFloat, exact in double), ties
// to the even one, and infinity from 65520 (half way past the largest
// half, 65504) up. Tried at every half, at every midpoint between two
// neighbours and one float ulp either side of it, both signs: every
// rounding edge of the normal and subnormal ranges.
uint16_t ReferenceHalf(float f) {
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (uint32_t h = 0; h <= 0x7BFF; ++h) {
      v.push_back(HalfToFloat(static_cast<uint16_t>(h)));
    }
    return v;
  }();
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double x = std::fabs(static_cast<double>(f));
  if (x >= 65520.0) return sign | 0x7C00;
  const size_t hi = std::lower_bound(values.begin(), values.end(), x) -
                    values.begin();               // values[hi] >= x
  if (hi == values.size()) return sign | 0x7BFF;  // (65504, 65520)
  if (values[hi] == x || hi == 0) return sign | static_cast<uint16_t>(hi);
  const double up = values[hi] - x, down = x - values[hi - 1];
  if (up < down || (up == down && hi % 2 == 0)) {
    return sign | static_cast<uint16_t>(hi);
  }
  return sign | static_cast<uint16_t>(hi - 1);
}

TEST(DTypeTest, HalfRoundsToNearestEvenAtEveryEdge) {
  int tried = 0;
  for (uint32_t h = 0; h < 0x7BFF; ++h) {
    const double lo = HalfToFloat(static_cast<uint16_t>(h));
    const double hi = HalfToFloat(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact in float
    for (float f : {static_cast<float>(lo), mid, std::nextafter(mid, 0.0f),
                    std::nextafter(mid, 1e9f)}) {
      for (float g : {f, -f}) {
        ASSERT_EQ(FloatToHalf(g), ReferenceHalf(g))
            << std::hexfloat << g << " (half " << std::hex << h << ")";
        ++tried;
      }
    }
  }
  // The overflow edge, the underflow edge (2^-25 is half way to the
  // smallest subnormal, 2^-24: ties to 0), and below.
  for (float f : {65504.0f, 65519.996f, 65520.0f, 1e9f, std::ldexp(1.0f, -25),
                  std::nextafter(std::ldexp(1.0f, -25), 1.0f),
                  std::nextafter(std::ldexp(1.0f, -25), 0.0f),
                  std::ldexp(1.0f, -24), std::ldexp(1.0f, -14),
                  std::nextafter(std::ldexp(1.0f, -14), 0.0f), 1e-30f}) {
    for (float g : {f, -f}) {
      EXPECT_EQ(FloatToHalf(g), ReferenceHalf(g)) << std::hexfloat << g;
    }
  }
  EXPECT_GT(tried, 200000);
  // Infinity stays infinite; NaN stays NaN (quiet), its sign kept.
  EXPECT_EQ(FloatToHalf(INFINITY), 0x7C00);
  EXPECT_EQ(FloatToHalf(-INFINITY), 0xFC00);
  EXPECT_EQ(FloatToHalf(NAN) & 0x7E00, 0x7E00);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::max()), 0x7C00);
}

// A NaN whose payload sits in the bits bfloat16 drops (0x7F800001) is
// still a NaN, not rounded up into infinity.
TEST(DTypeTest, Bf16KeepsNaNsWithLowPayloads) {
  for (uint32_t bits : {0x7F800001u, 0xFF800001u, 0x7F80FFFFu, 0x7FC00000u}) {
    float f;
    std::memcpy(&f, &bits, 4);
    EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(f)))) << std::hex << bits;
  }
}

// Unknown dtypes convert to nothing, not even themselves.
TEST(DTypeTest, UnknownDtypesDoNotConvert) {
  EXPECT_FALSE(CanConvert(v1::DTYPE_UNSPECIFIED, v1::DTYPE_UNSPECIFIED));
  EXPECT_FALSE(CanConvert(static_cast<v1::DType>(99), v1::FLOAT32));
}

// A zero dimension is an empty tensor; the 2^62-byte bound is exact: a
// shape of exactly 2^62 bytes passes, one row more is refused.
TEST(DTypeTest, NumElementsBoundsAreExact) {
  EXPECT_EQ(*NumElements({0, 5}, v1::FLOAT32, "x"), 0);
  EXPECT_EQ(*NumElements({5, 0}, v1::FLOAT32, "x"), 0);
  EXPECT_EQ(
      *NumElements({int64_t{1} << 30, int64_t{1} << 30}, v1::FLOAT32, "x"),
      int64_t{1} << 60);
  EXPECT_FALSE(
      NumElements({(int64_t{1} << 30) + 1, int64_t{1} << 30}, v1::FLOAT32, "x")
          .ok());
  EXPECT_EQ(*NumElements({int64_t{1} << 60}, v1::FLOAT32, "x"),
            int64_t{1} << 60);
  EXPECT_FALSE(NumElements({(int64_t{1} << 60) + 1}, v1::FLOAT32, "x").ok());
}

// Exactly n elements are converted, the first included, none past the
// end; a same-dtype "conversion" copies bits exactly (an int64, a
// signalling bf16 NaN that a trip through float would quiet).
TEST(DTypeTest, ConvertElementsTouchesExactlyNElements) {
  const std::vector<float> src = {1.5f, -2.0f, 3.25f, 7.0f};
  std::vector<uint16_t> dst(5, 0xFFFF);  // one guard element past n = 4
  ConvertElements(src.data(), v1::FLOAT32, dst.data(), v1::FLOAT16, 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(dst[i], FloatToHalf(src[i])) << i;
  EXPECT_EQ(dst[4], 0xFFFF);
  const std::vector<int64_t> ints = {-1, int64_t{1} << 62, 12345};
  std::vector<int64_t> copy(3, 0);
  ConvertElements(ints.data(), v1::INT64, copy.data(), v1::INT64, 3);
  EXPECT_EQ(copy, ints);
  const std::vector<uint16_t> snan = {0x7F81, 0x3F80};
  std::vector<uint16_t> out(2, 0);
  ConvertElements(snan.data(), v1::BFLOAT16, out.data(), v1::BFLOAT16, 2);
  EXPECT_EQ(out, snan);
}

}  // namespace
}  // namespace weightsync
