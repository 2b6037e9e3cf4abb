#include "quant/codebook.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "quant/rotation.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

using ::testing::HasSubstr;

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }

// TURBOQUANT.md's test vectors, D = 128, bit for bit.
TEST(CodebookTest, MatchesTestVectorsBitForBit) {
  const Codebook b2 = LloydMaxGaussian(128, 2);
  ASSERT_EQ(b2.size(), 4);
  EXPECT_EQ(Bits(b2.centroids[2]), 0x3D23D93Au);
  EXPECT_EQ(Bits(b2.centroids[3]), 0x3E08A131u);
  EXPECT_EQ(Bits(b2.centroids[1]), 0xBD23D93Au);
  EXPECT_EQ(Bits(b2.centroids[0]), 0xBE08A131u);

  const Codebook b3 = LloydMaxGaussian(128, 3);
  const uint32_t want3[] = {0x3CB16317u, 0x3D88C955u, 0x3DF3243Du, 0x3E42A09Fu};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(Bits(b3.centroids[4 + i]), want3[i]) << i;
    EXPECT_EQ(Bits(b3.centroids[3 - i]), want3[i] | 0x80000000u) << i;
  }

  const Codebook b4 = LloydMaxGaussian(128, 4);
  const float want4[] = {0.011351509f, 0.0343068577f, 0.0580605306f, 0.0833014399f,
                         0.111038528f, 0.143001899f,  0.182826623f,  0.241381705f};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(Bits(b4.centroids[8 + i]), Bits(want4[i])) << i;
  EXPECT_EQ(Bits(b4.centroids[8]), 0x3C39FBAEu);
  EXPECT_EQ(Bits(b4.centroids[15]), 0x3E772CC4u);
}

TEST(CodebookTest, SymmetricSortedWithFp32Midpoints) {
  for (int d : {64, 128, 256}) {
    for (int bits : {2, 3, 4}) {
      const Codebook b = LloydMaxGaussian(d, bits);
      const int n = 1 << bits;
      ASSERT_EQ(b.size(), n);
      ASSERT_EQ(b.midpoints.size(), size_t(n - 1));
      for (int i = 0; i < n; ++i) {
        EXPECT_EQ(b.centroids[i], -b.centroids[n - 1 - i]) << d << " " << bits << " " << i;
        if (i > 0) {
          EXPECT_LT(b.centroids[i - 1], b.centroids[i]);
        }
      }
      for (int j = 0; j + 1 < n; ++j) {
        EXPECT_EQ(b.midpoints[j], (b.centroids[j] + b.centroids[j + 1]) / 2.0f);
      }
    }
  }
}

// Scaled by √D the tables are the classic Max quantizer for N(0, 1).
TEST(CodebookTest, ScaledTableIsTheMaxQuantizer) {
  const Codebook b = LloydMaxGaussian(256, 2);
  EXPECT_NEAR(b.centroids[3] * 16.0, 1.510, 2e-3);
  EXPECT_NEAR(b.centroids[2] * 16.0, 0.4528, 1e-3);
}

TEST(CodebookTest, BucketizeIsUpperBoundWithTiesUpAndNanZero) {
  const Codebook b = LloydMaxGaussian(128, 2);
  EXPECT_EQ(b.Bucketize(-1.0f), 0);
  EXPECT_EQ(b.Bucketize(b.midpoints[0]), 1);  // tie goes up
  EXPECT_EQ(b.Bucketize(std::nextafter(b.midpoints[0], -1.0f)), 0);
  EXPECT_EQ(b.Bucketize(0.0f), 2);  // midpoints[1] == 0 exactly
  EXPECT_EQ(b.Bucketize(-0.0f), 2);
  EXPECT_EQ(b.Bucketize(1.0f), 3);
  EXPECT_EQ(b.Bucketize(std::nanf("")), 0);
  EXPECT_EQ(b.Bucketize(INFINITY), 3);
  EXPECT_EQ(b.Bucketize(-INFINITY), 0);
}

// Normalized MSE E||y − ĉ||² of random unit vectors after a rotation: ≈ 0.117 / 0.034 / 0.0095.
TEST(CodebookTest, MseOnRotatedUnitVectors) {
  const int d = 128;
  const Rotation rot = MakeRotation(RotationKind::kHaar, d, 7);
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<double> normal;
  const double expected[] = {0.117, 0.034, 0.0095};
  for (int bits : {2, 3, 4}) {
    const Codebook b = LloydMaxGaussian(d, bits);
    double total = 0.0;
    const int trials = 4000;
    std::vector<double> x(d);
    for (int n = 0; n < trials; ++n) {
      double norm = 0.0;
      for (auto& v : x) {
        v = normal(rng);
        norm += v * v;
      }
      norm = std::sqrt(norm);
      for (int j = 0; j < d; ++j) {
        double y = 0.0;
        for (int i = 0; i < d; ++i) y += x[i] / norm * rot.matrix[i * d + j];
        const double err = y - b.centroids[b.Bucketize(static_cast<float>(y))];
        total += err * err;
      }
    }
    const double mse = total / trials;
    EXPECT_NEAR(mse, expected[bits - 2], 0.05 * expected[bits - 2]) << bits << " bits";
  }
}

TEST(CodebookTest, CallerSuppliedCentroidsAreUsedUnchanged) {
  const std::vector<float> c = {-0.3f, -0.05f, 0.02f, 0.4f};
  const Codebook b = CodebookFromCentroids(c, 2);
  EXPECT_EQ(b.centroids, c);
  EXPECT_EQ(b.midpoints[0], (-0.3f + -0.05f) / 2.0f);
  EXPECT_EQ(b.Bucketize(0.0f), 2);
}

// Centroids whose fp32 midpoints overflow or collide are refused: a centroid between equal
// midpoints, or past an infinite one, could never be chosen.
TEST(CodebookTest, RejectsCentroidsSomeValueCannotReach) {
  const float max = std::numeric_limits<float>::max();
  const std::vector<float> overflow = {-1.0f, 0.0f, 3e38f, max};
  EXPECT_THAT([&] { CodebookFromCentroids(overflow, 2); },
              ::testing::ThrowsMessage<Error>(HasSubstr("centroids[3] = 3.4028235e+38")));
  const float one = 1.0f, u = std::nextafter(one, 2.0f) - one;
  const std::vector<float> crowded = {one, one + u, one + 2 * u, one + 3 * u};
  EXPECT_THAT([&] { CodebookFromCentroids(crowded, 2); },
              ::testing::ThrowsMessage<Error>(HasSubstr("midpoints with its neighbours")));
  EXPECT_NO_THROW(CodebookFromCentroids(std::vector<float>{-1.0f, 0.0f, 1.0f, 2.0f}, 2));
}

TEST(CodebookTest, RejectsBadTables) {
  EXPECT_THROW(LloydMaxGaussian(128, 5), Error);
  EXPECT_THROW(LloydMaxGaussian(0, 3), Error);
  const std::vector<float> three = {0.1f, 0.2f, 0.3f};
  try {
    CodebookFromCentroids(three, 2);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("centroids.size() = 3"));
  }
  const std::vector<float> unsorted = {0.1f, -0.2f, 0.3f, 0.4f};
  try {
    CodebookFromCentroids(unsorted, 2);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("centroids[1] = -0.2"));
  }
  const std::vector<float> nan = {0.1f, 0.2f, NAN, 0.4f};
  EXPECT_THROW(CodebookFromCentroids(nan, 2), Error);
}

}  // namespace
}  // namespace tqkv
