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

#include "model/llama.h"

namespace tqkv::model {

struct KvPolicy {
  std::string preset = "turboquant_4bit_nc";  // a TurboQuant preset, or "bf16" for every layer
  int boundary_layers = 0;                    // bf16 layers at each end
  int block_size = 16;
  int32_t num_blocks = 0;  // 0: enough for the longest sequence a call runs, plus one
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
  std::vector<float> Forward(std::span<const int32_t> tokens, int chunk);

  // Whether layer l's cache is uncompressed bf16.
  bool IsBf16Layer(int layer) const;
  // KV bytes per token over all layers (the cache formats' slot bytes · KV heads).
  int64_t kv_bytes_per_token() const;
  // Tokens served from the prefix cache so far.
  int64_t prefix_hit_tokens() const;

 private:
  struct State;
  const LlamaModel& model_;
  KvPolicy policy_;
  std::unique_ptr<State> state_;
};

}  // namespace tqkv::model
