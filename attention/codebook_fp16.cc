#include "attention/codebook_fp16.h"

#include <cmath>
#include <limits>

#include "quant/numerics.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

double MaxRelError(std::span<const float> centroids, float scale) {
  double worst = 0.0;
  for (const float c : centroids) {
    const double x = static_cast<double>(scale) * c;
    if (x == 0.0) continue;  // exact
    const double h = HalfBitsToFloat(FloatToHalfBits(static_cast<float>(x)));
    const double e = std::abs(h - x) / std::abs(x);
    worst = std::max(worst, std::isfinite(e) ? e : std::numeric_limits<double>::infinity());
  }
  return worst;
}

}  // namespace

Fp16Codebook ScaleCodebookForFp16(std::span<const float> centroids, bool search) {
  if (centroids.empty() || centroids.size() > 16) {
    throw InvalidArgument("ScaleCodebookForFp16", "centroids.size()", centroids.size(), "1 to 16");
  }
  Fp16Codebook out;
  out.max_rel_error = MaxRelError(centroids, 1.0f);
  if (search) {
    constexpr int kCoarse = 1 << 16, kFine = 1 << 10;
    for (int i = 0; i < kCoarse; ++i) {
      const float a = 1.0f + static_cast<float>(i) / kCoarse;
      const double e = MaxRelError(centroids, a);
      if (e < out.max_rel_error) out.max_rel_error = e, out.scale = a;
    }
    const float center = out.scale;
    for (int i = -kFine; i <= kFine; ++i) {
      const float a = center + static_cast<float>(i) / (static_cast<float>(kCoarse) * kFine);
      if (a < 1.0f || a >= 2.0f) continue;
      const double e = MaxRelError(centroids, a);
      if (e < out.max_rel_error) out.max_rel_error = e, out.scale = a;
    }
  }
  for (const float c : centroids) {
    const double x = static_cast<double>(out.scale) * c;
    const uint16_t hi = FloatToHalfBits(static_cast<float>(x));
    out.hi.push_back(hi);
    out.lo.push_back(FloatToHalfBits(static_cast<float>(x - HalfBitsToFloat(hi))));
  }
  return out;
}

}  // namespace tqkv
