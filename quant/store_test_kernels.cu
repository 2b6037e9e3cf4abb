#include <cuda_runtime.h>

#include "quant/store_device.h"
#include "quant/store_test_kernels.h"

namespace tqkv::store::testing {
namespace {

__global__ void ValueCodesKernel(const float* v, const float* vmin, const float* scale, int n,
                                 uint32_t levels, uint32_t* fast, uint32_t* in_range,
                                 uint32_t* exact) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float r = DivisionReciprocal(scale[i]);
  fast[i] = ValueCode(v[i], vmin[i], scale[i], r, levels);
  in_range[i] = ValueCodeInRange(v[i], vmin[i], scale[i], r);
  // Quantizer::EncodeSlot's expression, in IEEE fp32.
  const float t = floorf(__fadd_rn(__fdiv_rn(__fsub_rn(v[i], vmin[i]), scale[i]), 0.5f));
  exact[i] = t >= 0.0f ? static_cast<uint32_t>(fminf(t, static_cast<float>(levels))) : 0u;
}

}  // namespace

void LaunchValueCodes(const float* v, const float* vmin, const float* scale, int n, uint32_t levels,
                      uint32_t* fast, uint32_t* in_range, uint32_t* exact, StreamHandle stream) {
  ValueCodesKernel<<<(n + 255) / 256, 256, 0, stream>>>(v, vmin, scale, n, levels, fast, in_range,
                                                        exact);
}

}  // namespace tqkv::store::testing
