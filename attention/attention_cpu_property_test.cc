// Property test of AttentionCpu against an independent oracle, over random step batches: every
// preset, head_dim 64 / 128, 1-2 KV heads, GQA groups 1-4, block sizes 16 / 32, 1-4 sequences of
// 1-80 tokens with 0 (padding) to all of them new, with and without a sliding window and a
// softmax scale. The oracle reads each attended token through Quantizer::Dequantize in the
// original space (the keys rotated back, the query not rotated), where AttentionCpu works in the
// keys' rotated space; both in double precision, so they agree to rounding. Query rows of
// padding sequences have none, and no row outside the batch's may be written.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attention/attention_cpu.h"
#include "quant/preset.h"
#include "quant/quantizer.h"
#include "tests/attention_scenario.h"

namespace tqkv {
namespace {

using testing::AttentionScenario;

struct Rows {
  std::vector<double> out, lse;  // [T, Hq, D], [T, Hq]
};

// Query row r of sequence b at context position `pos` attends tokens (pos − window, pos] (all of
// [0, pos] without a window), read through the block table and Dequantize, in fp64.
Rows Oracle(const Quantizer& q, const AttentionScenario& s, int32_t window, double scale) {
  const int d = q.format().head_dim, hk = q.format().num_kv_heads, bs = q.format().block_size;
  const int hq = s.num_q_heads, group = hq / hk;
  const ConstCacheRef cache{s.base.cache.data(), s.base.num_blocks, q.layout()};
  Rows r;
  r.out.assign(static_cast<size_t>(s.num_tokens) * hq * d, 0.0);
  r.lse.assign(static_cast<size_t>(s.num_tokens) * hq, 0.0);
  for (size_t b = 0; b + 1 < s.query_start_loc.size(); ++b) {
    const int q0 = s.query_start_loc[b], q_len = s.query_start_loc[b + 1] - q0;
    const int len = s.base.seq_lens[b];
    for (int i = 0; i < q_len; ++i) {
      const int pos = len - q_len + i;
      const int first = window > 0 ? std::max(0, pos - window + 1) : 0;
      for (int h = 0; h < hq; ++h) {
        const float* query = s.queries.data() + (int64_t{q0 + i} * hq + h) * d;
        std::vector<double> scores;
        std::vector<std::vector<float>> values;
        for (int t = first; t <= pos; ++t) {
          const int64_t slot =
              int64_t{s.base.block_tables[b * s.base.max_blocks + t / bs]} * bs + t % bs;
          const DequantizedSlot kv = q.Dequantize(cache, slot, h / group);
          double dot = 0.0;
          for (int e = 0; e < d; ++e) dot += double{query[e]} * kv.key[e];
          scores.push_back(dot * scale);
          values.push_back(kv.value);
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

RC_GTEST_PROP(AttentionCpuProperty, MatchesDequantizeThenAttendInTheOriginalSpace, ()) {
  const auto presets = AllPresets();
  const Preset& preset = presets[*rc::gen::inRange<size_t>(0, presets.size())];
  const int d = *rc::gen::element(64, 128);
  const int hk = *rc::gen::inRange(1, 3);
  const int group = *rc::gen::inRange(1, 5);
  const int bs = *rc::gen::element(16, 32);
  const int batch = *rc::gen::inRange(1, 5);
  std::vector<int32_t> lens, q_lens;
  for (int b = 0; b < batch; ++b) {
    const int len = *rc::gen::inRange(1, 81);
    lens.push_back(len);
    q_lens.push_back(*rc::gen::inRange(0, std::min(len, 20) + 1));
  }
  const int32_t window = *rc::gen::element(0, 0, 1, 7, 16, 33, 100);
  const bool own_scale = *rc::gen::arbitrary<bool>();
  const double scale = own_scale ? 0.3 : 1.0 / std::sqrt(static_cast<double>(d));
  const auto seed = *rc::gen::inRange<uint64_t>(0, 1u << 20);

  const Quantizer q = Quantizer::Create(preset.name, d, hk, bs);
  const AttentionScenario s = testing::BuildAttention(q, lens, q_lens, hk * group, seed);
  // One spare row past the batch's: AttentionCpu must leave it alone.
  const size_t rows = static_cast<size_t>(s.num_tokens + 1) * hk * group;
  std::vector<float> out(rows * d, NAN), lse(rows, NAN);
  AttentionArgs a = testing::HostArgs(s, s.base.cache, q.layout());
  a.sliding_window = window;
  if (own_scale) a.scale = static_cast<float>(scale);
  a.output = out.data();
  a.lse = lse.data();
  AttentionCpu(q, a);

  const Rows ref = Oracle(q, s, window, own_scale ? double{static_cast<float>(scale)} : scale);
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
