#pragma once

namespace tqkv {
inline constexpr const char* kVersion = "0.1.0";
}  // namespace tqkv
