// A Llama model served through tqkv on a CUDA device: the same Engine as CpuEngine (policy,
// block manager, step batch; the caches in device memory), with every step on one stream: one
// upload of the step batch (UploadStepBatch) and of the step's tokens, positions and logit rows,
// then per layer RMSNorm, the fused QKV projection (cuBLAS, bf16 weights, fp32 accumulation),
// RoPE, the store of the layer's K/V (StoreDeviceState for TurboQuant layers, a bf16 writer for
// bf16 ones), attention over the cache (CudaAttention: decode kernels for one-token rows, the
// chunk kernel for prefill chunks), the output projection added to the fp32 residual, and the
// SwiGLU feed-forward; then the logits of the rows asked for, and one synchronization.
//
// The weights are the model's fp32 weights rounded to bf16 on the device (the CPU engine uses
// them in fp32), so logits differ from CpuEngine's by bf16 weight rounding.
#pragma once

#include <memory>
#include <span>

#include "model/engine.h"

namespace tqkv::model {

class CudaEngine : public Engine {
 public:
  // Uploads the weights (synchronously). Throws tqkv::Error without a CUDA build or device.
  CudaEngine(const LlamaModel& model, KvPolicy policy);
  ~CudaEngine() override;

  void Compute(std::span<const int32_t> tokens, std::span<const int32_t> logit_rows,
               float* logits, int32_t* argmax) override;

  // Device memory the weights take (bytes).
  int64_t weight_bytes() const;

 private:
  struct Device;
  std::unique_ptr<Device> dev_;
};

}  // namespace tqkv::model
