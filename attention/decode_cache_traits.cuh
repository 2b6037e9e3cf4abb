// How the split kernel reads each cache kind: per-thread key and value bytes, their alignment,
// and the MMA fragments built from them (CacheTraits<kind, value bits, D>).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "attention/decode_device.cuh"
#include "attention/decode_variant.h"

namespace tqkv::decode_detail {

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
    row_g = ca0 | (cb0 << 16);  // subnormal halves c · 2^-24
    row_g8 = ca1 | (cb1 << 16);
  }

  // 3-bit codes, the staged kernels' decode (SplitCompute): both tokens' codes of m-tiles 2j and
  // 2j + 1 in one word (window j: 16 bits of token a's run in the low half, of token b's in the
  // high half, from bit kWindowBit[j]), built once per chunk; then per m-tile one shift of its
  // window and two masks, row g + 8 masked in place (bits 3-5 of each half: 8·c · 2^-24, scaled
  // back by kStagedOddRowScale). Rows' shift and mask per code and token took twice the
  // instructions.
  static constexpr int kWindows = kD / 32;
  static constexpr int kWindowBit[4] = {0, 8, 24, 32};  // D = 64: the first two
  static constexpr float kStagedOddRowScale = kSubnormalScale / 8.0f;
  __device__ __forceinline__ static void RowWindows(const uint32_t (&wa)[kValueWords],
                                                    const uint32_t (&wb)[kValueWords],
                                                    uint32_t (&win)[kWindows]) {
    static_assert(kValueBits == 3 && (kD == 64 || kD == 128));
    win[0] = __byte_perm(wa[0], wb[0], 0x5410);  // bits 0-15
    win[1] = __byte_perm(wa[0], wb[0], 0x6521);  // bits 8-23
    if constexpr (kD == 128) {
      const uint32_t xa = __funnelshift_r(wa[0], wa[1], 24), xb = __funnelshift_r(wb[0], wb[1], 24);
      win[2] = __byte_perm(xa, xb, 0x5410);        // bits 24-39
      win[3] = __byte_perm(wa[1], wb[1], 0x5410);  // bits 32-47
    }
  }
  template <int kMt>
  __device__ __forceinline__ static void RowsOfWindow(const uint32_t (&win)[kWindows],
                                                      uint32_t& row_g, uint32_t& row_g8) {
    constexpr int kShift = 6 * kMt - kWindowBit[kMt / 2];
    static_assert(kShift >= 0 && kShift + 5 <= 15);
    const uint32_t y = win[kMt / 2] >> kShift;
    row_g = y & 0x00070007u;
    row_g8 = y & 0x00380038u;
  }

  __device__ __forceinline__ static int D0(int g, int mt) {
    return kValueBits == 4 ? 2 * ((kD / 16) * g + mt) : (kD / 8) * g + 2 * mt;
  }

  // 4-bit codes: m-tiles kMt and kMt+1 (kMt even) at once. One byte-permute gathers bytes kMt,
  // kMt+1 of both tokens; low nibbles become c · 2^-24, high nibbles (masked in place, no shift)
  // 16·c · 2^-24, so rows g (even d) and g+8 (odd d) are scaled back at the end (k*RowScale).
  static constexpr float kEvenRowScale = kSubnormalScale;
  static constexpr float kOddRowScale = kValueBits == 4 ? kSubnormalScale / 16.0f : kSubnormalScale;
  template <int kMt>
  __device__ __forceinline__ static void RowsPair(const uint32_t (&wa)[kValueWords],
                                                  const uint32_t (&wb)[kValueWords],
                                                  uint32_t (&rows)[2][2]) {
    static_assert(kValueBits == 4 && kMt % 2 == 0);
    constexpr int j = kMt % 4;
    const uint32_t x = __byte_perm(wa[kMt / 4], wb[kMt / 4],
                                   j | ((j + 1) << 4) | ((4 + j) << 8) | ((5 + j) << 12));
    const uint32_t y = x >> 8;
    rows[0][0] = x & 0x000F000Fu;
    rows[0][1] = x & 0x00F000F0u;
    rows[1][0] = y & 0x000F000Fu;
    rows[1][1] = y & 0x00F000F0u;
  }
};

// The key codebook table: entry e (a pair of codes) of lane l at byte 256·e + 8·(l mod 16) of
// dynamic shared memory, holding the fp16 pair (c_hi[e0], c_hi[e1]) and the pair of remainders
// (c_lo): a lookup address is one byte-permute of the packed codes with lane_word = (window top
// byte) | 8·(lane mod 16). 16 replicas suffice: lanes l and l + 16 share one but sit in different
// half-warp wavefronts of the 64-bit load (ncu: 0.3 % of shared-load wavefronts
// conflict). The second 128 bytes of every 256-byte row hold the staged kernels' stages 0-1.
// (The hi-only and half-precision kernels, Config::kHiTable, keep 32 replicas of the hi pair
// alone at 256·e + 4·l.)

template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kMse4, kValueBits, kD> : CompressedValues<kValueBits, kD> {
  static constexpr bool kPlain = false;
  static constexpr bool kHasNorm = true;
  static constexpr int kKeyBytes = kD / 8;  // 32 codes of 4 bits per thread (D = 128)
  static constexpr int kKeyWords = kKeyBytes / 4 + (kKeyBytes % 4 != 0);
  static constexpr int kKeyAlign = 16;
  static constexpr int kLutEntries = 256;  // code pairs
  // Address of the entry for byte kB of `w`: byte kB%4 of w to bits 8-15, bytes 0, 2, 3 of
  // lane_word (8·(lane mod 16); 0; the window's top byte) around it.
  template <int kB>
  __device__ __forceinline__ static uint32_t Addr(uint32_t w, uint32_t lane_word) {
    return __byte_perm(w, lane_word, 0x7604 | ((kB % 4) << 4));
  }
  // A fragment of k-step s for one token (words w): row g = hi parts, row g + 8 = lo parts.
  template <int kS>
  __device__ __forceinline__ static void KeyFragHiLo(const uint32_t (&w)[kKeyWords],
                                                     uint32_t lane_word, uint32_t (&a)[4]) {
    constexpr int kB0 = 2 * kS, kB1 = 2 * kS + 1;
    LutLoad(Addr<kB0>(w[kB0 / 4], lane_word), a[0], a[1]);
    LutLoad(Addr<kB1>(w[kB1 / 4], lane_word), a[2], a[3]);
  }
  // The half-precision kernels' A fragment of k-step s for two tokens (words wg: row g, w8: row
  // g + 8): c_hi pairs.
  template <int kS>
  __device__ __forceinline__ static void KeyFragHi(const uint32_t (&wg)[kKeyWords],
                                                   const uint32_t (&w8)[kKeyWords],
                                                   uint32_t lane_word, uint32_t (&a)[4]) {
    constexpr int kB0 = 2 * kS, kB1 = 2 * kS + 1;
    a[0] = LutLoadHi(Addr<kB0>(wg[kB0 / 4], lane_word));
    a[1] = LutLoadHi(Addr<kB0>(w8[kB0 / 4], lane_word));
    a[2] = LutLoadHi(Addr<kB1>(wg[kB1 / 4], lane_word));
    a[3] = LutLoadHi(Addr<kB1>(w8[kB1 / 4], lane_word));
  }
};

template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kMse3, kValueBits, kD> : CompressedValues<kValueBits, kD> {
  static constexpr bool kPlain = false;
  static constexpr bool kHasNorm = true;
  static constexpr int kKeyBytes = 3 * kD / 32;  // 32 codes of 3 bits per thread (D = 128)
  static constexpr int kKeyWords = (kKeyBytes + 3) / 4;
  static constexpr int kKeyAlign = kD == 64 ? 2 : (kD == 128 ? 4 : 8);
  static constexpr int kLutEntries = 64;
  template <int kS>
  __device__ __forceinline__ static void KeyFragHiLo(const uint32_t (&w)[kKeyWords],
                                                     uint32_t lane_word, uint32_t (&a)[4]) {
    LutLoad(((Bits<12 * kS, 6>(w) << 8) | lane_word), a[0], a[1]);
    LutLoad(((Bits<12 * kS + 6, 6>(w) << 8) | lane_word), a[2], a[3]);
  }
  // Hi-only A fragment of k-step s for two tokens (words wg: row g, w8: row g + 8): c_hi pairs.
  template <int kS>
  __device__ __forceinline__ static void KeyFragHi(const uint32_t (&wg)[kKeyWords],
                                                   const uint32_t (&w8)[kKeyWords],
                                                   uint32_t lane_word, uint32_t (&a)[4]) {
    a[0] = LutLoadHi((Bits<12 * kS, 6>(wg) << 8) | lane_word);
    a[1] = LutLoadHi((Bits<12 * kS, 6>(w8) << 8) | lane_word);
    a[2] = LutLoadHi((Bits<12 * kS + 6, 6>(wg) << 8) | lane_word);
    a[3] = LutLoadHi((Bits<12 * kS + 6, 6>(w8) << 8) | lane_word);
  }
};

template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kFp8, kValueBits, kD> : CompressedValues<kValueBits, kD> {
  static constexpr bool kPlain = false;
  static constexpr bool kHasNorm = false;
  static constexpr int kKeyBytes = kD / 4;
  static constexpr int kKeyWords = kKeyBytes / 4;
  static constexpr int kKeyAlign = 16;
  static constexpr int kLutEntries = 0;
  template <int kS>
  __device__ __forceinline__ static void KeyFrag(const uint32_t (&kg)[kKeyWords],
                                                 const uint32_t (&k8)[kKeyWords],
                                                 uint32_t (&a)[4]) {
    a[0] = E4M3x2ToHalf2(kg[kS]);
    a[1] = E4M3x2ToHalf2(k8[kS]);
    a[2] = E4M3x2HiToHalf2(kg[kS]);
    a[3] = E4M3x2HiToHalf2(k8[kS]);
  }
};

template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kBf16, kValueBits, kD> {
  static constexpr float kEvenRowScale = 1.0f;
  static constexpr float kOddRowScale = 1.0f;
  static constexpr bool kPlain = true;  // uncompressed 16-bit K and V
  static constexpr bool kFp16 = false;  // bf16 elements (CacheTraits<kF16>: fp16)
  static constexpr bool kHasNorm = false;
  static constexpr int kKeyBytes = kD / 2;  // D/4 bf16 elements per thread
  static constexpr int kKeyWords = kKeyBytes / 4;
  static constexpr int kKeyAlign = 16;
  static constexpr int kLutEntries = 0;
  static constexpr int kValueBytes = kD / 4;  // D/16 m-tiles x one word (2 elements)
  static constexpr int kValueWords = kValueBytes / 4;
  static constexpr int kValueAlign = 16;
  template <int kS>
  __device__ __forceinline__ static void KeyFrag(const uint32_t (&kg)[kKeyWords],
                                                 const uint32_t (&k8)[kKeyWords],
                                                 uint32_t (&a)[4]) {
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

// Uncompressed fp16 K and V: the bf16 kind's layout and loads, fp16 MMAs.
template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kF16, kValueBits, kD> : CacheTraits<KeyKind::kBf16, kValueBits, kD> {
  static constexpr bool kFp16 = true;
};

}  // namespace tqkv::decode_detail
