// The split kernel's four chunk pipelines: each copies or loads a warp's chunks (this warp's
// chunks are warp, warp + kW, ... of the split's full chunks), calls finish_prologue once its
// first copies are out, and calls `compute` per chunk. Staged pipelines copy chunks into shared
// memory by cp.async a few chunks ahead; register pipelines hold the next chunk in registers.
// Function templates over the kernel's lambdas and values, so that after inlining each is the
// code the kernel held inline (decode_split_kernel.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode_cache_traits.cuh"
#include "attention/decode_device.cuh"
#include "attention/decode_launch.h"
#include "attention/decode_split_compute.cuh"
#include "attention/decode_split_config.cuh"
#include "attention/decode_variant.h"

namespace tqkv::decode_detail {

// What the pipelines read of the kernel's prologue: the warp's place and the per-thread byte
// offsets within a block.
struct SplitPipelineFrame {
  const SplitParams& p;
  int lane, g, t;
  int warp;      // among the kW warps that share the KV head's chunks
  int cta_warp;  // among the CTA's warps
  int h;         // KV head
  int begin;     // the split's first token
  int num_full;  // the split's full chunks
  int block_shift;
  int stride_token, head_off, value_base, meta_field;
  int id0;     // the split's first block index (ids_s[0] is its id)
  int* ids_s;  // block ids in shared memory (Config::kMaxIds > 0)
};

template <SplitVariant V>
struct SplitPipelines {
  using Config = SplitKernelConfig<V>;
  using Traits = typename Config::Traits;
  using Chunk = SplitChunk<Traits>;
  static constexpr KeyKind kKind = V.kind;
  static constexpr int kValueBits = V.value_bits;
  static constexpr int kD = V.head_dim;
  static constexpr int kW = Config::kCtaWarps / Config::kUnits;
  static constexpr int kSW = Config::kSW;
  // The cache copies with the L2 evict-first policy (CopyAsync16Fill), except 3-bit keys'.
  static constexpr bool kStreamCopies = kKind != KeyKind::kMse3;

  // bf16 / fp16 caches at D = 128 (Config::kPlainStaged).
  template <typename FirstBlock, typename BlockOf, typename Finish, typename Compute>
  __device__ __forceinline__ static void PlainStaged(const SplitPipelineFrame& f,
                                                     FirstBlock& first_block, BlockOf& block_of,
                                                     Finish& finish_prologue,
                                                     const Compute& compute) {
    extern __shared__ __align__(16) uint8_t smem[];
    const SplitParams& p = f.p;
    const int lane = f.lane, g = f.g, t = f.t, warp = f.warp, begin = f.begin;
    const int num_full = f.num_full, stride_token = f.stride_token, head_off = f.head_off;
    const int value_base = f.value_base;
    // Chunk c + (S - 1)·kW is copied into stage (k + S - 1) mod S while chunk c (this warp's k-th)
    // is read from stage k mod S and computed, one commit group per chunk (empty past the end).
    // Copy instruction i covers units 32·i .. 32·i + 31 of the chunk's 16 × kU units (token by
    // token): lane l copies unit e % kU of token e / kU, e = 32·i + l (D = 64: two tokens per
    // instruction), so each instruction reads whole runs of 128 or 256 key or value bytes.
    using Layout = Bf16StagedLayout<kD>;
    constexpr int kS = Layout::kStages;
    constexpr uint32_t kPitch = Layout::kPitch;
    constexpr int kU = Layout::kUnits;
    constexpr int kCopies = 16 * kU / 32;
    const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    uint32_t stage[kS];  // shared addresses of this warp's stages, stage[0] = the next read
#pragma unroll
    for (int s = 0; s < kS; ++s) stage[s] = smem_base + Layout::Stage(warp, s);
    // Lane l's unit and its token within the instruction.
    const uint32_t lane_unit = lane % kU;
    const uint32_t lane_token = lane / kU;
    // Destination of lane l's unit for each swizzle mask x (the mask is a compile-time function
    // of the token, so each instruction picks one of these).
    uint32_t copy_dst[8];
#pragma unroll
    for (int x = 0; x < 8; ++x) copy_dst[x] = kPitch * lane_token + 16u * (lane_unit ^ x);
    // Source of lane l's unit: a key unit below kU / 2, a value unit above.
    const uint32_t copy_src =
        Pinned((lane_unit < kU / 2 ? 0u : static_cast<uint32_t>(value_base)) + head_off +
               16u * (lane_unit % (kU / 2)) + lane_token * static_cast<uint32_t>(stride_token));
    const uint32_t block_bytes = static_cast<uint32_t>(p.block_bytes);
    const uint32_t token_bytes = static_cast<uint32_t>(stride_token);
    auto issue = [&](int cc, uint32_t dst, int block) {
      const uint32_t bytes = cc < num_full ? 16u : 0u;
      const uint8_t* base = PinnedPointer(
          p.cache + static_cast<uint64_t>(static_cast<uint32_t>(block)) * block_bytes);
      const uint32_t pos0 = (begin + cc * kChunk) & (p.block_size - 1);
      const uint8_t* src = base + pos0 * token_bytes;
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        // The instruction's first token and its swizzle mask (compile-time after unrolling; the
        // mask ignores token bit 0, so both tokens of a D = 64 instruction share it).
        const int tok = (32 * i) / kU;
        const uint32_t x = Layout::Swizzle(tok);
        CopyAsync16Fill<kStreamCopies>(dst + copy_dst[x] + kPitch * tok,
                                       src + copy_src + tok * token_bytes, bytes);
      }
    };
    // Reads: keys of token 2g (units 4j + t: from read_k[j % 2] + 64·(j - j % 2)) and 2g + 1
    // (+kPitch: same mask); values of token 4t + c, units (D/64)·g + hh, from read_v[c / 2][hh]
    // (+kPitch for odd c).
    constexpr int kKeyUnits = kD / 32, kValueUnits = kD / 64;
    const uint32_t key_x = t ^ Layout::Swizzle(2 * g);
    const uint32_t read_k0 = Pinned(kPitch * (2 * g) + 16u * key_x);
    const uint32_t read_k1 = Pinned(kPitch * (2 * g) + 16u * (key_x ^ 4u));
    uint32_t read_v[2][kValueUnits];
#pragma unroll
    for (int c2 = 0; c2 < 2; ++c2) {
      const uint32_t tok = 4 * t + 2 * c2;
#pragma unroll
      for (int hh = 0; hh < kValueUnits; ++hh) {
        read_v[c2][hh] =
            Pinned(kPitch * tok + 2u * kD + 16u * ((kValueUnits * g + hh) ^ Layout::Swizzle(tok)));
      }
    }
    auto read = [&](uint32_t st, Chunk& ck) {
#pragma unroll
      for (int j = 0; j < kKeyUnits; ++j) {
        const uint32_t a = st + (j & 1 ? read_k1 : read_k0) + 128u * (j >> 1);
        uint32_t w[4];
        SharedLoad16(a, w);
#pragma unroll
        for (int i = 0; i < 4; ++i) ck.kg[4 * j + i] = w[i];
        SharedLoad16(a + kPitch, w);
#pragma unroll
        for (int i = 0; i < 4; ++i) ck.k8[4 * j + i] = w[i];
      }
      // v[0..3] = tokens 4t, 4t + 2, 4t + 1, 4t + 3.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c2 = i & 1, odd = i >> 1;
#pragma unroll
        for (int hh = 0; hh < kValueUnits; ++hh) {
          uint32_t w[4];
          SharedLoad16(st + read_v[c2][hh] + kPitch * odd, w);
#pragma unroll
          for (int k = 0; k < 4; ++k) ck.v[i][4 * hh + k] = w[k];
        }
      }
    };
    int first_blocks[kS];  // all read before any copy waits for one
#pragma unroll
    for (int k = 0; k < kS; ++k) first_blocks[k] = first_block(k);
#pragma unroll
    for (int k = 0; k < kS - 1; ++k) {
      issue(warp + k * kW, stage[k], first_blocks[k]);
      CopyAsyncCommit();
    }
    int next_block = first_blocks[kS - 1];
    finish_prologue();
    Chunk cur;
#pragma unroll 1
    for (int c = warp; c < num_full; c += kW) {
      const int ahead = c + (kS - 1) * kW;
      const int following = block_of(ahead + kW, num_full);
      CopyAsyncWaitGroup<kS - 2>();
      __syncwarp();  // every lane's copies of chunk c are complete and visible
      read(stage[0], cur);
      // The stage written here was read in the previous step (by mma operands every lane
      // reached), so it is free.
      issue(ahead, stage[kS - 1], next_block);
      CopyAsyncCommit();
      compute.template operator()<false>(c, cur);
      next_block = following;
      const uint32_t first = stage[0];
#pragma unroll
      for (int i = 0; i + 1 < kS; ++i) stage[i] = stage[i + 1];
      stage[kS - 1] = first;
    }
    CopyAsyncWait();  // (only empty groups remain) before the merge reuses shared memory
  }

  // The other bf16 / fp16 kernels. A bf16 chunk is 4x the bytes of a compressed one: one buffer,
  // and occupancy (more warps per SM) keeps enough loads in flight.
  template <typename FirstBlock, typename BlockOf, typename Finish, typename Load, typename Compute>
  __device__ __forceinline__ static void PlainRegisters(const SplitPipelineFrame& f,
                                                        FirstBlock& first_block, BlockOf& block_of,
                                                        Finish& finish_prologue, Load& load,
                                                        const Compute& compute) {
    const int warp = f.warp, num_full = f.num_full;
    // A bf16 chunk is 4x the bytes of a compressed one: one buffer, and occupancy (more warps
    // per SM) keeps enough loads in flight.
    Chunk buf;
    int block = first_block(0);
    finish_prologue();
#pragma unroll 1
    for (int c = warp; c < num_full; c += kW) {
      const int next = block_of(c + kW, num_full);
      load(c, buf, block);
      compute.template operator()<false>(c, buf);
      block = next;
    }
  }

  // 4bit_nc, k3v4_nc and 3bit_nc at D = 128 and 64, k8v4 at D = 128 (Config::kStaged,
  // compressed).
  template <typename FirstBlock, typename BlockOf, typename Finish, typename Compute>
  __device__ __forceinline__ static void Staged(const SplitPipelineFrame& f, uint32_t& lane_word,
                                                FirstBlock& first_block, BlockOf& block_of,
                                                Finish& finish_prologue, const Compute& compute) {
    extern __shared__ __align__(16) uint8_t smem[];
    const SplitParams& p = f.p;
    const int lane = f.lane, g = f.g, t = f.t, warp = f.warp, cta_warp = f.cta_warp, h = f.h;
    const int begin = f.begin, num_full = f.num_full, block_shift = f.block_shift;
    const int stride_token = f.stride_token, head_off = f.head_off, meta_field = f.meta_field;
    const int id0 = f.id0;
    int* const ids_s = f.ids_s;
    // Chunk c + (kStages - 1)·kW is copied into stage (k + 3) mod 4 while chunk c (this warp's
    // k-th) is read from stage k mod 4 and computed; one commit group per chunk (empty past the
    // end) keeps the wait count fixed. In copy instruction j (j = 0..3) lane l copies the 16-byte
    // unit l mod 8 of token 4j + l / 8, so each 8-lane phase moves one token's whole slot: one
    // L2 request per 128-byte line of the slot (two where a 112-byte slot of 3-bit keys crosses a
    // line), where lane pairs over 16 tokens (v7y) made four per line, and twice that for the
    // 3-bit slots at 112·h: that request rate held k3v4_nc's copies to 57 % of the read ceiling
    // (v8a). A phase writes one token's 8 units of one stage row, conflict-free under any
    // swizzle. Lanes 0-5 also copy one 16-byte half of a metadata run each (FP8 keys: lanes 0-3,
    // two fields; their 192-byte slots take two more copy instructions for the value units,
    // below, so these four move the key units alone).
    // 3-bit keys at D = 64 (kPieces): 56-byte slots, 8 bytes aligned, copied as 8-byte pieces
    // into StagedPieceLayout: in copy instruction j lane l copies piece l mod 8 (none for 7) of
    // token j + 4·(l / 8 mod 2) + 8·(l / 16), so each 8-lane phase still moves one token's slot.
    // 3bit_nc's 48-byte slots (24 key + 24 value bytes) take the same layout and copies, pieces
    // 0-5 (6 and 7 idle): its key bytes and their reads are k3v4_nc's. (Its slots are 16 bytes
    // aligned, so 16-byte copies into the same places would do too; not compared.)
    constexpr bool kPieces = kKind == KeyKind::kMse3 && kD == 64;
    using Layout = StagedLayoutOf<kKind, kSW, kD>;
    // Bytes from token 2m to token 2m + 1 of a stage.
    constexpr uint32_t kPitch = [] {
      if constexpr (kPieces) {
        return Layout::Byte(1, 0);
      } else {
        return Layout::kPitch;
      }
    }();
    constexpr uint32_t kKeyBytes = Traits::kKeyBytes * 4;  // per token (4 lanes)
    constexpr uint32_t kValBytes = Traits::kValueBytes * 8;  // per token (8 lanes)
    static_assert(kPieces ? kKeyBytes == 24 && (kKeyBytes + kValBytes == 56 ||
                                                (kValueBits == 3 && kKeyBytes + kValBytes == 48))
                          : kKeyBytes % 16 == 0 && kKeyBytes + kValBytes <= kPitch);
    constexpr uint32_t kCopyBytes = kPieces ? 8 : 16;
    // Where byte `byte` of token `token`'s slot lies in a stage.
    auto at = [](uint32_t token, uint32_t byte) {
      if constexpr (kPieces) {
        return Layout::Byte(token, byte);
      } else {
        return kPitch * token + 16u * ((byte >> 4) ^ Layout::Swizzle(token)) + (byte & 15u);
      }
    };
    const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    uint32_t stage[kStages];  // shared addresses of this warp's stages, stage[0] = the next read
#pragma unroll
    for (int s = 0; s < kStages; ++s) stage[s] = smem_base + Layout::Stage(cta_warp, s);
    const uint32_t meta_cells = smem_base + Layout::kMeta + 128u * kStages * cta_warp;
    const uint32_t copy_tok = kPieces ? 4u * ((lane >> 3) & 1) + 8u * (lane >> 4) : lane >> 3,
                   copy_unit = lane & 7u;
    // The swizzles are XOR-linear in the token's bits, so token 4j + r's destination is r's with
    // Swizzle(4j) applied: pitch · token has no set bit at or below the masks' top bit, so the
    // XOR touches only the unit bits and carries nothing (the masks reach byte bits 4-6 where the
    // pitch is a multiple of 128, bits 4-5 at FP8 keys' pitch of 192). The piece layout adds token
    // j's offset instead.
    const uint32_t copy_dst = Pinned([&] {
      if constexpr (kPieces) {
        return at(copy_tok, kCopyBytes * copy_unit);
      } else {
        return kPitch * copy_tok + 16u * (copy_unit ^ Layout::Swizzle(copy_tok));
      }
    }());
    const uint32_t copy_head = head_off;
    // A warp's chunks lie kW·16 tokens apart; in the 8-warp kernels that is 128 tokens, a multiple
    // of every block size (16-128), so the position of each of its chunks in its block is the
    // same (kFixedPos: folded into copy_src once, no per-chunk position arithmetic).
    constexpr bool kFixedPos = kW * kChunk == 128;
    const uint32_t warp_pos =
        kFixedPos ? (static_cast<uint32_t>(begin + warp * kChunk) & (p.block_size - 1)) : 0u;
    const uint32_t copy_src =
        Pinned((warp_pos + copy_tok) * stride_token + copy_head + kCopyBytes * copy_unit);
    // 4 tokens (the piece layout: 1)
    const uint32_t copy_step = Pinned((kPieces ? 1u : 4u) * static_cast<uint32_t>(stride_token));
    // Unit 7 of a 112-byte slot (3-bit keys) is past the slot: that lane copies nothing (piece 7
    // of a 56-byte slot too, pieces 6-7 of a 48-byte one).
    const bool copy_lane = kCopyBytes * copy_unit < kKeyBytes + kValBytes;
    // FP8 keys (k8v4: 192-byte slots): the copies above take a token's 8 key units; two more
    // instructions take the 4 value units of 8 tokens each: lane l unit 8 + l mod 4 of token
    // 8j + l / 4 (an 8-lane phase: two tokens' 64 value bytes).
    constexpr bool kFp8 = kKind == KeyKind::kFp8;
    static_assert(!kFp8 || (kKeyBytes == 128 && kValBytes == 64 && kPitch == 192));
    const uint32_t value_tok = lane >> 2, value_unit = 8u + (lane & 3u);
    const uint32_t value_dst = [&] {
      if constexpr (kFp8) {
        return Pinned(kPitch * value_tok + 16u * (value_unit ^ Layout::Swizzle(value_tok)));
      } else {
        return 0u;
      }
    }();
    const uint32_t value_src =
        kFp8 ? Pinned((warp_pos + value_tok) * stride_token + copy_head + 16u * value_unit) : 0u;
    // One lane per field and 16-byte half of the chunk's metadata runs (MSE keys: k_norm,
    // v_scale, v_zero; FP8 keys: v_scale, v_zero).
    const bool meta_lane = lane < (Traits::kHasNorm ? 6 : 4);
    const uint32_t copy_meta =
        Pinned(static_cast<uint32_t>(p.meta_offset) + 2 * h * p.num_meta * p.block_size +
               (lane >> 1) * meta_field + 16 * (lane & 1) + 2 * warp_pos);
    const uint32_t meta_dst_lane = Pinned(meta_cells + 16u * lane);
    const uint32_t block_bytes = static_cast<uint32_t>(p.block_bytes);
    // Chunk cc into a stage; past the split's full chunks (block 0) nothing is read.
    // (One 64-bit address per chunk, then 64-bit steps: a 64-bit product and sum per copy cost
    // 7 more instructions per chunk.)
    auto issue = [&](int cc, uint32_t dst, uint32_t meta_dst, int block) {
      const uint32_t bytes = cc < num_full ? 16u : 0u;
      const uint8_t* base = PinnedPointer(
          p.cache + static_cast<uint64_t>(static_cast<uint32_t>(block)) * block_bytes);
      const uint32_t pos0 = kFixedPos ? 0u : (begin + cc * kChunk) & (p.block_size - 1);
      const uint8_t* from = base + (pos0 * stride_token + copy_src);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if constexpr (kPieces) {
          static_assert(!kStreamCopies);
          CopyAsync8FillIf(copy_lane, dst + copy_dst + at(j, 0), from, cc < num_full ? 8u : 0u);
        } else {
          const uint32_t to = dst + 4u * kPitch * j + (copy_dst ^ (16u * Layout::Swizzle(4u * j)));
          if constexpr (kKeyBytes + kValBytes == 128 || kFp8) {
            CopyAsync16Fill<kStreamCopies>(to, from, bytes);
          } else {
            CopyAsync16FillIf<kStreamCopies>(copy_lane, to, from, bytes);
          }
        }
        from += copy_step;
      }
      if constexpr (kFp8) {
        const uint8_t* vfrom = base + (pos0 * stride_token + value_src);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          // Tokens 8j + r: r's destination with Swizzle(8j) applied (as above; it is 0, since
          // the swizzle takes token bits 1-2 alone).
          const uint32_t to = dst + 8u * kPitch * j + (value_dst ^ (16u * Layout::Swizzle(8u * j)));
          CopyAsync16Fill<kStreamCopies>(to, vfrom, bytes);
          vfrom += 8u * static_cast<uint32_t>(stride_token);
        }
      }
      CopyAsync16FillIf<kStreamCopies>(meta_lane, meta_dst, base + (copy_meta + 2 * pos0), bytes);
    };
    // Read offsets within a stage: keys of token 2g and 2g + 1 (+kPitch: the swizzle depends on
    // token / 2); values of tokens 4t, 4t + 1 (+kPitch) and 4t + 2, 4t + 3 (+kPitch), bytes
    // kKeyBytes + 8g; metadata of tokens 2g, 2g + 1.
    // 16-byte, 8-byte or 4-byte reads; the piece layout: the 4-byte words at 6t rounded down to
    // 4 and after it, and byte permutes with key_sel (below).
    // FP8 keys: a thread's 32 key bytes of a token as two 16-byte reads (units 2t and 2t + 1).
    constexpr int kKeyReads = kKind == KeyKind::kMse4 || kPieces ? 1 : kFp8 ? 2 : 3;
    uint32_t read_k[kKeyReads];
#pragma unroll
    for (int w = 0; w < kKeyReads; ++w) {
      read_k[w] = Pinned(at(2 * g, kKind == KeyKind::kMse4 ? uint32_t(Traits::kKeyBytes) * t
                                   : kPieces               ? (6u * t) & ~3u
                                   : kFp8                  ? 32u * t + 16u * w
                                                           : 12u * t + 4u * w));
    }
    // 3-bit values (3bit_nc: D = 64, 3 bytes at 24 + 3g; D = 128, 6 bytes at 48 + 6g; not 4-byte
    // aligned): the 4-byte words at that byte rounded down to 4 (read_v0, read_v1) and after it
    // (read_v0b, read_v1b), joined by byte permutes with per-thread selectors into the words
    // LoadBytes gives the register pipeline: in word 0 the run's bytes 0-3 (val_sel), at D = 128
    // in word 1 its bytes 4-5 and two zeros (val_sel_hi; at D = 64 byte 3 of word 0 differs from
    // LoadBytes' zero, and no decode reads it), so the compute code takes these and the masked
    // last chunks' register loads alike (CompressedValues::RowWindows). At D = 64 each of the 8
    // reads takes one wavefront (piece_banks.py), at D = 128 two (the 3-bit keys' swizzle,
    // unchanged).
    constexpr bool kSplitValues = kValueBits == 3;
    static_assert(!kSplitValues || Traits::kValueBytes == (kPieces ? 3 : 6));
    const uint32_t value_byte = kKeyBytes + uint32_t(Traits::kValueBytes) * g;
    const uint32_t value_at = kSplitValues ? value_byte & ~3u : value_byte;
    const uint32_t read_v0 = Pinned(at(4 * t, value_at));
    const uint32_t read_v1 = kPieces ? read_v0 + at(2, 0) : Pinned(at(4 * t + 2, value_at));
    // The second word may lie in another piece or unit: its own addresses (the piece layout's
    // token bits 0-1 still add).
    const uint32_t read_v0b = kSplitValues ? Pinned(at(4 * t, value_at + 4u)) : 0u;
    const uint32_t read_v1b = kSplitValues && !kPieces ? Pinned(at(4 * t + 2, value_at + 4u)) : 0u;
    const uint32_t val_sel = kSplitValues ? Pinned(0x3210u + 0x1111u * (value_byte & 3u)) : 0u;
    const uint32_t val_sel_hi =
        kSplitValues && !kPieces ? Pinned(0x54u + 0x11u * (value_byte & 3u)) : 0u;
    // The piece layout's key bytes 6t .. 6t + 5 from the words A (at 6t rounded down) and B: in
    // kg[0] bytes 6t .. 6t + 3 (A's, or A's upper and B's lower halves for odd t), in kg[1]
    // bytes 6t + 4, 6t + 5 and two zero bytes: the words the register pipeline's LoadBytes gives.
    const uint32_t key_sel = kPieces ? Pinned(t & 1 ? 0x5432u : 0x3210u) : 0u;
    const uint32_t key_sel_hi = kPieces ? Pinned(t & 1 ? 0x76u : 0x54u) : 0u;  // of (0, B)
    const uint32_t read_meta = Pinned(meta_cells + 4u * g);
    auto read = [&](uint32_t st, uint32_t meta, Chunk& ck) {
      if constexpr (kKind == KeyKind::kMse4) {
        if constexpr (Traits::kKeyWords == 4) {
          SharedLoad16(st + read_k[0], ck.kg);
          SharedLoad16(st + read_k[0] + kPitch, ck.k8);
        } else {
          SharedLoad8(st + read_k[0], ck.kg);
          SharedLoad8(st + read_k[0] + kPitch, ck.k8);
        }
      } else if constexpr (kFp8) {
        static_assert(Traits::kKeyWords == 8);
        uint32_t w[4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          SharedLoad16(st + read_k[r], w);
#pragma unroll
          for (int i = 0; i < 4; ++i) ck.kg[4 * r + i] = w[i];
          SharedLoad16(st + read_k[r] + kPitch, w);
#pragma unroll
          for (int i = 0; i < 4; ++i) ck.k8[4 * r + i] = w[i];
        }
      } else if constexpr (kPieces) {
        const uint32_t a0 = SharedLoad4(st + read_k[0]), b0 = SharedLoad4(st + read_k[0] + 4);
        const uint32_t a1 = SharedLoad4(st + read_k[0] + kPitch);
        const uint32_t b1 = SharedLoad4(st + read_k[0] + kPitch + 4);
        ck.kg[0] = __byte_perm(a0, b0, key_sel);
        ck.kg[1] = __byte_perm(0u, b0, key_sel_hi);
        ck.k8[0] = __byte_perm(a1, b1, key_sel);
        ck.k8[1] = __byte_perm(0u, b1, key_sel_hi);
      } else {
#pragma unroll
        for (int w = 0; w < kKeyReads; ++w) {
          ck.kg[w] = SharedLoad4(st + read_k[w]);
          ck.k8[w] = SharedLoad4(st + read_k[w] + kPitch);
        }
      }
      if constexpr (Traits::kValueWords == 2 && !kSplitValues) {
        SharedLoad8(st + read_v0, ck.v[0]);
        SharedLoad8(st + read_v0 + kPitch, ck.v[2]);
        SharedLoad8(st + read_v1, ck.v[1]);
        SharedLoad8(st + read_v1 + kPitch, ck.v[3]);
      } else if constexpr (kSplitValues && !kPieces) {
        static_assert(Traits::kValueWords == 2);
        // v[0..3] = tokens 4t, 4t + 2, 4t + 1, 4t + 3.
        const uint32_t a[4] = {SharedLoad4(st + read_v0), SharedLoad4(st + read_v1),
                               SharedLoad4(st + read_v0 + kPitch),
                               SharedLoad4(st + read_v1 + kPitch)};
        const uint32_t b[4] = {SharedLoad4(st + read_v0b), SharedLoad4(st + read_v1b),
                               SharedLoad4(st + read_v0b + kPitch),
                               SharedLoad4(st + read_v1b + kPitch)};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          ck.v[i][0] = __byte_perm(a[i], b[i], val_sel);
          ck.v[i][1] = __byte_perm(0u, b[i], val_sel_hi);
        }
      } else if constexpr (kSplitValues) {
        constexpr uint32_t kTwo = at(2, 0);  // token 4t + 2 from 4t
        const uint32_t a0 = SharedLoad4(st + read_v0), b0 = SharedLoad4(st + read_v0b);
        const uint32_t a2 = SharedLoad4(st + read_v0 + kPitch);
        const uint32_t b2 = SharedLoad4(st + read_v0b + kPitch);
        const uint32_t a1 = SharedLoad4(st + read_v0 + kTwo);
        const uint32_t b1 = SharedLoad4(st + read_v0b + kTwo);
        const uint32_t a3 = SharedLoad4(st + read_v0 + kTwo + kPitch);
        const uint32_t b3 = SharedLoad4(st + read_v0b + kTwo + kPitch);
        ck.v[0][0] = __byte_perm(a0, b0, val_sel);
        ck.v[2][0] = __byte_perm(a2, b2, val_sel);
        ck.v[1][0] = __byte_perm(a1, b1, val_sel);
        ck.v[3][0] = __byte_perm(a3, b3, val_sel);
      } else {
        ck.v[0][0] = SharedLoad4(st + read_v0);
        ck.v[2][0] = SharedLoad4(st + read_v0 + kPitch);
        ck.v[1][0] = SharedLoad4(st + read_v1);
        ck.v[3][0] = SharedLoad4(st + read_v1 + kPitch);
      }
      if constexpr (Traits::kHasNorm) {
        ck.norm = SharedLoad4(meta);
        ck.vscale = SharedLoad4(meta + 32);
        ck.vzero = SharedLoad4(meta + 64);
      } else {  // FP8 keys' fields: v_scale, v_zero
        ck.norm = 0u;
        ck.vscale = SharedLoad4(meta);
        ck.vzero = SharedLoad4(meta + 32);
      }
    };
    int first_blocks[kStages];  // all read before any copy waits for one
#pragma unroll
    for (int k = 0; k < kStages; ++k) first_blocks[k] = first_block(k);
    constexpr int kPrologueStages = kStages - 1;
#pragma unroll
    for (int k = 0; k < kPrologueStages; ++k) {
      issue(warp + k * kW, stage[k], meta_dst_lane + 128u * k, first_blocks[k]);
      CopyAsyncCommit();
    }
    // The narrow kernel: block ids from global memory, each read one chunk before its copy.
    [[maybe_unused]] int next_block = first_blocks[kStages - 1];
    finish_prologue();
    lane_word = Pinned(lane_word);
    // The 8-warp kernels: block id of chunk cc from the split's ids in shared memory (read there
    // past the end too, inside Config::kMaxIds, and dropped), 0 past its full chunks.
    const uint32_t ids_lane = Pinned(static_cast<uint32_t>(__cvta_generic_to_shared(ids_s)) -
                                     4u * static_cast<uint32_t>(id0));
    auto staged_block = [&](int cc) -> int {
      const uint32_t at =
          ids_lane + 4u * static_cast<uint32_t>((begin + cc * kChunk) >> block_shift);
      return cc < num_full ? static_cast<int>(SharedLoad4(at)) : 0;
    };
    Chunk cur;
    uint32_t s = 0;  // stage of chunk c
#pragma unroll 1
    for (int c = warp; c < num_full; c += kW) {
      const int ahead = c + (kStages - 1) * kW;
      int following = 0;
      if constexpr (Config::kMaxIds > 0) {
        next_block = staged_block(ahead);
      } else {
        following = block_of(ahead + kW, num_full);
      }
      CopyAsyncWaitGroup<kStages - 2>();
      __syncwarp();  // every lane's copies of chunk c are complete and visible
      read(stage[0], read_meta + 128u * s, cur);
      // The stage written here was read in the previous step; its reads fed that step's
      // mma.sync instructions, which every lane of the warp had to reach, so it is free. (Issued
      // after this step's reads: an LDGSTS holds its address registers until the memory pipe
      // takes it, and the reads' destinations would otherwise reuse them and wait.)
      issue(ahead, stage[kStages - 1], meta_dst_lane + 128u * ((s + kStages - 1) % kStages),
            next_block);
      CopyAsyncCommit();
      compute.template operator()<false>(c, cur);
      if constexpr (Config::kMaxIds == 0) next_block = following;
      s = (s + 1) % kStages;
      const uint32_t first = stage[0];
#pragma unroll
      for (int i = 0; i + 1 < kStages; ++i) stage[i] = stage[i + 1];
      stage[kStages - 1] = first;
    }
    CopyAsyncWait();  // (only empty groups remain) before the merge reuses shared memory
  }

  // The other compressed kernels.
  template <typename FirstBlock, typename BlockOf, typename Finish, typename Load, typename Compute>
  __device__ __forceinline__ static void Registers(const SplitPipelineFrame& f,
                                                   FirstBlock& first_block, BlockOf& block_of,
                                                   Finish& finish_prologue, Load& load,
                                                   const Compute& compute) {
    const int warp = f.warp, num_full = f.num_full;
    // Two register buffers in turn. While chunk c is computed, the registers of chunk c + 1
    // (this warp's next) are loading and the block id of chunk c + 2 is being read.
    Chunk buf0, buf1;
    int c = warp;
    int next1 = first_block(1);
    if (c < num_full) load(c, buf0, first_block(0));
    finish_prologue();
    auto step = [&](int cc, Chunk& cur, Chunk& nxt) {
      const int next2 = block_of(cc + 2 * kW, num_full);
      if (cc + kW < num_full) load(cc + kW, nxt, next1);
      compute.template operator()<false>(cc, cur);
      next1 = next2;
    };
#pragma unroll 1
    for (; c < num_full; c += 2 * kW) {
      step(c, buf0, buf1);
      if (c + kW >= num_full) break;
      step(c + kW, buf1, buf0);
    }
  }
};

}  // namespace tqkv::decode_detail
