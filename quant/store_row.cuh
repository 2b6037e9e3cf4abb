// StoreKernel's work on one row (token, head): the key's rotation (FWHT path) or its y (GEMM and
// MMA paths), bucketize, codes, corrected norm, the value's min-max codes, and the metadata, all
// written into the row's block slot. A function object holding references to the kernel's
// values, as the lambda it replaced did.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "quant/store_loads.cuh"
#include "quant/store_row_math.cuh"

namespace tqkv::store {
namespace {

template <int D, int KB, DType T, KeySource S, int N = kLaneElems>
struct KeyInput {
  static constexpr DType kType = (S == KeySource::kLoadY && KB != 8) ? DType::kF32 : T;
  using Raw = RawRow<kType, N>;
};

// Loads of one row (token, head): slot, key (or y and norm), value. y (fp32) is loaded as the
// warp's contiguous tile (the rows of a warp are consecutive) and rearranged by StoreRow.
template <int D, int KB, DType T, KeySource S, int E>
struct LoadedRow {
  typename KeyInput<D, KB, T, S, E>::Raw k;
  RawRow<T, E> v;
  int64_t slot;
  float norm;
  float factor;  // kMma: MmaRowScale::factor
};

// E elements per lane, G lanes per row; kMaxPairCopiesLog2: the pair table's interleaved copies.
template <int D, int KB, int VB, DType T, KeySource S, int E, bool kWideLayout,
          int kMaxPairCopiesLog2>
struct StoreRow {
  static constexpr int G = D / E;
  static constexpr bool kFp8 = KB == 8;
  static constexpr bool kLoadY = S == KeySource::kLoadY && !kFp8;
  static constexpr bool kMma = S == KeySource::kMma && !kFp8;
  static constexpr DType KT = KeyInput<D, KB, T, S>::kType;
  static constexpr bool kTensorFwht = kWideLayout;
  static constexpr int kMaxPairCopies = 1 << kMaxPairCopiesLog2;
  using Loaded = LoadedRow<D, KB, T, S, E>;

  const StoreParams& p;
  const BlockFormat& f;
  const int &tid, &q, &lane;
  uint4* const stage;  // kLoadY: this warp's y staging (TileToRows)
  float* const y_s;    // kMma: the y tile
  const int& num_heads;
  const uint32_t& sign_bits;
  const uint32_t (&hadamard_b)[2][2];  // kTensorFwht: this lane's H16 fragments
  const uint32_t& sign_spread;
  const int& pair_log2;
  const int& block_shift;
  // Shared-memory tables: bucketize cells, code-pair squares, midpoints.
  LutEntry* const lut_s;
  double* const pair_sq_s;
  float* const midpoints_s;

  // Quantizes and writes one row.
  __device__ __forceinline__ void operator()(const Loaded& in, int64_t token, int head) const {
    const int64_t slot = in.slot;
    if (slot >= p.num_slots && p.status != nullptr && head == 0 && q == 0) {
      atomicMax(&p.status->inverted_first_bad_token, ~static_cast<unsigned long long>(token));
      atomicAdd(&p.status->num_bad_tokens, 1ull);
    }
    const bool active = slot >= 0 && slot < p.num_slots;  // never write outside the cache
    // Block ids and offsets within a block fit 32 bits (ValidateStoreArguments checks the
    // cache: fewer than 2^32 blocks of fewer than 2^31 bytes), so a row's addresses are one
    // 32 x 32 -> 64-bit multiply-add from the block id (64-bit products cost ~35 instructions
    // per row).
    const uint32_t block = active ? static_cast<uint32_t>(slot >> block_shift) : 0u;
    const uint32_t pos = active ? static_cast<uint32_t>(slot) & (f.block_size - 1) : 0u;
    uint8_t* const block_base =
        p.cache + static_cast<uint64_t>(block) * static_cast<uint32_t>(f.block_bytes);
    const uint32_t dps = static_cast<uint32_t>(f.data_per_slot);
    uint8_t* const key_dst = block_base + (pos * static_cast<uint32_t>(num_heads) + head) * dps;

    float k[E], v[E];
    if constexpr (kLoadY) {
      typename KeyInput<D, KB, T, S, E>::Raw y;
      TileToRows<G>(in.k.w, stage, lane, y.w);
      ToFloat<KT>(y, k);
      if (p.y_factors != nullptr) {  // y of the scaled keys (replicate_scaled), as kMma's
#pragma unroll
        for (int i = 0; i < E; ++i) k[i] = __fmul_rn(k[i], in.factor);
      }
    } else if constexpr (kMma) {  // this row of the y tile (MmaTile), in LaneElement order
      const int r = tid / G;
      const float* const y_row = y_s + r * D;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = (j < 2 ? 2 * q : 2 * (q + G)) + (j & 1);
        const float4 y4 = *reinterpret_cast<const float4*>(y_row + 4 * YTileChunk(r, c));
        k[4 * j + 0] = __fmul_rn(y4.x, in.factor);
        k[4 * j + 1] = __fmul_rn(y4.y, in.factor);
        k[4 * j + 2] = __fmul_rn(y4.z, in.factor);
        k[4 * j + 3] = __fmul_rn(y4.w, in.factor);
      }
    } else if constexpr (!kTensorFwht) {  // the tensor-core FWHT reads the raw words
      ToFloat<KT>(in.k, k);
    }
    uint16_t meta0 = 0;  // k_norm (MSE)

    if constexpr (kFp8) {
      uint32_t packed[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(k[4 * j], k[4 * j + 1]),
                                                     __NV_SATFINITE, __NV_E4M3);
        const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(k[4 * j + 2], k[4 * j + 3]),
                                                     __NV_SATFINITE, __NV_E4M3);
        packed[j] = lo | (hi << 16);
      }
      if (active) {
        uint64_t* dst = reinterpret_cast<uint64_t*>(key_dst);  // chunks q and q + G
        dst[q] = packed[0] | (static_cast<uint64_t>(packed[1]) << 32);
        dst[q + G] = packed[2] | (static_cast<uint64_t>(packed[3]) << 32);
      }
    } else {
      float norm = in.norm;
      if constexpr (S == KeySource::kFwht) {
        // y = x̂ · Πᵀ = FWHT(x̂ ⊙ s) · fp32(1/√D), x̂ = k / (‖k‖ + 1e-8). The division is folded
        // into the final scale, y = FWHT(k ⊙ s) · (fp32(1/√D) / denom): a few ulp from the
        // reference's fp64 product, like any fp32 rotation. Keys whose sums could overflow fp32
        // are divided first instead.
        if constexpr (kTensorFwht) {
          norm = RowNorm<G>(in.k);
        } else {
          norm = RowNorm<G>(k);
        }
        const float denom = norm + 1e-8f;
        float post_scale = p.fwht_scale;
        bool transformed = false;
        if constexpr (kTensorFwht) {
          // On tensor cores when every row of the warp has a norm of 0 or in [1e-24, 1e36):
          // then no fp32 sum can overflow, and subnormal inputs (were they flushed) weigh < 2^-40
          // of the row. Other warps (inf / NaN / huge / tiny keys) take the fp32 butterflies.
          const bool plain = norm == 0.0f || (norm >= 1e-24f && norm < 1e36f);
          if (p.fwht_on_tensor_cores && __all_sync(kFullMask, plain)) {
            post_scale = __fdiv_rn(p.fwht_scale, denom);
            if (p.use_signs) {
              FwhtOnTensorCores<T, G, true>(in.k, sign_spread, hadamard_b, post_scale, k, q);
            } else {
              FwhtOnTensorCores<T, G, false>(in.k, sign_spread, hadamard_b, post_scale, k, q);
            }
            transformed = true;  // and scaled
          }
        }
        if (!transformed) {
          if constexpr (kTensorFwht) ToFloat<KT>(in.k, k);
          if (norm < 1e36f) {
            post_scale = __fdiv_rn(p.fwht_scale, denom);
          } else {
#pragma unroll
            for (int i = 0; i < E; ++i) k[i] = __fdiv_rn(k[i], denom);
          }
          if (p.use_signs) {
#pragma unroll
            for (int i = 0; i < E; ++i) {
              k[i] =
                  __uint_as_float(__float_as_uint(k[i]) ^ ((sign_bits << (31 - i)) & 0x80000000u));
            }
          }
          Fwht<G>(k, q);
#pragma unroll
          for (int i = 0; i < E; ++i) k[i] = __fmul_rn(k[i], post_scale);
        }
      }
      // Rows with a finite norm have |y| <= 1 (+ rounding): the lookup table's domain. NaN and
      // inf keys (NaN y) take the binary search, which sends NaN to 0 as the reference does.
      LaneCodes<KB, E / 8> codes;
      if (p.lut.cells > 0 && norm <= 3.4e38f) {
        // LutBucketize without its clamp (y is finite and |y| <= 1 + rounding here, inside the
        // table's ±kLutRange), the cell's byte address in one shift-add: t's bits are 0x4B400000
        // + cell, so (bits << 3) + (table address − (0x4B400000 << 3)) is the entry (mod 2^32).
        // The code is packed as base_index << s plus, if y passes the cell's midpoint, 1 << s.
        const uint32_t lut_biased = SmemAddr(lut_s) + p.lut_address_bias;
#pragma unroll
        for (int i = 0; i < E; ++i) {
          const float t = __fmaf_rn(k[i], p.lut.inv_step, p.lut.magic_bias);
          const uint32_t at = (static_cast<uint32_t>(__float_as_int(t)) << 3) + lut_biased;
          float next_midpoint;
          uint32_t base_index;
          asm("ld.shared.v2.b32 {%0, %1}, [%2];" : "=f"(next_midpoint), "=r"(base_index) : "r"(at));
          const int s = KB * (i % 8);  // constant after unrolling
          uint32_t& word = codes.w[i / 8];
          word += base_index << s;
          // + (1 << s) if y >= the cell's midpoint: one predicated add (the compiler makes it a
          // select and an add otherwise).
          asm("{\n .reg .pred p;\n setp.ge.f32 p, %1, %2;\n @p add.u32 %0, %0, %3;\n}\n"
              : "+r"(word)
              : "f"(k[i]), "f"(next_midpoint), "r"(1u << s));
        }
      } else {
#pragma unroll
        for (int i = 0; i < E; ++i) codes.Add(i, SearchBucketize(k[i], midpoints_s, KB));
      }
      double csum;
      if constexpr (kWideLayout) {
        csum = GroupSum<G>(CodeSquareSumFixedCopies<KB, E / 8, kMaxPairCopiesLog2>(
            codes, pair_sq_s, 8u * (lane & (kMaxPairCopies - 1))));
      } else {
        csum = GroupSum<G>(
            CodeSquareSum<KB>(codes, pair_sq_s + (lane & ((1 << pair_log2) - 1)), pair_log2));
      }
      StoreCodes<KB, G>(codes, q, active, key_dst);
      float stored =
          p.norm_correction ? static_cast<float>(double(norm) / sqrt(csum + 1e-16)) : norm;
      if (isnan(stored)) stored = 0.0f;  // NaN keys: a zero norm, never NaN metadata
      meta0 = __half_as_ushort(__float2half_rn(fminf(fmaxf(stored, -65504.0f), 65504.0f)));
    }

    float vmin, vmax;
    ToFloat<T>(in.v, v);
    LaneMinMax<T>(in.v, v, vmin, vmax);
    uint16_t scale_bits, zero_bits;
    LaneCodes<VB, E / 8> vcodes;
    QuantizeValues<G, VB>(v, vmin, vmax, vcodes, scale_bits, zero_bits);
    StoreCodes<VB, G>(vcodes, q, active, key_dst + f.key_data_bytes);

    // Metadata: lane q of the row writes field q (fp16 arrays [H][fields][block_size]).
    constexpr int kMeta = kFp8 ? 2 : 3;
    if (active && q < kMeta) {
      const MetaField first = kFp8 ? MetaField::kValueScale : MetaField::kKeyNorm;
      const uint16_t bits = kFp8 ? (q == 0 ? scale_bits : zero_bits)
                                 : (q == 0 ? meta0 : (q == 1 ? scale_bits : zero_bits));
      // f.MetaOffset(first, pos, head) + 2 q · block_size, in 32 bits.
      const uint32_t bs = static_cast<uint32_t>(f.block_size);
      const uint32_t at = static_cast<uint32_t>(f.meta_offset) +
                          2u * ((head * static_cast<uint32_t>(f.num_meta) +
                                 static_cast<uint32_t>(f.MetaFieldIndex(first)) + q) *
                                    bs +
                                pos);
      *reinterpret_cast<uint16_t*>(block_base + at) = bits;
    }
  }
};

}  // namespace
}  // namespace tqkv::store
