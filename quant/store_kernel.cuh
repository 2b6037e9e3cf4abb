// StoreKernel: one launch quantizes K/V rows into the SoA blocks (every path but the GEMM's
// normalize step). Instantiated per head_dim by store_kernels_d{64,128,256}.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "quant/store_loads.cuh"
#include "quant/store_row_math.cuh"

namespace tqkv::store {
namespace {

// ---------------------------------------------------------------------------------------------
// The store kernel: one launch writes codes and metadata of every row. A persistent grid (as many
// CTAs as fit at once) walks the rows in chunks of kRows; each iteration loads the next chunk's
// inputs before it computes the current one.
//   KB: key bits (8 = FP8 E4M3 keys; 3 or 4 = MSE codes), VB: value bits.

template <int D, int KB, DType T, KeySource S, int N = kLaneElems>
struct KeyInput {
  static constexpr DType kType = (S == KeySource::kLoadY && KB != 8) ? DType::kF32 : T;
  using Raw = RawRow<kType, N>;
};

// The store kernel's layouts: kNarrow (16 elements per lane, 256-thread CTAs; every path) and, for
// the FWHT path with 16-bit inputs, kWide.
enum class StoreLayout { kNarrow, kWide };

// The wide FWHT kernel (StoreLayout::kWide): E = 32 elements per lane instead of 16,
// so G = D / 32 lanes per row, a warp holds twice the rows, and every per-row step (reductions,
// norm, divisions, norm correction, value range, metadata) is shared by half as many lanes; one
// cross-lane FWHT stage fewer. 22 % fewer instructions than the narrow kernel at D = 128; it needs
// 128 registers, so it runs 128-thread CTAs, four per SM (at 96 registers for five it spilled and
// was slower). The default for the FWHT path with 16-bit inputs at D = 128 and 256.
inline constexpr StoreLayout kWide = StoreLayout::kWide;
inline constexpr int64_t kWideMinRows = 32768;
template <StoreLayout kLayout>
inline constexpr int kLaneElemsFor = kLayout == kWide ? 32 : kLaneElems;
template <StoreLayout kLayout>
inline constexpr int kCtaThreadsFor = kLayout == kWide ? 128 : kThreads;
inline constexpr int kWideTileVecs = 128;  // 16-byte vectors of one tensor's warp tile (2 KB)
inline constexpr int kWideTileBytes = kCtaThreadsFor<kWide> / 32 * 2 * kWideTileVecs * 16;

// Minimum CTAs per SM the kernel is compiled for (register budget): the MSE kernels need 80
// registers for three CTAs (24 warps) per SM, which hides their dependency chains (shuffles,
// lookups, fp64 sums) better than two CTAs of 100+ registers; FP8 needs no bound; the wide kernel
// (kWide) four 128-thread CTAs.
constexpr int MinCtasPerSm(int key_bits, KeySource source, StoreLayout layout) {
  if (source == KeySource::kMma && key_bits != 8) return 2;  // ~100 KB of shared memory each
  if (layout == kWide) return 4;  // 128-thread CTAs (kCtaThreadsFor): 128 registers
  return key_bits == 8 ? 1 : 3;
}

template <int D, int KB, int VB, DType T, KeySource S, StoreLayout kLayout>
__global__ void __launch_bounds__(kCtaThreadsFor<kLayout>, MinCtasPerSm(KB, S, kLayout))
    StoreKernel(const StoreParams p) {
  constexpr int kThreads = kCtaThreadsFor<kLayout>;  // this kernel's CTA size
  constexpr int E = kLaneElemsFor<kLayout>;          // elements per lane
  constexpr int G = D / E;                           // lanes per row
  constexpr int kRows = kThreads / G;                // rows per CTA and iteration
  static_assert(kLayout != kWide || (S == KeySource::kFwht && KB != 8 && T != DType::kF32));
  constexpr bool kFp8 = KB == 8;
  constexpr bool kLoadY = S == KeySource::kLoadY && !kFp8;
  constexpr bool kMma = S == KeySource::kMma && !kFp8;
  constexpr DType KT = KeyInput<D, KB, T, S>::kType;
  constexpr int kPairs = kFp8 ? 1 : 1 << (2 * KB);
  using Tiles = MmaTiles<D, T>;

  __shared__ LutEntry lut_s[kFp8 ? 1 : (kLayout == kWide ? kWideLutCells : kMaxLutCells)];
  // The pair table, for large stores (StoreParams::pair_copies_log2) in 16 interleaved copies,
  // lane l reading copy l % 16: the 8-byte lookups of a half-warp then hit 16 distinct bank pairs
  // (one copy: ~5-way conflicts on random codes). Only the FWHT kernel: the MMA kernels spend
  // their shared memory on the rotation tiles, and the y-reading kernel's y staging would take its
  // static shared memory past 48 KB.
  constexpr int kMaxPairCopiesLog2 = S == KeySource::kFwht ? 4 : 0;
  constexpr int kMaxPairCopies = 1 << kMaxPairCopiesLog2;
  // The wide kernel (large stores only) always fills the 16 copies: its lookups then address
  // them with compile-time shifts (CodeSquareSumFixedCopies).
  const int pair_log2 = kLayout == kWide     ? kMaxPairCopiesLog2
                        : kMaxPairCopies > 1 ? min(p.pair_copies_log2, kMaxPairCopiesLog2)
                                             : 0;
  __shared__ double pair_sq_s[kPairs * kMaxPairCopies];
  __shared__ double centroid_sq_s[kMaxCodebookSize];
  __shared__ float midpoints_s[kMaxCodebookSize];
  __shared__ uint4 stage_s[kLoadY ? kThreads / 32 * kTileVecs : 1];  // y tiles (TileToRows)
  // kMma: Πᵀ hi/lo, the key tile and the y tile (MmaTiles), in dynamic shared memory.
  extern __shared__ uint4 mma_s[];
  uint8_t* const rot_s = reinterpret_cast<uint8_t*>(mma_s);
  uint8_t* const key_s = rot_s + Tiles::kRotationBytes;
  float* const y_s = reinterpret_cast<float*>(key_s + Tiles::kKeyBytes);
  // The wide kernel's input tiles (kWideTileBytes of dynamic shared memory): per warp, the next
  // key and value rows (2 KB each), copied in by cp.async one iteration ahead (WideTileSlot).
  uint4* const tile_s = mma_s;

  const BlockFormat& f = p.format;
  const int tid = threadIdx.x;
  const int q = tid % G;
  const int lane = tid % 32;
  uint4* const stage = stage_s + (kLoadY ? tid / 32 * kTileVecs : 0);
  const int num_heads = f.num_kv_heads;
  const int64_t rows = p.num_tokens * num_heads;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRows;

  if constexpr (!kFp8) {
    if constexpr (kMma) {  // Πᵀ hi/lo into the swizzled tile (HalfTileChunk)
      constexpr int kRowChunks = D / 8, kChunks = 2 * D * kRowChunks;
      const uint4* const src = reinterpret_cast<const uint4*>(p.rotation_f16);
      for (int i = tid; i < kChunks; i += kThreads) {
        const int row = i / kRowChunks, c = i % kRowChunks;  // row: split · D + n
        mma_s[row * kRowChunks + HalfTileChunk(row, c)] = __ldg(src + i);
      }
    }
    for (int i = tid; i < p.lut.cells; i += kThreads) lut_s[i] = p.tables->lut[i];
    for (int i = tid; i < (kPairs << pair_log2); i += kThreads) {
      pair_sq_s[i] = p.tables->pair_sq[i >> pair_log2];
    }
    if (tid < kMaxCodebookSize) {
      centroid_sq_s[tid] = p.tables->centroid_sq[tid];
      midpoints_s[tid] = p.tables->midpoints[tid];
    }
    __syncthreads();
  }
  uint32_t sign_bits = 0;
  if constexpr (S == KeySource::kFwht && !kFp8) {
    if (p.use_signs) {  // bit e = the sign of element LaneElement(q, e, G)
#pragma unroll
      for (int c = 0; c < E / 8; ++c) {
        const int j = 8 * (q + c * G);
        sign_bits |= ((__ldg(p.tables->sign_bits + j / 32) >> (j % 32)) & 0xFFu) << (8 * c);
      }
    }
  }
  // The wide kernel's FWHT on tensor cores (FwhtOnTensorCores): this lane's H16 fragments and
  // its sign bits spread over the 16-bit words.
  constexpr bool kTensorFwht = kLayout == kWide;
  uint32_t hadamard_b[2][2] = {};
  uint32_t sign_spread = 0;
  if constexpr (kTensorFwht) {
    constexpr uint32_t kOne = T == DType::kBF16 ? 0x3F80u : 0x3C00u;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int r = 0; r < 2; ++r) hadamard_b[j][r] = HadamardFragment(lane, j, r, kOne);
    }
    sign_spread = SpreadPairSigns(sign_bits);
  }
  const int block_shift = __ffs(f.block_size) - 1;  // block sizes are powers of two

  // Loads of one row (token, head): slot, key (or y and norm), value. y (fp32) is loaded as the
  // warp's contiguous tile (the rows of a warp are consecutive) and rearranged by `process`.
  struct Loaded {
    typename KeyInput<D, KB, T, S, E>::Raw k;
    RawRow<T, E> v;
    int64_t slot;
    float norm;
    float factor;  // kMma: MmaRowScale::factor
  };
  auto load = [&](int64_t token, int head, Loaded& n) {
    const bool in_range = token < p.num_tokens;
    const int64_t row = token * num_heads + head;
    const int64_t row_elem = row * D;
    n.slot = in_range ? LoadSlot(p, token) : -1;
    if constexpr (kLoadY) {
      LoadTile<D>(p.y, row - lane / G, rows, lane, n.k.w);
      n.norm = in_range ? __ldg(p.norms + row) : 0.0f;
      n.factor = p.y_factors != nullptr && in_range ? __ldg(p.y_factors + row) : 0.0f;
    } else {
      LoadRaw<KT, G>(p.key, row_elem, q, in_range, n.k);
      n.norm = 0.0f;
    }
    if constexpr (!kLoadY) n.factor = 0.0f;
    LoadRaw<T, G>(p.value, row_elem, q, in_range, n.v);
  };

  // Quantizes and writes one row.
  auto process = [&](const Loaded& in, int64_t token, int head) {
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
      if constexpr (kLayout == kWide) {
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
  };

  // Rows advance by `stride` per iteration; (token, head) is carried along, so the kernel divides
  // by the head count only here. The loop runs over chunks (uniform in the CTA), so the shuffles
  // stay convergent.
  const int64_t num_chunks = (rows + kRows - 1) / kRows;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kRows + tid / G;
  int64_t token = first_row / num_heads;
  int head = static_cast<int>(first_row - token * num_heads);
  const int64_t stride_tokens = stride / num_heads;
  const int stride_heads = static_cast<int>(stride - stride_tokens * num_heads);
  auto advance = [&](int64_t& t, int& h) {
    t += stride_tokens;
    h += stride_heads;
    if (h >= num_heads) {
      h -= num_heads;
      ++t;
    }
  };
  if constexpr (kMma) {
    // Per chunk: the norm and scaling of each row and its fp16 key into the key tile; the next
    // chunk's loads; the tile's y on tensor cores into the y tile; then `process` per row.
    const int r = tid / G;  // row of the tile
    auto prepare = [&](Loaded& in) {
      float kf[kLaneElems];
      ToFloat<T>(in.k, kf);
      in.norm = RowNorm<G>(kf);
      const MmaRowScale sc = MmaScaleForNorm(in.norm);
      in.factor = sc.factor;
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // chunks q and q + G of the row
        uint32_t hi[4], lo[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float a = __fmul_rn(kf[8 * h + 2 * j], sc.up);
          const float b = __fmul_rn(kf[8 * h + 2 * j + 1], sc.up);
          const __half2 hh = __floats2half2_rn(a, b);
          memcpy(&hi[j], &hh, 4);
          if constexpr (Tiles::kKeyParts == 2) {
            const float2 back = __half22float2(hh);
            const __half2 hl = __floats2half2_rn(__fsub_rn(a, back.x), __fsub_rn(b, back.y));
            memcpy(&lo[j], &hl, 4);
          }
        }
        const int c = HalfTileChunk(r, q + h * G);
        uint4* const dst = reinterpret_cast<uint4*>(key_s) + r * (D / 8) + c;
        *dst = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        if constexpr (Tiles::kKeyParts == 2) {
          dst[kRows * (D / 8)] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        }
      }
    };
    // Warp w computes rows [32 (w / (D / 16)), +32) × columns [16 (w % (D / 16)), +16) of the
    // tile: 2 × 2 m16n8 tiles, D / 16 k-steps of 2 (fp32 keys: 3) MMAs per tile.
    auto mma_tile = [&]() {
      constexpr int kWarpCols = D / 16;
      static_assert(kRows == 32 * (8 / kWarpCols), "8 warps of 32 rows x 16 columns");
      const int warp = tid / 32;
      const int row0 = 32 * (warp / kWarpCols), col0 = 16 * (warp % kWarpCols);
      float acc[2][2][4] = {};
      const uint32_t rot_base = SmemAddr(rot_s), key_base = SmemAddr(key_s);
#pragma unroll 2
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[Tiles::kKeyParts][2][4];
#pragma unroll
        for (int part = 0; part < Tiles::kKeyParts; ++part) {
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            const int row = row0 + 16 * mt + (lane & 15);
            const int c = HalfTileChunk(row, 2 * ks + (lane >> 4));
            LdMatrix4(key_base + ((part * kRows + row) * (D / 8) + c) * 16, a[part][mt]);
          }
        }
        uint32_t b[2][4];  // per n-tile: hi (k 0-7, 8-15), lo (k 0-7, 8-15)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int n = col0 + 8 * nt + (lane & 7);
          const int row = (lane >> 4) * D + n;  // split · D + n
          const int c = HalfTileChunk(row, 2 * ks + ((lane >> 3) & 1));
          LdMatrix4(rot_base + (row * (D / 8) + c) * 16, b[nt]);
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            MmaF16(acc[mt][nt], a[0][mt], b[nt][2], b[nt][3]);  // hi key · lo Πᵀ
            if constexpr (Tiles::kKeyParts == 2) {
              MmaF16(acc[mt][nt], a[1][mt], b[nt][0], b[nt][1]);  // lo key · hi Πᵀ
            }
            MmaF16(acc[mt][nt], a[0][mt], b[nt][0], b[nt][1]);  // hi key · hi Πᵀ
          }
        }
      }
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int n = col0 + 8 * nt + 2 * t;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = row0 + 16 * mt + g + 8 * h;
            float* const dst = y_s + row * D + 4 * YTileChunk(row, n / 4) + n % 4;
            *reinterpret_cast<float2*>(dst) =
                make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
          }
        }
      }
    };
    Loaded cur;
    load(token, head, cur);
    for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
      prepare(cur);
      int64_t next_token = token;
      int next_head = head;
      advance(next_token, next_head);
      Loaded next;
      load(next_token, next_head, next);  // past the end: no loads (slot -1)
      __syncthreads();                    // key tile written
      mma_tile();
      __syncthreads();  // y tile written (and the key tile read)
      process(cur, token, head);
      cur = next;
      token = next_token;
      head = next_head;
    }
  } else if constexpr (kLayout == kWide) {
    // The warp's rows are consecutive, so its key rows (and value rows) are one contiguous 2 KB
    // tile: cp.async copies the next iteration's tiles into the warp's shared buffers, lane L
    // taking vectors L, L + 32, L + 64, L + 96 (512 contiguous bytes per instruction: whole lines,
    // half the L2 requests of direct 16-byte loads at 4 lanes per row), while this iteration
    // computes. At the top of an iteration the lanes read their chunks from the buffers.
    static_assert(E * 32 / 8 == kWideTileVecs && T != DType::kF32);
    constexpr int kRowVecs = D / 8;                              // 16-byte vectors per row
    uint4* const tiles = tile_s + tid / 32 * 2 * kWideTileVecs;  // keys, then values
    const uint32_t tiles_addr = SmemAddr(tiles);
    // Vector v = lane + 32 i has slot WideTileSlot(lane) + 32 i (bit 4 of v is bit 4 of lane), so
    // a whole tile is 8 copies at immediate offsets from three addresses; only the last tile of
    // the store checks its rows.
    const uint32_t lane_dst = tiles_addr + 16 * WideTileSlot(lane);
    auto issue = [&](int64_t t, int h) {
      const int64_t row0 = t * num_heads + h - lane / G;  // the warp's first row
      if (row0 + kWideTileVecs / kRowVecs <= rows) {
        const int64_t at = row0 * (D * 2) + 16 * lane;
        const uint8_t* const k_src = static_cast<const uint8_t*>(p.key) + at;
        const uint8_t* const v_src = static_cast<const uint8_t*>(p.value) + at;
#pragma unroll
        for (int i = 0; i < kWideTileVecs / 32; ++i) {
          CpAsync16(lane_dst + 512 * i, k_src + 512 * i);
          CpAsync16(lane_dst + 16 * kWideTileVecs + 512 * i, v_src + 512 * i);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kWideTileVecs / 32; ++i) {
          const int v = lane + 32 * i;
          const bool valid = row0 + v / kRowVecs < rows;
          const int64_t at = valid ? row0 * D * 2 + 16 * v : 0;
          const uint32_t dst = tiles_addr + 16 * WideTileSlot(v);
          CpAsync16(dst, static_cast<const uint8_t*>(p.key) + at, valid);
          CpAsync16(dst + 16 * kWideTileVecs, static_cast<const uint8_t*>(p.value) + at, valid);
        }
      }
      CpAsyncCommit();
    };
    issue(token, head);
    int64_t slot = token < p.num_tokens ? LoadSlot(p, token) : -1;
    for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
      CpAsyncWaitAll();
      __syncwarp();
      Loaded a;
#pragma unroll
      for (int c = 0; c < E / 8; ++c) {
        const int v = WideTileSlot((lane / G) * kRowVecs + q + c * G);
        a.k.w[c] = tiles[v];
        a.v.w[c] = tiles[kWideTileVecs + v];
      }
      a.slot = slot;
      a.norm = 0.0f;
      a.factor = 0.0f;
      __syncwarp();  // every lane has read the buffers
      int64_t next_token = token;
      int next_head = head;
      advance(next_token, next_head);
      if (chunk + gridDim.x < num_chunks) issue(next_token, next_head);  // uniform in the CTA
      slot = next_token < p.num_tokens ? LoadSlot(p, next_token) : -1;
      process(a, token, head);
      token = next_token;
      head = next_head;
    }
  } else {
    // Loads at the top of each iteration; other warps (three or more CTAs per SM) cover them.
    // The next chunk's key and value rows are prefetched into L2 meanwhile (each lane one or two
    // 32-byte sectors of each), so its loads wait for L2, not DRAM.
    constexpr int kElemBytes = T == DType::kF32 ? 4 : 2;
    constexpr int kLaneBytes = E * kElemBytes;  // this lane's share of a row
    for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
      Loaded a;
      load(token, head, a);
      if constexpr (kLayout == StoreLayout::kNarrow && S != KeySource::kLoadY) {
        int64_t next_token = token;
        int next_head = head;
        advance(next_token, next_head);
        if (next_token < p.num_tokens) {
          const int64_t at =
              (next_token * num_heads + next_head) * (D * kElemBytes) + q * kLaneBytes;
#pragma unroll
          for (int s = 0; s < kLaneBytes; s += 32) {
            asm volatile(
                "prefetch.global.L2 [%0];" ::"l"(static_cast<const uint8_t*>(p.key) + at + s));
            asm volatile(
                "prefetch.global.L2 [%0];" ::"l"(static_cast<const uint8_t*>(p.value) + at + s));
          }
        }
      }
      process(a, token, head);
      advance(token, head);
    }
  }
}

}  // namespace
}  // namespace tqkv::store
