// The split layout choice of CudaDecoder::Plan (ChooseSplitLayout) and the kernel variant choice
// (ChooseSplitVariant), on the host: the limits every plan keeps, and the plans that the split
// sweeps (tools/bench/NOTES.md at commit 1664e39) measured fastest on the H200 (132 SMs,
// Llama-3-8B layer: 8 KV heads), so that a change to the cost model that moves one of them shows
// up here before it is measured.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>

#include "attention/decode_cuda.h"

namespace tqkv {
namespace {

constexpr int kSms = 132;
constexpr int kKvHeads = 8;
// 4bit_nc / k3v4_nc at D = 128, GQA 4: the 8-warp staged kernel, two CTAs fit per SM.
constexpr SplitKernelOccupancy kStagedCompressed{2, true, false};
// k3v4_nc: the same, and its narrow variant (4-warp CTAs, four fit per SM).
constexpr SplitKernelOccupancy kStagedK3v4{2, true, false, 4};
constexpr SplitKernelOccupancy kStagedBf16{2, true, true};
constexpr SplitKernelOccupancy kUnstaged{3, false, false};

int64_t Tps(int64_t batch, int64_t context, const SplitKernelOccupancy& o) {
  return ChooseSplitLayout(context, batch * kKvHeads, kSms, o).tokens_per_split;
}
bool Narrow(int64_t batch, int64_t context, const SplitKernelOccupancy& o, int64_t tps = 0) {
  return ChooseSplitLayout(context, batch * kKvHeads, kSms, o, tps).narrow;
}

TEST(DecodePlanTest, EveryChoiceKeepsTheLimits) {
  std::mt19937 rng(std::random_device{}());
  // Short contexts often, and up to the longest the decode kernels read (past 2,097,152 tokens
  // splits grew past 8,192 and their block ids past the shared-memory array).
  std::uniform_int_distribution<int64_t> len(1, 131072), seqs(1, 1024),
      long_len(131072, CudaDecoder::kMaxContextTokens);
  std::uniform_int_distribution<int> sms(1, 200), resident(1, 4);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t max_len = trial == 0       ? CudaDecoder::kMaxContextTokens
                            : trial % 2 == 0 ? long_len(rng)
                                             : len(rng);
    const int64_t seq_heads = seqs(rng) * kKvHeads;
    const SplitKernelOccupancy o{resident(rng),
                                 trial % 2 == 0,
                                 trial % 3 == 0,
                                 trial % 4 == 0 ? 4 : 0,
                                 trial % 5 < 3,
                                 trial % 5 == 0,
                                 trial % 7 == 0 ? 4096 : 0,
                                 trial % 11 < 6};
    const SplitLayout layout = ChooseSplitLayout(max_len, seq_heads, sms(rng), o);
    const int64_t tps = layout.tokens_per_split;
    ASSERT_TRUE(!layout.narrow || o.narrow_resident_per_sm > 0);
    ASSERT_TRUE(!layout.narrow || o.narrow_max_len == 0 || max_len <= o.narrow_max_len);
    ASSERT_TRUE(!layout.hi_only || (layout.narrow ? o.narrow_hi_only : o.hi_only));
    ASSERT_TRUE(!layout.one_cta || (o.one_cta_twin && !layout.narrow && tps >= 1024));
    ASSERT_EQ(tps % 64, 0) << max_len;
    ASSERT_GE(tps, 64);
    ASSERT_LE(tps, 8192);
    ASSERT_LE((max_len + tps - 1) / tps, 256) << max_len << " tokens in splits of " << tps;
  }
}

TEST(DecodePlanTest, StagedCompressedKernelsGetTheMeasuredBestSplits) {
  // One CTA per SM where a second one does not pay (batch 1, short splits) ...
  EXPECT_EQ(Tps(1, 1024, kStagedCompressed), 128);    // 8.9 µs vs 9.4 at 256, 9.2 at 64
  EXPECT_EQ(Tps(1, 4096, kStagedCompressed), 256);    // 11.2 vs 11.6 at 384, 14.4 at 128
  EXPECT_EQ(Tps(1, 16384, kStagedCompressed), 1024);  // 14.8 vs 16.6 at 512, 19.2 at 2,048
  EXPECT_EQ(Tps(1, 32768, kStagedCompressed), 2048);  // 20.6 vs 21.3 at 1,024, 25.2 at 3,072
  EXPECT_EQ(Tps(16, 1024, kStagedCompressed), 1024);  // 13.8 vs 19.1 at 512
  EXPECT_EQ(Tps(16, 4096, kStagedCompressed), 4096);  // 31.0 vs 33.5 at 2,048
  // ... two where the splits are long (v7v).
  EXPECT_EQ(Tps(4, 32768, kStagedCompressed), 4096);    // 50.3 vs 55.3 at 8,192
  EXPECT_EQ(Tps(2, 65536, kStagedCompressed), 4096);    // 50.3 vs 55.5 at 8,192
  EXPECT_EQ(Tps(8, 16384, kStagedCompressed), 4096);    // 50.5 vs 55.4 at 8,192
  EXPECT_EQ(Tps(16, 8192, kStagedCompressed), 4096);    // 50.7 vs 53.8 at 8,192
  EXPECT_EQ(Tps(64, 4096, kStagedCompressed), 4096);    // one split: no merge
  EXPECT_EQ(Tps(256, 32768, kStagedCompressed), 8192);  // 3,059 vs 3,100 at 6,592
  EXPECT_EQ(Tps(128, 32768, kStagedCompressed), 8192);  // 1,521 vs 1,538 at 6,592
}

TEST(DecodePlanTest, NarrowVariantWhereTheWideKernelNeedsTwoRoundsOfPairs) {
  // 64 × 4k: 512 CTAs of one split are one round of narrow CTAs (4 per SM), two of wide pairs.
  EXPECT_EQ(Tps(64, 4096, kStagedK3v4), 4096);
  EXPECT_TRUE(Narrow(64, 4096, kStagedK3v4));
  EXPECT_TRUE(Narrow(256, 4096, kStagedK3v4));
  EXPECT_TRUE(Narrow(64, 1024, kStagedK3v4));
  // One round of wide CTAs already: the 8-warp kernel and its measured best splits.
  EXPECT_FALSE(Narrow(16, 4096, kStagedK3v4));
  EXPECT_EQ(Tps(16, 4096, kStagedK3v4), 4096);
  EXPECT_FALSE(Narrow(1, 32768, kStagedK3v4));
  EXPECT_EQ(Tps(1, 32768, kStagedK3v4), 2048);
  EXPECT_FALSE(Narrow(1, 1024, kStagedK3v4));
  // A given split length: only the variant is chosen.
  EXPECT_TRUE(Narrow(64, 4096, kStagedK3v4, 1024));   // 2,048 CTAs: 4 rounds, not 8 of pairs
  EXPECT_FALSE(Narrow(16, 4096, kStagedK3v4, 4096));  // 128 CTAs: one wide CTA per SM
  // No narrow variant, no narrow plan.
  EXPECT_FALSE(Narrow(64, 4096, kStagedCompressed));
  EXPECT_FALSE(Narrow(64, 4096, kStagedCompressed, 4096));
}

// The half-precision kernels of GQA groups 9-16 (verify passes of 16 columns): one 8-warp CTA per
// SM, and a narrow twin of 4-warp CTAs, two per SM.
TEST(DecodePlanTest, HalfPrecisionNarrowTwinWhereTheWideGridNeedsSeveralRounds) {
  SplitKernelOccupancy half{1, true, false, 2};
  half.narrow_half = true;
  // 64 × 4k: 512 CTAs, four rounds of 8-warp CTAs or two of narrow pairs (measured 122.7-122.9
  // -> 117.5-118.2 µs with 4 new tokens).
  EXPECT_TRUE(Narrow(64, 4096, half));
  EXPECT_EQ(Tps(64, 4096, half), 4096);
  // 1 × 128k: one round of 16 wide CTAs per KV head (114.0-114.6 µs with 8 new tokens) rather
  // than 33 narrow ones (125.3-125.9).
  EXPECT_FALSE(Narrow(1, 131072, half));
  EXPECT_EQ(Tps(1, 131072, half), 8192);
  // Without the twin, the 8-warp kernel at the same splits.
  EXPECT_FALSE(Narrow(64, 4096, SplitKernelOccupancy{1, true, false}));
  EXPECT_EQ(Tps(64, 4096, SplitKernelOccupancy{1, true, false}), 4096);
}

// The hi-only twin of k3v4_nc's 8-warp kernel (a codebook close enough to fp16): only where the
// split grid holds at most one CTA per SM (v20: 5-15 % faster there, 8 % slower at
// 16 × 16k with two per SM), for the narrow variant only as paired CTAs (narrow_hi_only: even KV
// heads; v21: 3-15 % faster at every narrow shape), never without the twin.
TEST(DecodePlanTest, HiOnlyScoresWhereTheGridHoldsOneCtaPerSm) {
  SplitKernelOccupancy hi = kStagedK3v4;
  hi.hi_only = true;
  auto hi_only = [&](int64_t batch, int64_t context, const SplitKernelOccupancy& o,
                     int64_t tps = 0) {
    return ChooseSplitLayout(context, batch * kKvHeads, kSms, o, tps).hi_only;
  };
  EXPECT_TRUE(hi_only(1, 32768, hi));  // 16 splits: 128 CTAs
  EXPECT_TRUE(hi_only(1, 4096, hi));
  EXPECT_TRUE(hi_only(16, 4096, hi));    // 128 CTAs
  EXPECT_FALSE(hi_only(16, 16384, hi));  // 2 splits: 256 CTAs, two per SM
  EXPECT_FALSE(hi_only(64, 4096, hi));   // the narrow variant, no paired CTAs (odd KV heads)
  EXPECT_TRUE(Narrow(64, 4096, hi));
  SplitKernelOccupancy paired = hi;
  paired.narrow_hi_only = true;
  EXPECT_TRUE(hi_only(64, 4096, paired));  // narrow: paired hi-only CTAs
  EXPECT_TRUE(hi_only(256, 1024, paired));
  EXPECT_TRUE(hi_only(16, 32768, paired));
  EXPECT_TRUE(hi_only(1, 32768, paired));        // wide, one CTA per SM: as before
  EXPECT_TRUE(hi_only(16, 16384, paired));       // now narrow (below)
  EXPECT_FALSE(hi_only(32, 4096, paired));       // wide, two per SM: the exact twin
  EXPECT_TRUE(hi_only(64, 4096, paired, 1024));  // a given split: still narrow, still paired
  EXPECT_FALSE(hi_only(1, 32768, hi, 128));      // 256 splits: 2,048 CTAs
  EXPECT_TRUE(hi_only(1, 32768, hi, 2048));
  EXPECT_FALSE(hi_only(1, 32768, kStagedK3v4));  // no twin (or a codebook too far from fp16)
  EXPECT_FALSE(hi_only(1, 32768, kStagedCompressed));
  // The benchmark shapes' split lengths and variants are the same with or without the twin ...
  for (const auto [batch, context] : {std::pair{1, 32768}, {16, 4096}, {16, 16384}, {64, 4096}}) {
    EXPECT_EQ(Tps(batch, context, hi), Tps(batch, context, kStagedK3v4));
    EXPECT_EQ(Narrow(batch, context, hi), Narrow(batch, context, kStagedK3v4));
  }
  // ... but the paired CTAs take the mid shapes where the 8-warp kernel needs two CTAs per SM
  // (v21, graph µs, same call: 16 × 16k 4 × 4,096 tokens 77.8-78.2 vs the 8-warp pairs' 2 × 8,192
  // 87.3-88.0; 16 × 8k 44.0-44.3 vs 46.7-47.7; 8 × 32k 78.1-78.5 vs 86.0-86.2; 4 × 32k 44.5 vs
  // 47.5-48.1), not those where it holds one per SM or splits would get short (16 × 4k 27.1 vs
  // 22.0-22.1 hi-only; 1 × 32k 17.4 vs 15.7-15.8; 32 × 4k 44.7-44.8 vs 43.2-43.3).
  EXPECT_TRUE(Narrow(16, 16384, paired));
  EXPECT_EQ(Tps(16, 16384, paired), 4096);
  EXPECT_TRUE(Narrow(16, 8192, paired));
  EXPECT_EQ(Tps(16, 8192, paired), 2048);
  EXPECT_TRUE(Narrow(8, 32768, paired));
  EXPECT_EQ(Tps(8, 32768, paired), 4096);
  EXPECT_TRUE(Narrow(4, 32768, paired));
  EXPECT_EQ(Tps(4, 32768, paired), 2048);
  EXPECT_TRUE(Narrow(64, 4096, paired));
  EXPECT_EQ(Tps(64, 4096, paired), 4096);
  EXPECT_FALSE(Narrow(16, 4096, paired));
  EXPECT_EQ(Tps(16, 4096, paired), 4096);
  EXPECT_FALSE(Narrow(1, 32768, paired));
  EXPECT_EQ(Tps(1, 32768, paired), 2048);
  EXPECT_FALSE(Narrow(32, 4096, paired));
  EXPECT_EQ(Tps(32, 4096, paired), 4096);
  // One hi-only 8-warp CTA per SM instead of two exact ones over half the tokens (4 × 16k 24.3 µs
  // vs 29.2-29.3, 8 × 8k 24.6-24.7 vs 28.6-28.7, 2 × 32k 24.3-24.6 vs 29.5-29.6).
  for (const auto [batch, context] : {std::pair{4, 16384}, {8, 8192}, {2, 32768}}) {
    EXPECT_FALSE(Narrow(batch, context, paired)) << batch << " x " << context;
    EXPECT_EQ(Tps(batch, context, paired), 4096) << batch << " x " << context;
    EXPECT_TRUE(hi_only(batch, context, paired)) << batch << " x " << context;
  }
}

// 4bit_nc's narrow layout (paired exact CTAs) only for contexts of at most 4,096 tokens (one
// split) whose 8-warp grid needs a second round of CTA pairs. v22, graph
// µs, two rounds, same call, 8-warp plan -> narrow: 64 × 1k 27.1-27.2 -> 24.1, 64 × 2k 42.9-43.0
// -> 40.7-40.8, 64 × 4k 75.3 -> 73.8-73.9, 128 × 2k 81.6-81.7 -> 78.4-78.6, 256 × 1k 95.9-96.7
// -> 87.8-88.1, 512 × 1k 184.2-186.2 -> 168.9-170.2, 256 × 4k and 1,024 × 4k equal within the
// spread; slower at one round of pairs (32 × 1k 13.9 -> 15.5) and, with v21, over
// 8,192-token splits (64 × 16k 284.8-285.4 -> 290.6-304.7).
TEST(DecodePlanTest, FourBitNarrowVariantOnlyForShortContextsPastOneRound) {
  SplitKernelOccupancy o = kStagedCompressed;
  o.narrow_resident_per_sm = 4;
  o.narrow_max_len = 4096;
  for (const auto [batch, context] : {std::pair{64, 1024},
                                      {64, 2048},
                                      {64, 4096},
                                      {128, 2048},
                                      {256, 1024},
                                      {256, 4096},
                                      {512, 1024},
                                      {1024, 4096}}) {
    EXPECT_TRUE(Narrow(batch, context, o)) << batch << " x " << context;
    EXPECT_EQ(Tps(batch, context, o), context) << batch << " x " << context;
  }
  // Longer contexts and one round of 8-warp pairs keep the 8-warp kernel and its splits.
  for (const auto [batch, context] : {std::pair{32, 1024},
                                      {32, 4096},
                                      {16, 4096},
                                      {1, 4096},
                                      {64, 16384},
                                      {16, 32768},
                                      {256, 32768},
                                      {1, 32768}}) {
    EXPECT_FALSE(Narrow(batch, context, o)) << batch << " x " << context;
    EXPECT_EQ(Tps(batch, context, o), Tps(batch, context, kStagedCompressed))
        << batch << " x " << context;
  }
  // A given split length: the variant by the same rule.
  EXPECT_TRUE(Narrow(64, 4096, o, 1024));
  EXPECT_FALSE(Narrow(64, 16384, o, 1024));
  EXPECT_FALSE(Narrow(16, 4096, o, 4096));  // 128 CTAs
}

// 4bit_nc's 8-warp kernel compiled for one CTA per SM where the split grid fits the SMs and
// splits hold at least 1,024 tokens (v23, graph µs, two rounds, same call,
// two-per-SM kernel -> twin: 1 × 32k 16.1-16.2 -> 15.7-15.8, 1 × 16k 11.8 -> 11.4, 16 × 1k 9.7-9.8
// -> 9.3, 16 × 4k 23.1-23.5 -> 22.4; 1 × 1k 6.0 both; 1 × 4k, 256-token splits, 7.4 -> 7.6).
TEST(DecodePlanTest, FourBitOneCtaTwinWhereTheGridFitsTheSms) {
  SplitKernelOccupancy o = kStagedCompressed;
  o.narrow_resident_per_sm = 4;
  o.narrow_max_len = 4096;
  SplitKernelOccupancy twin = o;
  twin.one_cta_twin = true;
  auto one_cta = [&](int64_t batch, int64_t context, const SplitKernelOccupancy& occ,
                     int64_t tps = 0) {
    return ChooseSplitLayout(context, batch * kKvHeads, kSms, occ, tps).one_cta;
  };
  for (const auto [batch, context] : {std::pair{1, 32768}, {1, 16384}, {16, 1024}, {16, 4096}}) {
    EXPECT_TRUE(one_cta(batch, context, twin)) << batch << " x " << context;
    EXPECT_FALSE(one_cta(batch, context, o)) << batch << " x " << context;  // no twin
    EXPECT_EQ(Tps(batch, context, twin), Tps(batch, context, o)) << batch << " x " << context;
  }
  // Short splits, two CTAs per SM, or the narrow layout: the two-per-SM kernel, the same splits.
  for (const auto [batch, context] : {std::pair{1, 4096},
                                      {1, 1024},
                                      {4, 1024},
                                      {16, 16384},
                                      {32, 4096},
                                      {64, 4096},
                                      {256, 1024}}) {
    EXPECT_FALSE(one_cta(batch, context, twin)) << batch << " x " << context;
    EXPECT_EQ(Tps(batch, context, twin), Tps(batch, context, o)) << batch << " x " << context;
    EXPECT_EQ(Narrow(batch, context, twin), Narrow(batch, context, o)) << batch << " x " << context;
  }
  EXPECT_FALSE(one_cta(1, 32768, twin, 512));  // 64 splits: 512 CTAs
  EXPECT_TRUE(one_cta(1, 32768, twin, 4096));  // 8 splits: 64 CTAs
  // The twin priced (kOneCtaCost): one twin CTA per SM over twice the tokens instead of two
  // CTAs per SM, where measured faster (commit 3447a5e, graph µs, same calls, old plan -> twin):
  // 4 × 16k 25.1 -> 24.5-24.6, 8 × 8k 25.3-25.4 -> 24.8-25.0, 2 × 32k 25.0-25.5 -> 24.5-24.7,
  // 4 × 32k 42.0-43.5 -> 41.3-42.0, 8 × 16k 42.2 -> 41.6-41.7, 2 × 64k 43.2-43.4 -> 41.8,
  // 1 × 128k 45.0-45.2 -> 41.8, 16 × 8k 43.8-43.9 -> 39.4-39.6; but not 4 × 1k (4 × 256
  // tokens 7.4-7.5 against one twin split of 1,024: 8.4), which stays above.
  struct Move {
    int batch, context;
    int64_t before, after;
  };
  for (const Move m : {Move{4, 16384, 2048, 4096},
                       {8, 8192, 2048, 4096},
                       {2, 32768, 2048, 4096},
                       {4, 32768, 4096, 8192},
                       {8, 16384, 4096, 8192},
                       {2, 65536, 4096, 8192},
                       {1, 131072, 4032, 8192},
                       {16, 8192, 4096, 8192}}) {
    EXPECT_EQ(Tps(m.batch, m.context, o), m.before) << m.batch << " x " << m.context;
    EXPECT_EQ(Tps(m.batch, m.context, twin), m.after) << m.batch << " x " << m.context;
    EXPECT_TRUE(one_cta(m.batch, m.context, twin)) << m.batch << " x " << m.context;
    EXPECT_FALSE(Narrow(m.batch, m.context, twin)) << m.batch << " x " << m.context;
  }
}

TEST(DecodePlanTest, StagedBf16KernelKeepsOneCtaPerSm) {
  // The pair model measured 1-3 % slower for bf16: 16 × 8k one split 124.5 µs vs 128.7 at 4,096.
  EXPECT_EQ(Tps(16, 8192, kStagedBf16), 8192);
  EXPECT_EQ(Tps(4, 32768, kStagedBf16), 8192);
  EXPECT_EQ(Tps(16, 8192, kStagedCompressed), 4096);  // the same shape, compressed
}

TEST(DecodePlanTest, UnstagedKernelsFillEveryResidentCta) {
  // 64 × 4k: 512 CTAs per split fill 396 slots (3 per SM) in two rounds at three splits, where
  // one split would leave the second round a quarter full.
  const int64_t tps = Tps(64, 4096, kUnstaged);
  EXPECT_LT(tps, 4096);
  EXPECT_EQ(Tps(64, 4096, SplitKernelOccupancy{1, false, false}), 4096);
}

// The half-precision kernels (DecodeOptions::half, for verify passes) exist where they measured
// faster than the exact ones: unpacked (GQA groups 5-16) staged kernels of 4-bit and 3-bit keys
// with 4-bit values at D = 128 and 64, and of 3-bit keys with 3-bit values at D = 128 and 64.
// Everywhere else the choice is ignored, and the variant is the one without it. Groups 17-32
// exist on the D = 128 kernels of 4-bit values (four N tiles, 4-warp CTAs) and on the bf16 /
// fp16 caches' at D = 64 and 128 (staged, four N tiles, half or not), and MaxSplitGroup says so;
// with shared_o also 3bit_nc's and k8v4's at D = 128 (the shared-output kernel). Every chosen
// variant is instantiated (SplitVariantsOf) and survives its code.
TEST(DecodePlanTest, HalfPrecisionKernelsOnlyOnTheStagedCodebookPipeline) {
  using decode_detail::ChooseSplitVariant;
  using decode_detail::MaybeSplitVariant;
  using decode_detail::SplitVariant;
  int half_variants = 0;
  for (KeyKind kind : kKeyKinds) {
    const decode_detail::SplitVariantList listed = decode_detail::SplitVariantsOf(kind);
    for (int bits : {3, 4, 16}) {
      for (int d : {64, 128, 256}) {
        for (int group = 1; group <= 33; ++group) {
          for (bool staged : {false, true}) {
            const MaybeSplitVariant with =
                ChooseSplitVariant(kind, bits, d, group, {staged, false, true, false, true});
            const MaybeSplitVariant without =
                ChooseSplitVariant(kind, bits, d, group, {staged, false, true, false, false});
            // (D = 64: groups 5-16 only; 4-bit keys' exact kernels staged too, 3-bit keys' on
            // registers; 3-bit keys with 3-bit values too.)
            const bool d64 = staged && d == 64 &&
                             ((bits == 4 && (kind == KeyKind::kMse4 || kind == KeyKind::kMse3)) ||
                              (bits == 3 && kind == KeyKind::kMse3));
            const bool half_kernels =
                d64 || (staged && d == 128 &&
                        ((bits == 4 && (kind == KeyKind::kMse4 || kind == KeyKind::kMse3)) ||
                         (bits == 3 && kind == KeyKind::kMse3)));
            const bool wide = half_kernels && !d64 && bits == 4;  // groups 17-32
            // The bf16 / fp16 caches' staged kernel of four N tiles (4-warp CTAs, their own
            // outputs), half or not.
            const bool plain_wide = staged && d <= 128 && bits == 16 && IsPlain(kind);
            const bool expected = half_kernels && group > 4;
            const std::string what = fmt::format("kind {} bits {} D {} group {} staged {}",
                                                 static_cast<int>(kind), bits, d, group, staged);
            EXPECT_EQ(decode_detail::MaxSplitGroup(kind, bits, d, staged, true),
                      wide || plain_wide ? 32 : 16)
                << what;
            EXPECT_EQ(decode_detail::MaxSplitGroup(kind, bits, d, staged, false),
                      plain_wide ? 32 : 16)
                << what;
            const bool shared_wide = wide || plain_wide ||
                                     (staged && d == 128 && bits == 3 && kind == KeyKind::kMse3) ||
                                     (staged && d == 128 && bits == 4 && kind == KeyKind::kFp8);
            EXPECT_EQ(decode_detail::MaxSplitGroup(kind, bits, d, staged, true, true),
                      shared_wide ? 32 : 16)
                << what;
            EXPECT_EQ(decode_detail::MaxSplitGroup(kind, bits, d, staged, false, true),
                      plain_wide ? 32 : 16)
                << what;
            EXPECT_FALSE(without.ok && group > 16 && !plain_wide) << what;
            if (group > 16 && plain_wide) {
              ASSERT_EQ(with.ok, group <= 32) << what;
              ASSERT_EQ(without.ok, group <= 32) << what;
              if (!with.ok) continue;
              EXPECT_EQ(with.variant, without.variant) << what;
              EXPECT_FALSE(with.variant.half) << what;
              EXPECT_TRUE(with.variant.staged()) << what;
              EXPECT_EQ(with.variant.n_tiles, 4) << what;
              EXPECT_EQ(with.variant.cta_warps(), 4) << what;
              bool instantiated = false;
              for (int i = 0; i < listed.size; ++i) instantiated |= listed.items[i] == with.variant;
              EXPECT_TRUE(instantiated) << what;
              continue;
            }
            if (group > 16) {
              ASSERT_EQ(with.ok, expected && wide && group <= 32) << what;
              if (!with.ok) continue;
              ++half_variants;
              EXPECT_TRUE(with.variant.half) << what;
              EXPECT_EQ(with.variant.n_tiles, 4) << what;
              EXPECT_EQ(with.variant.cta_warps(), 4) << what;
              // The narrow choice selects the same kernel.
              EXPECT_EQ(ChooseSplitVariant(kind, bits, d, group, {true, true, true, false, true})
                            .variant,
                        with.variant)
                  << what;
              EXPECT_EQ(SplitVariant::FromCode(with.variant.Code()), with.variant) << what;
              bool instantiated = false;
              for (int i = 0; i < listed.size; ++i) instantiated |= listed.items[i] == with.variant;
              EXPECT_TRUE(instantiated) << what;
              continue;
            }
            ASSERT_EQ(with.ok, without.ok);
            if (!with.ok) continue;
            EXPECT_EQ(with.variant.half, expected) << what;
            EXPECT_FALSE(without.variant.half) << what;
            if (expected) {
              ++half_variants;
              EXPECT_TRUE(with.variant.staged()) << what;
              EXPECT_FALSE(with.variant.packed) << what;
              EXPECT_EQ(with.variant.n_tiles, group <= 8 ? 1 : 2) << what;
              EXPECT_EQ(with.variant.cta_warps(), 8) << what;
              // the exact kernel
              EXPECT_EQ(without.variant.staged(), d64 && kind == KeyKind::kMse4) << what;
            } else {
              EXPECT_EQ(with.variant, without.variant) << what;
            }
            EXPECT_EQ(SplitVariant::FromCode(with.variant.Code()), with.variant) << what;
            bool instantiated = false;
            for (int i = 0; i < listed.size; ++i) instantiated |= listed.items[i] == with.variant;
            EXPECT_TRUE(instantiated) << what;
          }
        }
      }
    }
  }
  // 4-bit and 3-bit keys with 4-bit values, groups 5-32 at D = 128, 5-16 at D = 64; 3-bit keys
  // with 3-bit values, groups 5-16 at D = 128 and 64
  EXPECT_EQ(half_variants, 2 * 28 + 4 * 12);
}

// 3-bit keys with 4-bit or 3-bit values at D = 64 (k3v4_nc and 3bit_nc at SmolLM2's head_dim;
// StagedPieceLayout): GQA groups up to 4 on the packed 8-warp staged kernel and its hi-only twin,
// with no narrow layout (neither a 4-warp nor a paired kernel: a narrow choice has no variant);
// groups 5-16 on the half-precision staged kernels (8-warp, and the 4-warp narrow twin for 9-16),
// the exact ones on the register kernels; the register kernels wherever staged = false.
TEST(DecodePlanTest, ThreeBitKeysAtHeadDim64) {
  using decode_detail::ChooseSplitVariant;
  using decode_detail::MaybeSplitVariant;
  using decode_detail::SplitPipeline;
  using decode_detail::SplitVariant;
  const decode_detail::SplitVariantList listed = decode_detail::SplitVariantsOf(KeyKind::kMse3);
  for (int bits : {4, 3}) {
    auto choose = [bits](int group, bool narrow, bool hi_only, bool half, bool staged = true) {
      return ChooseSplitVariant(KeyKind::kMse3, bits, 64, group,
                                {staged, narrow, hi_only, false, half, true});
    };
    for (int group = 1; group <= 16; ++group) {
      const std::string what = fmt::format("value bits {} group {}", bits, group);
      const MaybeSplitVariant exact = choose(group, false, false, false);
      const MaybeSplitVariant hi = choose(group, false, true, false);
      const MaybeSplitVariant half = choose(group, false, true, true);
      const MaybeSplitVariant narrow = choose(group, true, true, false);
      const MaybeSplitVariant narrow_half = choose(group, true, true, true);
      const MaybeSplitVariant registers = choose(group, false, true, true, false);
      ASSERT_TRUE(exact.ok && hi.ok && half.ok && registers.ok) << what;
      EXPECT_FALSE(registers.variant.staged()) << what;
      EXPECT_FALSE(narrow.ok) << what;
      if (group <= 4) {
        EXPECT_TRUE(exact.variant.packed) << what;
        EXPECT_EQ(exact.variant.pipeline, SplitPipeline::kStaged) << what;
        EXPECT_EQ(exact.variant.cta_warps(), 8) << what;
        EXPECT_FALSE(exact.variant.hi_only) << what;
        EXPECT_TRUE(hi.variant.hi_only) << what;
        EXPECT_EQ(hi.variant.pipeline, SplitPipeline::kStaged) << what;
        EXPECT_EQ(half.variant, hi.variant) << what;  // half: groups above 4 only
        EXPECT_FALSE(narrow_half.ok) << what;
      } else {
        EXPECT_FALSE(exact.variant.staged()) << what;
        EXPECT_EQ(hi.variant, exact.variant) << what;
        EXPECT_TRUE(half.variant.half) << what;
        EXPECT_EQ(half.variant.pipeline, SplitPipeline::kStaged) << what;
        EXPECT_EQ(half.variant.n_tiles, group <= 8 ? 1 : 2) << what;
        EXPECT_FALSE(half.variant.shared_o) << what;
        EXPECT_EQ(narrow_half.ok, group > 8) << what;
        if (narrow_half.ok) {
          EXPECT_TRUE(narrow_half.variant.half) << what;
          EXPECT_EQ(narrow_half.variant.pipeline, SplitPipeline::kStagedNarrow) << what;
          EXPECT_EQ(narrow_half.variant.n_tiles, 2) << what;
        }
      }
      for (const MaybeSplitVariant& m : {exact, hi, half, narrow_half, registers}) {
        if (!m.ok) continue;
        EXPECT_EQ(m.variant.value_bits, bits) << what;
        EXPECT_EQ(SplitVariant::FromCode(m.variant.Code()), m.variant) << what;
        bool instantiated = false;
        for (int i = 0; i < listed.size; ++i) instantiated |= listed.items[i] == m.variant;
        EXPECT_TRUE(instantiated) << what;
      }
    }
  }
}

// 3bit_nc (3-bit keys and values) at D = 128 gets k3v4_nc's kernel for every choice and group, with
// 3-bit values, except groups 17-32 off the shared-output kernel (k3v4_nc's kernel of four N tiles
// with one output per warp has no 3-bit twin): those have none. MaxSplitGroup says 32 with
// shared_o, 16 without.
TEST(DecodePlanTest, ThreeBitValuesAtHeadDim128TakeK3v4Kernels) {
  using decode_detail::ChooseSplitVariant;
  using decode_detail::MaybeSplitVariant;
  const decode_detail::SplitVariantList listed = decode_detail::SplitVariantsOf(KeyKind::kMse3);
  EXPECT_EQ(decode_detail::MaxSplitGroup(KeyKind::kMse3, 3, 128, true, true, true), 32);
  EXPECT_EQ(decode_detail::MaxSplitGroup(KeyKind::kMse3, 3, 128, true, true, false), 16);
  int staged = 0, shared = 0;
  for (int group = 1; group <= 33; ++group) {
    for (int choice = 0; choice < 64; ++choice) {
      const decode_detail::SplitChoice c{(choice & 1) != 0, (choice & 2) != 0,  (choice & 4) != 0,
                                         (choice & 8) != 0, (choice & 16) != 0, (choice & 32) != 0};
      const MaybeSplitVariant m = ChooseSplitVariant(KeyKind::kMse3, 3, 128, group, c);
      const std::string what = fmt::format("group {} choice {}", group, choice);
      MaybeSplitVariant k3v4 = ChooseSplitVariant(KeyKind::kMse3, 4, 128, group, c);
      ASSERT_EQ(m.ok, k3v4.ok && (group <= 16 || k3v4.variant.shared_o)) << what;
      if (!m.ok) continue;
      shared += m.variant.shared_o;
      if (m.variant.shared_o) {
        EXPECT_TRUE(m.variant.half) << what;
        EXPECT_EQ(m.variant.n_tiles, group <= 16 ? 2 : 4) << what;
      }
      EXPECT_EQ(m.variant.value_bits, 3) << what;
      k3v4.variant.value_bits = 3;
      EXPECT_EQ(m.variant, k3v4.variant) << what;
      staged += m.variant.staged();
      bool instantiated = false;
      for (int i = 0; i < listed.size; ++i) instantiated |= listed.items[i] == m.variant;
      EXPECT_TRUE(instantiated) << what;
    }
  }
  EXPECT_GT(staged, 0);
  // groups 9-32; staged, half and shared_o, with or without narrow, hi_only and one_cta
  EXPECT_EQ(shared, 24 * 8);
}

// FP8 keys (k8v4) have one half-precision kernel, the shared-output one at D = 128: groups 5-32
// with staged, half and shared_o (narrow or not) take it, two N tiles up to 16 columns and four
// above; groups 5-16 without shared_o keep the exact register kernels (no narrow layout); groups
// above 16 exist only on it. Other head dims have none.
TEST(DecodePlanTest, Fp8KeysVerifyOnTheSharedOutputKernel) {
  using decode_detail::ChooseSplitVariant;
  using decode_detail::MaybeSplitVariant;
  const decode_detail::SplitVariantList listed = decode_detail::SplitVariantsOf(KeyKind::kFp8);
  EXPECT_EQ(decode_detail::MaxSplitGroup(KeyKind::kFp8, 4, 128, true, true, true), 32);
  EXPECT_EQ(decode_detail::MaxSplitGroup(KeyKind::kFp8, 4, 128, true, true, false), 16);
  EXPECT_EQ(decode_detail::MaxSplitGroup(KeyKind::kFp8, 4, 128, false, true, true), 16);
  EXPECT_EQ(decode_detail::MaxSplitGroup(KeyKind::kFp8, 4, 64, true, true, true), 16);
  EXPECT_EQ(decode_detail::MaxSplitGroup(KeyKind::kFp8, 4, 256, true, true, true), 16);
  int shared = 0;
  for (int d : {64, 128, 256}) {
    for (int group = 5; group <= 32; ++group) {
      for (bool narrow : {false, true}) {
        const std::string what = fmt::format("D {} group {} narrow {}", d, group, narrow);
        const MaybeSplitVariant with =
            ChooseSplitVariant(KeyKind::kFp8, 4, d, group, {true, narrow, true, false, true, true});
        const MaybeSplitVariant without =
            ChooseSplitVariant(KeyKind::kFp8, 4, d, group, {true, false, true, false, true, false});
        const bool on_shared = d == 128;
        // (FP8 keys have no narrow layout: a narrow choice off the shared kernel has no variant.)
        ASSERT_EQ(with.ok, on_shared || (group <= 16 && !narrow)) << what;
        ASSERT_EQ(without.ok, group <= 16) << what;
        if (without.ok) {
          EXPECT_FALSE(without.variant.half) << what;
          EXPECT_FALSE(without.variant.staged()) << what;
        }
        if (!with.ok) continue;
        EXPECT_EQ(with.variant.shared_o, on_shared) << what;
        EXPECT_EQ(with.variant.half, on_shared) << what;
        if (on_shared) {
          ++shared;
          EXPECT_EQ(with.variant.pipeline, decode_detail::SplitPipeline::kStaged) << what;
          EXPECT_EQ(with.variant.cta_warps(), 8) << what;
          EXPECT_EQ(with.variant.n_tiles, group <= 16 ? 2 : 4) << what;
          EXPECT_FALSE(with.variant.packed) << what;
        } else {
          EXPECT_EQ(with.variant, without.variant) << what;
        }
        bool instantiated = false;
        for (int i = 0; i < listed.size; ++i) instantiated |= listed.items[i] == with.variant;
        EXPECT_TRUE(instantiated) << what;
      }
    }
  }
  EXPECT_EQ(shared, 2 * 28);
}

// 3bit_nc has no staged kernel at D = 256: every choice of every group gets a register kernel,
// with no narrow or half-precision variant.
TEST(DecodePlanTest, ThreeBitValuesOnRegistersAtHeadDim256) {
  using decode_detail::ChooseSplitVariant;
  using decode_detail::MaybeSplitVariant;
  for (int d : {256}) {
    EXPECT_EQ(decode_detail::MaxSplitGroup(KeyKind::kMse3, 3, d, true, true), 16) << d;
    EXPECT_EQ(decode_detail::MaxSplitGroup(KeyKind::kMse3, 3, d, true, true, true), 16) << d;
    for (int group = 1; group <= 16; ++group) {
      for (int choice = 0; choice < 64; ++choice) {
        const decode_detail::SplitChoice c{(choice & 1) != 0,  (choice & 2) != 0,
                                           (choice & 4) != 0,  (choice & 8) != 0,
                                           (choice & 16) != 0, (choice & 32) != 0};
        const MaybeSplitVariant m = ChooseSplitVariant(KeyKind::kMse3, 3, d, group, c);
        const std::string what = fmt::format("D {} group {} choice {}", d, group, choice);
        ASSERT_EQ(m.ok, !c.narrow) << what;
        if (!m.ok) continue;
        EXPECT_FALSE(m.variant.staged()) << what;
        EXPECT_FALSE(m.variant.half) << what;
        EXPECT_FALSE(m.variant.hi_only) << what;
        EXPECT_EQ(m.variant.packed, group <= 4) << what;
      }
    }
  }
}

// The shared-output kernel (DecodeOptions::shared_o) serves exactly the half-precision kernels'
// groups 9-32 at D = 128 (4-bit values, and 3bit_nc's 3-bit ones: its groups 17-32 only here), and
// k8v4's groups 5-32 (FP8 keys: the only half-precision kernel they have; without it their groups
// 5-16 run the exact kernels, which have no narrow layout), on 8-warp CTAs (two N tiles up to 16
// columns, four above), whatever the narrow choice; everywhere else the choice is ignored. So is
// the window choice, which gives the shared-output variants their window twins. Each variant and
// twin is instantiated and survives its code.
TEST(DecodePlanTest, SharedOutputKernelOnlyForWideHalfPrecisionPasses) {
  using decode_detail::ChooseSplitVariant;
  using decode_detail::MaybeSplitVariant;
  using decode_detail::SplitVariant;
  int shared_variants = 0;
  for (KeyKind kind : kKeyKinds) {
    const decode_detail::SplitVariantList listed = decode_detail::SplitVariantsOf(kind);
    for (int bits : {3, 4, 16}) {
      for (int d : {64, 128, 256}) {
        for (int group = 1; group <= 33; ++group) {
          for (bool staged : {false, true}) {
            for (bool half : {false, true}) {
              for (bool narrow : {false, true}) {
                const MaybeSplitVariant with = ChooseSplitVariant(
                    kind, bits, d, group, {staged, narrow, true, false, half, true});
                const MaybeSplitVariant without = ChooseSplitVariant(
                    kind, bits, d, group, {staged, narrow, true, false, half, false});
                const bool three = bits == 3 && kind == KeyKind::kMse3;
                const bool fp8 = bits == 4 && kind == KeyKind::kFp8;
                const bool expected =
                    staged && half && d == 128 && (group > 8 || (fp8 && group > 4)) &&
                    group <= 32 &&
                    ((bits == 4 && (kind == KeyKind::kMse4 || kind == KeyKind::kMse3)) || three ||
                     fp8);
                const std::string what =
                    fmt::format("kind {} bits {} D {} group {} staged {} half {} narrow {}",
                                static_cast<int>(kind), bits, d, group, staged, half, narrow);
                if (!expected) {
                  ASSERT_EQ(with.ok, without.ok) << what;
                  if (with.ok) {
                    EXPECT_EQ(with.variant, without.variant) << what;
                    // (Nor does the window choice change anything here.)
                    const MaybeSplitVariant windowed = ChooseSplitVariant(
                        kind, bits, d, group, {staged, narrow, true, false, half, true, true});
                    ASSERT_TRUE(windowed.ok) << what;
                    EXPECT_EQ(windowed.variant, with.variant) << what;
                  }
                  continue;
                }
                ASSERT_TRUE(with.ok) << what;
                // 3bit_nc's and k8v4's groups 17-32: no kernel without the shared output.
                ASSERT_EQ(without.ok, fp8 ? group <= 16 && !narrow : !three || group <= 16) << what;
                ++shared_variants;
                EXPECT_TRUE(with.variant.shared_o) << what;
                EXPECT_TRUE(with.variant.half) << what;
                EXPECT_EQ(with.variant.pipeline, decode_detail::SplitPipeline::kStaged) << what;
                EXPECT_EQ(with.variant.cta_warps(), 8) << what;
                EXPECT_EQ(with.variant.n_tiles, group <= 16 ? 2 : 4) << what;
                // (k8v4's groups 5-8: one N tile on the exact kernels, two on the shared one.)
                if (without.ok && group > 8) {
                  EXPECT_EQ(with.variant.n_tiles, without.variant.n_tiles) << what;
                }
                EXPECT_EQ(SplitVariant::FromCode(with.variant.Code()), with.variant) << what;
                // Its window twin (SplitChoice::window): the same kernel but for that.
                const MaybeSplitVariant twin = ChooseSplitVariant(
                    kind, bits, d, group, {staged, narrow, true, false, half, true, true});
                ASSERT_TRUE(twin.ok) << what;
                EXPECT_TRUE(twin.variant.window) << what;
                EXPECT_FALSE(with.variant.window) << what;
                SplitVariant untwinned = twin.variant;
                untwinned.window = false;
                EXPECT_EQ(untwinned, with.variant) << what;
                EXPECT_EQ(SplitVariant::FromCode(twin.variant.Code()), twin.variant) << what;
                bool instantiated = false, twin_instantiated = false;
                for (int i = 0; i < listed.size; ++i) {
                  instantiated |= listed.items[i] == with.variant;
                  twin_instantiated |= listed.items[i] == twin.variant;
                }
                EXPECT_TRUE(instantiated) << what;
                EXPECT_TRUE(twin_instantiated) << what;
              }
            }
          }
        }
      }
    }
  }
  // 4-bit, 3-bit and FP8 keys with 4-bit values, 3bit_nc; groups 9-32 (FP8: 5-32), narrow or not
  EXPECT_EQ(shared_variants, (4 * 24 + 4) * 2);
}

}  // namespace
}  // namespace tqkv
