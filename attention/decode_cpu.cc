#include "attention/decode_cpu.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "quant/numerics.h"
#include "quant/packing.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

constexpr const char* kWhere = "DecodeCpu";

void Validate(const Quantizer& quantizer, ConstCacheRef cache, const DecodeInputs& in,
              const DecodeOutputs& out) {
  const BlockFormat& f = quantizer.format();
  CheckCacheLayout(kWhere, quantizer.layout(), cache.layout);
  const int64_t num_blocks = cache.num_blocks;
  if (num_blocks < 0 || num_blocks > kMaxCacheBlocks) {
    throw InvalidArgument(kWhere, "cache.num_blocks", num_blocks,
                          fmt::format("0 to {} (32-bit block ids)", kMaxCacheBlocks));
  }
  if (in.num_seqs < 0) throw InvalidArgument(kWhere, "num_seqs", in.num_seqs, ">= 0");
  if (in.num_q_heads < 1 || in.num_q_heads % f.num_kv_heads != 0) {
    throw InvalidArgument(kWhere, "num_q_heads", in.num_q_heads,
                          fmt::format("a positive multiple of num_kv_heads = {}", f.num_kv_heads));
  }
  if (in.max_blocks_per_seq < 0) {
    throw InvalidArgument(kWhere, "max_blocks_per_seq", in.max_blocks_per_seq, ">= 0");
  }
  if (in.scale && !(std::isfinite(*in.scale) && *in.scale > 0.0f)) {
    throw InvalidArgument(kWhere, "scale", *in.scale, "finite and > 0");
  }
  if (in.token_begin < 0 || in.token_end < in.token_begin) {
    throw InvalidArgument(kWhere, "token range",
                          fmt::format("[{}, {})", in.token_begin, in.token_end),
                          "0 <= token_begin <= token_end");
  }
  if (in.num_seqs == 0) return;
  if (in.query == nullptr || in.block_tables == nullptr || in.seq_lens == nullptr ||
      out.output == nullptr || out.lse == nullptr || cache.data == nullptr) {
    throw Error(fmt::format(
        "{}: query, block_tables, seq_lens, output, lse and cache.data must not be null", kWhere));
  }
  const int64_t rows = int64_t{in.num_seqs} * in.num_q_heads;
  CheckDisjoint(kWhere, {{"output", out.output, rows * f.head_dim * 4},
                         {"lse", out.lse, rows * 4},
                         {"cache", cache.data, std::max<int64_t>(num_blocks, 0) * f.block_bytes},
                         {"query", in.query, rows * f.head_dim * 4},
                         {"seq_lens", in.seq_lens, int64_t{in.num_seqs} * 4},
                         {"block_tables", in.block_tables,
                          int64_t{in.num_seqs} * in.max_blocks_per_seq * 4}});
  const int64_t max_len = int64_t{in.max_blocks_per_seq} * f.block_size;
  for (int b = 0; b < in.num_seqs; ++b) {
    const int32_t len = in.seq_lens[b];
    if (len < 0 || len > max_len) {
      throw InvalidArgument(kWhere, fmt::format("seq_lens[{}]", b), len,
                            fmt::format("0 to {} ({} blocks x {} tokens)", max_len,
                                        in.max_blocks_per_seq, f.block_size));
    }
    // (In int64: a len near 2^31 wrapped the count negative, and no block id was checked.)
    const int64_t used_blocks = (int64_t{len} + f.block_size - 1) / f.block_size;
    for (int64_t i = 0; i < used_blocks; ++i) {
      const int32_t id = in.block_tables[int64_t{b} * in.max_blocks_per_seq + i];
      if (id < 0 || id >= num_blocks) {
        throw InvalidArgument(kWhere, fmt::format("block_tables[{}, {}]", b, i), id,
                              fmt::format("0 to {} (num_blocks {})", num_blocks - 1, num_blocks));
      }
    }
  }
}

}  // namespace

void DecodeCpu(const Quantizer& quantizer, ConstCacheRef cache, const DecodeInputs& in,
               DecodeOutputs out) {
  Validate(quantizer, cache, in, out);
  const BlockFormat& f = quantizer.format();
  const int d = f.head_dim;
  const int group = in.num_q_heads / f.num_kv_heads;
  const double scale = in.scale ? *in.scale : 1.0 / std::sqrt(static_cast<double>(d));
  const std::vector<float>& centroids = quantizer.codebook().centroids;

  std::vector<float> q_rot(d);
  std::vector<double> q(d), acc(d), scores;
  std::vector<float> key(d), value(d);
  for (int b = 0; b < in.num_seqs; ++b) {
    const int32_t len = in.seq_lens[b];
    const int32_t begin = std::min(in.token_begin, len);
    const int32_t end = std::min(in.token_end, len);
    for (int hq = 0; hq < in.num_q_heads; ++hq) {
      const int h = hq / group;
      quantizer.RotateQuery(in.query + (int64_t{b} * in.num_q_heads + hq) * d, q_rot.data());
      for (int i = 0; i < d; ++i) q[i] = q_rot[i];
      scores.assign(static_cast<size_t>(end - begin), 0.0);
      double max_score = -std::numeric_limits<double>::infinity();
      for (int32_t t = begin; t < end; ++t) {
        const int32_t block_id =
            in.block_tables[int64_t{b} * in.max_blocks_per_seq + t / f.block_size];
        const uint8_t* block = cache.data + int64_t{block_id} * f.block_bytes;
        const int pos = t % f.block_size;
        const uint8_t* codes = block + f.KeyCodesOffset(pos, h);
        double dot = 0.0;
        if (f.fp8_keys) {
          for (int i = 0; i < d; ++i) dot += q[i] * E4M3ToFloat(codes[i]);
        } else {
          for (int i = 0; i < d; ++i) dot += q[i] * centroids[UnpackCode(codes, i, f.key_bits)];
          dot *= HalfBitsToFloat(LoadHalfBits(block + f.MetaOffset(MetaField::kKeyNorm, pos, h)));
        }
        scores[t - begin] = scale * dot;
        max_score = std::max(max_score, scores[t - begin]);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      double sum = 0.0;
      for (int32_t t = begin; t < end; ++t) {
        const int32_t block_id =
            in.block_tables[int64_t{b} * in.max_blocks_per_seq + t / f.block_size];
        const uint8_t* block = cache.data + int64_t{block_id} * f.block_bytes;
        const int pos = t % f.block_size;
        const double p = std::exp(scores[t - begin] - max_score);
        sum += p;
        const float vs =
            HalfBitsToFloat(LoadHalfBits(block + f.MetaOffset(MetaField::kValueScale, pos, h)));
        const float vz =
            HalfBitsToFloat(LoadHalfBits(block + f.MetaOffset(MetaField::kValueZero, pos, h)));
        const uint8_t* codes = block + f.ValueCodesOffset(pos, h);
        for (int i = 0; i < d; ++i) {
          acc[i] += p * std::fma(static_cast<float>(UnpackCode(codes, i, f.value_bits)), vs, vz);
        }
      }
      float* o = out.output + (int64_t{b} * in.num_q_heads + hq) * d;
      float& lse = out.lse[int64_t{b} * in.num_q_heads + hq];
      if (end <= begin) {
        std::fill(o, o + d, 0.0f);
        lse = -std::numeric_limits<float>::infinity();
      } else {
        for (int i = 0; i < d; ++i) o[i] = static_cast<float>(acc[i] / sum);
        lse = static_cast<float>(max_score + std::log(sum));
      }
    }
  }
}

void MergeAttentionStates(const float* out_a, float lse_a, const float* out_b, float lse_b,
                          int head_dim, float* out, float* lse) {
  const double m = std::max(lse_a, lse_b);
  if (m == -std::numeric_limits<double>::infinity()) {  // both empty
    std::fill(out, out + head_dim, 0.0f);
    *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  const double wa = std::exp(double(lse_a) - m), wb = std::exp(double(lse_b) - m);
  const double total = wa + wb;
  for (int i = 0; i < head_dim; ++i) {
    out[i] = static_cast<float>((wa * out_a[i] + wb * out_b[i]) / total);
  }
  *lse = static_cast<float>(m + std::log(total));
}

void ReferenceAttention(const float* q, const float* k, const float* v, int seq_len,
                        int num_q_heads, int num_kv_heads, int head_dim, double scale, double* out,
                        double* lse) {
  const int group = num_q_heads / num_kv_heads;
  std::vector<double> s(static_cast<size_t>(seq_len));
  for (int hq = 0; hq < num_q_heads; ++hq) {
    const int h = hq / group;
    double m = -std::numeric_limits<double>::infinity();
    for (int t = 0; t < seq_len; ++t) {
      double dot = 0.0;
      for (int i = 0; i < head_dim; ++i) {
        dot += double(q[hq * head_dim + i]) * k[(int64_t{t} * num_kv_heads + h) * head_dim + i];
      }
      s[t] = scale * dot;
      m = std::max(m, s[t]);
    }
    double sum = 0.0;
    double* o = out + int64_t{hq} * head_dim;
    std::fill(o, o + head_dim, 0.0);
    for (int t = 0; t < seq_len; ++t) {
      const double p = std::exp(s[t] - m);
      sum += p;
      for (int i = 0; i < head_dim; ++i)
        o[i] += p * v[(int64_t{t} * num_kv_heads + h) * head_dim + i];
    }
    if (seq_len == 0) {
      lse[hq] = -std::numeric_limits<double>::infinity();
      continue;
    }
    for (int i = 0; i < head_dim; ++i) o[i] /= sum;
    lse[hq] = m + std::log(sum);
  }
}

}  // namespace tqkv
