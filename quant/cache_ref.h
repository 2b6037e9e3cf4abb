// One layer's paged cache as every operation takes it: num_blocks blocks of one layout, in host
// memory for the CPU paths and device memory for the CUDA ones. Stores take a CacheRef (they
// write), attention a ConstCacheRef (it reads); a CacheRef converts to one.
//
// A reference names the layout its bytes were allocated and written in (CacheLayout), and every
// store and attention call compares it with its own: a cache of another format would have its
// blocks read at the wrong offsets, or written past its end. KVCache::layer() builds the
// reference of a layer; a cache held elsewhere takes the layout of the format it was sized for
// (Quantizer::layout(), Bf16BlockFormat::layout()).
#pragma once

#include <cstdint>
#include <string_view>
#include <type_traits>

namespace tqkv {

// The names of the uncompressed 16-bit layouts (a TurboQuant cache's layout is its preset's name).
inline constexpr std::string_view kBf16FormatName = "bf16";
inline constexpr std::string_view kFp16FormatName = "fp16";

// What fixes where every byte of a block sits: the format (a TurboQuant preset's name, "bf16" or
// "fp16"; static storage: Preset::name or the constants above), head_dim, KV heads and tokens
// per block. The rotation the keys were stored with is not part of it: a cache written with one
// rotation and read with another has the right layout and wrong values, which the caller's
// prefix-cache format tag (MakeFormatTag) keeps apart.
struct CacheLayout {
  std::string_view format;
  int head_dim = 0;
  int num_kv_heads = 0;
  int block_size = 0;

  friend bool operator==(const CacheLayout&, const CacheLayout&) = default;
};

template <typename Byte>
struct BasicCacheRef {
  Byte* data = nullptr;  // [num_blocks, the layout's block bytes]
  int64_t num_blocks = 0;
  CacheLayout layout;

  BasicCacheRef() = default;
  BasicCacheRef(Byte* data_, int64_t num_blocks_, const CacheLayout& layout_)
      : data(data_), num_blocks(num_blocks_), layout(layout_) {}

  operator BasicCacheRef<const Byte>() const
    requires(!std::is_const_v<Byte>)
  {
    return {data, num_blocks, layout};
  }
};
using CacheRef = BasicCacheRef<uint8_t>;
using ConstCacheRef = BasicCacheRef<const uint8_t>;
// The most blocks a cache may have: the kernels address a block by a 32-bit id.
inline constexpr int64_t kMaxCacheBlocks = int64_t{0xffffffff};

}  // namespace tqkv
