// The prefill kernel at head_dim 128 on Hopper, for the compressed kinds and the bf16 / fp16
// caches: FlashAttention-3's structure (warpgroup MMAs from shared memory, producer and consumer
// warpgroups) with the compressed cache dequantized by the producers. Same rows, grid and outputs
// as the mma.sync prefill kernel (attention/attention_prefill.cuh), which serves the other shapes
// and devices, at the same precision class: the query rounded once to fp16, each token's scales
// applied by the producers so that the consumers run FlashAttention's softmax with no per-token
// factors (MSE keys: centroid · norm rounded once to fp16; FP8 keys exactly; values (code · scale
// + zero) / 16 rounded once to fp16, P · 16 rounded once to fp16). The bf16 / fp16 caches: keys
// and values as stored, the query and P rounded once to the cache's type (bf16 MMAs for the bf16
// cache), as FlashAttention rounds them.
//
// One CTA = (128-row tile, split of the context, KV head, sequence), four warpgroups (setmaxnreg
// gives the producers 80 registers, the consumers 176):
//   key producers (0-3),    per 64-token KV tile, in a ring of kWgStages stages: the key
//   value producers (4-7)   warpgroup writes the tile's keys in fp16 (MSE: centroid · norm; FP8:
//                           the values); the value warpgroup the values (code · scale + zero) in
//                           fp16, transposed (Vᵀ: head_dim rows of 64 tokens); both in the MMAs'
//                           128-byte swizzled layout. The value warpgroup (FP8 keys: the key
//                           warpgroup, kWgKeysCopy) also copies the raw tiles (slots and
//                           metadata, by cp.async) three tiles ahead into a ring of its own
//                           (bf16 / fp16 caches: key and value rows, one tile ahead; the key
//                           warpgroup copies the key rows into place, the value warpgroup
//                           transposes the values);
//   consumers (8-15)        64 rows per warpgroup: S = Q · Kᵀ (8 wgmma 64×64×16, the query
//                           from registers, the keys from shared memory), mask, online softmax
//                           in registers (the softmax scale in the exponent's FMA), O += P · V
//                           (4 wgmma 64×128×16, P from registers); where most of the CTA's
//                           tiles come dequantized, tile j + 1's S issued before tile j's P · V
//                           (FlashAttention-3's in-warpgroup overlap).
// A stage's "full" barrier completes when both producer warpgroups have written it, its "empty"
// barrier when both consumer warpgroups are done with it. The tiles of a long chunk's own tokens
// come dequantized (ChunkParams::tiles, written before by DequantTilesKernel with the producers'
// code): the value warpgroup's first thread copies each into its stage with one bulk copy, whose
// bytes the full barrier waits for.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "attention/attention_launch.h"
#include "attention/attention_tiles.cuh"
#include "attention/decode_device.cuh"
#include "attention/wgmma.cuh"

namespace tqkv::attention_detail {

inline constexpr int kWgTile = 64;   // KV tokens per tile
inline constexpr int kWgStages = 3;  // tiles in flight between the producers and the consumers
inline constexpr int kWgThreads = 512;
// Registers per thread after the split (setmaxnreg): 256 · (80 + 176) = the whole file. The
// consumers hold the query's MMA fragments (32) beside O (64) and S (32).
inline constexpr int kWgProducerRegs = 80;
inline constexpr int kWgConsumerRegs = 176;
// Whether the key warpgroup, rather than the value warpgroup, copies the raw tiles: for FP8 keys,
// whose conversion is the lightest of the producers' work (H200: 4bit_nc and k3v4_nc 0 to +2 %
// with the keys copying, k8v4 -1 to -6.5 %).
template <KeyKind kKind>
inline constexpr bool kWgKeysCopy = kKind == KeyKind::kFp8;
// The compressed kinds' values are written into the stages divided by 2^kValueShrink, so that any
// finite fp16 scale and zero give a finite fp16 value; P carries the factor back (P = 16 · p, at
// most 2^(4 + kLazyMax)) and the row sums are divided by it at the end.
inline constexpr int kValueShrink = 4;
// How far (log2) a score may pass its row's softmax reference before the reference moves.
inline constexpr float kLazyMax = 8.0f;
// ChunkParams::tiles (attention_launch.h, PrefillTilesFor): a long chunk has the tiles of its own
// tokens dequantized once (DequantTilesKernel, the producers' code); the kernel's producers copy
// each into a stage, one bulk copy per tile, instead of dequantizing it again for every row tile
// after it.
inline constexpr uint32_t kWgTileBytes = kPrefillTileBytes;  // a stage: keys, then Vᵀ
static_assert(kWgTileBytes == 2 * 64 * 128 + 128 * 128);

#if defined(__CUDA_ARCH__)
// Whether sequence i takes dequantized tiles (PrefillTilesFor).
__device__ __forceinline__ bool TakesTiles(const ChunkParams& p, int i) {
  const int q_len = p.query_start_loc[i + 1] - p.query_start_loc[i];
  return PrefillTilesFor(q_len, p.seq_lens[i] - q_len);
}

// Sequence b's first slot in ChunkParams::tiles (q_start = query_start_loc[b];
// PrefillFirstTileSlot of the sequences before b that take tiles). Every thread of the CTA calls
// it (a barrier per blockDim.x sequences before b).
__device__ __forceinline__ int FirstTileSlot(const ChunkParams& p, int b, int q_start) {
  int before = 0;
  for (int i0 = 0; i0 < b; i0 += static_cast<int>(blockDim.x)) {
    const int i = i0 + static_cast<int>(threadIdx.x);
    before += __syncthreads_count(i < b && TakesTiles(p, i));
  }
  return PrefillFirstTileSlot(q_start, before);
}
#endif

// A tile's raw bytes as the cache holds them: each token's slot (key codes then value codes) and
// the tokens' fp16 metadata, per field in 8-token groups. Only the layouts of head_dim 128 whose
// slots are whole 16-byte pieces (every preset's) run here. The bf16 / fp16 caches: each token's
// key row then its value row (256 bytes each), no metadata.
template <KeyKind kKind, int kValueBits>
struct WgRawLayout {
  static constexpr bool kMse = kKind == KeyKind::kMse4 || kKind == KeyKind::kMse3;
  static constexpr bool kPlain = IsPlain(kKind);
  static constexpr int kKeyBytes = kPlain                   ? 256
                                   : kKind == KeyKind::kFp8 ? 128
                                   : kKind == KeyKind::kMse4 ? 64
                                                             : 48;
  static constexpr int kSlot = kKeyBytes + 16 * kValueBits;  // data_per_slot (plain: 512)
  static constexpr int kMeta = kPlain ? 0 : kMse ? 3 : 2;    // num_meta
  static_assert(kSlot % 16 == 0);
  static constexpr uint32_t kMetaOffset = kWgTile * kSlot;  // field f at + f · 2 · kWgTile
  static constexpr uint32_t kBytes = kMetaOffset + kMeta * 2 * kWgTile;
};

// Shared memory (offsets from a 1024-byte aligned base): the query [2 swizzle atoms of 64 dims][128
// rows][128 B]; per stage keys [2 atoms][64 tokens][128 B] then Vᵀ [128 dims][64 tokens · 2 B];
// the barriers; the split's block ids; kWgRawStages raw tiles. About 168 KB for 4bit_nc: one CTA
// per SM.
inline constexpr int kWgRawStages = 4;  // raw tiles in flight: copies of 3 tiles ahead
template <KeyKind kKind, int kValueBits>
struct WgLayout {
  static constexpr int kD = 128;
  static constexpr uint32_t kAtom = 128 * 128;  // a query atom: 128 rows of 128 bytes
  static constexpr uint32_t kQ = 0;
  static constexpr uint32_t kKAtom = kWgTile * 128;
  static constexpr uint32_t kKBytes = 2 * kKAtom;
  static constexpr uint32_t kStageBytes = kKBytes + kD * 128;
  static_assert(kStageBytes == kWgTileBytes);
  static constexpr uint32_t kStage0 = kQ + 2 * kAtom;
  static constexpr uint32_t kFull = kStage0 + kWgStages * kStageBytes;  // uint64 [stages]
  static constexpr uint32_t kEmpty = kFull + 8 * kWgStages;
  static constexpr uint32_t kIds = kEmpty + 8 * kWgStages;
  static constexpr uint32_t kRaw = kIds + 4 * kMaxStagedIds;  // raw tile r at kRaw + r · kRawBytes
  static constexpr uint32_t kRawBytes = WgRawLayout<kKind, kValueBits>::kBytes;
  // Raw tiles in flight (copies kRawStages − 1 tiles ahead): the bf16 / fp16 caches' 32 KB raw
  // tiles leave room for two.
  static constexpr int kRawStages = IsPlain(kKind) ? 2 : kWgRawStages;
  static constexpr int kBytes = kRaw + kRawStages * kRawBytes + 1024;  // + the base's alignment
  static_assert(kFull % 8 == 0 && kRaw % 16 == 0);  // mbarriers; cp.async's 16-byte pieces
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// out[i], out[i + 1] = x0, x1 in the output dtype (i even; F16 saturating): one store.
__device__ __forceinline__ void StoreOutputPair(void* out, DType dtype, int64_t i, float x0,
                                                float x1) {
  if (dtype == DType::kF32) {
    *reinterpret_cast<float2*>(static_cast<float*>(out) + i) = make_float2(x0, x1);
  } else {
    *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(out) + i) =
        dtype == DType::kF16 ? decode_detail::PackOutput<true>(x0, x1)
                             : decode_detail::PackOutput<false>(x0, x1);
  }
}

// (t / d, t % d) for 0 <= t < 2^24 and d >= 1: a float estimate, corrected once.
__device__ __forceinline__ void DivMod(int t, int d, float inv_d, int& q, int& r) {
  q = __float2int_rz(static_cast<float>(t) * inv_d);
  r = t - q * d;
  if (r < 0) {
    --q;
    r += d;
  } else if (r >= d) {
    ++q;
    r -= d;
  }
}

// The producers: copies of raw tiles into the raw ring (cp.async, kWgRawStages − 1 tiles ahead),
// then each raw tile dequantized into a stage. For the dequantization a thread takes tokens
// 8·tb .. 8·tb + 7 of the tile (one block: block_size is a multiple of 8 and tiles start on
// multiples of 64) and dims 8·db .. 8·db + 7.
template <KeyKind kKind, int kValueBits>
struct WgProducer {
  using R = WgRawLayout<kKind, kValueBits>;
  const ChunkParams& p;
  const uint8_t* smem;
  uint32_t base;
  const int32_t* ids;
  int id_base, h, end, thread, tb, db;
  float inv_block_size;
  // The MSE codebook's fp16 centroids as byte planes in registers (LoadCodebook): low bytes of
  // centroids 4k .. 4k + 3 in lut[k], high bytes in lut[4 + k] (3-bit: lut[0..1], lut[4..5]).
  uint32_t lut[8] = {};

  __device__ __forceinline__ void LoadCodebook() {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t c = p.centroid_hi[4 * k + i];
        lo |= (c & 0xFFu) << (8 * i);
        hi |= (c >> 8) << (8 * i);
      }
      lut[k] = lo;
      lut[4 + k] = hi;
    }
  }

  // x's bytes permuted by the 4-bit selectors of `sel`, a selector's top bit replicating the
  // picked byte's sign over the byte (prmt's default mode).
  static __device__ __forceinline__ uint32_t Prmt(uint32_t x, uint32_t y, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(y), "r"(sel));
    return r;
  }

  // The centroids of 8 codes (element j at bits kBits · j of `codes`) as 4 words of fp16 pairs,
  // elements 2i and 2i + 1 in word i: byte permutes of the codebook's planes, 4 elements per
  // permute. 4-bit codes pick from centroids 0-7 and 8-15 (selector bits 0-2) and choose by bit 3
  // (a byte mask made by sign-replicating permutes); 3-bit codes are spread to one per nibble
  // first.
  template <int kBits>
  __device__ __forceinline__ void Centroids8(uint32_t codes, uint32_t (&q)[4]) const {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t lo, hi;
      if constexpr (kBits == 4) {
        const uint32_t sel = (half ? codes >> 16 : codes) & 0x7777u;
        // Element j's bit 3 is the sign of byte j / 2 of codes << 4 (even j) or of codes (odd j).
        const uint32_t upper = Prmt(codes << 4, codes, half ? 0xFBEAu : 0xD9C8u);
        lo = (__byte_perm(lut[0], lut[1], sel) & ~upper) |
             (__byte_perm(lut[2], lut[3], sel) & upper);
        hi = (__byte_perm(lut[4], lut[5], sel) & ~upper) |
             (__byte_perm(lut[6], lut[7], sel) & upper);
      } else {
        // Four 3-bit fields to four nibbles: pairs of fields to bytes, then fields to nibbles.
        const uint32_t t = (half ? codes >> 12 : codes) & 0xFFFu;
        const uint32_t u = (t & 0x3Fu) | ((t & 0xFC0u) << 2);
        const uint32_t sel = (u & 0x0707u) | ((u & 0x3838u) << 1);
        lo = __byte_perm(lut[0], lut[1], sel);
        hi = __byte_perm(lut[4], lut[5], sel);
      }
      q[2 * half] = __byte_perm(lo, hi, 0x5140);
      q[2 * half + 1] = __byte_perm(lo, hi, 0x7362);
    }
  }

  // Tile [tile_begin, +64)'s slots and metadata (tokens before `end`) into raw tile `raw`: two
  // threads per token, each copying half of its slot's 16-byte pieces; the first thread of each
  // 8-token group also copies the group's metadata. One cp.async group per call, empty or not.
  __device__ __forceinline__ void Copy(int tile_begin, uint32_t raw) const {
    CopyWith(tile_begin, raw, [&](int blk) { return ids[blk - id_base]; });
  }
  // Copy with the block id of this thread's token given (BlockId).
  __device__ __forceinline__ void CopyFrom(int tile_begin, uint32_t raw, int id) const {
    CopyWith(tile_begin, raw, [&](int) { return id; });
  }
  // The block id of this thread's token in the tile at tile_begin (0 past `end`) from `from`, the
  // ids of blocks `first` on.
  __device__ __forceinline__ int BlockId(const int32_t* from, int first, int tile_begin) const {
    const int t = tile_begin + (thread >> 1);
    int blk, pos;
    DivMod(t, p.block_size, inv_block_size, blk, pos);
    return t < end ? from[blk - first] : 0;
  }
  // id_of(block index): the block's id.
  template <typename IdOf>
  __device__ __forceinline__ void CopyWith(int tile_begin, uint32_t raw, const IdOf& id_of) const {
    constexpr int kChunks = R::kSlot / 16;  // 16-byte pieces per slot
    constexpr int kHalf = (kChunks + 1) / 2;
    const int u = thread >> 1, half = thread & 1, t = tile_begin + u;
    if (t < end) {
      int blk, pos;
      DivMod(t, p.block_size, inv_block_size, blk, pos);
      const uint8_t* block = p.cache + int64_t{id_of(blk)} * p.block_bytes;
      // The slot's half, or (plain caches) the token's key row or value row.
      const uint8_t* src =
          R::kPlain ? block + (half ? p.meta_offset : 0) +
                          (int64_t{pos} * p.num_kv_heads + h) * R::kKeyBytes
                    : block + (int64_t{pos} * p.num_kv_heads + h) * R::kSlot + 16 * kHalf * half;
      const uint32_t dst = raw + u * R::kSlot + 16 * kHalf * half;
      constexpr int kMine = kHalf;  // the second half has kChunks - kHalf pieces
      const int mine = kChunks % 2 == 0 || half == 0 ? kHalf : kChunks - kHalf;
#pragma unroll
      for (int i = 0; i < kMine; ++i) {
        // Tokens start at different pieces: one copy's 32 lanes spread over the banks.
        int piece = i + (u & 3);
        piece = piece >= mine ? piece - mine : piece;
        piece = piece >= mine ? piece - mine : piece;
        if (i < mine) decode_detail::CopyAsync16Fill(dst + 16 * piece, src + 16 * piece, 16);
      }
      if (R::kMeta > 0 && (thread & 15) == 0) {  // u = 8·g: the group's metadata, by field
        const uint8_t* meta =
            block + p.meta_offset + 2 * (int64_t{h} * R::kMeta * p.block_size + pos);
#pragma unroll
        for (int f = 0; f < R::kMeta; ++f) {
          decode_detail::CopyAsync16Fill(raw + R::kMetaOffset + 2 * kWgTile * f + 2 * u,
                                         meta + 2 * int64_t{f} * p.block_size, 16);
        }
      }
    }
    decode_detail::CopyAsyncCommit();
  }

  // The bf16 / fp16 caches' raw tile into a stage, tokens 8·tb .. 8·tb + 7 and dims 8·db .. 8·db
  // + 7: kKeys, the key rows as they are; otherwise Vᵀ, an 8 × 8 transpose of 16-bit elements
  // (the byte permutes of each token pair's words give two dims' rows at once). Tokens at or
  // past `end` hold stale bytes: their values are zeroed (P' is 0 there, but 0 · NaN is NaN),
  // their scores masked.
  template <bool kKeys>
  __device__ __forceinline__ void StorePlain(int tile_begin, uint32_t raw, uint8_t* stage) const {
    using L = WgLayout<kKind, kValueBits>;
    const int valid = end - (tile_begin + 8 * tb);
    const uint32_t row0 = raw + 8 * tb * R::kSlot + 16 * db;
    if constexpr (kKeys) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        uint32_t w[4];
        decode_detail::SharedLoad16(row0 + k * R::kSlot, w);
        *reinterpret_cast<uint4*>(stage + (db >> 3) * L::kKAtom +
                                  wgmma::SwizzledChunk(8 * tb + k, db & 7)) =
            uint4{w[0], w[1], w[2], w[3]};
      }
    } else {
      // Lanes take the thread's four dim pairs in different orders (pair (jj + db / 2) % 4 at
      // step jj) so that a store's lanes spread over the banks; the loads pick the pair's word
      // by address, so every register index stays static.
      const int rot = db >> 1;
      uint8_t* vt = stage + L::kKBytes;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = (jj + rot) & 3;
        uint32_t w[8];  // token k's dims 2j, 2j + 1
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          w[k] = k < valid
                     ? decode_detail::SharedLoad4(row0 + k * R::kSlot + R::kKeyBytes + 4 * j)
                     : 0u;
        }
        uint32_t even[4], odd[4];  // dims 2j and 2j + 1: tokens 2i and 2i + 1 in word i
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          even[i] = __byte_perm(w[2 * i], w[2 * i + 1], 0x5410);
          odd[i] = __byte_perm(w[2 * i], w[2 * i + 1], 0x7632);
        }
        *reinterpret_cast<uint4*>(vt + wgmma::SwizzledChunk(8 * db + 2 * j, tb)) =
            uint4{even[0], even[1], even[2], even[3]};
        *reinterpret_cast<uint4*>(vt + wgmma::SwizzledChunk(8 * db + 2 * j + 1, tb)) =
            uint4{odd[0], odd[1], odd[2], odd[3]};
      }
    }
  }

  // The 8 codes of dims 8·db .. 8·db + 7 in a raw stream at byte `at` (4-bit: one word; 3-bit:
  // 24 bits).
  template <int kBits>
  __device__ __forceinline__ uint32_t Codes8(uint32_t at) const {
    if constexpr (kBits == 4) {
      return decode_detail::SharedLoad4(at + 4 * db);
    } else {
      // Bytes 3·db .. 3·db + 2 from the two words around them (the second may be the next
      // field's or token's: inside the raw tile).
      const uint32_t byte = at + 3 * db;
      const uint32_t w0 = decode_detail::SharedLoad4(byte & ~3u);
      const uint32_t w1 = decode_detail::SharedLoad4((byte & ~3u) + 4);
      return __funnelshift_r(w0, w1, 8 * (byte & 3));
    }
  }

  // Raw tile `raw` (tokens from tile_begin) into a stage, every token's scales applied here so
  // that the consumers' scores and P·V need none. kKeys (the key warpgroup): 8 key rows of 16
  // bytes as fp16 (MSE: centroid · norm, rounded once; FP8: the values, exactly); otherwise 8 Vᵀ
  // rows of 16 bytes, (code · scale + zero) / 16 rounded once to fp16 (kValueShrink: any finite
  // fp16 scale and zero then give a finite value, |zero| + 15 · |scale| ≤ 16 · 65504, also
  // metadata tqkv's store never writes but a cache converted from elsewhere may hold). The
  // metadata of tokens at or past `end` (never copied: stale) reads as 0, which zeroes their keys
  // and values (their scores are masked too).
  template <bool kKeys>
  __device__ __forceinline__ void Store(int tile_begin, uint32_t raw, uint8_t* stage) const {
    using L = WgLayout<kKind, kValueBits>;
    const int valid = end - (tile_begin + 8 * tb);
    uint32_t meta[R::kMeta][4];
#pragma unroll
    for (int f = 0; f < R::kMeta; ++f) {
      if (kKeys != (f == 0 && R::kMse)) continue;  // keys: the norms; values: scale and zero
      decode_detail::SharedLoad16(raw + R::kMetaOffset + 2 * kWgTile * f + 16 * tb, meta[f]);
      if (valid < 8) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          meta[f][i] = 2 * i >= valid ? 0u : 2 * i + 1 >= valid ? meta[f][i] & 0xFFFFu : meta[f][i];
        }
      }
    }
    const uint32_t row0 = raw + 8 * tb * R::kSlot;
    if constexpr (kKeys) {
      // The 8 tokens' codes are loaded before any stage store: a load after a store to shared
      // memory waits for it (the compiler cannot tell the raw ring from the stage), so loads
      // between the stores would expose their latency 8 times.
      constexpr int kWords = kKind == KeyKind::kFp8 ? 2 : 1;
      uint32_t code[8][kWords];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint32_t at = row0 + k * R::kSlot;
        if constexpr (kKind == KeyKind::kFp8) {
          decode_detail::SharedLoad8(at + 8 * db, code[k]);
        } else {
          code[k][0] = Codes8<kKind == KeyKind::kMse4 ? 4 : 3>(at);
        }
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        uint32_t q[4];
        if constexpr (kKind == KeyKind::kFp8) {
          const uint32_t(&w)[kWords] = code[k];
          q[0] = E4M3x2ToHalf2(w[0]);
          q[1] = E4M3x2HiToHalf2(w[0]);
          q[2] = E4M3x2ToHalf2(w[1]);
          q[3] = E4M3x2HiToHalf2(w[1]);
        } else {
          constexpr int kBits = kKind == KeyKind::kMse4 ? 4 : 3;
          Centroids8<kBits>(code[k][0], q);
          const uint32_t norm_bits = (meta[0][k / 2] >> (16 * (k % 2))) & 0xFFFFu;
          const __half2 norm = __halves2half2(__ushort_as_half(static_cast<uint16_t>(norm_bits)),
                                              __ushort_as_half(static_cast<uint16_t>(norm_bits)));
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const __half2 kn = __hmul2(*reinterpret_cast<const __half2*>(&q[i]), norm);
            q[i] = *reinterpret_cast<const uint32_t*>(&kn);
          }
        }
        *reinterpret_cast<uint4*>(stage + (db >> 3) * L::kKAtom +
                                  wgmma::SwizzledChunk(8 * tb + k, db & 7)) =
            uint4{q[0], q[1], q[2], q[3]};
      }
    } else {
      // Value dim 8·db + dd of tokens 2m and 2m + 1 (one word): 64 + code / 16 (the code's bits
      // under 64's exponent, whose step is 1/16) minus 64 (exact), then · scale + zero / 16 (the
      // two tokens' fp16 metadata words; zero / 16 exact but for subnormals), one rounding. Lanes
      // start at different dims (rows of Vᵀ) so that a store's 32 lanes fill every bank evenly.
      static_assert(kValueBits <= 4 && (1 << kValueShrink) == 16);
      uint32_t value[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) value[k] = Codes8<kValueBits>(row0 + k * R::kSlot + R::kKeyBytes);
      __half2 scale[4], zero[4];
      const __half2 sixteenth = __floats2half2_rn(0.0625f, 0.0625f);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        scale[m] = *reinterpret_cast<const __half2*>(&meta[R::kMeta - 2][m]);
        zero[m] = __hmul2(*reinterpret_cast<const __half2*>(&meta[R::kMeta - 1][m]), sixteenth);
      }
      const __half2 k64 = __floats2half2_rn(64.0f, 64.0f);
      auto dequant = [&](uint32_t bits, int m) {
        bits |= 0x54005400u;
        const __half2 c =
            __hfma2(__hsub2(*reinterpret_cast<const __half2*>(&bits), k64), scale[m], zero[m]);
        return *reinterpret_cast<const uint32_t*>(&c);
      };
      uint8_t* vt = stage + L::kKBytes;
      if constexpr (kValueBits == 4) {
#pragma unroll
        for (int bi = 0; bi < 4; ++bi) {
          // Dims 2·b and 2·b + 1: byte b of each token's word.
          const int b = (bi + (db >> 1)) & 3;
          const uint32_t sel = 0x4400u + 0x1111u * static_cast<uint32_t>(b);
          uint32_t lo[4], hi[4];
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            // Byte b of token 2m's word in byte 0, of token 2m + 1's in byte 2.
            const uint32_t t = __byte_perm(value[2 * m], value[2 * m + 1], sel);
            lo[m] = dequant(t & 0x000F000Fu, m);
            hi[m] = dequant((t >> 4) & 0x000F000Fu, m);
          }
          *reinterpret_cast<uint4*>(vt + wgmma::SwizzledChunk(8 * db + 2 * b, tb)) =
              uint4{lo[0], lo[1], lo[2], lo[3]};
          *reinterpret_cast<uint4*>(vt + wgmma::SwizzledChunk(8 * db + 2 * b + 1, tb)) =
              uint4{hi[0], hi[1], hi[2], hi[3]};
        }
      } else {
        constexpr uint32_t kMask = (1u << kValueBits) - 1u;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int dd = (i + db) & 7;
          uint32_t q[4];
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            q[m] = dequant(((value[2 * m] >> (kValueBits * dd)) & kMask) |
                               ((value[2 * m + 1] >> (kValueBits * dd)) & kMask) << 16,
                           m);
          }
          *reinterpret_cast<uint4*>(vt + wgmma::SwizzledChunk(8 * db + dd, tb)) =
              uint4{q[0], q[1], q[2], q[3]};
        }
      }
    }
  }
};

// The CTA's query rows in the keys' space for a Hadamard rotation (ChunkParams::query_fwht),
// rounded once to fp16 into the query's swizzled tiles: y = FWHT(q ⊙ signs) · query_scale in fp32
// from the caller's query, so that no q·Πᵀ pass over all rows runs before the kernel (34 µs of
// the 2,048-token prompt's 181, H200). Four adjacent lanes per row, 32 elements each: five
// butterfly stages in registers, the last two across the four lanes (Sylvester order, as the
// decode kernels' prologue).
template <typename L, typename AfterLoads>
__device__ __forceinline__ void LoadRotatedQuery(const ChunkParams& p, uint8_t* smem, int row0,
                                                 int row_end, int q_start, int h, int group,
                                                 const AfterLoads& after_loads) {
  constexpr int kD = L::kD, kPer = kD / 4;
  static_assert(kPrefillRows * 4 == kWgThreads && kPer == 32);
  const int r = static_cast<int>(threadIdx.x) >> 2, part = static_cast<int>(threadIdx.x) & 3;
  float x[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) x[e] = 0.0f;
  if (row0 + r < row_end) {
    const int i = (row0 + r) / group, gg = (row0 + r) % group;
    const int64_t at = (int64_t{q_start + i} * p.num_q_heads + h * group + gg) * kD + kPer * part;
    const bool vec = reinterpret_cast<uintptr_t>(p.query) % 16 == 0;
    if (vec && p.query_dtype == DType::kF32) {
      const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(p.query) + at);
#pragma unroll
      for (int k = 0; k < kPer / 4; ++k) {
        const float4 v = __ldg(src + k);
        x[4 * k] = v.x, x[4 * k + 1] = v.y, x[4 * k + 2] = v.z, x[4 * k + 3] = v.w;
      }
    } else if (vec) {  // 16-bit elements, 8 per load
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.query) + at);
      const bool f16 = p.query_dtype == DType::kF16;
#pragma unroll
      for (int k = 0; k < kPer / 8; ++k) {
        const uint4 v = __ldg(src + k);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const auto bits = static_cast<uint16_t>(w[j / 2] >> (16 * (j % 2)));
          x[8 * k + j] = f16 ? __half2float(__ushort_as_half(bits))
                             : __bfloat162float(__ushort_as_bfloat16(bits));
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < kPer; ++e) x[e] = LoadQueryElement(p.query, p.query_dtype, at + e);
    }
    if (p.query_signs != nullptr) {
#pragma unroll
      for (int e = 0; e < kPer; ++e) x[e] *= __ldg(p.query_signs + kPer * part + e);
    }
  }
  after_loads();  // issued while the loads above are in flight
#pragma unroll
  for (int m = 1; m < kPer; m <<= 1) {
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      if ((e & m) == 0) {
        const float u = x[e], v = x[e + m];
        x[e] = u + v;
        x[e + m] = u - v;
      }
    }
  }
#pragma unroll
  for (int m = 1; m < 4; m <<= 1) {  // element bits 5 and 6 are lane bits 0 and 1
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const float o = __shfl_xor_sync(0xffffffffu, x[e], m);
      x[e] = (part & m) ? o - x[e] : x[e] + o;
    }
  }
#pragma unroll
  for (int k = 0; k < kPer / 8; ++k) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = decode_detail::PackPlain<true>(x[8 * k + 2 * j] * p.query_scale,
                                            x[8 * k + 2 * j + 1] * p.query_scale);
    }
    const int c16 = (kPer / 8) * part + k;
    *reinterpret_cast<uint4*>(smem + L::kQ + (c16 >> 3) * L::kAtom +
                              wgmma::SwizzledChunk(r, c16 & 7)) = uint4{w[0], w[1], w[2], w[3]};
  }
}

// The CTA's query rows from the caller's 16-byte aligned bf16 / fp16 query, rounded once to the
// MMAs' type (bf16 for kBf16, else fp16) into the query's swizzled tiles (rows past the
// sequence's: 0). Each thread's kPieces 16-byte pieces are all loaded before any is converted,
// so that their latencies overlap: a load, convert and store per piece stalled every warp of the
// CTA once per piece (ncu, k8v4 2,048 + 0: 611 stall samples there against 253 for the rotated
// path).
template <typename L, bool kBf16, typename AfterLoads>
__device__ __forceinline__ void LoadQuery16(const ChunkParams& p, uint8_t* smem, int row0,
                                            int row_end, int q_start, int h, int group,
                                            const AfterLoads& after_loads) {
  constexpr int kD = L::kD, kPieces = kPrefillRows * (kD / 8) / kWgThreads;
  static_assert(kPieces * kWgThreads == kPrefillRows * (kD / 8) && kWgThreads % (kD / 8) == 0);
  const int c16 = static_cast<int>(threadIdx.x) % (kD / 8);
  const uint4* q = static_cast<const uint4*>(p.query);
  uint4 v[kPieces];
#pragma unroll
  for (int k = 0; k < kPieces; ++k) {
    const int r = row0 + (static_cast<int>(threadIdx.x) + k * kWgThreads) / (kD / 8);
    const int64_t at = (int64_t{q_start + r / group} * p.num_q_heads + h * group + r % group) * kD;
    v[k] = r < row_end ? __ldg(q + at / 8 + c16) : uint4{0u, 0u, 0u, 0u};
  }
  after_loads();  // issued while the loads above are in flight
  const bool f16 = p.query_dtype == DType::kF16;
#pragma unroll
  for (int k = 0; k < kPieces; ++k) {
    const int r = (static_cast<int>(threadIdx.x) + k * kWgThreads) / (kD / 8);
    uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
    if (f16 != !kBf16) {  // the MMAs' type differs from the query's: convert
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const auto lo = static_cast<uint16_t>(w[e]), hi = static_cast<uint16_t>(w[e] >> 16);
        const float x0 = f16 ? __half2float(__ushort_as_half(lo))
                             : __bfloat162float(__ushort_as_bfloat16(lo));
        const float x1 = f16 ? __half2float(__ushort_as_half(hi))
                             : __bfloat162float(__ushort_as_bfloat16(hi));
        w[e] = decode_detail::PackPlain<!kBf16>(x0, x1);
      }
    }
    *reinterpret_cast<uint4*>(smem + L::kQ + (c16 >> 3) * L::kAtom +
                              wgmma::SwizzledChunk(r, c16 & 7)) = uint4{w[0], w[1], w[2], w[3]};
  }
}

// Grid row_tiles · max_splits · num_kv_heads, as the mma.sync prefill kernel's. Needs block_size a
// multiple of 8 (LaunchPrefillWgmma's caller checks).
template <KeyKind kKind, int kValueBits>
__global__ void __launch_bounds__(kWgThreads, 1) PrefillWgmmaKernel(const ChunkParams p) {
  using L = WgLayout<kKind, kValueBits>;
  constexpr int kD = L::kD;
  // The bf16 cache's MMAs take bf16 operands (the query and P' rounded to bf16, as
  // FlashAttention rounds them); every other kind's fp16.
  constexpr bool kBf16 = kKind == KeyKind::kBf16;
  constexpr bool kPlain = IsPlain(kKind);
  constexpr float kShift = kPlain ? 0.0f : static_cast<float>(kValueShrink);
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw_base + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_base);

  int h, slot;
  SlotOfBlock(p, h, slot);
  const int split = slot / p.row_tiles;
  int b, tile;
  FindRowTile(p, kPrefillRows, slot % p.row_tiles, b, tile);
  const int group = p.num_q_heads / p.num_kv_heads;
  const int q_start = p.query_start_loc[b];
  int q_len = p.query_start_loc[b + 1] - q_start;
  if (q_len == 1 && p.skip_single) q_len = 0;  // the decode kernels' row
  const int row0 = tile * kPrefillRows;
  const int row_end = min(q_len * group, row0 + kPrefillRows);
  if (row0 >= row_end) {  // the sequence has fewer rows
    GridDependencyWait();  // ChunkParams::programmatic
    return;
  }
  const int ctx0 = p.seq_lens[b] - q_len;
  const SplitSpan span = SplitSpanOf(p, ctx0, group, row0, row_end, split);
  const int split_begin = span.begin, split_end = span.end;
  // Tiles start on multiples of 64 (a sliding window's first tile masks the tokens before it).
  const int loop_begin = split_begin - split_begin % kWgTile;
  const int tiles = split_end > split_begin ? (split_end - loop_begin + kWgTile - 1) / kWgTile : 0;
  // Tiles j_pre on (the one holding the first new token on) come dequantized (ChunkParams::tiles):
  // the tile at token t in slot pre_slot0 + t / 64 of pre_tiles (pre_slot0 below).
  const bool pre = p.tiles != nullptr && PrefillTilesFor(q_len, ctx0);
  const int j_pre =
      pre ? min(tiles, max(0, (ctx0 / kWgTile * kWgTile - loop_begin) / kWgTile)) : tiles;
  const uint8_t* pre_tiles = pre ? p.tiles + int64_t{h} * p.tile_slots * kWgTileBytes : nullptr;

  // The split's block ids (one per thread, loaded here and stored after the query so that the two
  // loads overlap); the query rows rounded once to fp16 (rows past the sequence's: 0); the
  // barriers.
  static_assert(kMaxStagedIds <= kWgThreads);
  const int32_t* table = p.block_tables + int64_t{b} * p.max_blocks_per_seq;
  const int id_begin = loop_begin / p.block_size;
  const int id_count = split_end > split_begin ? (split_end - 1) / p.block_size - id_begin + 1 : 0;
  const bool staged_ids = id_count <= kMaxStagedIds;
  int32_t* smem_ids = reinterpret_cast<int32_t*>(smem + L::kIds);
  const int32_t my_id = staged_ids && static_cast<int>(threadIdx.x) < id_count
                            ? __ldg(table + id_begin + threadIdx.x)
                            : 0;
  // The copying warpgroup (kWgKeysCopy; the bf16 / fp16 caches' value warpgroup) issues its first
  // raw tiles' copies while the query's loads are in flight, so that the first tile's latency
  // overlaps the query's instead of following it: their block ids from the table (the staged ids
  // are written after the query), loaded before the query.
  const int warp0 = static_cast<int>(threadIdx.x >> 5);
  const bool copier = !kPlain && kWgKeysCopy<kKind> ? warp0 < 4 : warp0 >= 4 && warp0 < 8;
  const int copy_thread = static_cast<int>(threadIdx.x & 127);
  const WgProducer<kKind, kValueBits> first_copier{p,
                                                   smem,
                                                   base,
                                                   table,
                                                   0,
                                                   h,
                                                   split_end,
                                                   copy_thread,
                                                   copy_thread >> 4,
                                                   copy_thread & 15,
                                                   1.0f / static_cast<float>(p.block_size)};
  // (split_end: nothing copied, past the split or for a dequantized tile.)
  auto first_tile = [&](int i) { return i < j_pre ? loop_begin + i * kWgTile : split_end; };
  int first_ids[L::kRawStages - 1];
#pragma unroll
  for (int i = 0; i < L::kRawStages - 1; ++i) {
    first_ids[i] = copier ? first_copier.BlockId(table, 0, first_tile(i)) : 0;
  }
  auto first_copies = [&] {
    if (!copier) return;
#pragma unroll
    for (int i = 0; i < L::kRawStages - 1; ++i) {
      first_copier.CopyFrom(first_tile(i), base + L::kRaw + i * L::kRawBytes, first_ids[i]);
    }
  };
  const bool query_aligned = reinterpret_cast<uintptr_t>(p.query) % 16 == 0;
  const bool query_vec = p.query_dtype == DType::kF32 && query_aligned;
  // The caller's 16-bit query, as the FP8 and bf16 / fp16 caches take it: every load of the
  // thread's pieces issued before any is converted.
  constexpr bool kQuery16 = kKind == KeyKind::kFp8 || kPlain;
  if (p.query_fwht) {
    LoadRotatedQuery<L>(p, smem, row0, row_end, q_start, h, group, first_copies);
  } else if (kQuery16 && query_aligned && p.query_dtype != DType::kF32) {
    LoadQuery16<L, kBf16>(p, smem, row0, row_end, q_start, h, group, first_copies);
  } else {
    for (int u = threadIdx.x; u < kPrefillRows * (kD / 8); u += kWgThreads) {
      const int r = u / (kD / 8), c16 = u % (kD / 8);
      uint32_t w[4] = {0, 0, 0, 0};
      if (row0 + r < row_end) {
        const int i = (row0 + r) / group, gg = (row0 + r) % group;
        const int64_t at = (int64_t{q_start + i} * p.num_q_heads + h * group + gg) * kD + 8 * c16;
        float x[8];
        if (query_vec) {  // fp32 on 16 bytes (the query prep's q·Πᵀ): two 16-byte loads
          const float4 a =
              __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(p.query) + at));
          const float4 c =
              __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(p.query) + at) + 1);
          x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = c.x, x[5] = c.y, x[6] = c.z,
          x[7] = c.w;
        } else if (query_aligned) {  // 16-bit elements, 8 per load
          const uint4 v =
              __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.query) + at));
          const uint32_t q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const auto bits = static_cast<uint16_t>(q[e / 2] >> (16 * (e % 2)));
            x[e] = p.query_dtype == DType::kF16 ? __half2float(__ushort_as_half(bits))
                                                : __bfloat162float(__ushort_as_bfloat16(bits));
          }
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) x[e] = LoadQueryElement(p.query, p.query_dtype, at + e);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          w[e] = decode_detail::PackPlain<!kBf16>(x[2 * e], x[2 * e + 1]);
        }
      }
      *reinterpret_cast<uint4*>(smem + L::kQ + (c16 >> 3) * L::kAtom +
                                wgmma::SwizzledChunk(r, c16 & 7)) = uint4{w[0], w[1], w[2], w[3]};
    }
    first_copies();
  }
  if (staged_ids && static_cast<int>(threadIdx.x) < id_count) smem_ids[threadIdx.x] = my_id;
  const int32_t* ids = staged_ids ? smem_ids : table;
  const int id_base = staged_ids ? id_begin : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kWgStages; ++s) {
      wgmma::BarrierInit(base + L::kFull + 8 * s, 256);
      wgmma::BarrierInit(base + L::kEmpty + 8 * s, 8);
    }
  }
  wgmma::FenceProxyAsync();  // the query, for the MMAs
  // (After the query's loads and the first copies, so that its loads and barriers overlap them.)
  const int pre_slot0 = pre ? FirstTileSlot(p, b, q_start) - ctx0 / kWgTile : 0;
  __syncthreads();

  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  if (warp < 8) {
    // Producers: the key warpgroup (warps 0-3) and the value warpgroup (4-7). At step j the
    // copying warpgroup (`copier`: the values', or the keys' for kWgKeysCopy) issues tile j +
    // kWgRawStages − 1's copies; then each writes its half of tile j (copied three steps ago) into
    // its stage once the consumers have freed it.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWgProducerRegs));
    // The compressed kinds: two copies of the loop, one per warpgroup (`keys` a compile-time
    // constant), so that the key warpgroup's codebook registers are not held across the value
    // warpgroup's code; the bf16 / fp16 caches: one loop for both (`keys` known at run time).
    auto produce = [&](auto warpgroup_keys) {
      const bool keys = warpgroup_keys;
      // The warpgroup that copies the raw tiles (kWgKeysCopy).
      const bool copies = kPlain ? !keys : keys == kWgKeysCopy<kKind>;
      const int thread = static_cast<int>(threadIdx.x & 127);
      WgProducer<kKind, kValueBits> pr{p,
                                       smem,
                                       base,
                                       ids,
                                       id_base,
                                       h,
                                       split_end,
                                       thread,
                                       thread >> 4,
                                       thread & 15,
                                       1.0f / static_cast<float>(p.block_size)};
      if (keys && WgRawLayout<kKind, kValueBits>::kMse) pr.LoadCodebook();
      const uint32_t raw0 = base + L::kRaw;  // tiles 0 .. kRawStages − 2: first_copies
      for (int j = 0; j < j_pre; ++j) {
        if (copies) decode_detail::CopyAsyncWaitGroup<L::kRawStages - 2>();  // its copies of tile j
        // Every copy of tile j has landed, and raw tile j − 1 has been read.
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
        if (copies) {
          const int ahead = j + L::kRawStages - 1;
          pr.Copy(ahead < j_pre ? loop_begin + ahead * kWgTile : split_end,
                  raw0 + (ahead % L::kRawStages) * L::kRawBytes);
        }
        const int s = j % kWgStages;
        if (j >= kWgStages) wgmma::BarrierWait(base + L::kEmpty + 8 * s, (j / kWgStages + 1) & 1);
        const uint32_t raw = raw0 + (j % L::kRawStages) * L::kRawBytes;
        uint8_t* stage = smem + L::kStage0 + s * L::kStageBytes;
        if constexpr (kPlain) {
          if (keys) {
            pr.template StorePlain<true>(loop_begin + j * kWgTile, raw, stage);
          } else {
            pr.template StorePlain<false>(loop_begin + j * kWgTile, raw, stage);
          }
        } else if (keys) {
          pr.template Store<true>(loop_begin + j * kWgTile, raw, stage);
        } else {
          pr.template Store<false>(loop_begin + j * kWgTile, raw, stage);
        }
        wgmma::FenceProxyAsync();
        wgmma::BarrierArrive(base + L::kFull + 8 * s);
      }
      // The dequantized tiles: one bulk copy each by the value warpgroup's first thread, whose
      // arrival adds the copy's bytes to what the stage's barrier waits for.
      for (int j = j_pre; j < tiles; ++j) {
        const int s = j % kWgStages;
        if (j >= kWgStages) wgmma::BarrierWait(base + L::kEmpty + 8 * s, (j / kWgStages + 1) & 1);
        const uint32_t full = base + L::kFull + 8 * s;
        if (!keys && thread == 0) {
          wgmma::BarrierArriveExpectTx(full, kWgTileBytes);
          wgmma::BulkCopy(base + L::kStage0 + s * L::kStageBytes,
                          pre_tiles + int64_t{pre_slot0 + loop_begin / kWgTile + j} * kWgTileBytes,
                          kWgTileBytes, full);
        } else {
          wgmma::BarrierArrive(full);
        }
      }
      if (copies) decode_detail::CopyAsyncWait();
    };
    if constexpr (kPlain) {
      produce(warp < 4);
    } else if (warp < 4) {
      produce(std::true_type{});
    } else {
      produce(std::false_type{});
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWgConsumerRegs));

  // Consumers: warpgroup wg holds rows 64·wg .. 64·wg + 63; the thread rows 16·wl + g + 8k of it.
  // wg broadcast from lane 0: warp-uniform as far as the compiler can tell, so that the query's
  // MMA descriptors live in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, warp / 4 - 2, 0), wl = warp % 4, g = lane >> 2,
            tq = lane & 3;
  const int wr0 = row0 + 64 * wg;
  const int wg_last_pos = wr0 < row_end ? ctx0 + (min(wr0 + 64, row_end) - 1) / group : -1;
  const int warp_first_pos = ctx0 + (wr0 + 16 * wl) / group;
  int row_pos[2];
  float m[2], l[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int r = wr0 + 16 * wl + g + 8 * k;
    row_pos[k] = r < row_end ? ctx0 + r / group : -1;
    m[k] = -INFINITY;
    l[k] = 0.0f;
  }
  float o[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.0f;
  // The warp's 16 query rows as the MMAs' A fragments (one per 16 dims), so that S = Q · Kᵀ takes
  // only the keys from shared memory, whose bandwidth the MMAs with both operands there would
  // fill on their own.
  const int q_row = 64 * wg + 16 * wl + (lane & 7) + 8 * ((lane >> 3) & 1);
  auto load_query = [&](uint32_t(&qa)[kD / 16][4]) {
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      LdMatrixX4(base + L::kQ + (ks >> 2) * L::kAtom +
                     wgmma::SwizzledChunk(q_row, 2 * (ks & 3) + (lane >> 4)),
                 qa[ks]);
    }
  };
  float s[32];
  uint32_t a[kWgTile / 16][4];  // P of the tile whose P · V is next, as the MMAs' A fragments
  // The warpgroup's tiles: those that start at or before its last row's position (the causal
  // diagonal); it waits for and releases the others without reading them.
  const int wg_tiles =
      wg_last_pos >= loop_begin ? min(tiles, (wg_last_pos - loop_begin) / kWgTile + 1) : 0;
  auto wait_full = [&](int j) {
    wgmma::BarrierWait(base + L::kFull + 8 * (j % kWgStages), (j / kWgStages) & 1);
  };
  auto release = [&](int j) {
    __syncwarp();
    if (lane == 0) wgmma::BarrierArrive(base + L::kEmpty + 8 * (j % kWgStages));
  };
  auto stage_desc = [&](int j) {
    return wgmma::DescriptorLow(base + L::kStage0 + (j % kWgStages) * L::kStageBytes);
  };
  // S = Q · Kᵀ of tile j, 16 dims per step (the softmax scale comes in the exponent).
  auto issue_scores = [&](int j, const uint32_t(&qa)[kD / 16][4]) {
    const uint32_t k_desc = stage_desc(j);
    wgmma::Fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t off = (ks & 3) * 32;  // the step's bytes into the atom's rows
      wgmma::MmaRS64x64<kBf16>(s, qa[ks],
                               wgmma::DescriptorOf(k_desc + ((ks >> 2) * L::kKAtom + off) / 16),
                               ks > 0);
    }
    wgmma::Commit();
  };
  // O += P · V of tile j (P in a), 16 tokens per step.
  auto issue_values = [&](int j) {
    const uint32_t k_desc = stage_desc(j);
    wgmma::Fence();
#pragma unroll
    for (int kk = 0; kk < kWgTile / 16; ++kk) {
      wgmma::MmaRS64x128<kBf16>(o, a[kk],
                                wgmma::DescriptorOf(k_desc + (L::kKBytes + 32 * kk) / 16));
    }
    wgmma::Commit();
  };
  // Tile j's scores in s masked, then P = 2^(s · scale − ref + shift) in s (fp32) and l += P:
  // online softmax in the log2 domain with a lazy maximum. m, the reference of a row's exponents,
  // moves only when a score passes it by more than kLazyMax, so P ≤ 2^(kLazyMax + kShift), which
  // fp16 holds (shift: the values' kValueShrink); the softmax scale, a positive uniform factor, is
  // applied in the exponent. Where m moves, l is rescaled here and O must be by `alpha` once the
  // P · V in flight has completed: the return value says so (most tiles: no).
  auto softmax = [&](int j, float (&alpha)[2]) {
    const int tile_begin = loop_begin + j * kWgTile;
    // Tiles wholly inside the split and before the warp's first row need no mask.
    const bool unmasked = p.sliding_window == 0 && tile_begin >= split_begin &&
                          tile_begin + kWgTile <= split_end &&
                          tile_begin + kWgTile - 1 <= warp_first_pos;
    if (!unmasked) {
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int t = tile_begin + 8 * (i / 4) + 2 * tq + (i & 1), pos = row_pos[(i >> 1) & 1];
        const bool keep = t >= split_begin && t < split_end && t <= pos &&
                          (p.sliding_window == 0 || t > pos - p.sliding_window);
        s[i] = keep ? s[i] : -INFINITY;
      }
    }
    float mx[2];
    bool over = false;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      mx[k] = -INFINITY;
#pragma unroll
      for (int n = 0; n < kWgTile / 8; ++n) {
        mx[k] = fmaxf(mx[k], fmaxf(s[4 * n + 2 * k], s[4 * n + 2 * k + 1]));
      }
      over |= mx[k] * p.score_scale > m[k] + kLazyMax;
    }
    const bool moved = __any_sync(0xffffffffu, over);
    if (moved) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], 1));
        mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], 2));
        const float m_new = fmaxf(m[k], mx[k] * p.score_scale);
        alpha[k] = m_new == -INFINITY ? 1.0f : decode_detail::FastExp2(m[k] - m_new);
        m[k] = m_new;
        l[k] *= alpha[k];
      }
    }
    const float ref[2] = {m[0] == -INFINITY ? 0.0f : m[0], m[1] == -INFINITY ? 0.0f : m[1]};
    const float shift[2] = {kShift - ref[0], kShift - ref[1]};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int k = (i >> 1) & 1;
      const float w = decode_detail::FastExp2(fmaf(s[i], p.score_scale, shift[k]));
      l[k] += w;
      s[i] = w;
    }
    return moved;
  };
  auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      o[4 * n] *= alpha[0];
      o[4 * n + 1] *= alpha[0];
      o[4 * n + 2] *= alpha[1];
      o[4 * n + 3] *= alpha[1];
    }
  };
  // P rounded to fp16 (bf16) for the MMA.
  auto pack = [&] {
#pragma unroll
    for (int kk = 0; kk < kWgTile / 16; ++kk) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        a[kk][e] = decode_detail::PackPlain<!kBf16>(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
      }
    }
  };
  if (2 * j_pre < tiles) {
    // Most tiles come dequantized (ChunkParams::tiles), so the consumers bound the CTA:
    // FlashAttention-3's order within the warpgroup. Tile j + 1's S = Q · Kᵀ is issued before tile
    // j's P · V, and its softmax runs while that P · V does; O is rescaled, P packed and tile j's
    // stage released once the P · V has completed. The query's fragments are read for each tile
    // (held across the loop they would leave too few registers).
    if (wg_tiles > 0) {
      float alpha[2];
      wait_full(0);
      {
        uint32_t qa[kD / 16][4];
        load_query(qa);
        issue_scores(0, qa);
      }
      wgmma::Wait<0>();
      if (softmax(0, alpha)) rescale(alpha);
      pack();
      for (int j = 0; j + 1 < wg_tiles; ++j) {
        wait_full(j + 1);
        {
          uint32_t qa[kD / 16][4];
          load_query(qa);
          issue_scores(j + 1, qa);
        }
        issue_values(j);
        wgmma::Wait<1>();
        const bool moved = softmax(j + 1, alpha);
        wgmma::Wait<0>();
        release(j);
        if (moved) rescale(alpha);
        pack();
      }
      issue_values(wg_tiles - 1);
      wgmma::Wait<0>();
      release(wg_tiles - 1);
    }
  } else {
    // The producers dequantize most tiles and bound the CTA: one tile at a time, the query's
    // fragments held across the loop (reading them for each tile took shared-memory bandwidth from
    // the producers: 2,048 + 32k +4 to +7 %, H200).
    uint32_t qa[kD / 16][4];
    load_query(qa);
    for (int j = 0; j < wg_tiles; ++j) {
      wait_full(j);
      issue_scores(j, qa);
      wgmma::Wait<0>();
      float alpha[2];
      if (softmax(j, alpha)) rescale(alpha);
      pack();
      issue_values(j);
      wgmma::Wait<0>();
      release(j);
    }
  }
  for (int j = wg_tiles; j < tiles; ++j) {
    wait_full(j);
    release(j);
  }

  // Row sums (of P = 2^kShift · p) over the quad, then O / l and the LSE: the output (pairs of
  // elements in one store where the output is 8-byte aligned), or the split's partial.
  constexpr float kLn2 = 0.69314718055994530942f;
  const bool out_vec = reinterpret_cast<uintptr_t>(p.output) % 8 == 0;
  // A 16-bit output in one piece goes through shared memory (the warpgroup's query rows, which
  // its MMAs no longer read: the same swizzled layout, 128 B per row and atom), so that global
  // stores are 16 bytes of one row each rather than 4 bytes of eight rows (the scattered stores
  // took ~3 µs of each CTA, H200).
  if (p.max_splits == 1 && p.out_dtype != DType::kF32 &&
      reinterpret_cast<uintptr_t>(p.output) % 16 == 0) {
    const bool out_f16 = p.out_dtype == DType::kF16;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      float lk = l[k];
      lk += __shfl_xor_sync(0xffffffffu, lk, 1);
      lk += __shfl_xor_sync(0xffffffffu, lk, 2);
      const int rw = 64 * wg + 16 * wl + g + 8 * k;  // the CTA's row
      const bool empty = lk == 0.0f;
      const float inv = empty ? 0.0f : exp2f(kShift) / lk;
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        const float x0 = o[4 * n + 2 * k] * inv, x1 = o[4 * n + 2 * k + 1] * inv;
        const uint32_t w = out_f16 ? decode_detail::PackOutput<true>(x0, x1)
                                   : decode_detail::PackOutput<false>(x0, x1);
        *reinterpret_cast<uint32_t*>(smem + L::kQ + (n >> 3) * L::kAtom +
                                     wgmma::SwizzledChunk(rw, n & 7) + 4 * tq) = w;
      }
      const int r = wr0 + 16 * wl + g + 8 * k;
      if (r < row_end && tq == 0) {
        const int i = r / group, gg = r % group;
        p.lse[int64_t{q_start + i} * p.num_q_heads + h * group + gg] =
            empty ? -INFINITY : (m[k] + __log2f(lk) - kShift) * kLn2;
      }
    }
    wgmma::NamedBarrierSync(2 + wg, 128);  // the warpgroup's rows are in shared memory
    const int t = static_cast<int>(threadIdx.x & 127), c = t & 15;
#pragma unroll
    for (int it = 0; it < 8; ++it) {
      const int rw = 64 * wg + (t >> 4) + 8 * it, r = row0 + rw;
      if (r >= row_end) continue;
      uint32_t v[4];
      decode_detail::SharedLoad16(base + L::kQ + (c >> 3) * L::kAtom +
                                      wgmma::SwizzledChunk(rw, c & 7),
                                  v);
      const int i = r / group, gg = r % group;
      const int64_t out_row = int64_t{q_start + i} * p.num_q_heads + h * group + gg;
      *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.output) + out_row * kD + 8 * c) =
          uint4{v[0], v[1], v[2], v[3]};
    }
    GridDependencyWait();  // ChunkParams::programmatic
    return;
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    float lk = l[k];
    lk += __shfl_xor_sync(0xffffffffu, lk, 1);
    lk += __shfl_xor_sync(0xffffffffu, lk, 2);
    const int r = wr0 + 16 * wl + g + 8 * k;
    if (r >= row_end) continue;
    const int i = r / group, gg = r % group;
    const int64_t out_row = int64_t{q_start + i} * p.num_q_heads + h * group + gg;
    const bool empty = lk == 0.0f;
    const float inv = empty ? 0.0f : exp2f(kShift) / lk;
    const float lse = empty ? -INFINITY : (m[k] + __log2f(lk) - kShift) * kLn2;
    if (p.max_splits == 1) {
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        const int64_t at = out_row * kD + 8 * n + 2 * tq;
        const float x0 = o[4 * n + 2 * k] * inv, x1 = o[4 * n + 2 * k + 1] * inv;
        if (out_vec) {
          StoreOutputPair(p.output, p.out_dtype, at, x0, x1);
        } else {
          decode_detail::StoreOutput(p.output, p.out_dtype, at, x0);
          decode_detail::StoreOutput(p.output, p.out_dtype, at + 1, x1);
        }
      }
      if (tq == 0) p.lse[out_row] = lse;
    } else {
      float* out = p.partial_out + (out_row * p.max_splits + split) * kD;
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        *reinterpret_cast<float2*>(out + 8 * n + 2 * tq) =
            make_float2(o[4 * n + 2 * k] * inv, o[4 * n + 2 * k + 1] * inv);
      }
      if (tq == 0) p.partial_lse[out_row * p.max_splits + split] = lse;
    }
  }
  // ChunkParams::programmatic (the producers exit without it: the CTA lasts as long as its
  // consumers).
  GridDependencyWait();
}

// The dequantized tiles of ChunkParams::tiles: CTA (x, KV head) finds its sequence and tile
// (PrefillTileSequence: every sequence has q_len / 64 + 2 values of x), copies the tile's raw
// bytes into shared memory (the value warpgroup, as the prefill kernel's producers) and writes
// the tile in the stages' layout to global memory with the producers' own code: the key
// warpgroup the keys, the value warpgroup Vᵀ (tokens at or past the sequence's end zero). So the
// prefill kernel reads the same values whether its producers dequantize a tile or copy it.
template <KeyKind kKind, int kValueBits>
__global__ void __launch_bounds__(256) DequantTilesKernel(const ChunkParams p) {
  using L = WgLayout<kKind, kValueBits>;
  __shared__ __align__(128) uint8_t raw_tile[L::kRawBytes];
  const int x = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y);
  const int b = PrefillTileSequence(p.query_start_loc, p.num_seqs, x);
  if (b < 0) return;
  const int q_start = p.query_start_loc[b];
  const int q_len = p.query_start_loc[b + 1] - q_start;
  const int seq_len = p.seq_lens[b];
  if (!PrefillTilesFor(q_len, seq_len - q_len)) return;
  const int tile = (seq_len - q_len) / kWgTile + x - PrefillFirstTileCta(p.query_start_loc, b);
  if (tile * kWgTile >= seq_len) return;
  const int tile_begin = tile * kWgTile;
  const int slot = FirstTileSlot(p, b, q_start) + tile - (seq_len - q_len) / kWgTile;
  const int thread = static_cast<int>(threadIdx.x & 127);
  const bool keys = threadIdx.x < 128;
  const WgProducer<kKind, kValueBits> pr{p,
                                         raw_tile,
                                         0,
                                         p.block_tables + int64_t{b} * p.max_blocks_per_seq,
                                         0,
                                         h,
                                         seq_len,
                                         thread,
                                         thread >> 4,
                                         thread & 15,
                                         1.0f / static_cast<float>(p.block_size)};
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(raw_tile));
  if (!keys) pr.Copy(tile_begin, raw);
  decode_detail::CopyAsyncWait();
  __syncthreads();
  uint8_t* out = p.tiles + (int64_t{h} * p.tile_slots + slot) * kWgTileBytes;
  if constexpr (WgRawLayout<kKind, kValueBits>::kPlain) {
    if (keys) {
      pr.template StorePlain<true>(tile_begin, raw, out);
    } else {
      pr.template StorePlain<false>(tile_begin, raw, out);
    }
  } else if (keys) {
    WgProducer<kKind, kValueBits> kp = pr;
    if constexpr (WgRawLayout<kKind, kValueBits>::kMse) kp.LoadCodebook();
    kp.template Store<true>(tile_begin, raw, out);
  } else {
    pr.template Store<false>(tile_begin, raw, out);
  }
}

#else

template <KeyKind kKind, int kValueBits>
__global__ void PrefillWgmmaKernel(const ChunkParams p) {}  // launched only on sm_90
template <KeyKind kKind, int kValueBits>
__global__ void DequantTilesKernel(const ChunkParams p) {}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Whether PrefillWgmmaKernel<kKind, kValueBits> serves a call's cache layout.
template <KeyKind kKind, int kValueBits>
bool WgmmaPrefillRuns(const ChunkParams& p) {
  using R = WgRawLayout<kKind, kValueBits>;
  if constexpr (R::kPlain) return p.block_size % 8 == 0;
  return p.block_size % 8 == 0 && p.data_per_slot == R::kSlot && p.key_data_bytes == R::kKeyBytes &&
         p.num_meta == R::kMeta;
}

// Whether the current device runs the wgmma kernels (compute capability 9.0).
inline bool DeviceHasWgmma() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0;
}

// ChunkParams::tiles: grid tile_grid · num_kv_heads.
template <KeyKind kKind, int kValueBits>
cudaError_t LaunchDequantTiles(const ChunkParams& p, cudaStream_t stream) {
  if (p.tiles == nullptr || p.tile_slots < 1 || p.tile_grid < 1) return cudaErrorInvalidValue;
  DequantTilesKernel<kKind, kValueBits>
      <<<dim3(static_cast<unsigned>(p.tile_grid), static_cast<unsigned>(p.num_kv_heads)), 256, 0,
         stream>>>(p);
  return cudaGetLastError();
}

template <KeyKind kKind, int kValueBits>
cudaError_t LaunchPrefillWgmma(const ChunkParams& p, cudaStream_t stream) {
  constexpr int kSmem = WgLayout<kKind, kValueBits>::kBytes;
  auto* kernel = PrefillWgmmaKernel<kKind, kValueBits>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(static_cast<unsigned>(p.row_tiles * p.max_splits * p.num_kv_heads));
  return LaunchChunkGrid(kernel, grid, kWgThreads, kSmem, stream, p);
}

}  // namespace tqkv::attention_detail
