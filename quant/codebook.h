// Lloyd-Max codebook for the coordinates of a rotated unit vector, ~ N(0, 1/D)
// (TURBOQUANT.md, "Codebook").
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tqkv {

struct Codebook {
  int bits = 0;
  std::vector<float> centroids;  // [2^bits], strictly increasing
  std::vector<float> midpoints;  // [2^bits - 1], (c[j] + c[j+1]) / 2 computed in fp32

  int size() const { return static_cast<int>(centroids.size()); }
  // Index of y: the number of midpoints m_j with m_j <= y (upper bound; ties go up; NaN -> 0).
  int Bucketize(float y) const;
};

// The codebook TURBOQUANT.md specifies for (head_dim, bits), computed (never hard-coded).
// bits in {2, 3, 4}; head_dim >= 1. Throws tqkv::Error for other values.
Codebook LloydMaxGaussian(int head_dim, int bits);

// A caller-supplied table (e.g. vLLM's exact centroids), used unchanged: 2^bits finite,
// strictly increasing values. Midpoints are computed in fp32 as for the built-in tables.
Codebook CodebookFromCentroids(std::span<const float> centroids, int bits);

// Checks a Codebook passed in by a caller, who may have filled its fields by hand: `bits`, 2^bits
// finite, strictly increasing centroids and the midpoints computed from them as above. Throws
// tqkv::Error naming the field, prefixed with `where`.
void ValidateCodebook(const Codebook& codebook, int bits, const char* where);

}  // namespace tqkv
