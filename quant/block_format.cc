#include "quant/block_format.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>

#include "runtime/error.h"

namespace tqkv {
namespace {

void ValidateShape(const char* where, int head_dim, int num_kv_heads, int block_size) {
  if (std::find(std::begin(kHeadDims), std::end(kHeadDims), head_dim) == std::end(kHeadDims)) {
    throw InvalidArgument(where, "head_dim", head_dim, "64, 128, 256");
  }
  if (std::find(std::begin(kBlockSizes), std::end(kBlockSizes), block_size) ==
      std::end(kBlockSizes)) {
    throw InvalidArgument(where, "block_size", block_size, "16, 32, 64, 128");
  }
  if (num_kv_heads < 1 || num_kv_heads > kMaxKvHeads) {
    throw InvalidArgument(where, "num_kv_heads", num_kv_heads, fmt::format("1 to {}", kMaxKvHeads));
  }
}

}  // namespace

Bf16BlockFormat MakeBf16BlockFormat(int head_dim, int num_kv_heads, int block_size, DType dtype) {
  ValidateShape("MakeBf16BlockFormat", head_dim, num_kv_heads, block_size);
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    throw InvalidArgument("MakeBf16BlockFormat", "dtype", DTypeName(dtype), "BF16 or F16");
  }
  Bf16BlockFormat f;
  f.head_dim = head_dim;
  f.num_kv_heads = num_kv_heads;
  f.block_size = block_size;
  f.dtype = dtype;
  f.value_offset = 2 * static_cast<int64_t>(block_size) * num_kv_heads * head_dim;
  f.block_bytes = 2 * f.value_offset;
  return f;
}

Bf16BlockFormat CheckBf16BlockFormat(std::string_view where, const Bf16BlockFormat& format) {
  const Bf16BlockFormat made =
      MakeBf16BlockFormat(format.head_dim, format.num_kv_heads, format.block_size, format.dtype);
  if (format.value_offset != made.value_offset) {
    throw InvalidArgument(where, "format.value_offset", format.value_offset,
                          fmt::format("{} (MakeBf16BlockFormat)", made.value_offset));
  }
  if (format.block_bytes != made.block_bytes) {
    throw InvalidArgument(where, "format.block_bytes", format.block_bytes,
                          fmt::format("{} (MakeBf16BlockFormat)", made.block_bytes));
  }
  return made;
}

BlockFormat MakeBlockFormat(const Preset& preset, int head_dim, int num_kv_heads, int block_size) {
  constexpr const char* kWhere = "MakeBlockFormat";
  ValidateShape(kWhere, head_dim, num_kv_heads, block_size);
  const bool three_bit = preset.key_bits == 3 || preset.value_bits == 3;
  if (three_bit && head_dim % 8 != 0) {
    throw InvalidArgument(kWhere, "head_dim", head_dim,
                          fmt::format("a multiple of 8 for 3-bit preset {}", preset.name));
  }

  BlockFormat f;
  f.head_dim = head_dim;
  f.num_kv_heads = num_kv_heads;
  f.block_size = block_size;
  f.fp8_keys = preset.key_coding == KeyCoding::kFp8;
  f.key_bits = preset.key_bits;
  f.value_bits = preset.value_bits;
  f.key_data_bytes = f.fp8_keys ? head_dim : (head_dim * preset.key_bits + 7) / 8;
  f.val_data_bytes = (head_dim * preset.value_bits + 7) / 8;
  f.num_meta = f.fp8_keys ? 2 : 3;
  f.data_per_slot = f.key_data_bytes + f.val_data_bytes;
  f.slot_bytes = f.data_per_slot + 2 * f.num_meta;
  f.meta_offset = static_cast<int64_t>(block_size) * num_kv_heads * f.data_per_slot;
  f.block_bytes = static_cast<int64_t>(block_size) * num_kv_heads * f.slot_bytes;
  return f;
}

int64_t BlockBytesOf(const CacheLayout& layout) {
  if (layout.format == kBf16FormatName || layout.format == kFp16FormatName) {
    return MakeBf16BlockFormat(layout.head_dim, layout.num_kv_heads, layout.block_size,
                               layout.format == kFp16FormatName ? DType::kF16 : DType::kBF16)
        .block_bytes;
  }
  return MakeBlockFormat(PresetByName(layout.format), layout.head_dim, layout.num_kv_heads,
                         layout.block_size)
      .block_bytes;
}

std::string DescribeLayout(const CacheLayout& layout) {
  return fmt::format("{}, head_dim {}, {} KV heads, block {}",
                     layout.format.empty() ? "no format" : layout.format, layout.head_dim,
                     layout.num_kv_heads, layout.block_size);
}

void CheckCacheLayout(std::string_view where, const CacheLayout& expected,
                      const CacheLayout& cache) {
  if (cache == expected) return;
  throw InvalidArgument(
      where, "cache.layout", fmt::format("({})", DescribeLayout(cache)),
      fmt::format("the layout this call was made for ({})", DescribeLayout(expected)));
}

}  // namespace tqkv
