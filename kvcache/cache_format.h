// Cache formats KVCache can hold, and the capacity arithmetic behind `tqkv info --memory`.
//
// A cache format is either a TurboQuant preset (the SoA block of quant/block_format.h) or an
// uncompressed 16-bit one: "bf16" (the baseline) or "fp16", the same layout with fp16 elements.
// Either way a layer's cache is [num_blocks, block_bytes] uint8 and block ids mean the same thing
// in every layer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvcache/block_hash.h"
#include "quant/block_format.h"
#include "runtime/host_device.h"

namespace tqkv {

// Bf16BlockFormat (the uncompressed layout) lives in quant/block_format.h with the TurboQuant one;
// the names "bf16" and "fp16" (kBf16FormatName, kFp16FormatName) in quant/cache_ref.h.

struct CacheFormat {
  std::string name;             // a preset name, "bf16" or "fp16"
  bool bf16 = false;            // uncompressed (bf16 or fp16: bf16_format.dtype); which of the
                                // two below is valid
  BlockFormat turboquant;       // !bf16
  Bf16BlockFormat bf16_format;  // bf16
  int head_dim = 0;
  int num_kv_heads = 0;
  int block_size = 0;
  int64_t block_bytes = 0;  // one block of one layer
  int64_t slot_bytes = 0;   // one token of one head (K + V + metadata)

  // What a CacheRef of a cache in this format names.
  CacheLayout layout() const;
};

// `name` is "bf16", "fp16" or a TurboQuant preset; anything else throws tqkv::Error listing them.
// The sizes are validated by MakeBlockFormat / MakeBf16BlockFormat.
CacheFormat MakeCacheFormat(std::string_view name, int head_dim, int num_kv_heads, int block_size);

// The prefix-cache format tag of a cache format (rotation_id: the rotation's kind and seed as
// the engine identifies them; 0 for bf16 and FP8 keys).
FormatTag MakeFormatTag(const CacheFormat& format, uint64_t rotation_id);

struct CapacityRow {
  std::string format;
  int64_t block_bytes = 0;      // one block of one layer
  int64_t bytes_per_block = 0;  // one block id across all layers
  int64_t bytes_per_token = 0;  // one token across all layers and heads
  int64_t num_blocks = 0;       // cache-tensor rows that fit, the null block included
  int64_t num_tokens = 0;       // (num_blocks - 1) * block_size: what sequences can hold
  double vs_bf16 = 1.0;         // bf16 bytes per token / this format's: how many times more fit
};

struct CapacityReport {
  int64_t memory_bytes = 0;
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  CapacityRow format;  // the requested format
  CapacityRow bf16;    // the bf16 baseline (equal to `format` when that is bf16)
};

// How many blocks and tokens of `format` ("bf16", "fp16" or a preset) fit in memory_bytes of cache
// memory, next to bf16. Throws tqkv::Error for a negative memory size, num_layers < 1 or an
// invalid format.
CapacityReport ComputeCapacity(int64_t memory_bytes, std::string_view format, int num_layers,
                               int num_kv_heads, int head_dim, int block_size = 16);

// The table `tqkv info --memory` prints: a heading line, column names, the bf16 row and the
// format's row (one row when the format is bf16). Ends with a newline.
std::string FormatCapacityTable(const CapacityReport& report);

}  // namespace tqkv
