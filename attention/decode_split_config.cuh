// The split kernel's compile-time configuration: chunk and softmax constants, the staged
// kernels' shared-memory layouts, and SplitKernelConfig (warps, shared-memory regions, occupancy)
// of one SplitVariant.
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention/decode_cache_traits.cuh"
#include "attention/decode_launch.h"
#include "attention/decode_variant.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TQKV_SHARED_O_WGMMA 1  // Hopper's warpgroup MMAs (SplitKernelConfig::kSharedOWgmma)
#else
#define TQKV_SHARED_O_WGMMA 0
#endif

namespace tqkv::decode_detail {

constexpr int kWarps = 4;   // per CTA, except the staged kernels'
constexpr int kChunk = 16;  // tokens per MMA chunk
// Lazy softmax maximum: a chunk rescales the running sums only when a score exceeds the running
// maximum by more than this (log2 units), so p = 2^(s - m) ≤ 2^kLazyMax; otherwise no reduction.
// P' = p · value scale must stay below the fp16 maximum: that holds for value scales up to
// kMaxLazyValueScale = 65504 / 2^6 (value ranges up to ~15,000); a chunk with a larger scale
// rescales to the exact maximum instead (p ≤ 1, P' ≤ the scale ≤ 65504).
constexpr float kLazyMax = 6.0f;
constexpr float kMaxLazyValueScale = 1023.0f;
constexpr float kLn2 = 0.69314718055994530942f;

// Staged kernels (4-bit keys and 4-bit values, or 3-bit keys and 4-bit values; D = 128 and 64,
// GQA group <= 4: 4bit_nc and k3v4_nc; and their half-precision kernels for groups 5-32, 5-16 at
// D = 64; 4bit_nc's exact kernels at D = 64 for groups 5-16 too; 3bit_nc's packed and
// half-precision kernels at D = 128 and 64, as k3v4_nc's there, up to 16 columns but on the
// shared-output kernel; FP8 keys with 4-bit values, k8v4, packed at D = 128; see kSplitMinCtas):
// 8 warps per CTA at 2 CTAs per SM (<= 128 registers, 16 warps per SM instead of 12) or, for
// 3-bit keys, also a narrow variant of 4 warps at 4 CTAs per SM (the same 16 warps; a batch that
// needs two rounds of 8-warp CTAs fits one round of these, so the CTAs' fixed prologue and
// epilogue are paid once; the plan picks the variant; the half-precision kernels of groups 9-32
// have one of 4 warps at 2 CTAs per SM), and each warp copies its next chunks into shared memory
// by cp.async, kStages - 1 chunks ahead, instead of holding the next chunk in registers. A stage
// holds the 16 slots of a chunk (one KV head) at a fixed pitch, then a 128-byte metadata cell per
// stage (3 runs of 16 fp16; FP8 keys 2). Within a slot the 16-byte units are XOR-swizzled by
// token (Swizzle) so that the lanes' key and value reads hit distinct banks. StagedLayout says
// where everything is (StagedPieceLayout for k3v4_nc's 56-byte slots at D = 64).
constexpr int kStagedWarps = 8;
constexpr int kStages = 4;

template <KeyKind kKind, int kW>  // kW: warps per CTA
struct StagedLayout;

// 4-bit keys: 128-byte slots at a 256-byte pitch. Stages 0 and 1 of warp w are the free second
// halves of table rows 32w + 16s .. + 15 (the 64 KB table uses the first halves), stages 2 and 3
// the two halves of rows 16w .. 16w + 15 of a 32 KB region after the table: 100 KB per CTA.
// 4 warps (the narrow kernels: half precision, and exact at D = 64): all 16 stages in the table
// rows' free halves. At D = 64 a 64-byte slot takes the same place as a 128-byte one.
// The swizzle: unit bits 1-2 from token bits 2-3 (the four tokens a half-warp's value reads
// touch get four distinct 32-byte pairs), bit 2 also from token bit 1 (the two tokens of an
// 8-lane key read phase get disjoint halves), bit 0 from token bit 1 (v7y's copies needed it;
// the reads do not mind). Never from token bit 0: a read of token 2m + 1 is the read of 2m plus
// the pitch. The copies (one token's 8 units per 8-lane phase) are conflict-free under any XOR.
template <int kW>
struct StagedLayout<KeyKind::kMse4, kW> {
  static_assert(kW == kStagedWarps || kW == 4, "the stages fill the table rows' halves");
  static constexpr uint32_t kPitch = 256;
  static constexpr uint32_t kExtra = 256 * 256;
  static constexpr uint32_t kMeta = kW == 4 ? kExtra : kExtra + kStagedWarps * 16 * 256;
  static constexpr int kBytes = kMeta + kW * kStages * 128;
  __device__ __forceinline__ static uint32_t Stage(int warp, int s) {
    if constexpr (kW == 4) return 4096u * (kStages * warp + s) + 128u;
    return s < 2 ? 8192u * warp + 4096u * s + 128u : kExtra + 4096u * warp + 128u * (s - 2);
  }
  __device__ __forceinline__ static uint32_t Swizzle(uint32_t i) {
    return ((i >> 1) & 1u) ^ (2u * ((i >> 2) & 3u)) ^ (4u * ((i >> 1) & 1u));
  }
};

// 3-bit keys: 112-byte slots (48 key + 64 value bytes; 3bit_nc: 96, 48 + 48) at a 128-byte pitch,
// all stages after the
// 16 KB table: 84 KB per CTA (8 warps), 50 KB (4 warps). The swizzle is a bit permutation of token
// / 2 (bits 2, 0, 1 -> unit bits 2, 1, 0): the 8 tokens of a key read (32 lanes, 4-byte words at
// 12t + 4w) get 8 distinct unit masks, which tile the 32 banks exactly, and the four tokens of a
// half-warp's value reads (units 3-4 or 5-6) get masks from {0, 1, 4, 5} or {2, 3, 6, 7}, whose
// unit pairs are disjoint.
template <int kW>
struct StagedLayout<KeyKind::kMse3, kW> {
  static constexpr uint32_t kPitch = 128;
  static constexpr uint32_t kFirst = 64 * 256;
  static constexpr uint32_t kMeta = kFirst + kW * kStages * 16 * 128;
  static constexpr int kBytes = kMeta + kW * kStages * 128;
  __device__ __forceinline__ static uint32_t Stage(int warp, int s) {
    return kFirst + 2048u * (kStages * warp + s);
  }
  __host__ __device__ static constexpr uint32_t Swizzle(uint32_t i) {
    const uint32_t x = i >> 1;
    return (x & 4u) | ((x & 1u) << 1) | ((x >> 1) & 1u);
  }
};

// FP8 keys with 4-bit values at D = 128 (k8v4): 192-byte slots (128 key + 64 value bytes) at a
// 192-byte pitch, no table: 96 KB of stages and 4 KB of metadata cells per 8-warp CTA, two CTAs
// per SM. The swizzle XORs unit bits 0-1 only, so key units stay in 0-7 and value units in 8-11:
// bit 0 from token bit 1 (the two tokens of an 8-lane key read phase, 2g and 2g + 2, start on the
// same bank, since 384 ≡ 0 mod 128: their 16-byte units 2t (+1) then fill the 32 banks), bit 1
// from token bit 2 (the four tokens 4t of a half-warp's 8-byte value reads all start on bank 0:
// two of them on units 8-9, two on 10-11, two wavefronts per half-warp, the least while an even
// token's value run covers banks 0-15 alone). Never from token bit 0: token 2m + 1
// is token 2m plus the pitch. A copy phase of 8 lanes moves one token's 8 key units, or the 4
// value units of two tokens (banks 0-15 and 16-31): conflict-free.
template <int kW>
struct StagedLayout<KeyKind::kFp8, kW> {
  static_assert(kW == kStagedWarps);
  static constexpr uint32_t kPitch = 192;
  static constexpr uint32_t kStageBytes = 16 * kPitch;
  static constexpr uint32_t kMeta = kW * kStages * kStageBytes;
  static constexpr int kBytes = kMeta + kW * kStages * 128;
  __device__ __forceinline__ static uint32_t Stage(int warp, int s) {
    return kStageBytes * (kStages * warp + s);
  }
  __host__ __device__ static constexpr uint32_t Swizzle(uint32_t i) {
    return ((i >> 1) & 1u) | (((i >> 2) & 1u) << 1);
  }
};

// 3-bit keys with 4-bit values at D = 64 (k3v4_nc at head_dim 64): 56-byte slots (24 key + 32
// value bytes) at 56·(p·H + h) in a block, so only 8 bytes aligned: the 16-byte copies of the
// layouts above do not apply. A warp copies each slot as seven 8-byte pieces (cp.async.ca; lane
// 8a + k copies piece k, and piece 7 is past the slot), and a stage holds a chunk's 16 slots in
// 1 KB, after the 16 KB table: token i = i0 + 2·i1 + 4·i2 + 8·i3 at byte 512·i0 + 256·i1 +
// 128·i3 + 64·i2 (64 bytes per token, 8 of them unused), its piece k at 8·(k ^ 4·i3) there.
// - Token bits 0 and 1 only add to the address (Byte(i + j, b) = Byte(i, b) + Byte(j, 0) for i a
//   multiple of 4, j < 4): copy instruction j takes tokens j + 4·i2 + 8·i3, at an immediate offset
//   from the lane's first, and the reads of tokens 2g + 1 and 4t + 1, 2, 3 are offsets from those
//   of 2g and 4t.
// - Token bit 2 picks the 64-byte bank half: the two 8-lane phases of a half-warp's copies (i2 = 0
//   and 1) write different halves, 2 wavefronts per copy instruction (the least for 224 bytes).
// - A value read (tokens 4t + c, t = 0..3, 4 bytes at 24 + 4g) puts two tokens in each half,
//   with masks 0 and 4: pieces 3-6 and 7, 0, 1, 2, which tile it: one wavefront.
// - A key read (a 4-byte word at 6t rounded down to 4, or the one after it, of tokens 2g; both
//   lie in pieces 0-3, which either mask keeps in order, so the second is 4 bytes on) takes 2
//   wavefronts: tokens 2g that differ in bit 1 alone share a half and a mask. (No placement of
//   pieces reads both words in one wavefront each: the four tokens of a half would need their 12
//   key pieces in 8 places. The best, one and two wavefronts, takes masks from token bit 1, which
//   makes the copy destinations XORs per instruction instead of immediate offsets.)
// Per chunk and warp: 4 key and 4 value reads, 12 wavefronts (bank simulation). 52 KB per CTA
// (8 warps), 34 KB (4 warps).
// 3bit_nc at D = 64 (48-byte slots: 24 key + 24 value bytes, 16 bytes aligned) uses the same
// layout with pieces 0-5: the same key reads, and its 3-byte value runs (at 24 + 3g) as two
// 4-byte reads per token, each one wavefront (tools/bench/piece_banks.py): 16 per chunk.
template <int kW>
struct StagedPieceLayout {
  static constexpr uint32_t kFirst = 64 * 256;
  static constexpr uint32_t kStageBytes = 1024;
  static constexpr uint32_t kMeta = kFirst + kW * kStages * kStageBytes;
  static constexpr int kBytes = kMeta + kW * kStages * 128;
  __device__ __forceinline__ static uint32_t Stage(int warp, int s) {
    return kFirst + kStageBytes * (kStages * warp + s);
  }
  // Byte b (0-55) of token i's slot, within its stage.
  __host__ __device__ static constexpr uint32_t Byte(uint32_t i, uint32_t b) {
    const uint32_t i0 = i & 1u, i1 = (i >> 1) & 1u, i2 = (i >> 2) & 1u, i3 = (i >> 3) & 1u;
    return 512u * i0 + 256u * i1 + 128u * i3 + 64u * i2 + 8u * ((b >> 3) ^ (4u * i3)) + (b & 7u);
  }
};

// What the pipeline's copies and reads take from StagedPieceLayout: the 16 × 7 pieces of a stage
// in distinct 8-byte places of its 1 KB, and token bits 0-1 adding to the address.
constexpr bool PieceLayoutHolds() {
  using L = StagedPieceLayout<kStagedWarps>;
  bool used[128] = {};
  for (uint32_t i = 0; i < 16; ++i) {
    for (uint32_t k = 0; k < 7; ++k) {
      const uint32_t at = L::Byte(i, 8 * k);
      if (at % 8 != 0 || at >= L::kStageBytes || used[at / 8]) return false;
      used[at / 8] = true;
      for (uint32_t b = 8 * k; b < 8 * k + 8; ++b) {
        if (L::Byte(i, b) != at + b % 8) return false;
        if (L::Byte(i, b) != L::Byte(i & ~3u, b) + L::Byte(i & 3u, 0)) return false;
      }
    }
  }
  return true;
}
static_assert(PieceLayoutHolds());

// The staged layout of a kind at head_dim kD.
template <KeyKind kKind, int kW, int kD>
using StagedLayoutOf = std::conditional_t<kKind == KeyKind::kMse3 && kD == 64,
                                          StagedPieceLayout<kW>, StagedLayout<kKind, kW>>;

// bf16 keys and values (D = 64 and 128, any GQA group; at D = 256 a staged chunk's registers
// spilled, so D = 256 keeps the unstaged kernel): 4 warps per CTA, each with kStages stages of
// 16 tokens × 4·D bytes (a token's 2·D key bytes, then its 2·D value bytes: 8 KB at D = 128)
// copied kStages - 1 chunks ahead, so that a warp keeps 2 chunks of loads in flight instead of the
// unstaged kernel's one chunk at a time (which leaves small batches latency-bound). A thread's key
// words are the 16-byte units 4j + t of its two tokens (not 4t·D/32 ..: the query fragments follow
// the same d order), its value words the units (D/64)·g + hh of tokens 4t + c. The units of a token
// are XOR-swizzled by Swizzle(token) (unit bits 0-2) so that every 8-lane phase of those reads
// touches 8 distinct 16-byte bank groups: bit 2 = token bits 1 ⊕ 2 separates the two tokens of a
// key read (4q, 4q + 2); the four tokens 4t + c of a value read differ in token bits 2-3, which go
// to the unit bits that the lane's g leaves free (D = 64: bits 1-2; 128: bits 0 and 2). The
// copies (8 consecutive units of one token per phase) are conflict-free under any XOR.
template <int kD>
struct Bf16StagedLayout {  // instantiated for D = 64 and 128 (HasStagedKernel)
  static constexpr int kWarps = 4;
  static constexpr int kStages = 3;
  static constexpr uint32_t kPitch = 4 * kD;  // bytes per token
  static constexpr int kUnits = kD / 4;       // 16-byte units per token
  static constexpr uint32_t kStageBytes = 16 * kPitch;
  static constexpr int kBytes = kWarps * kStages * kStageBytes;
  __device__ __forceinline__ static uint32_t Stage(int warp, int s) {
    return kStageBytes * (kStages * warp + s);
  }
  __host__ __device__ static constexpr uint32_t Swizzle(uint32_t i) {
    const uint32_t b1 = (i >> 1) & 1u, b2 = (i >> 2) & 1u, b3 = (i >> 3) & 1u;
    return kD == 64 ? (4u * (b1 ^ b2) | 2u * b3) : (4u * (b1 ^ b2) | b3);
  }
};

// The shared-output kernels (SplitVariant::shared_o: 8 warps, half precision, 4-bit values or
// 3bit_nc's 3-bit ones, D = 128): three stages per warp (two steps of 8 chunks copied ahead), since
// each group of four warps moves through the split in steps together (SharedOSplit). 4-bit keys:
// stages 0-1 of warp w in the table rows' free halves (as StagedLayout<kMse4, 8>), stage 2 of warps
// 2i and 2i + 1 in the two halves of rows 16i .. 16i + 15 of a 16 KB region after the table; 3-bit
// keys: all stages after the table; FP8 keys (no table): all stages from the start. Then the
// metadata cells, 128 bytes per stage. The swizzles are StagedLayout's.
inline constexpr int kSharedStages = 3;

template <KeyKind kKind>
struct SharedOLayout;

template <>
struct SharedOLayout<KeyKind::kMse4> {
  static constexpr uint32_t kPitch = 256;
  static constexpr uint32_t kExtra = 256 * 256;
  static constexpr uint32_t kMeta = kExtra + 4 * 16 * 256;
  static constexpr int kBytes = kMeta + kStagedWarps * kSharedStages * 128;
  __device__ __forceinline__ static uint32_t Stage(int warp, int s) {
    return s < 2 ? 8192u * warp + 4096u * s + 128u
                 : kExtra + 4096u * (warp >> 1) + 128u * (warp & 1);
  }
  __device__ __forceinline__ static uint32_t Swizzle(uint32_t i) {
    return StagedLayout<KeyKind::kMse4, kStagedWarps>::Swizzle(i);
  }
};

template <>
struct SharedOLayout<KeyKind::kMse3> {
  static constexpr uint32_t kPitch = 128;
  static constexpr uint32_t kFirst = 64 * 256;
  static constexpr uint32_t kMeta = kFirst + kStagedWarps * kSharedStages * 16 * 128;
  static constexpr int kBytes = kMeta + kStagedWarps * kSharedStages * 128;
  // Stage(warp + 1, s) - Stage(warp, s)
  static constexpr uint32_t kWarpStride = 2048u * kSharedStages;
  __device__ __forceinline__ static uint32_t Stage(int warp, int s) {
    return kFirst + 2048u * (kSharedStages * warp + s);
  }
  __device__ __forceinline__ static uint32_t Swizzle(uint32_t i) {
    return StagedLayout<KeyKind::kMse3, kStagedWarps>::Swizzle(i);
  }
};

// FP8 keys with 4-bit values (k8v4): StagedLayout<kFp8>'s 192-byte slots and swizzle, 3 stages per
// warp: 72 KB of stages, 3 KB of metadata cells. The value reads (ldmatrix.trans of one value unit
// of a chunk's 8 even or 8 odd tokens) take two wavefronts per matrix: those tokens start on the
// same bank (384 ≡ 0 mod 128) and the swizzle, which keeps value units in 8-11, gives them four
// distinct units.
template <>
struct SharedOLayout<KeyKind::kFp8> {
  static constexpr uint32_t kPitch = StagedLayout<KeyKind::kFp8, kStagedWarps>::kPitch;
  static constexpr uint32_t kStageBytes = 16 * kPitch;
  static constexpr uint32_t kMeta = kStagedWarps * kSharedStages * kStageBytes;
  static constexpr int kBytes = kMeta + kStagedWarps * kSharedStages * 128;
  __device__ __forceinline__ static uint32_t Stage(int warp, int s) {
    return kStageBytes * (kSharedStages * warp + s);
  }
  __device__ __forceinline__ static uint32_t Swizzle(uint32_t i) {
    return StagedLayout<KeyKind::kFp8, kStagedWarps>::Swizzle(i);
  }
};

// The configuration of split kernel V. Paired CTAs (SplitPipeline::kStagedPaired; 3-bit keys: the
// hi-only twin; 4-bit keys: exact scores): warps 0-3 and 4-7 serve KV heads 2y and 2y + 1 of one
// sequence, each as a narrow CTA would (chunks interleaved over 4 warps, block ids from global
// memory), for the plan's narrow layouts. An SM holds two, i.e. the same four units as four narrow
// CTAs, but the warp schedulers favour the earlier-launched CTAs of an SM: four narrow CTAs of
// equal work finished 20 µs apart at 64 × 4k (~67, 72, 80, 88 µs), the last one alone on its SM
// with 4 warps for 8 µs; with pairs the SM keeps 8 warps to the end.
template <SplitVariant V>
struct SplitKernelConfig {
  static constexpr KeyKind kKind = V.kind;
  static constexpr int kValueBits = V.value_bits;
  static constexpr int kD = V.head_dim;
  static constexpr int kNTiles = V.n_tiles;
  static constexpr bool kStaged = V.staged();
  static constexpr bool kPaired = V.pipeline == SplitPipeline::kStagedPaired;
  // Warps per CTA of a staged compressed kernel.
  static constexpr int kSW = V.staged() && !IsPlain(V.kind) ? V.cta_warps() : kStagedWarps;
  using Traits = CacheTraits<kKind, kValueBits, kD>;
  static constexpr bool kPlainStaged = kStaged && IsPlain(kKind);
  static constexpr int kCtaWarps = [] {
    if constexpr (kPlainStaged) {
      return Bf16StagedLayout<kD>::kWarps;
    } else {
      return kStaged ? kSW : kWarps;
    }
  }();
  static constexpr int kUnits = kPaired ? 2 : 1;  // KV heads per CTA
  static constexpr int kKSteps = kD / 16;
  static constexpr int kMTiles = kD / 16;
  static constexpr bool kSharedO = V.shared_o;
  // The shared-output kernel's products as warpgroup MMAs (SharedOSplit), where the target has
  // them (sm_90a; not the compute_90 PTX that later devices compile), for four N tiles: at two
  // (9-16 columns) the MMAs' descriptor moves and fences outweigh the MMA instructions they save
  // (measured slower: H200, 64 × 4k, 4 new tokens at GQA 4, 4bit_nc 103.0 -> 105.4 µs, k3v4_nc
  // 113.6 -> 122.2).
  static constexpr bool kSharedOWgmma = kSharedO && TQKV_SHARED_O_WGMMA && kNTiles == 4;
  static constexpr int kLutBytes = [] {
    if constexpr (kPlainStaged) {
      return Bf16StagedLayout<kD>::kBytes;
    } else if constexpr (kSharedO) {
      return SharedOLayout<kKind>::kBytes;
    } else if constexpr (kStaged) {
      return StagedLayoutOf<kKind, kSW, kD>::kBytes;
    } else {
      return Traits::kLutEntries * 256;
    }
  }();
  // The warps' merge: accumulators [kCtaWarps][heads][kD], (m, l, z) [3][kCtaWarps][heads], then
  // the per-head factors [kCtaWarps][heads], 1/l [heads] and z [heads].
  // An accumulator row (one warp's head) holds element d at d + d / 32 and rows are kAccStride
  // floats apart (≡ 4 mod 32 words for D ≤ 128): the fragment stores of a packed warp — lane
  // (g, t) writes d = 16g + 2·mt (+1) of head t — then hit 32 distinct banks (unpadded rows of
  // 128 floats put all 32 lanes on 2 banks), and the final pass's reads of consecutive d stay
  // conflict-free. D = 256 keeps plain rows (its merge region would outgrow the table).
  static constexpr int kAccRow = kD <= 128 ? kD + kD / 32 : kD;
  static constexpr int kAccStride = kD <= 128 ? kAccRow + (36 - kAccRow % 32) % 32 : kD;
  __host__ __device__ static constexpr int AccAt(int row, int d) {
    return row * kAccStride + (kD <= 128 ? d + d / 32 : d);
  }
  // The shared-output kernels merge less (SharedOSplit::WriteOutput): warps 4-7's accumulators
  // (kSharedAccStride floats per column and quarter of head_dim), each warp's l and z per column,
  // then 1/l, z and each group's factor and maximum per column.
  static constexpr int kSharedAccStride = 36;
  static constexpr int kMergeBytes =
      kSharedO ? (4 * 8 * kNTiles * kSharedAccStride + (2 * kCtaWarps + 6) * 8 * kNTiles) * 4
               : (kCtaWarps * 8 * kNTiles * kAccStride + (4 * kCtaWarps + 2) * 8 * kNTiles) * 4;
  // The group's rotated query rows as fp16 hi [heads][kD] then lo [heads][kD] parts (plain caches:
  // the cache's type in the first array), rows past the group zero, after everything else (the
  // prologue writes them while the first chunks' copies land in the stages).
  static constexpr int kQueryOffset = kLutBytes > kMergeBytes ? kLutBytes : kMergeBytes;
  static constexpr int kQueryHeads = kStaged && V.packed ? 4 : 8 * kNTiles;  // per unit
  // The 8-warp staged compressed kernels: the split's block ids (int32, after the query rows):
  // at most one per 16 tokens, one more for a split that starts inside a block, and room for
  // the ids the loop reads (and drops) for the (kStages - 1)·kW chunks it looks past the end.
  // Not the narrow kernel: measured 8-18 % slower with them at one round of 512 CTAs (k3v4_nc
  // 64 × 4k 83.5 -> 91.1 µs, 16 × 32k 164.6 -> 194.2; not understood).
  static_assert(kQueryOffset % 64 == 0, "QueryRunAddress XORs the unit bits of the address");
  static constexpr int kIdsOffset = kQueryOffset + kUnits * kQueryHeads * kD * 4;
  static constexpr int kMaxIds =
      kStaged && !kPlainStaged && kSW == kStagedWarps && !kPaired && !kSharedO
          ? kMaxSplitTokens / 16 + 1 + (kStages - 1) * kSW
          : 0;
  // The shared-output kernels: P' of a step's 8 chunks (SharedOSplit: per chunk and N tile two
  // 8 x 8 fp16 matrices, columns by token slot; with warpgroup MMAs per group and column one row
  // of its 4 chunks' 64 token slots), then each group's column maxima (per column, one per warp
  // of the group).
  static constexpr int kPOffset = kIdsOffset + (kMaxIds * 4 + 15) / 16 * 16;
  // The warpgroup MMAs' swizzled operands start on 1,024-byte boundaries of the shared window.
  static_assert(!kSharedO || (kQueryOffset % 1024 == 0 && kPOffset % 1024 == 0));
  static constexpr int kPBytes = kSharedO ? kStagedWarps * kNTiles * 256 : 0;
  static constexpr int kRedOffset = kPOffset + kPBytes;
  static constexpr int kSmemBytes = kRedOffset + (kSharedO ? kStagedWarps * 8 * kNTiles * 4 : 0);
  // Two shared-output CTAs per SM (kSplitMinCtas): 228 KB of shared memory, 1 KB reserved per CTA.
  // FP8 keys' staged kernel, whose stages have no table rows to share, likewise.
  static_assert(!kSharedO || 2 * (kSmemBytes + 1024) <= 228 * 1024);
  static_assert(!(kStaged && kKind == KeyKind::kFp8) || 2 * (kSmemBytes + 1024) <= 228 * 1024);
  // What the output accumulators' rows g + 8 (odd d) are scaled back by: the staged kernels of
  // 3-bit values hold their codes at 8x (CompressedValues::RowsOfWindow).
  static constexpr float kOddRowScale = [] {
    if constexpr (!IsPlain(kKind) && kValueBits == 3 && kStaged) {
      return Traits::kStagedOddRowScale;
    } else {
      return Traits::kOddRowScale;
    }
  }();
  // Scores from the codebook's hi parts alone (SplitVariant::hi_only).
  static constexpr bool kHiOnly = V.hi_only;
  // Half precision (SplitVariant::half): one fp16 query part, hi centroids, one fp16 P'.
  static constexpr bool kHalf = V.half;
  // The codebook table holds the hi pairs alone, 32 replicas: a 4-byte lookup in one wavefront,
  // where the hi + lo table's 16 replicas put lanes l and l + 16 on one bank (ncu counted 27 % of
  // the half kernel's shared-load wavefronts as such conflicts; 1 % faster without them).
  static constexpr bool kHiTable = kHiOnly || kHalf;
  // The query's fp16 parts in the score MMA's B fragments: hi and lo, except where the plain
  // kinds take the cache's type, the packed kernels put lo in a column of its own and the
  // half-precision kernels drop it.
  static constexpr int kQParts = IsPlain(kKind) || V.packed || V.half ? 1 : 2;
  // Four N tiles (groups 17-32): the output accumulators take 128 registers, so the query's B
  // fragments are read from the rotated rows in shared memory (SplitCompute::QueryRunAddress),
  // not held.
  static constexpr bool kQueryInSmem = kNTiles > 2 || kSharedO;
  static constexpr int kFragTiles = kQueryInSmem ? 1 : kNTiles;  // qf's N tiles (unused: 1)
  // Element d of rotated query row `head` in shared memory. With kQueryInSmem a thread (g, t)
  // reads 16-byte unit j of its 64-byte run (elements 32t .. 32t + 31) of row 8·nt + g per pair
  // of k-steps; rows are 256 bytes apart, so units 4t + j and 4(t + 2) + j share banks. The
  // units of a run are XOR-permuted by f = 2·(t / 2) + head mod 2: an 8-lane phase (g in {2i,
  // 2i + 1}, t = 0..3) then reads 8 distinct 16-byte bank groups.
  // The shared-output kernel's warpgroup MMAs (kSharedOWgmma) read the rows as the score's B
  // operand: K-major, 128-byte swizzle (attention/wgmma.cuh), k-steps 0-3 in a first atom of
  // kQueryHeads rows of 128 bytes and 4-7 in a second, each k-step's 16 elements in the order of
  // the key fragments' k index (a thread t's key elements d = 32t + 4s .. + 3 of k-step s are
  // its k = 2t, 2t + 1, 2t + 8, 2t + 9).
  __host__ __device__ static constexpr int QueryAt(int head, int d) {
    if constexpr (kSharedOWgmma) {
      const int t = d >> 5, s = (d >> 2) & 7, i = d & 3;
      const int pos = 16 * (s & 3) + 8 * (i >> 1) + 2 * t + (i & 1);  // in the atom's row
      return (s >> 2) * kQueryHeads * 64 + head * 64 + 8 * ((pos >> 3) ^ (head & 7)) + (pos & 7);
    } else if constexpr (!kQueryInSmem) {
      return head * kD + d;
    } else if constexpr (IsPlain(kKind)) {
      // The bf16 / fp16 caches' staged kernel of four N tiles (interleaved keys: a thread t's
      // elements of k-steps 2j and 2j + 1 are d = 32j + 8t .. + 7, one 16-byte unit): odd rows
      // have the 64-byte halves of every 128 bytes swapped (D = 64 and 128), so that rows g and
      // g + 1 of an 8-lane phase fall on distinct banks.
      return head * kD + (d ^ ((head & 1) << 5));
    } else {
      const int f = (2 * ((d >> 6) & 1)) ^ (head & 1);
      return head * kD + (d ^ (f << 3));
    }
  }
  static_assert(V.cta_warps() == kCtaWarps && V.units() == kUnits);
};

// CTAs per SM the kernel is compiled for (D ≤ 128, one N tile; the others take what they need).
// The bf16 kernel fits 128 registers without spilling, so four CTAs (16 warps) per SM keep more
// loads in flight: 4 % faster at batch 64 × 4k. The compressed kernels are held to three (≤ 168
// registers; left alone, the unpacked ones for GQA groups 5-8 took 179-198, i.e. two CTAs);
// capped at 128 for four they spilled and ran 20-35 % slower (measured, k3v4_nc and k8v4), and
// the 4-bit table (64 KB) allows three anyway. Staged kernels: two bf16 CTAs; 16 compressed
// warps per SM, or one CTA per SM for the one_cta twin (up to 255 registers instead of 128:
// ptxas takes 151, the loop keeps its length; 3-5 % faster where a split grid fits the SMs), and
// for the half-precision staged kernel of two N tiles (GQA groups 9-16: its accumulators and
// query fragments take ~200 registers; held to 128 for two CTAs, with the fragments in shared
// memory, it spilled and measured 5 % slower: 182.9 vs 173.4 µs at 64 × 4k); its narrow twin (4
// warps, ChooseSplitVariant) keeps the fragments in its 198-204 registers at two CTAs per SM
// (three, with the fragments in shared memory and 165 registers, measured 6 % slower). The
// kernel of four N tiles (groups 17-32) reads its fragments from shared memory: two CTAs per SM
// at 246-251 registers.
// Head_dim 64 (4-bit keys staged there too): the register kernel of two N tiles fits three CTAs
// per SM for codebook keys (162-166 registers; 3-bit keys' 5-token verify at 9:3:64, 64 × 4k,
// H100: 0.72x the time at two CTAs); FP8 keys' kernel fits three unconstrained (163 registers) and
// measured 1.5-2 % slower held to 156 for it, so it is left alone. 4-bit keys' half-precision
// kernel of two N tiles takes 127 registers (two 8-warp CTAs) or 140 (three 4-warp ones), their
// exact one 180 at one 8-warp CTA (two spilled 196 bytes) or 168 at three 4-warp ones; 3-bit keys'
// half-precision one 125 (two 8-warp CTAs) or 136 (three 4-warp ones), their packed kernel 104 and
// its hi-only twin 96 (two 8-warp CTAs); with 3-bit values (3bit_nc) 128 / 143, 112 and 96, and
// the half-precision kernel of one N tile 106.
template <SplitVariant V>
constexpr int kSplitMinCtas = [] {
  if (!V.staged()) {
    if (V.n_tiles == 2 && V.head_dim == 64 &&
        (V.kind == KeyKind::kMse3 || V.kind == KeyKind::kMse4)) {
      return 3;
    }
    return V.n_tiles != 1 || V.head_dim > 128 ? 1 : IsPlain(V.kind) ? 4 : 3;
  }
  if (IsPlain(V.kind)) return 2;
  if (V.shared_o) return 2;
  if (V.head_dim == 64 && !V.packed && V.n_tiles == 2) {
    return V.cta_warps() == 4 ? 3 : V.half ? 2 : 1;
  }
  if (V.one_cta || (V.half && V.n_tiles > 1 && V.cta_warps() == 8)) return 1;
  return V.half ? 2 : 16 / V.cta_warps();
}();
}  // namespace tqkv::decode_detail
