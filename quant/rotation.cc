#include "quant/rotation.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <cmath>
#include <numbers>
#include <random>

#include "runtime/error.h"

namespace tqkv {
namespace {

bool IsPowerOfTwo(int n) { return n > 0 && (n & (n - 1)) == 0; }

uint64_t MatrixId(int head_dim, std::span<const float> matrix) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  XXH3_64bits_update(state, &head_dim, sizeof(head_dim));
  XXH3_64bits_update(state, matrix.data(), matrix.size() * sizeof(float));
  const uint64_t id = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return id;
}

// Sylvester Hadamard entry H[i][j] = (-1)^popcount(i & j).
double HadamardEntry(int i, int j) { return (__builtin_popcount(i & j) & 1) ? -1.0 : 1.0; }

std::vector<float> HaarMatrix(int d, uint64_t seed) {
  std::mt19937_64 gen(seed);
  auto uniform = [&] { return static_cast<double>(gen() >> 11) * 0x1.0p-53; };
  std::vector<double> a(static_cast<size_t>(d) * d);  // row-major A
  for (auto& x : a) {
    double u1 = uniform();
    const double u2 = uniform();
    if (u1 == 0.0) u1 = 0x1.0p-53;
    x = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }
  // Modified Gram-Schmidt on the columns of A (twice, for orthogonality to fp64 rounding):
  // A = Q R with diag(R) > 0 by construction.
  std::vector<double> q = a;
  auto col = [&](std::vector<double>& m, int r, int c) -> double& { return m[size_t(r) * d + c]; };
  for (int j = 0; j < d; ++j) {
    for (int pass = 0; pass < 2; ++pass) {
      for (int k = 0; k < j; ++k) {
        double dot = 0.0;
        for (int r = 0; r < d; ++r) dot += col(q, r, k) * col(q, r, j);
        for (int r = 0; r < d; ++r) col(q, r, j) -= dot * col(q, r, k);
      }
    }
    double norm = 0.0;
    for (int r = 0; r < d; ++r) norm += col(q, r, j) * col(q, r, j);
    norm = std::sqrt(norm);
    for (int r = 0; r < d; ++r) col(q, r, j) /= norm;
  }
  std::vector<float> out(q.size());
  for (size_t i = 0; i < q.size(); ++i) out[i] = static_cast<float>(q[i]);
  return out;
}

}  // namespace

std::string_view RotationKindName(RotationKind kind) {
  switch (kind) {
    case RotationKind::kHadamard:
      return "hadamard";
    case RotationKind::kHadamardSigns:
      return "hadamard_signs";
    case RotationKind::kHaar:
      return "haar";
    case RotationKind::kCustom:
      return "custom";
  }
  return "?";
}

RotationKind ParseRotationKind(std::string_view name) {
  for (RotationKind k :
       {RotationKind::kHadamard, RotationKind::kHadamardSigns, RotationKind::kHaar}) {
    if (RotationKindName(k) == name) return k;
  }
  throw InvalidArgument("ParseRotationKind", "rotation", fmt::format("\"{}\"", name),
                        "hadamard, hadamard_signs, haar");
}

Rotation MakeRotation(RotationKind kind, int head_dim, uint64_t seed) {
  if (head_dim < 1) throw InvalidArgument("MakeRotation", "head_dim", head_dim, ">= 1");
  Rotation r;
  r.kind = kind;
  r.seed = seed;
  r.head_dim = head_dim;
  const int d = head_dim;
  r.matrix.resize(static_cast<size_t>(d) * d);
  switch (kind) {
    case RotationKind::kHadamard:
    case RotationKind::kHadamardSigns: {
      if (!IsPowerOfTwo(d)) {
        throw InvalidArgument(
            "MakeRotation", "head_dim", d,
            fmt::format("a power of two for rotation {}", RotationKindName(kind)));
      }
      std::vector<double> s(d, 1.0);
      if (kind == RotationKind::kHadamardSigns) {
        std::mt19937_64 gen(seed);
        for (auto& x : s) x = (gen() >> 63) ? -1.0 : 1.0;
        r.signs.assign(s.begin(), s.end());
      }
      const double inv_sqrt = 1.0 / std::sqrt(static_cast<double>(d));
      for (int i = 0; i < d; ++i) {
        for (int j = 0; j < d; ++j) {
          r.matrix[size_t(i) * d + j] = static_cast<float>(s[i] * HadamardEntry(i, j) * inv_sqrt);
        }
      }
      break;
    }
    case RotationKind::kHaar:
      r.matrix = HaarMatrix(d, seed);
      break;
    case RotationKind::kCustom:
      throw InvalidArgument("MakeRotation", "kind", "custom",
                            "hadamard, hadamard_signs, haar (use RotationFromMatrix for custom)");
  }
  r.id = MatrixId(d, r.matrix);
  return r;
}

namespace {
constexpr double kMaxOrthogonalityError = 1e-3;
}  // namespace

double OrthogonalityError(std::span<const float> m, int d) {
  double worst = 0.0;
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      double dot = 0.0;  // (Πᵀ Π)[i][j] = Σ_k Πᵀ[i][k] Πᵀ[j][k]
      for (int k = 0; k < d; ++k) dot += double(m[size_t(i) * d + k]) * m[size_t(j) * d + k];
      worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  return worst;
}

void ValidateRotation(const Rotation& r, int head_dim, const char* where) {
  const int d = head_dim;
  if (r.head_dim != d || r.matrix.size() != static_cast<size_t>(d) * d) {
    throw InvalidArgument(where, "rotation.head_dim", r.head_dim,
                          fmt::format("{} (the head_dim), with a [{}, {}] matrix", d, d, d));
  }
  for (size_t i = 0; i < r.matrix.size(); ++i) {
    if (!std::isfinite(r.matrix[i])) {
      throw InvalidArgument(where, fmt::format("rotation.matrix[{}]", i), r.matrix[i],
                            "finite values");
    }
  }
  if (r.id != MatrixId(d, r.matrix)) {
    throw InvalidArgument(
        where, "rotation.id", r.id,
        fmt::format("{} (the matrix's; build rotations with MakeRotation or RotationFromMatrix)",
                    MatrixId(d, r.matrix)));
  }
  const bool hadamard = r.kind == RotationKind::kHadamard;
  const bool with_signs = r.kind == RotationKind::kHadamardSigns;
  const size_t signs = with_signs ? static_cast<size_t>(d) : 0;
  if (r.signs.size() != signs) {
    throw InvalidArgument(where, "rotation.signs.size()", r.signs.size(),
                          fmt::format("{} for rotation {}", signs, RotationKindName(r.kind)));
  }
  if (!hadamard && !with_signs) {
    // A Haar or custom matrix with its id recomputed by hand (RotationMatrixId is public) could be
    // anything: the same bound as RotationFromMatrix's (D³ multiply-adds, once per Quantizer).
    const double err = OrthogonalityError(r.matrix, d);
    if (!(err <= kMaxOrthogonalityError)) {
      throw InvalidArgument(
          where, "rotation: max |Πᵀ·Π − I|", err,
          fmt::format("<= {} (the rotation must be orthogonal)", kMaxOrthogonalityError));
    }
    return;
  }
  if (!IsPowerOfTwo(d)) {
    throw InvalidArgument(where, "head_dim", d,
                          fmt::format("a power of two for rotation {}", RotationKindName(r.kind)));
  }
  const double inv_sqrt = 1.0 / std::sqrt(static_cast<double>(d));
  for (int i = 0; i < d; ++i) {
    const double s = with_signs ? r.signs[static_cast<size_t>(i)] : 1.0;
    if (s != 1.0 && s != -1.0) {
      throw InvalidArgument(where, fmt::format("rotation.signs[{}]", i), s, "1 or -1");
    }
    for (int j = 0; j < d; ++j) {
      if (r.matrix[size_t(i) * d + j] != static_cast<float>(s * HadamardEntry(i, j) * inv_sqrt)) {
        throw InvalidArgument(
            where, "rotation.kind", RotationKindName(r.kind),
            fmt::format("the kind of its matrix (entry [{}, {}] is not that of {})", i, j,
                        RotationKindName(r.kind)));
      }
    }
  }
}

uint64_t RotationMatrixId(int head_dim, std::span<const float> matrix) {
  return MatrixId(head_dim, matrix);
}

Rotation RotationFromMatrix(std::span<const float> matrix, int head_dim) {
  if (head_dim < 1) throw InvalidArgument("RotationFromMatrix", "head_dim", head_dim, ">= 1");
  const size_t n = static_cast<size_t>(head_dim) * head_dim;
  if (matrix.size() != n) {
    throw InvalidArgument("RotationFromMatrix", "matrix.size()", matrix.size(),
                          fmt::format("{} ([{}, {}])", n, head_dim, head_dim));
  }
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(matrix[i])) {
      throw InvalidArgument("RotationFromMatrix", fmt::format("matrix[{}]", i), matrix[i],
                            "finite values");
    }
  }
  const double err = OrthogonalityError(matrix, head_dim);
  if (err > kMaxOrthogonalityError) {
    throw InvalidArgument("RotationFromMatrix", "max |Πᵀ·Π − I|", err,
                          "<= 1e-3 (the rotation must be orthogonal)");
  }
  Rotation r;
  r.kind = RotationKind::kCustom;
  r.head_dim = head_dim;
  r.matrix.assign(matrix.begin(), matrix.end());
  r.id = MatrixId(head_dim, r.matrix);
  return r;
}

}  // namespace tqkv
