// Quantizer: one preset + block format + codebook + rotation, and the CPU reference store and
// dequantize of TURBOQUANT.md. Every CUDA kernel is judged against what this file computes.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "quant/block_format.h"
#include "quant/cache_ref.h"
#include "quant/codebook.h"
#include "quant/preset.h"
#include "quant/rotation.h"
#include "runtime/device.h"
#include "runtime/dtype.h"

namespace tqkv {

// Keys and values of the tokens to store, and where each goes.
struct StoreInputs {
  const void* key = nullptr;           // [num_tokens, num_kv_heads, head_dim] of `dtype`
  const void* value = nullptr;         // [num_tokens, num_kv_heads, head_dim] of `dtype`
  DType dtype = DType::kF32;           // kF32, kF16 or kBF16
  const void* slot_mapping = nullptr;  // [num_tokens] of `slot_dtype`; < 0 = write nothing
  DType slot_dtype = DType::kI64;      // kI32 or kI64
  int64_t num_tokens = 0;
};

// The checks every store makes, CPU or CUDA (Quantizer::StoreCpu, StoreDeviceState::Store): the
// cache's layout is `layout` (the quantizer's), the element types, num_tokens >= 0, num_blocks >= 0
// and, for a non-empty store, no null pointer. Throws tqkv::Error naming the argument, prefixed
// with `where`.
void ValidateStoreInputs(const StoreInputs& inputs, const CacheRef& cache,
                         const CacheLayout& layout, const char* where);

// The slot checks of Quantizer::StoreCpu over a host copy of a store's slot_mapping
// (`slot_mapping`, `slot_dtype`, `num_tokens` as in StoreInputs): every slot negative (skip) or
// below num_blocks · block_size, and none written by two tokens. Throws tqkv::Error naming the
// entry, its value and what is allowed, prefixed with `where`.
void ValidateSlotMapping(const void* slot_mapping, DType slot_dtype, int64_t num_tokens,
                         int64_t num_blocks, int block_size, const char* where);

// One (token slot, head) decoded back to fp32.
struct DequantizedSlot {
  std::vector<float> key_rotated;  // [D] k_norm · c[idx] in the rotated space (FP8: = key)
  std::vector<float> key;          // [D] rotated back: key_rotated · Π (FP8: decoded codes)
  std::vector<float> value;        // [D] code · scale + zero
};

class Quantizer {
 public:
  // Validates every combination (`preset` one of AllPresets(), as defined; see MakeBlockFormat;
  // Hadamard rotations need a power-of-two D; the rotation's and codebook's sizes must match) and
  // throws tqkv::Error naming what is wrong. `codebook` defaults to LloydMaxGaussian(head_dim, key
  // bits). FP8 presets ignore both.
  Quantizer(const Preset& preset, int head_dim, int num_kv_heads, int block_size, Rotation rotation,
            std::optional<Codebook> codebook = std::nullopt);

  // Convenience: preset by name, built-in codebook, rotation of `kind` from `seed`.
  static Quantizer Create(std::string_view preset, int head_dim, int num_kv_heads, int block_size,
                          RotationKind kind = RotationKind::kHadamard, uint64_t seed = 0);

  const Preset& preset() const { return *preset_; }
  const BlockFormat& format() const { return format_; }
  // The layout of the caches this quantizer writes and reads (its preset's name, the format's
  // sizes): what their CacheRefs must name.
  CacheLayout layout() const {
    return {preset_->name, format_.head_dim, format_.num_kv_heads, format_.block_size};
  }
  const Codebook& codebook() const { return codebook_; }  // empty for FP8 presets
  const Rotation& rotation() const { return rotation_; }
  bool uses_rotation() const { return !format_.fp8_keys; }

  // CPU reference store. Validates everything first (dtypes, null pointers, every slot below
  // num_blocks · block_size, no slot written twice) and throws tqkv::Error naming the token and
  // the slot; nothing is written when any input is invalid.
  void StoreCpu(const StoreInputs& inputs, CacheRef cache) const;

  // The CUDA store of the same bytes is StoreDeviceState::Store (quant/store_cuda.h), which holds
  // this quantizer's device tables.

  // Encodes one token-head (k, v: [D] fp32) into `block` at position `pos`, head `head`.
  void EncodeSlot(const float* k, const float* v, uint8_t* block, int pos, int head) const;

  // Decodes the (slot, head) written by the store from a host cache of this quantizer's layout.
  // Throws tqkv::Error for a cache of another layout or an out-of-range slot or head.
  DequantizedSlot Dequantize(ConstCacheRef cache, int64_t slot, int head) const;

  // q · Πᵀ for the query of a decode (identity for FP8 presets): q, out [D].
  void RotateQuery(const float* q, float* out) const;

 private:
  const Preset* preset_;
  BlockFormat format_;
  Rotation rotation_;
  Codebook codebook_;
};

// Element `i` of a float tensor of dtype kF32 / kF16 / kBF16, as fp32.
float LoadAsFloat(const void* data, DType dtype, int64_t i);

}  // namespace tqkv
