// The chunk attention kernel's shared-memory layout and its KV tiles: fragment loads and 16-bit
// conversions, ChunkLayout, and the loads of one KV tile of every cache kind — dequantized
// straight into shared memory (LoadKvTile), or for the compressed kinds as raw words in registers
// first (RawTile: fetched before the current tile's MMAs, committed to shared memory after them).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_launch.h"
#include "attention/decode_device.cuh"

namespace tqkv::attention_detail {

using decode_detail::E4M3x2HiToHalf2;
using decode_detail::E4M3x2ToHalf2;
using decode_detail::GridDependencyWait;
using decode_detail::IsPlain;

// Launches a kernel of this family on `grid`, as a programmatic dependent of the kernel before it
// where p.programmatic says so (ChunkParams::programmatic).
template <typename Kernel>
cudaError_t LaunchChunkGrid(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream,
                            const ChunkParams& p) {
  if (p.programmatic) {
    return decode_detail::LaunchDependent(kernel, grid, dim3(threads), smem, stream, p);
  }
  kernel<<<grid, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <bool kFp16>
__device__ __forceinline__ uint16_t ToBits(float x) {
  if constexpr (kFp16) {
    return __half_as_ushort(__float2half_rn(x));
  } else {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
}
template <bool kFp16>
__device__ __forceinline__ float FromBits(uint16_t b) {
  if constexpr (kFp16) {
    return __half2float(__ushort_as_half(b));
  } else {
    return __bfloat162float(__ushort_as_bfloat16(b));
  }
}
// x as hi + lo parts of the MMA type, packed in pairs (x0 in the low half).
template <bool kFp16>
__device__ __forceinline__ void SplitPair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const uint16_t h0 = ToBits<kFp16>(x0), h1 = ToBits<kFp16>(x1);
  const uint16_t l0 = ToBits<kFp16>(x0 - FromBits<kFp16>(h0));
  const uint16_t l1 = ToBits<kFp16>(x1 - FromBits<kFp16>(h1));
  hi = uint32_t{h0} | uint32_t{h1} << 16;
  lo = uint32_t{l0} | uint32_t{l1} << 16;
}

__device__ __forceinline__ float LoadQueryElement(const void* q, DType t, int64_t i) {
  if (t == DType::kF32) return static_cast<const float*>(q)[i];
  if (t == DType::kF16) return __half2float(static_cast<const __half*>(q)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(q)[i]);
}

inline constexpr int kMaxStagedIds = 512;

// The tokens split `split` of a row tile reads, [begin, end): the tile's rows row0 .. row_end − 1
// (new token r / group at position ctx0 + r / group) see from the first row's window start (0
// without a window) to the last row's own token, and a split is tokens_per_split of that.
struct SplitSpan {
  int begin, end;
};
__device__ __forceinline__ SplitSpan SplitSpanOf(const ChunkParams& p, int ctx0, int group,
                                                 int row0, int row_end, int split) {
  const int first_i = row0 / group, last_i = (row_end - 1) / group;
  const int kv_end = ctx0 + last_i + 1;
  const int kv_begin = p.sliding_window > 0 ? max(0, ctx0 + first_i - p.sliding_window + 1) : 0;
  const int begin = kv_begin + split * p.tokens_per_split;
  return {begin, min(kv_end, begin + p.tokens_per_split)};
}

// The block ids of a split's tokens: token t's block is ids[t / block_size − base]. Copied into
// shared memory (smem_ids) by the CTA's kThreads threads where they fit (kMaxStagedIds), so that
// no tile's loads wait on a dependent global load of the block table; the caller synchronizes
// the CTA before reading them.
struct SplitIds {
  const int32_t* ids;
  int base;
};
template <int kThreads>
__device__ __forceinline__ SplitIds StageSplitIds(const ChunkParams& p, const int32_t* table,
                                                  SplitSpan span, int32_t* smem_ids) {
  const int id_begin = span.begin / p.block_size;
  const int id_count = span.end > span.begin ? (span.end - 1) / p.block_size - id_begin + 1 : 0;
  const bool staged = id_count <= kMaxStagedIds;
  if (staged) {
    for (int i = threadIdx.x; i < id_count; i += kThreads) smem_ids[i] = table[id_begin + i];
  }
  return staged ? SplitIds{smem_ids, id_begin} : SplitIds{table, 0};
}

// The KV head and row-tile slot of this CTA: by head (all of head 0's slots, then head 1's), or with
// heads_fastest every head's slot 0, then every head's slot 1, ... (ChunkParams::heads_fastest).
__device__ __forceinline__ void SlotOfBlock(const ChunkParams& p, int& h, int& slot) {
  const int x = static_cast<int>(blockIdx.x);
  if (p.heads_fastest) {
    h = x % p.num_kv_heads;
    slot = x / p.num_kv_heads;
  } else {
    h = x / (p.row_tiles * p.max_splits);
    slot = x % (p.row_tiles * p.max_splits);
  }
}

// The (sequence b, row tile) of row-tile slot x: sequence b's tiles of `rows` rows take the slots
// from floor((query_start_loc[b] − query_start_loc[0]) · G / rows) + b on (query_start_loc[0] is
// not 0 where the call's leading decode rows run apart), which strictly increase with b and leave
// room for its ceil(q_len · G / rows) tiles; a slot past them gets a tile with no rows. The
// tiles go last first: the causal mask gives a sequence's last tile the most context to read, so
// the longest CTAs start first and the short ones fill the end of the grid.
__device__ __forceinline__ void FindRowTile(const ChunkParams& p, int rows, int x, int& b,
                                            int& tile) {
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int first = p.query_start_loc[0];
  auto start = [&](int s) {
    return static_cast<int>(int64_t{p.query_start_loc[s] - first} * group / rows) + s;
  };
  int lo = 0, hi = p.num_seqs - 1;  // the last sequence whose first slot is at or before x
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (start(mid) <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  b = lo;
  const int k = x - start(lo);
  const int tiles =
      static_cast<int>((int64_t{p.query_start_loc[lo + 1] - p.query_start_loc[lo]} * group +
                        rows - 1) / rows);
  tile = k < tiles ? tiles - 1 - k : k;
}

// The shared-memory layout of one CTA: rows of head_dim 16-bit elements at a pitch of
// 2·D + 16 bytes, so that the 8 row addresses of an ldmatrix phase fall on distinct bank groups.
// The query is held as kQParts parts (hi, lo; bf16 caches: hi, mid, lo, so that bf16 parts carry
// the fp32 query's 24 bits).
template <int kD, int kQParts, int kRows = kRowsPerCta>
struct ChunkLayout {
  static constexpr int kKv = KvTile(kD);
  static constexpr uint32_t kPitch = 2 * kD + 16;
  static constexpr uint32_t kQ = 0;  // part j of row r at kQ + (j · kRows + r) · kPitch
  static constexpr uint32_t kKHi = kQ + kQParts * kRows * kPitch;
  static constexpr uint32_t kKLo = kKHi + kKv * kPitch;
  static constexpr uint32_t kV = kKLo + kKv * kPitch;
  static constexpr uint32_t kKScale = kV + kKv * kPitch;  // float [kKv]: log2-domain key scale
  static constexpr uint32_t kVScale = kKScale + 4 * kKv;  // float [kKv]
  static constexpr uint32_t kVZero = kVScale + 4 * kKv;   // float [kKv]
  static constexpr uint32_t kCodebook = kVZero + 4 * kKv;  // uint32 [16]: hi | lo << 16
  // The block ids of a split, where they fit (kMaxStagedIds): no dependent global load of the
  // block table before each tile's loads.
  static constexpr uint32_t kIds = kCodebook + 64;
  static constexpr int kBytes = kIds + 4 * kMaxStagedIds;
};

template <KeyKind kKind>
inline constexpr int kQueryParts = kKind == KeyKind::kBf16 ? 3 : 2;

// The 8 codes of element group e8 (elements 8·e8 .. 8·e8 + 7) of a bit stream at `src`, as the
// low bits of a 32-bit (4-bit codes) or 24-bit (3-bit codes) word.
template <int kBits>
__device__ __forceinline__ uint32_t LoadCodes8(const uint8_t* src, int e8) {
  if constexpr (kBits == 4) {
    return __ldg(reinterpret_cast<const uint32_t*>(src) + e8);
  } else {
    const uint8_t* p = src + 3 * e8;
    return uint32_t{__ldg(p)} | uint32_t{__ldg(p + 1)} << 8 | uint32_t{__ldg(p + 2)} << 16;
  }
}

// Dequantizes KV tile [tile_begin, tile_begin + kKv) of KV head h (tokens at or past `end`:
// zeros) into shared memory.
template <KeyKind kKind, int kValueBits, int kD, int kRows>
__device__ __forceinline__ void LoadKvTile(const ChunkParams& p, uint8_t* smem,
                                           const int32_t* table, int h, int tile_begin, int end) {
  using L = ChunkLayout<kD, kQueryParts<kKind>, kRows>;
  constexpr int kGroups = kD / 8;  // 8-element groups per row
  constexpr bool kPlain = IsPlain(kKind);
  for (int u = threadIdx.x; u < L::kKv * kGroups; u += kWarps * 32) {
    const int j = u / kGroups, e8 = u % kGroups;
    const int t = tile_begin + j;
    uint4 k_hi = {0, 0, 0, 0}, k_lo = {0, 0, 0, 0}, v = {0, 0, 0, 0};
    if (t < end) {
      const uint8_t* block = p.cache + int64_t{table[t / p.block_size]} * p.block_bytes;
      const int pos = t % p.block_size;
      if constexpr (kPlain) {
        const int64_t at = 2 * ((int64_t{pos} * p.num_kv_heads + h) * kD) + 16 * e8;
        k_hi = __ldg(reinterpret_cast<const uint4*>(block + at));
        v = __ldg(reinterpret_cast<const uint4*>(block + p.meta_offset + at));
      } else {
        const uint8_t* slot =
            block + (int64_t{pos} * p.num_kv_heads + h) * p.data_per_slot;
        if constexpr (kKind == KeyKind::kFp8) {
          const uint2 w = __ldg(reinterpret_cast<const uint2*>(slot) + e8);
          k_hi.x = E4M3x2ToHalf2(w.x);
          k_hi.y = E4M3x2HiToHalf2(w.x);
          k_hi.z = E4M3x2ToHalf2(w.y);
          k_hi.w = E4M3x2HiToHalf2(w.y);
        } else {
          constexpr int kKeyBits = kKind == KeyKind::kMse4 ? 4 : 3;
          const uint32_t codes = LoadCodes8<kKeyBits>(slot, e8);
          const uint32_t* cb = reinterpret_cast<const uint32_t*>(smem + L::kCodebook);
          uint32_t hi[4], lo[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint32_t c0 = cb[(codes >> (2 * k * kKeyBits)) & ((1u << kKeyBits) - 1u)];
            const uint32_t c1 = cb[(codes >> ((2 * k + 1) * kKeyBits)) & ((1u << kKeyBits) - 1u)];
            hi[k] = (c0 & 0xFFFFu) | (c1 << 16);
            lo[k] = (c0 >> 16) | (c1 & 0xFFFF0000u);
          }
          k_hi = {hi[0], hi[1], hi[2], hi[3]};
          k_lo = {lo[0], lo[1], lo[2], lo[3]};
        }
        const uint32_t vcodes = LoadCodes8<kValueBits>(slot + p.key_data_bytes, e8);
        uint32_t vw[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t c0 = (vcodes >> (2 * k * kValueBits)) & ((1u << kValueBits) - 1u);
          const uint32_t c1 = (vcodes >> ((2 * k + 1) * kValueBits)) & ((1u << kValueBits) - 1u);
          const __half2 pair = __floats2half2_rn(static_cast<float>(c0), static_cast<float>(c1));
          vw[k] = *reinterpret_cast<const uint32_t*>(&pair);
        }
        v = {vw[0], vw[1], vw[2], vw[3]};
      }
    }
    const uint32_t row = j * L::kPitch + 16 * e8;
    *reinterpret_cast<uint4*>(smem + L::kKHi + row) = k_hi;
    if constexpr (kKind == KeyKind::kMse4 || kKind == KeyKind::kMse3) {
      *reinterpret_cast<uint4*>(smem + L::kKLo + row) = k_lo;
    }
    *reinterpret_cast<uint4*>(smem + L::kV + row) = v;
  }
  // Per-token scales: keys' (log2-domain softmax scale, times the norm for MSE keys), values'.
  for (int j = threadIdx.x; j < L::kKv; j += kWarps * 32) {
    const int t = tile_begin + j;
    float ks = 0.0f, vs = 0.0f, vz = 0.0f;
    if (t < end) {
      ks = p.score_scale;
      if constexpr (!kPlain) {
        const uint8_t* block = p.cache + int64_t{table[t / p.block_size]} * p.block_bytes;
        const int pos = t % p.block_size;
        const __half* meta = reinterpret_cast<const __half*>(block + p.meta_offset) +
                             int64_t{h} * p.num_meta * p.block_size + pos;
        int f = 0;
        if constexpr (kKind != KeyKind::kFp8) ks *= __half2float(meta[p.block_size * f++]);
        vs = __half2float(meta[p.block_size * f++]);
        vz = __half2float(meta[p.block_size * f]);
      }
    }
    reinterpret_cast<float*>(smem + L::kKScale)[j] = ks;
    reinterpret_cast<float*>(smem + L::kVScale)[j] = vs;
    reinterpret_cast<float*>(smem + L::kVZero)[j] = vz;
  }
}

// The compressed kinds' next KV tile as raw words in registers: loaded before the current tile's
// MMAs (so that the loads are in flight while they run) and dequantized into shared memory after
// them. Each thread holds the codes of kUnits 8-element groups and one token's metadata.
template <KeyKind kKind, int kValueBits, int kD, int kRows>
struct RawTile {
  static constexpr int kKv = KvTile(kD);
  static constexpr int kGroups = kD / 8;
  static constexpr int kUnits = kKv * kGroups / (kWarps * 32);
  static_assert(kKv * kGroups % (kWarps * 32) == 0 && kKv <= kWarps * 32);
  static constexpr int kKeyWords = kKind == KeyKind::kFp8 ? 2 : 1;
  uint32_t key[kUnits][kKeyWords];
  uint32_t value[kUnits];
  float ks, vs, vz;

  // ids[t / block_size − id_base]: the split's ids staged in shared memory, or the block table.
  __device__ __forceinline__ void Fetch(const ChunkParams& p, const int32_t* ids, int id_base,
                                        int h, int tile_begin, int end) {
    // Unit threadIdx.x + 128·k is (token j0 + k·128 / kGroups, group e8): nothing per unit to keep
    // in registers across tiles.
    const int e8 = static_cast<int>(threadIdx.x % kGroups), j0 = static_cast<int>(threadIdx.x / kGroups);
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {
      const int j = j0 + k * (kWarps * 32 / kGroups);
      const int t = tile_begin + j;
      key[k][0] = 0;
      if constexpr (kKeyWords == 2) key[k][1] = 0;
      value[k] = 0;
      if (t < end) {
        const uint8_t* slot = p.cache + int64_t{ids[t / p.block_size - id_base]} * p.block_bytes +
                              (int64_t{t % p.block_size} * p.num_kv_heads + h) * p.data_per_slot;
        if constexpr (kKind == KeyKind::kFp8) {
          const uint2 w = __ldg(reinterpret_cast<const uint2*>(slot) + e8);
          key[k][0] = w.x;
          key[k][1] = w.y;
        } else {
          key[k][0] = LoadCodes8<kKind == KeyKind::kMse4 ? 4 : 3>(slot, e8);
        }
        value[k] = LoadCodes8<kValueBits>(slot + p.key_data_bytes, e8);
      }
    }
    ks = vs = vz = 0.0f;
    const int t = tile_begin + static_cast<int>(threadIdx.x);
    if (threadIdx.x < kKv && t < end) {
      const uint8_t* block = p.cache + int64_t{ids[t / p.block_size - id_base]} * p.block_bytes;
      const __half* meta = reinterpret_cast<const __half*>(block + p.meta_offset) +
                           int64_t{h} * p.num_meta * p.block_size + t % p.block_size;
      int f = 0;
      ks = p.score_scale;
      if constexpr (kKind != KeyKind::kFp8) ks *= __half2float(meta[p.block_size * f++]);
      vs = __half2float(meta[p.block_size * f++]);
      vz = __half2float(meta[p.block_size * f]);
    }
  }

  __device__ __forceinline__ void Commit(uint8_t* smem) const {
    using L = ChunkLayout<kD, kQueryParts<kKind>, kRows>;
    const int e8 = static_cast<int>(threadIdx.x % kGroups), j0 = static_cast<int>(threadIdx.x / kGroups);
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {
      const int j = j0 + k * (kWarps * 32 / kGroups);
      uint4 k_hi, k_lo = {0, 0, 0, 0};
      if constexpr (kKind == KeyKind::kFp8) {
        k_hi.x = E4M3x2ToHalf2(key[k][0]);
        k_hi.y = E4M3x2HiToHalf2(key[k][0]);
        k_hi.z = E4M3x2ToHalf2(key[k][1]);
        k_hi.w = E4M3x2HiToHalf2(key[k][1]);
      } else {
        constexpr int kKeyBits = kKind == KeyKind::kMse4 ? 4 : 3;
        const uint32_t* cb = reinterpret_cast<const uint32_t*>(smem + L::kCodebook);
        uint32_t hi[4], lo[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint32_t c0 = cb[(key[k][0] >> (2 * q * kKeyBits)) & ((1u << kKeyBits) - 1u)];
          const uint32_t c1 =
              cb[(key[k][0] >> ((2 * q + 1) * kKeyBits)) & ((1u << kKeyBits) - 1u)];
          hi[q] = (c0 & 0xFFFFu) | (c1 << 16);
          lo[q] = (c0 >> 16) | (c1 & 0xFFFF0000u);
        }
        k_hi = {hi[0], hi[1], hi[2], hi[3]};
        k_lo = {lo[0], lo[1], lo[2], lo[3]};
      }
      uint32_t vw[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t c0 = (value[k] >> (2 * q * kValueBits)) & ((1u << kValueBits) - 1u);
        const uint32_t c1 = (value[k] >> ((2 * q + 1) * kValueBits)) & ((1u << kValueBits) - 1u);
        const __half2 pair = __floats2half2_rn(static_cast<float>(c0), static_cast<float>(c1));
        vw[q] = *reinterpret_cast<const uint32_t*>(&pair);
      }
      const uint32_t row = j * L::kPitch + 16 * e8;
      *reinterpret_cast<uint4*>(smem + L::kKHi + row) = k_hi;
      if constexpr (kKind != KeyKind::kFp8) {
        *reinterpret_cast<uint4*>(smem + L::kKLo + row) = k_lo;
      }
      *reinterpret_cast<uint4*>(smem + L::kV + row) = uint4{vw[0], vw[1], vw[2], vw[3]};
    }
    if (threadIdx.x < kKv) {
      reinterpret_cast<float*>(smem + L::kKScale)[threadIdx.x] = ks;
      reinterpret_cast<float*>(smem + L::kVScale)[threadIdx.x] = vs;
      reinterpret_cast<float*>(smem + L::kVZero)[threadIdx.x] = vz;
    }
  }
};

}  // namespace tqkv::attention_detail
