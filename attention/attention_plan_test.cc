// CudaAttention::Plan's split of the context for the chunk and prefill kernels
// (ChooseChunkSplits), on the host: the limits every choice keeps, and the choices measured
// fastest on the H100 (132 SMs; Llama-3-8B layer: 32 query heads, 8 KV heads, head_dim 128).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>

#include "attention/attention_cuda.h"

namespace tqkv {
namespace {

constexpr int kSms = 132;

// One sequence of `tokens` new tokens after `prefix` cached ones, 32:8:128 at GQA 4 (a prefill
// kernel CTA holds 128 rows, 32 new tokens).
ChunkCall OneChunk(int64_t prefix, int tokens, bool prefill = true) {
  return {.max_len = prefix + tokens,
          .num_tokens = tokens,
          .max_q_len = tokens,
          .group = 4,
          .num_kv_heads = 8,
          .cta_rows = prefill ? 128 : 64,
          .prefill = prefill};
}

TEST(ChunkSplitsTest, EveryChoiceKeepsTheLimits) {
  std::mt19937 rng(2026);
  std::uniform_int_distribution<int64_t> len(1, int64_t{1} << 22);
  std::uniform_int_distribution<int> q(1, 4096), seqs(1, 256), group(1, 16), hk(1, 16),
      sms(1, 200), rows(0, 3);
  for (int i = 0; i < 20000; ++i) {
    ChunkCall c;
    c.max_q_len = q(rng);
    c.max_len = std::max<int64_t>(c.max_q_len, len(rng));
    c.num_tokens = std::uniform_int_distribution<int64_t>(c.max_q_len,
                                                          int64_t{c.max_q_len} * seqs(rng))(rng);
    c.group = group(rng);
    c.num_kv_heads = hk(rng);
    c.prefill = rows(rng) == 3;
    c.cta_rows = c.prefill ? 128 : 16 << std::min(rows(rng), 2);
    const int sm = sms(rng);
    const ChunkSplits s = ChooseChunkSplits(c, sm);
    const std::string at =
        testing::PrintToString(std::vector<int64_t>{c.max_len, c.num_tokens, c.max_q_len, c.group,
                                                    c.num_kv_heads, c.cta_rows, c.prefill, sm});
    ASSERT_GE(s.splits, 1) << at;
    ASSERT_LE(s.splits, kMaxChunkSplits) << at;
    ASSERT_EQ(s.tokens_per_split % 64, 0) << at;
    // The splits cover the context, none of them empty.
    ASSERT_GE(int64_t{s.splits} * s.tokens_per_split, c.max_len) << at;
    ASSERT_LT(int64_t{s.splits - 1} * s.tokens_per_split, c.max_len) << at;
    if (s.splits == 1) continue;
    // Split only while every split's CTAs fit one wave of two per SM and keep their tokens.
    ASSERT_LE(ChunkBusyCtas(c) * s.splits, 2 * int64_t{sm}) << at;
    ASSERT_GE(s.tokens_per_split, c.prefill ? 1024 : 256) << at;
  }
}

TEST(ChunkSplitsTest, BusyCtasCountATileForEverySequenceWithRows) {
  // 256 new tokens of one sequence: 1,024 rows, 8 tiles of 128 per KV head.
  EXPECT_EQ(ChunkBusyCtas(OneChunk(1024, 256)), 8 * 8);
  // 64 sequences of 4 new tokens: 16 rows each, a tile each though 2 would hold them.
  EXPECT_EQ(ChunkBusyCtas({.max_len = 4096,
                           .num_tokens = 256,
                           .max_q_len = 4,
                           .group = 4,
                           .num_kv_heads = 8,
                           .cta_rows = 128,
                           .prefill = true}),
            64 * 8);
}

// The choices the H100 sweeps measured (ChooseChunkSplits' comment).
TEST(ChunkSplitsTest, MeasuredChoices) {
  // 256 new tokens after 1k: one split (34.9 µs; the old rule's 5 took 51.5).
  EXPECT_EQ(ChooseChunkSplits(OneChunk(1024, 256), kSms).splits, 1);
  // After 4k: 4 of 1,088 tokens (5 of 1,024 took 85.2 µs, 1 split 91.6, 9 of 512 98.6).
  const ChunkSplits after4k = ChooseChunkSplits(OneChunk(4096, 256), kSms);
  EXPECT_EQ(after4k.splits, 4);
  EXPECT_EQ(after4k.tokens_per_split, 1088);
  // 512 new tokens after 4k: 2 splits (116.9 µs against 3's 128.5).
  EXPECT_EQ(ChooseChunkSplits(OneChunk(4096, 512), kSms).splits, 2);
  // 8 new tokens after 128k on the prefill kernel: one tile per KV head, 33 splits, the wave's
  // 264 CTAs (one CTA per SM took 1.65x longer).
  const ChunkSplits deep = ChooseChunkSplits(OneChunk(131072 - 8, 8), kSms);
  EXPECT_EQ(deep.splits, 33);
  // 2,048 new tokens: 512 CTAs with rows, more than a wave: no split.
  EXPECT_EQ(ChooseChunkSplits(OneChunk(32768, 2048), kSms).splits, 1);
}

}  // namespace
}  // namespace tqkv
