// The split kernel whose warps share one output (SplitVariant::shared_o): verify passes of 9-32
// columns (new tokens × GQA heads) on 4-bit, 3-bit and FP8 keys with 4-bit values (FP8 keys: 5-32,
// as they have no other half-precision kernel), and on 3-bit keys with 3-bit values (3bit_nc), at
// D = 128, in half precision. DecodeSplitKernel runs its own prologue (block ids, the group's
// rotated query rows and, for codebook keys, the table in shared memory), then SharedOSplit::Run
// for the chunks and the output.
//
// The other split kernels give each warp its own chunks and its own output Oᵀ[d, column] for
// every d: at 32 columns that is 128 accumulator registers per thread, so only 8 warps fit an SM
// and the chunk loop, a chain of dependent lookups, MMAs and exponentials, runs latency-bound. Here
// the 8 warps of a CTA move through the split in steps of 128 tokens (8 chunks of 16), as two
// groups of 4 (warps 0-3 take chunks 0-3 of each step, warps 4-7 chunks 4-7), and
//
//   1. warp w scores chunk w of the step, Sᵀ[token, column] = K̂ · Qᵀ, as the half kernels do;
//   2. its group agrees on the running maximum of every column (lazy, as the other kernels: only
//      when some score of the step passes it by kLazyMax; a vote, bar.red.or on the group's
//      named barrier, and, rarely, a round of the group's column maxima through shared memory),
//      so the group's warps scale by the same maximum;
//   3. warp w writes P'ᵀ = (p · value scale) of its chunk to shared memory in fp16 (stmatrix);
//   4. after the group's barrier, warp w computes Oᵀ[d, column] for the 32 d of value unit
//      w mod 4 (a quarter of head_dim) over its group's 4 chunks: the value codes read by
//      ldmatrix.trans straight from the stages, P' by ldmatrix.
//
// A thread then holds 2 m-tiles × N tiles × 4 accumulators (32 at 32 columns). Warps w and w + 4
// hold partial sums of the same d over disjoint tokens, each against its group's maximum: the
// output merges them (as the merge kernel merges splits). Two group barriers per step (three when
// the maximum moves): the vote (after which the stage that the previous step's P·V read is free
// for the copy two steps ahead) and the one after P'. A group waits only for its own warps; the
// CTA's two groups and the SM's two CTAs run out of step with each other.
//
// Token order in a chunk: score MMA row g ↔ token 2g, row g + 8 ↔ token 2g + 1 (as the other
// kernels); P·V k-slot j < 8 ↔ token 2j, k-slot 8 + j ↔ token 2j + 1. The stmatrix.trans of the
// score fragment's 8 x 8 tiles (rows: tokens 2g or 2g + 1; columns: 8 query columns) stores
// P'ᵀ[column][k-slot] rows, which ldmatrix hands back as the P·V MMA's B fragments; the
// ldmatrix.trans of the even and odd tokens' 16-byte value units (one matrix per parity; its 8
// tokens differ in token bits 1-3, so their swizzles differ: conflict-free; FP8 keys' swizzle takes
// token bits 1-2 alone, two wavefronts per matrix: SharedOLayout<kFp8>) gives thread (g, t) the
// code bytes 2g, 2g + 1 of the unit for tokens 4t, 4t + 2 (k-slots 2t, 2t + 1) and 4t + 1, 4t + 3
// (k-slots 2t + 8, 2t + 9), i.e. d = 32·u + 4g .. + 3 of both: masked to fp16 subnormals in place
// (CacheTraits::RowsPair's trick), rows g and g + 8 of m-tile 0 are d = 32u + 4g and + 1, of m-tile
// 1 (the bytes shifted down by 8) d = 32u + 4g + 2 and + 3.
//
// 3-bit values (3bit_nc; 48 bytes per token, d's code at bit 3d) keep that assignment of d: thread
// (g, t) of warp u needs the 12 bits at 96u + 12g of tokens 4t .. 4t + 3, which no ldmatrix gives
// (its rows are 16-byte units, a thread's share 16 bits at 16g). So it reads them as 4-byte words:
// per token the word holding the first bit and the next (the same word again where the 12 bits do
// not cross it: all but g = 2, 5), one funnel shift, and per token pair (4t, 4t + 2 / 4t + 1,
// 4t + 3) one byte permute puts both tokens' codes side by side; then per m-tile a shift and two
// masks give rows g and g + 8 (row g + 8 in place at 8x, CompressedValues::RowsOfWindow's trick,
// scaled back by Config::kOddRowScale). 8 reads per chunk, 32 per step, where 4-bit values take 2
// ldmatrix; each one wavefront (the warp's 3 words of 4 tokens under the 3-bit keys' swizzle:
// the masks {0, 1, 4, 5} or {2, 3, 6, 7} put the tokens' units on distinct banks). The fragments
// are what the ldmatrix path holds; the 32-column kernel is at 128 registers either way, so the
// reads' offsets and the shift share one register and the token 4t + 2 addresses are made per step
// (ptxas then spills what k3v4_nc's kernel spills). About 60 instructions per step more than the
// 4-bit path (the reads, funnel shifts and permutes).
//
// On sm_90a at four N tiles (17-32 columns; SplitKernelConfig::kSharedOWgmma) both products are
// warpgroup MMAs of each group (wgmma, A from registers): per step 8 m64n32k16 MMAs for Sᵀ (the
// 4 warps' chunks as the 64 rows, each warp's key fragments its rows; the query rows as the B
// operand in shared memory, laid out by SplitKernelConfig::QueryAt) and 8 for Oᵀ (per chunk
// m-tiles 0 and 1: each warp's rows are its d; P'ᵀ as the B operand, one 128-byte swizzled row
// of the group's 64 token slots per column), where the m16n8k16 form takes 64 MMAs per warp and
// step and loads the query and P' fragments itself. The same fp16 operands and fp32
// accumulators, so the same numerics, in fewer instructions and with the tensor cores' work off
// the warps' issue slots.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "attention/decode_cache_traits.cuh"
#include "attention/decode_device.cuh"
#include "attention/decode_launch.h"
#include "attention/decode_split_config.cuh"
#include "attention/decode_variant.h"
#include "attention/wgmma.cuh"

namespace tqkv::decode_detail {

#if TQKV_SHARED_O_WGMMA
namespace wgmma = attention_detail::wgmma;
#endif

__device__ __forceinline__ void SharedLdsmX4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void SharedLdsmX4Trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void SharedStsmX4Trans(uint32_t addr, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
      "r"(r0), "r"(r1), "r"(r2), "r"(r3)
      : "memory");
}

// Named barrier 1 + group (0 is __syncthreads') of the 128 threads of one warp group. The id is
// an immediate in each branch: with an id in a register ptxas reserves all 16 barriers.
__device__ __forceinline__ void GroupSync(int group) {
  if (group == 0) {
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
  } else {
    asm volatile("bar.sync 2, 128;\n" ::: "memory");
  }
}
// The same barrier, returning whether `pred` holds in any of its threads (bar.red.or).
__device__ __forceinline__ bool GroupAny(int group, bool pred) {
  uint32_t any;
  if (group == 0) {
    asm volatile(
        "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, 1, 128, p;\n"
        "selp.u32 %0, 1, 0, q;\n}\n"
        : "=r"(any)
        : "r"(static_cast<uint32_t>(pred))
        : "memory");
  } else {
    asm volatile(
        "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, 2, 128, p;\n"
        "selp.u32 %0, 1, 0, q;\n}\n"
        : "=r"(any)
        : "r"(static_cast<uint32_t>(pred))
        : "memory");
  }
  return any != 0;
}

template <SplitVariant V>
struct SharedOSplit {
  using Config = SplitKernelConfig<V>;
  using Traits = typename Config::Traits;
  using Layout = SharedOLayout<V.kind>;
  static constexpr KeyKind kKind = V.kind;
  static constexpr int kW = kStagedWarps;  // warps per CTA, chunks per step
  static constexpr int kGW = 4;            // warps per group (they share an output)
  static constexpr int kNT = V.n_tiles;
  static constexpr int kCols = 8 * kNT;
  static constexpr int kD = V.head_dim;
  static constexpr int kKSteps = kD / 16;
  static constexpr int kS = kSharedStages;
  static constexpr uint32_t kPitch = Layout::kPitch;
  static constexpr uint32_t kKeyBytes = Traits::kKeyBytes * 4;  // per token (4 lanes)
  // FP8 keys (k8v4): 128 key bytes per token, no table (a key fragment is two conversions of its
  // e4m3 pairs), no key norm (metadata fields v_scale, v_zero).
  static constexpr bool kFp8 = kKind == KeyKind::kFp8;
  static constexpr uint32_t kValueUnit0 = kKeyBytes / 16;       // the first value unit of a slot
  // 3-bit values (3bit_nc): 48 value bytes per token, read as words (module comment), not by
  // ldmatrix.trans of nibbles.
  static constexpr bool kV3 = V.value_bits == 3;
  static constexpr uint32_t kSlotBytes = kKeyBytes + Traits::kValueBytes * 8;  // copied per token
  // What takes a 3-bit value read of token 4t to token 4t + 2 (an XOR of bits 5 and 8: unit bit 1
  // of the swizzle, and the pitch twice, bit 8 being clear in token 4t's address) and from one
  // chunk of a group to the next (kV3Stride: its stage).
  static constexpr uint32_t V3Two() {
    if constexpr (kKind == KeyKind::kMse3) {
      return 2u * kPitch | 16u * StagedLayout<KeyKind::kMse3, kStagedWarps>::Swizzle(2);
    } else {
      return 0u;
    }
  }
  static constexpr uint32_t V3Stride() {
    if constexpr (kKind == KeyKind::kMse3) {
      return Layout::kWarpStride;
    } else {
      return 0u;
    }
  }
  static constexpr uint32_t kV3Two = V3Two(), kV3Stride = V3Stride();
  static_assert(!kV3 || kV3Two == 0x120u);
  // Both products as warpgroup MMAs (Config::kSharedOWgmma), else one m16n8k16 MMA per warp,
  // k-step and N tile.
  static constexpr bool kWg = Config::kSharedOWgmma;
  // The twin for calls under a sliding window (SplitVariant::window): the masks of a column's
  // first position and split 0's steps before the window's origin. The kernel without windows
  // keeps none of that code: with any masked loop ahead of the full steps' loop ptxas schedules
  // that loop anew. The twin runs all its masked steps in one loop (Run), which leaves its full
  // step near the kernel without windows' (4bit_nc at 32 columns: 406 instructions and 9 local
  // loads and stores per step against 409 and 3; with a second masked loop, 382 and 13).
  static constexpr bool kWindow = V.window;
  // Score chains per N tile of the m16n8k16 MMAs: two (k-step parity) where there are two N
  // tiles, else one.
  static constexpr int kChains = kNT > 2 || kWg ? 1 : 2;
  // The cache copies with the L2 evict-first policy, 3-bit keys' too (SplitPipelines copies
  // theirs without): a verify pass that reads 3-bit keys that way is faster, the decode kernels
  // are not (H100, three calls: k3v4_nc 8 new tokens 0.973x-0.985x, 1 × 128k 0.93x-0.94x;
  // 3bit_nc 0.978x-0.994x; the decode kernels' 3bit_nc with it 1.00x-1.04x).
  static constexpr bool kStreamCopies = true;
  static_assert(V.shared_o && V.half && kD == 128 && !V.packed &&
                (V.value_bits == 4 || (kV3 && kKind == KeyKind::kMse3)) &&
                Config::kCtaWarps == kW && Config::kUnits == 1 && (kNT == 2 || kNT == 4));
  static_assert(kKeyBytes % 16 == 0 && kSlotBytes % 16 == 0 && kSlotBytes <= kPitch);
  static_assert(!kFp8 || (kKeyBytes == 128 && kSlotBytes == 192 && kPitch == 192));
  static_assert(Config::kQueryInSmem && Config::kSharedO);

  // A thread's running state: accumulators of m-tiles 0-1 (d = 32u + 4g + 2·mi + row half) and
  // its columns 8·nt + 2t + j; the group's maximum of each column (the same in its 4 warps), and
  // the thread's partial sums l (of p) and z (of p · value zero) over its tokens.
  struct State {
    float acc[2][kNT][4];
    float m[kNT][2], l[kNT][2], z[kNT][2];
  };

  // What DecodeSplitKernel's prologue hands over.
  struct Frame {
    const SplitParams& p;
    int begin, end;  // the split's tokens (end: the last column's)
    int lane, warp, g, t;
    int h, b, group, split;
    uint32_t lane_word;
    const int32_t* table;  // the sequence's block table
    int block_shift;
  };

  // The score MMA's A fragment of k-step s for tokens 2g (words wg) and 2g + 1 (w8): the fp16 hi
  // centroids of the codes (a table lookup per code byte), or FP8 keys' values converted (exact in
  // fp16).
  template <int kS>
  __device__ __forceinline__ static void KeyFrag(const uint32_t (&wg)[Traits::kKeyWords],
                                                 const uint32_t (&w8)[Traits::kKeyWords],
                                                 uint32_t lane_word, uint32_t (&a)[4]) {
    if constexpr (kFp8) {
      Traits::template KeyFrag<kS>(wg, w8, a);
    } else {
      Traits::template KeyFragHi<kS>(wg, w8, lane_word, a);
    }
  }

  __device__ __forceinline__ static uint32_t SharedAddr(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
  }

  // The shared address of unit 0 of thread (g, t)'s run of query row g (Config::QueryAt; unit j is
  // at this ^ 16·j, row 8·nt + g at + 16·kD·nt), as SplitCompute::QueryRunAddress.
  __device__ __forceinline__ static uint32_t QueryRun(uint32_t smem_base, int g, int t) {
    const uint32_t f = 2u * static_cast<uint32_t>(t >> 1) ^ static_cast<uint32_t>(g & 1);
    return smem_base + Config::kQueryOffset + 2u * static_cast<uint32_t>(g * kD + 32 * t) + 16u * f;
  }

  template <typename Finish>
  __device__ __forceinline__ static void Run(const Frame& f, const int (&first_block_ids)[kStages],
                                             Finish& finish_prologue) {
    extern __shared__ __align__(16) uint8_t smem[];
    const SplitParams& p = f.p;
    const int lane = f.lane, warp = f.warp, g = f.g, t = f.t, h = f.h, begin = f.begin;
    const int end = f.end;
    const uint32_t smem_base = SharedAddr(smem);
    const int stride_token = p.num_kv_heads * p.data_per_slot;
    const int head_off = h * p.data_per_slot;
    const int meta_field = 2 * p.block_size;
    const int num_chunks = (end - begin + kChunk - 1) / kChunk;

    // Copies, as SplitPipelines::Staged's 8-warp kernels: in copy instruction j lane l copies
    // unit l mod 8 of token 4j + l / 8 (FP8 keys: their 8 key units; two more instructions copy
    // the value units 8-11, lane l unit 8 + l mod 4 of token 8j + l / 4); lanes 0-5 (FP8: 0-3)
    // one 16-byte half of a metadata run each. A warp's chunks lie 128 tokens apart, a multiple
    // of every block size, so each sits at the same position in its block. Chunks past the
    // split's last (partial) one are zero-filled.
    const uint32_t copy_tok = lane >> 3, copy_unit = lane & 7u;
    const uint32_t copy_dst =
        Pinned(kPitch * copy_tok + 16u * (copy_unit ^ Layout::Swizzle(copy_tok)));
    const uint32_t warp_pos = static_cast<uint32_t>(begin + warp * kChunk) & (p.block_size - 1);
    const uint32_t copy_src =
        Pinned((warp_pos + copy_tok) * stride_token + head_off + 16u * copy_unit);
    const uint32_t copy_step = Pinned(4u * static_cast<uint32_t>(stride_token));
    const bool copy_lane = 16u * copy_unit < kSlotBytes;
    const uint32_t value_tok = lane >> 2, value_unit = 8u + (lane & 3u);
    const uint32_t value_dst =
        kFp8 ? Pinned(kPitch * value_tok + 16u * (value_unit ^ Layout::Swizzle(value_tok))) : 0u;
    const uint32_t value_src =
        kFp8 ? Pinned((warp_pos + value_tok) * stride_token + head_off + 16u * value_unit) : 0u;
    const bool meta_lane = lane < (Traits::kHasNorm ? 6 : 4);
    const uint32_t copy_meta =
        Pinned(static_cast<uint32_t>(p.meta_offset) + 2 * h * p.num_meta * p.block_size +
               (lane >> 1) * meta_field + 16 * (lane & 1) + 2 * warp_pos);
    const uint32_t meta_own = Pinned(smem_base + Layout::kMeta + 128u * kS * warp);
    const uint32_t block_bytes = static_cast<uint32_t>(p.block_bytes);
    auto issue = [&](int cc, int s, int block) {
      const uint32_t bytes = cc < num_chunks ? 16u : 0u;
      const uint8_t* base = PinnedPointer(
          p.cache + static_cast<uint64_t>(static_cast<uint32_t>(block)) * block_bytes);
      const uint8_t* from = base + copy_src;
      const uint32_t dst = smem_base + Layout::Stage(warp, s);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t to = dst + 4u * kPitch * j + (copy_dst ^ (16u * Layout::Swizzle(4u * j)));
        if constexpr (kSlotBytes == 128 || kFp8) {
          CopyAsync16Fill<kStreamCopies>(to, from, bytes);
        } else {
          CopyAsync16FillIf<kStreamCopies>(copy_lane, to, from, bytes);
        }
        from += copy_step;
      }
      if constexpr (kFp8) {  // (Swizzle(8j) is 0: the swizzle takes token bits 1-2 alone)
        const uint8_t* vfrom = base + value_src;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          CopyAsync16Fill<kStreamCopies>(dst + 8u * kPitch * j + value_dst, vfrom, bytes);
          vfrom += 8u * static_cast<uint32_t>(stride_token);
        }
      }
      CopyAsync16FillIf<kStreamCopies>(meta_lane, meta_own + 128u * s + 16u * lane,
                                       base + copy_meta, bytes);
    };
    auto block_of = [&](int cc) -> int {
      return cc < num_chunks ? __ldg(f.table + ((begin + cc * kChunk) >> f.block_shift)) : 0;
    };
    // Steps 0 and 1 are copied ahead; step i + 2's copy is issued in step i.
    int next_block = warp + 2 * kW < num_chunks ? first_block_ids[2] : 0;
    issue(warp, 0, warp < num_chunks ? first_block_ids[0] : 0);
    CopyAsyncCommit();
    issue(warp + kW, 1, warp + kW < num_chunks ? first_block_ids[1] : 0);
    CopyAsyncCommit();
    finish_prologue();
#if TQKV_SHARED_O_WGMMA
    if constexpr (kWg) {  // the prologue's query rows (plain stores), for the MMAs' reads
      wgmma::FenceProxyAsync();
      __syncthreads();
    }
#endif
    const uint32_t lane_word = Pinned(f.lane_word);

    State st;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        st.m[nt][j] = -INFINITY;
        st.l[nt][j] = 0.0f;
        st.z[nt][j] = 0.0f;
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int i = 0; i < 4; ++i) st.acc[mi][nt][i] = 0.0f;
      }
    }

    // Warps 0-3 and 4-7 are two groups (warpgroups), each with its own maximum, barrier and
    // output (their partial outputs are merged at the end): a group waits only for its own four
    // warps.
    // (Broadcast from lane 0, so that the compiler knows it is warp-uniform and keeps the MMAs'
    // descriptors, which derive from it, in uniform registers.)
    const int group = kWg ? __shfl_sync(0xffffffffu, warp >> 2, 0) : warp >> 2;
    // Read offsets within a stage (StagedLayout's swizzles): keys of tokens 2g, 2g + 1 (+kPitch),
    // metadata of tokens 2g, 2g + 1; the value unit of this warp's quarter of head_dim for the
    // token this lane addresses in an ldmatrix of two chunks (matrix l / 8: chunk (l / 16), even
    // or odd tokens; row l mod 8).
    auto at = [](uint32_t token, uint32_t byte) {
      return kPitch * token + 16u * ((byte >> 4) ^ Layout::Swizzle(token)) + (byte & 15u);
    };
    // 16-byte reads (4-bit keys: one per token, FP8 keys: two, units 2t and 2t + 1) or 4-byte ones
    // (3-bit keys).
    constexpr int kKeyReads = kKind == KeyKind::kMse4 ? 1 : kFp8 ? 2 : 3;
    uint32_t read_k[kKeyReads];
#pragma unroll
    for (int w = 0; w < kKeyReads; ++w) {
      read_k[w] = Pinned(at(2 * g, kKind == KeyKind::kMse4 ? 16u * t
                                   : kFp8                  ? 32u * t + 16u * w
                                                           : 12u * t + 4u * w));
    }
    const uint32_t v_token = 2u * (lane & 7) + ((lane >> 3) & 1);
    const uint32_t read_v = kV3 ? 0u
                                : Pinned(kPitch * v_token + 16u * ((kValueUnit0 + (warp & 3)) ^
                                                                   Layout::Swizzle(v_token)));
    // 3-bit values: the codes of d = 32u + 4g .. + 3 (u = warp mod 4) lie at bits 96u + 12g ..
    // + 11 of a token's value bytes: the word holding the first bit and, where the 12 bits run
    // past it (g = 2, 5), the next (else the same word again), of token 4t (4t + 1 at + kPitch;
    // 4t + 2 and 4t + 3 at an XOR with kV3Two). One register (the 32-column kernel is at its
    // limit) holds the first bit's place in the word in bits 0-4 (the funnel shift's amount,
    // which reads those alone) and the two reads' offsets in a stage (< 2,048) in bits 5-15 and
    // 16-26.
    const uint32_t v3_bit = 96u * static_cast<uint32_t>(warp & 3) + 12u * static_cast<uint32_t>(g);
    const uint32_t v3_lo = kKeyBytes + 4u * (v3_bit >> 5);
    const uint32_t v3_hi = (v3_bit & 31u) > 20u ? v3_lo + 4u : v3_lo;
    static_assert(!kV3 || kPitch * 16 <= 2048);
    const uint32_t read_v3 =
        kV3 ? Pinned((v3_bit & 31u) | at(4u * t, v3_lo) << 5 | at(4u * t, v3_hi) << 16) : 0u;
    const int v_chunk0 = 4 * (warp >> 2) + (lane >> 4);  // + 2 for the second ldmatrix
    // P' of a step. With warpgroup MMAs each group's P'ᵀ (Config::kPOffset + 128·kCols·group):
    // row c (column c; 8-row groups 1,024 bytes apart) holds the 64 token slots of the group's 4
    // chunks, chunk q in 16-byte units 2q (slots 0-7) and 2q + 1 (8-15), unit u of row c at u ^
    // (c mod 8): the B operand of P·V, K-major with the 128-byte swizzle. Otherwise chunk q of
    // the step, N tiles nt and nt + 1 at P + 256·(kNT·q + nt). An stmatrix / ldmatrix x4 of
    // chunk q and N tiles nt, nt + 1 has lane l address row l mod 8 of matrix l / 8 (tile nt's
    // slots 0-7, then 8-15; tile nt + 1's).
    const uint32_t p_group = smem_base + Config::kPOffset + 128u * kCols * group;
    const uint32_t p_lane = Pinned(smem_base + Config::kPOffset + 16u * lane);
    const uint32_t p_own =
        kWg ? Pinned(p_group + 1024u * (lane >> 4) + 128u * (lane & 7) +
                     16u * ((2u * (warp & 3) + ((lane >> 3) & 1u)) ^ (lane & 7u)))
            : 0u;
    const uint32_t q_run = Pinned(QueryRun(smem_base, g, t));
#if TQKV_SHARED_O_WGMMA
    // The MMAs' descriptors: the query rows' k-steps (Config::QueryAt) and P'ᵀ's 4 chunks.
    uint64_t q_desc[kKSteps], p_desc[4];
    const uint32_t q_low = wgmma::DescriptorLow(smem_base + Config::kQueryOffset);
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      q_desc[ks] = wgmma::DescriptorOf(q_low + (ks >> 2) * (8u * kCols) + 2u * (ks & 3));
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      p_desc[q] = wgmma::DescriptorOf(wgmma::DescriptorLow(p_group) + 2u * q);
    }
#endif
    // The group's column maxima: [column][warp of the group].
    float* const red = reinterpret_cast<float*>(smem + Config::kRedOffset) + group * kCols * kGW;

    // One step: this warp's chunk c = kW·i + warp from stage s, P·V over its group's chunks.
    // kRel (a step after the first, no masks: every column has a finite maximum m): s holds
    // s − m, the exponent of p, from one FFMA, and the lazy check reads it; the scores are
    // recovered as (s − m) + m only where the maximum moves. kTail: masked, a column of new token
    // i seeing the positions before end0 + i (within the split's end) and, on the window twin,
    // from lo_end0 + i on.
    auto step = [&](int i, int stage_index, int end0, int lo_end0, auto tail_c, auto rel_c) {
      constexpr bool kTail = decltype(tail_c)::value;
      constexpr bool kRel = decltype(rel_c)::value;
      static_assert(!(kTail && kRel));
      const int c = kW * i + warp;
      const int ahead = c + 2 * kW;
      const int following = block_of(ahead + kW);
      CopyAsyncWaitGroup<kS - 2>();
      __syncwarp();  // every lane's copies of chunk c are complete and visible to the warp
      const uint32_t stage = smem_base + Layout::Stage(warp, stage_index);
      uint32_t kg[Traits::kKeyWords], k8[Traits::kKeyWords];
      if constexpr (kKind == KeyKind::kMse4) {
        SharedLoad16(stage + read_k[0], kg);
        SharedLoad16(stage + read_k[0] + kPitch, k8);
      } else if constexpr (kFp8) {
        static_assert(Traits::kKeyWords == 8);
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          SharedLoad16(stage + read_k[w], reinterpret_cast<uint32_t(&)[4]>(kg[4 * w]));
          SharedLoad16(stage + read_k[w] + kPitch, reinterpret_cast<uint32_t(&)[4]>(k8[4 * w]));
        }
      } else {
#pragma unroll
        for (int w = 0; w < kKeyReads; ++w) {
          kg[w] = SharedLoad4(stage + read_k[w]);
          k8[w] = SharedLoad4(stage + read_k[w] + kPitch);
        }
      }
      const uint32_t meta = meta_own + 128u * stage_index + 4u * g;
      constexpr uint32_t kScaleField = Traits::kHasNorm ? 32u : 0u;  // FP8 keys: no norm field
      const uint32_t norm = Traits::kHasNorm ? SharedLoad4(meta) : 0u;
      const uint32_t vscale = SharedLoad4(meta + kScaleField);
      const uint32_t vzero = SharedLoad4(meta + kScaleField + 32);

      // Scores (half precision: c_hi · q once), Sᵀ[token, column] as m16n8 fragments: one
      // warpgroup MMA per k-step (its 64 rows the group's 4 chunks, the query rows in shared
      // memory), or one MMA per k-step and N tile.
      float sp[kChains][kNT][4];
#if TQKV_SHARED_O_WGMMA
      if constexpr (kWg) {
        uint32_t a[kKSteps][4];
        StaticFor<kKSteps>([&](auto ks_c) {
          constexpr int ks = decltype(ks_c)::value;
          KeyFrag<ks>(kg, k8, lane_word, a[ks]);
        });
        auto& d = reinterpret_cast<float(&)[kCols / 2]>(sp[0]);
        wgmma::Fence();
        StaticFor<kKSteps>([&](auto ks_c) {
          constexpr int ks = decltype(ks_c)::value;
          wgmma::MmaRS64xN<kCols, (ks > 0)>(d, a[ks], q_desc[ks]);
        });
        wgmma::Commit();
        wgmma::Wait<0>();
      } else
#endif
      {
#pragma unroll
        for (int k = 0; k < kChains; ++k) {
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) sp[k][nt][e] = 0.0f;
          }
        }
        uint32_t qv[kNT][4];
        StaticFor<kKSteps>([&](auto ks_c) {
          constexpr int ks = decltype(ks_c)::value;
          if constexpr (ks % 2 == 0) {
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
              SharedLoad16((q_run ^ (16u * (ks / 2))) + 16u * kD * nt, qv[nt]);
            }
          }
          uint32_t a[4];
          KeyFrag<ks>(kg, k8, lane_word, a);
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            MmaF16(sp[ks % kChains][nt], a, qv[nt][2 * (ks % 2)], qv[nt][2 * (ks % 2) + 1]);
          }
        });
      }
      float vs[2], vz[2], row_scale[2];
      bool valid[2] = {true, true};  // tokens 2g, 2g + 1
      const int t0 = begin + c * kChunk;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        row_scale[r] = Traits::kHasNorm ? HalfBitsToFloat(static_cast<uint16_t>(norm >> (16 * r))) *
                                              p.score_scale
                                        : p.score_scale;
        vs[r] = HalfBitsToFloat(static_cast<uint16_t>(vscale >> (16 * r)));
        vz[r] = HalfBitsToFloat(static_cast<uint16_t>(vzero >> (16 * r)));
        if constexpr (kTail) {  // metadata past the end may be NaN garbage (0 · NaN = NaN)
          valid[r] = t0 + 2 * g + r < end && (!kWindow || t0 + 2 * g + r >= lo_end0);
          vs[r] = valid[r] ? vs[r] : 0.0f;
          vz[r] = valid[r] ? vz[r] : 0.0f;
        }
      }
      // s[nt][e]: token 2g + e / 2, column 8·nt + 2t + e % 2 (kRel: minus the column's maximum);
      // a verify pass's column c sees c / group tokens past end0 (within the split's end), and
      // under a window from as many past lo_end0.
      float s[kNT][4];
      float mx[kNT][2];
      bool need = false;
      const bool exact = fmaxf(vs[0], vs[1]) > kMaxLazyValueScale;
      [[maybe_unused]] const float lazy = exact ? 0.0f : kLazyMax;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float sum = sp[0][nt][e];
          if constexpr (kChains > 1) sum += sp[1][nt][e];
          if constexpr (kRel) {
            s[nt][e] = fmaf(sum, row_scale[e / 2], -st.m[nt][e % 2]);
          } else {
            s[nt][e] = sum * row_scale[e / 2];
          }
          if constexpr (kTail) {
            const int col = 8 * nt + 2 * t + e % 2;
            const int extra =
                p.verify.query_start_loc != nullptr ? NewTokenOfColumn(p.verify, col) : 0;
            const int token = t0 + 2 * g + e / 2;
            const bool seen =
                token < min(end, end0 + extra) && (!kWindow || token >= lo_end0 + extra);
            s[nt][e] = seen ? s[nt][e] : -INFINITY;
          }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          // Lazy: only past the maximum by kLazyMax, or by anything where a value scale is too
          // large for p ≤ 2^kLazyMax (then the maximum becomes exact).
          if constexpr (kRel) {
            need |= fmaxf(s[nt][j], s[nt][j + 2]) > lazy;
          } else {
            mx[nt][j] = fmaxf(s[nt][j], s[nt][j + 2]);
            need = need || mx[nt][j] > (exact ? st.m[nt][j] : st.m[nt][j] + kLazyMax);
          }
        }
      }
      // Where some score of the group passed its column's maximum by more than the lazy margin
      // (rarely after the first step): every group warp's column maxima of this step through
      // shared memory, the same new maximum in each, l, z and the accumulators rescaled to it.
      auto move_maximum = [&] {
        if constexpr (kRel) {  // back to the scores
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] += st.m[nt][e % 2];
#pragma unroll
            for (int j = 0; j < 2; ++j) mx[nt][j] = fmaxf(s[nt][j], s[nt][j + 2]);
          }
        }
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            float x = mx[nt][j];
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
            if (g == 0) red[(8 * nt + 2 * t + j) * kGW + (warp & 3)] = x;
          }
        }
        GroupSync(group);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float4 x = *reinterpret_cast<const float4*>(red + (8 * nt + 2 * t + j) * kGW);
            const float step_max = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));
            const float m_new = fmaxf(st.m[nt][j], step_max);
            const float corr = m_new == -INFINITY ? 1.0f : exp2f(st.m[nt][j] - m_new);
            st.m[nt][j] = m_new;
            st.l[nt][j] *= corr;
            st.z[nt][j] *= corr;
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
              st.acc[mi][nt][j] *= corr;
              st.acc[mi][nt][j + 2] *= corr;
            }
            if constexpr (kRel) {  // the exponents against the new maximum
              s[nt][j] -= m_new;
              s[nt][j + 2] -= m_new;
            }
          }
        }
      };
      // The copy two steps ahead, into the stage the previous step read.
      auto issue_ahead = [&] {
        const int s_ahead = stage_index == 0 ? kS - 1 : stage_index - 1;
        issue(ahead, s_ahead, next_block);
        CopyAsyncCommit();
        next_block = following;
      };
      // P' = p · value scale in fp16, stored as P'ᵀ[column][k-slot] (module comment); p added
      // to l and z.
      auto store_p = [&] {
        const uint32_t p_chunk = kWg ? p_own : p_lane + 256u * kNT * warp;
#pragma unroll
        for (int nt = 0; nt < kNT; nt += 2) {
          uint32_t packed[2][2];  // [N tile][token 2g / 2g + 1]
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            float pw[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int j = e % 2, r = e / 2;
              // Past the end s = -inf: p = 0 (m may be -inf too, for a column that has seen no
              // token yet).
              const float pr = kTail && s[nt + k][e] == -INFINITY ? 0.0f
                               : kRel                             ? FastExp2(s[nt + k][e])
                                      : FastExp2(s[nt + k][e] - st.m[nt + k][j]);
              st.l[nt + k][j] += pr;
              st.z[nt + k][j] += pr * vz[r];
              pw[e] = pr * vs[r];
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const __half2 x = __floats2half2_rn(pw[2 * r], pw[2 * r + 1]);
              packed[k][r] = *reinterpret_cast<const uint32_t*>(&x);
            }
          }
          SharedStsmX4Trans(p_chunk + (kWg ? 1024u : 256u) * nt, packed[0][0], packed[0][1],
                            packed[1][0], packed[1][1]);
        }
      };

      // The vote is also the barrier after which the stage that the previous step's P·V read
      // (every group warp's stage (s + 2) mod 3) is free.
      if (GroupAny(group, need)) move_maximum();
      issue_ahead();
      store_p();
#if TQKV_SHARED_O_WGMMA
      if constexpr (kWg) wgmma::FenceProxyAsync();  // the stores, for the MMAs' reads
#endif
      GroupSync(group);  // every group warp's P' and chunk of this step

      // Oᵀ[d, column] += Vᵀ[d, token] · P'ᵀ[token, column] over chunks 4·(warp / 4) .. + 3: two
      // warpgroup MMAs per chunk (m-tiles 0 and 1 of the 4 warps: all of head_dim), or four MMAs
      // per chunk and pair of N tiles.
      [[maybe_unused]] uint32_t va[4][2][4];  // [chunk][m-tile], for the warpgroup MMAs
      if constexpr (kV3) {
        // The group's chunks' stages lie kV3Stride apart; token 4t + 2's address is token 4t's
        // XOR kV3Two, also after adding a multiple of 512 (the stages, in a shared window that
        // starts 1,024-byte aligned, as the warpgroup MMAs' operands need). Computed per step, so
        // that two loop invariants fewer hold registers.
        const uint32_t v3_stage = smem_base + Layout::Stage(4 * group, stage_index);
        const uint32_t v3_lo_at = v3_stage + ((read_v3 >> 5) & 2047u);
        const uint32_t v3_hi_at = v3_stage + (read_v3 >> 16);
        const uint32_t v3_at[2][2] = {{v3_lo_at, v3_lo_at ^ kV3Two}, {v3_hi_at, v3_hi_at ^ kV3Two}};
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // chunk 4·group + k
          // w[o]: the 12 code bits of token 4t + o in the low half, of 4t + 2 + o in the high.
          uint32_t w[2];
#pragma unroll
          for (int o = 0; o < 2; ++o) {
            uint32_t x[2];
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              const uint32_t off = kV3Stride * k + kPitch * o;
              const uint32_t lo = SharedLoad4(v3_at[0][b] + off);
              const uint32_t hi = SharedLoad4(v3_at[1][b] + off);
              x[b] = __funnelshift_r(lo, hi, read_v3);  // by bits 0-4
            }
            w[o] = __byte_perm(x[0], x[1], 0x5410);
          }
          // Row g: the first code of each pair (c · 2^-24), row g + 8 the second in place (bits
          // 3-5: 8·c · 2^-24, Config::kOddRowScale); m-tile 1 the next two codes.
          const uint32_t y0 = w[0] >> 6, y1 = w[1] >> 6;
          const uint32_t a0[4] = {w[0] & 0x00070007u, w[0] & 0x00380038u, w[1] & 0x00070007u,
                                  w[1] & 0x00380038u};
          const uint32_t a1[4] = {y0 & 0x00070007u, y0 & 0x00380038u, y1 & 0x00070007u,
                                  y1 & 0x00380038u};
          if constexpr (kWg) {
#pragma unroll
            for (int x = 0; x < 4; ++x) {
              va[k][0][x] = a0[x];
              va[k][1][x] = a1[x];
            }
          } else {
            const int q = 4 * group + k;
#pragma unroll
            for (int nt = 0; nt < kNT; nt += 2) {
              uint32_t b[4];  // N tile nt: b0, b1; nt + 1: b0, b1
              SharedLdsmX4(p_lane + 256u * (kNT * q + nt), b);
              MmaF16(st.acc[0][nt], a0, b[0], b[1]);
              MmaF16(st.acc[1][nt], a1, b[0], b[1]);
              MmaF16(st.acc[0][nt + 1], a0, b[2], b[3]);
              MmaF16(st.acc[1][nt + 1], a1, b[2], b[3]);
            }
          }
        }
      } else {
#pragma unroll
        for (int pair = 0; pair < 2; ++pair) {
          uint32_t v[4];  // chunk q, q + 1: even tokens, odd tokens
          SharedLdsmX4Trans(smem_base + Layout::Stage(v_chunk0 + 2 * pair, stage_index) + read_v,
                            v);
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const uint32_t ve = v[2 * k], vo = v[2 * k + 1];
            const uint32_t ve8 = ve >> 8, vo8 = vo >> 8;
            const uint32_t a0[4] = {ve & 0x000F000Fu, ve & 0x00F000F0u, vo & 0x000F000Fu,
                                    vo & 0x00F000F0u};
            const uint32_t a1[4] = {ve8 & 0x000F000Fu, ve8 & 0x00F000F0u, vo8 & 0x000F000Fu,
                                    vo8 & 0x00F000F0u};
            if constexpr (kWg) {
#pragma unroll
              for (int x = 0; x < 4; ++x) {
                va[2 * pair + k][0][x] = a0[x];
                va[2 * pair + k][1][x] = a1[x];
              }
            } else {
              const int q = 4 * group + 2 * pair + k;
#pragma unroll
              for (int nt = 0; nt < kNT; nt += 2) {
                uint32_t b[4];  // N tile nt: b0, b1; nt + 1: b0, b1
                SharedLdsmX4(p_lane + 256u * (kNT * q + nt), b);
                MmaF16(st.acc[0][nt], a0, b[0], b[1]);
                MmaF16(st.acc[1][nt], a1, b[0], b[1]);
                MmaF16(st.acc[0][nt + 1], a0, b[2], b[3]);
                MmaF16(st.acc[1][nt + 1], a1, b[2], b[3]);
              }
            }
          }
        }
      }
#if TQKV_SHARED_O_WGMMA
      if constexpr (kWg) {
        wgmma::Fence();
#pragma unroll
        for (int q = 0; q < 4; ++q) {
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            wgmma::MmaRS64xN<kCols, true>(reinterpret_cast<float(&)[kCols / 2]>(st.acc[mi]),
                                          va[q][mi], p_desc[q]);
          }
        }
        wgmma::Commit();
        // Waited for here: a wait at the next step's scores instead (the MMAs running on into
        // it) makes ptxas serialize every MMA, as the next chunk's key fragments are computed
        // while they run.
        wgmma::Wait<0>();
      }
#endif
    };

    // Steps whose 8 chunks every column sees whole, then the split's last steps (a partial chunk,
    // a verify pass's causal part, chunks past the end), masked; on the window twin first split
    // 0's steps below the window's origin (begin < 0), masked too. All warps run every step.
    // (Positions count from the origin: DecodeSplitKernel.)
    const ColumnSpan unshifted = SpanOfColumns(p.verify, p.seq_lens, f.b);
    const int origin = kWindow ? WindowOrigin(WindowLo(unshifted.len, p.window), p.block_size) : 0;
    const ColumnSpan span = ShiftSpan(unshifted, origin);
    // The first column's first position (a column of new token i sees from lo_end0 + i on).
    const int lo_end0 = kWindow ? span.end0 - p.window : kNoWindowStart;
    const int num_full = max(0, min(end, span.end0) - begin) / kChunk;
    const int full_steps = num_full / kW;
    const int num_steps = (num_chunks + kW - 1) / kW;
    int stage_index = 0;
    int i = 0;
    static_assert(kS > 1);
    auto next_stage = [&] { stage_index = stage_index == kS - 1 ? 0 : stage_index + 1; };
    // The full steps: the first sets every column's maximum.
    auto full = [&] {
      if (i < full_steps) {
        step(i, stage_index, span.end0, lo_end0, std::false_type{}, std::false_type{});
        next_stage();
        ++i;
      }
#pragma unroll 1
      for (; i < full_steps; ++i) {
        step(i, stage_index, span.end0, lo_end0, std::false_type{}, std::true_type{});
        next_stage();
      }
    };
    if constexpr (kWindow) {
      // One loop of masked steps (a second one ahead of the full steps made ptxas spill in
      // theirs): split 0's steps below the origin, then, after the full steps, the last ones.
      int masked_end = begin < 0 ? min((kW * kChunk - 1 - begin) / (kW * kChunk), num_steps) : 0;
#pragma unroll 1
      for (;;) {
#pragma unroll 1
        for (; i < masked_end; ++i) {
          step(i, stage_index, span.end0, lo_end0, std::true_type{}, std::false_type{});
          next_stage();
        }
        if (masked_end == num_steps) break;
        full();
        masked_end = num_steps;
      }
    } else {
      full();
#pragma unroll 1
      for (; i < num_steps; ++i) {
        step(i, stage_index, span.end0, lo_end0, std::true_type{}, std::false_type{});
        next_stage();
      }
    }
    CopyAsyncWait();  // (only empty or unread groups remain) before shared memory is reused

    if (p.trigger_dependents) LaunchDependents();
    WriteOutput(f, st);
  }

  // The output: the two groups' partial accumulators (warps w and w + 4: disjoint tokens), l and
  // z merged, each scaled by f = 2^(its maximum - the larger). One split per sequence: the final
  // rows and LSE; otherwise the split's partial ones for the merge.
  __device__ __forceinline__ static void WriteOutput(const Frame& f, State& st) {
    extern __shared__ __align__(16) uint8_t smem[];
    const SplitParams& p = f.p;
    const int warp = f.warp, g = f.g, t = f.t;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
          st.l[nt][j] += __shfl_xor_sync(0xffffffffu, st.l[nt][j], off);
          st.z[nt][j] += __shfl_xor_sync(0xffffffffu, st.z[nt][j], off);
        }
      }
    }
    __syncthreads();  // the stages, P' and the table are no longer read
    // acc_s[u][column][kSharedAccStride]: d = 32u + 4g .. + 3 of a column as one float4 (the
    // stride of 36 floats puts the 8 lanes of a store phase on distinct 16-byte bank groups);
    // lz[column][warp]: l, z; fin[column]: 1/l, z, f of groups 0 and 1, m of groups 0 and 1.
    constexpr int kAS = Config::kSharedAccStride;
    float* const acc_s = reinterpret_cast<float*>(smem);
    float2* const lz = reinterpret_cast<float2*>(acc_s + 4 * kCols * kAS);
    float* const fin = reinterpret_cast<float*>(lz + kW * kCols);
    const int u = warp & 3;
    constexpr float kEven = Traits::kEvenRowScale, kOdd = Config::kOddRowScale;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = 8 * nt + 2 * t + j;
        if (warp >= 4) {
          *reinterpret_cast<float4*>(acc_s + (u * kCols + col) * kAS + 4 * g) =
              make_float4(st.acc[0][nt][j] * kEven, st.acc[0][nt][j + 2] * kOdd,
                          st.acc[1][nt][j] * kEven, st.acc[1][nt][j + 2] * kOdd);
        }
        if (g == 0) {
          lz[col * kW + warp] = make_float2(st.l[nt][j], st.z[nt][j]);
          if ((warp & 3) == 0) fin[6 * col + 4 + (warp >> 2)] = st.m[nt][j];
        }
      }
    }
    __syncthreads();
    const ColumnSpan span = SpanOfColumns(p.verify, p.seq_lens, f.b);
    const int64_t row0 = static_cast<int64_t>(f.b) * p.num_q_heads + f.h * f.group;
    if (threadIdx.x < kCols) {
      const int col = threadIdx.x;
      const float m0 = fin[6 * col + 4], m1 = fin[6 * col + 5], mm = fmaxf(m0, m1);
      // A group without tokens of this column has m = -inf: f = 0.
      const float f0 = m0 == -INFINITY ? 0.0f : exp2f(m0 - mm);
      const float f1 = m1 == -INFINITY ? 0.0f : exp2f(m1 - mm);
      float ll = 0.0f, zz = 0.0f;
#pragma unroll
      for (int w = 0; w < kW; ++w) {
        const float2 x = lz[col * kW + w];
        const float fw = w < kGW ? f0 : f1;
        ll += fw * x.x;
        zz += fw * x.y;
      }
      // ll = 0 only for a verify column that saw no token of this split: output 0, LSE -inf.
      fin[6 * col] = ll > 0.0f ? 1.0f / ll : 0.0f;
      fin[6 * col + 1] = zz;
      fin[6 * col + 2] = f0;
      fin[6 * col + 3] = f1;
      const float lse = ll > 0.0f ? (mm + log2f(ll)) * kLn2 : -INFINITY;
      if (col < f.group) {
        if (p.output != nullptr) {  // one split per sequence: the final LSE, no merge
          const int64_t row =
              RowOfColumn(p.verify, span, p.num_q_heads, p.num_kv_heads, f.b, f.h, col);
          if (row >= 0) p.lse[row] = lse;
        } else {
          p.partial_lse[(row0 + col) * p.max_splits + f.split] = lse;
        }
      }
    }
    __syncthreads();
    if (warp >= 4) return;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = 8 * nt + 2 * t + j;
        if (col >= f.group) continue;
        const float4 o = *reinterpret_cast<const float4*>(acc_s + (u * kCols + col) * kAS + 4 * g);
        const float inv_l = fin[6 * col], zz = fin[6 * col + 1];
        const float f0 = fin[6 * col + 2], f1 = fin[6 * col + 3];
        const float out[4] = {(f0 * (st.acc[0][nt][j] * kEven) + f1 * o.x + zz) * inv_l,
                              (f0 * (st.acc[0][nt][j + 2] * kOdd) + f1 * o.y + zz) * inv_l,
                              (f0 * (st.acc[1][nt][j] * kEven) + f1 * o.z + zz) * inv_l,
                              (f0 * (st.acc[1][nt][j + 2] * kOdd) + f1 * o.w + zz) * inv_l};
        const int d0 = 32 * u + 4 * g;
        if (p.output != nullptr) {
          const int64_t row =
              RowOfColumn(p.verify, span, p.num_q_heads, p.num_kv_heads, f.b, f.h, col);
          if (row < 0) continue;
#pragma unroll
          for (int k = 0; k < 4; ++k) StoreOutput(p.output, p.out_dtype, row * kD + d0 + k, out[k]);
        } else {
          *reinterpret_cast<float4*>(p.partial_out + ((row0 + col) * p.max_splits + f.split) * kD +
                                     d0) = make_float4(out[0], out[1], out[2], out[3]);
        }
      }
    }
  }
};

}  // namespace tqkv::decode_detail
