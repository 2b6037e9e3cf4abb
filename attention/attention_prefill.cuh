// The prefill kernel: attention of long chunks of new tokens (prefill, prefix-hit continuations)
// over a paged cache in half precision, FlashAttention-2 style — the chunk kernel's rows and
// masks (attention/attention_kernel.cuh), at the throughput of a bf16 kernel.
//
// One CTA = (128-row tile, split of the context, KV head, sequence), 4 warps of 32 rows (two
// 16-row MMA tiles, so every K and V fragment read from shared memory feeds two MMAs). Rows are
// (new token i, GQA head g) pairs r = i·G + g, as in the chunk kernel. Per KV tile of 64 tokens:
//
//   S  = Q · Kᵀ     one m16n8k16 MMA per product: the query rounded to fp16 once, MSE keys as
//                   their centroids' fp16 parts (the norm scales the score), FP8 keys as fp16
//                   (exact); bf16 / fp16 caches multiply in their own type
//   P' = p · v_scale (fp16, one part)      O += P' · codes,   z += Σ p · v_zero
//
// so a product costs one MMA where the chunk kernel's fp32-level numerics cost 2.5 (query and key
// hi/lo parts, P hi/lo): AttentionOptions::chunk_precision chooses. The tiles are double
// buffered: the compressed kinds fetch tile j + 1's codes into registers before tile j's MMAs and
// dequantize them into the other buffer after; the plain kinds copy tile j + 1 by cp.async. One
// barrier per tile. Scores stay fp32 from the MMA on (scale, mask, exact online softmax).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_launch.h"
#include "attention/attention_prefill_wgmma.cuh"
#include "attention/attention_tiles.cuh"
#include "attention/decode_device.cuh"

namespace tqkv::attention_detail {

using decode_detail::FastExp2;

inline constexpr int kPrefillKv = 64;  // tokens per KV tile

// Shared memory: the query rows, two buffers of K and V tiles (rows of D 16-bit elements at a
// pitch of 2·D + 16 bytes: an ldmatrix phase's 8 row addresses fall on distinct bank groups), two
// buffers of per-token scales, the codebook, the split's block ids. 106 KB at D = 128: two CTAs
// per SM.
template <int kD>
struct PrefillLayout {
  static constexpr uint32_t kPitch = 2 * kD + 16;
  static constexpr uint32_t kTile = kPrefillKv * kPitch;
  static constexpr uint32_t kQ = 0;  // row r at kQ + r · kPitch
  static constexpr uint32_t kK = kQ + kPrefillRows * kPitch;  // buffer b at kK + b · kTile
  static constexpr uint32_t kV = kK + 2 * kTile;
  // Buffer b: float key scale [64] (log2 domain, times the norm for MSE keys), value scale [64],
  // value zero [64].
  static constexpr uint32_t kScaleBytes = 3 * 4 * kPrefillKv;
  static constexpr uint32_t kScales = kV + 2 * kTile;
  static constexpr uint32_t kCodebook = kScales + 2 * kScaleBytes;  // uint32 [16]: hi | lo << 16
  static constexpr uint32_t kIds = kCodebook + 64;
  static constexpr int kBytes = kIds + 4 * kMaxStagedIds;
};

template <KeyKind kKind, int kValueBits, int kD>
struct PrefillCta {
  using L = PrefillLayout<kD>;
  static constexpr bool kPlain = IsPlain(kKind);
  static constexpr bool kFp16 = kKind != KeyKind::kBf16;  // the MMAs' operand type
  static constexpr int kKSteps = kD / 16;
  // A tile's scores are taken 32 tokens at a time (registers: 32 rows × 64 tokens of scores
  // beside the 32 × 128 accumulators spilled).
  static constexpr int kPart = 32;
  static constexpr int kSN = kPart / 8;  // score n-tiles (8 tokens each)
  static constexpr int kON = kD / 8;          // output n-tiles (8 d each)
  static_assert(kWarps * 32 == kPrefillRows, "4 warps of 32 rows");
  static_assert(kPrefillKv * (kD / 8) % (kWarps * 32) == 0);

  const ChunkParams& p;
  uint8_t* smem;
  uint32_t smem_base;
  int lane, warp, g, tq;
  int group, q_start, row0, row_end, ctx0;
  int first_pos, last_pos;  // the warp's rows' smallest and largest positions
  int row_pos[2][2];        // [m-tile][k]: position of row 16·mt + g + 8k's token; -1: no row
  float acc[2][kON][4] = {};
  float m[2][2], l[2][2], z[2][2];

  __device__ __forceinline__ PrefillCta(const ChunkParams& params, uint8_t* shared, int tile,
                                        int b)
      : p(params), smem(shared) {
    smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    lane = threadIdx.x & 31;
    warp = threadIdx.x >> 5;
    g = lane >> 2;
    tq = lane & 3;
    group = p.num_q_heads / p.num_kv_heads;
    q_start = p.query_start_loc[b];
    int q_len = p.query_start_loc[b + 1] - q_start;
    if (q_len == 1 && p.skip_single) q_len = 0;  // the decode kernels' row
    row0 = tile * kPrefillRows;
    row_end = min(q_len * group, row0 + kPrefillRows);
    ctx0 = p.seq_lens[b] - q_len;
    const int wr0 = row0 + 32 * warp;
    first_pos = ctx0 + wr0 / group;
    last_pos = wr0 < row_end ? ctx0 + (min(wr0 + 32, row_end) - 1) / group : -1;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int r = wr0 + 16 * mt + g + 8 * k;
        row_pos[mt][k] = r < row_end ? ctx0 + r / group : -1;
        m[mt][k] = -INFINITY;
        l[mt][k] = 0.0f;
        z[mt][k] = 0.0f;
      }
    }
  }

  // The codebook and the CTA's query rows, rounded once to the MMA type (rows past the
  // sequence's: 0).
  __device__ __forceinline__ void LoadQuery(int h) {
    if constexpr (kKind == KeyKind::kMse4 || kKind == KeyKind::kMse3) {
      if (threadIdx.x < 16) {
        reinterpret_cast<uint32_t*>(smem + L::kCodebook)[threadIdx.x] =
            uint32_t{p.centroid_hi[threadIdx.x]} | uint32_t{p.centroid_lo[threadIdx.x]} << 16;
      }
    }
    for (int u = threadIdx.x; u < kPrefillRows * kD / 2; u += kWarps * 32) {
      const int r = u / (kD / 2), d = 2 * (u % (kD / 2));
      float x0 = 0.0f, x1 = 0.0f;
      if (row0 + r < row_end) {
        const int i = (row0 + r) / group, gg = (row0 + r) % group;
        const int64_t at = (int64_t{q_start + i} * p.num_q_heads + h * group + gg) * kD + d;
        x0 = LoadQueryElement(p.query, p.query_dtype, at);
        x1 = LoadQueryElement(p.query, p.query_dtype, at + 1);
      }
      *reinterpret_cast<uint32_t*>(smem + L::kQ + r * L::kPitch + 2 * d) =
          decode_detail::PackPlain<kFp16>(x0, x1);
    }
  }

  // Plain caches: tile [tile_begin, +64) of KV head h into buffer `buf` by cp.async (tokens at or
  // past `end` zero-filled).
  __device__ __forceinline__ void CopyPlainTile(const int32_t* ids, int id_base, int h,
                                                int tile_begin, int end, int buf) const {
    constexpr int kGroups = kD / 8;
    // Unit threadIdx.x + 128·k is (token j0 + k·128 / kGroups, group e8): nothing per unit to keep
    // in registers across tiles.
    const int e8 = static_cast<int>(threadIdx.x % kGroups), j0 = static_cast<int>(threadIdx.x / kGroups);
#pragma unroll
    for (int k = 0; k < kPrefillKv * kGroups / (kWarps * 32); ++k) {
      const int j = j0 + k * (kWarps * 32 / kGroups);
      const int t = tile_begin + j;
      const uint8_t* key = p.cache;
      if (t < end) {
        const uint8_t* block = p.cache + int64_t{ids[t / p.block_size - id_base]} * p.block_bytes;
        key = block + 2 * ((int64_t{t % p.block_size} * p.num_kv_heads + h) * kD) + 16 * e8;
      }
      const uint32_t bytes = t < end ? 16u : 0u;
      const uint32_t at = j * L::kPitch + 16 * e8;
      decode_detail::CopyAsync16Fill(smem_base + L::kK + buf * L::kTile + at, key, bytes);
      decode_detail::CopyAsync16Fill(smem_base + L::kV + buf * L::kTile + at,
                                     t < end ? key + p.meta_offset : key, bytes);
    }
    decode_detail::CopyAsyncCommit();
  }

  // Compressed kinds: a fetched tile's codes dequantized into buffer `buf` (keys as fp16
  // centroids or FP8 values, value codes as fp16 integers) with its tokens' scales.
  template <typename Raw>
  __device__ __forceinline__ void Commit(const Raw& raw, int buf) const {
    constexpr int kGroups = kD / 8;
    const int e8 = static_cast<int>(threadIdx.x % kGroups), j0 = static_cast<int>(threadIdx.x / kGroups);
#pragma unroll
    for (int k = 0; k < Raw::kUnits; ++k) {
      const int j = j0 + k * (kWarps * 32 / kGroups);
      uint4 key;
      if constexpr (kKind == KeyKind::kFp8) {
        key.x = E4M3x2ToHalf2(raw.key[k][0]);
        key.y = E4M3x2HiToHalf2(raw.key[k][0]);
        key.z = E4M3x2ToHalf2(raw.key[k][1]);
        key.w = E4M3x2HiToHalf2(raw.key[k][1]);
      } else {
        constexpr int kKeyBits = kKind == KeyKind::kMse4 ? 4 : 3;
        constexpr uint32_t kMask = (1u << kKeyBits) - 1u;
        const uint16_t* cb = reinterpret_cast<const uint16_t*>(smem + L::kCodebook);
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // the hi half of each codebook word
          const uint32_t c0 = cb[2 * ((raw.key[k][0] >> (2 * q * kKeyBits)) & kMask)];
          const uint32_t c1 = cb[2 * ((raw.key[k][0] >> ((2 * q + 1) * kKeyBits)) & kMask)];
          w[q] = c0 | c1 << 16;
        }
        key = {w[0], w[1], w[2], w[3]};
      }
      uint32_t vw[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t c0 = (raw.value[k] >> (2 * q * kValueBits)) & ((1u << kValueBits) - 1u);
        const uint32_t c1 =
            (raw.value[k] >> ((2 * q + 1) * kValueBits)) & ((1u << kValueBits) - 1u);
        const __half2 pair = __floats2half2_rn(static_cast<float>(c0), static_cast<float>(c1));
        vw[q] = *reinterpret_cast<const uint32_t*>(&pair);
      }
      const uint32_t at = j * L::kPitch + 16 * e8;
      *reinterpret_cast<uint4*>(smem + L::kK + buf * L::kTile + at) = key;
      *reinterpret_cast<uint4*>(smem + L::kV + buf * L::kTile + at) =
          uint4{vw[0], vw[1], vw[2], vw[3]};
    }
    if (threadIdx.x < kPrefillKv) {
      float* scales = reinterpret_cast<float*>(smem + L::kScales + buf * L::kScaleBytes);
      scales[threadIdx.x] = raw.ks;
      scales[kPrefillKv + threadIdx.x] = raw.vs;
      scales[2 * kPrefillKv + threadIdx.x] = raw.vz;
    }
  }

  // Tokens tok0 .. tok0 + 31 of a KV tile (buffer `buf`, tokens from tile_begin) for the warp's
  // 32 rows.
  __device__ __forceinline__ void Part(int tile_begin, int tok0, int split_end, int buf) {
    const uint32_t kbase = smem_base + L::kK + buf * L::kTile;
    const uint32_t vbase = smem_base + L::kV + buf * L::kTile;
    const float* scales = reinterpret_cast<const float*>(smem + L::kScales + buf * L::kScaleBytes);
    float s[2][kSN][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int n = 0; n < kSN; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) s[mt][n][c] = 0.0f;
      }
    }
    // S = Q · Kᵀ.
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int r = 32 * warp + 16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1);
        LdMatrixX4(smem_base + L::kQ + r * L::kPitch + 2 * (16 * ks + 8 * (lane >> 4)), a[mt]);
      }
#pragma unroll
      for (int n2 = 0; n2 < kSN / 2; ++n2) {
        const int tok = tok0 + 16 * n2 + (lane & 7) + 8 * (lane >> 4);
        uint32_t b[4];
        LdMatrixX4(kbase + tok * L::kPitch + 2 * (16 * ks + 8 * ((lane >> 3) & 1)), b);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          decode_detail::MmaPlain<kFp16>(s[mt][2 * n2], a[mt], b[0], b[1]);
          decode_detail::MmaPlain<kFp16>(s[mt][2 * n2 + 1], a[mt], b[2], b[3]);
        }
      }
    }
    // Scale (log2 domain) and mask; most tiles of a long chunk lie wholly before every row of the
    // warp and inside the split: no mask there.
    const int t0 = tile_begin + tok0;
    const bool unmasked =
        p.sliding_window == 0 && t0 + kPart <= split_end && t0 + kPart - 1 <= first_pos;
    float tile_max[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
#pragma unroll
    for (int n = 0; n < kSN; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = tok0 + 8 * n + 2 * tq + (c & 1);
        const float ks = kPlain ? p.score_scale : scales[j];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int k = c >> 1;
          float x = s[mt][n][c] * ks;
          if (!unmasked) {
            const int t = tile_begin + j, pos = row_pos[mt][k];
            const bool keep = t < split_end && t <= pos &&
                              (p.sliding_window == 0 || t > pos - p.sliding_window);
            x = keep ? x : -INFINITY;
          }
          s[mt][n][c] = x;
          tile_max[mt][k] = fmaxf(tile_max[mt][k], x);
        }
      }
    }
    // Online softmax: new maxima, rescale, P' = p · value scale (plain: p).
    float ref[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        float mx = tile_max[mt][k];
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[mt][k], mx);
        ref[mt][k] = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = FastExp2(m[mt][k] - ref[mt][k]);  // m = -inf: 0
        m[mt][k] = m_new;
        l[mt][k] *= alpha;
        z[mt][k] *= alpha;
#pragma unroll
        for (int n = 0; n < kON; ++n) {
          acc[mt][n][2 * k] *= alpha;
          acc[mt][n][2 * k + 1] *= alpha;
        }
      }
    }
#pragma unroll
    for (int n = 0; n < kSN; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = tok0 + 8 * n + 2 * tq + (c & 1);
        float vs = 1.0f, vz = 0.0f;
        if constexpr (!kPlain) {
          vs = scales[kPrefillKv + j];
          vz = scales[2 * kPrefillKv + j];
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int k = c >> 1;
          const float w = FastExp2(s[mt][n][c] - ref[mt][k]);
          l[mt][k] += w;
          if constexpr (!kPlain) z[mt][k] += w * vz;
          s[mt][n][c] = w * vs;
        }
      }
    }
    // O += P' · V, 16 tokens per k-step; P' is the score fragments, packed to the MMA type.
#pragma unroll
    for (int kk = 0; kk < kSN / 2; ++kk) {
      uint32_t a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        a[mt][0] = decode_detail::PackPlain<kFp16>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = decode_detail::PackPlain<kFp16>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = decode_detail::PackPlain<kFp16>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = decode_detail::PackPlain<kFp16>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int nd = 0; nd < kON / 2; ++nd) {
        const int tok = tok0 + 16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1);
        uint32_t bv[4];
        LdMatrixX4Trans(vbase + tok * L::kPitch + 2 * (16 * nd + 8 * (lane >> 4)), bv);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          decode_detail::MmaPlain<kFp16>(acc[mt][2 * nd], a[mt], bv[0], bv[1]);
          decode_detail::MmaPlain<kFp16>(acc[mt][2 * nd + 1], a[mt], bv[2], bv[3]);
        }
      }
    }
  }

  // Row sums over the quad, then (O + z) / l and the LSE of the thread's rows: the output, or the
  // split's partial.
  __device__ __forceinline__ void Write(int h, int split) {
    constexpr float kLn2 = 0.69314718055994530942f;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        float lk = l[mt][k], zk = z[mt][k];
        lk += __shfl_xor_sync(0xffffffffu, lk, 1);
        lk += __shfl_xor_sync(0xffffffffu, lk, 2);
        zk += __shfl_xor_sync(0xffffffffu, zk, 1);
        zk += __shfl_xor_sync(0xffffffffu, zk, 2);
        const int r = row0 + 32 * warp + 16 * mt + g + 8 * k;
        if (r >= row_end) continue;
        const int i = r / group, gg = r % group;
        const int64_t out_row = int64_t{q_start + i} * p.num_q_heads + h * group + gg;
        const bool empty = lk == 0.0f;
        const float inv = empty ? 0.0f : 1.0f / lk;
        zk = empty ? 0.0f : zk;
        const float lse = empty ? -INFINITY : (m[mt][k] + __log2f(lk)) * kLn2;
        if (p.max_splits == 1) {
#pragma unroll
          for (int n = 0; n < kON; ++n) {
            const int64_t at = out_row * kD + 8 * n + 2 * tq;
            decode_detail::StoreOutput(p.output, p.out_dtype, at,
                                       (acc[mt][n][2 * k] + zk) * inv);
            decode_detail::StoreOutput(p.output, p.out_dtype, at + 1,
                                       (acc[mt][n][2 * k + 1] + zk) * inv);
          }
          if (tq == 0) p.lse[out_row] = lse;
        } else {
          float* out = p.partial_out + (out_row * p.max_splits + split) * kD;
#pragma unroll
          for (int n = 0; n < kON; ++n) {
            *reinterpret_cast<float2*>(out + 8 * n + 2 * tq) =
                make_float2((acc[mt][n][2 * k] + zk) * inv, (acc[mt][n][2 * k + 1] + zk) * inv);
          }
          if (tq == 0) p.partial_lse[out_row * p.max_splits + split] = lse;
        }
      }
    }
  }
};

// Grid row_tiles · max_splits · num_kv_heads, as the chunk kernel's with 128-row tiles.
template <KeyKind kKind, int kValueBits, int kD>
__global__ void __launch_bounds__(kWarps * 32, 2) PrefillAttentionKernel(const ChunkParams p) {
  using Cta = PrefillCta<kKind, kValueBits, kD>;
  using L = typename Cta::L;
  extern __shared__ __align__(16) uint8_t smem[];
  int h, slot;
  SlotOfBlock(p, h, slot);
  const int split = slot / p.row_tiles;
  int b, tile;
  FindRowTile(p, kPrefillRows, slot % p.row_tiles, b, tile);
  Cta cta(p, smem, tile, b);
  if (cta.row0 >= cta.row_end) {  // the sequence has fewer rows
    GridDependencyWait();         // ChunkParams::programmatic
    return;
  }
  const SplitSpan span = SplitSpanOf(p, cta.ctx0, cta.group, cta.row0, cta.row_end, split);
  const int split_begin = span.begin, split_end = span.end;
  const int32_t* table = p.block_tables + int64_t{b} * p.max_blocks_per_seq;
  cta.LoadQuery(h);
  const SplitIds staged =
      StageSplitIds<kWarps * 32>(p, table, span, reinterpret_cast<int32_t*>(smem + L::kIds));
  const int32_t* ids = staged.ids;
  const int id_base = staged.base;
  __syncthreads();

  const int tiles = split_end > split_begin ? (split_end - split_begin + kPrefillKv - 1) / kPrefillKv
                                            : 0;
  RawTile<kKind, kValueBits, kD, kPrefillRows> raw;
  if (tiles > 0) {
    if constexpr (Cta::kPlain) {
      cta.CopyPlainTile(ids, id_base, h, split_begin, split_end, 0);
      decode_detail::CopyAsyncWait();
    } else {
      raw.Fetch(p, ids, id_base, h, split_begin, split_end);
      cta.Commit(raw, 0);
    }
  }
  __syncthreads();
  for (int j = 0; j < tiles; ++j) {
    const int tile_begin = split_begin + j * kPrefillKv;
    const bool more = j + 1 < tiles;
    const int next = (j + 1) & 1;
    if (more) {
      if constexpr (Cta::kPlain) {
        cta.CopyPlainTile(ids, id_base, h, tile_begin + kPrefillKv, split_end, next);
      } else {
        raw.Fetch(p, ids, id_base, h, tile_begin + kPrefillKv, split_end);
      }
    }
    // A warp whose rows all come before a part (the causal diagonal) or that has none, or a part
    // past the split's end, is skipped.
#pragma unroll 1
    for (int part = 0; part < kPrefillKv; part += Cta::kPart) {
      const int t0 = tile_begin + part;
      if (t0 <= cta.last_pos && t0 < split_end) cta.Part(tile_begin, part, split_end, j & 1);
    }
    if (more) {
      if constexpr (Cta::kPlain) {
        decode_detail::CopyAsyncWait();
      } else {
        cta.Commit(raw, next);
      }
    }
    __syncthreads();  // the next buffer is complete; this one is free for tile j + 2
  }
  cta.Write(h, split);
  GridDependencyWait();  // ChunkParams::programmatic
}

template <KeyKind kKind, int kValueBits, int kD>
cudaError_t LaunchPrefill(const ChunkParams& p, cudaStream_t stream) {
  constexpr int kSmem = PrefillLayout<kD>::kBytes;
  auto* kernel = PrefillAttentionKernel<kKind, kValueBits, kD>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(static_cast<unsigned>(p.row_tiles * p.max_splits * p.num_kv_heads));
  return LaunchChunkGrid(kernel, grid, kWarps * 32, kSmem, stream, p);
}

// Whether LaunchPrefillOfBits<kKind, kValueBits>(head_dim, p, ..) runs the wgmma kernel here.
template <KeyKind kKind, int kValueBits>
bool WgmmaRunsOfBits(int head_dim, const ChunkParams& p) {
  return head_dim == 128 && WgmmaPrefillRuns<kKind, kValueBits>(p) && DeviceHasWgmma();
}

// head_dim 64 and 128 (256 keeps the chunk kernel: its registers would not hold 32 rows).
template <KeyKind kKind, int kValueBits>
cudaError_t LaunchPrefillOfBits(int head_dim, const ChunkParams& p, cudaStream_t stream) {
  if (p.tiles_pass) {  // the tiles the wgmma kernel takes (ChunkParams::tiles)
    if (WgmmaRunsOfBits<kKind, kValueBits>(head_dim, p)) {
      return LaunchDequantTiles<kKind, kValueBits>(p, stream);
    }
    return cudaErrorInvalidValue;
  }
  if (p.query_fwht) {  // only the wgmma kernel rotates the query itself
    if constexpr (!IsPlain(kKind)) {
      if (head_dim == 128 && WgmmaPrefillRuns<kKind, kValueBits>(p) && DeviceHasWgmma()) {
        return LaunchPrefillWgmma<kKind, kValueBits>(p, stream);
      }
    }
    return cudaErrorInvalidValue;
  }
  switch (head_dim) {
    case 64:
      return LaunchPrefill<kKind, kValueBits, 64>(p, stream);
    case 128:
      // On Hopper: the wgmma kernel (attention_prefill_wgmma.cuh), for the slot layouts it was
      // built for (and the bf16 / fp16 caches), with blocks of whole 8-token groups.
      if (WgmmaPrefillRuns<kKind, kValueBits>(p) && DeviceHasWgmma()) {
        return LaunchPrefillWgmma<kKind, kValueBits>(p, stream);
      }
      return LaunchPrefill<kKind, kValueBits, 128>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace tqkv::attention_detail
