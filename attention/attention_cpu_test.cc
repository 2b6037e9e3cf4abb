#include "attention/attention_cpu.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "attention/decode_cpu.h"
#include "kvcache/manager.h"
#include "kvcache/step_batch.h"
#include "quant/numerics.h"
#include "runtime/error.h"
#include "tests/attention_scenario.h"

namespace tqkv {
namespace {

using testing::AttentionScenario;
using testing::BuildAttention;
using ::testing::HasSubstr;

const char* const kPresetNames[] = {"turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                                    "turboquant_3bit_nc"};

struct Result {
  std::vector<float> out, lse;
};

Result RunCpu(const Quantizer& q, const AttentionScenario& s, int32_t window = 0) {
  Result r;
  r.out.assign(static_cast<size_t>(s.num_tokens) * s.num_q_heads * q.format().head_dim, NAN);
  r.lse.assign(static_cast<size_t>(s.num_tokens) * s.num_q_heads, NAN);
  AttentionArgs a = testing::HostArgs(s, s.base.cache, q.layout());
  a.sliding_window = window;
  a.output = r.out.data();
  a.lse = r.lse.data();
  AttentionCpu(q, a);
  return r;
}

// One decode (DecodeCpu, an independent implementation of the one-token case) of query row
// `row` over tokens [begin, end) of sequence b.
Result DecodeOne(const Quantizer& q, const AttentionScenario& s, int b, int row, int32_t begin,
                 int32_t end) {
  const int d = q.format().head_dim, hq = s.num_q_heads;
  Result r;
  r.out.assign(static_cast<size_t>(hq) * d, NAN);
  r.lse.assign(hq, NAN);
  DecodeInputs in;
  in.query = s.queries.data() + int64_t{row} * hq * d;
  in.num_seqs = 1;
  in.num_q_heads = hq;
  in.block_tables = s.base.block_tables.data() + int64_t{b} * s.base.max_blocks;
  in.max_blocks_per_seq = s.base.max_blocks;
  in.seq_lens = &end;
  in.token_begin = begin;
  DecodeCpu(q, {s.base.cache.data(), s.base.num_blocks, q.layout()}, in,
            {r.out.data(), r.lse.data()});
  return r;
}

void ExpectRowsMatch(const Result& r, const Result& ref, int row, int hq, int d,
                     const std::string& what) {
  for (int h = 0; h < hq; ++h) {
    const float l = r.lse[int64_t{row} * hq + h], rl = ref.lse[h];
    ASSERT_NEAR(l, rl, 1e-6 * std::max(1.0f, std::abs(rl))) << what << " row " << row << " h " << h;
    for (int i = 0; i < d; ++i) {
      const float o = r.out[(int64_t{row} * hq + h) * d + i], ro = ref.out[int64_t{h} * d + i];
      ASSERT_NEAR(o, ro, 1e-6 * (1 + std::abs(ro))) << what << " row " << row << " h " << h;
    }
  }
}

// New token i of a sequence whose context ends at L attends exactly as a one-token decode over
// the first L − q_len + i + 1 tokens would: causal within the new tokens, every preset, GQA
// groups 1-4, block sizes 16 and 32, q_len from 1 (decode) to longer than a block; sequences of
// q_len 0 (padding rows) produce nothing.
TEST(AttentionCpuTest, EachNewTokenAttendsLikeADecodeOfItsPrefix) {
  for (const char* preset : kPresetNames) {
    for (int d : {64, 128}) {
      for (int group : {1, 3}) {
        for (int bs : {16, 32}) {
          const int hk = 2;
          const Quantizer q = Quantizer::Create(preset, d, hk, bs);
          const std::vector<int32_t> lens = {1, 5, 40, 70, 9};
          const std::vector<int32_t> q_lens = {1, 5, 33, 4, 0};
          const AttentionScenario s = BuildAttention(q, lens, q_lens, hk * group, 99 + d + bs);
          const Result r = RunCpu(q, s);
          for (size_t b = 0; b < lens.size(); ++b) {
            for (int i = 0; i < q_lens[b]; ++i) {
              const int row = s.query_start_loc[b] + i;
              const Result ref =
                  DecodeOne(q, s, static_cast<int>(b), row, 0, lens[b] - q_lens[b] + i + 1);
              ExpectRowsMatch(r, ref, row, hk * group, d,
                              std::string(preset) + " D=" + std::to_string(d) +
                                  " group=" + std::to_string(group) + " bs=" + std::to_string(bs));
            }
          }
        }
      }
    }
  }
}

// A manager with a sliding window releases blocks as its sequences move on; attention with the
// same window over its batches must read only blocks the manager keeps. Chunked prefills and
// decode steps of three sequences run through two managers, one releasing behind a 40-token
// window and one keeping everything, with the same K/V stored into each manager's own cache.
// Before every store, each block outside the windowed manager's tables (the null block
// included) is filled with NaN bytes: a read of a released block would show as NaN. The
// outputs agree bit for bit.
TEST(AttentionCpuTest, ManagerDrivenSlidingWindowReadsOnlyKeptBlocks) {
  constexpr int kD = 64, kHk = 2, kHq = 4, kBlock = 16, kWindow = 40, kBlocks = 64, kChunk = 24;
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", kD, kHk, kBlock);
  const int64_t block_bytes = q.format().block_bytes;
  struct Side {
    std::optional<KVCacheManager> m;
    std::vector<uint8_t> cache;
    StepBatch batch;
    std::vector<SeqId> seqs;
  } sides[2];
  for (int w = 0; w < 2; ++w) {
    KVCacheManagerOptions o;
    o.num_blocks = kBlocks;
    o.block_size = kBlock;
    o.format = FormatTag{"turboquant_4bit_nc", kD, kBlock, q.rotation().id};
    o.sliding_window = w == 0 ? kWindow : 0;
    sides[w].m.emplace(o);
    sides[w].cache.assign(static_cast<size_t>(kBlocks * block_bytes), 0);
  }
  const std::vector<int> prompt_lens = {70, 33, 5};
  std::vector<int> computed(prompt_lens.size(), 0);
  for (size_t i = 0; i < prompt_lens.size(); ++i) {
    std::vector<int32_t> prompt(static_cast<size_t>(prompt_lens[i]));
    for (int t = 0; t < prompt_lens[i]; ++t) prompt[t] = static_cast<int32_t>(100 * i + t);
    for (Side& side : sides) side.seqs.push_back(side.m->AddSequence(prompt));
  }
  // K/V and queries of a (sequence, position): the same on both sides.
  auto fill = [](std::vector<float>& v, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n;
    for (float& x : v) x = n(rng);
  };
  int windowed_rows = 0;
  for (int step = 0; step < 40; ++step) {
    std::vector<StepRequest> reqs;
    std::vector<std::pair<int, int>> rows;  // (sequence, position) of each new token
    for (size_t i = 0; i < prompt_lens.size(); ++i) {
      const int n =
          computed[i] < prompt_lens[i] ? std::min(kChunk, prompt_lens[i] - computed[i]) : 1;
      for (int t = 0; t < n; ++t) rows.emplace_back(static_cast<int>(i), computed[i] + t);
      reqs.push_back({sides[0].seqs[i], n, 0});
    }
    const int tokens = static_cast<int>(rows.size());
    std::vector<float> key(static_cast<size_t>(tokens) * kHk * kD), value(key.size()),
        query(static_cast<size_t>(tokens) * kHq * kD);
    for (int r = 0; r < tokens; ++r) {
      const uint64_t seed = 1000003ull * rows[r].first + static_cast<uint64_t>(rows[r].second);
      std::vector<float> k(kHk * kD), v(kHk * kD), qr(kHq * kD);
      fill(k, seed * 3);
      fill(v, seed * 3 + 1);
      fill(qr, seed * 3 + 2);
      std::copy(k.begin(), k.end(), key.begin() + int64_t{r} * kHk * kD);
      std::copy(v.begin(), v.end(), value.begin() + int64_t{r} * kHk * kD);
      std::copy(qr.begin(), qr.end(), query.begin() + int64_t{r} * kHq * kD);
    }
    std::vector<float> out[2], lse[2];
    for (int w = 0; w < 2; ++w) {
      Side& side = sides[w];
      for (size_t i = 0; i < reqs.size(); ++i) reqs[i].seq = side.seqs[i];
      ASSERT_TRUE(side.m->Schedule(reqs, side.batch).admitted) << "step " << step;
      if (w == 0) {
        std::vector<bool> kept(kBlocks, false);
        for (SeqId s : side.seqs) {
          for (int32_t b : side.m->BlockTable(s)) {
            if (b != kNullBlock) kept[static_cast<size_t>(b)] = true;
          }
        }
        for (int b = 0; b < kBlocks; ++b) {
          if (!kept[b])
            std::fill_n(side.cache.data() + b * block_bytes, block_bytes, uint8_t{0xff});
        }
      }
      StoreInputs in;
      in.key = key.data();
      in.value = value.data();
      in.slot_mapping = side.batch.slot_mapping().data();
      in.num_tokens = tokens;
      q.StoreCpu(in, {side.cache.data(), kBlocks, q.layout()});
      out[w].assign(static_cast<size_t>(tokens) * kHq * kD, NAN);
      lse[w].assign(static_cast<size_t>(tokens) * kHq, NAN);
      AttentionArgs a;
      a.query = query.data();
      a.num_seqs = static_cast<int>(reqs.size());
      a.num_tokens = tokens;
      a.num_q_heads = kHq;
      a.query_start_loc = side.batch.query_start_loc().data();
      a.seq_lens = side.batch.seq_lens().data();
      a.block_tables = side.batch.block_tables().data();
      a.max_blocks_per_seq = side.batch.block_table_width();
      a.cache = {side.cache.data(), kBlocks, q.layout()};
      a.sliding_window = kWindow;
      a.output = out[w].data();
      a.lse = lse[w].data();
      AttentionCpu(q, a);
    }
    for (size_t i = 0; i < out[0].size(); ++i) {
      ASSERT_TRUE(std::isfinite(out[0][i])) << "step " << step << ": a released block was read";
      ASSERT_EQ(out[0][i], out[1][i]) << "step " << step;
    }
    EXPECT_EQ(lse[0], lse[1]) << "step " << step;
    for (const auto& [i, pos] : rows) windowed_rows += pos >= kWindow;
    for (size_t i = 0; i < prompt_lens.size(); ++i) {
      computed[i] += reqs[i].num_new_tokens;
      const bool sampled = computed[i] >= prompt_lens[i];
      for (Side& side : sides) {
        side.m->Commit(side.seqs[i], sampled ? std::vector<int32_t>{7} : std::vector<int32_t>{});
      }
    }
  }
  EXPECT_GT(windowed_rows, 60);
  // The windowed manager released blocks behind its sequences; the other kept them all.
  EXPECT_LT(sides[0].m->Stats().blocks_in_use, sides[1].m->Stats().blocks_in_use);
}

// With a sliding window W, the query at position p reads (p − W, p]: the decode of that range.
TEST(AttentionCpuTest, SlidingWindowReadsTheLastWindowTokens) {
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 64, 2, 16);
  const std::vector<int32_t> lens = {100, 30};
  const std::vector<int32_t> q_lens = {20, 30};
  const AttentionScenario s = BuildAttention(q, lens, q_lens, 4, 7);
  for (int32_t w : {1, 16, 37, 1000}) {
    const Result r = RunCpu(q, s, w);
    for (int b = 0; b < 2; ++b) {
      for (int i = 0; i < q_lens[b]; ++i) {
        const int32_t p = lens[b] - q_lens[b] + i;
        const int row = s.query_start_loc[b] + i;
        const Result ref = DecodeOne(q, s, b, row, std::max(0, p - w + 1), p + 1);
        ExpectRowsMatch(r, ref, row, 4, 64, "window " + std::to_string(w));
      }
    }
  }
}

// An uncompressed cache: fp64 attention over the K/V as stored (rounded to bf16 / fp16).
TEST(AttentionCpuTest, PlainCachesMatchAttentionOverTheStoredValues) {
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const int d = 64, hk = 2, group = 2, hq = hk * group, bs = 16;
    const Quantizer any = Quantizer::Create("turboquant_k8v4", d, hk, bs);
    AttentionScenario s = BuildAttention(any, {50, 17}, {10, 17}, hq, 3);
    const Bf16BlockFormat f = MakeBf16BlockFormat(d, hk, bs, dtype);
    const std::vector<uint8_t> cache = testing::StorePlain(s, f);
    std::vector<float> out(static_cast<size_t>(s.num_tokens) * hq * d), lse(s.num_tokens * hq);
    AttentionArgs a = testing::HostArgs(s, cache, f.layout());
    a.output = out.data();
    a.lse = lse.data();
    AttentionCpu(f, a);
    for (int b = 0; b < 2; ++b) {
      const int32_t len = s.base.seq_lens[b];
      const int32_t q_len = s.query_start_loc[b + 1] - s.query_start_loc[b];
      for (int i = 0; i < q_len; ++i) {
        const int row = s.query_start_loc[b] + i;
        std::vector<double> o(size_t(hq) * d), l(hq);
        ReferenceAttention(s.queries.data() + int64_t{row} * hq * d, s.base.keys[b].data(),
                           s.base.values[b].data(), len - q_len + i + 1, hq, hk, d,
                           1.0 / std::sqrt(double(d)), o.data(), l.data());
        for (int h = 0; h < hq; ++h) {
          ASSERT_NEAR(lse[int64_t{row} * hq + h], l[h], 1e-6 * std::max(1.0, std::abs(l[h])));
          for (int e = 0; e < d; ++e) {
            ASSERT_NEAR(out[(int64_t{row} * hq + h) * d + e], o[h * d + e],
                        1e-6 * (1 + std::abs(o[h * d + e])));
          }
        }
      }
    }
  }
}

// F16 / BF16 queries are read as such and outputs are the F32 result rounded to nearest.
TEST(AttentionCpuTest, HalfPrecisionQueriesAndOutputs) {
  const Quantizer q = Quantizer::Create("turboquant_k3v4_nc", 128, 2, 16);
  AttentionScenario s = BuildAttention(q, {40, 20}, {8, 3}, 8, 5);
  for (float& x : s.queries) x = BFloat16BitsToFloat(FloatToBFloat16Bits(x));
  const Result f32 = RunCpu(q, s);
  std::vector<uint16_t> q16(s.queries.size());
  for (size_t i = 0; i < q16.size(); ++i) q16[i] = FloatToBFloat16Bits(s.queries[i]);
  for (DType out_type : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> out(f32.out.size());
    std::vector<float> lse(f32.lse.size());
    AttentionArgs a = testing::HostArgs(s, s.base.cache, q.layout());
    a.query = q16.data();
    a.query_dtype = DType::kBF16;
    a.output = out.data();
    a.output_dtype = out_type;
    a.lse = lse.data();
    AttentionCpu(q, a);
    EXPECT_EQ(lse, f32.lse);
    for (size_t i = 0; i < out.size(); ++i) {
      const uint16_t want =
          out_type == DType::kF16 ? FloatToHalfBits(f32.out[i]) : FloatToBFloat16Bits(f32.out[i]);
      ASSERT_EQ(out[i], want) << i;
    }
  }
}

// A token's values spanning fp16's whole range dequantize past its largest finite value (the fp16
// value scale rounds up: −65504 + 15 · 8736 = 65536). F16 outputs saturate to ±65504 rather than
// becoming inf; NaN stays NaN.
TEST(AttentionCpuTest, F16OutputsSaturateAtTheLargestFiniteValue) {
  for (const char* preset : {"turboquant_4bit_nc", "turboquant_3bit_nc"}) {
    const int d = 64, bs = 16;
    const Quantizer q = Quantizer::Create(preset, d, 1, bs);
    std::vector<uint8_t> cache(2 * q.format().block_bytes, 0);
    std::vector<float> k(d), v(d), query(d, 0.0f);
    for (int i = 0; i < d; ++i) {
      k[i] = static_cast<float>(i % 7) - 3.0f;
      v[i] = i % 2 == 0 ? 65504.0f : -65504.0f;
    }
    q.EncodeSlot(k.data(), v.data(), cache.data() + q.format().block_bytes, 0, 0);
    const std::vector<float> dequantized = q.Dequantize({cache.data(), 2, q.layout()}, bs, 0).value;
    ASSERT_GT(*std::max_element(dequantized.begin(), dequantized.end()), 65520.0f)
        << preset << ": the premise (a value fp16 rounds to inf) no longer holds";
    const int32_t table[] = {1}, lens[] = {1}, starts[] = {0, 1};
    for (const bool nan_query : {false, true}) {
      if (nan_query) query[0] = NAN;
      std::vector<uint16_t> out(d, 0);
      float lse = 0.0f;
      AttentionArgs a;
      a.query = query.data();
      a.query_dtype = DType::kF32;
      a.num_seqs = 1;
      a.num_tokens = 1;
      a.num_q_heads = 1;
      a.query_start_loc = starts;
      a.seq_lens = lens;
      a.block_tables = table;
      a.max_blocks_per_seq = 1;
      a.cache = {cache.data(), 2, q.layout()};
      a.output = out.data();
      a.output_dtype = DType::kF16;
      a.lse = &lse;
      AttentionCpu(q, a);
      for (int i = 0; i < d; ++i) {
        if (nan_query) {
          ASSERT_TRUE(std::isnan(HalfBitsToFloat(out[i]))) << preset << " " << i;
        } else {
          ASSERT_EQ(out[i], FloatToHalfBitsClamped(dequantized[i])) << preset << " " << i;
          ASSERT_TRUE(std::isfinite(HalfBitsToFloat(out[i]))) << preset << " " << i;
        }
      }
    }
  }
}
// Bad input throws, naming the argument, its value and what is allowed, and writes nothing.
TEST(AttentionCpuTest, InvalidArgumentsThrowAndWriteNothing) {
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 64, 2, 16);
  AttentionScenario s = BuildAttention(q, {30, 20}, {5, 2}, 4, 11);
  std::vector<float> out(static_cast<size_t>(s.num_tokens) * 4 * 64, -7.0f),
      lse(s.num_tokens * 4, -7.0f);
  auto expect_throw = [&](AttentionArgs a, const std::string& text) {
    a.output = out.data();
    a.lse = lse.data();
    try {
      AttentionCpu(q, a);
      ADD_FAILURE() << "no error for " << text;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(text));
    }
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0f; }));
    EXPECT_TRUE(std::all_of(lse.begin(), lse.end(), [](float x) { return x == -7.0f; }));
  };
  const AttentionArgs good = testing::HostArgs(s, s.base.cache, q.layout());
  AttentionArgs a = good;
  a.num_q_heads = 3;
  expect_throw(a, "num_q_heads = 3; allowed: a positive multiple of num_kv_heads = 2");
  a = good;
  a.query_dtype = DType::kI32;
  expect_throw(a, "query_dtype = I32");
  a = good;
  a.sliding_window = -1;
  expect_throw(a, "sliding_window = -1");
  std::vector<int32_t> loc = s.query_start_loc;
  loc[1] = 9;  // past num_tokens
  a = good;
  a.query_start_loc = loc.data();
  expect_throw(a, "query_start_loc[1] = 9; allowed: 0 (query_start_loc[0]) to num_tokens = 7");
  loc = s.query_start_loc;
  loc[0] = 1;
  a.query_start_loc = loc.data();
  expect_throw(a, "query_start_loc[0] = 1; allowed: 0");
  std::vector<int32_t> lens = s.base.seq_lens;
  lens[1] = 1;  // shorter than its 2 new tokens
  a = good;
  a.seq_lens = lens.data();
  expect_throw(a, "seq_lens[1] = 1; allowed: the query length 2 to");
  std::vector<int32_t> tables = s.base.block_tables;
  tables[1] = static_cast<int32_t>(s.base.num_blocks);
  a = good;
  a.block_tables = tables.data();
  expect_throw(a, "block_tables[0, 1]");
  a = good;
  a.num_tokens = 8;
  expect_throw(a, "num_tokens = 8");
  a = good;
  a.scale = -1.0f;
  expect_throw(a, "scale = -1");
  a = good;  // past 32-bit block ids (the cache's byte size would overflow int64 further on)
  a.cache.num_blocks = int64_t{1} << 60;
  expect_throw(a, "cache.num_blocks = 1152921504606846976");
  // A cache of another layout: its blocks would be read at the wrong offsets.
  const CacheLayout own = q.layout();
  for (const CacheLayout& other :
       {CacheLayout{"turboquant_k3v4_nc", own.head_dim, own.num_kv_heads, own.block_size},
        CacheLayout{own.format, own.head_dim, own.num_kv_heads, 2 * own.block_size},
        CacheLayout{own.format, own.head_dim, 2 * own.num_kv_heads, own.block_size},
        MakeBf16BlockFormat(own.head_dim, own.num_kv_heads, own.block_size).layout(),
        CacheLayout{}}) {
    a = good;
    a.cache.layout = other;
    expect_throw(a, fmt::format("invalid cache.layout = ({}); allowed: the layout this call was "
                                "made for ({})",
                                DescribeLayout(other), DescribeLayout(own)));
  }
  // Outputs over inputs, or over each other: the lse over the query had overwritten query rows
  // still to be read. (expect_throw sets output and lse; these set the query.)
  {
    std::vector<float> shared = s.queries;
    a = good;
    a.query = shared.data();
    AttentionArgs over = a;
    over.output = shared.data() + 64;  // inside the query
    over.lse = lse.data();
    EXPECT_THAT([&] { AttentionCpu(q, over); },
                ::testing::ThrowsMessage<Error>(HasSubstr("output (")));
    over.output = out.data();
    over.lse = out.data() + 8;  // inside the output
    EXPECT_THAT([&] { AttentionCpu(q, over); },
                ::testing::ThrowsMessage<Error>(::testing::AllOf(
                    HasSubstr("output ("), HasSubstr("lse ("), HasSubstr("overlap"))));
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0f; }));
    EXPECT_EQ(shared, s.queries);
  }
  // An output or lse over the cache would change the cache: refused, the cache bytes unchanged.
  {
    std::vector<uint8_t> cache(good.cache.data,
                               good.cache.data + good.cache.num_blocks * q.format().block_bytes);
    const std::vector<uint8_t> before = cache;
    a = good;
    a.cache.data = cache.data();
    a.output = cache.data() + cache.size() - 64;  // its last bytes under the first output row
    a.lse = lse.data();
    EXPECT_THAT([&] { AttentionCpu(q, a); },
                ::testing::ThrowsMessage<Error>(::testing::AllOf(
                    HasSubstr("output ("), HasSubstr("cache ("), HasSubstr("overlap"))));
    a.output = out.data();
    a.lse = reinterpret_cast<float*>(cache.data());
    EXPECT_THAT([&] { AttentionCpu(q, a); },
                ::testing::ThrowsMessage<Error>(::testing::AllOf(
                    HasSubstr("cache ("), HasSubstr("lse ("), HasSubstr("overlap"))));
    EXPECT_EQ(cache, before);
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0f; }));
  }
  // A start that decreases after a valid one is named, not the length it makes look wrong.
  AttentionScenario three = BuildAttention(q, {30, 20, 12}, {5, 2, 3}, 4, 12);
  std::vector<int32_t> loc3 = three.query_start_loc;  // {0, 5, 7, 10}
  loc3[2] = 1;
  AttentionArgs b = testing::HostArgs(three, three.base.cache, q.layout());
  b.query_start_loc = loc3.data();
  std::vector<float> out3(static_cast<size_t>(three.num_tokens) * 4 * 64),
      lse3(three.num_tokens * 4);
  b.output = out3.data();
  b.lse = lse3.data();
  EXPECT_THAT([&] { AttentionCpu(q, b); },
              ::testing::ThrowsMessage<Error>(HasSubstr("query_start_loc[2] = 1")));
  // A plain-cache format not made by MakeBf16BlockFormat (no KV heads; F32 elements).
  a = good;
  a.output = out.data();
  a.lse = lse.data();
  EXPECT_THAT([&] { AttentionCpu(Bf16BlockFormat{}, a); },
              ::testing::ThrowsMessage<Error>(HasSubstr("head_dim")));
  Bf16BlockFormat f32 = MakeBf16BlockFormat(64, 2, 16, DType::kBF16);
  f32.dtype = DType::kF32;
  EXPECT_THAT([&] { AttentionCpu(f32, a); }, ::testing::ThrowsMessage<Error>(HasSubstr("F32")));
  // Right sizes, but the values where the keys are: it read keys as values.
  Bf16BlockFormat moved = MakeBf16BlockFormat(64, 2, 16, DType::kBF16);
  moved.value_offset = 0;
  EXPECT_THAT([&] { AttentionCpu(moved, a); },
              ::testing::ThrowsMessage<Error>(
                  HasSubstr(fmt::format("format.value_offset = 0; allowed: {}", 2 * 16 * 2 * 64))));
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0f; }));
}

}  // namespace
}  // namespace tqkv
