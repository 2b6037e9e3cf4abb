// The split-KV decode kernel, DecodeSplitKernel<code of a SplitVariant>, and its launcher per key
// kind. SplitCta (decode_split_cta.cuh) is one CTA's work; its phases live in the headers below.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "attention/decode_device.cuh"
#include "attention/decode_launch.h"
#include "attention/decode_split_compute.cuh"
#include "attention/decode_split_config.cuh"
#include "attention/decode_split_cta.cuh"
#include "attention/decode_split_epilogue.cuh"
#include "attention/decode_split_pipelines.cuh"
#include "attention/decode_split_prologue.cuh"
#include "attention/decode_variant.h"

namespace tqkv::decode_detail {

// Split kernel SplitVariant::FromCode(kCode).
template <uint32_t kCode>
__global__ void __launch_bounds__(SplitVariant::FromCode(kCode).cta_warps() * 32,
                                  kSplitMinCtas<SplitVariant::FromCode(kCode)>)
    DecodeSplitKernel(const SplitParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  SplitCta<SplitVariant::FromCode(kCode)>(p, smem).Run();
}

// Launch and occupancy of one instantiation of the split kernel.
template <SplitVariant V>
struct SplitKernelOps {
  using Config = SplitKernelConfig<V>;
  static constexpr auto kKernel = DecodeSplitKernel<V.Code()>;
  static_assert(SplitVariant::FromCode(V.Code()) == V);
  static constexpr int kCtaThreads = Config::kCtaWarps * 32;

  // Shared memory above 48 KB must be opted into once per kernel.
  static cudaError_t Configure() {
    static const cudaError_t configured = cudaFuncSetAttribute(
        kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Config::kSmemBytes);
    return configured;
  }
  static cudaError_t Launch(const SplitParams& p, bool programmatic, cudaStream_t stream) {
    if (const cudaError_t e = Configure(); e != cudaSuccess) return e;
    if (p.num_kv_heads % Config::kUnits != 0) return cudaErrorInvalidValue;
    const dim3 grid(p.max_splits, p.num_kv_heads / Config::kUnits, p.num_seqs);
    if (programmatic) {
      return LaunchDependent(kKernel, grid, dim3(kCtaThreads), Config::kSmemBytes, stream, p);
    }
    kKernel<<<grid, kCtaThreads, Config::kSmemBytes, stream>>>(p);
    return cudaGetLastError();
  }
  static cudaError_t CtasPerSm(int* ctas) {
    if (const cudaError_t e = Configure(); e != cudaSuccess) return e;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, kKernel, kCtaThreads,
                                                         Config::kSmemBytes);
  }
};

// The split kernels of one key kind: every variant SplitVariantsOf(kKind) lists is instantiated,
// and the one asked for is launched (cudaErrorInvalidValue for any other value).
template <KeyKind kKind, typename Fn, int... I>
cudaError_t ForVariant(const SplitVariant& variant, std::integer_sequence<int, I...>, Fn&& fn) {
  static constexpr SplitVariantList kList = SplitVariantsOf(kKind);
  cudaError_t result = cudaErrorInvalidValue;
  ((variant == kList.items[I] ? (result = fn(SplitKernelOps<kList.items[I]>{}), true) : false) ||
   ...);
  return result;
}

template <KeyKind kKind>
cudaError_t LaunchSplitKernelOfKind(const SplitParams& p, const SplitVariant& variant,
                                    bool programmatic, cudaStream_t stream) {
  return ForVariant<kKind>(
      variant, std::make_integer_sequence<int, SplitVariantsOf(kKind).size>{},
      [&](auto ops) { return decltype(ops)::Launch(p, programmatic, stream); });
}

template <KeyKind kKind>
cudaError_t SplitKernelOfKindCtasPerSm(const SplitVariant& variant, int* ctas) {
  return ForVariant<kKind>(variant, std::make_integer_sequence<int, SplitVariantsOf(kKind).size>{},
                           [&](auto ops) {
                             const cudaError_t e = decltype(ops)::CtasPerSm(ctas);
                             *ctas *= decltype(ops)::Config::kUnits;
                             return e;
                           });
}

}  // namespace tqkv::decode_detail
