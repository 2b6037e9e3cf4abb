// Attention of a step's new tokens over a paged cache: the one operation behind decode (one new
// token per sequence), speculative verify (1 + k), chunked prefill and the rest of a prompt after
// a prefix-cache hit. The arguments are the same for the CPU reference (AttentionCpu,
// attention/attention_cpu.h) and the CUDA kernels (CudaAttention, attention/attention_cuda.h);
// only where the pointers point differs (host or device).
//
// Semantics (defined here; TURBOQUANT.md's "Decode attention" is the one-token case): sequence b
// has q_len = query_start_loc[b + 1] − query_start_loc[b] new tokens at the end of its context of
// L = seq_lens[b] tokens, already stored in the cache (the store runs first, so a token's K/V is
// read back from the cache like every other token's, and a sequence's outputs do not depend on
// whether its prefix came from the prefix cache). New token i (0 ≤ i < q_len) sits at position
// p = L − q_len + i and attends to the positions [max(0, p − window + 1), p] (causal; window 0:
// no sliding window, as KVCacheManagerOptions::sliding_window defines it). Query head hq reads KV
// head hq / (Hq / Hk) (GQA). Its output row is query_start_loc[b] + i.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "quant/cache_ref.h"
#include "runtime/dtype.h"

namespace tqkv {

struct AttentionArgs {
  // [num_tokens, num_q_heads, head_dim]: F32, F16 or BF16.
  const void* query = nullptr;
  DType query_dtype = DType::kF32;
  int num_seqs = 0;
  int num_tokens = 0;   // query rows: query_start_loc[num_seqs]
  int num_q_heads = 0;  // a multiple of the cache's num_kv_heads
  // [num_seqs + 1]: 0, then the running sums of the query lengths (non-decreasing; the last is
  // num_tokens). A sequence with q_len 0 (a padding row) produces nothing.
  const int32_t* query_start_loc = nullptr;
  // [num_seqs]: context length after this step's tokens, q_len to max_blocks_per_seq · block_size.
  const int32_t* seq_lens = nullptr;
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  ConstCacheRef cache;         // the layer's cache
  std::optional<float> scale;  // softmax scale; default 1/√D
  int32_t sliding_window = 0;  // 0: none; else a query at position p reads (p − window, p]
  // [num_tokens, num_q_heads, head_dim]: F32, F16 or BF16, rounded to nearest from fp32; F16
  // saturates at ±65504 (4-bit values dequantize up to ~60 past it) and keeps NaN.
  void* output = nullptr;
  DType output_dtype = DType::kF32;
  float* lse = nullptr;  // [num_tokens, num_q_heads], natural log
  // CUDA only: device scratch of at least the plan's workspace_bytes.
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
};

// Checks what can be checked without reading the per-sequence arrays: the cache's layout is
// `layout` (the one the call was made for: Quantizer::layout(), Bf16BlockFormat::layout()),
// counts, dtypes, the scale, the window, null pointers (the arrays may be device memory), and
// that what the call writes (output, lse, workspace) overlaps nothing it reads or writes, the
// cache included. Throws tqkv::Error naming the argument, its value and what is allowed.
void ValidateAttentionShapes(std::string_view where, const CacheLayout& layout,
                             const AttentionArgs& args);

// Checks the per-sequence arrays, which must be host memory: query_start_loc (starts at 0,
// non-decreasing, ends at num_tokens), seq_lens (q_len to max_blocks_per_seq · block_size) and
// the block ids of the blocks each sequence's queries read (0 to num_blocks − 1; entries a
// sliding window has released are not read and not checked).
void ValidateAttentionArrays(std::string_view where, const CacheLayout& layout,
                             const AttentionArgs& args);

}  // namespace tqkv
