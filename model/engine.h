// A Llama model served through tqkv on the CPU: the block manager schedules every step (chunked
// prefill, prefix caching, decode), each layer's K/V are stored into that layer's paged cache
// (TurboQuant via Quantizer::StoreCpu, or uncompressed bf16), and attention reads them back for
// every new token (AttentionCpu). Per-layer cache formats: a preset for most layers and bf16 for
// the first and last `boundary_layers` (vLLM's boundary layers).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvcache/manager.h"
#include "kvcache/step_batch.h"
#include "model/llama.h"

namespace tqkv::model {

struct KvPolicy {
  std::string preset = "turboquant_4bit_nc";  // a TurboQuant preset, or "bf16" for every layer
  int boundary_layers = 0;                    // bf16 layers at each end
  int block_size = 16;
  int32_t num_blocks = 0;  // 0: enough for the longest sequence a call runs, plus one
};

// Per-layer errors of the cache against the exact values, summed over the tokens a Forward
// computes (compressed layers only; bf16 layers too, as rounding): the keys' and values' relative
// squared error Σ‖x − x̂‖² / Σ‖x‖² (TurboQuant's D_mse for unit keys: 0.0095 at 4 bits, 0.0345 at
// 3), and the cosine between each head's attention output over the cache and over the exact fp32
// K/V of the same sequence, for the same query.
struct LayerErrors {
  std::vector<double> key_err, key_norm, value_err, value_norm;
  std::vector<double> cosine_sum, cosine_min;
  std::vector<int64_t> outputs;
  void Resize(int layers);
  double key_mse(int l) const { return key_err[l] / key_norm[l]; }
  double value_mse(int l) const { return value_err[l] / value_norm[l]; }
  double mean_cosine(int l) const { return cosine_sum[l] / static_cast<double>(outputs[l]); }
};

class CpuEngine {
 public:
  CpuEngine(const LlamaModel& model, KvPolicy policy);
  ~CpuEngine();
  CpuEngine(CpuEngine&&) noexcept;

  // Teacher-forced logits [n, vocab] of one sequence of `tokens`, prefilled `chunk` tokens per
  // step (each step: Schedule, per layer store + attention over the cache, then the rest of the
  // layer). The sequence is freed afterwards; its full blocks stay in the prefix cache, and a
  // later call's positions served from there are not recomputed: their rows are NaN.
  // With `errors`, also measures each layer's errors (slower: every stored slot is decoded again
  // and exact attention runs beside the cache's); the sequence must not hit the prefix cache.
  std::vector<float> Forward(std::span<const int32_t> tokens, int chunk,
                             LayerErrors* errors = nullptr);

  // The serving interface (model/server.h drives it). The block manager over this engine's
  // caches, created on first use with policy.num_blocks blocks (throws when that is 0: a server
  // sizes its pool; Forward sizes it to the sequence).
  KVCacheManager& manager();
  // Schedules a step into the engine's batch (KVCacheManager::Schedule); when admitted, the caches
  // apply the step's copy-on-write copies.
  ScheduleResult Schedule(std::span<const StepRequest> requests);
  const StepBatch& batch() const;
  // Runs the scheduled step: tokens[t] is the token at row t of the batch (its slot_mapping
  // order; positions follow from seq_lens and query_start_loc), every layer's K/V are stored and
  // attended through the cache; the logits of the rows in `logit_rows` go to logits
  // [logit_rows.size(), vocab]. A row's result depends only on its sequence's tokens and cache,
  // not on the other rows of the batch.
  void Compute(std::span<const int32_t> tokens, std::span<const int32_t> logit_rows,
               float* logits);

  const LlamaModel& model() const { return model_; }
  // Whether layer l's cache is uncompressed bf16.
  bool IsBf16Layer(int layer) const;
  // KV bytes per token over all layers (the cache formats' slot bytes · KV heads).
  int64_t kv_bytes_per_token() const;
  // Tokens served from the prefix cache so far.
  int64_t prefix_hit_tokens() const;

 private:
  struct State;
  // Exact K/V of the sequence so far, for LayerErrors.
  struct ExactState {
    LayerErrors* errors = nullptr;
    std::vector<std::vector<float>> k_hist, v_hist;  // [layer][position · kv heads · head_dim]
  };
  // Compute, with the exact-attention comparison of LayerErrors when `exact` is set (one
  // sequence whose positions all ran through this engine).
  void RunStep(std::span<const int32_t> tokens, std::span<const int32_t> logit_rows,
               float* logits, ExactState* exact);
  // Creates the manager and caches on first use (num_blocks from the policy, or blocks_needed);
  // throws if a sequence of n tokens needs more blocks than there are.
  void Prepare(int32_t blocks_needed, const char* where, int n);
  const LlamaModel& model_;
  KvPolicy policy_;
  std::unique_ptr<State> state_;
};

}  // namespace tqkv::model
