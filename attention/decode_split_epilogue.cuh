// The split kernel's end: the warps' partial states merged through shared memory, then the
// split's output rows and LSE (or, with a merge grid after it, its partial ones).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode_cache_traits.cuh"
#include "attention/decode_device.cuh"
#include "attention/decode_launch.h"
#include "attention/decode_split_config.cuh"
#include "attention/decode_variant.h"

namespace tqkv::decode_detail {

template <SplitVariant V>
struct SplitEpilogue {
  using Config = SplitKernelConfig<V>;
  using Traits = typename Config::Traits;
  static constexpr int kD = V.head_dim;
  static constexpr int kNTiles = V.n_tiles;
  static constexpr bool kPacked = V.packed;
  static constexpr bool kPaired = Config::kPaired;
  static constexpr int kUnits = Config::kUnits;
  static constexpr int kT = Config::kCtaWarps * 32;
  static constexpr int kW = Config::kCtaWarps / kUnits;
  static constexpr int kMTiles = Config::kMTiles;

  // acc, m, l, z: the warp's running state (unscaled accumulator, maximum, sum, zero-point sum).
  // span: the sequence's verify columns (their output rows), if any.
  __device__ __forceinline__ static void MergeWarps(const SplitParams& p, const ColumnSpan& span,
                                                    float (&acc)[kMTiles][kNTiles][4],
                                                    float (&m)[kNTiles][2], float (&l)[kNTiles][2],
                                                    float (&z)[kNTiles][2], int g, int t,
                                                    int cta_warp, int b, int h0, int group,
                                                    int split) {
    extern __shared__ __align__(16) uint8_t smem[];
    if constexpr (kPacked) {  // columns 2t, 2t + 1 hold the P'_hi and P'_lo sums of head t
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        acc[mt][0][0] += acc[mt][0][1];  // row g
        acc[mt][0][2] += acc[mt][0][3];  // row g + 8
      }
    }

    // Row sums: l and z are per-thread partials over tokens 2g, 2g+1; m is already warp-uniform
    // per head column.
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
          l[nt][j] += __shfl_xor_sync(0xffffffffu, l[nt][j], off);
          z[nt][j] += __shfl_xor_sync(0xffffffffu, z[nt][j], off);
        }
      }
    }

    // Merge the four warps through shared memory (the table is no longer needed): every warp
    // stores its (m, l, z) and its accumulator unscaled, then one pass rescales and sums them.
    __syncthreads();
    constexpr int kHeads = 8 * kNTiles;
    // Rows per CTA warp (kCW); a paired CTA's heads 0-3 of unit u are its row heads 4u .. 4u + 3
    // in the per-head arrays below.
    constexpr int kCW = Config::kCtaWarps;
    float* acc_s = reinterpret_cast<float*>(smem);             // [kCW][kHeads] rows, AccAt
    float* stats = acc_s + kCW * kHeads * Config::kAccStride;  // [3][kCW][kHeads]: m, l, z
    if (g == 0) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int j = 0; j < (kPacked ? 1 : 2); ++j) {
          const int head = kPacked ? t : 8 * nt + 2 * t + j;
          stats[(0 * kCW + cta_warp) * kHeads + head] = m[nt][j];
          stats[(1 * kCW + cta_warp) * kHeads + head] = l[nt][j];
          stats[(2 * kCW + cta_warp) * kHeads + head] = z[nt][j];
        }
      }
    }
    float* my_acc = acc_s + Config::AccAt(cta_warp * kHeads, 0);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const int d0 = Traits::D0(g, mt);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (kPacked && i % 2 == 1) continue;  // folded into i - 1
          const int head = kPacked ? t : 8 * nt + 2 * t + (i % 2);
          my_acc[Config::AccAt(head, d0 + i / 2)] =
              acc[mt][nt][i] * (i < 2 ? Traits::kEvenRowScale : Config::kOddRowScale);
        }
      }
    }
    __syncthreads();

    // Final: out[head][d] = (Σ_w f_w · acc_w + z) / l with f_w = 2^(m_w - max m), z = Σ_w f_w z_w,
    // l = Σ_w f_w l_w, lse = (max m + log2 l) · ln 2, for the group's heads. A warp without tokens
    // has m = -inf and f = 0. The per-head factors first (one thread per head), then the elements.
    // Paired CTAs: unit u's warps are u·kW .. u·kW + kW - 1 and its heads hh = u·group + head of
    // the per-head arrays (rows b·Hq + h0·group + hh: the two KV heads' query rows are adjacent).
    static_assert(kUnits * 4 <= kHeads || !kPaired);
    float* factor = stats + 3 * kCW * kHeads;  // [kCW][kHeads] f_w, [kHeads] 1/l, [kHeads] z
    if (threadIdx.x < kUnits * group) {
      const int hh = threadIdx.x, u = kPaired ? hh / group : 0, head = kPaired ? hh % group : hh;
      const int w0 = u * kW;
      float mm = -INFINITY;
#pragma unroll
      for (int w = w0; w < w0 + kW; ++w) mm = fmaxf(mm, stats[w * kHeads + head]);
      float ll = 0.0f, zz = 0.0f;
#pragma unroll
      for (int w = w0; w < w0 + kW; ++w) {
        const float mw = stats[w * kHeads + head];
        const float f = mw == -INFINITY ? 0.0f : exp2f(mw - mm);
        factor[w * kHeads + head] = f;
        ll += f * stats[(kCW + w) * kHeads + head];
        zz += f * stats[(2 * kCW + w) * kHeads + head];
      }
      // ll = 0 only for a verify column that saw no token of this split: output 0, LSE -inf.
      factor[kCW * kHeads + hh] = ll > 0.0f ? 1.0f / ll : 0.0f;
      factor[(kCW + 1) * kHeads + hh] = zz;
      const float lse = ll > 0.0f ? (mm + log2f(ll)) * kLn2 : -INFINITY;
      if (p.output != nullptr) {  // one split per sequence: the final LSE, no merge
        const int64_t row =
            RowOfColumn(p.verify, span, p.num_q_heads, p.num_kv_heads, b, h0 + u, head);
        if (row >= 0) p.lse[row] = lse;
      } else {
        const int64_t row = static_cast<int64_t>(b) * p.num_q_heads + h0 * group + hh;
        p.partial_lse[row * p.max_splits + split] = lse;
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kUnits * group * kD; i += kT) {
      const int hh = i / kD, d = i % kD, u = kPaired ? hh / group : 0;
      const int head = kPaired ? hh % group : hh, w0 = u * kW;
      float aa = 0.0f;
#pragma unroll
      for (int w = w0; w < w0 + kW; ++w) {
        const float f = factor[w * kHeads + head];
        aa += f == 0.0f ? 0.0f : f * acc_s[Config::AccAt(w * kHeads + head, d)];
      }
      const float out = (aa + factor[(kCW + 1) * kHeads + hh]) * factor[kCW * kHeads + hh];
      if (p.output != nullptr) {  // one split per sequence: the final output, no merge
        const int64_t row =
            RowOfColumn(p.verify, span, p.num_q_heads, p.num_kv_heads, b, h0 + u, head);
        if (row >= 0) StoreOutput(p.output, p.out_dtype, row * kD + d, out);
      } else {
        const int64_t row = static_cast<int64_t>(b) * p.num_q_heads + h0 * group + hh;
        p.partial_out[(row * p.max_splits + split) * kD + d] = out;
      }
    }
  }
};

}  // namespace tqkv::decode_detail
