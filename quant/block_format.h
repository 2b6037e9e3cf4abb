// The SoA block format: sizes and byte offsets of one paged block of a layer's compressed cache.
//
// This is the only place the layout of TURBOQUANT.md ("Sizes", "SoA block layout") is written down
// in code. The CPU reference, the CUDA store and decode kernels, KVCache sizing and the tests all
// use it. Included by kernel files: no fmt, no spdlog, no exceptions here.
//
//   data region : [0, meta_offset)
//     token p, head h : p * (H * data_per_slot) + h * data_per_slot
//                       key codes [0, key_data_bytes), value codes [key_data_bytes, data_per_slot)
//   meta region : [meta_offset, block_bytes), fp16 array [H][num_meta][block_size]
//     MSE fields: 0 = k_norm, 1 = v_scale, 2 = v_zero;  FP8 fields: 0 = v_scale, 1 = v_zero
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "quant/cache_ref.h"
#include "quant/key_kind.h"
#include "quant/preset.h"
#include "runtime/dtype.h"
#include "runtime/host_device.h"

namespace tqkv {

enum class MetaField { kKeyNorm, kValueScale, kValueZero };

struct BlockFormat {
  int head_dim = 0;      // D
  int num_kv_heads = 0;  // H
  int block_size = 0;    // tokens per block
  bool fp8_keys = false;
  int key_bits = 0;
  int value_bits = 0;

  int key_data_bytes = 0;   // D (FP8) or ceil(D * key_bits / 8)
  int val_data_bytes = 0;   // ceil(D * value_bits / 8)
  int num_meta = 0;         // fp16 fields per (token, head): 2 (FP8) or 3 (MSE)
  int data_per_slot = 0;    // key_data_bytes + val_data_bytes
  int slot_bytes = 0;       // data_per_slot + 2 * num_meta: bytes per token per head
  int64_t meta_offset = 0;  // block_size * H * data_per_slot
  int64_t block_bytes = 0;  // block_size * H * slot_bytes

  // Byte offset within a block of the key codes of token `pos` (0 <= pos < block_size), head h.
  TQKV_HOST_DEVICE int64_t KeyCodesOffset(int pos, int h) const {
    return static_cast<int64_t>(pos) * num_kv_heads * data_per_slot +
           static_cast<int64_t>(h) * data_per_slot;
  }
  TQKV_HOST_DEVICE int64_t ValueCodesOffset(int pos, int h) const {
    return KeyCodesOffset(pos, h) + key_data_bytes;
  }
  // Index of a metadata field in this format's field order, or -1 if the format has none (FP8
  // keys carry no norm).
  TQKV_HOST_DEVICE int MetaFieldIndex(MetaField field) const {
    const int i = static_cast<int>(field);
    return fp8_keys ? i - 1 : i;
  }
  // Byte offset within a block of an fp16 metadata field of (token pos, head h).
  TQKV_HOST_DEVICE int64_t MetaOffset(MetaField field, int pos, int h) const {
    const int f = MetaFieldIndex(field);
    return meta_offset + 2 * (static_cast<int64_t>(h) * num_meta * block_size +
                              static_cast<int64_t>(f) * block_size + pos);
  }
  // Bytes of K and V per token per head for an uncompressed 16-bit cache (the bf16 baseline).
  TQKV_HOST_DEVICE int Bf16SlotBytes() const { return 4 * head_dim; }
  TQKV_HOST_DEVICE KeyKind key_kind() const {
    return fp8_keys ? KeyKind::kFp8 : (key_bits == 4 ? KeyKind::kMse4 : KeyKind::kMse3);
  }
};

// An uncompressed 16-bit (bf16 or fp16) paged block, for layers an engine keeps uncompressed and as
// the baseline: keys then values, each [block_size][H][D] 16-bit elements.
//   key (pos, h)   : 2 * ((pos * H + h) * D)
//   value (pos, h) : value_offset + 2 * ((pos * H + h) * D),  value_offset = 2 * block_size * H * D
struct Bf16BlockFormat {
  int head_dim = 0;
  int num_kv_heads = 0;
  int block_size = 0;
  DType dtype = DType::kBF16;  // the elements: kBF16 or kF16
  int64_t value_offset = 0;    // bytes
  int64_t block_bytes = 0;   // 4 * block_size * H * D

  TQKV_HOST_DEVICE int64_t KeyOffset(int pos, int h) const {
    return 2 * ((static_cast<int64_t>(pos) * num_kv_heads + h) * head_dim);
  }
  TQKV_HOST_DEVICE int64_t ValueOffset(int pos, int h) const {
    return value_offset + KeyOffset(pos, h);
  }
  TQKV_HOST_DEVICE int SlotBytes() const { return 4 * head_dim; }  // K + V of one token-head
  TQKV_HOST_DEVICE KeyKind key_kind() const {
    return dtype == DType::kF16 ? KeyKind::kF16 : KeyKind::kBf16;
  }
  // What a CacheRef of a cache in this format names ("bf16" or "fp16").
  CacheLayout layout() const {
    return {dtype == DType::kF16 ? kFp16FormatName : kBf16FormatName, head_dim, num_kv_heads,
            block_size};
  }
};

// Same validation as MakeBlockFormat (head_dim, block_size, num_kv_heads); dtype kBF16 or kF16.
Bf16BlockFormat MakeBf16BlockFormat(int head_dim, int num_kv_heads, int block_size,
                                    DType dtype = DType::kBF16);

// `format` as MakeBf16BlockFormat makes it for its head_dim, num_kv_heads, block_size and dtype:
// the constructors and calls that take a caller's format check it with this, since an edited
// value_offset or block_bytes would read keys as values or past a block. Throws tqkv::Error as
// MakeBf16BlockFormat does for those four, and from `where` naming value_offset or block_bytes
// where it differs, with the value it must have.
Bf16BlockFormat CheckBf16BlockFormat(std::string_view where, const Bf16BlockFormat& format);

// Validates and computes a format. Throws tqkv::Error naming the argument and the allowed values:
// head_dim in {64, 128, 256}; block_size in {16, 32, 64, 128}; num_kv_heads in [1, 256];
// 3-bit codes need head_dim % 8 == 0.
BlockFormat MakeBlockFormat(const Preset& preset, int head_dim, int num_kv_heads, int block_size);

// The bytes of one block of a cache in `layout` (a preset's name, "bf16" or "fp16"; the
// validation of MakeBlockFormat / MakeBf16BlockFormat, and an unknown format, throw).
int64_t BlockBytesOf(const CacheLayout& layout);

// "turboquant_4bit_nc, head_dim 128, 8 KV heads, block 16", for messages.
std::string DescribeLayout(const CacheLayout& layout);

// The check every store and attention call makes of its cache: throws tqkv::Error naming
// `where`, "cache.layout", the cache's layout and the one the call was made for, unless they are
// equal.
void CheckCacheLayout(std::string_view where, const CacheLayout& expected,
                      const CacheLayout& cache);

// The allowed values, for messages and flag help.
inline constexpr int kHeadDims[] = {64, 128, 256};
inline constexpr int kBlockSizes[] = {16, 32, 64, 128};
inline constexpr int kMaxKvHeads = 256;

}  // namespace tqkv
