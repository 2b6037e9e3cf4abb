// Persistent-grid launches of the store kernels: as many CTAs as fit on the device at once.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "quant/store_launch.h"
#include "quant/store_loads.cuh"

namespace tqkv::store {
namespace {

// CTAs of `Kernel` that fit on the device at once with `smem_bytes` of dynamic shared memory
// (one cache per kernel, whose dynamic size is fixed; the device is the current one at first
// use). Kernels with dynamic shared memory get their limit raised to it first.
template <auto Kernel, int kCtaThreads = kThreads>
int ResidentCtas(int smem_bytes = 0) {
  static const int ctas = [smem_bytes] {
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (smem_bytes > 0) {
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    }
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kCtaThreads, smem_bytes);
    return std::max(1, sms * per_sm);
  }();
  return ctas;
}

template <auto Kernel, int kCtaThreads = kThreads>
void LaunchPersistent(const StoreParams& p, int64_t chunks, StreamHandle stream,
                      int smem_bytes = 0) {
  const int grid =
      static_cast<int>(std::min<int64_t>(chunks, ResidentCtas<Kernel, kCtaThreads>(smem_bytes)));
  Kernel<<<grid, kCtaThreads, smem_bytes, stream>>>(p);
}

}  // namespace
}  // namespace tqkv::store
