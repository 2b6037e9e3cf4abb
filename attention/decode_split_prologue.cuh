// The split kernel's finish_prologue: everything the split needs from earlier work, called by a
// pipeline once its first copies are out. Waits for the query prep grid where there is one
// (programmatic launch), rotates the group's query rows into shared memory (Hadamard rotations as
// a Walsh-Hadamard transform; a dense Πᵀ was applied by the query prep), writes the codebook
// replicas and the split's block ids, and loads the query fragments. A function object holding
// references to the kernel's values, as the lambda it replaced did.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode_cache_traits.cuh"
#include "attention/decode_device.cuh"
#include "attention/decode_launch.h"
#include "attention/decode_split_config.cuh"
#include "attention/decode_variant.h"

namespace tqkv::decode_detail {

template <SplitVariant V>
struct SplitPrologue {
  using Config = SplitKernelConfig<V>;
  using Traits = typename Config::Traits;
  static constexpr int kD = V.head_dim;
  static constexpr int kNTiles = V.n_tiles;
  static constexpr bool kPacked = V.packed;
  static constexpr int kT = Config::kCtaWarps * 32;
  static constexpr int kW = Config::kCtaWarps / Config::kUnits;
  static constexpr int kKSteps = Config::kKSteps;
  static constexpr bool kCodebook = Traits::kLutEntries > 0;
  static constexpr bool kInterleavedKeys = Config::kPlainStaged;
  static constexpr int kE = kD / 32;  // query elements per lane
  // Codebook entries and block ids a thread carries from the kernel's start to here.
  static constexpr int kEntriesPerThread = (Traits::kLutEntries + kT - 1) / kT;
  static constexpr int kIdsPerThread = (Config::kMaxIds + kT - 1) / kT;
  static constexpr int kQParts = Config::kQParts;

  // Rows of the group each warp rotates.
  static constexpr int kRowsPerWarp = (Config::kQueryHeads + kW - 1) / kW;

  const SplitParams& p;
  const int& unit;
  const ColumnSpan& span;  // the sequence's verify columns (query rows), if any
  const int &warp, &lane, &b, &h, &group;
  const uint32_t (&q_pre)[kRowsPerWarp][kE / 2];
  const float (&q_sign)[kE];  // the rotation's signs (1 without)
  const uint2 (&entries)[kEntriesPerThread > 0 ? kEntriesPerThread : 1];
  const int& num_ids;
  int* const& ids_s;
  const int& q_prefetched_rows;  // q_pre[r] holds the row of head warp + r·kW for r below it
  const int (&ids_pre)[kIdsPerThread > 0 ? kIdsPerThread : 1];
  const int &g, &t;
  // out: the score MMA's B fragments (Config::kQueryInSmem: none, the compute reads them)
  uint32_t (&qf)[kQParts][Config::kFragTiles][kKSteps][2];

  __device__ __forceinline__ void operator()() const {
    extern __shared__ __align__(16) uint8_t smem[];
    GridDependencyWait();
    // Warp w rotates rows w, w + kW, ... of the group: lane l holds elements kE·l .. kE·l + kE - 1,
    // so the transform's first log2(kE) butterfly stages are in registers and the other five
    // cross lanes (shuffles). Sylvester order: y[j] = Σ_i x[i] (-1)^popcount(i & j).
    uint16_t* q_hi = reinterpret_cast<uint16_t*>(smem + Config::kQueryOffset) +
                     unit * 2 * Config::kQueryHeads * kD;
    uint16_t* q_lo = q_hi + Config::kQueryHeads * kD;
    // Every row's loads first, so that their latencies overlap (a load per row between the
    // transforms of 4 rows took 4.7 µs of a 4-warp CTA's prologue, H200).
    float xs[kRowsPerWarp][kE];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int head = warp + r * kW;
#pragma unroll
      for (int e = 0; e < kE; ++e) xs[r][e] = 0.0f;
      if (head >= Config::kQueryHeads || head >= group) continue;
      const int64_t row =
          RowOfColumn(p.verify, span, p.num_q_heads, p.num_kv_heads, b, h, head);
      if (row < 0) continue;
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        const int64_t at = row * kD + kE * lane + e;
        if (r < q_prefetched_rows) {
          const auto bits = static_cast<uint16_t>(q_pre[r][e / 2] >> (16 * (e % 2)));
          xs[r][e] = p.query_dtype == DType::kF16 ? __half2float(__ushort_as_half(bits))
                                                  : __bfloat162float(__ushort_as_bfloat16(bits));
        } else if (p.query_dtype == DType::kF32) {
          xs[r][e] = static_cast<const float*>(p.query)[at];
        } else if (p.query_dtype == DType::kF16) {
          xs[r][e] = __half2float(static_cast<const __half*>(p.query)[at]);
        } else {
          xs[r][e] = __bfloat162float(static_cast<const __nv_bfloat16*>(p.query)[at]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int head = warp + r * kW;
      if (head >= Config::kQueryHeads) break;
      float(&x)[kE] = xs[r];
      if (head < group) {
#pragma unroll
        for (int e = 0; e < kE; ++e) x[e] *= q_sign[e];  // 1 without signs
        if (p.query_fwht) {
#pragma unroll
          for (int m = 1; m < kE; m <<= 1) {
#pragma unroll
            for (int e = 0; e < kE; ++e) {
              if ((e & m) == 0) {
                const float u = x[e], v = x[e + m];
                x[e] = u + v;
                x[e + m] = u - v;
              }
            }
          }
#pragma unroll
          for (int m = 1; m < 32; m <<= 1) {
#pragma unroll
            for (int e = 0; e < kE; ++e) {
              const float o = __shfl_xor_sync(0xffffffffu, x[e], m);
              x[e] = (lane & m) ? o - x[e] : x[e] + o;
            }
          }
#pragma unroll
          for (int e = 0; e < kE; ++e) x[e] *= p.query_scale;
        }
      }
      // Fragment words hold element pairs (low half = even element), so the rows are stored as
      // pairs.
#pragma unroll
      for (int e = 0; e < kE; e += 2) {
        const int at = Config::QueryAt(head, kE * lane + e);
        if constexpr (Traits::kPlain) {  // the cache's element type
          *reinterpret_cast<uint32_t*>(q_hi + at) = PackPlain<Traits::kFp16>(x[e], x[e + 1]);
        } else {
          const __half2 hi = __floats2half2_rn(x[e], x[e + 1]);
          const float2 hf = __half22float2(hi);
          *reinterpret_cast<__half2*>(q_hi + at) = hi;
          *reinterpret_cast<__half2*>(q_lo + at) = __floats2half2_rn(x[e] - hf.x, x[e + 1] - hf.y);
        }
      }
    }
    if constexpr (kCodebook) {
      // 16-byte stores of two replicas (Config::kHiTable: four replicas of the hi pair, 32 per
      // entry at 4-byte steps, so that the 32 lanes' 4-byte lookups hit 32 distinct banks: one
      // wavefront); store c of lane l goes to 16-byte slot (c + l) mod 8 of its entry's 256-byte
      // row, so each 8-lane phase of a store covers 8 distinct bank groups.
      const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
#pragma unroll
      for (int k = 0; k < kEntriesPerThread; ++k) {
        const int e = threadIdx.x + k * kT;
        if (e < Traits::kLutEntries) {
#pragma unroll
          for (int c = 0; c < 8; ++c) {
            const uint32_t at = base + 256u * e + 16u * ((c + lane) & 7);
            const uint32_t second = Config::kHiTable ? entries[k].x : entries[k].y;
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %1, %2};\n" ::"r"(at), "r"(entries[k].x),
                         "r"(second)
                         : "memory");
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kIdsPerThread; ++k) {
      const int i = threadIdx.x + k * kT;
      if (i < num_ids) ids_s[i] = ids_pre[k];
    }
    __syncthreads();  // the rotated rows, the table replicas and the block ids
    if constexpr (Config::kQueryInSmem) return;
#pragma unroll
    for (int part = 0; part < kQParts; ++part) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        // Packed: column g holds part g % 2 of head g / 2.
        const int head = kPacked ? (g >> 1) : 8 * nt + g;
        const uint16_t* q = ((kPacked ? (g & 1) : part) ? q_lo : q_hi) + head * kD +
                            (kInterleavedKeys ? 8 : kD / 4) * t;
#pragma unroll
        for (int s = 0; s < kKSteps; ++s) {
          // A thread's key element i is d = (D/4)·t + i, or with interleaved keys (its units are
          // 4j + t) d = 32·(i / 8) + 8·t + i % 8.
          const int at = kInterleavedKeys ? 32 * (s / 2) + 4 * (s % 2) : 4 * s;
          qf[part][nt][s][0] = *reinterpret_cast<const uint32_t*>(q + at);
          qf[part][nt][s][1] = *reinterpret_cast<const uint32_t*>(q + at + 2);
        }
      }
    }
  }
};

}  // namespace tqkv::decode_detail
