#include "attention/attention.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "quant/block_format.h"
#include "runtime/dtype.h"
#include "runtime/error.h"

namespace tqkv {
namespace {

bool FloatType(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

}  // namespace

void ValidateAttentionShapes(std::string_view where, const CacheLayout& layout,
                             const AttentionArgs& a) {
  CheckCacheLayout(where, layout, a.cache.layout);
  if (a.num_seqs < 0) throw InvalidArgument(where, "num_seqs", a.num_seqs, ">= 0");
  if (a.num_tokens < 0) throw InvalidArgument(where, "num_tokens", a.num_tokens, ">= 0");
  if (a.num_q_heads < 1 || a.num_q_heads % layout.num_kv_heads != 0) {
    throw InvalidArgument(
        where, "num_q_heads", a.num_q_heads,
        fmt::format("a positive multiple of num_kv_heads = {}", layout.num_kv_heads));
  }
  if (a.max_blocks_per_seq < 0) {
    throw InvalidArgument(where, "max_blocks_per_seq", a.max_blocks_per_seq, ">= 0");
  }
  if (a.cache.num_blocks < 0 || a.cache.num_blocks > kMaxCacheBlocks) {
    throw InvalidArgument(where, "cache.num_blocks", a.cache.num_blocks,
                          fmt::format("0 to {} (32-bit block ids)", kMaxCacheBlocks));
  }
  if (a.scale && !(std::isfinite(*a.scale) && *a.scale > 0.0f)) {
    throw InvalidArgument(where, "scale", *a.scale, "finite and > 0");
  }
  if (a.sliding_window < 0) {
    throw InvalidArgument(where, "sliding_window", a.sliding_window, ">= 0 (0: none)");
  }
  if (!FloatType(a.query_dtype)) {
    throw InvalidArgument(where, "query_dtype", DTypeName(a.query_dtype), "F32, F16, BF16");
  }
  if (!FloatType(a.output_dtype)) {
    throw InvalidArgument(where, "output_dtype", DTypeName(a.output_dtype), "F32, F16, BF16");
  }
  if (a.num_seqs == 0 && a.num_tokens != 0) {
    throw InvalidArgument(where, "num_tokens", a.num_tokens, "0 when num_seqs is 0");
  }
  if (a.num_seqs == 0) return;
  if (a.query_start_loc == nullptr || a.seq_lens == nullptr || a.block_tables == nullptr) {
    throw Error(fmt::format(
        "{}: query_start_loc, seq_lens and block_tables must not be null (num_seqs = {})", where,
        a.num_seqs));
  }
  if (a.num_tokens > 0 &&
      (a.query == nullptr || a.output == nullptr || a.lse == nullptr || a.cache.data == nullptr)) {
    throw Error(
        fmt::format("{}: query, output, lse and cache.data must not be null (num_tokens = {})",
                    where, a.num_tokens));
  }
  // What the call writes (output, lse, workspace) must not overlap what it reads or other writes:
  // an lse over the query had overwritten query rows still to be read on the CPU; on CUDA, CTAs
  // race; an output over the cache would change the cache.
  const int64_t rows = int64_t{a.num_tokens} * a.num_q_heads;
  const int64_t d = layout.head_dim;
  CheckDisjoint(where,
                {{"output", a.output, rows * d * DTypeSize(a.output_dtype)},
                 {"cache", a.cache.data, a.cache.num_blocks * BlockBytesOf(layout)},
                 {"lse", a.lse, rows * 4},
                 {"workspace", a.workspace, a.workspace_bytes},
                 {"query", a.query, rows * d * DTypeSize(a.query_dtype)},
                 {"query_start_loc", a.query_start_loc, (int64_t{a.num_seqs} + 1) * 4},
                 {"seq_lens", a.seq_lens, int64_t{a.num_seqs} * 4},
                 {"block_tables", a.block_tables, int64_t{a.num_seqs} * a.max_blocks_per_seq * 4}});
}

void ValidateAttentionArrays(std::string_view where, const CacheLayout& layout,
                             const AttentionArgs& a) {
  if (a.num_seqs == 0) return;
  if (a.query_start_loc[0] != 0) {
    throw InvalidArgument(where, "query_start_loc[0]", a.query_start_loc[0], "0");
  }
  // Every query start first, so that a bad one is named as such rather than as the seq_lens
  // entry it makes look wrong.
  for (int b = 0; b < a.num_seqs; ++b) {
    const int32_t begin = a.query_start_loc[b], end = a.query_start_loc[b + 1];
    if (end < begin || end > a.num_tokens) {
      throw InvalidArgument(
          where, fmt::format("query_start_loc[{}]", b + 1), end,
          fmt::format("{} (query_start_loc[{}]) to num_tokens = {}", begin, b, a.num_tokens));
    }
  }
  const int64_t max_len = int64_t{a.max_blocks_per_seq} * layout.block_size;
  for (int b = 0; b < a.num_seqs; ++b) {
    const int32_t begin = a.query_start_loc[b], end = a.query_start_loc[b + 1];
    const int32_t q_len = end - begin;
    const int32_t len = a.seq_lens[b];
    if (len < q_len || len > max_len) {
      throw InvalidArgument(where, fmt::format("seq_lens[{}]", b), len,
                            fmt::format("the query length {} to {} ({} blocks x {} tokens)", q_len,
                                        max_len, a.max_blocks_per_seq, layout.block_size));
    }
    if (q_len == 0) continue;
    // The first position any of its queries reads.
    int64_t first = 0;
    if (a.sliding_window > 0) first = std::max<int64_t>(0, len - q_len - a.sliding_window + 1);
    for (int64_t i = first / layout.block_size; i * layout.block_size < len; ++i) {
      const int32_t id = a.block_tables[int64_t{b} * a.max_blocks_per_seq + i];
      if (id < 0 || id >= a.cache.num_blocks) {
        throw InvalidArgument(where, fmt::format("block_tables[{}, {}]", b, i), id,
                              fmt::format("0 to {} (cache.num_blocks {})", a.cache.num_blocks - 1,
                                          a.cache.num_blocks));
      }
    }
  }
  if (a.query_start_loc[a.num_seqs] != a.num_tokens) {
    throw InvalidArgument(where, fmt::format("query_start_loc[{}]", a.num_seqs),
                          a.query_start_loc[a.num_seqs],
                          fmt::format("num_tokens = {}", a.num_tokens));
  }
}

}  // namespace tqkv
