// Split-KV decode attention over paged caches: TurboQuant SoA blocks (4/3-bit codebook keys, FP8
// keys; 4/3-bit uniform values) and uncompressed bf16 or fp16 blocks (the "plain" kinds: one
// kernel family with bf16 or fp16 MMAs), plus the LSE merge and the query preparation for a dense
// Πᵀ (q·Πᵀ once per step; Hadamard rotations are applied to the query by each CTA's prologue, as
// a Walsh-Hadamard transform of its group's rows).
//
// One CTA = (split of the context, KV head, sequence), 4 warps (8 for the staged kernels of
// 4bit_nc and k3v4_nc; the staged kernels, those two and bf16 at D = 128, copy their chunks into
// shared memory ahead of use: see StagedLayout); it serves all query heads of the GQA group, so
// every compressed byte is read once. Each warp takes 16-token chunks in turn (a chunk never
// crosses a block: block sizes are multiples of 16) and runs both products on tensor cores with
// mma.sync m16n8k16:
//
//   scores  Sᵀ[token, head] = K̂[token, d] · Qᵀ[d, head]       (M = 16 tokens, N = 8 heads)
//   output  Oᵀ[d, head]    += Vcodesᵀ[d, token] · P'ᵀ[token, head]   (M = 16 d, N = 8 heads)
//
// (codebook keys: M = 8 tokens × {c_hi, c_lo} rows per score MMA). Everything that is rounded to
// 16 bits for an MMA is split into a hi and a lo part — q·Πᵀ, the codebook, p·scale — so scores
// and outputs keep fp32 accuracy; the online softmax rescales lazily (only when a score passes
// the running maximum by 2^6), and P' reaches the B operand of P·V by an 8x8 movmatrix.
//
// A dot product does not care in which order its terms are summed, so each thread's fragment
// slots are mapped to the d's (and tokens) that make its loads contiguous: a thread reads whole
// 8- or 16-byte runs of one token's codes. The key codebook is applied through a shared-memory
// table indexed by a code pair (one 64-bit load gives the fp16 pair and the pair of its
// remainders, so keys keep ~22 bits), replicated once per lane of a half-warp so that lookups
// never conflict (a 64-bit shared load is served as two half-warp wavefronts). Values
// are never dequantized inside the loop:
// Σ_t p_t (code_t · scale_t + zero_t) = Σ_t (p_t · scale_t) · code_t + Σ_t p_t · zero_t, so the MMA
// multiplies exact integer codes (fp16 subnormals: one AND per two codes) by p · scale, and the
// zero-point term is one scalar per head.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "attention/decode_cache_traits.cuh"
#include "attention/decode_device.cuh"
#include "attention/decode_launch.h"
#include "attention/decode_split_compute.cuh"
#include "attention/decode_split_config.cuh"
#include "attention/decode_variant.h"

namespace tqkv::decode_detail {

// Token order inside a 16-token chunk (any order works for a dot product; this one makes the
// metadata of a thread's two score rows adjacent):
//   score MMA row g ↔ token 2g, row g + 8 ↔ token 2g + 1;
//   P·V MMA k-slots 2t, 2t+1 ↔ tokens 4t, 4t+2 and k-slots 2t+8, 2t+9 ↔ tokens 4t+1, 4t+3,
// which is where the 8x8 transposes of the score fragment put P'.
//
// Packed heads (SplitVariant::packed: compressed kinds, GQA group ≤ 4): column 2h of the score
// MMA's N = 8 holds q_hi of head h and column 2h + 1 its q_lo, so one MMA computes both parts and
// thread t holds both halves of head t's score (one add, no shuffle, and no thread computes a
// softmax twice); the P·V B operand holds P'_hi of head h in column 2h and P'_lo in 2h + 1, so one
// P·V MMA per m-tile does what two did, and the accumulator's two columns are added once per
// split. Half the MMAs per chunk, and half the softmax work per thread.

// Split kernel SplitVariant::FromCode(kCode): one CTA per (split, KV head or pair of KV heads,
// sequence). Its phases, in order: the loads that need not wait for the kernel ahead (codebook
// entries, rotation signs), the wait, the block-table chain and the query's first row; then
// finish_prologue (query rotation into shared memory, codebook replicas, block ids, query
// fragments) once a pipeline's first copies are out; one of four chunk pipelines (bf16 staged,
// bf16 from registers, compressed staged, compressed from registers) calling `compute` per chunk
// (score MMAs, online softmax, P·V MMAs); the split's partial last chunk; the warps' merge through
// shared memory and the output. `compute` is a function object (decode_split_compute.cuh) that
// holds references to the running state as the lambda it replaced did: that compiles to the same
// SASS. The rest stays one function on purpose: as member functions of a per-CTA class the same
// code compiled to other schedules, 5-9 % slower for k3v4_nc at batch 16 (branch
// split-cta-decomposition, commit a7bbadb), and the prologue and the warps' merge as function
// objects also changed the SASS (register allocation), unmeasured.
template <uint32_t kCode>
__global__ void __launch_bounds__(SplitVariant::FromCode(kCode).cta_warps() * 32,
                                  kSplitMinCtas<SplitVariant::FromCode(kCode)>)
    DecodeSplitKernel(const SplitParams p) {
  constexpr SplitVariant V = SplitVariant::FromCode(kCode);
  constexpr KeyKind kKind = V.kind;
  constexpr int kValueBits = V.value_bits;
  constexpr int kD = V.head_dim;
  constexpr int kNTiles = V.n_tiles;
  constexpr bool kPacked = V.packed;
  using Config = SplitKernelConfig<V>;
  constexpr bool kStaged = Config::kStaged;
  constexpr bool kPaired = Config::kPaired;
  constexpr int kSW = Config::kSW;
  static_assert(!kPacked || (kNTiles == 1 && !IsPlain(kKind)));
  static_assert(!kStaged || HasStagedKernel(kKind, kValueBits, kD, kPacked));
  static_assert(kSW == kStagedWarps || (kStaged && kKind == KeyKind::kMse3 && kSW == 4));
  static_assert(!V.hi_only || (kStaged && kKind == KeyKind::kMse3 && kSW == kStagedWarps));
  static_assert(!kPaired || (kStaged && !IsPlain(kKind) && kSW == kStagedWarps));
  static_assert(!V.one_cta ||
                (kStaged && kKind == KeyKind::kMse4 && kSW == kStagedWarps && !kPaired));
  constexpr int kT = Config::kCtaWarps * 32;
  // The cache copies with the L2 evict-first policy (CopyAsync16Fill), except 3-bit keys'.
  constexpr bool kStreamCopies = kKind != KeyKind::kMse3;
  // kW: the warps that share one KV head's chunks (all of the CTA's but in a paired CTA).
  constexpr int kUnits = Config::kUnits;
  constexpr int kW = Config::kCtaWarps / kUnits;
  using Traits = typename Config::Traits;
  constexpr int kKSteps = Config::kKSteps;
  constexpr int kMTiles = Config::kMTiles;
  constexpr int kKW = Traits::kKeyWords;
  constexpr bool kCodebook = Traits::kLutEntries > 0;
  // The 8-warp staged kernel for 3-bit keys reads the centroids' scaled fp16 hi parts alone
  // (codebook_fp16.h: the plan picks it only for a codebook that scales to within kMaxHiOnlyError
  // of fp16, and only at one CTA per SM; its exact twin keeps hi + lo): one score MMA per
  // k-step covers 16 tokens instead of 8, so a chunk needs 16 MMAs, not 24.
  constexpr bool kHiOnly = Config::kHiOnly;
  // The staged bf16 kernel maps a thread's key words to the 16-byte units 4j + t of a token (not
  // to 4t .. 4t + 3), so that its shared-memory reads spread over the banks (StagedLayout).
  constexpr bool kInterleavedKeys = Config::kPlainStaged;

  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x & 31, cta_warp = threadIdx.x >> 5;
  // warp: the warp's index among its KV head's kW warps; unit: which of the CTA's KV heads.
  const int unit = kPaired ? cta_warp / kW : 0, warp = kPaired ? cta_warp % kW : cta_warp;
  const int split = blockIdx.x, h0 = blockIdx.y * kUnits, h = h0 + unit, b = blockIdx.z;

  // Key codebook table, one replica per lane of a half-warp (entry e of lane l at byte 256·e +
  // 8·(l mod 16)), from the decoder's prebuilt table (decode_launch.h, CodebookTable; 2 KB for
  // 4-bit keys): each thread loads its entries here and writes their 16 replicas in
  // finish_prologue, after the first chunk's loads are out. (Copying the replicated table from L2
  // per CTA moved 24 MB through L2 at batch 1 × 32k, 100 MB at 64 × 4k.)
  constexpr int kEntriesPerThread = (Traits::kLutEntries + kT - 1) / kT;
  uint2 entries[kEntriesPerThread > 0 ? kEntriesPerThread : 1];
  uint32_t lane_word = 0;
  if constexpr (kCodebook) {
    const uint32_t window = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    if ((window & 0x00FFFFFFu) != kSmemStart) __trap();  // the lookups assume this layout
#pragma unroll
    for (int k = 0; k < kEntriesPerThread; ++k) {
      const int e = threadIdx.x + k * kT;
      if (e < Traits::kLutEntries) entries[k] = __ldg(p.codebook_table + e);
    }
    lane_word = (window & 0xFF000000u) | (kHiOnly ? 4u * lane : 8u * (lane & 15));
  }
  // The random signs of the query rotation are the decoder's constants: read before the wait.
  constexpr int kE = kD / 32;  // query elements per lane in finish_prologue
  float q_sign[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    q_sign[e] = p.query_signs != nullptr && warp < Config::kQueryHeads
                    ? __ldg(p.query_signs + kE * lane + e)
                    : 1.0f;
  }
  // Launched as a programmatic dependent of whatever kernel precedes it in the stream (the
  // default without a query prep: CudaDecoder::Run), the CTA may be resident before that kernel
  // has finished; everything below reads inputs it may have written (query, seq_lens, tables,
  // cache) or writes what it may still read (workspace, output), so it waits here. Only the
  // launch and the table and sign loads above (decoder-owned constants) overlap the kernel before.
  if (p.wait_at_start) GridDependencyWait();
  // The first query row this warp rotates in finish_prologue (head = warp), for 16-bit queries:
  // its load is issued here, beside the sequence length's, so that its latency overlaps the
  // seq_len -> block table -> first copies chain instead of following it (ncu, 4bit_nc 64 x 1k:
  // the warps waited as long for the query as for the first block ids).
  uint32_t q_pre[kE / 2];
  const bool q_prefetched = p.wait_at_start && p.query_dtype != 0 &&
                            warp < p.num_q_heads / p.num_kv_heads && warp < Config::kQueryHeads;
  if (q_prefetched) {
    const int64_t row =
        static_cast<int64_t>(b) * p.num_q_heads + h * (p.num_q_heads / p.num_kv_heads) + warp;
    const uint32_t* src = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.query) +
                                                            row * kD + kE * lane);
#pragma unroll
    for (int w = 0; w < kE / 2; ++w) q_pre[w] = src[w];
  }
  // The block ids of this warp's first chunks, read beside the sequence length instead of after
  // it (one memory round trip less before the first copies): where they lie past the sequence's
  // blocks they are still inside the table's row (max_blocks_per_seq entries) and are dropped by
  // first_block below.
  const int begin = split * p.tokens_per_split;
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq;
  const int block_shift = 31 - __clz(p.block_size);
  int first_block_ids[kStages];
#pragma unroll
  for (int k = 0; k < kStages; ++k) {
    const int at = (begin + (warp + k * kW) * kChunk) >> block_shift;
    first_block_ids[k] = at < p.max_blocks_per_seq ? __ldg(table + at) : 0;
  }
  // The 8-warp staged compressed kernels read the block ids of their later chunks from shared
  // memory (ids_s, written in finish_prologue) instead of from global memory one chunk ahead of
  // each copy: 10 instructions less per chunk; 1-12 % faster from batch 16 or 32k tokens up
  // (16 × 4k the most), 0.1-0.2 µs slower at batch 1 × 1k-4k (v11d).
  // Loaded here into registers, beside the first ids; entries past the sequence as above
  // (Config::kMaxIds: none in the other kernels).
  constexpr int kIdsPerThread = (Config::kMaxIds + kT - 1) / kT;
  const int id0 = begin >> block_shift;
  const int num_ids =
      min(((begin + p.tokens_per_split - 1) >> block_shift) + 1, p.max_blocks_per_seq) - id0;
  int ids_pre[kIdsPerThread > 0 ? kIdsPerThread : 1];
#pragma unroll
  for (int k = 0; k < kIdsPerThread; ++k) {
    const int i = threadIdx.x + k * kT;
    ids_pre[k] = i < num_ids ? __ldg(table + id0 + i) : 0;
  }
  int* const ids_s = reinterpret_cast<int*>(smem + Config::kIdsOffset);
  const int len = p.seq_lens[b];
  if (begin >= len) {           // the merge reads only splits that hold tokens
    if (p.output != nullptr) {  // no merge: an empty sequence's rows are 0, LSE -inf
      const int group = p.num_q_heads / p.num_kv_heads;
      const int64_t row0 = static_cast<int64_t>(b) * p.num_q_heads + h0 * group;
      for (int i = threadIdx.x; i < kUnits * group * kD; i += blockDim.x) {
        StoreOutput(p.output, p.out_dtype, row0 * kD + i, 0.0f);
        if (i % kD == 0) p.lse[row0 + i / kD] = -INFINITY;
      }
    }
    return;
  }
  const int end = min(begin + p.tokens_per_split, len);
  const int g = lane >> 2, t = lane & 3;
  const int group = p.num_q_heads / p.num_kv_heads;

  // Query fragments (B operand of the score MMA): head 8·nt + g. The compressed kinds carry q as
  // fp16 hi + lo parts (q ≈ hi + lo to ~2^-22), one MMA chain each, and the codebook kinds the
  // centroids as hi + lo rows of the A operand, so scores keep fp32 accuracy. The plain kinds use
  // the query rounded to the cache's type (exact for a query of that type).
  constexpr int kQParts = Traits::kPlain || kPacked ? 1 : 2;
  uint32_t qf[kQParts][kNTiles][kKSteps][2];
  // Everything the split needs from earlier work: waits for the query prep grid where there is
  // one (programmatic launch), rotates the group's query rows into shared memory and loads the
  // fragments from there, and completes the table copy.
  auto finish_prologue = [&] {
    GridDependencyWait();
    // Warp w rotates rows w, w + kW, ... of the group: lane l holds elements kE·l .. kE·l + kE - 1,
    // so the transform's first log2(kE) butterfly stages are in registers and the other five
    // cross lanes (shuffles). Sylvester order: y[j] = Σ_i x[i] (-1)^popcount(i & j).
    uint16_t* q_hi = reinterpret_cast<uint16_t*>(smem + Config::kQueryOffset) +
                     unit * 2 * Config::kQueryHeads * kD;
    uint16_t* q_lo = q_hi + Config::kQueryHeads * kD;
    for (int head = warp; head < Config::kQueryHeads; head += kW) {
      float x[kE];
#pragma unroll
      for (int e = 0; e < kE; ++e) x[e] = 0.0f;
      if (head < group) {
        const int64_t row = static_cast<int64_t>(b) * p.num_q_heads + h * group + head;
#pragma unroll
        for (int e = 0; e < kE; ++e) {
          const int64_t at = row * kD + kE * lane + e;
          if (head == warp && q_prefetched) {
            const auto bits = static_cast<uint16_t>(q_pre[e / 2] >> (16 * (e % 2)));
            x[e] = p.query_dtype == 1 ? __half2float(__ushort_as_half(bits))
                                      : __bfloat162float(__ushort_as_bfloat16(bits));
          } else if (p.query_dtype == 0) {
            x[e] = static_cast<const float*>(p.query)[at];
          } else if (p.query_dtype == 1) {
            x[e] = __half2float(static_cast<const __half*>(p.query)[at]);
          } else {
            x[e] = __bfloat162float(static_cast<const __nv_bfloat16*>(p.query)[at]);
          }
          x[e] *= q_sign[e];  // 1 without signs
        }
        if (p.query_fwht) {
#pragma unroll
          for (int m = 1; m < kE; m <<= 1) {
#pragma unroll
            for (int e = 0; e < kE; ++e) {
              if ((e & m) == 0) {
                const float u = x[e], v = x[e + m];
                x[e] = u + v;
                x[e + m] = u - v;
              }
            }
          }
#pragma unroll
          for (int m = 1; m < 32; m <<= 1) {
#pragma unroll
            for (int e = 0; e < kE; ++e) {
              const float o = __shfl_xor_sync(0xffffffffu, x[e], m);
              x[e] = (lane & m) ? o - x[e] : x[e] + o;
            }
          }
#pragma unroll
          for (int e = 0; e < kE; ++e) x[e] *= p.query_scale;
        }
      }
      // Fragment words hold element pairs (low half = even element), so the rows are stored as
      // pairs.
#pragma unroll
      for (int e = 0; e < kE; e += 2) {
        const int at = head * kD + kE * lane + e;
        if constexpr (Traits::kPlain) {  // the cache's element type
          *reinterpret_cast<uint32_t*>(q_hi + at) = PackPlain<Traits::kFp16>(x[e], x[e + 1]);
        } else {
          const __half2 hi = __floats2half2_rn(x[e], x[e + 1]);
          const float2 hf = __half22float2(hi);
          *reinterpret_cast<__half2*>(q_hi + at) = hi;
          *reinterpret_cast<__half2*>(q_lo + at) = __floats2half2_rn(x[e] - hf.x, x[e + 1] - hf.y);
        }
      }
    }
    if constexpr (kCodebook) {
      // 16-byte stores of two replicas (hi-only: four replicas of the hi pair, 32 per entry at
      // 4-byte steps, so that the 32 lanes' 4-byte lookups hit 32 distinct banks: one wavefront);
      // store c of lane l goes to 16-byte slot (c + l) mod 8 of its entry's 256-byte row, so each
      // 8-lane phase of a store covers 8 distinct bank groups.
      const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
#pragma unroll
      for (int k = 0; k < kEntriesPerThread; ++k) {
        const int e = threadIdx.x + k * kT;
        if (e < Traits::kLutEntries) {
#pragma unroll
          for (int c = 0; c < 8; ++c) {
            const uint32_t at = base + 256u * e + 16u * ((c + lane) & 7);
            const uint32_t second = kHiOnly ? entries[k].x : entries[k].y;
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %1, %2};\n" ::"r"(at), "r"(entries[k].x),
                         "r"(second)
                         : "memory");
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kIdsPerThread; ++k) {
      const int i = threadIdx.x + k * kT;
      if (i < num_ids) ids_s[i] = ids_pre[k];
    }
    __syncthreads();  // the rotated rows, the table replicas and the block ids
#pragma unroll
    for (int part = 0; part < kQParts; ++part) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        // Packed: column g holds part g % 2 of head g / 2.
        const int head = kPacked ? (g >> 1) : 8 * nt + g;
        const uint16_t* q = ((kPacked ? (g & 1) : part) ? q_lo : q_hi) + head * kD +
                            (kInterleavedKeys ? 8 : kD / 4) * t;
#pragma unroll
        for (int s = 0; s < kKSteps; ++s) {
          // A thread's key element i is d = (D/4)·t + i, or with interleaved keys (its units are
          // 4j + t) d = 32·(i / 8) + 8·t + i % 8.
          const int at = kInterleavedKeys ? 32 * (s / 2) + 4 * (s % 2) : 4 * s;
          qf[part][nt][s][0] = *reinterpret_cast<const uint32_t*>(q + at);
          qf[part][nt][s][1] = *reinterpret_cast<const uint32_t*>(q + at + 2);
        }
      }
    }
  };

  float acc[kMTiles][kNTiles][4];
  float m[kNTiles][2], m_thr[kNTiles][2], l[kNTiles][2], z[kNTiles][2];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m[nt][i] = -INFINITY;
      m_thr[nt][i] = -INFINITY;
      l[nt][i] = 0.0f;
      z[nt][i] = 0.0f;
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
    }
  }

  // Per-thread byte offsets within a block (block_bytes < 2^31), computed once; per chunk only the
  // block pointer and the position change.
  const int stride_token =
      Traits::kPlain ? 2 * p.num_kv_heads * kD : p.num_kv_heads * p.data_per_slot;
  const int head_off = Traits::kPlain ? 2 * h * kD : h * p.data_per_slot;
  const int value_base = Traits::kPlain ? static_cast<int>(p.meta_offset) : p.key_data_bytes;
  const int off_kg = head_off + (kInterleavedKeys ? 16 : Traits::kKeyBytes) * t +
                     2 * g * stride_token;   // token 2g
  const int off_k8 = off_kg + stride_token;  // token 2g + 1
  const int off_v = value_base + head_off + Traits::kValueBytes * g + 4 * t * stride_token;
  const int off_meta =
      static_cast<int>(p.meta_offset) + 2 * (h * p.num_meta * p.block_size + 2 * g);
  const int meta_field = 2 * p.block_size;  // bytes between fields of one head

  using Chunk = SplitChunk<Traits>;
  // Block id of chunk c, or 0 past the split's full chunks. Loaded one chunk before the chunk's
  // data loads need it, so that a warp never waits for a table read before its next compute.
  auto block_of = [&](int c, int num_chunks) -> int {
    return c < num_chunks ? __ldg(table + ((begin + c * kChunk) >> block_shift)) : 0;
  };
  auto load = [&](int c, Chunk& ck, int block) {
    const int t0 = begin + c * kChunk;
    const uint32_t pos0 = t0 & (p.block_size - 1);
    const uint8_t* base = p.cache + static_cast<int64_t>(block) * p.block_bytes;
    const uint8_t* at = base + pos0 * stride_token;
    if constexpr (kInterleavedKeys) {  // units 4j + t
#pragma unroll
      for (int j = 0; j < kKW / 4; ++j) {
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(at + off_kg + 64 * j));
        const uint4 c = __ldg(reinterpret_cast<const uint4*>(at + off_k8 + 64 * j));
        ck.kg[4 * j] = a.x, ck.kg[4 * j + 1] = a.y, ck.kg[4 * j + 2] = a.z, ck.kg[4 * j + 3] = a.w;
        ck.k8[4 * j] = c.x, ck.k8[4 * j + 1] = c.y, ck.k8[4 * j + 2] = c.z, ck.k8[4 * j + 3] = c.w;
      }
    } else {
      LoadBytes<Traits::kKeyBytes, Traits::kKeyAlign>(at + off_kg, ck.kg);
      LoadBytes<Traits::kKeyBytes, Traits::kKeyAlign>(at + off_k8, ck.k8);
    }
    LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v, ck.v[0]);
    LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v + 2 * stride_token, ck.v[1]);
    LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v + stride_token, ck.v[2]);
    LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v + 3 * stride_token, ck.v[3]);
    if constexpr (!Traits::kPlain) {
      const uint8_t* meta = base + off_meta + 2 * pos0;
      constexpr int kScaleField = Traits::kHasNorm ? 1 : 0;
      ck.norm = Traits::kHasNorm ? __ldg(reinterpret_cast<const uint32_t*>(meta)) : 0u;
      ck.vscale = __ldg(reinterpret_cast<const uint32_t*>(meta + kScaleField * meta_field));
      ck.vzero = __ldg(reinterpret_cast<const uint32_t*>(meta + (kScaleField + 1) * meta_field));
    }
  };

  // One chunk: scores, the online softmax and P·V (decode_split_compute.cuh).
  const SplitCompute<V> compute{p, begin, end, g, t, lane_word, qf, acc, m, m_thr, l, z};

  // Full chunks in turn over the warps; the split's last, partial chunk (if any) separately, so
  // that only it pays for the end-of-sequence masks.
  const int num_full = (end - begin) / kChunk;
  // block_of(warp + k·kW, num_full) for the chunks read in the prologue (k < kStages).
  auto first_block = [&](int k) { return warp + k * kW < num_full ? first_block_ids[k] : 0; };
  if constexpr (Traits::kPlain && kStaged) {
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
      const uint8_t* base =
          p.cache + static_cast<uint64_t>(static_cast<uint32_t>(block)) * block_bytes;
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
  } else if constexpr (Traits::kPlain) {
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
  } else if constexpr (kStaged) {
    // Chunk c + (kStages - 1)·kW is copied into stage (k + 3) mod 4 while chunk c (this warp's
    // k-th) is read from stage k mod 4 and computed; one commit group per chunk (empty past the
    // end) keeps the wait count fixed. In copy instruction j (j = 0..3) lane l copies the 16-byte
    // unit l mod 8 of token 4j + l / 8, so each 8-lane phase moves one token's whole slot: one
    // L2 request per 128-byte line of the slot (two where a 112-byte slot of 3-bit keys crosses a
    // line), where lane pairs over 16 tokens (v7y) made four per line, and twice that for the
    // 3-bit slots at 112·h: that request rate held k3v4_nc's copies to 57 % of the read ceiling
    // (v8a). A phase writes one token's 8 units of one stage row, conflict-free under any
    // swizzle. Lanes 0-5 also copy one 16-byte half of a metadata run each.
    using Layout = StagedLayout<kKind, kSW>;
    constexpr uint32_t kPitch = Layout::kPitch;
    constexpr uint32_t kKeyBytes = Traits::kKeyBytes * 4;  // per token (4 lanes)
    static_assert(kKeyBytes % 16 == 0 && kKeyBytes + 64 <= kPitch);
    const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    uint32_t stage[kStages];  // shared addresses of this warp's stages, stage[0] = the next read
#pragma unroll
    for (int s = 0; s < kStages; ++s) stage[s] = smem_base + Layout::Stage(cta_warp, s);
    const uint32_t meta_cells = smem_base + Layout::kMeta + 128u * kStages * cta_warp;
    const uint32_t copy_tok = lane >> 3, copy_unit = lane & 7u;
    // The swizzles are XOR-linear in the token's bits, so token 4j + r's destination is r's with
    // Swizzle(4j) applied (kPitch is a multiple of 128: the XOR touches only the unit bits).
    const uint32_t copy_dst =
        Pinned(kPitch * copy_tok + 16u * (copy_unit ^ Layout::Swizzle(copy_tok)));
    const uint32_t copy_head = head_off;
    // A warp's chunks lie kW·16 tokens apart; in the 8-warp kernels that is 128 tokens, a multiple
    // of every block size (16-128), so the position of each of its chunks in its block is the
    // same (kFixedPos: folded into copy_src once, no per-chunk position arithmetic).
    constexpr bool kFixedPos = kW * kChunk == 128;
    const uint32_t warp_pos =
        kFixedPos ? (static_cast<uint32_t>(begin + warp * kChunk) & (p.block_size - 1)) : 0u;
    const uint32_t copy_src =
        Pinned((warp_pos + copy_tok) * stride_token + copy_head + 16u * copy_unit);
    const uint32_t copy_step = Pinned(4u * static_cast<uint32_t>(stride_token));  // 4 tokens
    // Unit 7 of a 112-byte slot (3-bit keys) is past the slot: that lane copies nothing.
    const bool copy_lane = 16u * copy_unit < kKeyBytes + 64u;
    const bool meta_lane = lane < 6;  // field lane / 2, half lane % 2
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
      const uint8_t* base =
          p.cache + static_cast<uint64_t>(static_cast<uint32_t>(block)) * block_bytes;
      const uint32_t pos0 = kFixedPos ? 0u : (begin + cc * kChunk) & (p.block_size - 1);
      const uint8_t* from = base + (pos0 * stride_token + copy_src);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t to = dst + 4u * kPitch * j + (copy_dst ^ (16u * Layout::Swizzle(4u * j)));
        if constexpr (kKeyBytes + 64 == 128) {
          CopyAsync16Fill<kStreamCopies>(to, from, bytes);
        } else {
          CopyAsync16FillIf<kStreamCopies>(copy_lane, to, from, bytes);
        }
        from += copy_step;
      }
      CopyAsync16FillIf<kStreamCopies>(meta_lane, meta_dst, base + (copy_meta + 2 * pos0), bytes);
    };
    // Read offsets within a stage: keys of token 2g and 2g + 1 (+kPitch: the swizzle depends on
    // token / 2); values of tokens 4t, 4t + 1 (+kPitch) and 4t + 2, 4t + 3 (+kPitch), bytes
    // kKeyBytes + 8g; metadata of tokens 2g, 2g + 1.
    auto at = [](uint32_t token, uint32_t byte) {
      return kPitch * token + 16u * ((byte >> 4) ^ Layout::Swizzle(token)) + (byte & 15u);
    };
    constexpr int kKeyReads = kKind == KeyKind::kMse4 ? 1 : 3;  // 16-byte or 4-byte reads
    uint32_t read_k[kKeyReads];
#pragma unroll
    for (int w = 0; w < kKeyReads; ++w) {
      read_k[w] = Pinned(at(2 * g, kKind == KeyKind::kMse4 ? 16u * t : 12u * t + 4u * w));
    }
    const uint32_t read_v0 = Pinned(at(4 * t, kKeyBytes + 8u * g));
    const uint32_t read_v1 = Pinned(at(4 * t + 2, kKeyBytes + 8u * g));
    const uint32_t read_meta = Pinned(meta_cells + 4u * g);
    auto read = [&](uint32_t st, uint32_t meta, Chunk& ck) {
      if constexpr (kKind == KeyKind::kMse4) {
        SharedLoad16(st + read_k[0], ck.kg);
        SharedLoad16(st + read_k[0] + kPitch, ck.k8);
      } else {
#pragma unroll
        for (int w = 0; w < kKeyReads; ++w) {
          ck.kg[w] = SharedLoad4(st + read_k[w]);
          ck.k8[w] = SharedLoad4(st + read_k[w] + kPitch);
        }
      }
      SharedLoad8(st + read_v0, ck.v[0]);
      SharedLoad8(st + read_v0 + kPitch, ck.v[2]);
      SharedLoad8(st + read_v1, ck.v[1]);
      SharedLoad8(st + read_v1 + kPitch, ck.v[3]);
      ck.norm = SharedLoad4(meta);
      ck.vscale = SharedLoad4(meta + 32);
      ck.vzero = SharedLoad4(meta + 64);
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
  } else {
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
  if ((end - begin) % kChunk != 0 && num_full % kW == warp) {
    Chunk tail;
    load(num_full, tail, block_of(num_full, num_full + 1));
    compute.template operator()<true>(num_full, tail);
  }

  // The merge grid (or, without one, the next kernel) may start; it waits for this grid to finish
  // before it reads anything. Not when the next kernel may be a split grid smaller than the SMs'
  // room (p.trigger_dependents = 0): CTAs launched while this grid's last ones still ran were
  // placed next to them, two on some SMs, and a one-wave grid is as slow as its slowest SM
  // (batch 1 × 32k: 20.5 -> 27 µs with the merge's early trigger, measured); then the next
  // kernel is launched when every CTA of this grid has exited.
  if (p.trigger_dependents) LaunchDependents();

  if constexpr (kPacked) {  // columns 2t, 2t + 1 hold the P'_hi and P'_lo sums of head t
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      acc[mt][0][0] += acc[mt][0][1];  // row g
      acc[mt][0][2] += acc[mt][0][3];  // row g + 8
    }
  }

  // Row sums: l and z are per-thread partials over tokens 2g, 2g+1; m is already warp-uniform
  // per head column.
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

  // Merge the four warps through shared memory (the table is no longer needed): every warp
  // stores its (m, l, z) and its accumulator unscaled, then one pass rescales and sums them.
  __syncthreads();
  constexpr int kHeads = 8 * kNTiles;
  // Rows per CTA warp (kCW); a paired CTA's heads 0-3 of unit u are its row heads 4u .. 4u + 3
  // in the per-head arrays below.
  constexpr int kCW = Config::kCtaWarps;
  float* acc_s = reinterpret_cast<float*>(smem);             // [kCW][kHeads] rows, AccAt
  float* stats = acc_s + kCW * kHeads * Config::kAccStride;  // [3][kCW][kHeads]: m, l, z
  if (g == 0) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int j = 0; j < (kPacked ? 1 : 2); ++j) {
        const int head = kPacked ? t : 8 * nt + 2 * t + j;
        stats[(0 * kCW + cta_warp) * kHeads + head] = m[nt][j];
        stats[(1 * kCW + cta_warp) * kHeads + head] = l[nt][j];
        stats[(2 * kCW + cta_warp) * kHeads + head] = z[nt][j];
      }
    }
  }
  float* my_acc = acc_s + Config::AccAt(cta_warp * kHeads, 0);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    const int d0 = Traits::D0(g, mt);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (kPacked && i % 2 == 1) continue;  // folded into i - 1
        const int head = kPacked ? t : 8 * nt + 2 * t + (i % 2);
        my_acc[Config::AccAt(head, d0 + i / 2)] =
            acc[mt][nt][i] * (i < 2 ? Traits::kEvenRowScale : Traits::kOddRowScale);
      }
    }
  }
  __syncthreads();

  // Final: out[head][d] = (Σ_w f_w · acc_w + z) / l with f_w = 2^(m_w - max m), z = Σ_w f_w z_w,
  // l = Σ_w f_w l_w, lse = (max m + log2 l) · ln 2, for the group's heads. A warp without tokens
  // has m = -inf and f = 0. The per-head factors first (one thread per head), then the elements.
  // Paired CTAs: unit u's warps are u·kW .. u·kW + kW - 1 and its heads hh = u·group + head of
  // the per-head arrays (rows b·Hq + h0·group + hh: the two KV heads' query rows are adjacent).
  static_assert(kUnits * 4 <= kHeads || !kPaired);
  float* factor = stats + 3 * kCW * kHeads;  // [kCW][kHeads] f_w, [kHeads] 1/l, [kHeads] z
  if (threadIdx.x < kUnits * group) {
    const int hh = threadIdx.x, u = kPaired ? hh / group : 0, head = kPaired ? hh % group : hh;
    const int w0 = u * kW;
    float mm = -INFINITY;
#pragma unroll
    for (int w = w0; w < w0 + kW; ++w) mm = fmaxf(mm, stats[w * kHeads + head]);
    float ll = 0.0f, zz = 0.0f;
#pragma unroll
    for (int w = w0; w < w0 + kW; ++w) {
      const float mw = stats[w * kHeads + head];
      const float f = mw == -INFINITY ? 0.0f : exp2f(mw - mm);
      factor[w * kHeads + head] = f;
      ll += f * stats[(kCW + w) * kHeads + head];
      zz += f * stats[(2 * kCW + w) * kHeads + head];
    }
    factor[kCW * kHeads + hh] = 1.0f / ll;
    factor[(kCW + 1) * kHeads + hh] = zz;
    const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + h0 * group + hh);
    const float lse = (mm + log2f(ll)) * kLn2;
    if (p.output != nullptr) {  // one split per sequence: the final LSE, no merge
      p.lse[row] = lse;
    } else {
      p.partial_lse[row * p.max_splits + split] = lse;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kUnits * group * kD; i += kT) {
    const int hh = i / kD, d = i % kD, u = kPaired ? hh / group : 0;
    const int head = kPaired ? hh % group : hh, w0 = u * kW;
    float aa = 0.0f;
#pragma unroll
    for (int w = w0; w < w0 + kW; ++w) {
      const float f = factor[w * kHeads + head];
      aa += f == 0.0f ? 0.0f : f * acc_s[Config::AccAt(w * kHeads + head, d)];
    }
    const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + h0 * group + hh);
    const float out = (aa + factor[(kCW + 1) * kHeads + hh]) * factor[kCW * kHeads + hh];
    if (p.output != nullptr) {  // one split per sequence: the final output, no merge
      StoreOutput(p.output, p.out_dtype, row * kD + d, out);
    } else {
      p.partial_out[(row * p.max_splits + split) * kD + d] = out;
    }
  }
}

// Launch and occupancy of one instantiation of the split kernel.
template <SplitVariant V>
struct SplitKernelOps {
  using Config = SplitKernelConfig<V>;
  static constexpr auto kKernel = DecodeSplitKernel<V.Code()>;
  static_assert(SplitVariant::FromCode(V.Code()) == V);
  static constexpr int kCtaThreads = Config::kCtaWarps * 32;

  // Shared memory above 48 KB must be opted into once per kernel.
  static cudaError_t Configure() {
    static const cudaError_t configured = cudaFuncSetAttribute(
        kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Config::kSmemBytes);
    return configured;
  }
  static cudaError_t Launch(const SplitParams& p, bool programmatic, cudaStream_t stream) {
    if (const cudaError_t e = Configure(); e != cudaSuccess) return e;
    if (p.num_kv_heads % Config::kUnits != 0) return cudaErrorInvalidValue;
    const dim3 grid(p.max_splits, p.num_kv_heads / Config::kUnits, p.num_seqs);
    if (programmatic) {
      return LaunchDependent(kKernel, grid, dim3(kCtaThreads), Config::kSmemBytes, stream, p);
    }
    kKernel<<<grid, kCtaThreads, Config::kSmemBytes, stream>>>(p);
    return cudaGetLastError();
  }
  static cudaError_t CtasPerSm(int* ctas) {
    if (const cudaError_t e = Configure(); e != cudaSuccess) return e;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, kKernel, kCtaThreads,
                                                         Config::kSmemBytes);
  }
};

// The split kernels of one key kind: every variant SplitVariantsOf(kKind) lists is instantiated,
// and the one asked for is launched (cudaErrorInvalidValue for any other value).
template <KeyKind kKind, typename Fn, int... I>
cudaError_t ForVariant(const SplitVariant& variant, std::integer_sequence<int, I...>, Fn&& fn) {
  static constexpr SplitVariantList kList = SplitVariantsOf(kKind);
  cudaError_t result = cudaErrorInvalidValue;
  ((variant == kList.items[I] ? (result = fn(SplitKernelOps<kList.items[I]>{}), true) : false) ||
   ...);
  return result;
}

template <KeyKind kKind>
cudaError_t LaunchSplitKernelOfKind(const SplitParams& p, const SplitVariant& variant,
                                    bool programmatic, cudaStream_t stream) {
  return ForVariant<kKind>(
      variant, std::make_integer_sequence<int, SplitVariantsOf(kKind).size>{},
      [&](auto ops) { return decltype(ops)::Launch(p, programmatic, stream); });
}

template <KeyKind kKind>
cudaError_t SplitKernelOfKindCtasPerSm(const SplitVariant& variant, int* ctas) {
  return ForVariant<kKind>(variant, std::make_integer_sequence<int, SplitVariantsOf(kKind).size>{},
                           [&](auto ops) {
                             const cudaError_t e = decltype(ops)::CtasPerSm(ctas);
                             *ctas *= decltype(ops)::Config::kUnits;
                             return e;
                           });
}

}  // namespace tqkv::decode_detail
