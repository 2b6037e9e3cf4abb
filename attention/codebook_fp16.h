// The key codebook as the decode kernels' fp16 tensor-core operands read it.
//
// A centroid c rounded to fp16 is off by up to 2^-12 relative, which moves scores (and so the
// LSE) by ~1e-4 relative: more than the decode's tolerance. The kernels therefore either carry
// each centroid as fp16 hi + lo parts (c ≈ hi + lo to ~2^-22; one more score MMA per token pair)
// or, where one scale α puts every α·c within kMaxHiOnlyError of an fp16 value, the scaled fp16
// hi parts alone (scores then come out α times too large, which the softmax scale undoes).
// ScaleCodebookForFp16 finds that α. For the 3-bit Lloyd-Max tables the best α leaves ~2.5e-5
// (ten times less than α = 1); for 4-bit tables ~7.3e-5, above kMaxHiOnlyError.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tqkv {

struct Fp16Codebook {
  float scale = 1.0f;          // α
  double max_rel_error = 0.0;  // max over centroids of |hi − α·c| / |α·c| (α·c exact)
  std::vector<uint16_t> hi, lo;  // fp16 bits of α·c and of α·c − hi (hi + lo ≈ α·c to ~2^-22)
};

// Largest max_rel_error for which the decode uses the hi parts alone (see above): keeps the
// LSE's relative error below ~5e-5 on the decode tests' data (attention/codebook_fp16_test.cc).
inline constexpr double kMaxHiOnlyError = 4e-5;

// α in [1, 2) minimizing max_rel_error (a grid of 2^16 steps, then a finer one around the best),
// with the fp16 hi and lo parts of α·c (the hi + lo kernels read both, so one table serves both).
// 1 to 16 finite centroids (a zero is exact; values whose α·c leave fp16's normal range give a
// large max_rel_error, so such a table takes the hi + lo path). Throws tqkv::Error otherwise.
// search = false: α = 1 (the parts of c itself).
Fp16Codebook ScaleCodebookForFp16(std::span<const float> centroids, bool search = true);

}  // namespace tqkv
