// Element types of the tensors tqkv reads and writes (inputs, caches, files).
#pragma once

#include <cstdint>
#include <string_view>

namespace tqkv {

enum class DType { kF32, kF16, kBF16, kI32, kI64, kU8 };

constexpr int64_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kU8:
      return 1;
  }
  return 0;
}

// safetensors spelling: F32, F16, BF16, I32, I64, U8.
constexpr std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

}  // namespace tqkv
