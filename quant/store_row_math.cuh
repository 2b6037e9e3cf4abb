// The store kernels' per-row arithmetic over a row's G lanes: reductions, the FWHT (butterflies
// and the tensor-core H16 stages), code packing and the norm correction's table lookups, value
// quantization.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "quant/store_loads.cuh"

namespace tqkv::store {
namespace {

// ---------------------------------------------------------------------------------------------
// Reductions over the G lanes of a row (xor butterflies: every lane gets the same value, since
// a + b == b + a bitwise).

template <int G, typename V>
__device__ __forceinline__ V GroupSum(V x) {
#pragma unroll
  for (int m = G / 2; m >= 1; m >>= 1) x += __shfl_xor_sync(kFullMask, x, m);
  return x;
}

template <int G>
__device__ __forceinline__ float GroupMin(float x) {
#pragma unroll
  for (int m = G / 2; m >= 1; m >>= 1) x = fminf(x, __shfl_xor_sync(kFullMask, x, m));
  return x;
}

template <int G>
__device__ __forceinline__ float GroupMax(float x) {
#pragma unroll
  for (int m = G / 2; m >= 1; m >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, m));
  return x;
}

// ‖k‖ as the reference computes it: Σ k² in fp64 (exact products), sqrt in fp64, one rounding.
// Four partial sums (elements i mod 4) instead of one chain of N dependent DFMAs: the fp64 sum's
// order already differs from the reference's (lanes, butterfly), which the final rounding to fp32
// absorbs (see quant/README.md).
template <int G, int N>
__device__ __forceinline__ float RowNorm(const float (&k)[N]) {
  double ss[4] = {0.0, 0.0, 0.0, 0.0};
#pragma unroll
  for (int i = 0; i < N; ++i) ss[i % 4] = fma(double(k[i]), double(k[i]), ss[i % 4]);
  return static_cast<float>(sqrt(GroupSum<G>((ss[0] + ss[1]) + (ss[2] + ss[3]))));
}

// The same from the raw 16-bit words (the same products in the same partial sums).
template <int G, DType T, int N>
__device__ __forceinline__ float RowNorm(const RawRow<T, N>& r) {
  static_assert(T != DType::kF32);
  double ss[4] = {0.0, 0.0, 0.0, 0.0};
#pragma unroll
  for (int j = 0; j < RawRow<T, N>::kWords; ++j) {
    const uint32_t w[4] = {r.w[j].x, r.w[j].y, r.w[j].z, r.w[j].w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      double a, b;
      Unpack2F64<T>(w[c], a, b);
      const int i = 8 * j + 2 * c;  // element of a
      ss[i % 4] = fma(a, a, ss[i % 4]);
      ss[(i + 1) % 4] = fma(b, b, ss[(i + 1) % 4]);
    }
  }
  return static_cast<float>(sqrt(GroupSum<G>((ss[0] + ss[1]) + (ss[2] + ss[3]))));
}

// y = FWHT(x) over the row (Sylvester order: y[j] = Σ_i x[i] (-1)^popcount(i & j)), unscaled.
// Register bits (e) are index bits 0-2 and 3 + log2(G) ..; lane bits (q) index bits 3 .. 2 +
// log2(G).
// kRegSkip (register strides) and kLaneFrom skip stages that FwhtOnTensorCores did.
template <int G, int N, int kRegSkip = 0, int kLaneFrom = 1>
__device__ __forceinline__ void Fwht(float (&x)[N], int q) {
#pragma unroll
  for (int h = 1; h < N; h <<= 1) {
    if (h & kRegSkip) continue;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int m = kLaneFrom; m < G; m <<= 1) {
    // The lane whose bit is set keeps (partner − own), the other (own + partner); fma with ±1 is
    // one exactly rounded add either way.
    const float sign = (q & m) ? -1.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float other = __shfl_xor_sync(kFullMask, x[i], m);
      x[i] = __fmaf_rn(sign, x[i], other);
    }
  }
}

// c = a · b, m16n8k16, 16-bit inputs of type T, fp32 accumulation from zero.
template <DType T>
__device__ __forceinline__ void MmaFromZero(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  if constexpr (T == DType::kBF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %10, %10, %10};"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
  } else {
    static_assert(T == DType::kF16);
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %10, %10, %10};"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
  }
}

// The wide kernel's FWHT of a row, scaled by `scale` (as Fwht, then · scale), from the raw 16-bit
// words of its 32 lane elements: per chunk, H16 over the index bits {0, 2, 3, 4} on tensor cores
// (quant/store_device.h, MmaOutputElement and above; hadamard_signs applied to the words first
// when kSigns), then the stages of the other bits as butterflies: 2 MMAs + 24 adds per chunk
// instead of 56 adds, 16 shuffles and 16 FMAs. The last stage (register stride 16) takes the scale
// in: (a + b)·s, (a − b)·s as a·s ± fl(b·s), three operations per pair instead of four. The
// products are exact and the sums fp32, so y is within the same few-ulp bound as the butterflies'
// (the order of the sums and the scaling's rounding differ). Every lane of the warp must call it.
template <DType T, int G, bool kSigns>
__device__ __forceinline__ void FwhtOnTensorCores(const RawRow<T, 32>& raw, uint32_t sign_spread,
                                                  const uint32_t (&b)[2][2], float scale,
                                                  float (&x)[32], int q) {
  static_assert(G % 4 == 0);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t w[4] = {raw.w[c].x, raw.w[c].y, raw.w[c].z, raw.w[c].w};
    if constexpr (kSigns) {
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] ^= PairSignMask(sign_spread, 4 * c + i);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float acc[4];
      MmaFromZero<T>(acc, w, b[j][0], b[j][1]);
#pragma unroll
      for (int r = 0; r < 4; ++r) x[8 * c + MmaOutputElement(j, r)] = acc[r];
    }
  }
  // Element bits 0 and 2 (register strides 1, 4) and t were done; strides 2 and 8 and the lane
  // strides from 4 (D = 256) now, stride 16 last with the scale.
  Fwht<G, 32, 1 | 4 | 16, 4>(x, q);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float bs = __fmul_rn(x[i + 16], scale);
    const float a = x[i];
    x[i] = __fmaf_rn(a, scale, bs);
    x[i + 16] = __fmaf_rn(a, scale, -bs);
  }
}

// Writes a lane's packed `bits`-bit codes (chunks q, q + G, ... of 8 codes) into the row's code
// region at `dst` (8-aligned): 4-bit: one 4-byte word per chunk; 3-bit: three words per four
// chunks (G is a multiple of 4, so lane q + 1 holds the next chunk). The lanes of a row write
// consecutive words.
template <int kBits, int G, int C>
__device__ __forceinline__ void StoreCodes(const LaneCodes<kBits, C>& c, int q, bool active,
                                           uint8_t* dst) {
  uint32_t* const words = reinterpret_cast<uint32_t*>(dst);
  if constexpr (kBits == 4) {
    if (active) {
#pragma unroll
      for (int j = 0; j < C; ++j) words[q + j * G] = c.w[j];
    }
  } else {
    static_assert(kBits == 3 && G % 4 == 0);
    uint32_t next[C];
#pragma unroll
    for (int j = 0; j < C; ++j) next[j] = __shfl_down_sync(kFullMask, c.w[j], 1);
    const int r = q & 3;
    if (active && r < 3) {
      // Chunk q + jG's four lanes write words 3·((q + jG) / 4) .. + 2: (q + jG) / 4 = q / 4 +
      // j·G / 4, so one address and immediate offsets.
      uint32_t* const at = words + 3 * (q >> 2) + r;
#pragma unroll
      for (int j = 0; j < C; ++j) at[3 * (G / 4) * j] = Join3Bit32(c.w[j], next[j], r);
    }
  }
}

// Σ c[idx]² over a lane's 16 (32) packed codes, by pairs (DeviceTables::pair_sq), in fp64. The
// table holds 2^copies_log2 interleaved copies (entry p of copy c at p · 2^copies_log2 + c) and
// `pair_sq` points at this lane's copy.
template <int kBits, int C>
__device__ __forceinline__ double CodeSquareSum(const LaneCodes<kBits, C>& c, const double* pair_sq,
                                                int copies_log2) {
  double sum[4];  // partial sums, as in RowNorm
#pragma unroll
  for (int i = 0; i < 4 * C; ++i) {
    const uint32_t word = c.w[i / 4];
    const uint32_t pair = (word >> (2 * kBits * (i % 4))) & ((1u << (2 * kBits)) - 1);
    const double v = pair_sq[pair << copies_log2];
    sum[i % 4] = i < 4 ? v : sum[i % 4] + v;
  }
  return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

// The same with 2^kCopiesLog2 copies fixed at compile time, `table` the whole (shared) table and
// `lane_bytes` = 8 · this lane's copy: entry p of the lane's copy is at byte
// (p << (3 + kCopiesLog2)) | lane_bytes, so a lookup's address is a shift and a LOP3 of the
// code word plus the table's base (five instructions per pair with the load and the add, where
// the runtime copy count took seven).
template <int kBits, int C, int kCopiesLog2>
__device__ __forceinline__ double CodeSquareSumFixedCopies(const LaneCodes<kBits, C>& c,
                                                           const double* table,
                                                           uint32_t lane_bytes) {
  constexpr int kShift = 3 + kCopiesLog2;
  constexpr uint32_t kMask = ((1u << (2 * kBits)) - 1) << kShift;
  const char* const base = reinterpret_cast<const char*>(table);
  double sum[4];
#pragma unroll
  for (int i = 0; i < 4 * C; ++i) {
    const uint32_t word = c.w[i / 4];
    const int sh = 2 * kBits * (i % 4) - kShift;  // constant after unrolling
    const uint32_t x = sh >= 0 ? word >> sh : word << -sh;
    const double v = *reinterpret_cast<const double*>(base + ((x & kMask) | lane_bytes));
    sum[i % 4] = i < 4 ? v : sum[i % 4] + v;
  }
  return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

// Values: uniform min/max over the finite fp16 range (EncodeSlot). Takes the lane's min/max,
// returns the lane's packed codes and the row's fp16 scale and zero.
template <int G, int kBits, int N>
__device__ __forceinline__ void QuantizeValues(const float (&v)[N], float vmin, float vmax,
                                               LaneCodes<kBits, N / 8>& codes, uint16_t& scale_bits,
                                               uint16_t& zero_bits) {
  const float row_min = GroupMin<G>(vmin), row_max = GroupMax<G>(vmax);
  vmin = fminf(fmaxf(row_min, -65504.0f), 65504.0f);
  vmax = fminf(fmaxf(row_max, -65504.0f), 65504.0f);
  constexpr uint32_t kLevels = (1u << kBits) - 1;
  float scale = __fdiv_rn(__fsub_rn(vmax, vmin), static_cast<float>(kLevels));
  if (!(scale > 1e-8f)) scale = 1e-8f;
  const float r = DivisionReciprocal(scale);  // scale is normal: 1e-8 <= scale <= 131008 / 7
  if (row_min >= -65504.0f && row_max <= 65504.0f) {  // the usual row: no cap needed
#pragma unroll
    for (int i = 0; i < N; ++i) codes.Add(i, ValueCodeInRange(v[i], vmin, scale, r));
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) codes.Add(i, ValueCode(v[i], vmin, scale, r, kLevels));
  }
  scale_bits = __half_as_ushort(__float2half_rn(scale));
  zero_bits = __half_as_ushort(__float2half_rn(vmin));
}

}  // namespace
}  // namespace tqkv::store
