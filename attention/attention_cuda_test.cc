// CUDA attention for several new tokens per sequence against the CPU reference (AttentionCpu) on
// the same cache (GPU-tagged; skipped without a device): decode rows, verify rows and prefill
// chunks mixed in one call, every preset and the bf16/fp16 caches, head dims 64/128/256, GQA
// groups 1-8, every block size, splits, sliding windows. Outputs are poisoned with NaN before each
// run; unused cache bytes are 0xFF (NaN as fp16 / bf16) and must never leak into results.
#include "attention/attention_cuda.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "attention/attention_cpu.h"
#include "quant/numerics.h"
#include "quant/rotation.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "tests/attention_scenario.h"
#include "tests/gpu_test_util.h"
#if TQKV_HAVE_CUDA
#include <cuda_runtime.h>

#include "attention/attention_launch.h"

#include "runtime/cuda_check.h"
#endif

namespace tqkv {
namespace {

#if TQKV_HAVE_CUDA

using testing::AttentionScenario;
using testing::BuildAttention;

const char* const kPresetNames[] = {"turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                                    "turboquant_3bit_nc"};

// The decode kernels' bounds (attention/decode_cuda_test.cc): scores are fp32-level (query and
// codebook as fp16 hi + lo parts), so the LSE is held to 1e-5 relative; outputs to 1e-3 of the
// row's largest |element|. The chunk kernel also multiplies P's hi + lo parts by the plain caches'
// values, so bf16/fp16 caches are held to the same bounds. One-token plans of k3v4_nc run the
// decode kernels' hi-only twin: 1e-4 (as there).
constexpr double kOutTol = 1e-3;
constexpr double kLseTol = 1e-5;

// Rows of one-token sequences run on the decode kernels in a mixed call (AttentionPlan::
// decode_rows) and are held to those kernels' own bounds (attention/decode_cuda_test.cc): 1e-4 LSE
// for k3v4_nc's hi-only kernels, outputs 8e-3 for bf16 caches (P rounded to bf16); their plain
// kernels also round the query to the cache type, so the plain tests round it first.
struct Errors {
  double out = 0, lse = 0;
  double decode_out = 0, decode_lse = 0;  // rows of one-token sequences
  double rest_out = 0, rest_lse = 0;      // rows of sequences Case::rest_from_seq on (not above)
  int64_t bad = 0;                        // NaN / inf / unwritten
  bool prefill = false;                   // the plan ran the prefill kernel
  bool prefill_rotates = false;           // which rotated the query itself
  bool half_verify = false;               // verify passes on the half-precision decode kernel
  bool narrow_half_verify = false;        // .. on its narrow twin (4-warp CTAs, two per SM)
  bool shared_verify = false;             // .. on the kernel whose warps share the output
  bool verify_on_decode = false;          // a verify plan's passes ran
  int verify_columns = 0;                 // columns per verify pass (new tokens × GQA heads)
  int leading_decodes = 0;                // AttentionPlan::leading_decodes
  int leading_max_q_len = 0;              // AttentionPlan::leading_max_q_len
  int verify_passes = 0;                  // AttentionPlan::verify_passes
  bool overlap_next = false;              // .. whose decode the chunk kernel overlaps
  int decode_splits = 0;                  // the decode plan's max_splits
  bool decode = false;                    // AttentionPlan::decode
  bool decode_on_shared_o = false;        // .. on the shared-output kernel
  bool prefill_tiles = false;             // AttentionPlan::prefill_tiles
};

// The tests below hold the chunk kernel and verify passes to the decode kernels' bounds: long
// chunks and verify passes too (which run in half precision by default;
// PrefillKernelInHalfPrecision and VerifyInHalfPrecision test that).
AttentionOptions ExactChunks() {
  AttentionOptions o;
  o.chunk_precision = ChunkPrecision::kExact;
  o.verify_precision = ChunkPrecision::kExact;
  return o;
}

struct Case {
  const Quantizer* quantizer = nullptr;  // or plain
  const Bf16BlockFormat* plain = nullptr;
  int32_t window = 0;
  AttentionOptions options = ExactChunks();
  DType io = DType::kF32;  // query and output type
  int misalign = 0;        // the query and output start this many elements into their buffers
  std::vector<float>* keep_out = nullptr;  // non-null: the output and LSE as they came back
  std::vector<float>* keep_lse = nullptr;
  int rest_from_seq = -1;  // >= 0: its sequences and those after in Errors::rest_out / rest_lse
};

Errors RunAndCompare(const Case& c, AttentionScenario s, const std::vector<uint8_t>& cache,
                     int* max_splits = nullptr, bool* verify_rows = nullptr,
                     int max_q_len_bound = 0) {
  // Half-precision queries: the reference reads the same rounded values.
  for (float& x : s.queries) {
    if (c.io == DType::kF16) x = HalfBitsToFloat(FloatToHalfBits(x));
    if (c.io == DType::kBF16) x = BFloat16BitsToFloat(FloatToBFloat16Bits(x));
  }
  const int d = c.quantizer ? c.quantizer->format().head_dim : c.plain->head_dim;
  const int hq = s.num_q_heads;
  std::vector<float> ref_out, ref_lse;
  testing::ReferenceAttention(c.quantizer, c.plain, s, cache, c.window, ref_out, ref_lse);
  const CudaAttention attn = c.quantizer ? CudaAttention(*c.quantizer) : CudaAttention(*c.plain);
  const int num_seqs = static_cast<int>(s.base.seq_lens.size());
  int max_q_len = std::max(1, max_q_len_bound);  // a caller's bound may exceed the longest
  for (int b = 0; b < num_seqs; ++b) {
    max_q_len = std::max(max_q_len, s.query_start_loc[b + 1] - s.query_start_loc[b]);
  }
  const AttentionPlan plan =
      attn.Plan(num_seqs, s.num_tokens, hq, s.base.max_blocks, max_q_len, c.options);
  if (max_splits != nullptr) *max_splits = plan.max_splits;
  if (verify_rows != nullptr) *verify_rows = plan.verify_rows;
  const int64_t n = static_cast<int64_t>(s.num_tokens) * hq * d;
  DeviceBuffer<uint8_t> dcache(static_cast<int64_t>(cache.size()));
  dcache.CopyFromHost(cache);
  DeviceBuffer<int32_t> tables(static_cast<int64_t>(s.base.block_tables.size())), lens(num_seqs),
      loc(num_seqs + 1);
  tables.CopyFromHost(s.base.block_tables);
  lens.CopyFromHost(s.base.seq_lens);
  loc.CopyFromHost(s.query_start_loc);
  const bool half = c.io != DType::kF32;
  const int64_t skip = int64_t{c.misalign} * (half ? 2 : 4);  // bytes before the query, output
  DeviceBuffer<uint8_t> query(skip + n * (half ? 2 : 4)), out(skip + n * (half ? 2 : 4));
  if (half) {
    std::vector<uint16_t> q16(n);
    for (int64_t i = 0; i < n; ++i) {
      q16[i] =
          c.io == DType::kF16 ? FloatToHalfBits(s.queries[i]) : FloatToBFloat16Bits(s.queries[i]);
    }
    query.CopyFromHost(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(q16.data()), n * 2), skip);
  } else {
    query.CopyFromHost(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.queries.data()), n * 4), skip);
  }
  DeviceBuffer<float> lse(int64_t{s.num_tokens} * hq);
  DeviceBuffer<uint8_t> ws(std::max<int64_t>(plan.workspace_bytes, 1));
  out.FillBytes(0xFF);
  lse.FillBytes(0xFF);
  ws.FillBytes(0xFF);
  AttentionArgs a;
  a.query = query.data() + skip;
  a.query_dtype = c.io;
  a.num_seqs = num_seqs;
  a.num_tokens = s.num_tokens;
  a.num_q_heads = hq;
  a.query_start_loc = loc.data();
  a.seq_lens = lens.data();
  a.block_tables = tables.data();
  a.max_blocks_per_seq = s.base.max_blocks;
  a.cache = {dcache.data(), s.base.num_blocks,
             c.quantizer ? c.quantizer->layout() : c.plain->layout()};
  a.sliding_window = c.window;
  a.output = out.data() + skip;
  a.output_dtype = c.io;
  a.lse = lse.data();
  a.workspace = ws.data();
  a.workspace_bytes = ws.size_bytes();
  attn.Run(plan, a, nullptr);
  TQKV_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> out_bytes(n * (half ? 2 : 4));
  out.CopyToHost(out_bytes, skip);
  std::vector<float> o(n), l(int64_t{s.num_tokens} * hq);
  for (int64_t i = 0; i < n; ++i) {
    if (!half) {
      std::memcpy(&o[i], out_bytes.data() + 4 * i, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, out_bytes.data() + 2 * i, 2);
      o[i] = c.io == DType::kF16 ? HalfBitsToFloat(b) : BFloat16BitsToFloat(b);
    }
  }
  lse.CopyToHost(l);
  // Rows on the decode kernels: one-token sequences, every row of a verify plan, and the leading
  // verify rows of a mixed call.
  const bool verify_on_decode = plan.verify_rows;
  std::vector<bool> single(s.num_tokens, verify_on_decode);
  const bool lead_verify = plan.leading_max_q_len > 1;
  for (int b = 0; b < num_seqs; ++b) {
    if (s.query_start_loc[b + 1] - s.query_start_loc[b] == 1) single[s.query_start_loc[b]] = true;
    if (lead_verify && b < plan.leading_decodes) {
      for (int t = s.query_start_loc[b]; t < s.query_start_loc[b + 1]; ++t) single[t] = true;
    }
  }
  Errors e;
  e.prefill = plan.prefill;
  e.prefill_rotates = plan.prefill_rotates;
  e.half_verify = (verify_on_decode || lead_verify) && plan.decode_plan.variant.half;
  e.verify_on_decode = verify_on_decode;
  e.narrow_half_verify = e.half_verify && plan.decode_plan.variant.pipeline ==
                                              decode_detail::SplitPipeline::kStagedNarrow;
  e.shared_verify = e.half_verify && plan.decode_plan.variant.shared_o;
  e.verify_columns = plan.verify_rows ? plan.decode_plan.num_q_heads / attn.num_kv_heads() : 0;
  e.leading_decodes = plan.leading_decodes;
  e.leading_max_q_len = plan.leading_max_q_len;
  e.verify_passes = plan.verify_passes;
  e.overlap_next = plan.decode_plan.overlap_next;
  e.decode_splits = plan.decode_plan.max_splits;
  e.decode = plan.decode;
  e.decode_on_shared_o = plan.decode && plan.decode_plan.variant.shared_o;
  e.prefill_tiles = plan.prefill_tiles;
  if (c.keep_out != nullptr) *c.keep_out = o;
  if (c.keep_lse != nullptr) *c.keep_lse = l;
  const int rest_token = c.rest_from_seq >= 0 ? s.query_start_loc[c.rest_from_seq] : s.num_tokens;
  for (int64_t row = 0; row < int64_t{s.num_tokens} * hq; ++row) {
    if (!std::isfinite(l[row])) {
      ++e.bad;
      continue;
    }
    const bool one = single[row / hq];
    const bool rest = row / hq >= rest_token;
    const double row_lse =
        std::abs(double(l[row]) - ref_lse[row]) / std::max(1.0, std::abs(double(ref_lse[row])));
    double row_max = 0;
    for (int i = 0; i < d; ++i) row_max = std::max(row_max, std::abs(double(ref_out[row * d + i])));
    double row_out = 0;
    for (int i = 0; i < d; ++i) {
      const float x = o[row * d + i];
      if (!std::isfinite(x)) {
        ++e.bad;
        continue;
      }
      row_out =
          std::max(row_out, std::abs(double(x) - ref_out[row * d + i]) / std::max(row_max, 1e-30));
    }
    double& lse_err = rest ? e.rest_lse : one ? e.decode_lse : e.lse;
    double& out_err = rest ? e.rest_out : one ? e.decode_out : e.out;
    lse_err = std::max(lse_err, row_lse);
    out_err = std::max(out_err, row_out);
  }
  return e;
}

// A step as an engine makes it: decode rows (q_len 1), verify rows (1 + 3 drafts, 1 + 7), a
// prefill chunk after a cached prefix, a whole prompt, and a padding row (q_len 0).
struct Step {
  std::vector<int32_t> lens, q_lens;
};
Step MixedStep() { return {{300, 1, 77, 1000, 150, 65, 0}, {1, 1, 4, 200, 8, 65, 0}}; }

struct DecodeBounds {
  double lse = kLseTol, out = kOutTol;
};
DecodeBounds DecodeBoundsOf(std::string_view kind) {
  // (3-bit keys' hi-only twin: k3v4_nc and 3bit_nc at head_dim 128 and 64.)
  if (kind == "turboquant_k3v4_nc" || kind == "turboquant_3bit_nc") return {1e-4, kOutTol};
  if (kind == "BF16") return {kLseTol, 8e-3};
  return {};
}

void ExpectWithin(const Errors& e, double lse_tol, const std::string& what,
                  DecodeBounds decode = {}) {
  EXPECT_EQ(e.bad, 0) << what;
  EXPECT_LE(e.lse, lse_tol) << what;
  EXPECT_LE(e.out, kOutTol) << what;
  EXPECT_LE(e.decode_lse, decode.lse) << what << " (one-token rows: decode kernels)";
  EXPECT_LE(e.decode_out, decode.out) << what << " (one-token rows: decode kernels)";
}

TEST(CudaAttentionTest, EveryPresetHeadDimGroupAndBlockSize) {
  TQKV_SKIP_WITHOUT_GPU();
  const int groups[] = {1, 2, 3, 4, 8};
  const int block_sizes[] = {16, 32, 64, 128};
  int k = 0;
  for (const char* preset : kPresetNames) {
    for (int d : {64, 128, 256}) {
      const int group = groups[k % 5], bs = block_sizes[k % 4];
      ++k;
      const int hk = 2;
      const Quantizer q = Quantizer::Create(preset, d, hk, bs);
      const Step step = MixedStep();
      const AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, hk * group, 100 + k);
      const Errors e = RunAndCompare({.quantizer = &q}, s, s.base.cache);
      ExpectWithin(e, kLseTol,
                   fmt::format("{} D={} group={} bs={}: out {:.2e} lse {:.2e}", preset, d, group,
                               bs, e.out, e.lse),
                   DecodeBoundsOf(preset));
    }
  }
}

// Every GQA group from 1 to 8 (the rows of a CTA are new tokens × the group's heads, so the
// groups land differently on the 16-row MMA tiles) and every rotation kind (dense Πᵀ and
// Hadamard: the query prep's q·Πᵀ).
TEST(CudaAttentionTest, EveryGroupAndRotation) {
  TQKV_SKIP_WITHOUT_GPU();
  int k = 0;
  for (int group = 1; group <= 8; ++group) {
    const char* preset = group % 2 == 0 ? "turboquant_4bit_nc" : "turboquant_k3v4_nc";
    const RotationKind kinds[] = {RotationKind::kHadamard, RotationKind::kHadamardSigns,
                                  RotationKind::kHaar};
    const RotationKind kind = kinds[group % 3];
    const int d = group <= 4 ? 128 : 64, hk = 2, bs = 16 << (k++ % 4);
    const Quantizer q = Quantizer::Create(preset, d, hk, bs, kind, 7 + group);
    const Step step = MixedStep();
    const AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, hk * group, 300 + k);
    const Errors e = RunAndCompare({.quantizer = &q}, s, s.base.cache);
    ExpectWithin(e, kLseTol,
                 fmt::format("{} {} D={} group={} bs={}: out {:.2e} lse {:.2e}", preset,
                             RotationKindName(kind), d, group, bs, e.out, e.lse),
                 DecodeBoundsOf(preset));
  }
}

TEST(CudaAttentionTest, PlainCachesEveryHeadDimAndGroup) {
  TQKV_SKIP_WITHOUT_GPU();
  int k = 0;
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (int d : {64, 128, 256}) {
      for (int group : {1, 4, 8}) {
        const int hk = 2, bs = 16 << (k++ % 4);
        const Quantizer any = Quantizer::Create("turboquant_k8v4", d, hk, bs);
        const Step step = MixedStep();
        AttentionScenario s = BuildAttention(any, step.lens, step.q_lens, hk * group, 200 + k);
        for (float& x : s.queries) {
          x = dtype == DType::kF16 ? HalfBitsToFloat(FloatToHalfBits(x))
                                   : BFloat16BitsToFloat(FloatToBFloat16Bits(x));
        }
        const Bf16BlockFormat f = MakeBf16BlockFormat(d, hk, bs, dtype);
        const std::vector<uint8_t> cache = testing::StorePlain(s, f);
        const Errors e = RunAndCompare({.plain = &f}, s, cache);
        ExpectWithin(e, kLseTol,
                     fmt::format("{} D={} group={} bs={}: out {:.2e} lse {:.2e}", DTypeName(dtype),
                                 d, group, bs, e.out, e.lse),
                     DecodeBoundsOf(DTypeName(dtype)));
      }
    }
  }
}

// The same step with forced splits of 64 and 256 tokens (merge path) and with the plan's own, its
// one-token sequences on the decode kernels (the default) or on the chunk kernel.
TEST(CudaAttentionTest, SplitsMergeToTheSameResult) {
  TQKV_SKIP_WITHOUT_GPU();
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 4, 16);
  const Step step = MixedStep();
  const AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, 16, 5);
  for (bool decode_rows : {true, false}) {
    for (int tps : {0, 64, 256}) {
      int splits = 0;
      Case c{.quantizer = &q};
      c.options.tokens_per_split = tps;
      c.options.decode_kernels = decode_rows;
      const Errors e = RunAndCompare(c, s, s.base.cache, &splits);
      if (tps == 64) EXPECT_EQ(splits, 1000 / 64 + 1);
      ExpectWithin(
          e, kLseTol,
          fmt::format("tokens_per_split {} ({} splits), decode rows {}", tps, splits, decode_rows));
    }
  }
}

// A verify step (at most 8 new tokens per sequence): the rows ride beside the GQA heads on the
// decode kernels (exact numerics: passes of up to 16 columns, each column also seeing the pass's
// new tokens up to its own), held to the decode kernels' bounds, for every preset, head dim and a
// plain cache;
// with splits of 64 tokens (the merge; the last sequence's new tokens 64 and 65 straddle a split,
// so its first column sees no token of the second split); the same step on the chunk kernel
// (decode kernels off, or a sliding window) to the chunk bounds.
TEST(CudaAttentionTest, VerifyRowsOnTheDecodeKernels) {
  TQKV_SKIP_WITHOUT_GPU();
  const Step verify{{300, 77, 1000, 150, 0, 65}, {4, 1, 8, 3, 0, 2}};
  int k = 0;
  for (const char* preset : kPresetNames) {
    for (int d : {64, 128, 256}) {
      const int group = (k % 4) + 1, hk = 2, bs = 16 << (k % 4);
      ++k;
      // Every rotation: the queries mapped by the split kernels (Hadamard kinds) or by the query
      // prep (a dense Πᵀ).
      const RotationKind rotations[] = {RotationKind::kHadamard, RotationKind::kHadamardSigns,
                                        RotationKind::kHaar};
      const Quantizer q = Quantizer::Create(preset, d, hk, bs, rotations[k % 3], 40 + k);
      const AttentionScenario s =
          BuildAttention(q, verify.lens, verify.q_lens, hk * group, 500 + k);
      bool verify_rows = false;
      const Errors e = RunAndCompare({.quantizer = &q}, s, s.base.cache, nullptr, &verify_rows);
      EXPECT_TRUE(verify_rows);
      const std::string what =
          fmt::format("{} {} D={} group={} bs={}: decode-kernel rows out {:.2e} lse {:.2e}", preset,
                      RotationKindName(rotations[k % 3]), d, group, bs, e.decode_out, e.decode_lse);
      ExpectWithin(e, kLseTol, what, DecodeBoundsOf(preset));
      // Passes of one and two rows (verify_max_group = G, 2·G): later passes start past the
      // sequence's first new token.
      for (int rows : {1, 2}) {
        Case few{.quantizer = &q};
        few.options.verify_max_group = rows * group;
        const Errors fe = RunAndCompare(few, s, s.base.cache);
        ExpectWithin(fe, kLseTol, fmt::format("{} ({} rows per pass)", what, rows),
                     DecodeBoundsOf(preset));
      }
      if (d == 128) {
        Case split{.quantizer = &q};
        split.options.decode.tokens_per_split = 64;
        const Errors se = RunAndCompare(split, s, s.base.cache);
        ExpectWithin(se, kLseTol, what + " (splits of 64 tokens)", DecodeBoundsOf(preset));
        Case chunk{.quantizer = &q};
        chunk.options.verify_max_q_len = 0;
        const Errors ce = RunAndCompare(chunk, s, s.base.cache, nullptr, &verify_rows);
        EXPECT_FALSE(verify_rows);
        ExpectWithin(ce, kLseTol, what + " (chunk kernel)", DecodeBoundsOf(preset));
        Case window{.quantizer = &q, .window = 100};
        const Errors we = RunAndCompare(window, s, s.base.cache);
        ExpectWithin(we, kLseTol, what + " (sliding window)", DecodeBoundsOf(preset));
      }
    }
  }
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const int d = 128, hk = 2, group = 4, bs = 32;
    const Quantizer any = Quantizer::Create("turboquant_k8v4", d, hk, bs);
    AttentionScenario s = BuildAttention(any, verify.lens, verify.q_lens, hk * group, 600);
    for (float& x : s.queries) {
      x = dtype == DType::kF16 ? HalfBitsToFloat(FloatToHalfBits(x))
                               : BFloat16BitsToFloat(FloatToBFloat16Bits(x));
    }
    const Bf16BlockFormat f = MakeBf16BlockFormat(d, hk, bs, dtype);
    const std::vector<uint8_t> cache = testing::StorePlain(s, f);
    const Errors e = RunAndCompare({.plain = &f}, s, cache);
    ExpectWithin(e, kLseTol,
                 fmt::format("{}: decode-kernel rows out {:.2e} lse {:.2e}", DTypeName(dtype),
                             e.decode_out, e.decode_lse),
                 DecodeBoundsOf(DTypeName(dtype)));
  }
}

// Verify passes at head_dim 256 hold at most 8 columns on the compressed caches (their kernel of
// 9-16 columns costs more per column than two passes of 8), up to 16 on the bf16 / fp16 caches; a
// GQA group above 8 still runs one token per pass. Plans only; VerifyRowsOnTheDecodeKernels and
// EveryPresetHeadDimGroupAndBlockSize run such passes against the reference.
TEST(CudaAttentionTest, HeadDim256VerifyPassesHoldEightCompressedColumns) {
  TQKV_SKIP_WITHOUT_GPU();
  for (const char* preset : {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4"}) {
    const CudaAttention attn(Quantizer::Create(preset, 256, 8, 16));
    // 2 sequences of 8 new tokens each at GQA 2: two passes of 4 tokens (8 columns).
    const AttentionPlan two = attn.Plan(2, 16, 16, 4, 8);
    ASSERT_TRUE(two.verify_rows) << preset;
    EXPECT_EQ(two.verify_pass_rows, 4) << preset;
    EXPECT_EQ(two.verify_passes, 2) << preset;
    EXPECT_EQ(two.decode_plan.num_q_heads, 8 * 8) << preset;
    // GQA 16: one token of 16 columns per pass.
    const AttentionPlan wide = attn.Plan(2, 8, 128, 4, 4);
    ASSERT_TRUE(wide.verify_rows) << preset;
    EXPECT_EQ(wide.verify_pass_rows, 1) << preset;
    EXPECT_EQ(wide.verify_passes, 4) << preset;
    // At head_dim 128 the same call is one pass.
    const CudaAttention d128(Quantizer::Create(preset, 128, 8, 16));
    EXPECT_EQ(d128.Plan(2, 16, 16, 4, 8).verify_passes, 1) << preset;
  }
  const CudaAttention plain(MakeBf16BlockFormat(256, 8, 16, DType::kBF16));
  const AttentionPlan one = plain.Plan(2, 16, 16, 4, 8);
  ASSERT_TRUE(one.verify_rows);
  EXPECT_EQ(one.verify_pass_rows, 8);
  EXPECT_EQ(one.verify_passes, 1);
}

TEST(CudaAttentionTest, SlidingWindow) {
  TQKV_SKIP_WITHOUT_GPU();
  const Quantizer q = Quantizer::Create("turboquant_k3v4_nc", 128, 2, 32);
  const Step step = MixedStep();
  const AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, 8, 9);
  for (int32_t w : {1, 50, 128, 333}) {
    // The plan's splits, splits of 64 tokens, and the one-token rows' decode plan told of the
    // window (its splits sized for it; a larger window than the call's also serves).
    for (int variant : {0, 1, 2}) {
      Case c{.quantizer = &q, .window = w};
      if (variant == 1) c.options.tokens_per_split = 64;
      if (variant == 2) c.options.decode.sliding_window = w + 7;
      const Errors e = RunAndCompare(c, s, s.base.cache);
      // (The one-token rows run on the decode kernels: k3v4_nc's hi-only twin, held to its
      // bound.)
      ExpectWithin(e, kLseTol, fmt::format("window {} variant {}", w, variant),
                   DecodeBoundsOf("turboquant_k3v4_nc"));
    }
  }
}

// Long chunks in half precision (the default, ChunkPrecision::kHalf) on the prefill kernel:
// every preset and plain cache, head_dim 64 and 128, GQA groups 1-8, every block size, splits, a
// sliding window and bf16 I/O, against the fp64 reference. Rounding the fp32 query (q·Πᵀ), the
// keys and P once to fp16 (2^-11 relative each; the wgmma kernel rounds the dequantized keys
// centroid · norm and values code · scale + zero, the mma.sync kernel P' = p · value scale)
// measured up to 1.7e-3 of the LSE (relative to max(1, |LSE|), 4bit_nc with a Haar rotation at
// GQA group 8 on the wgmma kernel) and 4.0e-3 of a row's largest element (bf16 output aside; 5.5e-3
// with values past fp16, PrefillKernelKeepsValuesPastFp16) on the H200; a bf16 cache multiplies
// the bf16 query and keys exactly and rounds only P.
struct HalfBounds {
  double lse, out;
};
HalfBounds HalfBoundsOf(bool bf16) {
  return bf16 ? HalfBounds{4e-3, 2e-2} : HalfBounds{2e-3, 6e-3};
}

// The sliding-window tests' caches: every preset at head_dim 64, 128 and 256 (GQA groups 1-8 and
// block sizes 16-128 in turn), then the bf16 and fp16 caches (head_dim 128, GQA 4, block 32; the
// plain kinds' kernels round the query to the cache's type, so the scenario's is rounded first).
// check(quantizer, plain format, kind name, scenario, cache bytes, block size, description);
// the scenarios' seeds seed + 1, ... and plain_seed.
template <typename Check>
void ForEachWindowCache(const std::vector<int32_t>& lens, const std::vector<int32_t>& q_lens,
                        uint32_t seed, uint32_t plain_seed, Check&& check) {
  int k = 0;
  for (const char* preset : kPresetNames) {
    for (int d : {64, 128, 256}) {
      const int group = 1 + k % 8, hk = 2, bs = 16 << (k % 4);
      ++k;
      const Quantizer q = Quantizer::Create(preset, d, hk, bs);
      const AttentionScenario s = BuildAttention(q, lens, q_lens, hk * group, seed + k);
      check(&q, nullptr, preset, s, s.base.cache, bs,
            fmt::format("{} D={} group={} bs={}", preset, d, group, bs));
    }
  }
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const int d = 128, hk = 2, group = 4, bs = 32;
    const Quantizer any = Quantizer::Create("turboquant_k8v4", d, hk, bs);
    AttentionScenario s = BuildAttention(any, lens, q_lens, hk * group, plain_seed);
    for (float& x : s.queries) {
      x = dtype == DType::kF16 ? HalfBitsToFloat(FloatToHalfBits(x))
                               : BFloat16BitsToFloat(FloatToBFloat16Bits(x));
    }
    const Bf16BlockFormat f = MakeBf16BlockFormat(d, hk, bs, dtype);
    const std::vector<uint8_t> cache = testing::StorePlain(s, f);
    const std::string name(DTypeName(dtype));
    check(nullptr, &f, name, s, cache, bs, name);
  }
}

// The scenario with every table entry of a block wholly before position first[b] of sequence b
// naming a block no entry names (never written: NaN bytes), so that a kernel reading one shows.
AttentionScenario WithBlocksBeforeUnwritten(const AttentionScenario& s,
                                            const std::vector<int32_t>& first, int bs) {
  std::vector<bool> named(s.base.num_blocks);
  for (int32_t id : s.base.block_tables) {
    if (id >= 0) named[id] = true;
  }
  const auto unnamed = std::find(named.begin(), named.end(), false);
  TQKV_CHECK(unnamed != named.end());  // (BuildAttention leaves spare blocks)
  const auto never_written = static_cast<int32_t>(unnamed - named.begin());
  AttentionScenario out = s;
  for (size_t b = 0; b < first.size(); ++b) {
    for (int32_t i = 0; i < first[b] / bs; ++i) {
      out.base.block_tables[b * out.base.max_blocks + i] = never_written;
    }
  }
  return out;
}

// One token per sequence under a sliding window runs the decode kernels (the shared-output one
// too, where DecodeOptions::half puts the call, as k8v4 at GQA 8), reading nothing before the
// 16-token chunk that holds the window's first position:
// every preset and the plain caches, head dims 64-256, block sizes 16-128, GQA groups 1-8,
// windows that start inside a chunk, at a chunk, past the block before, or before the context,
// with the plan's splits, splits of 64 tokens (the merge) and splits sized for the window. The
// table entries of blocks before that block name a block that was never written (NaN bytes),
// so a read of one shows up; outputs differ from the chunk kernel's (the decode kernels ran).
TEST(CudaAttentionTest, SlidingWindowDecodeOnTheDecodeKernels) {
  TQKV_SKIP_WITHOUT_GPU();
  const std::vector<int32_t> lens = {1, 5, 17, 100, 129, 700, 2100};
  const std::vector<int32_t> q_lens(lens.size(), 1);
  auto check = [&](const Quantizer* q, const Bf16BlockFormat* f, const std::string& kind,
                   const AttentionScenario& s, const std::vector<uint8_t>& cache, int bs,
                   const std::string& what) {
    for (int32_t w : {1, 7, 16, 50, 333, 5000}) {
      std::vector<int32_t> first(lens.size());
      for (size_t b = 0; b < lens.size(); ++b) first[b] = lens[b] > w ? lens[b] - w : 0;
      const AttentionScenario sw = WithBlocksBeforeUnwritten(s, first, bs);
      // The plan's splits, splits of 64 tokens, and splits sized for the window
      // (DecodeOptions::sliding_window).
      for (int variant : {0, 1, 2}) {
        const int tps = variant == 1 ? 64 : 0;
        Case c{.quantizer = q, .plain = f, .window = w};
        c.options.decode.tokens_per_split = tps;
        if (variant == 2) c.options.decode.sliding_window = w;
        std::vector<float> out;
        c.keep_out = &out;
        const Errors e = RunAndCompare(c, sw, cache);
        const std::string at =
            fmt::format("{} window {} tokens_per_split {}{} ({} splits): out {:.2e} lse {:.2e}",
                        what, w, tps, variant == 2 ? " planned for the window" : "",
                        e.decode_splits, e.decode_out, e.decode_lse);
        ASSERT_TRUE(e.decode) << at;
        ExpectWithin(e, kLseTol, at,
                     e.decode_on_shared_o
                         ? DecodeBounds{HalfBoundsOf(false).lse, HalfBoundsOf(false).out}
                         : DecodeBoundsOf(kind));
        if (w != 50 || variant != 0) continue;
        Case chunk = c;
        chunk.options.decode_kernels = false;
        std::vector<float> chunk_out;
        chunk.keep_out = &chunk_out;
        const Errors ce = RunAndCompare(chunk, sw, cache);
        EXPECT_FALSE(ce.decode) << at;
        EXPECT_NE(out, chunk_out) << at << ": the same outputs as the chunk kernel's";
      }
    }
  };
  ForEachWindowCache(lens, q_lens, 700, 800, check);
  {  // k8v4 at GQA 8, head_dim 128; with DecodeOptions::half its plan takes the shared-output
     // kernel, which runs the window
    const Quantizer q = Quantizer::Create("turboquant_k8v4", 128, 2, 16);
    const AttentionScenario s = BuildAttention(q, lens, q_lens, 2 * 8, 790);
    check(&q, nullptr, "turboquant_k8v4", s, s.base.cache, 16, "turboquant_k8v4 D=128 group=8");
    Case c{.quantizer = &q, .window = 50};
    c.options.decode.half = true;
    const Errors e = RunAndCompare(c, s, s.base.cache);
    EXPECT_TRUE(e.decode_on_shared_o);
    ExpectWithin(e, kLseTol, "turboquant_k8v4 D=128 group=8 window 50, shared-output plan",
                 DecodeBounds{HalfBoundsOf(false).lse, HalfBoundsOf(false).out});
  }
}

// One token per sequence runs the decode kernels; the chunk kernel (decode_kernels = false)
// agrees with the same reference. Half-precision queries and outputs on both paths.
TEST(CudaAttentionTest, OneTokenPlansAndHalfPrecisionIo) {
  TQKV_SKIP_WITHOUT_GPU();
  for (const char* preset : kPresetNames) {
    const Quantizer q = Quantizer::Create(preset, 128, 8, 16);
    const AttentionScenario s = BuildAttention(q, {1, 100, 4096, 333}, {1, 1, 1, 1}, 32, 77);
    for (bool decode : {true, false}) {
      for (DType io : {DType::kF32, DType::kBF16}) {
        Case c{.quantizer = &q, .io = io};
        c.options.decode_kernels = decode;
        const Errors e = RunAndCompare(c, s, s.base.cache);
        // bf16 I/O: the reference reads the same rounded query; the output adds half a bf16 ulp
        // (up to 2^-8 of an element).
        const double out_tol = io == DType::kF32 ? kOutTol : kOutTol + 0.0039;
        // (The decode kernels' bound: 3-bit keys' hi-only twin, k3v4_nc and 3bit_nc.)
        const double lse_tol = decode ? DecodeBoundsOf(preset).lse : kLseTol;
        // Every row is a one-token row here.
        const double lse = std::max(e.lse, e.decode_lse), out = std::max(e.out, e.decode_out);
        const std::string what = fmt::format("{} decode kernels {} io {}: out {:.2e} lse {:.2e}",
                                             preset, decode, DTypeName(io), out, lse);
        EXPECT_EQ(e.bad, 0) << what;
        EXPECT_LE(lse, lse_tol) << what;
        EXPECT_LE(out, out_tol) << what;
        if (io != DType::kBF16) continue;
        // The query and output one bf16 element off 4-byte alignment: the decode kernels' first
        // query row, loaded early as 4-byte words, is loaded element by element then (a word at
        // a 2-byte address faults the context), with the same outputs; the chunk kernel's query
        // prep takes its scalar path then (fp32 instead of tensor cores): within the bounds.
        std::vector<float> aligned_out, aligned_lse, off_out, off_lse;
        c.keep_out = &aligned_out;
        c.keep_lse = &aligned_lse;
        RunAndCompare(c, s, s.base.cache);
        c.misalign = 1;
        c.keep_out = &off_out;
        c.keep_lse = &off_lse;
        const Errors off = RunAndCompare(c, s, s.base.cache);
        EXPECT_EQ(off.bad, 0) << what;
        if (decode) {
          EXPECT_EQ(off_out, aligned_out) << what << ", one element off";
          EXPECT_EQ(off_lse, aligned_lse) << what << ", one element off";
        } else {
          EXPECT_LE(std::max(off.lse, off.decode_lse), lse_tol) << what << ", one element off";
          EXPECT_LE(std::max(off.out, off.decode_out), out_tol) << what << ", one element off";
        }
      }
    }
  }
}

// Verify calls under a sliding window run their passes on the decode kernels, each column over
// its own token's window: in exact precision (kernels with their own outputs), in half precision
// with the plan told of the window (AttentionOptions::decode.sliding_window: splits sized for it;
// also splits of 64 tokens, the merge) and untold (splits for the whole table); at head_dim 128
// the half-precision passes of 9-32 columns run on the shared-output kernel (its masked first
// steps). Every preset and the plain caches, head dims 64-256, block sizes 16-128, GQA groups
// 1-8, 1 to 8 new tokens per sequence, windows of 1 to 5,000 tokens. Table entries before the
// block holding the first new token's first position name a never-written (NaN) block; outputs
// differ from the chunk kernel's (the passes ran).
TEST(CudaAttentionTest, SlidingWindowVerifyOnTheDecodeKernels) {
  TQKV_SKIP_WITHOUT_GPU();
  const Step verify{{3, 9, 77, 300, 1000, 2100, 0, 65}, {2, 1, 4, 8, 3, 8, 0, 2}};
  int on_shared = 0;
  auto check = [&](const Quantizer* q, const Bf16BlockFormat* f, const std::string& kind,
                   const AttentionScenario& s, const std::vector<uint8_t>& cache, int bs,
                   const std::string& what) {
    for (int32_t w : {1, 7, 16, 50, 333, 5000}) {
      std::vector<int32_t> first(verify.lens.size());
      for (size_t b = 0; b < verify.lens.size(); ++b) {
        // The first new token's window starts first.
        const int32_t len0 = verify.lens[b] - verify.q_lens[b] + 1;
        first[b] = len0 > w ? len0 - w : 0;
      }
      const AttentionScenario sw = WithBlocksBeforeUnwritten(s, first, bs);
      for (int variant : {0, 1, 2, 3}) {
        Case c{.quantizer = q, .plain = f, .window = w};
        if (variant > 0) c.options.verify_precision = ChunkPrecision::kHalf;
        if (variant == 1 || variant == 2) c.options.decode.sliding_window = w;
        if (variant == 2) c.options.decode.tokens_per_split = 64;
        std::vector<float> out;
        c.keep_out = &out;
        bool verify_rows = false;
        const Errors e = RunAndCompare(c, sw, cache, nullptr, &verify_rows);
        const std::string at = fmt::format(
            "{} window {} {} ({} splits): out {:.2e} lse {:.2e}", what, w,
            std::array{"exact", "half, planned for the window",
                       "half, planned for the window, splits of 64 tokens", "half"}[variant],
            e.decode_splits, e.decode_out, e.decode_lse);
        ASSERT_TRUE(verify_rows) << at;
        EXPECT_TRUE(e.verify_on_decode) << at;
        on_shared += e.shared_verify;
        const HalfBounds hb = HalfBoundsOf(f != nullptr && f->dtype == DType::kBF16);
        ExpectWithin(e, kLseTol, at,
                     e.half_verify ? DecodeBounds{hb.lse, hb.out} : DecodeBoundsOf(kind));
        if (w != 50 || (variant != 0 && !e.shared_verify)) continue;
        Case chunk = c;
        chunk.options.verify_max_q_len = 0;
        std::vector<float> chunk_out;
        chunk.keep_out = &chunk_out;
        const Errors ce = RunAndCompare(chunk, sw, cache);
        EXPECT_FALSE(ce.verify_on_decode) << at;
        EXPECT_NE(out, chunk_out) << at << ": the same outputs as the chunk kernel's";
      }
    }
  };
  ForEachWindowCache(verify.lens, verify.q_lens, 900, 950, check);
  EXPECT_GT(on_shared, 0);
}

// GQA groups 9-16 in half precision (DecodeOptions::half): told of a window or not, one token per
// sequence runs on the shared-output kernel (these presets have one), each row over its window
// (the kernel's masked first steps, from the 16-token chunk holding the window's first
// position), within the half-precision bounds; at block sizes 16 and 128, table entries of the
// blocks before the window's first naming a never-written (NaN) block. The chunk kernel's
// outputs differ (the decode kernel ran).
TEST(CudaAttentionTest, SlidingWindowDecodeAboveGroupEightInHalfPrecision) {
  TQKV_SKIP_WITHOUT_GPU();
  const std::vector<int32_t> lens = {1, 17, 129, 700, 2100};
  const std::vector<int32_t> q_lens(lens.size(), 1);
  for (const char* preset : {"turboquant_4bit_nc", "turboquant_k8v4", "turboquant_k3v4_nc"}) {
    for (int bs : {16, 128}) {
      const Quantizer q = Quantizer::Create(preset, 128, 2, bs);
      const AttentionScenario s = BuildAttention(q, lens, q_lens, 2 * 16, 811);
      for (int32_t w : {7, 50, 333}) {
        std::vector<int32_t> first(lens.size());
        for (size_t b = 0; b < lens.size(); ++b) first[b] = lens[b] > w ? lens[b] - w : 0;
        const AttentionScenario sw = WithBlocksBeforeUnwritten(s, first, bs);
        for (bool told : {false, true}) {
          Case c{.quantizer = &q, .window = w};
          c.options.decode.half = true;
          if (told) c.options.decode.sliding_window = w;
          std::vector<float> out;
          c.keep_out = &out;
          const Errors e = RunAndCompare(c, sw, sw.base.cache);
          const std::string at = fmt::format(
              "{} D=128 group=16 bs={} window {} {} ({} splits): out {:.2e} lse {:.2e}", preset, bs,
              w, told ? "told" : "untold", e.decode_splits, e.decode_out, e.decode_lse);
          ASSERT_TRUE(e.decode) << at;
          EXPECT_TRUE(e.decode_on_shared_o) << at;
          const HalfBounds hb = HalfBoundsOf(false);
          ExpectWithin(e, kLseTol, at, DecodeBounds{hb.lse, hb.out});
          if (!told) continue;
          Case chunk = c;
          chunk.options.decode_kernels = false;
          std::vector<float> chunk_out;
          chunk.keep_out = &chunk_out;
          const Errors ce = RunAndCompare(chunk, sw, sw.base.cache);
          EXPECT_FALSE(ce.decode) << at;
          EXPECT_NE(out, chunk_out) << at << ": the same outputs as the chunk kernel's";
        }
      }
    }
  }
}

TEST(CudaAttentionTest, PrefillKernelInHalfPrecision) {
  TQKV_SKIP_WITHOUT_GPU();
  // Chunks of 200, 65 and 129 new tokens after a prefix, a whole prompt of 300, beside decode and
  // verify rows.
  const Step step{{300, 1, 77, 1000, 150, 65, 700}, {300, 1, 4, 200, 8, 65, 129}};
  const int groups[] = {1, 2, 3, 4, 8};
  int k = 0;
  double worst_lse[2] = {}, worst_out[2] = {};
  auto check = [&](const Errors& e, bool bf16, const std::string& what, double io_out = 0.0) {
    const HalfBounds b = HalfBoundsOf(bf16);
    EXPECT_TRUE(e.prefill) << what;
    EXPECT_EQ(e.bad, 0) << what;
    EXPECT_LE(e.lse, b.lse) << what;
    EXPECT_LE(e.out, b.out + io_out) << what;
    worst_lse[bf16] = std::max(worst_lse[bf16], e.lse);
    worst_out[bf16] = std::max(worst_out[bf16], e.out);
  };
  for (const char* preset : kPresetNames) {
    for (int d : {64, 128}) {
      const int group = groups[k % 5], bs = 16 << (k % 4), hk = 2;
      ++k;
      const Quantizer q = Quantizer::Create(preset, d, hk, bs);
      const AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, hk * group, 700 + k);
      for (int variant = 0; variant < 4; ++variant) {
        Case c{.quantizer = &q};
        c.options.chunk_precision = ChunkPrecision::kHalf;
        if (variant == 1) c.options.tokens_per_split = 64;  // the split merge
        if (variant == 2) c.window = 100;
        if (variant == 3) c.io = DType::kBF16;
        const Errors e = RunAndCompare(c, s, s.base.cache);
        const std::string what = fmt::format(
            "{} D={} group={} bs={} variant {}: out {:.2e} lse "
            "{:.2e}",
            preset, d, group, bs, variant, e.out, e.lse);
        // bf16 I/O: the output adds half a bf16 ulp (up to 2^-8 of an element).
        check(e, false, what, variant == 3 ? 0.0039 : 0.0);
        EXPECT_LE(e.decode_out, kOutTol + (variant == 3 ? 0.0039 : 0.0)) << what;
      }
    }
  }
  // On Hopper the compressed kinds at head_dim 128 run the wgmma kernel: more groups and block
  // sizes, with splits, and every rotation (the MSE kinds' Hadamard rotations applied by the
  // kernel itself, a dense Πᵀ by the query prep before it).
  double worst_wgmma_out = 0, worst_wgmma_lse = 0;
  cudaDeviceProp prop{};
  TQKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const bool hopper = prop.major == 9 && prop.minor == 0;  // the wgmma kernel's devices
  for (const char* preset : kPresetNames) {
    for (const auto& [group, bs, rotation] : {std::tuple{1, 16, RotationKind::kHadamard},
                                              std::tuple{3, 64, RotationKind::kHadamardSigns},
                                              std::tuple{8, 128, RotationKind::kHaar}}) {
      const int hk = 2;
      const Quantizer q = Quantizer::Create(preset, 128, hk, bs, rotation, 11 + group);
      const AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, hk * group, 750 + k++);
      const bool mse = std::string_view(preset) != "turboquant_k8v4";
      for (int tps : {0, 128}) {
        Case c{.quantizer = &q};
        c.options.chunk_precision = ChunkPrecision::kHalf;
        c.options.tokens_per_split = tps;
        const Errors e = RunAndCompare(c, s, s.base.cache);
        check(e, false,
              fmt::format("{} {} D=128 group={} bs={} tokens_per_split={}: out {:.2e} lse {:.2e}",
                          preset, RotationKindName(rotation), group, bs, tps, e.out, e.lse));
        EXPECT_EQ(e.prefill_rotates, hopper && mse && rotation != RotationKind::kHaar) << preset;
        worst_wgmma_out = std::max(worst_wgmma_out, e.out);
        worst_wgmma_lse = std::max(worst_wgmma_lse, e.lse);
      }
      // An fp16 query and output (FP8 keys read the caller's query directly).
      if (group == 8) {
        Case c{.quantizer = &q};
        c.options.chunk_precision = ChunkPrecision::kHalf;
        c.io = DType::kF16;
        const Errors e = RunAndCompare(c, s, s.base.cache);
        const std::string what = fmt::format(
            "{} D=128 group={} bs={} fp16 io: out {:.2e} lse {:.2e}", preset, group, bs, e.out,
            e.lse);
        check(e, false, what);
        EXPECT_LE(e.decode_out, kOutTol + 0.0005) << what;
      }
      // A query and output only element-aligned (the API asks 16 bytes of the cache alone): the
      // kernels' scalar loads and stores (FP8 keys read the caller's query directly).
      if (group != 3) continue;
      for (DType io : {DType::kF32, DType::kBF16}) {
        Case c{.quantizer = &q};
        c.options.chunk_precision = ChunkPrecision::kHalf;
        c.io = io;
        c.misalign = 1;
        const Errors e = RunAndCompare(c, s, s.base.cache);
        const std::string what =
            fmt::format("{} D=128 group={} bs={} {} one element off: out {:.2e} lse {:.2e}", preset,
                        group, bs, DTypeName(io), e.out, e.lse);
        check(e, false, what, io == DType::kBF16 ? 0.0039 : 0.0);
        EXPECT_LE(e.decode_out, kOutTol + (io == DType::kBF16 ? 0.0039 : 0.0)) << what;
      }
    }
  }
  std::printf("compressed kinds at D 128, worst: out %.2e lse %.2e\n", worst_wgmma_out,
              worst_wgmma_lse);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (int d : {64, 128}) {
      for (int group : {1, 4, 8}) {
        const int hk = 2, bs = 16 << (k++ % 4);
        const Quantizer any = Quantizer::Create("turboquant_k8v4", d, hk, bs);
        AttentionScenario s = BuildAttention(any, step.lens, step.q_lens, hk * group, 800 + k);
        for (float& x : s.queries) {
          x = dtype == DType::kF16 ? HalfBitsToFloat(FloatToHalfBits(x))
                                   : BFloat16BitsToFloat(FloatToBFloat16Bits(x));
        }
        const Bf16BlockFormat f = MakeBf16BlockFormat(d, hk, bs, dtype);
        const std::vector<uint8_t> cache = testing::StorePlain(s, f);
        Case c{.plain = &f};
        c.options.chunk_precision = ChunkPrecision::kHalf;
        // The query and output in fp32, in the cache's type, or in the other 16-bit type (the
        // kernels convert it; the values, rounded to the cache's type above, stay exact).
        const DType other = dtype == DType::kBF16 ? DType::kF16 : DType::kBF16;
        c.io = group == 1 ? DType::kF32 : group == 4 ? dtype : other;
        const Errors e = RunAndCompare(c, s, cache);
        check(e, dtype == DType::kBF16,
              fmt::format("{} D={} group={} bs={} io {}: out {:.2e} lse {:.2e}", DTypeName(dtype),
                          d, group, bs, DTypeName(c.io), e.out, e.lse),
              c.io == DType::kBF16 ? 0.0039 : 0.0);
      }
    }
  }
  // Short chunks: from 16 rows (new tokens × GQA heads) per sequence on, the prefill kernel (its
  // 128-row tiles mostly empty; 1.1-3x faster than the chunk kernel at 64 × 4k, 4-16 new tokens);
  // below, the chunk kernel. max_q_len 16, 5 and 4 at GQA 4, 12 at GQA 2 (3 at GQA 4: the chunk
  // kernel), beside decode rows, every preset and a bf16 cache, head_dim 64 and 128, with and
  // without splits.
  for (const auto& [q_lens, group] :
       {std::pair{std::vector<int32_t>{16, 1, 9, 12, 3, 16}, 4},
        std::pair{std::vector<int32_t>{5, 1, 2, 5, 4, 3}, 4},
        std::pair{std::vector<int32_t>{12, 1, 9, 2, 12, 7}, 2},
        std::pair{std::vector<int32_t>{4, 1, 2, 4, 3, 4}, 4},
        std::pair{std::vector<int32_t>{3, 1, 2, 3, 3, 1}, 4}}) {
    const std::vector<int32_t> lens{300, 77, 1000, 150, 65, 2100};
    const int max_q = *std::max_element(q_lens.begin(), q_lens.end());
    for (const char* preset : {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4"}) {
      for (int d : {64, 128}) {
        const int hk = 2, bs = 16 << (k % 4);
        const Quantizer q = Quantizer::Create(preset, d, hk, bs);
        const AttentionScenario s = BuildAttention(q, lens, q_lens, hk * group, 800 + k++);
        for (int tps : {0, 128}) {
          Case c{.quantizer = &q};
          c.options.chunk_precision = ChunkPrecision::kHalf;
          c.options.verify_max_q_len = 0;  // not on the decode kernels
          c.options.tokens_per_split = tps;
          const Errors e = RunAndCompare(c, s, s.base.cache);
          const std::string what = fmt::format(
              "{} D={} group={} max_q_len={} tokens_per_split={}: out {:.2e} lse {:.2e}", preset,
              d, group, max_q, tps, e.out, e.lse);
          if (max_q * group >= 16) {
            check(e, false, what);
          } else {
            EXPECT_FALSE(e.prefill) << what;
            ExpectWithin(e, kLseTol, what, DecodeBoundsOf(preset));
          }
        }
      }
    }
    const int d = 128, hk = 2, bs = 32;
    const Bf16BlockFormat f = MakeBf16BlockFormat(d, hk, bs, DType::kBF16);
    const Quantizer any = Quantizer::Create("turboquant_k8v4", d, hk, bs);
    AttentionScenario s = BuildAttention(any, lens, q_lens, hk * group, 800 + k++);
    for (float& x : s.queries) x = BFloat16BitsToFloat(FloatToBFloat16Bits(x));
    const std::vector<uint8_t> cache = testing::StorePlain(s, f);
    Case c{.plain = &f};
    c.options.chunk_precision = ChunkPrecision::kHalf;
    c.options.verify_max_q_len = 0;
    const Errors e = RunAndCompare(c, s, cache);
    const std::string what = fmt::format("bf16 cache group={} max_q_len={}: out {:.2e} lse {:.2e}",
                                         group, max_q, e.out, e.lse);
    if (max_q * group >= 16) {
      check(e, true, what);
    } else {
      EXPECT_FALSE(e.prefill) << what;
    }
  }
  std::printf("prefill kernel, worst: fp16 operands out %.2e lse %.2e; bf16 out %.2e lse %.2e\n",
              worst_out[0], worst_lse[0], worst_out[1], worst_lse[1]);
  // Exact precision keeps these shapes on the chunk kernel.
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 2, 16);
  const AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, 8, 900);
  const Errors e = RunAndCompare({.quantizer = &q}, s, s.base.cache);
  EXPECT_FALSE(e.prefill);
  ExpectWithin(e, kLseTol, "exact");
}

// The dequantized tiles of long chunks (AttentionPlan::prefill_tiles) hold the values the wgmma
// kernel's producers write: the same outputs bit for bit with them and without, for every kind,
// with splits (a tile read by two splits), a sliding window, leading decode rows (the tiles
// written before their decode), chunks that start inside a tile after a prefix, beside a chunk
// too short for tiles and one after too long a prefix (PrefillTilesFor).
TEST(CudaAttentionTest, PrefillTilesChangeNoBit) {
  TQKV_SKIP_WITHOUT_GPU();
  cudaDeviceProp prop{};
  TQKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9 || prop.minor != 0) {
    GTEST_SKIP() << "the dequantized tiles are the wgmma kernel's (compute capability 9.0)";
  }
  const Step step{{1, 1, 700, 256, 1300, 300, 1400}, {1, 1, 300, 256, 600, 70, 256}};
  const int hk = 2, group = 4;
  int k = 0;
  // lead > 0: only that many leading one-token rows (AttentionOptions::leading_decode_seqs).
  auto check = [&](Case c, const AttentionScenario& s, const std::vector<uint8_t>& cache, bool bf16,
                   const std::string& name, int lead = 0) {
    for (int variant = lead > 0 ? 3 : 0; variant < 4; ++variant) {
      c.options = AttentionOptions{};
      c.window = 0;
      if (variant == 1) c.options.tokens_per_split = 128;
      if (variant == 2) c.window = 300;
      if (variant == 3) c.options.leading_decode_seqs = lead > 0 ? lead : 2;
      std::vector<float> out[2], lse[2];
      Errors e[2];
      for (int tiles = 0; tiles < 2; ++tiles) {
        c.options.prefill_tiles = tiles == 1;
        c.keep_out = &out[tiles];
        c.keep_lse = &lse[tiles];
        e[tiles] = RunAndCompare(c, s, cache);
      }
      const std::string what =
          fmt::format("{} variant {}: out {:.2e} lse {:.2e}", name, variant, e[1].out, e[1].lse);
      EXPECT_TRUE(e[1].prefill && e[1].prefill_tiles) << what;
      EXPECT_FALSE(e[0].prefill_tiles) << what;
      EXPECT_EQ(e[1].bad, 0) << what;
      // The precision bounds are PrefillKernelInHalfPrecision's; here the 3-bit values of these
      // longer chunks reach 8.6e-3 either way.
      const HalfBounds b = HalfBoundsOf(bf16);
      EXPECT_LE(e[1].lse, b.lse) << what;
      EXPECT_LE(e[1].out, 1.5 * std::max(b.out, 6e-3)) << what;
      ASSERT_EQ(out[0].size(), out[1].size());
      EXPECT_EQ(std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)), 0)
          << what;
      EXPECT_EQ(std::memcmp(lse[0].data(), lse[1].data(), lse[0].size() * sizeof(float)), 0)
          << what;
    }
  };
  for (const char* preset : kPresetNames) {
    const int bs = 16 << (k % 3);
    const Quantizer q = Quantizer::Create(preset, 128, hk, bs);
    const AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, hk * group, 950 + k++);
    check(Case{.quantizer = &q}, s, s.base.cache, false, fmt::format("{} bs={}", preset, bs));
  }
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const int bs = 16 << (k % 3);
    const Quantizer any = Quantizer::Create("turboquant_k8v4", 128, hk, bs);
    AttentionScenario s = BuildAttention(any, step.lens, step.q_lens, hk * group, 950 + k++);
    for (float& x : s.queries) {
      x = dtype == DType::kF16 ? HalfBitsToFloat(FloatToHalfBits(x))
                               : BFloat16BitsToFloat(FloatToBFloat16Bits(x));
    }
    const Bf16BlockFormat f = MakeBf16BlockFormat(128, hk, bs, dtype);
    const std::vector<uint8_t> cache = testing::StorePlain(s, f);
    check(Case{.plain = &f}, s, cache, dtype == DType::kBF16,
          fmt::format("{} bs={}", DTypeName(dtype), bs));
  }
  // 80 leading one-token rows: the chunks' first new tokens lie past the call's first tile, so the
  // dequantization grid's first CTAs come before any chunk's and must find none
  // (PrefillTileSequence), not a tile before the first chunk's prefix, whose block ids would be
  // read from the rows before it.
  Step many;
  for (int i = 0; i < 80; ++i) {
    many.lens.push_back(40 + 7 * i);
    many.q_lens.push_back(1);
  }
  many.lens.insert(many.lens.end(), {700, 1300});
  many.q_lens.insert(many.q_lens.end(), {300, 600});
  for (const char* preset : {"turboquant_4bit_nc", "turboquant_k8v4"}) {
    const Quantizer q = Quantizer::Create(preset, 128, hk, 16);
    const AttentionScenario s = BuildAttention(q, many.lens, many.q_lens, hk * group, 950 + k++);
    check(Case{.quantizer = &q}, s, s.base.cache, false, fmt::format("{} 80 leading rows", preset),
          80);
  }
}

// The slots of the dequantized tiles (host arithmetic, no device): for random calls (one-token
// rows, short and long chunks after short and long prefixes, leading rows before the prefill
// kernel's sequences), the sequences that take tiles get disjoint slot ranges inside
// PrefillTileSlots of the whole call, and each has as many CTAs of the dequantization grid as
// tiles, inside PrefillTileGrid, which find it (PrefillTileSequence) and its tiles in order.
// The chunk and prefill kernels' splits are ChooseChunkSplits' (attention_plan_test) at the
// device's SM count: one chunk after 1k and 4k, 64 sequences with 4 new tokens each, 8 new tokens
// after 128k on the prefill kernel, and on the chunk kernel (exact precision).
TEST(CudaAttentionTest, ChunkSplitsAreTheHostChoice) {
  TQKV_SKIP_WITHOUT_GPU();
  int sms = 0;
  TQKV_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const CudaAttention attn(Quantizer::Create("turboquant_4bit_nc", 128, 8, 16));
  struct Call {
    int seqs, tokens, max_len, max_q_len;
  };
  for (const ChunkPrecision precision : {ChunkPrecision::kHalf, ChunkPrecision::kExact}) {
    for (const Call& c : {Call{1, 256, 1024 + 256, 256}, Call{1, 256, 4096 + 256, 256},
                          Call{64, 256, 4096, 4}, Call{1, 8, 131072, 8}}) {
      const AttentionPlan plan = attn.Plan(c.seqs, c.tokens, 32, c.max_len / 16, c.max_q_len,
                                           {.decode_kernels = false, .chunk_precision = precision});
      ASSERT_FALSE(plan.decode);
      ASSERT_EQ(plan.verify_passes, 0);
      EXPECT_EQ(plan.prefill, precision == ChunkPrecision::kHalf);
      const ChunkCall call{.max_len = c.max_len,
                           .num_tokens = c.tokens,
                           .max_q_len = c.max_q_len,
                           .group = 4,
                           .num_kv_heads = 8,
                           .cta_rows = plan.prefill ? 128 : 16 * plan.row_warps,
                           .prefill = plan.prefill};
      const ChunkSplits want = ChooseChunkSplits(call, sms);
      const std::string at = fmt::format("{} x {} new tokens, context {}, {}", c.seqs, c.max_q_len,
                                         c.max_len, plan.prefill ? "prefill" : "chunk");
      EXPECT_EQ(plan.max_splits, want.splits) << at;
      EXPECT_EQ(plan.tokens_per_split, want.tokens_per_split) << at;
    }
  }
}

TEST(CudaAttentionTest, PrefillTileSlotsHoldEveryCall) {
  using namespace attention_detail;
  std::mt19937 rng(2026);
  std::uniform_int_distribution<int> kind(0, 3), seqs(1, 40), lead_of(0, 8), prefix_of(0, 30000);
  std::uniform_int_distribution<int> short_len(2, kPrefillTilesMinQLen - 1), long_len(256, 5000);
  int takers_seen = 0, mapped_after_lead = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    // Leading one-token rows (AttentionOptions::leading_decode_seqs): a few, or enough (64 and
    // more) to put the kernel's first sequence past its first tile.
    const int lead = trial % 3 == 0 ? 64 + static_cast<int>(rng() % 400) : lead_of(rng);
    const int n = seqs(rng);
    std::vector<int> q_len(n), prefix(n);
    for (int b = 0; b < n; ++b) {
      const int k = kind(rng);
      q_len[b] = k == 0 ? 1 : k == 1 ? short_len(rng) : k == 2 ? long_len(rng) : 0;
      prefix[b] = prefix_of(rng) % (k == 2 && rng() % 2 ? 2 * q_len[b] + 1 : 30001);
    }
    int tokens = lead;  // the leading one-token rows come first in the call
    std::vector<int> q_start(n + 1);
    for (int b = 0; b < n; ++b) {
      q_start[b] = tokens;
      tokens += q_len[b];
    }
    q_start[n] = tokens;
    const int64_t slots = PrefillTileSlots(tokens, lead + n);
    const int64_t grid = PrefillTileGrid(tokens, n);  // the kernel's sequences (after the lead)
    int takers = 0, end = 0;
    for (int b = 0; b < n; ++b) {
      if (!PrefillTilesFor(q_len[b], prefix[b])) continue;
      const int first = PrefillFirstTileSlot(q_start[b], takers++);
      const int count = PrefillTilesOf(q_len[b], prefix[b]);
      ASSERT_GE(first, end) << "trial " << trial << " sequence " << b;
      end = first + count;
      ASSERT_LE(end, slots) << "trial " << trial << " sequence " << b;
      // The grid's CTAs of b (relative to the kernel's first sequence): q_start / 64 + 2 · b on.
      const int64_t x0 = q_start[b] / 64 + 2 * b;
      const int64_t x1 = b + 1 < n ? q_start[b + 1] / 64 + 2 * (b + 1) : grid;
      ASSERT_LE(x0 + count, x1) << "trial " << trial << " sequence " << b;
    }
    takers_seen += takers;
    // The dequantization grid (DequantTilesKernel): CTA x finds its sequence (PrefillTileSequence)
    // and dequantizes that sequence's tile x - PrefillFirstTileCta; every tile of every sequence
    // that takes tiles exactly once, and no CTA a tile before a sequence's first new token (a CTA
    // before the first sequence's finds none).
    if (trial % 4 != 0) continue;
    std::vector<int32_t> qsl(q_start.begin(), q_start.end());
    std::vector<int> covered(n, 0);
    for (int x = 0; x < grid; ++x) {
      const int b = PrefillTileSequence(qsl.data(), n, x);
      if (b < 0) {
        ASSERT_LT(x, PrefillFirstTileCta(qsl.data(), 0)) << "trial " << trial << " CTA " << x;
        continue;
      }
      const int rel = x - PrefillFirstTileCta(qsl.data(), b);
      ASSERT_GE(rel, 0) << "trial " << trial << " CTA " << x << " sequence " << b;
      if (b + 1 < n) ASSERT_LT(x, PrefillFirstTileCta(qsl.data(), b + 1)) << "trial " << trial;
      if (PrefillTilesFor(q_len[b], prefix[b]) && rel < PrefillTilesOf(q_len[b], prefix[b])) {
        ASSERT_EQ(covered[b], rel) << "trial " << trial << " sequence " << b;
        ++covered[b];
        mapped_after_lead += lead >= 64 ? 1 : 0;
      }
    }
    for (int b = 0; b < n; ++b) {
      const int want =
          PrefillTilesFor(q_len[b], prefix[b]) ? PrefillTilesOf(q_len[b], prefix[b]) : 0;
      ASSERT_EQ(covered[b], want) << "trial " << trial << " sequence " << b;
    }
  }
  EXPECT_GT(takers_seen, 20000);  // the calls did have sequences that take tiles
  EXPECT_GT(mapped_after_lead, 1000);  // and tiles after 64 or more leading rows
}

// A mixed step whose one-token sequences come first, as vLLM orders a step
// (AttentionOptions::leading_decode_seqs): those rows run on the decode kernels in place, the
// chunk and prefill kernels' grids start after them. Decode rows to the decode kernels' bounds,
// the others to the kernel's own (the prefill kernel's half precision, the chunk kernel's exact
// numerics), with splits (the merge of the rows after the leading ones), a sliding window (the
// leading rows on the decode kernels under it too) and a step of one-token sequences only. The
// leading rows' contexts are split, so that where the chunk kernel overlaps their decode, their
// merge runs after it.
TEST(CudaAttentionTest, LeadingDecodeRowsRunInPlace) {
  TQKV_SKIP_WITHOUT_GPU();
  const Step step{{300, 1000, 77, 700, 150, 2000}, {1, 1, 1, 200, 65, 300}};
  auto check = [](const Errors& e, const char* preset, const std::string& what) {
    EXPECT_EQ(e.leading_decodes, 3) << what;
    if (e.prefill) {
      const HalfBounds hb = HalfBoundsOf(false);
      EXPECT_EQ(e.bad, 0) << what;
      EXPECT_LE(e.lse, hb.lse) << what;
      EXPECT_LE(e.out, hb.out) << what;
      const DecodeBounds db = DecodeBoundsOf(preset);
      EXPECT_LE(e.decode_lse, db.lse) << what;
      EXPECT_LE(e.decode_out, db.out) << what;
    } else {
      ExpectWithin(e, kLseTol, what, DecodeBoundsOf(preset));
    }
  };
  int k = 0, deferred_merges = 0;
  for (const char* preset : kPresetNames) {
    for (int d : {64, 128, 256}) {
      const int group = (k % 4) + 1, hk = 2, bs = 16 << (k % 4);
      ++k;
      const Quantizer q = Quantizer::Create(preset, d, hk, bs);
      const AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, hk * group, 970 + k);
      for (int variant = 0; variant < 5; ++variant) {
        Case c{.quantizer = &q};
        c.options.leading_decode_seqs = 3;
        if (variant == 0) c.options.chunk_precision = ChunkPrecision::kHalf;
        if (variant == 2) c.options.tokens_per_split = 64;
        if (variant >= 3) c.window = 100;
        if (variant == 4) c.options.decode.sliding_window = 100;  // the leading rows' splits
        const Errors e = RunAndCompare(c, s, s.base.cache);
        const std::string what = fmt::format(
            "{} D={} group={} bs={} variant {}: out {:.2e} lse {:.2e}, decode rows out {:.2e} lse "
            "{:.2e}",
            preset, d, group, bs, variant, e.out, e.lse, e.decode_out, e.decode_lse);
        // The chunk kernel follows the decode directly (and starts on the SMs it leaves); the
        // q·Πᵀ it needs where it does not rotate the query itself comes before the decode.
        EXPECT_TRUE(e.overlap_next) << what;
        deferred_merges += e.overlap_next && e.decode_splits > 1 && c.window == 0 ? 1 : 0;
        check(e, preset, what);
      }
    }
  }
  EXPECT_GE(deferred_merges, 3);  // the leading rows' merge did come after the chunk kernel
  {  // A dense Πᵀ: the decode kernels' own query prep comes before their split grid.
    const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 2, 16, RotationKind::kHaar, 5);
    const AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, 8, 995);
    Case c{.quantizer = &q};
    c.options.leading_decode_seqs = 3;
    const Errors e = RunAndCompare(c, s, s.base.cache);
    EXPECT_FALSE(e.overlap_next);
    check(e, "turboquant_4bit_nc",
          fmt::format("haar: out {:.2e} lse {:.2e}, decode rows out {:.2e} lse {:.2e}", e.out,
                      e.lse, e.decode_out, e.decode_lse));
  }
  // Every sequence one token, with a max_q_len bound above 1: a decode plan.
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 2, 16);
  const AttentionScenario s = BuildAttention(q, {300, 1000, 77}, {1, 1, 1}, 8, 990);
  Case c{.quantizer = &q};
  c.options.leading_decode_seqs = 3;
  const Errors e = RunAndCompare(c, s, s.base.cache, nullptr, nullptr, 3);
  EXPECT_TRUE(e.decode);
  ExpectWithin(e, kLseTol, "one-token sequences only", DecodeBoundsOf("turboquant_4bit_nc"));
}

// Leading verify rows (AttentionOptions::leading_max_q_len > 1: vLLM's decodes with draft tokens
// first in the step) beside prefill chunks: 1 to 4 new tokens per leading sequence run as one
// verify pass in place, 1 to 12 as 2 passes of 8 where the plan takes 16 new tokens as passes
// (4bit_nc, k3v4_nc and 3bit_nc at head_dim 128; 3 of 4 at 64), on the prefill or chunk kernel
// with the others where it does not (k8v4 and the bf16 cache past 8). Against the reference: the
// exact verify and chunk numerics (the default Case) to the decode bounds, half precision to the
// half bounds, where the rows after the leading sequences come out bit for bit as in the same
// call without leading rows (the same kernel, the same splits); with splits of the chunk's
// context (whose merge must leave the leading rows alone), a sliding window (the leading rows
// on the decode kernels under it too, the shared-output kernel's window twin among them) and a
// dense Πᵀ (the verify passes read the chunk's q·Πᵀ).
TEST(CudaAttentionTest, LeadingVerifyRowsRunInPlace) {
  TQKV_SKIP_WITHOUT_GPU();
  // (A chunk of 300 new tokens: at head_dim 128 in half precision its own tiles are dequantized
  // into the workspace first, for the sequences after the leading ones.)
  const Step four{{300, 1000, 77, 2000, 700, 150}, {4, 1, 3, 4, 300, 65}};
  const Step twelve{{300, 1000, 77, 2000, 700, 150}, {12, 1, 9, 12, 300, 65}};
  auto check = [](const Errors& e, const char* kind, bool half, const std::string& what) {
    EXPECT_EQ(e.bad, 0) << what;
    if (half) {  // (the bf16 cache: its prefill kernel's bounds)
      const HalfBounds hb = HalfBoundsOf(std::string_view(kind) == "BF16");
      EXPECT_LE(std::max(e.lse, e.decode_lse), hb.lse) << what;
      EXPECT_LE(std::max(e.out, e.decode_out), hb.out) << what;
    } else {
      ExpectWithin(e, kLseTol, what, DecodeBoundsOf(kind));
      EXPECT_LE(e.rest_lse, kLseTol) << what;
      EXPECT_LE(e.rest_out, kOutTol) << what;
    }
  };
  int k = 0, passes2 = 0, deferred_merges = 0, tiles = 0;
  for (const char* preset : {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
                             "turboquant_k8v4", "bf16"}) {
    const bool plain = std::string_view(preset) == "bf16";
    for (int d : {64, 128}) {
      const int hk = 2, group = 4, bs = 16 << (k % 4);
      ++k;
      const Quantizer q =
          Quantizer::Create(plain ? "turboquant_k8v4" : preset, d, hk, bs);  // (plain: its shape)
      const Bf16BlockFormat f = MakeBf16BlockFormat(d, hk, bs, DType::kBF16);
      for (const Step* step : {&four, &twelve}) {
        const int lead_q = step == &four ? 4 : 12;
        AttentionScenario s = BuildAttention(q, step->lens, step->q_lens, hk * group, 1400 + k);
        if (plain) {
          for (float& x : s.queries) x = BFloat16BitsToFloat(FloatToBFloat16Bits(x));
        }
        const std::vector<uint8_t> cache = plain ? testing::StorePlain(s, f) : s.base.cache;
        for (int variant = 0; variant < 5; ++variant) {
          Case c = plain ? Case{.plain = &f} : Case{.quantizer = &q};
          c.options.leading_decode_seqs = 4;
          c.options.leading_max_q_len = lead_q;
          const bool half = variant == 1 || variant == 2 || variant == 4;
          if (half) {
            c.options.chunk_precision = ChunkPrecision::kHalf;
            c.options.verify_precision = ChunkPrecision::kHalf;
          }
          if (variant == 2) c.options.tokens_per_split = 64;
          if (variant >= 3) c.window = 100;
          // Told of the window: the leading passes' splits sized for it.
          if (variant == 4) c.options.decode.sliding_window = 128;
          c.rest_from_seq = 4;
          std::vector<float> out_said, out_unsaid;
          c.keep_out = &out_said;
          const Errors e = RunAndCompare(c, s, cache);
          // The same call without saying which sequences lead (every row on the chunk or prefill
          // kernel): the rows after the leading sequences run on the same kernel either way.
          Case unsaid = c;
          unsaid.options.leading_decode_seqs = 0;
          unsaid.options.leading_max_q_len = 1;
          unsaid.keep_out = &out_unsaid;
          const Errors eu = half ? RunAndCompare(unsaid, s, cache) : Errors{};
          double apart = 0;  // the rest rows' largest difference between the two calls
          for (size_t i = size_t{s.query_start_loc[4]} * hk * group * d; i < out_unsaid.size();
               ++i) {
            apart = std::max(apart, double(std::abs(out_said[i] - out_unsaid[i])));
          }
          const std::string what = fmt::format(
              "{} D={} bs={} leading_max_q_len {} variant {}: out {:.2e} lse {:.2e}, one-token "
              "and leading verify rows out {:.2e} lse {:.2e}, the rest out {:.2e} lse {:.2e} "
              "(unsaid {:.2e} {:.2e}, apart {:.2e})",
              preset, d, bs, lead_q, variant, e.out, e.lse, e.decode_out, e.decode_lse, e.rest_out,
              e.rest_lse, eu.rest_out, eu.rest_lse, apart);
          // The rest in half precision: the prefill kernel's own numerics, bit for bit (the
          // same splits either way; PrefillKernelInHalfPrecision holds them to its bounds, this
          // data takes k3v4_nc at head_dim 64 to 8.5e-3, unsaid as said). The exact kernels: to
          // the decode bounds in check.
          if (half) {
            EXPECT_EQ(apart, 0.0) << what;
            EXPECT_EQ(e.rest_out, eu.rest_out) << what;
            EXPECT_LE(e.rest_out, 1e-2) << what;
            EXPECT_LE(e.rest_lse, HalfBoundsOf(plain).lse) << what;
          }
          // The plan's verify limit: 16 at head_dim 64 (4 passes of 16 columns on the compressed
          // caches, 2 of 32 on the bf16 one), and at 128 on the codebook keys' 32-column passes
          // (half precision), else 8.
          const bool codebook = !plain && std::string_view(preset) != "turboquant_k8v4";
          const bool sixteen = d == 64 || (d == 128 && codebook && half);
          const bool led = lead_q <= 8 || sixteen;
          // WithLeadingSequences' limit, as the plan takes it.
          const CudaAttention attn = plain ? CudaAttention(f) : CudaAttention(q);
          EXPECT_EQ(attn.MaxLeadingQLen(hk * group, c.options), sixteen ? 16 : 8) << what;
          EXPECT_EQ(e.leading_decodes, led ? 4 : 0) << what;
          EXPECT_EQ(e.leading_max_q_len, led ? lead_q : 0) << what;
          // (Under a window too, the half-precision passes at head_dim 128 run on the shared-output
          // kernel: its window twin.)
          if (variant >= 3 && led) {
            EXPECT_EQ(e.shared_verify, half && !plain && d == 128) << what;
          }
          if (led && c.window == 0) {
            // New tokens per pass at GQA 4: 32 or 16 columns (MaxSplitGroup).
            const int rows = plain || (d == 128 && half) ? 8 : 4;
            EXPECT_EQ(e.verify_passes, (lead_q + rows - 1) / rows) << what;
            passes2 += e.verify_passes > 1 ? 1 : 0;
            deferred_merges += e.overlap_next && e.decode_splits > 1 ? 1 : 0;
            tiles += e.prefill_tiles ? 1 : 0;
          }
          check(e, plain ? "BF16" : preset, half, what);
        }
      }
    }
  }
  EXPECT_GE(passes2, 6);
  {  // No leading verify rows past GQA 16 or without the decode kernels.
    const CudaAttention attn(Quantizer::Create("turboquant_4bit_nc", 128, 2, 16));
    EXPECT_EQ(attn.MaxLeadingQLen(2 * 17), 1);
    EXPECT_EQ(attn.MaxLeadingQLen(2 * 16), 8);  // (8 passes of 2 for 16: past the limit)
    EXPECT_EQ(attn.MaxLeadingQLen(8, {.decode_kernels = false}), 1);
  }
  EXPECT_GE(deferred_merges, 1);  // the last pass's merge came after the chunk kernel
  EXPECT_GE(tiles, 1);            // and the chunk's tiles were dequantized first
  {                               // A dense Πᵀ: the verify passes read the chunk's q·Πᵀ.
    const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 2, 16, RotationKind::kHaar, 5);
    for (const Step* step : {&four, &twelve}) {
      const AttentionScenario s = BuildAttention(q, step->lens, step->q_lens, 8, 1450);
      Case c{.quantizer = &q};
      c.options.leading_decode_seqs = 4;
      c.options.leading_max_q_len = step == &four ? 4 : 12;
      c.options.chunk_precision = ChunkPrecision::kHalf;
      c.options.verify_precision = ChunkPrecision::kHalf;
      const Errors e = RunAndCompare(c, s, s.base.cache);
      const std::string what = fmt::format(
          "haar, leading_max_q_len {}: out {:.2e} lse {:.2e}, leading rows out {:.2e} "
          "lse {:.2e}",
          c.options.leading_max_q_len, e.out, e.lse, e.decode_out, e.decode_lse);
      EXPECT_EQ(e.leading_decodes, 4) << what;
      EXPECT_TRUE(e.overlap_next) << what;  // (no query prep of the passes' own)
      check(e, "turboquant_4bit_nc", true, what);
    }
  }
}

// Value metadata whose values reach past fp16 (scales 2,000-30,000, zeros near -55,000 on every
// third 8-token group: values up to ~400,000; tqkv's store never writes them, a cache converted
// from elsewhere may hold them). The prefill kernels dequantize values to fp16 divided by 16 (the
// wgmma kernel) or scale P by them (the mma.sync kernel): such groups must come out finite and as
// accurate, relative to the row, as the others, beside groups of ordinary values in the same
// tiles.
TEST(CudaAttentionTest, PrefillKernelKeepsValuesPastFp16) {
  TQKV_SKIP_WITHOUT_GPU();
  const Step step{{300, 1, 1000, 150}, {300, 1, 200, 65}};
  for (const char* preset : {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4"}) {
    for (int d : {64, 128}) {
      const int hk = 2, group = 4, bs = 16;
      const Quantizer q = Quantizer::Create(preset, d, hk, bs);
      const AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, hk * group, 950 + d);
      std::vector<uint8_t> cache = s.base.cache;
      const BlockFormat& f = q.format();
      std::mt19937_64 rng(d);
      std::uniform_real_distribution<float> scale(2000.0f, 30000.0f), zero(-60000.0f, -50000.0f);
      for (size_t b = 0; b < s.base.seq_lens.size(); ++b) {
        for (int t = 0; t < s.base.seq_lens[b]; ++t) {
          if ((t / 8) % 3 != 0) continue;
          const int32_t block = s.base.block_tables[b * s.base.max_blocks + t / bs];
          uint8_t* base = cache.data() + int64_t{block} * f.block_bytes;
          for (int h = 0; h < hk; ++h) {
            const uint16_t sc = FloatToHalfBits(scale(rng)), ze = FloatToHalfBits(zero(rng));
            std::memcpy(base + f.MetaOffset(MetaField::kValueScale, t % bs, h), &sc, 2);
            std::memcpy(base + f.MetaOffset(MetaField::kValueZero, t % bs, h), &ze, 2);
          }
        }
      }
      Case c{.quantizer = &q};
      c.options.chunk_precision = ChunkPrecision::kHalf;
      const Errors e = RunAndCompare(c, s, cache);
      const std::string what =
          fmt::format("{} D={} large values: out {:.2e} lse {:.2e}", preset, d, e.out, e.lse);
      std::printf("%s\n", what.c_str());
      const HalfBounds hb = HalfBoundsOf(false);
      EXPECT_TRUE(e.prefill) << what;
      EXPECT_EQ(e.bad, 0) << what;
      EXPECT_LE(e.lse, hb.lse) << what;
      EXPECT_LE(e.out, hb.out) << what;
    }
  }
}

// Every token's values at 65504 + 16 · code (value zero 65504, scale 16: what the store writes
// for values spanning fp16's range dequantizes up to ~60 past 65504): each output element, an
// average of such values, lies past fp16's largest finite value, where a plain conversion gives
// inf. F16 outputs saturate to 65504 on every kernel: the decode plan (one split per sequence,
// or merged splits), verify passes (exact and half precision), the chunk and prefill kernels
// and the leading decode rows of a mixed step.
TEST(CudaAttentionTest, F16OutputsSaturateOnEveryKernel) {
  TQKV_SKIP_WITHOUT_GPU();
  const Step steps[] = {{{700, 4000, 33}, {1, 1, 1}},
                        {{700, 900, 40}, {4, 8, 4}},
                        {{300, 1, 1000, 150}, {300, 1, 200, 65}},
                        MixedStep()};
  for (const char* preset : kPresetNames) {
    for (int d : {64, 128}) {
      const int hk = 2, group = 4, bs = 16;
      const Quantizer q = Quantizer::Create(preset, d, hk, bs);
      const BlockFormat& f = q.format();
      const uint16_t scale = FloatToHalfBits(16.0f), zero = FloatToHalfBits(65504.0f);
      int k = 0;
      for (const Step& step : steps) {
        AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, hk * group, 1200 + k);
        for (size_t b = 0; b < s.base.seq_lens.size(); ++b) {
          for (int t = 0; t < s.base.seq_lens[b]; ++t) {
            const int32_t block = s.base.block_tables[b * s.base.max_blocks + t / bs];
            uint8_t* base = s.base.cache.data() + int64_t{block} * f.block_bytes;
            for (int h = 0; h < hk; ++h) {
              std::memcpy(base + f.MetaOffset(MetaField::kValueScale, t % bs, h), &scale, 2);
              std::memcpy(base + f.MetaOffset(MetaField::kValueZero, t % bs, h), &zero, 2);
            }
          }
        }
        for (const bool exact : {true, false}) {
          std::vector<float> out;
          Case c{.quantizer = &q, .io = DType::kF16, .keep_out = &out};
          if (!exact) c.options = AttentionOptions{};
          if (k == 3) c.options.leading_decode_seqs = 2;  // MixedStep's two decode rows
          const Errors e = RunAndCompare(c, s, s.base.cache);
          const std::string what = fmt::format("{} D={} step {} exact {}", preset, d, k, exact);
          const int64_t not_max =
              std::count_if(out.begin(), out.end(), [](float x) { return x != 65504.0f; });
          EXPECT_EQ(not_max, 0) << what << ": elements other than 65504 (inf before saturating)";
          EXPECT_EQ(e.bad, 0) << what;
        }
        ++k;
      }
    }
  }
}

// A prompt whose keys from token 256 on include some 8 times as long, so that many rows' scores
// pass the maximum of their first tile by more than 2^8: the wgmma prefill kernel moves its lazy
// softmax reference (and rescales O) only then, on a path random K/V alone rarely take. The
// bf16 / fp16 caches multiply query and keys exactly, so the longer keys add no rounding of their
// own. On other devices and head dims the mma.sync kernel runs the same rows.
TEST(CudaAttentionTest, PrefillKernelRescalesWhenScoresJump) {
  TQKV_SKIP_WITHOUT_GPU();
  const int hk = 2, group = 4, d = 128, bs = 16, len = 600;
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const Quantizer any = Quantizer::Create("turboquant_k8v4", d, hk, bs);
    AttentionScenario s = BuildAttention(any, {len}, {len}, hk * group, 990);
    for (float& x : s.queries) {
      x = dtype == DType::kF16 ? HalfBitsToFloat(FloatToHalfBits(x))
                               : BFloat16BitsToFloat(FloatToBFloat16Bits(x));
    }
    std::vector<float>& keys = s.base.keys[0];
    for (int t = 256; t < len; t += 37) {
      for (int i = 0; i < hk * d; ++i) keys[int64_t{t} * hk * d + i] *= 8.0f;
    }
    const Bf16BlockFormat f = MakeBf16BlockFormat(d, hk, bs, dtype);
    const std::vector<uint8_t> cache = testing::StorePlain(s, f);  // keys as stored
    // Rows whose largest score (log2 units, as the kernel's) passes that of tokens 0-63 by > 8.
    const double scale = std::log2(std::exp(1.0)) / std::sqrt(double(d));
    int jumps = 0;
    for (int i = 0; i < len; ++i) {
      for (int qh = 0; qh < hk * group; ++qh) {
        const float* q = s.queries.data() + (int64_t{i} * hk * group + qh) * d;
        double first = -INFINITY, later = -INFINITY;
        for (int t = 0; t <= i; ++t) {
          const float* k = keys.data() + (int64_t{t} * hk + qh / group) * d;
          double dot = 0;
          for (int e = 0; e < d; ++e) dot += double(q[e]) * k[e];
          double& best = t < 64 ? first : later;
          best = std::max(best, dot * scale);
        }
        jumps += later > first + 8.0;
      }
    }
    EXPECT_GE(jumps, 200) << DTypeName(dtype);
    Case c{.plain = &f};
    c.options.chunk_precision = ChunkPrecision::kHalf;
    const Errors e = RunAndCompare(c, s, cache);
    const std::string what = fmt::format("{} cache, {} rows past a jump: out {:.2e} lse {:.2e}",
                                         DTypeName(dtype), jumps, e.out, e.lse);
    std::printf("%s\n", what.c_str());
    const HalfBounds b = HalfBoundsOf(dtype == DType::kBF16);
    EXPECT_TRUE(e.prefill) << what;
    EXPECT_EQ(e.bad, 0) << what;
    EXPECT_LE(e.lse, b.lse) << what;
    EXPECT_LE(e.out, b.out) << what;
  }
}

// At head_dim 64 the plan's choice (verify_max_q_len -1) runs up to 16 new tokens as verify passes
// on the compressed caches where they take at most 4 passes (SmolLM2's GQA 3: 4 passes of 5), on
// the bf16 / fp16 caches where they take at most 2; at head_dim 128 on 4bit_nc, k3v4_nc and
// 3bit_nc where they take at most 2; 17 tokens, more passes and an explicit 8 keep the prefill
// kernel. The passes at head_dim 64 match the reference (at 128: VerifyInHalfPrecision).
TEST(CudaAttentionTest, VerifyPassesTakeSixteenNewTokens) {
  TQKV_SKIP_WITHOUT_GPU();
  int k = 0;
  for (const char* preset :
       {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "turboquant_k8v4"}) {
    const CudaAttention attn(Quantizer::Create(preset, 64, 3, 16));
    // 2 sequences of 16 new tokens at GQA 3.
    const AttentionPlan p = attn.Plan(2, 32, 9, 4, 16);
    ASSERT_TRUE(p.verify_rows) << preset;
    EXPECT_EQ(p.verify_pass_rows, 5) << preset;
    EXPECT_EQ(p.verify_passes, 4) << preset;
    EXPECT_FALSE(attn.Plan(2, 34, 9, 4, 17).verify_rows) << preset;
    EXPECT_FALSE(attn.Plan(2, 32, 15, 4, 16).verify_rows) << preset;  // GQA 5: 6 passes
    AttentionOptions eight;
    eight.verify_max_q_len = 8;
    EXPECT_FALSE(attn.Plan(2, 32, 9, 4, 16, eight).verify_rows) << preset;
    // At head_dim 128 (32 columns per pass) the codebook keys: at most 2 passes, 2 of 10 at
    // GQA 3, not 3 of 6 at GQA 5, and not the exact kernels' 4 of 5 (16 columns); k8v4 never.
    const CudaAttention d128(Quantizer::Create(preset, 128, 3, 16));
    const AttentionPlan p128 = d128.Plan(2, 32, 9, 4, 16);
    const bool fp8 = std::string_view(preset) == "turboquant_k8v4";
    ASSERT_EQ(p128.verify_rows, !fp8) << preset;
    EXPECT_EQ(p128.verify_pass_rows, fp8 ? 0 : 10) << preset;
    EXPECT_EQ(p128.verify_passes, fp8 ? 0 : 2) << preset;
    EXPECT_FALSE(d128.Plan(2, 34, 9, 4, 17).verify_rows) << preset;
    EXPECT_FALSE(d128.Plan(2, 32, 15, 4, 16).verify_rows) << preset;
    AttentionOptions exact;
    exact.verify_precision = ChunkPrecision::kExact;
    EXPECT_FALSE(d128.Plan(2, 32, 9, 4, 16, exact).verify_rows) << preset;

    const int hk = 2, group = 3;
    const Quantizer q = Quantizer::Create(preset, 64, hk, 16 << (k % 4));
    const AttentionScenario s = BuildAttention(q, {300, 77, 1000, 150, 0, 65},
                                               {16, 1, 12, 9, 0, 16}, hk * group, 1200 + k++);
    for (ChunkPrecision precision : {ChunkPrecision::kExact, ChunkPrecision::kHalf}) {
      Case c{.quantizer = &q};
      c.options.verify_precision = precision;
      const Errors e = RunAndCompare(c, s, s.base.cache);
      const bool half =
          std::string_view(preset) != "turboquant_k8v4" && precision == ChunkPrecision::kHalf;
      const std::string what = fmt::format("{} {}: out {:.2e} lse {:.2e}", preset,
                                           half ? "half" : "exact", e.decode_out, e.decode_lse);
      EXPECT_EQ(e.verify_columns, 5 * group) << what;
      EXPECT_EQ(e.half_verify, half) << what;
      EXPECT_EQ(e.bad, 0) << what;
      const HalfBounds b = HalfBoundsOf(false);
      const DecodeBounds db = half ? DecodeBounds{b.lse, b.out} : DecodeBoundsOf(preset);
      EXPECT_LE(e.decode_lse, db.lse) << what;
      EXPECT_LE(e.decode_out, db.out) << what;
    }
  }
  // The bf16 / fp16 caches: at most 2 passes (of up to 32 columns), 2 of 10 at GQA 3; not the 3
  // of 6 at GQA 5. The passes match the reference.
  const CudaAttention plain(MakeBf16BlockFormat(64, 3, 16, DType::kBF16));
  const AttentionPlan pp = plain.Plan(2, 32, 9, 4, 16);
  ASSERT_TRUE(pp.verify_rows);
  EXPECT_EQ(pp.verify_pass_rows, 10);
  EXPECT_EQ(pp.verify_passes, 2);
  EXPECT_FALSE(plain.Plan(2, 32, 15, 4, 16).verify_rows);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const int hk = 2, group = 3, bs = 32;
    const Quantizer any = Quantizer::Create("turboquant_k8v4", 64, hk, bs);
    AttentionScenario s =
        BuildAttention(any, {300, 77, 1000, 150, 0, 65}, {16, 1, 12, 9, 0, 16}, hk * group, 1300);
    for (float& x : s.queries) {
      x = dtype == DType::kF16 ? HalfBitsToFloat(FloatToHalfBits(x))
                               : BFloat16BitsToFloat(FloatToBFloat16Bits(x));
    }
    const Bf16BlockFormat f = MakeBf16BlockFormat(64, hk, bs, dtype);
    const std::vector<uint8_t> cache = testing::StorePlain(s, f);
    const Errors e = RunAndCompare({.plain = &f}, s, cache);
    EXPECT_EQ(e.verify_columns, 10 * group) << DTypeName(dtype);
    ExpectWithin(e, kLseTol,
                 fmt::format("{} D 64: verify passes out {:.2e} lse {:.2e}", DTypeName(dtype),
                             e.decode_out, e.decode_lse),
                 DecodeBoundsOf(DTypeName(dtype)));
  }
}

// Verify passes in half precision (the default, ChunkPrecision::kHalf): 4bit_nc's and k3v4_nc's
// passes of more than 4 columns (new tokens × GQA heads per KV head) at head_dim 128 and 64, and
// k8v4's at head_dim 128 too, run the decode kernels' half-precision variant, held to
// the prefill kernel's fp16 bounds (the same roundings: query, centroids and P' once to fp16);
// every other case keeps the decode bounds. Every preset, head_dim 64/128/256, GQA groups 1-16,
// every block size, verify_max_group 32, 16, 8 and 4 (passes of up to 32 columns where the half
// kernels run at head_dim 128, 8 at head_dim 256, 16 elsewhere), bf16 I/O.
// Passes of 9-32 columns at head_dim 128 (k8v4's of 5-32) run on the kernel whose warps share the
// output (DecodeOptions::shared_o, the default), and also on the kernels it replaced, to the same
// bounds (k8v4's: the exact kernels, to the decode bounds); at head_dim 64 the 8-warp and 4-warp
// (narrow) kernels.
TEST(CudaAttentionTest, VerifyInHalfPrecision) {
  TQKV_SKIP_WITHOUT_GPU();
  const Step verify{{300, 77, 1000, 150, 0, 65}, {4, 1, 8, 3, 0, 2}};
  double worst_lse = 0, worst_out = 0;  // half-precision passes (out: fp32 I/O)
  int wide_passes = 0;                  // calls with passes of 17-32 columns
  int shared_passes = 0;  // calls on the shared-output kernel (and the others), head_dim 128
  auto check = [&](const char* preset, int d, int group, int bs, DType io, uint32_t seed,
                   RotationKind rotation = RotationKind::kHadamard) {
    const int hk = 2;
    const Quantizer q = Quantizer::Create(preset, d, hk, bs, rotation, seed);
    const AttentionScenario s = BuildAttention(q, verify.lens, verify.q_lens, hk * group, seed);
    // (3bit_nc at head_dim 128: 17-32 columns on the shared-output kernel alone, so the kernels
    // it replaces below take passes of at most 16.)
    const bool wide_half = d == 128 && (std::string_view(preset) == "turboquant_4bit_nc" ||
                                        std::string_view(preset) == "turboquant_k3v4_nc" ||
                                        std::string_view(preset) == "turboquant_3bit_nc");
    const bool half_kernels = wide_half ||
                              (std::string_view(preset) == "turboquant_3bit_nc" && d <= 128) ||
                              (d == 64 && (std::string_view(preset) == "turboquant_4bit_nc" ||
                                           std::string_view(preset) == "turboquant_k3v4_nc"));
    // k8v4 at head_dim 128: passes of 5-32 columns on the shared-output kernel, its only
    // half-precision one (fewer columns, or shared_o off: the exact kernels, up to 16).
    const bool fp8_shared = d == 128 && std::string_view(preset) == "turboquant_k8v4";
    for (int max_group : {32, 16, 8, 4}) {
      Case c{.quantizer = &q, .io = io};
      c.options.verify_precision = ChunkPrecision::kHalf;
      c.options.verify_max_group = max_group;
      const Errors e = RunAndCompare(c, s, s.base.cache);
      // (Head_dim 256: the plan caps a pass at 8 columns on every compressed kind, ba7ed2e.)
      const int max_columns =
          std::min({max_group, wide_half || fp8_shared ? 32 : 16, d == 256 ? 8 : 32});
      const int columns = group * std::min(8, std::max(1, max_columns / group));
      const std::string what =
          fmt::format("{} D={} group={} bs={} {} columns io {}: out {:.2e} lse {:.2e}", preset, d,
                      group, bs, columns, DTypeName(io), e.decode_out, e.decode_lse);
      const bool half = columns > 4 && (half_kernels || fp8_shared);
      EXPECT_EQ(e.verify_columns, columns) << what;
      wide_passes += columns > 16;
      EXPECT_EQ(e.half_verify, half) << what;
      EXPECT_EQ(e.shared_verify, half && ((wide_half && columns > 8) || fp8_shared)) << what;
      EXPECT_EQ(e.bad, 0) << what;
      const double io_out = io == DType::kBF16 ? 0.0039 : 0.0;
      if (half) {
        const HalfBounds b = HalfBoundsOf(false);
        EXPECT_LE(e.decode_lse, b.lse) << what;
        EXPECT_LE(e.decode_out, b.out + io_out) << what;
        worst_lse = std::max(worst_lse, e.decode_lse);
        if (io == DType::kF32) worst_out = std::max(worst_out, e.decode_out);
        // The narrow twin of the 9-16-column kernel, wherever the plan would not take it (17-32
        // columns: the only kernel, narrow either way).
        if (fp8_shared) {  // shared_o off: the exact kernels
          Case own = c;
          own.options.decode.shared_o = false;
          const Errors se = RunAndCompare(own, s, s.base.cache);
          EXPECT_FALSE(se.half_verify) << what;
          EXPECT_EQ(se.bad, 0) << what;
          const DecodeBounds db = DecodeBoundsOf(preset);
          EXPECT_LE(se.decode_lse, db.lse) << what << " (exact kernels)";
          EXPECT_LE(se.decode_out, db.out + io_out) << what << " (exact kernels)";
          ++shared_passes;
        } else if (columns > 8) {
          Case narrow = c;
          narrow.options.decode.narrow = DecodeOptions::Narrow::kAlways;
          narrow.options.decode.shared_o = false;
          const Errors ne = RunAndCompare(narrow, s, s.base.cache);
          EXPECT_TRUE(ne.narrow_half_verify) << what;
          EXPECT_EQ(ne.bad, 0) << what;
          EXPECT_LE(ne.decode_lse, b.lse) << what << " (narrow twin)";
          EXPECT_LE(ne.decode_out, b.out + io_out) << what << " (narrow twin)";
          worst_lse = std::max(worst_lse, ne.decode_lse);
          if (io == DType::kF32) worst_out = std::max(worst_out, ne.decode_out);
          Case own = c;  // the wide kernel whose warps each hold their own output
          own.options.decode.shared_o = false;
          const Errors se = RunAndCompare(own, s, s.base.cache);
          EXPECT_FALSE(se.shared_verify) << what;
          EXPECT_EQ(se.bad, 0) << what;
          EXPECT_LE(se.decode_lse, b.lse) << what << " (own output)";
          EXPECT_LE(se.decode_out, b.out + io_out) << what << " (own output)";
          worst_lse = std::max(worst_lse, se.decode_lse);
          if (io == DType::kF32) worst_out = std::max(worst_out, se.decode_out);
          shared_passes += wide_half;
        }
      } else {
        const DecodeBounds b = DecodeBoundsOf(preset);
        EXPECT_LE(e.decode_lse, b.lse) << what;
        EXPECT_LE(e.decode_out, b.out + io_out) << what;
      }
    }
  };
  // Every preset and head dim (the half kernels where they exist, the exact ones elsewhere) ...
  const int groups[] = {1, 2, 3, 4, 5, 8};
  int k = 0;
  for (const char* preset : kPresetNames) {
    for (int d : {64, 128, 256}) {
      const int group = groups[k % 6], bs = 16 << (k % 4);
      ++k;
      check(preset, d, group, bs, k % 3 == 0 ? DType::kBF16 : DType::kF32, 950 + k);
    }
  }
  // ... and the half kernels at more GQA groups, with bf16 I/O too.
  for (const char* preset : {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"}) {
    for (int group : {1, 3, 4, 8, 16}) {
      for (DType io : {DType::kF32, DType::kBF16}) {
        // A dense Πᵀ too: the query prep's rows instead of the kernels' own rotation.
        check(preset, 128, group, 16 << (k % 4), io, 990 + k,
              k % 3 == 0 ? RotationKind::kHaar : RotationKind::kHadamard);
        ++k;
      }
    }
  }
  // ... and k8v4's shared-output kernel at head_dim 128 (5-8, 9-16 and 17-32 columns).
  for (int group : {2, 3, 4, 8, 16}) {
    for (DType io : {DType::kF32, DType::kBF16}) {
      check("turboquant_k8v4", 128, group, 16 << (k % 4), io, 1030 + k);
      ++k;
    }
  }
  // ... and at head_dim 64 (SmolLM2's: GQA 3, 15 columns with 4 drafts).
  for (const char* preset : {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"}) {
    for (int group : {3, 5, 16}) {
      check(preset, 64, group, 16 << (k % 4), k % 2 ? DType::kBF16 : DType::kF32, 1050 + k);
      ++k;
    }
  }
  EXPECT_GE(wide_passes, 16);
  EXPECT_GE(shared_passes, 16);
  // More new tokens than 8 still run as verify rows where one pass holds them all (max_q_len ·
  // group up to 32 columns on the half kernels, 16 elsewhere), or up to 16 in at most 2 passes
  // (the plan's choice at head_dim 128, but for k8v4); otherwise the prefill kernel.
  for (const char* preset :
       {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "turboquant_k8v4"}) {
    for (const auto& [q_lens, group] : {std::pair{std::vector<int32_t>{32, 1, 9, 20, 0, 31}, 1},
                                        std::pair{std::vector<int32_t>{16, 1, 12, 9, 0, 16}, 2},
                                        std::pair{std::vector<int32_t>{12, 1, 2, 9, 0, 10}, 4},
                                        std::pair{std::vector<int32_t>{20, 1, 2, 17, 0, 9}, 4}}) {
      const int hk = 2, d = 128, max_q = *std::max_element(q_lens.begin(), q_lens.end());
      const Quantizer q = Quantizer::Create(preset, d, hk, 16 << (k % 4));
      const AttentionScenario s = BuildAttention(q, {300, 77, 1000, 150, 0, 65}, q_lens,
                                                 hk * group, 1100 + k++);
      Case c{.quantizer = &q};
      c.options.verify_precision = ChunkPrecision::kHalf;
      c.options.chunk_precision = ChunkPrecision::kHalf;
      const Errors e = RunAndCompare(c, s, s.base.cache);
      // A pass holds up to 32 columns, in half precision (every verify case here has 16 or 32
      // columns per pass: k8v4's on the shared-output kernel too); 12 new tokens at GQA 4 take 2
      // passes of 8 (k8v4: the prefill kernel).
      const bool verify = max_q * group <= 32 || (max_q <= 16 && group == 4 &&
                                                  std::string_view(preset) != "turboquant_k8v4");
      const int columns = std::min(max_q, 32 / group) * group;
      const std::string what = fmt::format("{} group={} max_q_len={}: out {:.2e} lse {:.2e}",
                                           preset, group, max_q, e.out, e.lse);
      EXPECT_EQ(e.verify_columns, verify ? columns : 0) << what;
      if (!verify) EXPECT_TRUE(e.prefill) << what;  // (a verify plan keeps one for windows)
      EXPECT_EQ(e.half_verify, verify) << what;
      EXPECT_EQ(e.bad, 0) << what;
      const HalfBounds b = HalfBoundsOf(false);
      if (verify) {
        EXPECT_LE(e.decode_lse, b.lse) << what;
        EXPECT_LE(e.decode_out, b.out) << what;
      } else {
        EXPECT_LE(e.lse, b.lse) << what;
        EXPECT_LE(e.out, b.out) << what;
      }
    }
  }
  std::printf("half-precision verify, worst: out %.2e lse %.2e\n", worst_out, worst_lse);
}

// The shared-output kernel over long contexts: many whole steps of 128 tokens, one split per
// sequence or several (64 tokens: every step masked), and the CTA's shared maximum moving
// mid-split. Some tokens' key norms are raised 6x (k8v4, which has none: their FP8 keys 4x), so
// that later steps' scores pass the maximum by more than 2^6 (every warp rescales its
// accumulators to the new maximum), and some value scales and zero points are raised past
// kMaxLazyValueScale (those steps rescale to the exact maximum, so that P' stays within fp16).
// Against the reference at the half kernels' bounds.
TEST(CudaAttentionTest, SharedOutputVerifyOverLongContexts) {
  TQKV_SKIP_WITHOUT_GPU();
  const Step step{{5000, 2600, 9000, 130}, {8, 5, 8, 3}};
  int k = 0;
  for (const char* preset :
       {"turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "turboquant_k8v4"}) {
    const bool fp8 = std::string_view(preset) == "turboquant_k8v4";
    for (int group : {1, 2, 4}) {
      if (group == 1 && !fp8) continue;  // (8 columns: on the shared-output kernel for k8v4 alone)
      const int hk = 2, d = 128, bs = 16 << (k % 4);
      const Quantizer q = Quantizer::Create(preset, d, hk, bs);
      const AttentionScenario s = BuildAttention(q, step.lens, step.q_lens, hk * group, 1200 + k);
      ++k;
      for (bool jumps : {false, true}) {
        std::vector<uint8_t> cache = s.base.cache;
        if (jumps) {
          const BlockFormat& f = q.format();
          std::mt19937_64 rng(k);
          std::uniform_real_distribution<float> scale(2000.0f, 30000.0f),
              zero(-60000.0f, -50000.0f);
          for (size_t b = 0; b < s.base.seq_lens.size(); ++b) {
            for (int t = 0; t < s.base.seq_lens[b]; ++t) {
              const int32_t block = s.base.block_tables[b * s.base.max_blocks + t / bs];
              uint8_t* base = cache.data() + int64_t{block} * f.block_bytes;
              for (int h = 0; h < hk; ++h) {
                if (t % 577 == 300 && fp8) {
                  // 4x each key element: E4M3's exponent two higher (zero, subnormals and the
                  // largest exponents left as they are).
                  uint8_t* key = base + f.KeyCodesOffset(t % bs, h);
                  for (int i = 0; i < d; ++i) {
                    const int e = (key[i] >> 3) & 15;
                    if (e >= 1 && e <= 12) key[i] = static_cast<uint8_t>(key[i] + 16);
                  }
                } else if (t % 577 == 300) {
                  uint16_t norm;
                  std::memcpy(&norm, base + f.MetaOffset(MetaField::kKeyNorm, t % bs, h), 2);
                  norm = FloatToHalfBits(6.0f * HalfBitsToFloat(norm));
                  std::memcpy(base + f.MetaOffset(MetaField::kKeyNorm, t % bs, h), &norm, 2);
                }
                if (t % 1000 == 700) {
                  const uint16_t sc = FloatToHalfBits(scale(rng)), ze = FloatToHalfBits(zero(rng));
                  std::memcpy(base + f.MetaOffset(MetaField::kValueScale, t % bs, h), &sc, 2);
                  std::memcpy(base + f.MetaOffset(MetaField::kValueZero, t % bs, h), &ze, 2);
                }
              }
            }
          }
        }
        for (int tps : {0, 1024, 64}) {
          Case c{.quantizer = &q};
          c.options.verify_precision = ChunkPrecision::kHalf;
          c.options.decode.shared_o = true;
          c.options.decode.tokens_per_split = tps;
          int max_splits = 0;
          const Errors e = RunAndCompare(c, s, cache, &max_splits);
          const std::string what =
              fmt::format("{} group={} bs={} jumps={} tps={} ({} splits): out {:.2e} lse {:.2e}",
                          preset, group, bs, jumps, tps, max_splits, e.decode_out, e.decode_lse);
          std::printf("%s\n", what.c_str());
          // The kernel it replaced, on the same data: the value scales past 2,000 take both past
          // the half kernels' bound (H200: 4bit_nc at 32 columns 6.97e-3 and 7.03e-3).
          Case own = c;
          own.options.decode.shared_o = false;
          const Errors eo = RunAndCompare(own, s, cache);
          std::printf("  own-output kernel: out %.2e lse %.2e\n", eo.decode_out, eo.decode_lse);
          EXPECT_TRUE(e.shared_verify) << what;
          EXPECT_FALSE(eo.shared_verify) << what;
          EXPECT_EQ(e.verify_columns, 8 * group) << what;
          EXPECT_EQ(e.bad, 0) << what;
          const HalfBounds b = HalfBoundsOf(false);
          // (k8v4's kernel without shared_o is the exact one, 4.5-4.9e-5 with the jumps: its
          // half-precision pass is held to 1.25x the bound instead; H200 6.79-6.81e-3.)
          const double twin_out = fp8 ? b.out : eo.decode_out;
          EXPECT_LE(e.decode_lse, std::max<double>(b.lse, 1.25 * eo.decode_lse)) << what;
          EXPECT_LE(e.decode_out, std::max<double>(b.out, 1.25 * twin_out)) << what;
          if (!jumps) {
            EXPECT_LE(e.decode_lse, b.lse) << what;
            EXPECT_LE(e.decode_out, b.out) << what;
          }
        }
      }
    }
  }
}

// CheckArrays (a debugging aid: Run never reads the device arrays on the host) names the entry
// that breaks Run's contract, and accepts arrays that keep it.
TEST(CudaAttentionTest, CheckArraysNamesTheBrokenEntry) {
  TQKV_SKIP_WITHOUT_GPU();
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 8, 16);
  const CudaAttention attn(q);
  const AttentionScenario s = BuildAttention(q, {40, 33, 20}, {1, 4, 3}, 32, 5);
  const int rows = 54 * 32;  // the most rows below (the mixed call's)
  DeviceBuffer<float> query(rows * 128), output(rows * 128), lse(rows);
  DeviceBuffer<uint8_t> cache(static_cast<int64_t>(s.base.cache.size()));
  cache.CopyFromHost(s.base.cache);
  DeviceBuffer<int32_t> tables(static_cast<int64_t>(s.base.block_tables.size())), lens(3), loc(4);
  AttentionArgs a;
  a.query = query.data();
  a.num_seqs = 3;
  a.num_tokens = s.num_tokens;
  a.num_q_heads = 32;
  a.query_start_loc = loc.data();
  a.seq_lens = lens.data();
  a.block_tables = tables.data();
  a.max_blocks_per_seq = s.base.max_blocks;
  a.cache = {cache.data(), s.base.num_blocks, q.layout()};
  a.output = output.data();
  a.lse = lse.data();
  auto check = [&](const AttentionPlan& plan, std::vector<int32_t> t, std::vector<int32_t> l,
                   std::vector<int32_t> starts) {
    tables.CopyFromHost(t);
    lens.CopyFromHost(l);
    loc.CopyFromHost(starts);
    attn.CheckArrays(plan, a, nullptr);
  };
  const AttentionPlan plan = attn.Plan(3, s.num_tokens, 32, s.base.max_blocks, 4);
  EXPECT_NO_THROW(check(plan, s.base.block_tables, s.base.seq_lens, s.query_start_loc));
  std::vector<int32_t> bad_tables = s.base.block_tables;
  bad_tables[s.base.max_blocks] = static_cast<int32_t>(s.base.num_blocks);  // sequence 1, block 0
  EXPECT_THAT(
      [&] { check(plan, bad_tables, s.base.seq_lens, s.query_start_loc); },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr(fmt::format(
          "CudaAttention::CheckArrays: invalid block_tables[1, 0] = {}", s.base.num_blocks))));
  std::vector<int32_t> long_lens = s.base.seq_lens;
  long_lens[2] = s.base.max_blocks * 16 + 1;
  EXPECT_THAT([&] { check(plan, s.base.block_tables, long_lens, s.query_start_loc); },
              ::testing::ThrowsMessage<Error>(
                  ::testing::HasSubstr(fmt::format("invalid seq_lens[2] = {}", long_lens[2]))));
  // Sequence 1 has 4 new tokens: past a plan for at most 3.
  const AttentionPlan three = attn.Plan(3, s.num_tokens, 32, s.base.max_blocks, 3);
  EXPECT_THAT([&] { check(three, s.base.block_tables, s.base.seq_lens, s.query_start_loc); },
              ::testing::ThrowsMessage<Error>(
                  ::testing::AllOf(::testing::HasSubstr("invalid query_start_loc[2] = 5"),
                                   ::testing::HasSubstr("at most 4"))));
  // A leading decode sequence (a mixed call on the prefill kernel) with two new tokens.
  const AttentionScenario m = BuildAttention(q, {40, 33, 20}, {1, 33, 20}, 32, 6);
  a.num_tokens = m.num_tokens;
  AttentionOptions lead;
  lead.leading_decode_seqs = 1;
  const AttentionPlan led = attn.Plan(3, m.num_tokens, 32, m.base.max_blocks, 33, lead);
  ASSERT_EQ(led.leading_decodes, 1);
  EXPECT_NO_THROW(check(led, m.base.block_tables, m.base.seq_lens, m.query_start_loc));
  EXPECT_THAT(
      [&] {
        check(led, m.base.block_tables, m.base.seq_lens, {0, 2, 34, 54});
      },
      ::testing::ThrowsMessage<Error>(
          ::testing::AllOf(::testing::HasSubstr("invalid query_start_loc[1] = 2"),
                           ::testing::HasSubstr("a leading decode sequence"))));
  // A leading verify sequence (up to 2 new tokens) with 3, and with none.
  const AttentionScenario v = BuildAttention(q, {40, 33, 20}, {2, 31, 20}, 32, 7);
  a.num_tokens = v.num_tokens;
  lead.leading_max_q_len = 2;
  const AttentionPlan lv = attn.Plan(3, v.num_tokens, 32, v.base.max_blocks, 33, lead);
  ASSERT_EQ(lv.leading_decodes, 1);
  ASSERT_EQ(lv.leading_max_q_len, 2);
  EXPECT_NO_THROW(check(lv, v.base.block_tables, v.base.seq_lens, v.query_start_loc));
  for (const auto& [starts, bad] : {std::pair{std::vector<int32_t>{0, 3, 34, 53}, 3},
                                    std::pair{std::vector<int32_t>{0, 0, 33, 53}, 0}}) {
    EXPECT_THAT([&] { check(lv, v.base.block_tables, v.base.seq_lens, starts); },
                ::testing::ThrowsMessage<Error>(::testing::AllOf(
                    ::testing::HasSubstr(fmt::format("invalid query_start_loc[1] = {}", bad)),
                    ::testing::HasSubstr("1 to 2"), ::testing::HasSubstr("a leading sequence"))));
  }
}

TEST(CudaAttentionTest, PlanAndRunRejectBadArguments) {
  TQKV_SKIP_WITHOUT_GPU();
  const Quantizer q = Quantizer::Create("turboquant_4bit_nc", 128, 8, 16);
  const CudaAttention attn(q);
  Bf16BlockFormat moved = MakeBf16BlockFormat(128, 8, 16);  // values where the keys are
  moved.value_offset = 0;
  EXPECT_THAT([&] { CudaAttention plain(moved); },
              ::testing::ThrowsMessage<Error>(
                  ::testing::HasSubstr("CudaAttention: invalid format.value_offset = 0")));
  EXPECT_THAT([&] { attn.Plan(2, 5, 30, 4, 3); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("num_q_heads = 30")));
  EXPECT_THAT([&] { attn.Plan(2, 5, 32, 4, 6); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("max_q_len = 6")));
  EXPECT_THAT([&] { attn.Plan(2, 5, 32, 4, 3, {.tokens_per_split = 100}); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("tokens_per_split = 100")));
  AttentionOptions wide;
  wide.verify_max_group = 33;
  EXPECT_THAT([&] { attn.Plan(2, 5, 32, 4, 3, wide); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("verify_max_group = 33")));
  EXPECT_THAT([&] { attn.MaxLeadingQLen(30); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("num_q_heads = 30")));
  EXPECT_THAT([&] { attn.MaxLeadingQLen(32, wide); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("verify_max_group = 33")));
  for (int lead : {-1, 3}) {
    AttentionOptions o;
    o.leading_decode_seqs = lead;
    EXPECT_THAT([&] { attn.Plan(2, 5, 32, 4, 3, o); },
                ::testing::ThrowsMessage<Error>(
                    ::testing::HasSubstr(fmt::format("leading_decode_seqs = {}", lead))));
  }
  AttentionOptions all_lead;  // every sequence one token: only where num_tokens = num_seqs
  all_lead.leading_decode_seqs = 2;
  EXPECT_THAT([&] { attn.Plan(2, 5, 32, 4, 3, all_lead); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("leading_decode_seqs = 2")));
  EXPECT_TRUE(attn.Plan(2, 2, 32, 4, 2, all_lead).decode);
  // More tokens than num_seqs · max_q_len, leading one-token sequences past the tokens, and
  // positions past int32 are refused at Plan.
  EXPECT_THAT([&] { attn.Plan(10, 100, 32, 4, 2); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("num_tokens = 100")));
  AttentionOptions past_tokens;
  past_tokens.leading_decode_seqs = 100;
  EXPECT_THAT([&] { attn.Plan(101, 2, 32, 4, 2, past_tokens); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("leading_decode_seqs = 100")));
  EXPECT_THAT(
      [&] { attn.Plan(2, 2, 32, (1 << 27), 1); },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("max_blocks_per_seq = 134217728")));
  // Contexts and splits up to kMaxContextTokens (2^29), so that a split's end stays within int32:
  // a context just under 2^31 had made one split of 2^31 tokens (tokens_per_split negative), and
  // a split of 2^31 − 64 tokens after a window's start wrapped to a negative end.
  const int most = static_cast<int>(CudaAttention::kMaxContextTokens / 16);
  EXPECT_EQ(attn.Plan(2, 2, 32, most, 1).max_blocks_per_seq, most);
  EXPECT_THAT([&] { attn.Plan(2, 2, 32, most + 1, 1); },
              ::testing::ThrowsMessage<Error>(
                  ::testing::HasSubstr(fmt::format("max_blocks_per_seq = {}", most + 1))));
  EXPECT_THAT(
      [&] { attn.Plan(1, 8192, 32, 134217727, 8192); },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("max_blocks_per_seq = 134217727")));
  const AttentionPlan longest = attn.Plan(1, 8192, 32, most, 8192);
  EXPECT_GT(longest.tokens_per_split, 0);
  EXPECT_LE(int64_t{longest.tokens_per_split} * longest.max_splits,
            CudaAttention::kMaxContextTokens + 64 * longest.max_splits);
  EXPECT_EQ(attn.Plan(2, 5, 32, 4, 3, {.tokens_per_split = 1 << 29}).tokens_per_split, 1 << 29);
  EXPECT_THAT(
      [&] { attn.Plan(2, 5, 32, 4, 3, {.tokens_per_split = (1 << 29) + 64}); },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("tokens_per_split = 536870976")));
  // Past the decode kernels' longest context, one-token and verify calls run on the chunk kernel.
  const int past = static_cast<int>(CudaDecoder::kMaxContextTokens / 16) + 1;
  EXPECT_TRUE(attn.Plan(2, 2, 32, past - 1, 1).decode);
  EXPECT_FALSE(attn.Plan(2, 2, 32, past, 1).decode);
  EXPECT_TRUE(attn.Plan(2, 8, 32, past - 1, 4).verify_rows);
  EXPECT_FALSE(attn.Plan(2, 8, 32, past, 4).verify_rows);
  // The decode kernels' options are checked at Plan under their names, whatever path the plan
  // takes (a prefill-only shape had accepted them).
  for (const auto& [max_q_len, tokens] : {std::pair{3, 5}, std::pair{64, 64}}) {
    AttentionOptions decode_split;
    decode_split.decode.tokens_per_split = 100;
    EXPECT_THAT([&] { attn.Plan(2, tokens, 32, 4, max_q_len, decode_split); },
                ::testing::ThrowsMessage<Error>(
                    ::testing::HasSubstr("invalid options.decode.tokens_per_split = 100")));
    AttentionOptions narrow;
    narrow.decode.narrow = static_cast<DecodeOptions::Narrow>(7);
    EXPECT_THAT(
        [&] { attn.Plan(2, tokens, 32, 4, max_q_len, narrow); },
        ::testing::ThrowsMessage<Error>(::testing::HasSubstr("invalid options.decode.narrow = 7")));
  }
  // Shapes no arrays can have: more new tokens than the context holds, and more tokens than the
  // leading one-token sequences and max_q_len allow.
  EXPECT_THAT([&] { attn.Plan(1, 70, 32, 4, 70); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("invalid max_q_len = 70")));
  AttentionOptions one_lead;
  one_lead.leading_decode_seqs = 1;
  EXPECT_NO_THROW(attn.Plan(3, 7, 32, 4, 3, one_lead));
  EXPECT_THAT([&] { attn.Plan(3, 8, 32, 4, 3, one_lead); },
              ::testing::ThrowsMessage<Error>(::testing::AllOf(
                  ::testing::HasSubstr("invalid num_tokens = 8"), ::testing::HasSubstr("= 7"))));
  // Leading verify rows: at least 1 new token each, and at most leading_max_q_len.
  AttentionOptions lead_two = one_lead;
  lead_two.leading_max_q_len = 2;
  EXPECT_NO_THROW(attn.Plan(3, 8, 32, 4, 3, lead_two));
  EXPECT_THAT([&] { attn.Plan(3, 9, 32, 4, 3, lead_two); },
              ::testing::ThrowsMessage<Error>(::testing::AllOf(
                  ::testing::HasSubstr("invalid num_tokens = 9"), ::testing::HasSubstr("= 8"))));
  lead_two.leading_max_q_len = 0;
  EXPECT_THAT([&] { attn.Plan(3, 7, 32, 4, 3, lead_two); },
              ::testing::ThrowsMessage<Error>(
                  ::testing::HasSubstr("invalid options.leading_max_q_len = 0")));
  // Every sequence leading with up to 2 new tokens: planned as verify rows.
  AttentionOptions all_two;
  all_two.leading_decode_seqs = 3;
  all_two.leading_max_q_len = 2;
  const AttentionPlan all_verify = attn.Plan(3, 5, 32, 4, 2, all_two);
  EXPECT_TRUE(all_verify.verify_rows);
  EXPECT_EQ(all_verify.leading_decodes, 0);
  AttentionOptions precision;
  precision.verify_precision = static_cast<ChunkPrecision>(7);
  EXPECT_THAT([&] { attn.Plan(2, 5, 32, 4, 3, precision); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("verify_precision = 7")));
  const AttentionPlan plan = attn.Plan(2, 5, 32, 4, 3);
  AttentionArgs a;
  a.num_seqs = 2;
  a.num_tokens = 4;  // not the plan's 5
  a.num_q_heads = 32;
  // A cache reference without the layout of this attention's caches (here: none) is refused first.
  EXPECT_THAT([&] { attn.Run(plan, a, nullptr); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
                  "invalid cache.layout = (no format, head_dim 0, 0 KV heads, block 0); allowed: "
                  "the layout this call was made for (turboquant_4bit_nc, head_dim 128, 8 KV "
                  "heads, block 16)")));
  a.cache = {nullptr, 0, Quantizer::Create("turboquant_k3v4_nc", 128, 8, 16).layout()};
  EXPECT_THAT([&] { attn.Run(plan, a, nullptr); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
                  "invalid cache.layout = (turboquant_k3v4_nc, head_dim 128, 8 KV heads")));
  EXPECT_EQ(attn.layout(), q.layout());
  a.cache = {nullptr, 0, attn.layout()};
  EXPECT_THAT([&] { attn.Run(plan, a, nullptr); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("null")));

  // With every buffer in place: a plan whose fields were changed after Plan (its kernels are
  // sized by them: a decode plan for more sequences read past the call's arrays), and outputs
  // over inputs, are refused before anything is launched.
  const int64_t rows = 5 * 32;
  DeviceBuffer<float> query(rows * 128), output(rows * 128), lse(rows);
  DeviceBuffer<uint8_t> cache(8 * q.format().block_bytes),
      ws(std::max<int64_t>(plan.workspace_bytes, 1));
  DeviceBuffer<int32_t> tables(2 * 4), lens(2), loc(3);
  a.num_tokens = 5;
  a.max_blocks_per_seq = 4;
  a.query = query.data();
  a.query_dtype = DType::kF32;
  a.output = output.data();
  a.output_dtype = DType::kF32;
  a.lse = lse.data();
  a.cache = {cache.data(), 8, attn.layout()};
  a.block_tables = tables.data();
  a.seq_lens = lens.data();
  a.query_start_loc = loc.data();
  a.workspace = ws.data();
  a.workspace_bytes = ws.size_bytes();
  ASSERT_TRUE(plan.verify_rows);
  for (const auto& edit : std::initializer_list<void (*)(AttentionPlan&)>{
           [](AttentionPlan& p) { p.leading_decodes = p.num_seqs + 1; },
           [](AttentionPlan& p) { p.decode_plan.num_seqs += 1; },
           [](AttentionPlan& p) { p.row_warps = 3; },
           [](AttentionPlan& p) { p.tokens_per_split = 0; },
           [](AttentionPlan& p) { p.verify_passes = 0; }, [](AttentionPlan& p) { p.decode = true; },
           [](AttentionPlan& p) { p.prefill_tiles = true; },
           [](AttentionPlan& p) { p.prefill_rotates = true; },
           [](AttentionPlan& p) { p.row_tiles = 1 << 30; }}) {
    AttentionPlan changed = plan;
    edit(changed);
    EXPECT_THAT([&] { attn.Run(changed, a, nullptr); },
                ::testing::ThrowsMessage<Error>(
                    ::testing::HasSubstr("the plan was not made by CudaAttention::Plan")));
  }
  // The decode sub-plan's kernel choices, checked before the call queues any kernel (a query
  // prep or dequantization pass ahead of the verify or leading decode grid).
  for (const auto& edit : std::initializer_list<void (*)(AttentionPlan&)>{
           [](AttentionPlan& p) { p.decode_plan.narrow = !p.decode_plan.narrow; },
           [](AttentionPlan& p) { p.decode_plan.variant.half = !p.decode_plan.variant.half; },
           [](AttentionPlan& p) { p.decode_plan.max_splits = 0; }}) {
    AttentionPlan changed = plan;
    edit(changed);
    EXPECT_THAT([&] { attn.Run(changed, a, nullptr); },
                ::testing::ThrowsMessage<Error>(
                    ::testing::HasSubstr("CudaAttention::Run (decode_plan): ")));
  }
  // A verify plan told of a window (its passes' splits sized for it) takes windows from 1 to
  // it only, refused before the call's query prep or passes are queued; so does a mixed call's
  // plan told of one for its leading one-token rows (before its chunk's query prep).
  AttentionOptions told;
  told.decode.sliding_window = 50;
  const AttentionPlan windowed = attn.Plan(2, 5, 32, 4, 3, told);
  ASSERT_TRUE(windowed.verify_rows);
  // (The window does not change the passes' kernel.)
  EXPECT_EQ(windowed.decode_plan.variant, attn.Plan(2, 5, 32, 4, 3).decode_plan.variant);
  EXPECT_EQ(windowed.decode_plan.sliding_window, 50);
  told.leading_decode_seqs = 1;
  told.verify_max_q_len = 0;  // (else the verify passes take the whole call)
  const AttentionPlan mixed = attn.Plan(2, 4, 32, 4, 3, told);  // (1 + 3 tokens)
  ASSERT_EQ(mixed.leading_decodes, 1);
  EXPECT_EQ(mixed.decode_plan.sliding_window, 50);
  for (const AttentionPlan* p : {&windowed, &mixed}) {
    DeviceBuffer<uint8_t> windowed_ws(std::max<int64_t>(p->workspace_bytes, 1));
    for (int32_t w : {0, 51}) {
      AttentionArgs wa = a;
      wa.num_tokens = p->num_tokens;
      wa.workspace = windowed_ws.data();
      wa.workspace_bytes = windowed_ws.size_bytes();
      wa.sliding_window = w;
      EXPECT_THAT([&] { attn.Run(*p, wa, nullptr); },
                  ::testing::ThrowsMessage<Error>(
                      ::testing::AllOf(::testing::HasSubstr(fmt::format("sliding_window = {}", w)),
                                       ::testing::HasSubstr("1 to 50"))));
    }
  }
  AttentionArgs over = a;
  over.lse = output.data() + 5;
  EXPECT_THAT([&] { attn.Run(plan, over, nullptr); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("overlap")));
  over = a;
  over.workspace = output.data();
  over.workspace_bytes = 256;
  EXPECT_THAT([&] { attn.Run(plan, over, nullptr); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("overlap")));
  // An output over the cache would change the cache.
  over = a;
  over.output = cache.data() + 8 * q.format().block_bytes - 256;
  EXPECT_THAT([&] { attn.Run(plan, over, nullptr); },
              ::testing::ThrowsMessage<Error>(::testing::AllOf(::testing::HasSubstr("output ("),
                                                               ::testing::HasSubstr("cache ("),
                                                               ::testing::HasSubstr("overlap"))));
  // Rows not aligned to their elements (here fp32: 4 bytes; lse too) are refused; a misaligned
  // access would have faulted the context.
  DeviceBuffer<uint8_t> roomy(rows * 128 * 4 + 256);  // room past the rows for every shift below
  for (const char* name : {"query", "output", "lse"}) {
    over = a;
    uint8_t* const shifted = roomy.data() + 2;
    if (std::string_view(name) == "query") over.query = shifted;
    if (std::string_view(name) == "output") over.output = shifted;
    if (std::string_view(name) == "lse") over.lse = reinterpret_cast<float*>(shifted);
    EXPECT_THAT([&] { attn.Run(plan, over, nullptr); },
                ::testing::ThrowsMessage<Error>(
                    ::testing::AllOf(::testing::HasSubstr(fmt::format("invalid {} = ", name)),
                                     ::testing::HasSubstr("a 4-byte aligned device pointer"))))
        << name;
  }
  // A scale whose fp32 score scale (scale · log2(e)) overflows: the kernels' softmax would be NaN.
  over = a;
  over.scale = 3e38f;
  EXPECT_THAT([&] { attn.Run(plan, over, nullptr); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("invalid scale = ")));
}

#else

TEST(CudaTest, NeedsCuda) { GTEST_SKIP() << "this build has no CUDA support"; }

#endif  // TQKV_HAVE_CUDA

}  // namespace
}  // namespace tqkv
