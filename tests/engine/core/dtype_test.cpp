#include "engine/core/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace strata {
namespace {

TEST(DTypeTest, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties go to the even mantissa (1.0).
  EXPECT_EQ(float_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): rounds up to even.
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(float_to_bf16_bits(-2.0f), 0xc000);
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(std::numeric_limits<float>::infinity())), std::numeric_limits<float>::infinity());
}

TEST(DTypeTest, Fp16RoundTripsEveryHalf) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const uint16_t half = static_cast<uint16_t>(bits);
    const float value = fp16_bits_to_float(half);
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(fp16_bits_to_float(float_to_fp16_bits(value))));
      continue;
    }
    ASSERT_EQ(float_to_fp16_bits(value), half) << "bits " << bits;
  }
}

TEST(DTypeTest, Fp16RoundsToNearestEvenAndOverflows) {
  EXPECT_EQ(float_to_fp16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16_bits(65520.0f), 0x7c00);  // halfway to the next step rounds to inf
  EXPECT_EQ(float_to_fp16_bits(1e-8f), 0x0000);
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -25)), 0x0000);       // tie to even (0)
  EXPECT_EQ(float_to_fp16_bits(3 * std::ldexp(1.0f, -25)), 0x0002);   // tie to even (2)
  EXPECT_EQ(float_to_fp16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3c00); // tie to even
}

TEST(DTypeTest, ParsesNames) {
  EXPECT_EQ(*parse_dtype("bf16"), DType::kBFloat16);
  EXPECT_EQ(*parse_dtype("float32"), DType::kFloat32);
  auto bad = parse_dtype("int8");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("int8"), std::string::npos);
}

}  // namespace
}  // namespace strata
