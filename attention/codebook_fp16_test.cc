#include "attention/codebook_fp16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "attention/decode_cpu.h"
#include "quant/codebook.h"
#include "quant/numerics.h"
#include "runtime/error.h"
#include "tests/decode_scenario.h"

namespace tqkv {
namespace {

// The 3-bit Lloyd-Max tables scale to within kMaxHiOnlyError of fp16 (about ten times closer than
// unscaled), so their decode kernels may use the hi parts alone; the 4-bit tables do not.
TEST(CodebookFp16Test, ThreeBitTablesQualifyForHiOnlyFourBitTablesDoNot) {
  for (int d : {64, 96, 128, 192, 256}) {
    const Codebook c3 = LloydMaxGaussian(d, 3);
    const Fp16Codebook s3 = ScaleCodebookForFp16(c3.centroids);
    const Fp16Codebook unscaled = ScaleCodebookForFp16(c3.centroids, /*search=*/false);
    EXPECT_EQ(unscaled.scale, 1.0f);
    EXPECT_GE(s3.scale, 1.0f);
    EXPECT_LT(s3.scale, 2.0f);
    EXPECT_LE(s3.max_rel_error, kMaxHiOnlyError) << "D=" << d;
    EXPECT_LT(s3.max_rel_error, unscaled.max_rel_error / 5) << "D=" << d;
    const Fp16Codebook s4 = ScaleCodebookForFp16(LloydMaxGaussian(d, 4).centroids);
    EXPECT_GT(s4.max_rel_error, kMaxHiOnlyError) << "D=" << d;
  }
}

// Eight distinct magnitudes (every other 4-bit centroid, as a 3-bit table: the CUDA test's
// unscalable codebook) do not scale that closely.
TEST(CodebookFp16Test, AnAsymmetricThreeBitTableDoesNotQualify) {
  const std::vector<float> c4 = LloydMaxGaussian(128, 4).centroids;
  const std::vector<float> odd = {c4[0], c4[2], c4[4], c4[6], c4[8], c4[10], c4[12], c4[14]};
  EXPECT_GT(ScaleCodebookForFp16(odd).max_rel_error, kMaxHiOnlyError);
}

// hi + lo reproduce α·c to ~2^-22 relative (held to 2^-20: a small centroid's lo part is an fp16
// subnormal), and max_rel_error is the hi parts' true error.
TEST(CodebookFp16Test, PartsReproduceTheScaledCentroids) {
  for (int bits : {2, 3, 4}) {
    const Codebook c = LloydMaxGaussian(128, bits);
    const Fp16Codebook s = ScaleCodebookForFp16(c.centroids);
    ASSERT_EQ(s.hi.size(), c.centroids.size());
    ASSERT_EQ(s.lo.size(), c.centroids.size());
    double worst_hi = 0;
    for (size_t j = 0; j < c.centroids.size(); ++j) {
      const double x = double(s.scale) * double(c.centroids[j]);
      const double hi = HalfBitsToFloat(s.hi[j]), lo = HalfBitsToFloat(s.lo[j]);
      EXPECT_LE(std::abs(hi + lo - x), std::abs(x) * 0x1.0p-20) << bits << " bits, centroid " << j;
      worst_hi = std::max(worst_hi, std::abs(hi - x) / std::abs(x));
    }
    EXPECT_NEAR(worst_hi, s.max_rel_error, 1e-3 * s.max_rel_error + 1e-12);
  }
}

TEST(CodebookFp16Test, RejectsEmptyAndOversizedTables) {
  EXPECT_THROW(ScaleCodebookForFp16(std::vector<float>{}), Error);
  EXPECT_THROW(ScaleCodebookForFp16(std::vector<float>(17, 0.5f)), Error);
  // A zero centroid is exact; it does not make the error undefined.
  const Fp16Codebook z = ScaleCodebookForFp16(std::vector<float>{-0.5f, 0.0f, 0.25f});
  EXPECT_TRUE(std::isfinite(z.max_rel_error));
}

// Worst output error (relative to the row's largest |element|) and LSE error (relative, at least
// 1 in the denominator) of the CPU decode over `centroids` against the decode over q's codebook,
// on the CUDA decode tests' data.
std::pair<double, double> EmulatedErrors(const Quantizer& q, const std::vector<float>& centroids,
                                         int group, uint64_t seed) {
  const BlockFormat& f = q.format();
  const Quantizer qe(q.preset(), f.head_dim, f.num_kv_heads, f.block_size, q.rotation(),
                     CodebookFromCentroids(centroids, q.codebook().bits));
  const testing::Scenario sc =
      testing::Build(q, {1, 15, 16, 17, 100, 4097}, f.num_kv_heads * group, seed);
  const DecodeInputs in = testing::ReferenceInputs(sc);
  std::vector<float> o1(sc.queries.size()), o2(o1.size());
  std::vector<float> l1(static_cast<size_t>(in.num_seqs) * in.num_q_heads), l2(l1.size());
  DecodeCpu(q, {sc.cache.data(), sc.num_blocks, q.layout()}, in, {o1.data(), l1.data()});
  DecodeCpu(qe, {sc.cache.data(), sc.num_blocks, qe.layout()}, in, {o2.data(), l2.data()});
  const int d = f.head_dim;
  double worst_out = 0, worst_lse = 0;
  for (size_t r = 0; r < l1.size(); ++r) {
    worst_lse = std::max(worst_lse,
                         std::abs(double(l1[r]) - l2[r]) / std::max(1.0, std::abs(double(l1[r]))));
    double scale = 1e-30, w = 0;
    for (int i = 0; i < d; ++i) scale = std::max(scale, std::abs(double(o1[r * d + i])));
    for (int i = 0; i < d; ++i) w = std::max(w, std::abs(double(o1[r * d + i]) - o2[r * d + i]));
    worst_out = std::max(worst_out, w / scale);
  }
  return {worst_out, worst_lse};
}

// The decode with the hi parts alone, emulated on the CPU (the reference decode over a codebook
// of fp16(α·c)/α), stays within the decode's tolerance (output 1e-3 of the row's largest
// element, LSE 1e-4 relative) of the exact decode; with α = 1 (plain fp16 centroids) the LSE
// misses it.
TEST(CodebookFp16Test, HiOnlyScoresStayWithinTheDecodeTolerance) {
  double unscaled_lse = 0;
  for (int d : {64, 128, 256}) {
    for (int group : {1, 4, 8}) {
      const Quantizer q = Quantizer::Create("turboquant_k3v4_nc", d, 2, 16);
      for (bool search : {true, false}) {
        const Fp16Codebook s = ScaleCodebookForFp16(q.codebook().centroids, search);
        std::vector<float> emulated;
        for (uint16_t h : s.hi) emulated.push_back(HalfBitsToFloat(h) / s.scale);
        const auto [out, lse] = EmulatedErrors(q, emulated, group, 900 + d + group);
        if (search) {
          EXPECT_LE(out, 1e-3) << "D=" << d << " group=" << group;
          EXPECT_LE(lse, 1e-4) << "D=" << d << " group=" << group;
          EXPECT_GT(lse, 0.0) << "the emulation changed nothing";
        } else {
          unscaled_lse = std::max(unscaled_lse, lse);
        }
      }
    }
  }
  EXPECT_GT(unscaled_lse, 1e-4);
}

}  // namespace
}  // namespace tqkv
