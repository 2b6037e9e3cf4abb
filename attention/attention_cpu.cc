#include "attention/attention_cpu.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "quant/numerics.h"
#include "quant/packing.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

constexpr const char* kWhere = "AttentionCpu";

float LoadElement(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kF16:
      return HalfBitsToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kBF16:
      return BFloat16BitsToFloat(static_cast<const uint16_t*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

void StoreElement(void* base, DType t, int64_t i, double x) {
  switch (t) {
    case DType::kF16:  // saturating: 4-bit values dequantize up to ~60 past fp16's largest
      static_cast<uint16_t*>(base)[i] = FloatToHalfBitsClamped(static_cast<float>(x));
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(base)[i] = FloatToBFloat16Bits(static_cast<float>(x));
      break;
    default:
      static_cast<float*>(base)[i] = static_cast<float>(x);
  }
}

// Cache readers: Query(q, out) maps a query row to the space the keys live in (q·Πᵀ for MSE keys),
// Key(block, pos, h, out) and Value(...) write one token's dequantized key and value in fp64.
struct TurboQuantCache {
  const Quantizer& quantizer;
  int64_t block_bytes() const { return quantizer.format().block_bytes; }
  void Query(const float* q, float* out) const {
    if (quantizer.format().fp8_keys) {
      std::memcpy(out, q, sizeof(float) * quantizer.format().head_dim);
    } else {
      quantizer.RotateQuery(q, out);
    }
  }
  void Key(const uint8_t* block, int pos, int h, double* out) const {
    const BlockFormat& f = quantizer.format();
    const uint8_t* codes = block + f.KeyCodesOffset(pos, h);
    if (f.fp8_keys) {
      for (int i = 0; i < f.head_dim; ++i) out[i] = E4M3ToFloat(codes[i]);
      return;
    }
    const std::vector<float>& c = quantizer.codebook().centroids;
    const double norm =
        HalfBitsToFloat(LoadHalfBits(block + f.MetaOffset(MetaField::kKeyNorm, pos, h)));
    for (int i = 0; i < f.head_dim; ++i) out[i] = norm * c[UnpackCode(codes, i, f.key_bits)];
  }
  void Value(const uint8_t* block, int pos, int h, double* out) const {
    const BlockFormat& f = quantizer.format();
    const float vs =
        HalfBitsToFloat(LoadHalfBits(block + f.MetaOffset(MetaField::kValueScale, pos, h)));
    const float vz =
        HalfBitsToFloat(LoadHalfBits(block + f.MetaOffset(MetaField::kValueZero, pos, h)));
    const uint8_t* codes = block + f.ValueCodesOffset(pos, h);
    for (int i = 0; i < f.head_dim; ++i) {
      out[i] = std::fma(static_cast<float>(UnpackCode(codes, i, f.value_bits)), vs, vz);
    }
  }
};

struct PlainCache {
  const Bf16BlockFormat& format;
  int64_t block_bytes() const { return format.block_bytes; }
  void Query(const float* q, float* out) const {
    std::memcpy(out, q, sizeof(float) * format.head_dim);
  }
  void Load(const uint8_t* at, double* out) const {
    for (int i = 0; i < format.head_dim; ++i) {
      uint16_t bits;
      std::memcpy(&bits, at + 2 * i, 2);
      out[i] = format.dtype == DType::kF16 ? HalfBitsToFloat(bits) : BFloat16BitsToFloat(bits);
    }
  }
  void Key(const uint8_t* block, int pos, int h, double* out) const {
    Load(block + format.KeyOffset(pos, h), out);
  }
  void Value(const uint8_t* block, int pos, int h, double* out) const {
    Load(block + format.ValueOffset(pos, h), out);
  }
};

// The reference itself: per sequence and KV head, the K/V its queries read are dequantized once,
// then every (new token, query head of the group) row is a plain fp64 softmax over its range.
template <typename Cache>
void Attend(const Cache& cache, const CacheLayout& layout, const AttentionArgs& a) {
  const int d = layout.head_dim, hk = layout.num_kv_heads;
  const int group = a.num_q_heads / hk;
  const double scale = a.scale ? *a.scale : 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> keys, values, q(d), acc(d), scores;
  std::vector<float> q_in(d), q_map(d);
  for (int b = 0; b < a.num_seqs; ++b) {
    const int32_t q_begin = a.query_start_loc[b];
    const int32_t q_len = a.query_start_loc[b + 1] - q_begin;
    if (q_len == 0) continue;
    const int32_t len = a.seq_lens[b];
    const int32_t* table = a.block_tables + int64_t{b} * a.max_blocks_per_seq;
    const int32_t first =
        a.sliding_window > 0 ? std::max<int32_t>(0, len - q_len - a.sliding_window + 1) : 0;
    for (int h = 0; h < hk; ++h) {
      keys.resize(static_cast<size_t>(len - first) * d);
      values.resize(static_cast<size_t>(len - first) * d);
      for (int32_t t = first; t < len; ++t) {
        const uint8_t* block =
            a.cache.data + int64_t{table[t / layout.block_size]} * cache.block_bytes();
        const int pos = t % layout.block_size;
        cache.Key(block, pos, h, keys.data() + int64_t{t - first} * d);
        cache.Value(block, pos, h, values.data() + int64_t{t - first} * d);
      }
      for (int i = 0; i < q_len; ++i) {
        const int32_t p = len - q_len + i;
        const int32_t lo = a.sliding_window > 0 ? std::max(0, p - a.sliding_window + 1) : 0;
        for (int g = 0; g < group; ++g) {
          const int64_t out_row = int64_t{q_begin + i} * a.num_q_heads + h * group + g;
          for (int e = 0; e < d; ++e)
            q_in[e] = LoadElement(a.query, a.query_dtype, out_row * d + e);
          cache.Query(q_in.data(), q_map.data());
          for (int e = 0; e < d; ++e) q[e] = q_map[e];
          scores.resize(static_cast<size_t>(p + 1 - lo));
          double m = -std::numeric_limits<double>::infinity();
          for (int32_t t = lo; t <= p; ++t) {
            const double* k = keys.data() + int64_t{t - first} * d;
            double dot = 0.0;
            for (int e = 0; e < d; ++e) dot += q[e] * k[e];
            scores[t - lo] = scale * dot;
            m = std::max(m, scores[t - lo]);
          }
          std::fill(acc.begin(), acc.end(), 0.0);
          double sum = 0.0;
          for (int32_t t = lo; t <= p; ++t) {
            const double w = std::exp(scores[t - lo] - m);
            sum += w;
            const double* v = values.data() + int64_t{t - first} * d;
            for (int e = 0; e < d; ++e) acc[e] += w * v[e];
          }
          for (int e = 0; e < d; ++e) {
            StoreElement(a.output, a.output_dtype, out_row * d + e, acc[e] / sum);
          }
          a.lse[out_row] = static_cast<float>(m + std::log(sum));
        }
      }
    }
  }
}

}  // namespace

void AttentionCpu(const Quantizer& quantizer, const AttentionArgs& args) {
  const CacheLayout layout = quantizer.layout();
  ValidateAttentionShapes(kWhere, layout, args);
  ValidateAttentionArrays(kWhere, layout, args);
  Attend(TurboQuantCache{quantizer}, layout, args);
}

void AttentionCpu(const Bf16BlockFormat& format, const AttentionArgs& args) {
  const Bf16BlockFormat checked = CheckBf16BlockFormat(kWhere, format);
  const CacheLayout layout = checked.layout();
  ValidateAttentionShapes(kWhere, layout, args);
  ValidateAttentionArrays(kWhere, layout, args);
  Attend(PlainCache{checked}, layout, args);
}

}  // namespace tqkv
