#include "quant/numerics.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace tqkv {
namespace {

TEST(HalfTest, EveryFiniteCodeRoundTrips) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfBitsToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_EQ((h & 0x7C00), 0x7C00u);
      EXPECT_TRUE(std::isnan(HalfBitsToFloat(FloatToHalfBits(f))));
      continue;
    }
    ASSERT_EQ(FloatToHalfBits(f), h) << std::hex << h;
  }
}

TEST(HalfTest, KnownValues) {
  EXPECT_EQ(FloatToHalfBits(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalfBits(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalfBits(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalfBits(65519.99f), 0x7BFF);
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7C00);  // the tie above the max rounds to inf
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -25)), 0x0000);  // tie to even (0)
  EXPECT_EQ(FloatToHalfBits(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units: tie to even (2)
  EXPECT_EQ(FloatToHalfBitsClamped(1e9f), 0x7BFF);
  EXPECT_EQ(FloatToHalfBitsClamped(-INFINITY), 0xFBFF);
}

// The midpoint between two adjacent halves rounds to the one with an even code.
TEST(HalfTest, TiesRoundToEven) {
  for (uint32_t h = 0; h < 0x7BFF; ++h) {
    const double a = HalfBitsToFloat(static_cast<uint16_t>(h));
    const double b = HalfBitsToFloat(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((a + b) / 2);  // exact in fp32
    ASSERT_EQ(double(mid), (a + b) / 2);
    const uint16_t expected = (h % 2 == 0) ? h : h + 1;
    ASSERT_EQ(FloatToHalfBits(mid), expected) << std::hex << h;
    ASSERT_EQ(FloatToHalfBits(-mid), expected | 0x8000) << std::hex << h;
  }
}

TEST(BFloat16Test, RoundTripAndRounding) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = BFloat16BitsToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBFloat16Bits(f), b);
  }
  EXPECT_EQ(FloatToBFloat16Bits(std::bit_cast<float>(0x3F808000u)), 0x3F80);  // tie to even
  EXPECT_EQ(FloatToBFloat16Bits(std::bit_cast<float>(0x3F818000u)), 0x3F82);
  EXPECT_EQ(FloatToBFloat16Bits(std::bit_cast<float>(0x3F808001u)), 0x3F81);
}

TEST(E4M3Test, AllCodesDecodeAndReencode) {
  int nan_codes = 0;
  for (int code = 0; code < 256; ++code) {
    const float f = E4M3ToFloat(static_cast<uint8_t>(code));
    if ((code & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_EQ(FloatToE4M3(f), 0x7F);
      ++nan_codes;
      continue;
    }
    ASSERT_FALSE(std::isnan(f));
    ASSERT_EQ(FloatToE4M3(f), code) << code << " = " << f;
  }
  EXPECT_EQ(nan_codes, 2);
  EXPECT_EQ(E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0xFE), -448.0f);
  EXPECT_EQ(E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(E4M3ToFloat(0x80), 0.0f);
  EXPECT_TRUE(std::signbit(E4M3ToFloat(0x80)));
}

TEST(E4M3Test, SaturatesAndHandlesSpecials) {
  EXPECT_EQ(FloatToE4M3(448.0f), 0x7E);
  EXPECT_EQ(FloatToE4M3(464.0f), 0x7E);
  EXPECT_EQ(FloatToE4M3(1e30f), 0x7E);
  EXPECT_EQ(FloatToE4M3(INFINITY), 0x7E);
  EXPECT_EQ(FloatToE4M3(-INFINITY), 0xFE);
  EXPECT_EQ(FloatToE4M3(std::nanf("")), 0x7F);
  EXPECT_EQ(FloatToE4M3(0.0f), 0x00);
  EXPECT_EQ(FloatToE4M3(-0.0f), 0x80);
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.0f, -11)), 0x00);  // below half the smallest subnormal
}

TEST(E4M3Test, TiesRoundToEvenCode) {
  // Between each pair of adjacent finite positive codes, the exact midpoint goes to the even code.
  for (int code = 0; code < 0x7E; ++code) {
    const double a = E4M3ToFloat(static_cast<uint8_t>(code));
    const double b = E4M3ToFloat(static_cast<uint8_t>(code + 1));
    const float mid = static_cast<float>((a + b) / 2);
    ASSERT_EQ(double(mid), (a + b) / 2);
    const int expected = (code % 2 == 0) ? code : code + 1;
    ASSERT_EQ(FloatToE4M3(mid), expected) << code;
    ASSERT_EQ(FloatToE4M3(-mid), expected | 0x80) << code;
    // Just off the midpoint goes to the nearer side.
    ASSERT_EQ(FloatToE4M3(std::nextafter(mid, 0.0f)), code);
    ASSERT_EQ(FloatToE4M3(std::nextafter(mid, 1000.0f)), code + 1);
  }
}

// Random inputs: the encoding is the nearest code (ties even) found by brute force.
TEST(E4M3Test, MatchesBruteForceNearest) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> log_mag(-12.0f, 9.5f);
  for (int n = 0; n < 200000; ++n) {
    const float x = std::exp2(log_mag(rng)) * ((rng() & 1) ? -1.0f : 1.0f);
    int best = -1;
    double best_err = 1e300;
    for (int code = 0; code < 256; ++code) {
      if ((code & 0x7F) == 0x7F) continue;
      const double err = std::abs(double(E4M3ToFloat(static_cast<uint8_t>(code))) - x);
      const bool same_sign = ((code & 0x80) != 0) == std::signbit(x);
      if (err < best_err || (err == best_err && same_sign && (code & 1) == 0)) {
        best = code;
        best_err = err;
      }
    }
    const uint8_t got = FloatToE4M3(x);
    ASSERT_EQ(std::abs(double(E4M3ToFloat(got)) - x), best_err) << x;
    if (std::abs(x) < 448.0f) {
      ASSERT_EQ(E4M3ToFloat(got), E4M3ToFloat(static_cast<uint8_t>(best))) << x;
    }
  }
}

}  // namespace
}  // namespace tqkv
