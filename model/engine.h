// A Llama model served through tqkv: the block manager schedules every step (chunked prefill,
// prefix caching, decode), each layer's K/V are stored into that layer's paged cache (TurboQuant,
// or uncompressed bf16), and attention reads them back for every new token. Per-layer cache
// formats: a preset for most layers and bf16 for the first and last `boundary_layers` (vLLM's
// boundary layers). Engine holds what every device shares (policy, manager, caches, step batch);
// CpuEngine computes on the CPU (Quantizer::StoreCpu, AttentionCpu), CudaEngine
// (model/cuda_engine.h) on a CUDA device.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvcache/cache_format.h"
#include "kvcache/kv_cache.h"
#include "kvcache/manager.h"
#include "kvcache/step_batch.h"
#include "model/llama.h"
#include "quant/quantizer.h"
#include "runtime/device.h"

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

// The per-step interface a server drives (model/server.h), and the state every device shares.
class Engine {
 public:
  virtual ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const LlamaModel& model() const { return model_; }
  // The block manager over this engine's caches, created on first use with policy.num_blocks
  // blocks (throws when that is 0: a server sizes its pool; Forward sizes it to the
  // sequence).
  KVCacheManager& manager();
  // Schedules a step into the engine's batch (KVCacheManager::Schedule); when admitted, the caches
  // apply the step's copy-on-write copies. Throws tqkv::Error, changing nothing, while a scheduled
  // step is not computed yet, for a step of no new tokens, and for new tokens past the model's
  // context_length (positions 0 to context_length - 1 are served, as Server::Submit allows).
  ScheduleResult Schedule(std::span<const StepRequest> requests);
  const StepBatch& batch() const { return batch_; }
  // Undoes the last admitted Schedule, computed or not, before any Commit of its sequences (for a
  // Compute that threw): each of its sequences still live is rewound by the positions the step
  // scheduled (KVCacheManager::Rewind, which releases their blocks), and no step is pending.
  // Throws tqkv::Error when there is no such step.
  void AbandonStep();
  // Runs the scheduled step: tokens[t] is the token at row t of the batch (its slot_mapping
  // order; positions follow from seq_lens and query_start_loc), every layer's K/V are stored and
  // attended through the cache. For the rows in `logit_rows`: their logits into `logits`
  // [logit_rows.size(), vocab] and their argmax into `argmax` [logit_rows.size()] (host memory;
  // either may be null). A row's result depends only on its sequence's tokens and cache, not on
  // the other rows of the batch: bit for bit on the CPU; on CUDA up to the rounding of the GEMM
  // algorithm cuBLAS picks for the batch's row count. Each Schedule is computed once. Throws
  // tqkv::Error for a step not scheduled (or computed already), a token count other than the
  // step's, a token outside the vocabulary, a token other than its sequence's known token at that
  // position (rows past the known tokens, drafts, may carry any) or a row outside the step.
  virtual void Compute(std::span<const int32_t> tokens, std::span<const int32_t> logit_rows,
                       float* logits, int32_t* argmax) = 0;

  // Teacher-forced logits [n, vocab] of one sequence of `tokens` (at most the model's
  // context_length), prefilled `chunk` tokens per step (each step: Schedule, then Compute of every
  // row with its logits). The sequence is freed afterwards; its full blocks stay in the prefix
  // cache, and a later call's positions served from there are not recomputed: their rows are NaN.
  // With `errors` (CpuEngine alone; the others throw, changing nothing), also measures each
  // layer's errors (slower: every stored slot is decoded again and exact attention runs beside
  // the cache's); the sequence must not hit the prefix cache.
  std::vector<float> Forward(std::span<const int32_t> tokens, int chunk,
                             LayerErrors* errors = nullptr);

  // The most sequences and rows one step may have here (CudaEngine: its attention kernels'); a
  // Server refuses options past them.
  virtual int MaxStepSequences() const { return std::numeric_limits<int32_t>::max(); }
  virtual int MaxStepTokens() const { return std::numeric_limits<int32_t>::max(); }

  // Whether layer l's cache is uncompressed bf16.
  // Throws tqkv::Error for a layer outside the model.
  bool IsBf16Layer(int layer) const;
  // KV bytes per token over all layers (the cache formats' slot bytes · KV heads).
  int64_t kv_bytes_per_token() const;
  // Tokens served from the prefix cache so far.
  int64_t prefix_hit_tokens() const;

 protected:
  Engine(const LlamaModel& model, KvPolicy policy, CacheDevice device);
  // Creates the manager and caches on first use (num_blocks from the policy, or blocks_needed);
  // throws if a sequence of n tokens needs more blocks than there are.
  void Prepare(int32_t blocks_needed, const char* where, int n);
  // Whether Forward measures LayerErrors here.
  virtual bool MeasuresLayerErrors() const { return false; }
  // Forward's step: Compute of the scheduled step, each row's logits into `logits`. With `errors`
  // (MeasuresLayerErrors), also the layer errors, the sequence's exact K/V kept from step to step:
  // `first` is the step's first position (0 starts them), `n` the sequence's length.
  virtual void ForwardStep(std::span<const int32_t> tokens, std::span<const int32_t> rows,
                           float* logits, LayerErrors* errors, int first, int n);
  // Checks Compute's arguments against the scheduled step and fills positions_ (each row's
  // position in its sequence).
  void CheckStep(const char* where, std::span<const int32_t> tokens,
                 std::span<const int32_t> logit_rows);
  // Layer l's cache: its KVCache, and its tensor there as stores and attention take it.
  KVCache& LayerCache(int layer) { return bf16_layer_[layer] ? *bf16_ : *compressed_; }
  CacheRef LayerRef(int layer) { return LayerCache(layer).layer(cache_layer_[layer]); }

  const LlamaModel& model_;
  KvPolicy policy_;
  CacheDevice device_;
  StreamHandle copy_stream_ = nullptr;  // where a CUDA engine's copy-on-write copies run
  std::optional<Quantizer> quantizer_;  // the compressed layers'
  CacheFormat compressed_format_, bf16_format_;
  std::vector<int> cache_layer_;  // layer -> its index in the compressed or the bf16 cache
  std::vector<bool> bf16_layer_;
  std::optional<KVCache> compressed_, bf16_;
  std::optional<KVCacheManager> manager_;
  int32_t num_blocks_ = 0;
  // > 1: Schedule rounds the batch's block-table width up to a multiple of this, so that steps
  // of a growing context keep one shape (CudaEngine's CUDA graphs).
  int32_t width_multiple_ = 1;
  StepBatch batch_;
  bool step_pending_ = false;       // batch_ was scheduled and not yet computed
  std::vector<SeqId> step_seqs_;    // its rows' sequences (until AbandonStep)
  std::vector<int32_t> step_new_tokens_;  // and the positions it scheduled on each
  std::vector<int32_t> positions_;  // the step's rows
};

class CpuEngine : public Engine {
 public:
  CpuEngine(const LlamaModel& model, KvPolicy policy);

  void Compute(std::span<const int32_t> tokens, std::span<const int32_t> logit_rows,
               float* logits, int32_t* argmax) override;

 protected:
  bool MeasuresLayerErrors() const override { return true; }
  void ForwardStep(std::span<const int32_t> tokens, std::span<const int32_t> rows, float* logits,
                   LayerErrors* errors, int first, int n) override;

 private:
  // Exact K/V of the sequence so far, for LayerErrors.
  struct ExactState {
    LayerErrors* errors = nullptr;
    std::vector<std::vector<float>> k_hist, v_hist;  // [layer][position · kv heads · head_dim]
  };
  ExactState exact_;  // Forward's, while it measures errors
  // Compute, with the exact-attention comparison of LayerErrors when `exact` is set (one
  // sequence whose positions all ran through this engine).
  void RunStep(std::span<const int32_t> tokens, std::span<const int32_t> logit_rows,
               float* logits, int32_t* argmax, ExactState* exact);
  std::vector<float> x_, q_, k_, v_, attn_, lse_;  // one step's activations
};

}  // namespace tqkv::model
