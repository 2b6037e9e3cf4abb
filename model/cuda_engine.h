// A Llama model served through tqkv on a CUDA device: the same Engine as CpuEngine (policy,
// block manager, step batch; the caches in device memory), with every step on one stream: one
// upload of the step batch (UploadStepBatch) and of the step's tokens, positions and logit rows,
// then per layer RMSNorm, the fused QKV projection (cuBLAS, bf16 weights, fp32 accumulation),
// RoPE, the store of the layer's K/V (StoreDeviceState for TurboQuant layers, a bf16 writer for
// bf16 ones), attention over the cache (CudaAttention: decode kernels for one-token rows, the
// chunk kernel for prefill chunks), the output projection added to the fp32 residual, and the
// SwiGLU feed-forward; then the logits of the rows asked for, and one synchronization.
//
// A decode step (one row per sequence, each sampling) is captured once per shape (batch size,
// block-table width: Schedule pads the width to a multiple of 32 blocks) into a CUDA graph and
// replayed: the ~10 launches per layer cost more than a small model's kernels.
//
// The weights are the model's fp32 weights rounded to bf16 on the device (the CPU engine uses
// them in fp32), and the GEMMs read bf16 activations, so logits differ from CpuEngine's by that
// rounding, and a compressed cache's indices can flip where a key lies near a midpoint.
#pragma once

#include <memory>
#include <span>

#include "model/engine.h"

namespace tqkv {
struct AttentionPlan;
}

namespace tqkv::model {

struct CudaEngineOptions {
  bool decode_graphs = true;  // replay decode steps from CUDA graphs
  // Block-table width padding (blocks), 1 for none; at most CudaAttention::kMaxContextTokens /
  // block_size.
  int32_t width_multiple = 32;
};

class CudaEngine : public Engine {
 public:
  // Uploads the weights (synchronously). Throws tqkv::Error without a CUDA build or device.
  CudaEngine(const LlamaModel& model, KvPolicy policy, CudaEngineOptions options = {});
  ~CudaEngine() override;

  void Compute(std::span<const int32_t> tokens, std::span<const int32_t> logit_rows,
               float* logits, int32_t* argmax) override;

  // CudaAttention's limits: sequences per call, rows · query heads within int32.
  int MaxStepSequences() const override;
  int MaxStepTokens() const override;

  // Device memory the weights take (bytes).
  int64_t weight_bytes() const;
  // Decode-step graphs captured so far.
  int64_t graphs_captured() const;

 private:
  struct Device;
  // The step's kernels, from the embedding to the argmax, on the engine's stream.
  void Enqueue(int n, int rows, const StepBatchView& view, const AttentionPlan* plan,
               const AttentionPlan* plan_bf16);
  CudaEngineOptions options_;
  std::unique_ptr<Device> dev_;
};

}  // namespace tqkv::model
