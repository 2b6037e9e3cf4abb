#include <cuda_runtime.h>

#include "runtime/test_kernels.h"

namespace tqkv::testing {
namespace {

__global__ void FillKernel(float* dst, int n, float value) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = value;
}

}  // namespace

void LaunchFill(float* dst, int n, float value, int threads_per_block, StreamHandle stream) {
  const int blocks = (n + threads_per_block - 1) / threads_per_block;
  FillKernel<<<blocks, threads_per_block, 0, stream>>>(dst, n, value);
}

}  // namespace tqkv::testing
