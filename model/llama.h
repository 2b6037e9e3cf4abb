// A Llama-architecture decoder from a GGUF file (llama.cpp's tensor names and conventions), on the
// CPU in fp32: the weights are dequantized once, and the forward pass is split at the KV cache so
// that an engine stores each layer's K/V and runs attention itself (through tqkv), while
// ReferenceForward runs the whole model over an exact fp32 cache of its own.
//
// Conventions of llama.cpp's "llama" architecture in GGUF: a linear layer's weight has dims
// {in, out} (row o holds the `in` weights of output o); the converter permuted the Q and K rows
// so that RoPE rotates adjacent pairs (2i, 2i + 1) by pos · base^(-2i / head_dim); query head h
// reads KV head h / (n_heads / n_kv_heads); without output.weight the output layer is the token
// embedding (tied).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/gguf.h"

namespace tqkv::model {

struct LlamaConfig {
  int num_layers = 0;
  int hidden = 0;     // embedding length
  int ffn = 0;        // feed-forward length
  int num_heads = 0;  // query heads
  int num_kv_heads = 0;
  int head_dim = 0;  // hidden / num_heads
  int vocab = 0;
  int context = 0;  // trained context length
  float rms_eps = 1e-5f;
  float rope_base = 10000.0f;
};

class LlamaModel {
 public:
  // Reads general.architecture "llama", the llama.* hyperparameters and every layer's tensors.
  // Throws tqkv::Error naming what is missing or has the wrong shape.
  static LlamaModel FromGguf(const GgufFile& file);

  // A model of this shape with seeded random weights: linear layers N(0, 1/in), embedding N(0, 1),
  // norms 1 (tied output). For tests of other devices against the CPU, and for speed
  // measurements at a real model's shapes where its file cannot go. Throws tqkv::Error for a
  // shape FromGguf would refuse.
  static LlamaModel RandomInit(const LlamaConfig& config, uint64_t seed);
  // SmolLM2-135M's shape (issue 36's model), for RandomInit.
  static LlamaConfig SmolLm2Config();

  const LlamaConfig& config() const { return c_; }

  // Every per-token function works on n tokens at once (rows of x [n, hidden]), so that each weight
  // row is read once per call, not once per token.
  // x = the tokens' embeddings.
  void Embed(std::span<const int32_t> tokens, float* x) const;
  // From the residuals x at positions pos0 .. pos0 + n - 1: the layer's attention inputs q [n,
  // num_heads · head_dim], k and v [n, num_kv_heads · head_dim], with RoPE applied to q and k.
  void AttentionInputs(int layer, const float* x, int n, int pos0, float* q, float* k,
                       float* v) const;
  // The same with each row's own position (rows of several sequences in one batch).
  void AttentionInputs(int layer, const float* x, int n, const int32_t* positions, float* q,
                       float* k, float* v) const;
  // x += Wo · attn (attn [n, num_heads · head_dim], the attention output of every head).
  void AttentionOutput(int layer, const float* attn, int n, float* x) const;
  // x += FFN(RMSNorm(x)): SwiGLU.
  void FeedForward(int layer, int n, float* x) const;
  // logits [n, vocab] of the final residuals x.
  void Logits(const float* x, int n, float* logits) const;

  // The weights, fp32 (for another device's copy): linear layers [out, in] row-major.
  struct LayerWeights {
    std::vector<float> attn_norm, wq, wk, wv, wo, ffn_norm, gate, up, down;
  };
  const LayerWeights& layer(int l) const { return layers_.at(static_cast<size_t>(l)); }
  const std::vector<float>& embedding() const { return embedding_; }  // [vocab, hidden]
  // [vocab, hidden]: output.weight, or the embedding when tied.
  const std::vector<float>& output() const { return output_.empty() ? embedding_ : output_; }
  const std::vector<float>& output_norm() const { return output_norm_; }

 private:
  using Layer = LayerWeights;
  LlamaConfig c_;
  std::vector<float> embedding_;  // [vocab, hidden]
  std::vector<float> output_;     // [vocab, hidden], empty when tied to the embedding
  std::vector<float> output_norm_;
  std::vector<Layer> layers_;
};

// The whole model over `tokens` (positions 0 .. n-1) with an exact fp32 KV cache and plain
// softmax attention: logits [n, vocab]. The reference the tqkv-backed runs are measured against.
std::vector<float> ReferenceForward(const LlamaModel& model, std::span<const int32_t> tokens);

// y[t, o] = Σ_i w[o · in + i] · x[t · in + i] for t < n, o < out.
void MatMul(const float* w, const float* x, int n, int in, int out, float* y);

}  // namespace tqkv::model
