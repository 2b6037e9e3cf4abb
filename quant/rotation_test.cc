#include "quant/rotation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "runtime/error.h"

namespace tqkv {
namespace {

using ::testing::HasSubstr;

TEST(RotationTest, AllKindsAreOrthogonal) {
  for (int d : {64, 128, 256}) {
    for (RotationKind k :
         {RotationKind::kHadamard, RotationKind::kHadamardSigns, RotationKind::kHaar}) {
      const Rotation r = MakeRotation(k, d, 42);
      ASSERT_EQ(r.matrix.size(), size_t(d) * d);
      EXPECT_LE(OrthogonalityError(r.matrix, d), 1e-5) << RotationKindName(k) << " D=" << d;
    }
  }
  // Haar takes any D.
  EXPECT_LE(OrthogonalityError(MakeRotation(RotationKind::kHaar, 96, 1).matrix, 96), 1e-5);
}

TEST(RotationTest, HadamardIsSymmetricSylvester) {
  const int d = 128;
  const Rotation r = MakeRotation(RotationKind::kHadamard, d, 0);
  const float s = 1.0f / std::sqrt(128.0f);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      ASSERT_EQ(r.matrix[i * d + j], r.matrix[j * d + i]);
      ASSERT_NEAR(std::abs(r.matrix[i * d + j]), s, 1e-7);
    }
  }
  // H_2n = [[H_n, H_n], [H_n, -H_n]]: the bottom-right quadrant is minus the top-left.
  for (int i = 0; i < d / 2; ++i) {
    for (int j = 0; j < d / 2; ++j) {
      ASSERT_EQ(r.matrix[(i + 64) * d + j + 64], -r.matrix[i * d + j]);
      ASSERT_EQ(r.matrix[(i + 64) * d + j], r.matrix[i * d + j]);
    }
  }
  EXPECT_GT(r.matrix[0], 0.0f);
}

TEST(RotationTest, HadamardSignsIsDiagSTimesHadamard) {
  const int d = 64;
  const Rotation h = MakeRotation(RotationKind::kHadamard, d, 0);
  const Rotation hs = MakeRotation(RotationKind::kHadamardSigns, d, 5);
  ASSERT_EQ(hs.signs.size(), size_t(d));
  int negative = 0;
  for (int i = 0; i < d; ++i) {
    ASSERT_TRUE(hs.signs[i] == 1.0f || hs.signs[i] == -1.0f);
    negative += hs.signs[i] < 0;
    for (int j = 0; j < d; ++j) ASSERT_EQ(hs.matrix[i * d + j], hs.signs[i] * h.matrix[i * d + j]);
  }
  EXPECT_GT(negative, 10);
  EXPECT_LT(negative, 54);
}

TEST(RotationTest, SeededKindsAreDeterministicPerSeed) {
  for (RotationKind k : {RotationKind::kHadamardSigns, RotationKind::kHaar}) {
    const Rotation a = MakeRotation(k, 128, 9);
    const Rotation b = MakeRotation(k, 128, 9);
    const Rotation c = MakeRotation(k, 128, 10);
    EXPECT_EQ(a.matrix, b.matrix);
    EXPECT_EQ(a.id, b.id);
    EXPECT_NE(a.matrix, c.matrix);
    EXPECT_NE(a.id, c.id);
  }
  EXPECT_NE(MakeRotation(RotationKind::kHadamard, 128, 0).id,
            MakeRotation(RotationKind::kHaar, 128, 0).id);
}

TEST(RotationTest, HadamardNeedsPowerOfTwo) {
  try {
    MakeRotation(RotationKind::kHadamard, 96, 0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("head_dim = 96"));
    EXPECT_THAT(e.what(), HasSubstr("power of two"));
  }
  EXPECT_THROW(MakeRotation(RotationKind::kHadamardSigns, 100, 0), Error);
  EXPECT_THROW(MakeRotation(RotationKind::kCustom, 64, 0), Error);
}

TEST(RotationTest, ParsesNames) {
  EXPECT_EQ(ParseRotationKind("hadamard"), RotationKind::kHadamard);
  EXPECT_EQ(ParseRotationKind("hadamard_signs"), RotationKind::kHadamardSigns);
  EXPECT_EQ(ParseRotationKind("haar"), RotationKind::kHaar);
  try {
    ParseRotationKind("dct");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("\"dct\""));
    EXPECT_THAT(e.what(), HasSubstr("hadamard, hadamard_signs, haar"));
  }
}

TEST(RotationTest, CustomMatrixUsedUnchangedAndChecked) {
  const Rotation haar = MakeRotation(RotationKind::kHaar, 64, 3);
  const Rotation custom = RotationFromMatrix(haar.matrix, 64);
  EXPECT_EQ(custom.kind, RotationKind::kCustom);
  EXPECT_EQ(custom.matrix, haar.matrix);
  EXPECT_EQ(custom.id, haar.id);  // same matrix, same cache identity

  std::vector<float> skewed = haar.matrix;
  skewed[5] += 0.1f;
  try {
    RotationFromMatrix(skewed, 64);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("orthogonal"));
  }
  EXPECT_THROW(RotationFromMatrix(std::vector<float>(63 * 64, 0.0f), 64), Error);
  std::vector<float> nan = haar.matrix;
  nan[7] = NAN;
  EXPECT_THROW(RotationFromMatrix(nan, 64), Error);
}

}  // namespace
}  // namespace tqkv
