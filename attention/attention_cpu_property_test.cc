// Property test of AttentionCpu against an independent oracle, over random step batches: every
// preset and the bf16 / fp16 caches, head_dim 64 / 128, 1-2 KV heads, GQA groups 1-4, block sizes
// 16 / 32, 1-4 sequences of 1-80 tokens with 0 (padding) to 20 of them new, with and without a
// sliding window and a softmax scale. The oracle reads a TurboQuant cache's tokens through the
// block tables by Quantizer::Dequantize, in the original space (the keys rotated back, the query
// not rotated), where AttentionCpu works in the keys' rotated space; a plain cache's as the K/V
// were generated (rounded to its type), by position. Both in double precision, so they agree to
// rounding. No row outside the batch's may be written.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attention/attention_cpu.h"
#include "quant/block_format.h"
#include "quant/preset.h"
#include "quant/quantizer.h"
#include "tests/attention_scenario.h"

namespace tqkv {
namespace {

using testing::AttentionScenario;

struct Rows {
  std::vector<double> out, lse;  // [T, Hq, D], [T, Hq]
};

// Token t of sequence b, KV head kvh: its key (in the original space) and value.
using ReadToken = std::function<void(int b, int t, int kvh, std::vector<double>& key,
                                     std::vector<double>& value)>;

// Query row i of sequence b at context position pos = seq_len − q_len + i attends tokens
// (pos − window, pos] (all of [0, pos] without a window), in fp64.
Rows Oracle(const AttentionScenario& s, int d, int hk, int32_t window, double scale,
            const ReadToken& read) {
  const int hq = s.num_q_heads, group = hq / hk;
  Rows r;
  r.out.assign(static_cast<size_t>(s.num_tokens) * hq * d, 0.0);
  r.lse.assign(static_cast<size_t>(s.num_tokens) * hq, 0.0);
  std::vector<double> key(d), value(d);
  for (size_t b = 0; b + 1 < s.query_start_loc.size(); ++b) {
    const int q0 = s.query_start_loc[b], q_len = s.query_start_loc[b + 1] - q0;
    const int len = s.base.seq_lens[b];
    for (int i = 0; i < q_len; ++i) {
      const int pos = len - q_len + i;
      const int first = window > 0 ? std::max(0, pos - window + 1) : 0;
      for (int h = 0; h < hq; ++h) {
        const float* query = s.queries.data() + (int64_t{q0 + i} * hq + h) * d;
        std::vector<double> scores;
        std::vector<std::vector<double>> values;
        for (int t = first; t <= pos; ++t) {
          read(static_cast<int>(b), t, h / group, key, value);
          double dot = 0.0;
          for (int e = 0; e < d; ++e) dot += double{query[e]} * key[e];
          scores.push_back(dot * scale);
          values.push_back(value);
        }
        const double m = *std::max_element(scores.begin(), scores.end());
        double sum = 0.0;
        std::vector<double> acc(d, 0.0);
        for (size_t t = 0; t < scores.size(); ++t) {
          const double w = std::exp(scores[t] - m);
          sum += w;
          for (int e = 0; e < d; ++e) acc[e] += w * values[t][e];
        }
        const int64_t row = int64_t{q0 + i} * hq + h;
        for (int e = 0; e < d; ++e) r.out[row * d + e] = acc[e] / sum;
        r.lse[row] = m + std::log(sum);
      }
    }
  }
  return r;
}

RC_GTEST_PROP(AttentionCpuProperty, MatchesAttentionOverTheDequantizedTokens, ()) {
  const auto presets = AllPresets();
  // Uniform choices: rapidcheck's integer ranges grow with the case number (small values first).
  auto any = [](int lo, int hi) { return *rc::gen::resize(100, rc::gen::inRange(lo, hi + 1)); };
  // A preset, or past them the bf16 (then fp16) cache.
  const size_t kind = static_cast<size_t>(any(0, static_cast<int>(presets.size()) + 1));
  const int d = *rc::gen::element(64, 128);
  const int hk = any(1, 2);
  const int group = any(1, 4);
  const int bs = *rc::gen::element(16, 32);
  const int batch = any(1, 4);
  std::vector<int32_t> lens, q_lens;
  for (int b = 0; b < batch; ++b) {
    const int len = any(1, 80);
    lens.push_back(len);
    q_lens.push_back(any(b == 0 ? 1 : 0, std::min(len, 20)));  // the first has a new token
  }
  const int32_t window = *rc::gen::element(0, 0, 1, 7, 16, 33, 50);
  const bool own_scale = *rc::gen::arbitrary<bool>();
  const auto seed = *rc::gen::inRange<uint64_t>(0, 1u << 20);
  const double scale = own_scale ? double{0.3f} : 1.0 / std::sqrt(static_cast<double>(d));

  const bool plain = kind >= presets.size();
  const Quantizer q = Quantizer::Create(plain ? presets[0].name : presets[kind].name, d, hk, bs);
  AttentionScenario s = testing::BuildAttention(q, lens, q_lens, hk * group, seed);
  const Bf16BlockFormat f =
      MakeBf16BlockFormat(d, hk, bs, kind == presets.size() ? DType::kBF16 : DType::kF16);
  // The plain cache holds the K/V rounded to its type (StorePlain rounds s.base.keys / values).
  const std::vector<uint8_t> cache = plain ? testing::StorePlain(s, f) : s.base.cache;

  // One spare row past the batch's: AttentionCpu must leave it alone.
  const size_t rows = static_cast<size_t>(s.num_tokens + 1) * hk * group;
  std::vector<float> out(rows * d, NAN), lse(rows, NAN);
  AttentionArgs a = testing::HostArgs(s, cache, plain ? f.layout() : q.layout());
  a.sliding_window = window;
  if (own_scale) a.scale = 0.3f;
  a.output = out.data();
  a.lse = lse.data();
  if (plain) {
    AttentionCpu(f, a);
  } else {
    AttentionCpu(q, a);
  }

  const ConstCacheRef ref_cache{s.base.cache.data(), s.base.num_blocks, q.layout()};
  const ReadToken read = [&](int b, int t, int kvh, std::vector<double>& key,
                             std::vector<double>& value) {
    if (plain) {
      const int64_t at = (int64_t{t} * hk + kvh) * d;
      for (int e = 0; e < d; ++e) {
        key[e] = s.base.keys[b][at + e];
        value[e] = s.base.values[b][at + e];
      }
      return;
    }
    const int64_t slot = int64_t{s.base.block_tables[b * s.base.max_blocks + t / bs]} * bs + t % bs;
    const DequantizedSlot kv = q.Dequantize(ref_cache, slot, kvh);
    for (int e = 0; e < d; ++e) {
      key[e] = kv.key[e];
      value[e] = kv.value[e];
    }
  };
  const Rows ref = Oracle(s, d, hk, window, scale, read);
  const size_t used = static_cast<size_t>(s.num_tokens) * hk * group;
  for (size_t i = 0; i < used; ++i) {
    RC_ASSERT(std::abs(lse[i] - ref.lse[i]) <= 1e-5 * std::max(1.0, std::abs(ref.lse[i])));
  }
  for (size_t i = 0; i < used * d; ++i) {
    RC_ASSERT(std::abs(out[i] - ref.out[i]) <= 1e-5 * (1.0 + std::abs(ref.out[i])));
  }
  for (size_t i = used; i < rows; ++i) RC_ASSERT(std::isnan(lse[i]));
  for (size_t i = used * d; i < rows * d; ++i) RC_ASSERT(std::isnan(out[i]));
}

}  // namespace
}  // namespace tqkv
