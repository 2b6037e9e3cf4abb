// Where the sim stores and decodes: the CPU reference or the CUDA kernels, behind one interface.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "kvcache/cache_format.h"
#include "kvcache/step_batch.h"
#include "quant/quantizer.h"

namespace tqkv::sim {

class Backend {
 public:
  virtual ~Backend() = default;
  // Stores K/V [T, Hk, D] (fp32, host) at slot_mapping [T] into layer `layer`.
  virtual void Store(int layer, const std::vector<float>& k, const std::vector<float>& v,
                     std::span<const int64_t> slot_mapping) = 0;
  // Decode attention of queries [B, Hq, D] (fp32, host) over layer `layer` with block tables
  // [B, width] and seq_lens [B]: output [B, Hq, D] and lse [B, Hq] (host).
  virtual void Decode(int layer, const std::vector<float>& q, const std::vector<int32_t>& tables,
                      int width, const std::vector<int32_t>& seq_lens, std::vector<float>& out,
                      std::vector<float>& lse) = 0;
  virtual void ApplyCopies(std::span<const BlockCopy> copies) = 0;
  virtual void Sync() = 0;
};

// device "cpu" or "cuda"; quantizer is null for the bf16 format.
std::unique_ptr<Backend> MakeBackend(std::string_view device, const CacheFormat& format,
                                     const Quantizer* quantizer, int num_layers,
                                     int32_t num_blocks);

}  // namespace tqkv::sim
