#include "tests/attention_scenario.h"

#include <algorithm>
#include <cstring>

#include "attention/attention_cpu.h"
#include "quant/numerics.h"
#include "tests/synthetic_kv.h"

namespace tqkv::testing {

AttentionScenario BuildAttention(const Quantizer& q, std::vector<int32_t> seq_lens,
                                 const std::vector<int32_t>& q_lens, int num_q_heads,
                                 uint64_t seed) {
  AttentionScenario s;
  s.base = Build(q, seq_lens, num_q_heads, seed);
  s.num_q_heads = num_q_heads;
  s.query_start_loc.push_back(0);
  for (size_t b = 0; b < seq_lens.size(); ++b) {
    s.query_start_loc.push_back(s.query_start_loc.back() + q_lens.at(b));
  }
  s.num_tokens = s.query_start_loc.back();
  SyntheticKvOptions o;
  o.num_kv_heads = q.format().num_kv_heads;
  o.num_q_heads = num_q_heads;
  o.head_dim = q.format().head_dim;
  o.seed = seed + 17;
  SyntheticKv gen(o);
  for (size_t b = 0; b < seq_lens.size(); ++b) {
    for (int i = 0; i < q_lens[b]; ++i) gen.GenerateQuery(seq_lens[b] - q_lens[b] + i, s.queries);
  }
  return s;
}

std::vector<uint8_t> StorePlain(AttentionScenario& s, const Bf16BlockFormat& f) {
  const bool fp16 = f.dtype == DType::kF16;
  auto bits = [&](float x) { return fp16 ? FloatToHalfBits(x) : FloatToBFloat16Bits(x); };
  auto value = [&](uint16_t b) { return fp16 ? HalfBitsToFloat(b) : BFloat16BitsToFloat(b); };
  Scenario& base = s.base;
  std::vector<uint8_t> cache(base.num_blocks * f.block_bytes, 0xFF);
  const int d = f.head_dim, hk = f.num_kv_heads, bs = f.block_size;
  for (size_t b = 0; b < base.seq_lens.size(); ++b) {
    for (int t = 0; t < base.seq_lens[b]; ++t) {
      uint8_t* block =
          cache.data() + int64_t{base.block_tables[b * base.max_blocks + t / bs]} * f.block_bytes;
      for (int h = 0; h < hk; ++h) {
        for (int i = 0; i < d; ++i) {
          float& k = base.keys[b][(int64_t(t) * hk + h) * d + i];
          float& v = base.values[b][(int64_t(t) * hk + h) * d + i];
          const uint16_t kb = bits(k), vb = bits(v);
          k = value(kb);
          v = value(vb);
          std::memcpy(block + f.KeyOffset(t % bs, h) + 2 * i, &kb, 2);
          std::memcpy(block + f.ValueOffset(t % bs, h) + 2 * i, &vb, 2);
        }
      }
    }
  }
  return cache;
}

AttentionArgs HostArgs(const AttentionScenario& s, const std::vector<uint8_t>& cache,
                       const CacheLayout& layout) {
  AttentionArgs a;
  a.query = s.queries.data();
  a.query_dtype = DType::kF32;
  a.num_seqs = static_cast<int>(s.base.seq_lens.size());
  a.num_tokens = s.num_tokens;
  a.num_q_heads = s.num_q_heads;
  a.query_start_loc = s.query_start_loc.data();
  a.seq_lens = s.base.seq_lens.data();
  a.block_tables = s.base.block_tables.data();
  a.max_blocks_per_seq = s.base.max_blocks;
  a.cache = {cache.data(), s.base.num_blocks, layout};
  return a;
}

void ReferenceAttention(const Quantizer* q, const Bf16BlockFormat* plain,
                        const AttentionScenario& s, const std::vector<uint8_t>& cache,
                        int32_t sliding_window, std::vector<float>& out, std::vector<float>& lse) {
  const int d = q != nullptr ? q->format().head_dim : plain->head_dim;
  const int hq = s.num_q_heads;
  out.assign(static_cast<size_t>(s.num_tokens) * hq * d, 0.0f);
  lse.assign(static_cast<size_t>(s.num_tokens) * hq, 0.0f);
  const AttentionArgs all = HostArgs(s, cache, q != nullptr ? q->layout() : plain->layout());
  // Pieces of at most kPieceRows new tokens: a row sees the positions up to its own only, so new
  // tokens i0 .. i1 − 1 of a sequence of q_len are the same rows of that sequence cut after new
  // token i1 − 1, with i1 − i0 new tokens. The pieces run in parallel (a long chunk would keep one
  // core busy for all of its rows).
  constexpr int32_t kPieceRows = 32;
  struct Piece {
    int b;
    int32_t i0, i1;
  };
  std::vector<Piece> pieces;
  for (int b = 0; b < all.num_seqs; ++b) {
    const int32_t q_len = s.query_start_loc[b + 1] - s.query_start_loc[b];
    for (int32_t i0 = 0; i0 < q_len; i0 += kPieceRows) {
      pieces.push_back({b, i0, std::min(q_len, i0 + kPieceRows)});
    }
  }
  ParallelFor(static_cast<int>(pieces.size()), [&](int k) {
    const Piece& piece = pieces[k];
    const int32_t q_len = s.query_start_loc[piece.b + 1] - s.query_start_loc[piece.b];
    const int32_t begin = s.query_start_loc[piece.b] + piece.i0;
    const int32_t loc[2] = {0, piece.i1 - piece.i0};
    const int32_t len = all.seq_lens[piece.b] - (q_len - piece.i1);
    AttentionArgs one = all;
    one.num_seqs = 1;
    one.num_tokens = loc[1];
    one.query_start_loc = loc;
    one.query = s.queries.data() + int64_t{begin} * hq * d;
    one.block_tables = all.block_tables + int64_t{piece.b} * all.max_blocks_per_seq;
    one.seq_lens = &len;
    one.sliding_window = sliding_window;
    one.output = out.data() + int64_t{begin} * hq * d;
    one.lse = lse.data() + int64_t{begin} * hq;
    if (q != nullptr) {
      AttentionCpu(*q, one);
    } else {
      AttentionCpu(*plain, one);
    }
  });
}

}  // namespace tqkv::testing
