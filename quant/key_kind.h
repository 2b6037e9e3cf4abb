// How a cache format stores keys: the kernel family that reads it. Plain C++ (kernels include it).
#pragma once

#include <array>
#include <cstdint>

namespace tqkv {

enum class KeyKind : uint8_t {
  kMse4,  // 4-bit codebook indices + fp16 norm (turboquant_4bit_nc)
  kMse3,  // 3-bit codebook indices + fp16 norm (turboquant_k3v4_nc, turboquant_3bit_nc)
  kFp8,   // FP8 E4M3 per element (turboquant_k8v4)
  kBf16,  // uncompressed bf16 K and V (Bf16BlockFormat with dtype kBF16)
  kF16,   // uncompressed fp16 K and V (Bf16BlockFormat with dtype kF16)
};
inline constexpr std::array<KeyKind, 5> kKeyKinds = {KeyKind::kMse4, KeyKind::kMse3, KeyKind::kFp8,
                                                     KeyKind::kBf16, KeyKind::kF16};

// The uncompressed kinds.
constexpr bool IsPlain(KeyKind k) { return k == KeyKind::kBf16 || k == KeyKind::kF16; }

constexpr const char* KeyKindName(KeyKind k) {
  switch (k) {
    case KeyKind::kMse4: return "mse4";
    case KeyKind::kMse3: return "mse3";
    case KeyKind::kFp8: return "fp8";
    case KeyKind::kBf16: return "bf16";
    case KeyKind::kF16: return "f16";
  }
  return "?";
}

}  // namespace tqkv
