// CPU reference decode attention over a compressed paged cache (TURBOQUANT.md, "Decode
// attention"), plus a plain fp64 attention over uncompressed K/V and the log-sum-exp merge.
// Every CUDA decode kernel is judged against DecodeCpu.
#pragma once

#include <cstdint>
#include <optional>

#include "quant/quantizer.h"

namespace tqkv {

struct DecodeInputs {
  const float* query = nullptr;  // [num_seqs, num_q_heads, head_dim]
  int num_seqs = 0;
  int num_q_heads = 0;                    // a multiple of num_kv_heads (GQA)
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  const int32_t* seq_lens = nullptr;  // [num_seqs], 0 to max_blocks_per_seq · block_size
  std::optional<float> scale;         // softmax scale; default 1/√D
  // Attend only to tokens [token_begin, min(token_end, seq_len)) of every sequence (a split of
  // split-KV); the default is the whole context.
  int32_t token_begin = 0;
  int32_t token_end = INT32_MAX;
};

struct DecodeOutputs {
  float* output = nullptr;  // [num_seqs, num_q_heads, head_dim]
  float* lse = nullptr;     // [num_seqs, num_q_heads], natural log; -inf for an empty range
};

// Validates every input first (the cache's layout is the quantizer's, shapes, GQA ratio,
// seq_lens, block ids of used blocks, scale) and throws tqkv::Error naming the argument, its
// value and what is allowed. Computes in fp64 and rounds the outputs to fp32. An empty token range
// gives output 0 and lse -inf.
void DecodeCpu(const Quantizer& quantizer, ConstCacheRef cache, const DecodeInputs& inputs,
               DecodeOutputs outputs);

// Merges two partial results over disjoint token ranges (out_a/out_b [head_dim]):
// lse = log(e^lse_a + e^lse_b), out = e^(lse_a − lse) · out_a + e^(lse_b − lse) · out_b.
void MergeAttentionStates(const float* out_a, float lse_a, const float* out_b, float lse_b,
                          int head_dim, float* out, float* lse);

// Plain softmax attention of one sequence over uncompressed K/V, all in fp64:
// q [num_q_heads, head_dim], k and v [seq_len, num_kv_heads, head_dim] -> out [num_q_heads,
// head_dim], lse [num_q_heads].
void ReferenceAttention(const float* q, const float* k, const float* v, int seq_len,
                        int num_q_heads, int num_kv_heads, int head_dim, double scale, double* out,
                        double* lse);

}  // namespace tqkv
