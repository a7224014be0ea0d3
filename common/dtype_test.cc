#include "common/dtype.h"

#include <cmath>
#include <cstring>
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

}  // namespace
}  // namespace weightsync
