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

// The shared-memory addresses of a warp's cp.async stages: stage[0] is the next to read,
// stage[kS - 1] the next to fill. Both staged pipelines rotate it once per chunk.
template <int kS>
struct StageRing {
  uint32_t stage[kS];
  __device__ __forceinline__ void Rotate() {
    const uint32_t first = stage[0];
#pragma unroll
    for (int i = 0; i + 1 < kS; ++i) stage[i] = stage[i + 1];
    stage[kS - 1] = first;
  }
};

// One CTA of split kernel V: (split, KV head or pair of KV heads, sequence). Run() is the kernel;
// its phases are the member functions below, in the order they run: Start (block ids, sequence
// length, the query's and codebook's first loads), one chunk pipeline (which calls FinishPrologue
// once its first copies are out, then Load/Compute per chunk), Tail, Finish (the warps' merge and
// the output). Everything is inlined into the kernel; the members are its registers.
template <SplitVariant V>
class SplitCta {
 public:
  using Config = SplitKernelConfig<V>;
  using Traits = typename Config::Traits;
  static constexpr KeyKind kKind = V.kind;
  static constexpr int kValueBits = V.value_bits;
  static constexpr int kD = V.head_dim;
  static constexpr int kNTiles = V.n_tiles;
  static constexpr bool kPacked = V.packed;
  static constexpr bool kStaged = Config::kStaged;
  static constexpr bool kPaired = Config::kPaired;
  static constexpr int kSW = Config::kSW;
  static_assert(!kPacked || (kNTiles == 1 && !IsPlain(kKind)));
  static_assert(!kStaged || HasStagedKernel(kKind, kValueBits, kD, kPacked));
  static_assert(!V.hi_only || (kStaged && kKind == KeyKind::kMse3 && Config::kSW == kStagedWarps));
  static_assert(!kPaired || (kStaged && !IsPlain(kKind)));
  static_assert(!V.one_cta || (kStaged && kKind == KeyKind::kMse4 && !kPaired &&
                               V.pipeline == SplitPipeline::kStaged));

  static constexpr int kT = Config::kCtaWarps * 32;
  // The cache copies with the L2 evict-first policy (CopyAsync16Fill), except 3-bit keys'.
  static constexpr bool kStreamCopies = kKind != KeyKind::kMse3;
  // kW: the warps that share one KV head's chunks (all of the CTA's but in a paired CTA).
  static constexpr int kUnits = Config::kUnits;
  static constexpr int kW = Config::kCtaWarps / kUnits;
  static constexpr int kKSteps = Config::kKSteps;
  static constexpr int kMTiles = Config::kMTiles;
  static constexpr int kKW = Traits::kKeyWords;
  static constexpr int kVW = Traits::kValueWords;
  static constexpr bool kCodebook = Traits::kLutEntries > 0;
  // The 8-warp staged kernel for 3-bit keys reads the centroids' scaled fp16 hi parts alone
  // (codebook_fp16.h: the plan picks it only for a codebook that scales to within kMaxHiOnlyError
  // of fp16, and only at one CTA per SM; its exact twin keeps hi + lo): one score MMA per
  // k-step covers 16 tokens instead of 8, so a chunk needs 16 MMAs, not 24.
  static constexpr bool kHiOnly = Config::kHiOnly;
  // The staged bf16 kernel maps a thread's key words to the 16-byte units 4j + t of a token (not
  // to 4t .. 4t + 3), so that its shared-memory reads spread over the banks (StagedLayout).
  static constexpr bool kInterleavedKeys = Config::kPlainStaged;
  static constexpr int kEntriesPerThread = (Traits::kLutEntries + kT - 1) / kT;
  static constexpr int kE = kD / 32;  // query elements per lane in FinishPrologue
  static constexpr int kIdsPerThread = (Config::kMaxIds + kT - 1) / kT;
  // Query fragments (B operand of the score MMA): head 8·nt + g. The compressed kinds carry q as
  // fp16 hi + lo parts (q ≈ hi + lo to ~2^-22), one MMA chain each, and the codebook kinds the
  // centroids as hi + lo rows of the A operand, so scores keep fp32 accuracy. The plain kinds use
  // the query rounded to the cache's type (exact for a query of that type).
  static constexpr int kQParts = Traits::kPlain || kPacked ? 1 : 2;

  __device__ __forceinline__ SplitCta(const SplitParams& params, uint8_t* shared)
      : p(params), smem(shared) {}

  __device__ __forceinline__ void Run() {
    if (!Start()) return;
    InitState();
    if constexpr (Traits::kPlain && kStaged) {
      RunPlainStaged();
    } else if constexpr (Traits::kPlain) {
      RunPlainRegisters();
    } else if constexpr (kStaged) {
      RunStaged();
    } else {
      RunRegisters();
    }
    Tail();
    Finish();
  }

 private:
  // Registers of one chunk.
  struct Chunk {
    uint32_t kg[kKW], k8[kKW];     // key bytes of score rows g, g + 8 (tokens 2g, 2g + 1)
    uint32_t v[4][kVW];            // value bytes of tokens 4t, 4t+2, 4t+1, 4t+3
    uint32_t norm, vscale, vzero;  // fp16 pairs: tokens 2g (low half), 2g + 1 (high half)
  };

  const SplitParams& p;
  uint8_t* const smem;
  int lane, cta_warp;
  // warp: the warp's index among its KV head's kW warps; unit: which of the CTA's KV heads.
  int unit, warp;
  int split, h0, h, b;
  // Key codebook table, one replica per lane of a half-warp (entry e of lane l at byte 256·e +
  // 8·(l mod 16)), from the decoder's prebuilt table (decode_launch.h, CodebookTable; 2 KB for
  // 4-bit keys): each thread loads its entries in Start and writes their 16 replicas in
  // FinishPrologue, after the first chunk's loads are out. (Copying the replicated table from L2
  // per CTA moved 24 MB through L2 at batch 1 × 32k, 100 MB at 64 × 4k.)
  uint2 entries[kEntriesPerThread > 0 ? kEntriesPerThread : 1];
  uint32_t lane_word = 0;
  float q_sign[kE];
  uint32_t q_pre[kE / 2];
  bool q_prefetched;
  int begin;
  const int32_t* table;
  int block_shift;
  int first_block_ids[kStages];
  int id0, num_ids;
  int ids_pre[kIdsPerThread > 0 ? kIdsPerThread : 1];
  int* ids_s;
  int len, end, g, t, group;
  uint32_t qf[kQParts][kNTiles][kKSteps][2];
  // The online softmax's running state and the P·V accumulators.
  float acc[kMTiles][kNTiles][4];
  float m[kNTiles][2], m_thr[kNTiles][2], l[kNTiles][2], z[kNTiles][2];
  // Per-thread byte offsets within a block (InitState).
  int stride_token, head_off, value_base, off_kg, off_k8, off_v, off_meta, meta_field;
  // Full chunks of the split (the last, partial one is the Tail's).
  int num_full;

  // Indices, the loads that need not wait for the kernel before (codebook, signs), the wait, then
  // the loads of the block-table chain. False when the split holds no tokens (its outputs, if it
  // writes the final ones, are then written here).
  __device__ __forceinline__ bool Start();

  // Everything the split needs from earlier work: waits for the query prep grid where there is
  // one (programmatic launch), rotates the group's query rows into shared memory and loads the
  // fragments from there, and completes the table copy.
  __device__ __forceinline__ void FinishPrologue();

  // The running softmax state, the accumulators and the per-thread offsets.
  __device__ __forceinline__ void InitState();

  // Block id of chunk c, or 0 past the split's full chunks. Loaded one chunk before the chunk's
  // data loads need it, so that a warp never waits for a table read before its next compute.
  __device__ __forceinline__ int BlockOf(int c, int num_chunks) const {
    return c < num_chunks ? __ldg(table + ((begin + c * kChunk) >> block_shift)) : 0;
  }

  // The chunk's bytes from global memory into registers (the register pipelines and the tail).
  __device__ __forceinline__ void Load(int c, Chunk& ck, int block) const;

  // BlockOf(warp + k·kW, num_full) for the chunks read in the prologue (k < kStages).
  __device__ __forceinline__ int FirstBlock(int k) const {
    return warp + k * kW < num_full ? first_block_ids[k] : 0;
  }

  // Scores Sᵀ[token, head] for tokens 2g, 2g+1 and heads 8·nt + 2t, +1, in independent MMA
  // chains sp[k] (summed below). FP8 / bf16 keys: M rows g, g + 8 are tokens 2g, 2g + 1;
  // chains k = q parts. Codebook keys: one MMA per token half (k = 2·half + q part), whose rows
  // g and g + 8 hold the c_hi and c_lo parts of the same token (one 64-bit table load gives
  // both, in the consecutive registers an MMA operand needs), so S = C[row g] + C[row g + 8].
  // (Three chains c_hi·q_hi, c_hi·q_lo, c_lo·q_hi with token rows would save a quarter of these
  // MMAs but cost 8 register moves per k-step to regroup the loaded pairs: measured in SASS.)
  // (Staged: each token half's chain split in two by k-step parity, chains of 4 MMAs, not 8.)
  static constexpr int kScoreChains = kPacked          ? (kCodebook ? (kStaged ? 4 : 2) : 1)
                                      : Traits::kPlain ? 1
                                                       : (kCodebook ? 4 : 2);

  // One chunk: scores, the online softmax, P·V. kTail: the split's last, partial chunk, whose
  // tokens past the end are masked.
  template <bool kTail>
  __device__ __forceinline__ void Compute(int c, Chunk& cur);

  // Sᵀ = K̂ · Qᵀ for the chunk, in kScoreChains independent MMA chains (summed by the softmax).
  __device__ __forceinline__ void Scores(const Chunk& cur,
                                         float (&sp)[kScoreChains][kNTiles][4]) const;

  // The online softmax of a packed warp (head t per thread) and P' for the P·V MMA.
  template <bool kTail>
  __device__ __forceinline__ void SoftmaxPacked(const float (&sp)[kScoreChains][kNTiles][4],
                                                const bool (&valid)[2], const float (&row_scale)[2],
                                                const float (&vs)[2], const float (&vz)[2],
                                                uint32_t (&pb)[kNTiles][2],
                                                uint32_t (&pb_lo)[kNTiles][2]);

  // The online softmax of an unpacked warp (heads 2t, 2t + 1 of each N tile per thread) and P'
  // (hi and lo parts) for the P·V MMA.
  template <bool kTail>
  __device__ __forceinline__ void SoftmaxUnpacked(const float (&sp)[kScoreChains][kNTiles][4],
                                                  const bool (&valid)[2],
                                                  const float (&row_scale)[2], const float (&vs)[2],
                                                  const float (&vz)[2], uint32_t (&pb)[kNTiles][2],
                                                  uint32_t (&pb_lo)[kNTiles][2]);

  // Oᵀ[d, head] += Vᵀ[d, token] · P'ᵀ[token, head].
  __device__ __forceinline__ void AccumulatePV(const Chunk& cur, const uint32_t (&pb)[kNTiles][2],
                                               const uint32_t (&pb_lo)[kNTiles][2]);

  // bf16/fp16 caches, staged (Bf16StagedLayout).
  __device__ __forceinline__ void RunPlainStaged();

  // bf16/fp16 caches from registers.
  __device__ __forceinline__ void RunPlainRegisters();

  // Compressed caches, staged (StagedLayout): the 8-warp, narrow and paired kernels.
  __device__ __forceinline__ void RunStaged();

  // Compressed caches from registers (two buffers in turn).
  __device__ __forceinline__ void RunRegisters();

  // The split's last, partial chunk (if any), with the end-of-sequence masks.
  __device__ __forceinline__ void Tail();

  // After the chunks: lets the next grid launch, then the per-thread sums of each warp's rows.
  __device__ __forceinline__ void Finish();

  // The CTA's warps' partial results merged into the split's output and LSE for each head.
  __device__ __forceinline__ void MergeWarps();
};

}  // namespace tqkv::decode_detail
