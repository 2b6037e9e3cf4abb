// Split-KV decode attention over paged caches: TurboQuant SoA blocks (4/3-bit codebook keys, FP8
// keys; 4/3-bit uniform values) and uncompressed bf16 blocks, plus the LSE merge and the query
// preparation (q·Πᵀ once per step).
//
// One CTA = (split of the context, KV head, sequence), 4 warps; it serves all query heads of the
// GQA group, so every compressed byte is read once. Each warp takes 16-token chunks in turn (a
// chunk never crosses a block: block sizes are multiples of 16) and runs both products on tensor
// cores with mma.sync m16n8k16:
//
//   scores  Sᵀ[token, head] = K̂[token, d] · Qᵀ[d, head]       (M = 16 tokens, N = 8 heads)
//   output  Oᵀ[d, head]    += Vcodesᵀ[d, token] · P'ᵀ[token, head]   (M = 16 d, N = 8 heads)
//
// A dot product does not care in which order its terms are summed, so each thread's fragment
// slots are mapped to the d's (and tokens) that make its loads contiguous: a thread reads whole
// 8- or 16-byte runs of one token's codes. The key codebook is applied through a shared-memory
// table indexed by a code pair (one 32-bit load gives the half2 the MMA wants), replicated per
// lane so that lookups never conflict. Values are never dequantized inside the loop:
// Σ_t p_t (code_t · scale_t + zero_t) = Σ_t (p_t · scale_t) · code_t + Σ_t p_t · zero_t, so the MMA
// multiplies exact integer codes (built as fp16 with the 1024 + code exponent trick) by p · scale,
// and the zero-point term is one scalar per head.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "attention/decode_launch.h"

namespace tqkv::decode_detail {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 16;     // tokens per MMA chunk
constexpr int kPtStride = 24;  // halves per row of the per-warp P'ᵀ tile (bank-conflict free)
constexpr float kLn2 = 0.69314718055994530942f;

// ------------------------------------------------------------------------------------------------
// Small device helpers

// f(std::integral_constant<int, I>{}) for I = 0 .. N-1, unrolled at compile time.
template <int N, typename F>
__device__ __forceinline__ void StaticFor(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }
  (std::make_integer_sequence<int, N>{});
}

__device__ __forceinline__ void MmaF16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two E4M3 bytes (low byte -> low half) to f16x2.
__device__ __forceinline__ uint32_t E4M3x2ToHalf2(uint32_t two_bytes) {
  uint32_t out;
  asm("{\n .reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;\n}\n"
      : "=r"(out)
      : "r"(two_bytes));
  return out;
}


// (x & mask) | bits in one LOP3 (both constants in registers; with immediates it takes two).
__device__ __forceinline__ uint32_t AndOr(uint32_t x, uint32_t mask, uint32_t bits) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(x), "r"(mask), "r"(bits));
  return r;
}

// half2(1024 + a, 1024 + b) - 1024 = half2(a, b), exact for the small integers a, b that sit in
// the mantissa bits of `biased` (fp16 0x6400 = 1024, whose mantissa unit is 1).
__device__ __forceinline__ uint32_t SubMagic(uint32_t biased) {
  const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&biased),
                            __halves2half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400)));
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Two small integer codes placed at bits 0 and 16, as half2.
__device__ __forceinline__ uint32_t CodesToHalf2(uint32_t codes_at_0_and_16) {
  return SubMagic(codes_at_0_and_16 | 0x64006400u);
}

__device__ __forceinline__ float HalfBitsToFloat(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

// Loads N bytes (a multiple of 2) from `src` into words, using the widest access that the
// guaranteed alignment A allows.
template <int N, int A>
__device__ __forceinline__ void LoadBytes(const uint8_t* src, uint32_t (&w)[(N + 3) / 4]) {
  if constexpr (A >= 16 && N % 16 == 0) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(src) + i);
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  } else if constexpr (A >= 8 && N % 8 == 0) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(src) + i);
      w[2 * i] = v.x;
      w[2 * i + 1] = v.y;
    }
  } else if constexpr (A >= 4 && N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) w[i] = __ldg(reinterpret_cast<const uint32_t*>(src) + i);
  } else if constexpr (A >= 2 && N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < (N + 3) / 4; ++i) w[i] = 0;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const uint32_t h = __ldg(reinterpret_cast<const unsigned short*>(src) + i);
      w[i / 2] |= h << (16 * (i % 2));
    }
  } else {
#pragma unroll
    for (int i = 0; i < (N + 3) / 4; ++i) w[i] = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) w[i / 4] |= uint32_t{__ldg(src + i)} << (8 * (i % 4));
  }
}

// `bits` bits starting at bit `pos` of a little-endian word array (compile-time pos).
template <int kPos, int kBits, int W>
__device__ __forceinline__ uint32_t Bits(const uint32_t (&w)[W]) {
  constexpr int kWord = kPos / 32;
  constexpr int kShift = kPos % 32;
  uint32_t v = w[kWord] >> kShift;
  if constexpr (kShift + kBits > 32 && kWord + 1 < W) v |= w[kWord + 1] << (32 - kShift);
  return v & ((1u << kBits) - 1u);
}

// ------------------------------------------------------------------------------------------------
// Key and value access per cache kind. Fragment conventions (PTX m16n8k16, lane = 4·g + t):
//   A: a0 = (row g, cols 2t..2t+1), a1 = (row g+8, cols 2t..), a2 = (row g, cols 2t+8..),
//      a3 = (row g+8, cols 2t+8..);   B: b0 = (rows 2t..2t+1, col g), b1 = (rows 2t+8.., col g);
//   C: c0,c1 = (row g, cols 2t, 2t+1), c2,c3 = (row g+8, cols 2t, 2t+1).
// Score MMA k-slot ↔ d: slot 2t+e of k-step s is d = (D/4)·t + 4s + e, slot 2t+8+e is ... + 2 + e.
// PV MMA row ↔ d: row g of m-tile mt is d0 = 2·((D/16)·g + mt) (4-bit / bf16) or (D/8)·g + 2mt
// (3-bit); row g+8 is d0 + 1.

template <KeyKind kKind, int kValueBits, int kD>
struct CacheTraits;

// Common to the compressed kinds: fp16 metadata, codes as MMA operands in fp16.
template <int kValueBits, int kD>
struct CompressedValues {
  static constexpr int kValueCodesPerThread = kD / 8;  // per token: 2 rows x D/16 m-tiles
  static constexpr int kValueBytes = kValueCodesPerThread * kValueBits / 8;
  static constexpr int kValueWords = (kValueBytes + 3) / 4;
  // Guaranteed alignment of a thread's value bytes (slot strides and key sizes of the presets).
  static constexpr int kValueAlign =
      kValueBits == 4 ? kValueBytes : (kD == 256 ? 4 : (kD == 128 ? 2 : 1));

  // 3-bit codes of m-tile mt for tokens (ta, tb): a half2 for row g (d0) and for row g+8 (d0+1).
  // (4-bit codes go through RowsPair.)
  template <int kMt>
  __device__ __forceinline__ static void Rows(const uint32_t (&wa)[kValueWords],
                                              const uint32_t (&wb)[kValueWords], uint32_t& row_g,
                                              uint32_t& row_g8) {
    static_assert(kValueBits == 3);
    const uint32_t ca0 = Bits<6 * kMt, 3>(wa), ca1 = Bits<6 * kMt + 3, 3>(wa);
    const uint32_t cb0 = Bits<6 * kMt, 3>(wb), cb1 = Bits<6 * kMt + 3, 3>(wb);
    row_g = CodesToHalf2(ca0 | (cb0 << 16));
    row_g8 = CodesToHalf2(ca1 | (cb1 << 16));
  }

  __device__ __forceinline__ static int D0(int g, int mt) {
    return kValueBits == 4 ? 2 * ((kD / 16) * g + mt) : (kD / 8) * g + 2 * mt;
  }

  // 4-bit codes: m-tiles kMt and kMt+1 (kMt even) at once. One byte-permute gathers bytes kMt,
  // kMt+1 of both tokens; low nibbles become the exact codes, high nibbles 16·code (masked in
  // place, no shift), so rows g+8 (odd d) carry a factor 16 that is removed at the end
  // (kOddRowScale).
  static constexpr float kOddRowScale = kValueBits == 4 ? 1.0f / 16.0f : 1.0f;
  template <int kMt>
  __device__ __forceinline__ static void RowsPair(const uint32_t (&wa)[kValueWords],
                                                  const uint32_t (&wb)[kValueWords],
                                                  uint32_t (&rows)[2][2], uint32_t mask_lo,
                                                  uint32_t mask_hi, uint32_t magic) {
    static_assert(kValueBits == 4 && kMt % 2 == 0);
    constexpr int j = kMt % 4;
    const uint32_t x = __byte_perm(wa[kMt / 4], wb[kMt / 4],
                                   j | ((j + 1) << 4) | ((4 + j) << 8) | ((5 + j) << 12));
    const uint32_t y = x >> 8;
    rows[0][0] = SubMagic(AndOr(x, mask_lo, magic));
    rows[0][1] = SubMagic(AndOr(x, mask_hi, magic));
    rows[1][0] = SubMagic(AndOr(y, mask_lo, magic));
    rows[1][1] = SubMagic(AndOr(y, mask_hi, magic));
  }
};

// The key codebook table: entry e (a pair of codes) of lane l at byte 256·e + 4·l, so a lookup
// address is one byte-permute of the packed codes with the lane offset (lane_off = 4·lane).
__device__ __forceinline__ uint32_t LutLoad(const uint8_t* lut, uint32_t byte_at_bits_8_15) {
  return *reinterpret_cast<const uint32_t*>(lut + byte_at_bits_8_15);
}

template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kMse4, kValueBits, kD> : CompressedValues<kValueBits, kD> {
  static constexpr bool kBf16 = false;
  static constexpr bool kHasNorm = true;
  static constexpr int kKeyBytes = kD / 8;  // 32 codes of 4 bits per thread (D = 128)
  static constexpr int kKeyWords = kKeyBytes / 4 + (kKeyBytes % 4 != 0);
  static constexpr int kKeyAlign = 16;
  static constexpr int kLutEntries = 256;  // code pairs
  __device__ __forceinline__ static uint32_t LutValue(int e, const uint16_t* c) {
    return uint32_t{c[e & 15]} | (uint32_t{c[e >> 4]} << 16);
  }
  // Address of the entry for byte kB of `w` plus lane_off: byte kB%4 of w to bits 8-15, the lane
  // offset (< 128, in the low byte of lane_off) to bits 0-7, zeros above.
  template <int kB>
  __device__ __forceinline__ static uint32_t Addr(uint32_t w, uint32_t lane_off) {
    return __byte_perm(w, lane_off, 0x7700 | ((kB % 4) << 4) | 4);
  }
  // A fragment of k-step s: rows g (words kg) and g+8 (words k8).
  template <int kS>
  __device__ __forceinline__ static void KeyFrag(const uint32_t (&kg)[kKeyWords],
                                                 const uint32_t (&k8)[kKeyWords],
                                                 const uint8_t* lut, uint32_t lane_off,
                                                 uint32_t (&a)[4]) {
    constexpr int kB0 = 2 * kS, kB1 = 2 * kS + 1;
    a[0] = LutLoad(lut, Addr<kB0>(kg[kB0 / 4], lane_off));
    a[1] = LutLoad(lut, Addr<kB0>(k8[kB0 / 4], lane_off));
    a[2] = LutLoad(lut, Addr<kB1>(kg[kB1 / 4], lane_off));
    a[3] = LutLoad(lut, Addr<kB1>(k8[kB1 / 4], lane_off));
  }
};

template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kMse3, kValueBits, kD> : CompressedValues<kValueBits, kD> {
  static constexpr bool kBf16 = false;
  static constexpr bool kHasNorm = true;
  static constexpr int kKeyBytes = 3 * kD / 32;  // 32 codes of 3 bits per thread (D = 128)
  static constexpr int kKeyWords = (kKeyBytes + 3) / 4;
  static constexpr int kKeyAlign = kD == 64 ? 2 : (kD == 128 ? 4 : 8);
  static constexpr int kLutEntries = 64;
  __device__ __forceinline__ static uint32_t LutValue(int e, const uint16_t* c) {
    return uint32_t{c[e & 7]} | (uint32_t{c[e >> 3]} << 16);
  }
  template <int kS>
  __device__ __forceinline__ static void KeyFrag(const uint32_t (&kg)[kKeyWords],
                                                 const uint32_t (&k8)[kKeyWords],
                                                 const uint8_t* lut, uint32_t lane_off,
                                                 uint32_t (&a)[4]) {
    a[0] = LutLoad(lut, (Bits<12 * kS, 6>(kg) << 8) | lane_off);
    a[1] = LutLoad(lut, (Bits<12 * kS, 6>(k8) << 8) | lane_off);
    a[2] = LutLoad(lut, (Bits<12 * kS + 6, 6>(kg) << 8) | lane_off);
    a[3] = LutLoad(lut, (Bits<12 * kS + 6, 6>(k8) << 8) | lane_off);
  }
};

template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kFp8, kValueBits, kD> : CompressedValues<kValueBits, kD> {
  static constexpr bool kBf16 = false;
  static constexpr bool kHasNorm = false;
  static constexpr int kKeyBytes = kD / 4;
  static constexpr int kKeyWords = kKeyBytes / 4;
  static constexpr int kKeyAlign = 16;
  static constexpr int kLutEntries = 0;
  __device__ __forceinline__ static uint32_t LutValue(int, const uint16_t*) { return 0; }
  template <int kS>
  __device__ __forceinline__ static void KeyFrag(const uint32_t (&kg)[kKeyWords],
                                                 const uint32_t (&k8)[kKeyWords], const uint8_t*,
                                                 uint32_t, uint32_t (&a)[4]) {
    a[0] = E4M3x2ToHalf2(kg[kS] & 0xFFFFu);
    a[1] = E4M3x2ToHalf2(k8[kS] & 0xFFFFu);
    a[2] = E4M3x2ToHalf2(kg[kS] >> 16);
    a[3] = E4M3x2ToHalf2(k8[kS] >> 16);
  }
};

template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kBf16, kValueBits, kD> {
  static constexpr float kOddRowScale = 1.0f;
  static constexpr bool kBf16 = true;
  static constexpr bool kHasNorm = false;
  static constexpr int kKeyBytes = kD / 2;  // D/4 bf16 elements per thread
  static constexpr int kKeyWords = kKeyBytes / 4;
  static constexpr int kKeyAlign = 16;
  static constexpr int kLutEntries = 0;
  static constexpr int kValueBytes = kD / 4;  // D/16 m-tiles x one word (2 elements)
  static constexpr int kValueWords = kValueBytes / 4;
  static constexpr int kValueAlign = 16;
  __device__ __forceinline__ static uint32_t LutValue(int, const uint16_t*) { return 0; }
  template <int kS>
  __device__ __forceinline__ static void KeyFrag(const uint32_t (&kg)[kKeyWords],
                                                 const uint32_t (&k8)[kKeyWords], const uint8_t*,
                                                 uint32_t, uint32_t (&a)[4]) {
    a[0] = kg[2 * kS];
    a[1] = k8[2 * kS];
    a[2] = kg[2 * kS + 1];
    a[3] = k8[2 * kS + 1];
  }
  template <int kMt>
  __device__ __forceinline__ static void Rows(const uint32_t (&wa)[kValueWords],
                                              const uint32_t (&wb)[kValueWords], uint32_t& row_g,
                                              uint32_t& row_g8) {
    row_g = __byte_perm(wa[kMt], wb[kMt], 0x5410);   // element d0 of both tokens
    row_g8 = __byte_perm(wa[kMt], wb[kMt], 0x7632);  // element d0 + 1
  }
  __device__ __forceinline__ static int D0(int g, int mt) { return 2 * ((kD / 16) * g + mt); }
};

// ------------------------------------------------------------------------------------------------
// The split kernel.

template <KeyKind kKind, int kValueBits, int kD, int kNTiles>
struct SplitKernelConfig {
  using Traits = CacheTraits<kKind, kValueBits, kD>;
  static constexpr int kKSteps = kD / 16;
  static constexpr int kMTiles = kD / 16;
  static constexpr int kLutBytes = Traits::kLutEntries * 256;
  static constexpr int kMergeBytes = (8 * kNTiles * kD + 3 * 8 * kNTiles * kWarps) * 4;
  static constexpr int kPtBytes = kWarps * kNTiles * 8 * kPtStride * 2;
  static constexpr int kSmemBytes = (kLutBytes > kMergeBytes ? kLutBytes : kMergeBytes) + kPtBytes;
};

template <KeyKind kKind, int kValueBits, int kD, int kNTiles>
__global__ void __launch_bounds__(kThreads) DecodeSplitKernel(const SplitParams p) {
  using Config = SplitKernelConfig<kKind, kValueBits, kD, kNTiles>;
  using Traits = typename Config::Traits;
  constexpr int kKSteps = Config::kKSteps;
  constexpr int kMTiles = Config::kMTiles;
  constexpr int kKW = Traits::kKeyWords;
  constexpr int kVW = Traits::kValueWords;

  extern __shared__ __align__(16) uint8_t smem[];
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int len = p.seq_lens[b];
  const int begin = split * p.tokens_per_split;
  if (begin >= len) return;  // the merge reads only splits that hold tokens
  const int end = min(begin + p.tokens_per_split, len);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int group = p.num_q_heads / p.num_kv_heads;

  // Key codebook table, one replica per lane (entry e of lane l at word 64·e + l).
  if constexpr (Traits::kLutEntries > 0) {
    uint32_t* lut_words = reinterpret_cast<uint32_t*>(smem);
    for (int i = threadIdx.x; i < Traits::kLutEntries * 32; i += kThreads) {
      lut_words[(i >> 5) * 64 + (i & 31)] = Traits::LutValue(i >> 5, p.centroids);
    }
  }
  uint16_t* pt = reinterpret_cast<uint16_t*>(smem + (Config::kSmemBytes - Config::kPtBytes) +
                                             warp * kNTiles * 8 * kPtStride * 2);

  // Query fragments (B operand of the score MMA), loaded once: head 8·nt + g. The compressed
  // kinds carry q as fp16 hi + lo parts (q ≈ hi + lo to ~2^-22), two MMAs per k-step, so that
  // scores keep fp32 accuracy; the bf16 kind uses the (bf16) query as given.
  constexpr int kQParts = Traits::kBf16 ? 1 : 2;
  const int64_t q_part_stride = static_cast<int64_t>(p.num_seqs) * p.num_q_heads * kD;
  uint32_t qf[kQParts][kNTiles][kKSteps][2];
#pragma unroll
  for (int part = 0; part < kQParts; ++part) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int head = 8 * nt + g;
      const uint16_t* q = p.query + part * q_part_stride +
                          (static_cast<int64_t>(b) * p.num_q_heads + h * group + head) * kD +
                          (kD / 4) * t;
#pragma unroll
      for (int s = 0; s < kKSteps; ++s) {
        qf[part][nt][s][0] = head < group ? *reinterpret_cast<const uint32_t*>(q + 4 * s) : 0u;
        qf[part][nt][s][1] = head < group ? *reinterpret_cast<const uint32_t*>(q + 4 * s + 2) : 0u;
      }
    }
  }
  __syncthreads();
  const uint32_t lane_off = 4u * lane;
  uint32_t kMaskLo, kMaskHi, kMagic;
  asm("mov.b32 %0, 0x000F000F;\n" : "=r"(kMaskLo));
  asm("mov.b32 %0, 0x00F000F0;\n" : "=r"(kMaskHi));
  asm("mov.b32 %0, 0x64006400;\n" : "=r"(kMagic));

  float acc[kMTiles][kNTiles][4];
  float m[kNTiles][2], l[kNTiles][2], z[kNTiles][2];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m[nt][i] = -INFINITY;
      l[nt][i] = 0.0f;
      z[nt][i] = 0.0f;
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
    }
  }

  const int num_chunks = (end - begin + kChunk - 1) / kChunk;
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq;
  // Per-thread byte offsets within a block (block_bytes < 2^31), computed once; per chunk only the
  // block pointer and the position change.
  const int stride_token =
      Traits::kBf16 ? 2 * p.num_kv_heads * kD : p.num_kv_heads * p.data_per_slot;
  const int head_off = Traits::kBf16 ? 2 * h * kD : h * p.data_per_slot;
  const int value_base = Traits::kBf16 ? static_cast<int>(p.meta_offset) : p.key_data_bytes;
  const int off_kg = head_off + Traits::kKeyBytes * t + g * stride_token;
  const int off_k8 = off_kg + 8 * stride_token;
  const int off_v = value_base + head_off + Traits::kValueBytes * g + 2 * t * stride_token;
  const int off_v8 = off_v + 8 * stride_token;
  const int off_meta = static_cast<int>(p.meta_offset) + 2 * (h * p.num_meta * p.block_size + g);
  const int meta_field = 2 * p.block_size;  // bytes between fields of one head
  const int block_shift = 31 - __clz(p.block_size);

  // Registers of one chunk.
  struct Chunk {
    uint32_t kg[kKW], k8[kKW];              // key bytes of tokens g and g+8
    uint32_t v[4][kVW];                     // value bytes of tokens 2t, 2t+1, 2t+8, 2t+9
    uint16_t norm[2], vscale[2], vzero[2];  // tokens g and g+8
  };
  auto load = [&](int c, Chunk& ck) {
    const int t0 = begin + c * kChunk;
    const uint32_t pos0 = t0 & (p.block_size - 1);
    const uint8_t* base =
        p.cache + static_cast<int64_t>(__ldg(table + (t0 >> block_shift))) * p.block_bytes;
    const uint8_t* at = base + pos0 * stride_token;
    LoadBytes<Traits::kKeyBytes, Traits::kKeyAlign>(at + off_kg, ck.kg);
    LoadBytes<Traits::kKeyBytes, Traits::kKeyAlign>(at + off_k8, ck.k8);
    LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v, ck.v[0]);
    LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v + stride_token, ck.v[1]);
    LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v8, ck.v[2]);
    LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v8 + stride_token, ck.v[3]);
    if constexpr (!Traits::kBf16) {
      const uint8_t* meta = base + off_meta + 2 * pos0;
      constexpr int kScaleField = Traits::kHasNorm ? 1 : 0;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint8_t* m_at = meta + 16 * i;  // token g + 8i
        ck.norm[i] =
            Traits::kHasNorm ? __ldg(reinterpret_cast<const unsigned short*>(m_at)) : uint16_t{0};
        ck.vscale[i] =
            __ldg(reinterpret_cast<const unsigned short*>(m_at + kScaleField * meta_field));
        ck.vzero[i] =
            __ldg(reinterpret_cast<const unsigned short*>(m_at + (kScaleField + 1) * meta_field));
      }
    }
  };

  auto compute = [&](int c, Chunk& cur) {
    const int t0 = begin + c * kChunk;
    const bool valid[2] = {t0 + g < end, t0 + g + 8 < end};

    // Scores Sᵀ[token, head] for tokens g, g+8 and heads 8·nt + 2t, +1.
    float s[kNTiles][4];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = 0.0f;
    }
    StaticFor<kKSteps>([&](auto ks_c) {
      constexpr int ks = decltype(ks_c)::value;
      uint32_t a[4];
      Traits::template KeyFrag<ks>(cur.kg, cur.k8, smem, lane_off, a);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        if constexpr (Traits::kBf16) {
          MmaBf16(s[nt], a, qf[0][nt][ks][0], qf[0][nt][ks][1]);
        } else {
          MmaF16(s[nt], a, qf[0][nt][ks][0], qf[0][nt][ks][1]);
          MmaF16(s[nt], a, qf[1][nt][ks][0], qf[1][nt][ks][1]);
        }
      }
    });
    float row_scale[2], vs[2], vz[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row_scale[i] =
          Traits::kHasNorm ? HalfBitsToFloat(cur.norm[i]) * p.score_scale : p.score_scale;
      vs[i] = Traits::kBf16 ? 1.0f : HalfBitsToFloat(cur.vscale[i]);
      vz[i] = Traits::kBf16 ? 0.0f : HalfBitsToFloat(cur.vzero[i]);
    }

    uint32_t pb[kNTiles][2];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      // s[nt][0..1]: token g, heads 2t, 2t+1; s[nt][2..3]: token g+8.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i / 2;
        s[nt][i] = valid[r] ? s[nt][i] * row_scale[r] : -INFINITY;
      }
      float mx[2] = {fmaxf(s[nt][0], s[nt][2]), fmaxf(s[nt][1], s[nt][3])};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 4));
        mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 8));
        mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 16));
      }
      // Rescale only when some head of the warp got a new maximum (rare after the first chunks).
      const bool grew = mx[0] > m[nt][0] || mx[1] > m[nt][1];
      if (__any_sync(0xffffffffu, grew)) {
        float corr[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float m_new = fmaxf(m[nt][j], mx[j]);
          corr[j] = m_new == -INFINITY ? 1.0f : exp2f(m[nt][j] - m_new);
          m[nt][j] = m_new;
          l[nt][j] *= corr[j];
          z[nt][j] *= corr[j];
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          acc[mt][nt][0] *= corr[0];
          acc[mt][nt][1] *= corr[1];
          acc[mt][nt][2] *= corr[0];
          acc[mt][nt][3] *= corr[1];
        }
      }
      float pw[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i / 2, j = i % 2;
        const float pr = valid[r] ? exp2f(s[nt][i] - m[nt][j]) : 0.0f;
        l[nt][j] += pr;
        if constexpr (!Traits::kBf16) z[nt][j] += valid[r] ? pr * vz[r] : 0.0f;
        pw[i] = valid[r] ? pr * vs[r] : 0.0f;
      }
      // P'ᵀ[head][token] into the warp's tile: head 2t+j, tokens g and g+8.
      uint16_t* tile = pt + nt * 8 * kPtStride;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i / 2, j = i % 2;
        const uint16_t bits = Traits::kBf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(pw[i]))
                                            : __half_as_ushort(__float2half_rn(pw[i]));
        tile[(2 * t + j) * kPtStride + g + 8 * r] = bits;
      }
    }
    __syncwarp();
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const uint16_t* tile = pt + nt * 8 * kPtStride + g * kPtStride;
      pb[nt][0] = *reinterpret_cast<const uint32_t*>(tile + 2 * t);
      pb[nt][1] = *reinterpret_cast<const uint32_t*>(tile + 2 * t + 8);
    }
    __syncwarp();

    // Bf16 values of tokens past the end may be NaN garbage; zero them (P' is 0 there, but
    // 0 · NaN is NaN). Codes of the compressed kinds are always finite.
    if constexpr (Traits::kBf16) {
      const bool vvalid[4] = {t0 + 2 * t < end, t0 + 2 * t + 1 < end, t0 + 2 * t + 8 < end,
                              t0 + 2 * t + 9 < end};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int w = 0; w < kVW; ++w) cur.v[i][w] = vvalid[i] ? cur.v[i][w] : 0u;
      }
    }
    // Oᵀ[d, head] += Vᵀ[d, token] · P'ᵀ[token, head].
    if constexpr (!Traits::kBf16 && kValueBits == 4) {
      StaticFor<kMTiles / 2>([&](auto pair_c) {
        constexpr int mt = 2 * decltype(pair_c)::value;
        uint32_t r01[2][2], r89[2][2];  // [m-tile][row g / g+8]
        Traits::template RowsPair<mt>(cur.v[0], cur.v[1], r01, kMaskLo, kMaskHi, kMagic);
        Traits::template RowsPair<mt>(cur.v[2], cur.v[3], r89, kMaskLo, kMaskHi, kMagic);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const uint32_t a[4] = {r01[k][0], r01[k][1], r89[k][0], r89[k][1]};
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) MmaF16(acc[mt + k][nt], a, pb[nt][0], pb[nt][1]);
        }
      });
    } else {
      StaticFor<kMTiles>([&](auto mt_c) {
        constexpr int mt = decltype(mt_c)::value;
        uint32_t a[4];
        Traits::template Rows<mt>(cur.v[0], cur.v[1], a[0], a[1]);
        Traits::template Rows<mt>(cur.v[2], cur.v[3], a[2], a[3]);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          if constexpr (Traits::kBf16) {
            MmaBf16(acc[mt][nt], a, pb[nt][0], pb[nt][1]);
          } else {
            MmaF16(acc[mt][nt], a, pb[nt][0], pb[nt][1]);
          }
        }
      });
    }
  };

  if constexpr (Traits::kBf16) {
    // A bf16 chunk is 4x the bytes of a compressed one: one buffer, and occupancy (more warps
    // per SM) keeps enough loads in flight.
    Chunk buf;
#pragma unroll 1
    for (int c = warp; c < num_chunks; c += kWarps) {
      load(c, buf);
      compute(c, buf);
    }
  } else {
    // Two register buffers in turn: the next chunk's loads are in flight while one is computed.
    Chunk buf0, buf1;
    int c = warp;
    if (c < num_chunks) load(c, buf0);
#pragma unroll 1
    for (; c < num_chunks; c += 2 * kWarps) {
      if (c + kWarps < num_chunks) load(c + kWarps, buf1);
      compute(c, buf0);
      if (c + kWarps >= num_chunks) break;
      if (c + 2 * kWarps < num_chunks) load(c + 2 * kWarps, buf0);
      compute(c + kWarps, buf1);
    }
  }

  // Row sums: l and z are per-thread partials over tokens g, g+8; m is already warp-uniform per
  // head column.
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

  // Merge the four warps through shared memory (the table is no longer needed).
  __syncthreads();
  constexpr int kHeads = 8 * kNTiles;
  float* acc_s = reinterpret_cast<float*>(smem);  // [kHeads][kD]
  float* stats = acc_s + kHeads * kD;             // [3][kWarps][kHeads]: m, l, z
  if (g == 0) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int head = 8 * nt + 2 * t + j;
        stats[(0 * kWarps + warp) * kHeads + head] = m[nt][j];
        stats[(1 * kWarps + warp) * kHeads + head] = l[nt][j];
        stats[(2 * kWarps + warp) * kHeads + head] = z[nt][j];
      }
    }
  }
  __syncthreads();
  float factor[kNTiles][2];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int head = 8 * nt + 2 * t + j;
      float mm = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, stats[w * kHeads + head]);
      factor[nt][j] = m[nt][j] == -INFINITY ? 0.0f : exp2f(m[nt][j] - mm);
    }
  }
#pragma unroll 1
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        const int d0 = Traits::D0(g, mt);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int head = 8 * nt + 2 * t + (i % 2);
            const int d = d0 + i / 2;
            const float v =
                acc[mt][nt][i] * factor[nt][i % 2] * (i < 2 ? 1.0f : Traits::kOddRowScale);
            float& dst = acc_s[head * kD + d];
            dst = (w == 0) ? v : dst + v;
          }
        }
      }
    }
    __syncthreads();
  }

  // Final: out[head][d] = (acc + z) / l, lse = (m + log2 l) · ln 2, for the group's heads.
  for (int i = threadIdx.x; i < group * kD; i += kThreads) {
    const int head = i / kD, d = i % kD;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, stats[w * kHeads + head]);
    float ll = 0.0f, zz = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = stats[w * kHeads + head];
      const float f = mw == -INFINITY ? 0.0f : exp2f(mw - mm);
      ll += f * stats[(kWarps + w) * kHeads + head];
      zz += f * stats[(2 * kWarps + w) * kHeads + head];
    }
    const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + h * group + head);
    p.partial_out[(row * p.max_splits + split) * kD + d] = (acc_s[head * kD + d] + zz) / ll;
    if (d == 0) p.partial_lse[row * p.max_splits + split] = (mm + log2f(ll)) * kLn2;
  }
}

// ------------------------------------------------------------------------------------------------
// Merge of the split partials by log-sum-exp; one CTA per (sequence, query head), one thread per d.

__global__ void DecodeMergeKernel(const MergeParams p) {
  const int row = blockIdx.x;  // b · Hq + hq
  const int b = row / p.num_q_heads;
  const int d = threadIdx.x;
  const int len = p.seq_lens[b];
  const int splits = (len + p.tokens_per_split - 1) / p.tokens_per_split;
  const float* lse = p.partial_lse + static_cast<int64_t>(row) * p.max_splits;
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, lse[s]);
  float total = 0.0f, acc = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float w = __expf(lse[s] - mx);
    total += w;
    acc += w * p.partial_out[(static_cast<int64_t>(row) * p.max_splits + s) * p.head_dim + d];
  }
  const float out = splits > 0 ? acc / total : 0.0f;
  const int64_t o = static_cast<int64_t>(row) * p.head_dim + d;
  if (p.out_dtype == 0) {
    static_cast<float*>(p.output)[o] = out;
  } else if (p.out_dtype == 1) {
    static_cast<__half*>(p.output)[o] = __float2half_rn(out);
  } else {
    static_cast<__nv_bfloat16*>(p.output)[o] = __float2bfloat16_rn(out);
  }
  if (d == 0) p.lse[row] = splits > 0 ? mx + logf(total) : -INFINITY;
}

// q·Πᵀ (or a plain conversion) for every (sequence, query head); one CTA per row.
__global__ void QueryPrepKernel(const QueryPrepParams p) {
  extern __shared__ float q_s[];
  const int row = blockIdx.x;
  const int n = p.head_dim;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t at = static_cast<int64_t>(row) * n + i;
    float v;
    if (p.in_dtype == 0) {
      v = static_cast<const float*>(p.query)[at];
    } else if (p.in_dtype == 1) {
      v = __half2float(static_cast<const __half*>(p.query)[at]);
    } else {
      v = __bfloat162float(static_cast<const __nv_bfloat16*>(p.query)[at]);
    }
    q_s[i] = v;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    float y;
    if (p.rotation != nullptr) {
      y = 0.0f;
      for (int i = 0; i < n; ++i) y = fmaf(q_s[i], p.rotation[static_cast<int64_t>(i) * n + j], y);
    } else {
      y = q_s[j];
    }
    const int64_t at = static_cast<int64_t>(row) * n + j;
    if (p.out_bf16) {
      p.out[at] = __bfloat16_as_ushort(__float2bfloat16_rn(y));
    } else {
      const __half hi = __float2half_rn(y);
      p.out[at] = __half_as_ushort(hi);
      p.out[static_cast<int64_t>(p.rows) * n + at] =
          __half_as_ushort(__float2half_rn(y - __half2float(hi)));
    }
  }
}

// Launch and occupancy of one instantiation of the split kernel.
template <KeyKind kKind, int kValueBits, int kD, int kNTiles>
struct SplitKernelOps {
  using Config = SplitKernelConfig<kKind, kValueBits, kD, kNTiles>;
  static constexpr auto kKernel = DecodeSplitKernel<kKind, kValueBits, kD, kNTiles>;

  // Shared memory above 48 KB must be opted into once per kernel.
  static cudaError_t Configure() {
    static const cudaError_t configured = cudaFuncSetAttribute(
        kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Config::kSmemBytes);
    return configured;
  }
  static cudaError_t Launch(const SplitParams& p, cudaStream_t stream) {
    if (const cudaError_t e = Configure(); e != cudaSuccess) return e;
    const dim3 grid(p.max_splits, p.num_kv_heads, p.num_seqs);
    kKernel<<<grid, kThreads, Config::kSmemBytes, stream>>>(p);
    return cudaGetLastError();
  }
  static cudaError_t CtasPerSm(int* ctas) {
    if (const cudaError_t e = Configure(); e != cudaSuccess) return e;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, kKernel, kThreads,
                                                         Config::kSmemBytes);
  }
};

// Calls fn(SplitKernelOps<...>{}) for the instantiation that serves (kind, value bits, D, group):
// the one place where runtime values become template arguments.
template <typename Fn>
cudaError_t Dispatch(KeyKind kind, int value_bits, int head_dim, int group, Fn&& fn) {
  if (group < 1 || group > 16) return cudaErrorInvalidValue;
  auto by_dim = [&]<KeyKind kKind, int kVB>() -> cudaError_t {
    auto by_tiles = [&]<int kD>() -> cudaError_t {
      return group <= 8 ? fn(SplitKernelOps<kKind, kVB, kD, 1>{})
                        : fn(SplitKernelOps<kKind, kVB, kD, 2>{});
    };
    switch (head_dim) {
      case 64: return by_tiles.template operator()<64>();
      case 128: return by_tiles.template operator()<128>();
      case 256: return by_tiles.template operator()<256>();
    }
    return cudaErrorInvalidValue;
  };
  switch (kind) {
    case KeyKind::kMse4:
      if (value_bits == 4) return by_dim.template operator()<KeyKind::kMse4, 4>();
      break;
    case KeyKind::kMse3:
      if (value_bits == 4) return by_dim.template operator()<KeyKind::kMse3, 4>();
      if (value_bits == 3) return by_dim.template operator()<KeyKind::kMse3, 3>();
      break;
    case KeyKind::kFp8:
      if (value_bits == 4) return by_dim.template operator()<KeyKind::kFp8, 4>();
      break;
    case KeyKind::kBf16:
      return by_dim.template operator()<KeyKind::kBf16, 16>();
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchDecodeSplits(const SplitParams& p, KeyKind kind, int value_bits, int head_dim,
                               int group, cudaStream_t stream) {
  return Dispatch(kind, value_bits, head_dim, group,
                  [&](auto ops) { return decltype(ops)::Launch(p, stream); });
}

cudaError_t DecodeSplitCtasPerSm(KeyKind kind, int value_bits, int head_dim, int group,
                                 int* ctas) {
  return Dispatch(kind, value_bits, head_dim, group,
                  [&](auto ops) { return decltype(ops)::CtasPerSm(ctas); });
}

cudaError_t LaunchDecodeMerge(const MergeParams& p, cudaStream_t stream) {
  DecodeMergeKernel<<<p.num_seqs * p.num_q_heads, p.head_dim, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchQueryPrep(const QueryPrepParams& p, cudaStream_t stream) {
  QueryPrepKernel<<<p.rows, p.head_dim, p.head_dim * sizeof(float), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace tqkv::decode_detail
