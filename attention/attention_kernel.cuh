// Attention of several new tokens per sequence over a paged cache (attention/attention.h): one
// kernel family for every cache kind (4/3-bit codebook keys, FP8 keys, bf16/fp16 caches), head_dim
// 64/128/256 and any GQA group, FlashAttention-style.
//
// One CTA = (64-row tile, split of the context, KV head, sequence), 4 warps of 16 rows each. The
// rows of a (sequence, KV head) are its (new token i, query head g of the group) pairs, r = i·G +
// g, so the GQA heads and the new tokens share the MMA rows: a verify step of 4 tokens with a
// group of 4 fills one warp's 16 rows, and the cache is read once for all of them. Per KV tile
// (64 tokens; 32 at D = 256) the CTA dequantizes the tile into shared memory — MSE keys as their
// centroids' fp16 hi and lo parts (the norm is applied to the score), FP8 keys as fp16 (exact),
// value codes as fp16 integers (exact) — then each warp runs
//
//   S  = Q · Kᵀ        (hi·hi + lo·hi + hi·lo: fp32-level scores, like the decode kernels)
//   P' = p · v_scale   (fp16 hi + lo parts)      O += P' · codes,   z += Σ p · v_zero
//
// with mma.sync m16n8k16 and an exact online softmax, and the output is (O + z) / l. Plain caches
// multiply the query's hi + lo parts by the stored K and P's hi + lo parts by the stored V, in the
// cache's type. Causality and the sliding window are a per-(row, token) mask; tiles past a
// split's end are zero-filled so that masked weights never meet garbage.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_launch.h"
#include "attention/attention_tiles.cuh"
#include "attention/decode_device.cuh"

namespace tqkv::attention_detail {

using decode_detail::E4M3x2HiToHalf2;
using decode_detail::E4M3x2ToHalf2;
using decode_detail::FastExp2;
using decode_detail::IsPlain;

// One CTA's work, in phases. kRowWarps warps hold 16 query rows each; the other warps of the CTA
// share those rows and take their own part of every KV tile (kKvWarps parts), so a tile with few
// rows (decode and verify: a GQA group times a few new tokens) still keeps all four warps on the
// tensor cores; their softmax states are merged through shared memory at the end.
template <KeyKind kKind, int kValueBits, int kD, int kRowWarps>
struct ChunkCta {
  using L = ChunkLayout<kD, kQueryParts<kKind>, 16 * kRowWarps>;
  static constexpr int kQParts = kQueryParts<kKind>;
  static constexpr int kKv = L::kKv;
  static constexpr bool kPlain = IsPlain(kKind);
  static constexpr bool kFp16 = kKind != KeyKind::kBf16;  // the MMAs' operand type
  static constexpr bool kKeyLo = kKind == KeyKind::kMse4 || kKind == KeyKind::kMse3;
  static constexpr int kKvWarps = kWarps / kRowWarps;
  static constexpr int kRows = 16 * kRowWarps;          // query rows per CTA
  static constexpr int kWarpTokens = kKv / kKvWarps;    // a warp's tokens of each KV tile
  static constexpr int kSN = kWarpTokens / 8;           // its score n-tiles (8 tokens each)
  static constexpr int kON = kD / 8;                    // output n-tiles (8 d each)
  static_assert(kWarpTokens % 16 == 0, "a warp's part of a tile is whole P·V k-steps");
  static constexpr int kMergeFloats = kON * 4 + 6;      // per lane: acc, m, l, z
  static_assert(kWarps * kMergeFloats * 32 * 4 <= L::kVScale, "merge scratch fits");

  const ChunkParams& p;
  uint8_t* smem;
  uint32_t smem_base;
  int lane, warp, g, tq, row_warp, kv_part;
  int group, q_start, row0, row_end, ctx0;
  int row_pos[2];  // position of each of the thread's two rows' token; -1: no row
  float acc[kON][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, z[2] = {0.0f, 0.0f};

  __device__ __forceinline__ ChunkCta(const ChunkParams& params, uint8_t* shared, int tile,
                                      int b, int h)
      : p(params), smem(shared) {
    smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    lane = threadIdx.x & 31;
    warp = threadIdx.x >> 5;
    g = lane >> 2;
    tq = lane & 3;
    row_warp = warp % kRowWarps;
    kv_part = warp / kRowWarps;
    group = p.num_q_heads / p.num_kv_heads;
    q_start = p.query_start_loc[b];
    int q_len = p.query_start_loc[b + 1] - q_start;
    if (q_len == 1 && p.skip_single) q_len = 0;  // the decode kernels' row
    row0 = tile * kRows;
    row_end = min(q_len * group, row0 + kRows);
    ctx0 = p.seq_lens[b] - q_len;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int r = row0 + 16 * row_warp + g + 8 * k;
      row_pos[k] = r < row_end ? ctx0 + r / group : -1;
    }
    (void)h;
  }

  __device__ __forceinline__ bool active() const { return row0 + 16 * row_warp < row_end; }

  // The codebook parts and the CTA's query rows as kQParts parts (rows past the sequence's: 0).
  __device__ __forceinline__ void LoadQuery(int h) {
    if constexpr (kKeyLo) {
      if (threadIdx.x < 16) {
        reinterpret_cast<uint32_t*>(smem + L::kCodebook)[threadIdx.x] =
            uint32_t{p.centroid_hi[threadIdx.x]} | uint32_t{p.centroid_lo[threadIdx.x]} << 16;
      }
    }
    for (int u = threadIdx.x; u < kRows * kD / 2; u += kWarps * 32) {
      const int r = u / (kD / 2), d = 2 * (u % (kD / 2));
      float x0 = 0.0f, x1 = 0.0f;
      if (row0 + r < row_end) {
        const int i = (row0 + r) / group, gg = (row0 + r) % group;
        const int64_t at = (int64_t{q_start + i} * p.num_q_heads + h * group + gg) * kD + d;
        x0 = LoadQueryElement(p.query, p.query_dtype, at);
        x1 = LoadQueryElement(p.query, p.query_dtype, at + 1);
      }
#pragma unroll
      for (int j = 0; j < kQParts; ++j) {  // each part is the rounding of what the earlier left
        const uint16_t b0 = ToBits<kFp16>(x0), b1 = ToBits<kFp16>(x1);
        *reinterpret_cast<uint32_t*>(smem + L::kQ + (j * kRows + r) * L::kPitch + 2 * d) =
            uint32_t{b0} | uint32_t{b1} << 16;
        x0 -= FromBits<kFp16>(b0);
        x1 -= FromBits<kFp16>(b1);
      }
    }
  }

  // S = Q · Kᵀ for the warp's 16 rows and its kWarpTokens tokens of the tile (from tok0).
  __device__ __forceinline__ void Scores(int tok0, float (&s)[kSN][4]) const {
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      uint32_t a[kQParts][4];  // the query's parts, hi first
#pragma unroll
      for (int j = 0; j < kQParts; ++j) {
        const int r = j * kRows + 16 * row_warp + (lane & 7) + 8 * ((lane >> 3) & 1);
        LdMatrixX4(smem_base + L::kQ + r * L::kPitch + 2 * (16 * ks + 8 * (lane >> 4)), a[j]);
      }
#pragma unroll
      for (int n2 = 0; n2 < kSN / 2; ++n2) {
        const int tok = tok0 + 16 * n2 + (lane & 7) + 8 * (lane >> 4);
        const uint32_t col = 2 * (16 * ks + 8 * ((lane >> 3) & 1));
        uint32_t b_hi[4];
        LdMatrixX4(smem_base + L::kKHi + tok * L::kPitch + col, b_hi);
#pragma unroll
        for (int j = 0; j < kQParts; ++j) {
          decode_detail::MmaPlain<kFp16>(s[2 * n2], a[j], b_hi[0], b_hi[1]);
          decode_detail::MmaPlain<kFp16>(s[2 * n2 + 1], a[j], b_hi[2], b_hi[3]);
        }
        if constexpr (kKeyLo) {
          uint32_t b_lo[4];
          LdMatrixX4(smem_base + L::kKLo + tok * L::kPitch + col, b_lo);
          decode_detail::MmaPlain<kFp16>(s[2 * n2], a[0], b_lo[0], b_lo[1]);
          decode_detail::MmaPlain<kFp16>(s[2 * n2 + 1], a[0], b_lo[2], b_lo[3]);
        }
      }
    }
  }

  // Scales and masks the scores (log2 domain), updates the running maximum, rescales what was
  // accumulated, and turns s into P' (p · value scale; plain caches: p) for the P·V product.
  __device__ __forceinline__ void Softmax(int tile_begin, int tok0, int split_end,
                                          float (&s)[kSN][4]) {
    const float* kscale = reinterpret_cast<const float*>(smem + L::kKScale);
    float tile_max[2] = {-INFINITY, -INFINITY};
    // Most tiles of a long chunk lie wholly before every row of the warp and inside the split:
    // no mask there (the warp's first row has the smallest position).
    const int first_pos = ctx0 + (row0 + 16 * row_warp) / group;
    const bool unmasked = p.sliding_window == 0 && tile_begin + tok0 + kWarpTokens <= split_end &&
                          tile_begin + tok0 + kWarpTokens - 1 <= first_pos;
    if (unmasked) {
#pragma unroll
      for (int n = 0; n < kSN; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          s[n][c] *= kscale[tok0 + 8 * n + 2 * tq + (c & 1)];
          tile_max[c >> 1] = fmaxf(tile_max[c >> 1], s[n][c]);
        }
      }
    } else {
#pragma unroll
      for (int n = 0; n < kSN; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int j = tok0 + 8 * n + 2 * tq + (c & 1);
          const int t = tile_begin + j, k = c >> 1;
          const bool keep = t < split_end && t <= row_pos[k] &&
                            (p.sliding_window == 0 || t > row_pos[k] - p.sliding_window);
          s[n][c] = keep ? s[n][c] * kscale[j] : -INFINITY;
          tile_max[k] = fmaxf(tile_max[k], s[n][c]);
        }
      }
    }
    float ref[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      tile_max[k] = fmaxf(tile_max[k], __shfl_xor_sync(0xffffffffu, tile_max[k], 1));
      tile_max[k] = fmaxf(tile_max[k], __shfl_xor_sync(0xffffffffu, tile_max[k], 2));
      const float m_new = fmaxf(m[k], tile_max[k]);
      ref[k] = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = FastExp2(m[k] - ref[k]);  // m = -inf: 0 (nothing accumulated yet)
      m[k] = m_new;
      l[k] *= alpha;
      z[k] *= alpha;
#pragma unroll
      for (int n = 0; n < kON; ++n) {
        acc[n][2 * k] *= alpha;
        acc[n][2 * k + 1] *= alpha;
      }
    }
    const float* vscale = reinterpret_cast<const float*>(smem + L::kVScale);
    const float* vzero = reinterpret_cast<const float*>(smem + L::kVZero);
#pragma unroll
    for (int n = 0; n < kSN; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int k = c >> 1;
        const float w = FastExp2(s[n][c] - ref[k]);
        l[k] += w;
        if constexpr (kPlain) {
          s[n][c] = w;
        } else {
          const int j = tok0 + 8 * n + 2 * tq + (c & 1);
          z[k] += w * vzero[j];
          s[n][c] = w * vscale[j];
        }
      }
    }
  }

  // O += P' · V over the warp's tokens, 16 per k-step.
  __device__ __forceinline__ void Accumulate(int tok0, const float (&s)[kSN][4]) {
#pragma unroll
    for (int kk = 0; kk < kSN / 2; ++kk) {
      uint32_t a_hi[4], a_lo[4];
      SplitPair<kFp16>(s[2 * kk][0], s[2 * kk][1], a_hi[0], a_lo[0]);
      SplitPair<kFp16>(s[2 * kk][2], s[2 * kk][3], a_hi[1], a_lo[1]);
      SplitPair<kFp16>(s[2 * kk + 1][0], s[2 * kk + 1][1], a_hi[2], a_lo[2]);
      SplitPair<kFp16>(s[2 * kk + 1][2], s[2 * kk + 1][3], a_hi[3], a_lo[3]);
#pragma unroll
      for (int nd = 0; nd < kON / 2; ++nd) {
        const int tok = tok0 + 16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1);
        uint32_t bv[4];
        LdMatrixX4Trans(smem_base + L::kV + tok * L::kPitch + 2 * (16 * nd + 8 * (lane >> 4)), bv);
        decode_detail::MmaPlain<kFp16>(acc[2 * nd], a_hi, bv[0], bv[1]);
        decode_detail::MmaPlain<kFp16>(acc[2 * nd + 1], a_hi, bv[2], bv[3]);
        decode_detail::MmaPlain<kFp16>(acc[2 * nd], a_lo, bv[0], bv[1]);
        decode_detail::MmaPlain<kFp16>(acc[2 * nd + 1], a_lo, bv[2], bv[3]);
      }
    }
  }

  // Row sums over the quad, then (kKvWarps > 1) the KV parts' states merged into part 0's warps
  // through shared memory (the tiles' space, free after the loop). Every warp calls it.
  __device__ __forceinline__ void Merge() {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      l[k] += __shfl_xor_sync(0xffffffffu, l[k], 1);
      l[k] += __shfl_xor_sync(0xffffffffu, l[k], 2);
      z[k] += __shfl_xor_sync(0xffffffffu, z[k], 1);
      z[k] += __shfl_xor_sync(0xffffffffu, z[k], 2);
    }
    if constexpr (kKvWarps > 1) {
      float* scratch = reinterpret_cast<float*>(smem);
      __syncthreads();  // every warp is done with the tiles
      auto at = [&](int w, int f) { return (w * kMergeFloats + f) * 32 + lane; };
      if (kv_part > 0) {
#pragma unroll
        for (int n = 0; n < kON; ++n) {
#pragma unroll
          for (int c = 0; c < 4; ++c) scratch[at(warp, 4 * n + c)] = acc[n][c];
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          scratch[at(warp, 4 * kON + k)] = m[k];
          scratch[at(warp, 4 * kON + 2 + k)] = l[k];
          scratch[at(warp, 4 * kON + 4 + k)] = z[k];
        }
      }
      __syncthreads();
      if (kv_part > 0) return;
#pragma unroll
      for (int part = 1; part < kKvWarps; ++part) {
        const int w = warp + part * kRowWarps;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const float m2 = scratch[at(w, 4 * kON + k)];
          const float m_new = fmaxf(m[k], m2);
          const float ref = m_new == -INFINITY ? 0.0f : m_new;
          const float a1 = FastExp2(m[k] - ref), a2 = FastExp2(m2 - ref);
          m[k] = m_new;
          l[k] = l[k] * a1 + scratch[at(w, 4 * kON + 2 + k)] * a2;
          z[k] = z[k] * a1 + scratch[at(w, 4 * kON + 4 + k)] * a2;
#pragma unroll
          for (int n = 0; n < kON; ++n) {
            acc[n][2 * k] = acc[n][2 * k] * a1 + scratch[at(w, 4 * n + 2 * k)] * a2;
            acc[n][2 * k + 1] = acc[n][2 * k + 1] * a1 + scratch[at(w, 4 * n + 2 * k + 1)] * a2;
          }
        }
      }
    }
  }

  // (O + z) / l and the LSE of the thread's rows: the output, or the split's partial.
  __device__ __forceinline__ void Write(int h, int split) const {
    constexpr float kLn2 = 0.69314718055994530942f;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int r = row0 + 16 * row_warp + g + 8 * k;
      if (r >= row_end) continue;
      const int i = r / group, gg = r % group;
      const int64_t out_row = int64_t{q_start + i} * p.num_q_heads + h * group + gg;
      const bool empty = l[k] == 0.0f;
      const float inv = empty ? 0.0f : 1.0f / l[k];
      const float zk = empty ? 0.0f : z[k];
      const float lse = empty ? -INFINITY : (m[k] + __log2f(l[k])) * kLn2;
      if (p.max_splits == 1) {
#pragma unroll
        for (int n = 0; n < kON; ++n) {
          const int64_t at = out_row * kD + 8 * n + 2 * tq;
          decode_detail::StoreOutput(p.output, p.out_dtype, at, (acc[n][2 * k] + zk) * inv);
          decode_detail::StoreOutput(p.output, p.out_dtype, at + 1,
                                     (acc[n][2 * k + 1] + zk) * inv);
        }
        if (tq == 0) p.lse[out_row] = lse;
      } else {
        float* out = p.partial_out + (out_row * p.max_splits + split) * kD;
#pragma unroll
        for (int n = 0; n < kON; ++n) {
          *reinterpret_cast<float2*>(out + 8 * n + 2 * tq) =
              make_float2((acc[n][2 * k] + zk) * inv, (acc[n][2 * k + 1] + zk) * inv);
        }
        if (tq == 0) p.partial_lse[out_row * p.max_splits + split] = lse;
      }
    }
  }
};

// Grid row_tiles · max_splits · num_kv_heads: (slot, KV head), row-tile slots (FindRowTile). The context a tile reads runs from its
// first row's window start to its last row's token; a split is tokens_per_split of that. The
// compressed kinds load the next tile's codes into registers before this tile's MMAs (RawTile);
// the plain kinds load each tile straight into shared memory.
template <KeyKind kKind, int kValueBits, int kD, int kRowWarps>
__global__ void __launch_bounds__(kWarps * 32) ChunkAttentionKernel(const ChunkParams p) {
  using Cta = ChunkCta<kKind, kValueBits, kD, kRowWarps>;
  extern __shared__ __align__(16) uint8_t smem[];
  int h, slot;
  SlotOfBlock(p, h, slot);
  const int split = slot / p.row_tiles;
  int b, tile;
  FindRowTile(p, Cta::kRows, slot % p.row_tiles, b, tile);
  Cta cta(p, smem, tile, b, h);
  if (cta.row0 >= cta.row_end) {  // the sequence has fewer rows
    GridDependencyWait();         // ChunkParams::programmatic
    return;
  }
  const SplitSpan span = SplitSpanOf(p, cta.ctx0, cta.group, cta.row0, cta.row_end, split);
  const int split_begin = span.begin, split_end = span.end;
  const int32_t* table = p.block_tables + int64_t{b} * p.max_blocks_per_seq;
  cta.LoadQuery(h);
  const SplitIds staged =
      StageSplitIds<kWarps * 32>(p, table, span, reinterpret_cast<int32_t*>(smem + Cta::L::kIds));
  const int32_t* ids = staged.ids;
  const int id_base = staged.base;
  __syncthreads();

  RawTile<kKind, kValueBits, kD, Cta::kRows> raw;
  if constexpr (!Cta::kPlain) {
    if (split_begin < split_end) raw.Fetch(p, ids, id_base, h, split_begin, split_end);
  }
  const int tok0 = cta.kv_part * Cta::kWarpTokens;
  for (int tile_begin = split_begin; tile_begin < split_end; tile_begin += Cta::kKv) {
    __syncthreads();  // the previous tile has been used
    if constexpr (Cta::kPlain) {
      LoadKvTile<kKind, kValueBits, kD, Cta::kRows>(p, smem, table, h, tile_begin, split_end);
    } else {
      raw.Commit(smem);
    }
    __syncthreads();
    if constexpr (!Cta::kPlain) {
      if (tile_begin + Cta::kKv < split_end) {
        raw.Fetch(p, ids, id_base, h, tile_begin + Cta::kKv, split_end);
      }
    }
    if (!cta.active() || tile_begin + tok0 >= split_end) continue;
    float s[Cta::kSN][4] = {};
    cta.Scores(tok0, s);
    cta.Softmax(tile_begin, tok0, split_end, s);
    cta.Accumulate(tok0, s);
  }
  cta.Merge();
  if (cta.kv_part == 0 && cta.active()) cta.Write(h, split);
  GridDependencyWait();  // ChunkParams::programmatic
}

template <KeyKind kKind, int kValueBits, int kD, int kRowWarps>
cudaError_t LaunchChunk(const ChunkParams& p, cudaStream_t stream) {
  constexpr int kSmem = ChunkLayout<kD, kQueryParts<kKind>, 16 * kRowWarps>::kBytes;
  auto* kernel = ChunkAttentionKernel<kKind, kValueBits, kD, kRowWarps>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(static_cast<unsigned>(p.row_tiles * p.max_splits * p.num_kv_heads));
  return LaunchChunkGrid(kernel, grid, kWarps * 32, kSmem, stream, p);
}

// 16 · row_warps query rows per CTA: 1 and 2 for few rows (the other warps split each KV tile),
// 4 for long chunks. At D = 256 a tile of 32 tokens splits in two parts at most.
template <KeyKind kKind, int kValueBits, int kD>
cudaError_t LaunchChunkOfDim(const ChunkParams& p, cudaStream_t stream) {
  switch (p.row_warps) {
    case 1:
      if constexpr (kD != 256) return LaunchChunk<kKind, kValueBits, kD, 1>(p, stream);
      return cudaErrorInvalidValue;
    case 2:
      return LaunchChunk<kKind, kValueBits, kD, 2>(p, stream);
    case 4:
      return LaunchChunk<kKind, kValueBits, kD, 4>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <KeyKind kKind, int kValueBits>
cudaError_t LaunchChunkOfBits(int head_dim, const ChunkParams& p, cudaStream_t stream) {
  if (p.query_fwht) return cudaErrorInvalidValue;  // the chunk kernel reads a rotated query
  switch (head_dim) {
    case 64:
      return LaunchChunkOfDim<kKind, kValueBits, 64>(p, stream);
    case 128:
      return LaunchChunkOfDim<kKind, kValueBits, 128>(p, stream);
    case 256:
      return LaunchChunkOfDim<kKind, kValueBits, 256>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace tqkv::attention_detail
