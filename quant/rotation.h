// Rotations Πᵀ ([D, D] fp32, row-major, orthogonal) applied as y = x · Πᵀ to unit keys and to
// queries (TURBOQUANT.md, "Rotations").
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tqkv {

enum class RotationKind {
  kHadamard,       // Sylvester H_D / √D (symmetric); D a power of two
  kHadamardSigns,  // diag(s) · H_D / √D, s ∈ {±1}^D from the seed
  kHaar,           // Q of the QR of a seeded standard-normal D×D matrix, diag(R) > 0; any D
  kCustom,         // supplied by the caller, used unchanged
};

std::string_view RotationKindName(
    RotationKind kind);  // "hadamard", "hadamard_signs", "haar", "custom"
// Parses "hadamard", "hadamard_signs", "haar"; anything else throws tqkv::Error listing them.
RotationKind ParseRotationKind(std::string_view name);

struct Rotation {
  RotationKind kind = RotationKind::kHadamard;
  uint64_t seed = 0;
  int head_dim = 0;
  std::vector<float>
      matrix;       // Πᵀ [head_dim, head_dim] row-major: y[j] = Σ_i x[i] · matrix[i*D + j]
  uint64_t id = 0;  // XXH3-64 of (head_dim, matrix bytes): identifies it in cache tags

  // The random signs of kHadamardSigns ([D] of ±1), empty for other kinds. A fused kernel that
  // applies the Walsh-Hadamard transform in place of the GEMM needs them.
  std::vector<float> signs;
};

// Builds a rotation. Throws tqkv::Error for kCustom (use RotationFromMatrix), for Hadamard kinds
// with a head_dim that is not a power of two, and for head_dim < 1.
//
// Seeded generators are specified so that every platform builds the same matrix: std::mt19937_64
// seeded with `seed`; a sign is -1 when the top bit of the next 64-bit draw is set; a standard
// normal is Box-Muller on two uniforms u = (draw >> 11) · 2^-53 (u1 replaced by 2^-53 if 0),
// z = sqrt(-2 ln u1) · cos(2π u2), filled row by row.
Rotation MakeRotation(RotationKind kind, int head_dim, uint64_t seed);

// Rotation::id of a matrix: XXH3-64 of (head_dim, the matrix's bytes).
uint64_t RotationMatrixId(int head_dim, std::span<const float> matrix);

// A caller-supplied Πᵀ ([head_dim, head_dim] row-major), used unchanged. Must be finite and
// orthogonal to 1e-3 (max |Πᵀ·Π − I|), else tqkv::Error.
Rotation RotationFromMatrix(std::span<const float> matrix, int head_dim);

// Checks a Rotation passed in by a caller, who may have filled or changed its fields by hand: the
// shape, finite entries, `id` equal to the matrix's, and for the Hadamard kinds the matrix the
// kind and signs describe (the CUDA kernels apply those in place of the matrix), for the other
// kinds orthogonality to 1e-3 (the id can be recomputed by hand, RotationMatrixId).
// Throws tqkv::Error naming the field, prefixed with `where`.
void ValidateRotation(const Rotation& rotation, int head_dim, const char* where);

// Largest |(Πᵀ · Π)[i][j] − δij|, in double.
double OrthogonalityError(std::span<const float> matrix, int head_dim);

}  // namespace tqkv
