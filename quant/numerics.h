// Bit-exact scalar conversions shared by the CPU reference and the tests (TURBOQUANT.md, "Bit
// packing"): fp16 and bf16 with round-to-nearest-even, OCP FP8 E4M3FN with saturation.
// Host-only: CUDA kernels use the hardware conversions (__float2half_rn, __nv_cvt_float_to_fp8
// with __NV_SATFINITE), which these functions reproduce bit for bit.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace tqkv {

// fp32 -> IEEE binary16 bits, round to nearest even; overflow -> inf, NaN -> quiet NaN.
inline uint16_t FloatToHalfBits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (ax >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf
  if (ax >= 0x38800000u) {                       // normal half: >= 2^-14
    const uint32_t mant = ax & 0x7FFFFFu;
    const uint32_t exp = (ax >> 23) - 127 + 15;
    uint32_t h = (exp << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carry may bump the exponent
    return sign | static_cast<uint16_t>(h);
  }
  // Subnormal half (unit 2^-24): scaling by 2^24 is exact, nearbyint rounds half to even.
  const float scaled = std::bit_cast<float>(ax) * 16777216.0f;
  return sign | static_cast<uint16_t>(std::nearbyint(scaled));
}

inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);  // exact
    return std::bit_cast<float>(std::bit_cast<uint32_t>(v) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

// fp32 -> fp16 after clamping to the finite range [-65504, 65504] (TURBOQUANT.md: metadata is
// never inf). NaN stays NaN; callers that must not store NaN clamp before.
inline uint16_t FloatToHalfBitsClamped(float f) {
  if (f > 65504.0f) f = 65504.0f;
  if (f < -65504.0f) f = -65504.0f;
  return FloatToHalfBits(f);
}

inline float BFloat16BitsToFloat(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

// fp32 -> bf16 bits, round to nearest even (NaN stays NaN).
inline uint16_t FloatToBFloat16Bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t rounding = 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

// OCP FP8 E4M3FN: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; NaN =
// S.1111.111. Encoding rounds to nearest even and saturates to ±448 (like __NV_SATFINITE); NaN ->
// 0x7F.
inline uint8_t FloatToE4M3(float f) {
  if (std::isnan(f)) return 0x7F;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7E;
  if (a < 0.015625f) {  // below the smallest normal 2^-6: subnormals m * 2^-9, m = 0..8
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));  // 8 is the smallest normal
  }
  int e = std::ilogb(a);                           // 2^e <= a < 2^(e+1), e in [-6, 8]
  const float m = std::ldexp(a, 3 - e) - 8.0f;     // exact: 3 mantissa bits of 24
  int mant = static_cast<int>(std::nearbyint(m));  // 0..8, ties to even
  if (mant == 8) {
    mant = 0;
    ++e;
  }
  const int code = ((e + 7) << 3) | mant;
  return sign | static_cast<uint8_t>(code > 0x7E ? 0x7E : code);
}

inline float E4M3ToFloat(uint8_t code) {
  const bool negative = (code & 0x80) != 0;
  const int exp = (code >> 3) & 0xF;
  const int mant = code & 0x7;
  float v;
  if (exp == 0xF && mant == 0x7) {
    v = std::nanf("");
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -9);
  } else {
    v = std::ldexp(static_cast<float>(8 + mant), exp - 10);
  }
  return negative ? -v : v;
}

}  // namespace tqkv
