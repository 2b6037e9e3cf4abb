// The split kernel's work on one chunk (DecodeSplitKernel's `compute`): the score MMAs, the online
// softmax (lazy maximum; packed or unpacked heads) and the P·V MMAs. A function object holding
// references to the kernel's running state, as a lambda capturing them would.
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

// Registers of one chunk.
template <typename Traits>
struct SplitChunk {
  uint32_t kg[Traits::kKeyWords], k8[Traits::kKeyWords];  // key bytes of score rows g, g + 8
                                                          // (tokens 2g, 2g + 1)
  uint32_t v[4][Traits::kValueWords];  // value bytes of tokens 4t, 4t+2, 4t+1, 4t+3
  uint32_t norm, vscale, vzero;        // fp16 pairs: tokens 2g (low half), 2g + 1 (high half)
};

template <SplitVariant V>
struct SplitCompute {
  using Config = SplitKernelConfig<V>;
  using Traits = typename Config::Traits;
  using Chunk = SplitChunk<Traits>;
  static constexpr int kValueBits = V.value_bits;
  static constexpr int kNTiles = V.n_tiles;
  static constexpr bool kPacked = V.packed;
  static constexpr bool kStaged = Config::kStaged;
  static constexpr int kKSteps = Config::kKSteps;
  static constexpr int kMTiles = Config::kMTiles;
  static constexpr int kVW = Traits::kValueWords;
  static constexpr bool kCodebook = Traits::kLutEntries > 0;
  static constexpr bool kHiOnly = Config::kHiOnly;
  static constexpr bool kHalf = Config::kHalf;
  static constexpr int kQParts = Config::kQParts;
  static constexpr int kD = V.head_dim;

  const SplitParams& p;
  const int& begin;
  const int& end;
  const int& end0;  // every column sees the tokens before it (VerifyColumns; decode: len)
  const int& g;
  const int& t;
  const uint32_t& lane_word;
  const uint32_t (&qf)[kQParts][Config::kFragTiles][kKSteps][2];
  float (&acc)[kMTiles][kNTiles][4];
  float (&m)[kNTiles][2];
  float (&m_thr)[kNTiles][2];
  float (&l)[kNTiles][2];
  float (&z)[kNTiles][2];
  // Masked chunks: tokens before it are masked too (a sliding window's first position, counted
  // from the window's origin as begin is, SplitParams::window; 0 without one). A verify pass's
  // column of new token i sees its own window: tokens from lo_end0 + i on (lo_end0 = end0 −
  // window; lo_end0 + i >= lo for every column).
  int lo = 0;
  int lo_end0 = kNoWindowStart;

  // Config::kQueryInSmem: the shared address of unit 0 of the thread's run of row g (N tile 0),
  // its XOR permutation applied (unit j is at this ^ 16·j; kQueryOffset and the window's start
  // are multiples of 64, so the XOR touches only the unit bits).
  __device__ __forceinline__ uint32_t QueryRunAddress() const {
    if constexpr (!Config::kQueryInSmem) {
      return 0u;
    } else if constexpr (Traits::kPlain) {  // (+ 64-byte half j, Config::QueryAt)
      extern __shared__ __align__(16) uint8_t smem[];
      return static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + Config::kQueryOffset +
             2u * static_cast<uint32_t>(g * kD + 8 * t);
    } else {
      extern __shared__ __align__(16) uint8_t smem[];
      const uint32_t f = 2u * static_cast<uint32_t>(t >> 1) ^ static_cast<uint32_t>(g & 1);
      return static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + Config::kQueryOffset +
             2u * static_cast<uint32_t>(g * kD + 32 * t) + 16u * f;
    }
  }

  template <bool kTail>
  __device__ __forceinline__ void operator()(int c, Chunk& cur) const {
    const int t0 = begin + c * kChunk;
    bool valid[2] = {true, true};  // tokens 2g, 2g + 1
    if constexpr (kTail) {
      valid[0] = t0 + 2 * g < end && t0 + 2 * g >= lo;
      valid[1] = t0 + 2 * g + 1 < end && t0 + 2 * g + 1 >= lo;
    }
    // Whether column c sees token 2g + r: a verify pass's column c sees c / group tokens past
    // end0 (within the split's end), and under a window starts as many later.
    auto sees = [&](int c, int r) {
      const int extra = p.verify.query_start_loc != nullptr ? NewTokenOfColumn(p.verify, c) : 0;
      const int tok = t0 + 2 * g + r;
      return tok < min(end, end0 + extra) && tok >= max(lo, lo_end0 + extra);
    };

    // Scores Sᵀ[token, head] for tokens 2g, 2g+1 and heads 8·nt + 2t, +1, in independent MMA
    // chains sp[k] (summed below). FP8 / bf16 keys: M rows g, g + 8 are tokens 2g, 2g + 1;
    // chains k = q parts. Codebook keys: one MMA per token half (k = 2·half + q part), whose rows
    // g and g + 8 hold the c_hi and c_lo parts of the same token (one 64-bit table load gives
    // both, in the consecutive registers an MMA operand needs), so S = C[row g] + C[row g + 8].
    // (Three chains c_hi·q_hi, c_hi·q_lo, c_lo·q_hi with token rows would save a quarter of these
    // MMAs but cost 8 register moves per k-step to regroup the loaded pairs: measured in SASS.)
    // (Staged: each token half's chain split in two by k-step parity, chains of 4 MMAs, not 8;
    // FP8 keys' one chain likewise.)
    // (Half precision: rows g, g + 8 = tokens 2g, 2g + 1, chains k = k-step parity; one chain
    // per N tile where there are four of them.)
    constexpr int kParts = kPacked          ? (kCodebook ? (kStaged ? 4 : 2) : (kStaged ? 2 : 1))
                           : Traits::kPlain ? 1
                           : kHalf          ? (kNTiles > 2 ? 1 : 2)
                                            : (kCodebook ? 4 : 2);
    float sp[kParts][kNTiles][4];
#pragma unroll
    for (int k = 0; k < kParts; ++k) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) sp[k][nt][i] = 0.0f;
      }
    }
    // Config::kQueryInSmem: the B fragments of k-steps 2j and 2j + 1 of every N tile, read per
    // pair from unit j of the thread's run of row 8·nt + g (Config::QueryAt).
    uint32_t qv[Config::kQueryInSmem ? kNTiles : 1][4];
    [[maybe_unused]] const uint32_t q_run = QueryRunAddress();
    StaticFor<kKSteps>([&](auto ks_c) {
      constexpr int ks = decltype(ks_c)::value;
      if constexpr (kHiOnly) {  // rows g, g + 8 = tokens 2g, 2g + 1; chains k = k-step mod 4
        uint32_t a[4];
        Traits::template KeyFragHi<ks>(cur.kg, cur.k8, lane_word, a);
        MmaF16(sp[ks & 3][0], a, qf[0][0][ks][0], qf[0][0][ks][1]);
      } else if constexpr (kHalf && Config::kQueryInSmem) {
        if constexpr (ks % 2 == 0) {
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            SharedLoad16((q_run ^ (16u * (ks / 2))) + 16u * kD * nt, qv[nt]);
          }
        }
        uint32_t a[4];
        Traits::template KeyFragHi<ks>(cur.kg, cur.k8, lane_word, a);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          MmaF16(sp[0][nt], a, qv[nt][2 * (ks % 2)], qv[nt][2 * (ks % 2) + 1]);
        }
      } else if constexpr (kHalf) {  // codebook keys (ChooseSplitVariant)
        uint32_t a[4];
        Traits::template KeyFragHi<ks>(cur.kg, cur.k8, lane_word, a);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          MmaF16(sp[ks & 1][nt], a, qf[0][nt][ks][0], qf[0][nt][ks][1]);
        }
      } else if constexpr (kCodebook) {
        uint32_t a0[4], a1[4];
        Traits::template KeyFragHiLo<ks>(cur.kg, lane_word, a0);
        Traits::template KeyFragHiLo<ks>(cur.k8, lane_word, a1);
        if constexpr (kPacked) {  // chains k = token half; q parts are columns
          constexpr int kChain = kStaged ? 2 * (ks & 1) : 0;
          MmaF16(sp[kChain][0], a0, qf[0][0][ks][0], qf[0][0][ks][1]);
          MmaF16(sp[kChain + 1][0], a1, qf[0][0][ks][0], qf[0][0][ks][1]);
        } else {
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            MmaF16(sp[0][nt], a0, qf[0][nt][ks][0], qf[0][nt][ks][1]);
            MmaF16(sp[1][nt], a0, qf[1][nt][ks][0], qf[1][nt][ks][1]);
            MmaF16(sp[2][nt], a1, qf[0][nt][ks][0], qf[0][nt][ks][1]);
            MmaF16(sp[3][nt], a1, qf[1][nt][ks][0], qf[1][nt][ks][1]);
          }
        }
      } else if constexpr (Traits::kPlain && Config::kQueryInSmem) {
        // k-steps 2j and 2j + 1 of N tile nt: the 16-byte unit at d = 32j + 8t of row 8·nt + g,
        // in 64-byte half j XOR (g mod 2) (Config::QueryAt).
        static_assert(Config::kPlainStaged);  // interleaved keys
        if constexpr (ks % 2 == 0) {
          const uint32_t half = (64u * (ks / 2)) ^ (64u * static_cast<uint32_t>(g & 1));
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            SharedLoad16(q_run + half + 16u * kD * nt, qv[nt]);
          }
        }
        uint32_t a[4];
        Traits::template KeyFrag<ks>(cur.kg, cur.k8, a);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          MmaPlain<Traits::kFp16>(sp[0][nt], a, qv[nt][2 * (ks % 2)], qv[nt][2 * (ks % 2) + 1]);
        }
      } else {
        uint32_t a[4];
        Traits::template KeyFrag<ks>(cur.kg, cur.k8, a);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          if constexpr (Traits::kPlain) {
            MmaPlain<Traits::kFp16>(sp[0][nt], a, qf[0][nt][ks][0], qf[0][nt][ks][1]);
          } else if constexpr (kPacked) {  // (staged: chains k = k-step parity)
            MmaF16(sp[kParts > 1 ? ks & 1 : 0][nt], a, qf[0][nt][ks][0], qf[0][nt][ks][1]);
          } else {
            MmaF16(sp[0][nt], a, qf[0][nt][ks][0], qf[0][nt][ks][1]);
            MmaF16(sp[1][nt], a, qf[1][nt][ks][0], qf[1][nt][ks][1]);
          }
        }
      }
    });
    float row_scale[2], vs[2], vz[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row_scale[i] =
          Traits::kHasNorm
              ? HalfBitsToFloat(static_cast<uint16_t>(cur.norm >> (16 * i))) * p.score_scale
              : p.score_scale;
      vs[i] =
          Traits::kPlain ? 1.0f : HalfBitsToFloat(static_cast<uint16_t>(cur.vscale >> (16 * i)));
      vz[i] = Traits::kPlain ? 0.0f : HalfBitsToFloat(static_cast<uint16_t>(cur.vzero >> (16 * i)));
      if constexpr (kTail) {  // metadata of slots past the end may be NaN garbage (0 · NaN = NaN)
        vs[i] = valid[i] ? vs[i] : 0.0f;
        vz[i] = valid[i] ? vz[i] : 0.0f;
      }
    }

    uint32_t pb[kNTiles][2], pb_lo[kNTiles][2];  // P' as 16-bit hi and lo parts
    if constexpr (kPacked) {
      // Head t: its scores for tokens 2g + r (columns 2t, 2t + 1 = q_hi, q_lo; codebook keys add
      // the c_lo row g + 8), its running state in [0][0].
      float s[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum;
        if constexpr (kHiOnly) {  // row g + 8r of the four chains
          sum =
              ((sp[0][0][2 * r] + sp[0][0][2 * r + 1]) + (sp[2][0][2 * r] + sp[2][0][2 * r + 1])) +
              ((sp[1][0][2 * r] + sp[1][0][2 * r + 1]) + (sp[3][0][2 * r] + sp[3][0][2 * r + 1]));
        } else {
          sum = kCodebook ? (sp[r][0][0] + sp[r][0][1]) + (sp[r][0][2] + sp[r][0][3])
                          : sp[0][0][2 * r] + sp[0][0][2 * r + 1];
          if constexpr (!kCodebook && kParts == 2) sum += sp[1][0][2 * r] + sp[1][0][2 * r + 1];
          if constexpr (kCodebook && kParts == 4) {
            sum += (sp[r + 2][0][0] + sp[r + 2][0][1]) + (sp[r + 2][0][2] + sp[r + 2][0][3]);
          }
        }
        s[r] = sum * row_scale[r];
        if constexpr (kTail) s[r] = sees(t, r) ? s[r] : -INFINITY;
      }
      float mx = fmaxf(s[0], s[1]);
      // As below: lazy unless a value scale is too large for p ≤ 2^kLazyMax.
      const bool exact = fmaxf(vs[0], vs[1]) > kMaxLazyValueScale;
      if (__any_sync(0xffffffffu, mx > (exact ? m[0][0] : m_thr[0][0]))) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m[0][0], mx);
        const float corr = m_new == -INFINITY ? 1.0f : exp2f(m[0][0] - m_new);
        m[0][0] = m_new;
        m_thr[0][0] = m_new + kLazyMax;
        l[0][0] *= corr;
        z[0][0] *= corr;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][0][i] *= corr;
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // 0 past the end (s = -inf), also for a column that has seen no token yet (m = -inf).
        const float pr = kTail && s[r] == -INFINITY ? 0.0f : FastExp2(s[r] - m[0][0]);
        l[0][0] += pr;
        z[0][0] += pr * vz[r];
        const float pw = pr * vs[r];
        // (row g = token 2g + r, columns 2t, 2t + 1) = (P'_hi, P'_lo) of head t.
        const __half hi = __float2half_rn(pw);
        const __half2 x = __halves2half2(hi, __float2half_rn(pw - __half2float(hi)));
        pb[0][r] = Transpose8x8(*reinterpret_cast<const uint32_t*>(&x));
        pb_lo[0][r] = 0u;
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        // s[0..1]: token 2g, heads 2t, 2t+1; s[2..3]: token 2g + 1.
        float s[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float sum;
          if constexpr (kCodebook && !kHalf) {
            const int half = i / 2, j = i % 2;  // token 2g + half, head 2t + j
            sum = (sp[2 * half][nt][j] + sp[2 * half][nt][j + 2]) +
                  (sp[2 * half + 1][nt][j] + sp[2 * half + 1][nt][j + 2]);
          } else {
            sum = sp[0][nt][i];
            if constexpr (kParts > 1) sum += sp[1][nt][i];
          }
          s[i] = sum * row_scale[i / 2];
          if constexpr (kTail) s[i] = sees(8 * nt + 2 * t + i % 2, i / 2) ? s[i] : -INFINITY;
        }
        float mx[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
        // Rescale only when some score of the warp passes its head's running maximum by more than
        // kLazyMax (a few times per split), or by anything when a value scale of the chunk is too
        // large for p ≤ 2^kLazyMax; then m becomes the exact maximum so far.
        const bool exact = !Traits::kPlain && fmaxf(vs[0], vs[1]) > kMaxLazyValueScale;
        const float thr0 = exact ? m[nt][0] : m_thr[nt][0];
        const float thr1 = exact ? m[nt][1] : m_thr[nt][1];
        if (__any_sync(0xffffffffu, mx[0] > thr0 || mx[1] > thr1)) {
          float corr[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 4));
            mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 8));
            mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 16));
            const float m_new = fmaxf(m[nt][j], mx[j]);
            corr[j] = m_new == -INFINITY ? 1.0f : exp2f(m[nt][j] - m_new);
            m[nt][j] = m_new;
            m_thr[nt][j] = m_new + kLazyMax;
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
          // Past the end s = -inf: pr = 0 (m may be -inf too where a verify column has seen no
          // token yet).
          const float pr = kTail && s[i] == -INFINITY ? 0.0f : FastExp2(s[i] - m[nt][j]);
          l[nt][j] += pr;
          if constexpr (!Traits::kPlain) z[nt][j] += pr * vz[r];
          pw[i] = pr * vs[r];
        }
        // P'ᵀ as the B operand of P·V: the 8x8 tiles (tokens 2g | 2g+1, heads 2t, 2t+1) transposed
        // give head g at tokens 4t, 4t+2 (k-slots 2t, 2t+1) and 4t+1, 4t+3 (k-slots 2t+8, 2t+9).
        // Compressed kinds: P' = hi + lo (fp16 each, ~2^-22 together), two P·V MMAs keep the output
        // at fp32 level (one fp16 P' leaves 2^-12 per token, which the zero-point term amplifies);
        // the half-precision variant takes that one fp16 P' and its error, as FlashAttention does.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          uint32_t packed, packed_lo = 0;
          if constexpr (Traits::kPlain) {  // P' in the cache's type, as flash-attention rounds it
            packed = PackPlain<Traits::kFp16>(pw[2 * r], pw[2 * r + 1]);
          } else if constexpr (kHalf) {
            const __half2 x = __floats2half2_rn(pw[2 * r], pw[2 * r + 1]);
            packed = *reinterpret_cast<const uint32_t*>(&x);
          } else {
            const __half2 x = __floats2half2_rn(pw[2 * r], pw[2 * r + 1]);
            const __half2 y =
                __floats2half2_rn(pw[2 * r] - __low2float(x), pw[2 * r + 1] - __high2float(x));
            packed = *reinterpret_cast<const uint32_t*>(&x);
            packed_lo = *reinterpret_cast<const uint32_t*>(&y);
          }
          pb[nt][r] = Transpose8x8(packed);
          pb_lo[nt][r] = Traits::kPlain || kHalf ? 0u : Transpose8x8(packed_lo);
        }
      }
    }

    // Plain values of tokens past the end may be NaN garbage; zero them (P' is 0 there, but
    // 0 · NaN is NaN), and those before lo alike. Codes of the compressed kinds are always finite.
    if constexpr (Traits::kPlain && kTail) {
      constexpr int kTok[4] = {0, 2, 1, 3};  // value rows i: tokens 4t + kTok[i]
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = t0 + 4 * t + kTok[i];
        const bool vvalid = tok < end && tok >= lo;
#pragma unroll
        for (int w = 0; w < kVW; ++w) cur.v[i][w] = vvalid ? cur.v[i][w] : 0u;
      }
    }
    // Oᵀ[d, head] += Vᵀ[d, token] · P'ᵀ[token, head].
    if constexpr (!Traits::kPlain && kValueBits == 4) {
      StaticFor<kMTiles / 2>([&](auto pair_c) {
        constexpr int mt = 2 * decltype(pair_c)::value;
        uint32_t r01[2][2], r89[2][2];  // [m-tile][row g / g+8]
        Traits::template RowsPair<mt>(cur.v[0], cur.v[1], r01);
        Traits::template RowsPair<mt>(cur.v[2], cur.v[3], r89);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const uint32_t a[4] = {r01[k][0], r01[k][1], r89[k][0], r89[k][1]};
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            MmaF16(acc[mt + k][nt], a, pb[nt][0], pb[nt][1]);
            if constexpr (!kPacked && !kHalf)
              MmaF16(acc[mt + k][nt], a, pb_lo[nt][0], pb_lo[nt][1]);
          }
        }
      });
    } else if constexpr (!Traits::kPlain && kValueBits == 3 && kStaged) {
      // (CompressedValues::RowWindows: rows g + 8 at 8x, Config::kOddRowScale.)
      uint32_t w01[Traits::kWindows], w23[Traits::kWindows];
      Traits::RowWindows(cur.v[0], cur.v[1], w01);
      Traits::RowWindows(cur.v[2], cur.v[3], w23);
      StaticFor<kMTiles>([&](auto mt_c) {
        constexpr int mt = decltype(mt_c)::value;
        uint32_t a[4];
        Traits::template RowsOfWindow<mt>(w01, a[0], a[1]);
        Traits::template RowsOfWindow<mt>(w23, a[2], a[3]);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          MmaF16(acc[mt][nt], a, pb[nt][0], pb[nt][1]);
          if constexpr (!kPacked && !kHalf) MmaF16(acc[mt][nt], a, pb_lo[nt][0], pb_lo[nt][1]);
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
          if constexpr (Traits::kPlain) {
            MmaPlain<Traits::kFp16>(acc[mt][nt], a, pb[nt][0], pb[nt][1]);
          } else {
            MmaF16(acc[mt][nt], a, pb[nt][0], pb[nt][1]);
            if constexpr (!kPacked && !kHalf) MmaF16(acc[mt][nt], a, pb_lo[nt][0], pb_lo[nt][1]);
          }
        }
      });
    }
  }
};

}  // namespace tqkv::decode_detail
