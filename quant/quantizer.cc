#include "quant/quantizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <vector>

#include "quant/numerics.h"
#include "quant/packing.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

int64_t LoadSlot(const void* data, DType dtype, int64_t i) {
  return dtype == DType::kI32 ? static_cast<const int32_t*>(data)[i]
                              : static_cast<const int64_t*>(data)[i];
}

}  // namespace

float LoadAsFloat(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    case DType::kF16:
      return HalfBitsToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBF16:
      return BFloat16BitsToFloat(static_cast<const uint16_t*>(data)[i]);
    default:
      break;
  }
  throw InvalidArgument("LoadAsFloat", "dtype", DTypeName(dtype), "F32, F16, BF16");
}

namespace {

// The entry of AllPresets() that `preset` is (the quantizer keeps a pointer to it, so a caller's
// copy may go away): a preset of another name, or a known name with other fields (a preset built
// or changed by hand, whose layout would have named the real one's), throws.
const Preset& KnownPreset(const Preset& preset) {
  for (const Preset& p : AllPresets()) {
    if (p.name != preset.name) continue;
    if (p.key_coding != preset.key_coding || p.key_bits != preset.key_bits ||
        p.value_bits != preset.value_bits || p.norm_correction != preset.norm_correction) {
      throw InvalidArgument("Quantizer", "preset",
                            fmt::format("{} ({}-bit keys, {}-bit values)", preset.name,
                                        preset.key_bits, preset.value_bits),
                            fmt::format("{} as defined ({}-bit keys, {}-bit values; PresetByName)",
                                        p.name, p.key_bits, p.value_bits));
    }
    return p;
  }
  throw InvalidArgument("Quantizer", "preset", fmt::format("\"{}\"", preset.name), PresetNames());
}

}  // namespace

Quantizer::Quantizer(const Preset& preset, int head_dim, int num_kv_heads, int block_size,
                     Rotation rotation, std::optional<Codebook> codebook)
    : preset_(&KnownPreset(preset)),
      format_(MakeBlockFormat(*preset_, head_dim, num_kv_heads, block_size)),
      rotation_(std::move(rotation)) {
  if (format_.fp8_keys) {
    rotation_ = Rotation{};  // FP8 keys are stored unrotated; the id 0 marks "no rotation"
    return;
  }
  ValidateRotation(rotation_, head_dim, "Quantizer");
  if (codebook) {
    ValidateCodebook(*codebook, preset_->key_bits, "Quantizer");
    codebook_ = std::move(*codebook);
  } else {
    codebook_ = LloydMaxGaussian(head_dim, preset_->key_bits);
  }
}

Quantizer Quantizer::Create(std::string_view preset, int head_dim, int num_kv_heads, int block_size,
                            RotationKind kind, uint64_t seed) {
  const Preset& p = PresetByName(preset);
  // Validate the shape before building a rotation, so a bad head_dim is reported as such.
  MakeBlockFormat(p, head_dim, num_kv_heads, block_size);
  Rotation rotation =
      p.key_coding == KeyCoding::kFp8 ? Rotation{} : MakeRotation(kind, head_dim, seed);
  return Quantizer(p, head_dim, num_kv_heads, block_size, std::move(rotation));
}

void Quantizer::RotateQuery(const float* q, float* out) const {
  const int d = format_.head_dim;
  if (format_.fp8_keys) {
    std::copy(q, q + d, out);
    return;
  }
  for (int j = 0; j < d; ++j) {
    double acc = 0.0;
    for (int i = 0; i < d; ++i) acc += double(q[i]) * rotation_.matrix[size_t(i) * d + j];
    out[j] = static_cast<float>(acc);
  }
}

void Quantizer::EncodeSlot(const float* k, const float* v, uint8_t* block, int pos,
                           int head) const {
  const BlockFormat& f = format_;
  const int d = f.head_dim;
  uint8_t codes[256];
  uint8_t* key_out = block + f.KeyCodesOffset(pos, head);

  if (f.fp8_keys) {
    for (int i = 0; i < d; ++i) key_out[i] = FloatToE4M3(k[i]);
  } else {
    // Norm: the sum of squares in fp64 (exact products, order-insensitive to far below fp32
    // rounding), rounded to fp32 once — so every implementation gets the same fp32 norm.
    double ss = 0.0;
    for (int i = 0; i < d; ++i) ss += double(k[i]) * k[i];
    const float norm = static_cast<float>(std::sqrt(ss));
    const float denom = norm + 1e-8f;
    float x[256];
    for (int i = 0; i < d; ++i) x[i] = k[i] / denom;
    // y = x·Π by rows of Πᵀ (contiguous), each y[j] still summed over i in ascending order.
    double y[256] = {};
    for (int i = 0; i < d; ++i) {
      const double xi = x[i];
      const float* row = rotation_.matrix.data() + size_t(i) * d;
      for (int j = 0; j < d; ++j) y[j] += xi * row[j];
    }
    double csum = 0.0;
    for (int j = 0; j < d; ++j) {
      const int idx = codebook_.Bucketize(static_cast<float>(y[j]));
      codes[j] = static_cast<uint8_t>(idx);
      csum += double(codebook_.centroids[idx]) * codebook_.centroids[idx];
    }
    PackCodes(codes, d, f.key_bits, key_out);
    float stored = preset_->norm_correction
                       ? static_cast<float>(double(norm) / std::sqrt(csum + 1e-16))
                       : norm;
    if (std::isnan(stored)) stored = 0.0f;  // NaN keys: a zero norm, never NaN metadata
    StoreHalfBits(block + f.MetaOffset(MetaField::kKeyNorm, pos, head),
                  FloatToHalfBitsClamped(stored));
  }

  // Values: uniform min/max over the finite range of fp16.
  float vmin = INFINITY, vmax = -INFINITY;
  for (int i = 0; i < d; ++i) {
    if (std::isnan(v[i])) continue;
    vmin = std::min(vmin, v[i]);
    vmax = std::max(vmax, v[i]);
  }
  vmin = std::clamp(vmin, -65504.0f, 65504.0f);
  vmax = std::clamp(vmax, -65504.0f, 65504.0f);
  const int levels = (1 << f.value_bits) - 1;
  float scale = (vmax - vmin) / static_cast<float>(levels);
  if (!(scale > 1e-8f)) scale = 1e-8f;
  for (int i = 0; i < d; ++i) {
    const float t = std::floor((v[i] - vmin) / scale + 0.5f);
    codes[i] = t >= 0.0f ? static_cast<uint8_t>(std::min(t, static_cast<float>(levels))) : 0;
  }
  PackCodes(codes, d, f.value_bits, block + f.ValueCodesOffset(pos, head));
  StoreHalfBits(block + f.MetaOffset(MetaField::kValueScale, pos, head), FloatToHalfBits(scale));
  StoreHalfBits(block + f.MetaOffset(MetaField::kValueZero, pos, head), FloatToHalfBits(vmin));
}

void ValidateStoreInputs(const StoreInputs& in, const CacheRef& cache, const CacheLayout& layout,
                         const char* where) {
  CheckCacheLayout(where, layout, cache.layout);
  if (in.num_tokens < 0) throw InvalidArgument(where, "num_tokens", in.num_tokens, ">= 0");
  if (in.dtype != DType::kF32 && in.dtype != DType::kF16 && in.dtype != DType::kBF16) {
    throw InvalidArgument(where, "dtype", DTypeName(in.dtype), "F32, F16, BF16");
  }
  if (in.slot_dtype != DType::kI32 && in.slot_dtype != DType::kI64) {
    throw InvalidArgument(where, "slot_mapping dtype", DTypeName(in.slot_dtype), "I32, I64");
  }
  if (cache.num_blocks < 0 || cache.num_blocks > kMaxCacheBlocks) {
    throw InvalidArgument(where, "num_blocks", cache.num_blocks,
                          fmt::format("0 to {} (32-bit block ids)", kMaxCacheBlocks));
  }
  if (in.num_tokens > 0 &&
      (in.key == nullptr || in.value == nullptr || in.slot_mapping == nullptr ||
       (cache.data == nullptr && cache.num_blocks > 0))) {
    throw Error(fmt::format("{}: key, value, slot_mapping and cache must not be null", where));
  }
  // What the store reads must not lie in the cache it writes: slots written early would change
  // inputs still to be read (a slot_mapping inside the cache could send a later token past it).
  const int64_t row_bytes = int64_t{layout.num_kv_heads} * layout.head_dim * 4;
  if (in.num_tokens > std::numeric_limits<int64_t>::max() / row_bytes) {
    throw InvalidArgument(where, "num_tokens", in.num_tokens,
                          fmt::format("at most {} (the inputs' bytes within int64)",
                                      std::numeric_limits<int64_t>::max() / row_bytes));
  }
  const int64_t rows = in.num_tokens * int64_t{layout.num_kv_heads} * layout.head_dim;
  const ByteRange written{"cache", cache.data, cache.num_blocks * BlockBytesOf(layout)};
  for (const ByteRange& read :
       {ByteRange{"key", in.key, rows * DTypeSize(in.dtype)},
        ByteRange{"value", in.value, rows * DTypeSize(in.dtype)},
        ByteRange{"slot_mapping", in.slot_mapping, in.num_tokens * DTypeSize(in.slot_dtype)}}) {
    CheckDisjoint(where, {written, read});
  }
}

void ValidateSlotMapping(const void* slot_mapping, DType slot_dtype, int64_t num_tokens,
                         int64_t num_blocks, int block_size, const char* where) {
  const int64_t num_slots = num_blocks * block_size;
  std::unordered_map<int64_t, int64_t> first_token;  // slot -> token, to reject double writes
  // (At most one entry per slot: a huge num_tokens of mostly -1 slots reserves no more.)
  first_token.reserve(static_cast<size_t>(std::min<int64_t>(num_tokens, num_slots)));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = LoadSlot(slot_mapping, slot_dtype, t);
    if (slot < 0) continue;
    if (slot >= num_slots) {
      throw InvalidArgument(where, fmt::format("slot_mapping[{}]", t), slot,
                            fmt::format("negative (skip) or 0 to {} ({} blocks x {} tokens)",
                                        num_slots - 1, num_blocks, block_size));
    }
    const auto [it, inserted] = first_token.emplace(slot, t);
    if (!inserted) {
      throw InvalidArgument(
          where, fmt::format("slot_mapping[{}]", t), slot,
          fmt::format("a slot no other token writes (token {} writes it too)", it->second));
    }
  }
}

void Quantizer::StoreCpu(const StoreInputs& in, CacheRef cache) const {
  constexpr const char* kWhere = "Quantizer::StoreCpu";
  const BlockFormat& f = format_;
  ValidateStoreInputs(in, cache, layout(), kWhere);
  if (in.num_tokens == 0) return;
  ValidateSlotMapping(in.slot_mapping, in.slot_dtype, in.num_tokens, cache.num_blocks, f.block_size,
                      kWhere);

  const int d = f.head_dim;
  std::vector<float> k(d), v(d);
  for (int64_t t = 0; t < in.num_tokens; ++t) {
    const int64_t slot = LoadSlot(in.slot_mapping, in.slot_dtype, t);
    if (slot < 0) continue;
    uint8_t* block = cache.data + (slot / f.block_size) * f.block_bytes;
    const int pos = static_cast<int>(slot % f.block_size);
    for (int h = 0; h < f.num_kv_heads; ++h) {
      const int64_t base = (t * f.num_kv_heads + h) * d;
      for (int i = 0; i < d; ++i) {
        k[i] = LoadAsFloat(in.key, in.dtype, base + i);
        v[i] = LoadAsFloat(in.value, in.dtype, base + i);
      }
      EncodeSlot(k.data(), v.data(), block, pos, h);
    }
  }
}

DequantizedSlot Quantizer::Dequantize(ConstCacheRef cache, int64_t slot, int head) const {
  const BlockFormat& f = format_;
  CheckCacheLayout("Quantizer::Dequantize", layout(), cache.layout);
  const int64_t num_blocks = cache.num_blocks;
  if (num_blocks < 0 || num_blocks > kMaxCacheBlocks) {
    throw InvalidArgument("Quantizer::Dequantize", "num_blocks", num_blocks,
                          fmt::format("0 to {}", kMaxCacheBlocks));
  }
  if (slot < 0 || slot >= num_blocks * f.block_size) {
    throw InvalidArgument("Quantizer::Dequantize", "slot", slot,
                          fmt::format("0 to {}", num_blocks * f.block_size - 1));
  }
  if (head < 0 || head >= f.num_kv_heads) {
    throw InvalidArgument("Quantizer::Dequantize", "head", head,
                          fmt::format("0 to {}", f.num_kv_heads - 1));
  }
  if (cache.data == nullptr) {
    throw InvalidArgument("Quantizer::Dequantize", "cache.data", "null",
                          fmt::format("the {} blocks' bytes", num_blocks));
  }
  const uint8_t* block = cache.data + (slot / f.block_size) * f.block_bytes;
  const int pos = static_cast<int>(slot % f.block_size);
  const int d = f.head_dim;
  DequantizedSlot out;
  out.key_rotated.resize(d);
  out.key.resize(d);
  out.value.resize(d);
  const uint8_t* key_codes = block + f.KeyCodesOffset(pos, head);
  if (f.fp8_keys) {
    for (int i = 0; i < d; ++i) out.key[i] = E4M3ToFloat(key_codes[i]);
    out.key_rotated = out.key;
  } else {
    const float norm =
        HalfBitsToFloat(LoadHalfBits(block + f.MetaOffset(MetaField::kKeyNorm, pos, head)));
    for (int j = 0; j < d; ++j) {
      out.key_rotated[j] = norm * codebook_.centroids[UnpackCode(key_codes, j, f.key_bits)];
    }
    // x = y · Π, i.e. x[i] = Σ_j y[j] · Πᵀ[i][j].
    for (int i = 0; i < d; ++i) {
      double acc = 0.0;
      for (int j = 0; j < d; ++j)
        acc += double(out.key_rotated[j]) * rotation_.matrix[size_t(i) * d + j];
      out.key[i] = static_cast<float>(acc);
    }
  }
  const float scale =
      HalfBitsToFloat(LoadHalfBits(block + f.MetaOffset(MetaField::kValueScale, pos, head)));
  const float zero =
      HalfBitsToFloat(LoadHalfBits(block + f.MetaOffset(MetaField::kValueZero, pos, head)));
  const uint8_t* value_codes = block + f.ValueCodesOffset(pos, head);
  for (int i = 0; i < d; ++i) {
    out.value[i] =
        std::fma(static_cast<float>(UnpackCode(value_codes, i, f.value_bits)), scale, zero);
  }
  return out;
}

}  // namespace tqkv
