// Runtime to compile time for StoreKernel, within one head_dim: bits, then input type, then key
// source and layout, each in one switch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "quant/store_kernel.cuh"
#include "quant/store_launch.h"
#include "quant/store_resident.cuh"

namespace tqkv::store {
namespace {

// ---------------------------------------------------------------------------------------------
// Dispatch: head_dim, then bits, then input type, then key source, each in one switch.

template <int D, int KB, int VB, DType T>
constexpr auto kMmaKernel = StoreKernel<D, KB, VB, T, KeySource::kMma, StoreLayout::kNarrow>;

template <int D, int KB, int VB>
bool PrepareMmaBits() {
  if constexpr (D <= 128 && KB != 8) {
    ResidentCtas<kMmaKernel<D, KB, VB, DType::kF32>>(MmaTiles<D, DType::kF32>::kBytes);
    ResidentCtas<kMmaKernel<D, KB, VB, DType::kF16>>(MmaTiles<D, DType::kF16>::kBytes);
    ResidentCtas<kMmaKernel<D, KB, VB, DType::kBF16>>(MmaTiles<D, DType::kBF16>::kBytes);
    return true;
  }
  return false;
}

template <int D, int KB, int VB, DType T, StoreLayout kLayout>
void LaunchStoreLayout(const StoreParams& p, int64_t chunks, StreamHandle stream) {
  if constexpr (KB == 8) {
    LaunchPersistent<StoreKernel<D, KB, VB, T, KeySource::kFwht, kLayout>>(p, chunks, stream);
  } else if (p.key_source == KeySource::kFwht) {
    LaunchPersistent<StoreKernel<D, KB, VB, T, KeySource::kFwht, kLayout>>(p, chunks, stream);
  } else {
    // y is fp32 whatever the input type; only the values are read as T.
    LaunchPersistent<StoreKernel<D, KB, VB, T, KeySource::kLoadY, kLayout>>(p, chunks, stream);
  }
}

template <int D, int KB, int VB, DType T>
bool LaunchStoreTyped(const StoreParams& p, int64_t chunks, StreamHandle stream) {
  if (p.key_source == KeySource::kMma) {
    if constexpr (D <= 128 && KB != 8) {
      LaunchPersistent<kMmaKernel<D, KB, VB, T>>(p, chunks, stream, MmaTiles<D, T>::kBytes);
      return true;
    }
    return false;
  }
  // The wide FWHT kernel: the default for 16-bit inputs at D = 128 and 256 from kWideMinRows rows
  // (StoreFwhtKernel forces either, to compare and to test). Below that the narrow kernel is as
  // fast or faster: a 128-thread CTA takes twice as long to copy the lookup tables into shared
  // memory, and with one iteration per CTA the tiles' copy has nothing to overlap (8 heads: N =
  // 2,048 tokens 10.4 µs narrow vs 11.8 wide; 4,096: 17.1 vs 16.8; 8,192: 25.6 vs 25.5).
  if constexpr ((D == 128 || D == 256) && T != DType::kF32 && KB != 8) {
    const int64_t rows = p.num_tokens * p.format.num_kv_heads;
    const bool wide =
        ((p.fwht_kernel == StoreFwhtKernel::kAuto && rows >= kWideMinRows) ||
         p.fwht_kernel == StoreFwhtKernel::kWide || p.fwht_kernel == StoreFwhtKernel::kWideFp32) &&
        p.lut.cells <= kWideLutCells;
    if (wide && p.key_source == KeySource::kFwht) {
      constexpr int64_t kRowsPerCta = kCtaThreadsFor<kWide> / (D / kLaneElemsFor<kWide>);
      LaunchPersistent<StoreKernel<D, KB, VB, T, KeySource::kFwht, kWide>, kCtaThreadsFor<kWide>>(
          p, (rows + kRowsPerCta - 1) / kRowsPerCta, stream, kWideTileBytes);
      return true;
    }
  }
  LaunchStoreLayout<D, KB, VB, T, StoreLayout::kNarrow>(p, chunks, stream);
  return true;
}

template <int D, int KB, int VB>
bool LaunchStoreBits(const StoreParams& p, int64_t chunks, StreamHandle stream) {
  switch (p.input) {
    case DType::kF32:
      return LaunchStoreTyped<D, KB, VB, DType::kF32>(p, chunks, stream);
    case DType::kF16:
      return LaunchStoreTyped<D, KB, VB, DType::kF16>(p, chunks, stream);
    case DType::kBF16:
      return LaunchStoreTyped<D, KB, VB, DType::kBF16>(p, chunks, stream);
  }
  return false;
}

template <int D>
bool LaunchStoreDim(const StoreParams& p, int64_t chunks, StreamHandle stream) {
  const int kb = p.format.fp8_keys ? 8 : p.format.key_bits;
  const int vb = p.format.value_bits;
  if (kb == 8 && vb == 4) return LaunchStoreBits<D, 8, 4>(p, chunks, stream);
  if (kb == 4 && vb == 4) return LaunchStoreBits<D, 4, 4>(p, chunks, stream);
  if (kb == 3 && vb == 4) return LaunchStoreBits<D, 3, 4>(p, chunks, stream);
  if (kb == 3 && vb == 3) return LaunchStoreBits<D, 3, 3>(p, chunks, stream);
  return false;
}

template <int D>
bool PrepareMmaDim(const BlockFormat& f) {
  const int kb = f.fp8_keys ? 8 : f.key_bits;
  const int vb = f.value_bits;
  if (kb == 4 && vb == 4) return PrepareMmaBits<D, 4, 4>();
  if (kb == 3 && vb == 4) return PrepareMmaBits<D, 3, 4>();
  if (kb == 3 && vb == 3) return PrepareMmaBits<D, 3, 3>();
  return false;
}

}  // namespace
}  // namespace tqkv::store
