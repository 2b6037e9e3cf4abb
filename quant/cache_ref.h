// One layer's paged cache as every operation takes it: num_blocks blocks of the format's
// block_bytes, in host memory for the CPU paths and device memory for the CUDA ones. Stores take a
// CacheRef (they write), attention a ConstCacheRef (it reads); a CacheRef converts to one.
#pragma once

#include <cstdint>
#include <type_traits>

namespace tqkv {

template <typename Byte>
struct BasicCacheRef {
  Byte* data = nullptr;  // [num_blocks, block_bytes]
  int64_t num_blocks = 0;

  operator BasicCacheRef<const Byte>() const
    requires(!std::is_const_v<Byte>)
  {
    return {data, num_blocks};
  }
};
using CacheRef = BasicCacheRef<uint8_t>;
// The most blocks a cache may have: the kernels address a block by a 32-bit id.
inline constexpr int64_t kMaxCacheBlocks = int64_t{0xffffffff};
using ConstCacheRef = BasicCacheRef<const uint8_t>;

}  // namespace tqkv
