#include "quant/codebook.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string_view>

#include "runtime/error.h"

namespace tqkv {
namespace {

// ∫ g(x) dx over [lo, hi] by the trapezoid rule on `kSteps` equal sub-intervals.
template <typename G>
double Trapezoid(double lo, double hi, G g) {
  constexpr int kSteps = 200;
  const double h = (hi - lo) / kSteps;
  double sum = 0.0;
  double prev = g(lo);
  for (int i = 1; i <= kSteps; ++i) {
    const double x = (i == kSteps) ? hi : lo + h * i;
    const double cur = g(x);
    sum += (prev + cur) * 0.5 * h;
    prev = cur;
  }
  return sum;
}

std::vector<float> Midpoints(const std::vector<float>& c) {
  std::vector<float> m(c.size() - 1);
  for (size_t j = 0; j + 1 < c.size(); ++j) m[j] = (c[j] + c[j + 1]) / 2.0f;  // fp32
  return m;
}

}  // namespace

int Codebook::Bucketize(float y) const {
  // upper_bound: first midpoint > y; NaN compares false with everything -> index 0.
  if (std::isnan(y)) return 0;
  return static_cast<int>(std::upper_bound(midpoints.begin(), midpoints.end(), y) -
                          midpoints.begin());
}

Codebook LloydMaxGaussian(int head_dim, int bits) {
  if (bits < 2 || bits > 4) throw InvalidArgument("LloydMaxGaussian", "bits", bits, "2, 3, 4");
  if (head_dim < 1) throw InvalidArgument("LloydMaxGaussian", "head_dim", head_dim, ">= 1");
  const int n = 1 << bits;
  const double sigma = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const double norm = 1.0 / (sigma * std::sqrt(2.0 * std::numbers::pi));
  auto pdf = [&](double x) { return norm * std::exp(-x * x / (2.0 * sigma * sigma)); };

  std::vector<double> c(n);
  for (int i = 0; i < n; ++i) c[i] = -3.5 * sigma + 7.0 * sigma * (i + 0.5) / n;
  std::vector<double> edges(n + 1), next(n);
  for (int iter = 0; iter < 200; ++iter) {
    edges[0] = -10.5 * sigma;
    edges[n] = 10.5 * sigma;
    for (int i = 0; i + 1 < n; ++i) edges[i + 1] = (c[i] + c[i + 1]) / 2.0;
    double max_delta = 0.0;
    for (int i = 0; i < n; ++i) {
      const double mass = Trapezoid(edges[i], edges[i + 1], pdf);
      const double first = Trapezoid(edges[i], edges[i + 1], [&](double x) { return x * pdf(x); });
      next[i] = mass > 1e-15 ? first / mass : c[i];
      max_delta = std::max(max_delta, std::abs(next[i] - c[i]));
    }
    if (max_delta < 1e-10) break;  // keep the table from before this last update
    c = next;
  }

  Codebook book;
  book.bits = bits;
  book.centroids.resize(n);
  for (int i = 0; i < n; ++i) book.centroids[i] = static_cast<float>(c[i]);
  book.midpoints = Midpoints(book.centroids);
  return book;
}

namespace {

// `name`: how the caller calls the centroids ("centroids", "codebook.centroids").
void CheckCentroids(std::span<const float> centroids, int bits, const char* where,
                    std::string_view name) {
  if (bits < 2 || bits > 4) throw InvalidArgument(where, "bits", bits, "2, 3, 4");
  const size_t n = size_t{1} << bits;
  if (centroids.size() != n) {
    throw InvalidArgument(where, fmt::format("{}.size()", name), centroids.size(),
                          fmt::format("{} (2^{} for {}-bit keys)", n, bits, bits));
  }
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(centroids[i]) || (i > 0 && !(centroids[i] > centroids[i - 1]))) {
      throw InvalidArgument(where, fmt::format("{}[{}]", name, i), centroids[i],
                            "finite and strictly increasing");
    }
  }
  // Every centroid must be some value's nearest: the fp32 midpoints between them finite (c[i] +
  // c[i + 1] past FLT_MAX made inf) and strictly increasing (centroids a few ulps apart gave equal
  // midpoints, and the one between could never be chosen).
  const std::vector<float> mid = Midpoints(std::vector<float>(centroids.begin(), centroids.end()));
  for (size_t j = 0; j < mid.size(); ++j) {
    if (!std::isfinite(mid[j]) || (j > 0 && !(mid[j] > mid[j - 1]))) {
      throw InvalidArgument(
          where, fmt::format("{}[{}]", name, j + 1), centroids[j + 1],
          fmt::format("a value whose fp32 midpoints with its neighbours are finite and increasing "
                      "(the midpoint with {}[{}] = {} is {})",
                      name, j, centroids[j], mid[j]));
    }
  }
}

}  // namespace

Codebook CodebookFromCentroids(std::span<const float> centroids, int bits) {
  CheckCentroids(centroids, bits, "CodebookFromCentroids", "centroids");
  Codebook book;
  book.bits = bits;
  book.centroids.assign(centroids.begin(), centroids.end());
  book.midpoints = Midpoints(book.centroids);
  return book;
}

void ValidateCodebook(const Codebook& codebook, int bits, const char* where) {
  if (codebook.bits != bits) {
    throw InvalidArgument(where, "codebook.bits", codebook.bits, fmt::format("{}", bits));
  }
  CheckCentroids(codebook.centroids, bits, where, "codebook.centroids");
  // Bitwise: the CPU and CUDA stores bucketize against these exact fp32 values.
  const std::vector<float> midpoints = Midpoints(codebook.centroids);
  if (codebook.midpoints.size() != midpoints.size()) {
    throw InvalidArgument(where, "codebook.midpoints.size()", codebook.midpoints.size(),
                          fmt::format("{} (2^{} - 1)", midpoints.size(), bits));
  }
  for (size_t j = 0; j < midpoints.size(); ++j) {
    if (codebook.midpoints[j] != midpoints[j]) {
      throw InvalidArgument(
          where, fmt::format("codebook.midpoints[{}]", j), codebook.midpoints[j],
          fmt::format("{} ((c[{}] + c[{}]) / 2 in fp32)", midpoints[j], j, j + 1));
    }
  }
}

}  // namespace tqkv
