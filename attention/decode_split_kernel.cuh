// Split-KV decode attention over paged caches: TurboQuant SoA blocks (4/3-bit codebook keys, FP8
// keys; 4/3-bit uniform values) and uncompressed bf16 or fp16 blocks (the "plain" kinds: one
// kernel family with bf16 or fp16 MMAs), plus the LSE merge and the query preparation for a dense
// Πᵀ (q·Πᵀ once per step; Hadamard rotations are applied to the query by each CTA's prologue, as
// a Walsh-Hadamard transform of its group's rows).
//
// One CTA = (split of the context, KV head, sequence), 4 warps (8 for the staged kernels of
// 4bit_nc and k3v4_nc; the staged kernels, those two at D = 128, 4bit_nc at 64 and bf16 at 64
// and 128, copy their chunks into
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
// the running maximum by 2^6), and P' reaches the B operand of P·V by an 8x8 movmatrix. (The
// half-precision variant, SplitVariant::half, for verify passes that ask for it, rounds each of
// them once instead.)
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
#include "attention/decode_split_epilogue.cuh"
#include "attention/decode_split_pipelines.cuh"
#include "attention/decode_split_prologue.cuh"
#include "attention/decode_split_shared.cuh"
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
// finish_prologue (decode_split_prologue.cuh: query rotation into shared memory, codebook
// replicas, block ids, query fragments) once a pipeline's first copies are out; one of four chunk
// pipelines (decode_split_pipelines.cuh) calling `compute` (decode_split_compute.cuh: score MMAs,
// online softmax, P·V MMAs) per chunk; the split's masked last chunks (a partial one; a verify
// pass's causal part, SplitParams::verify); the warps' merge through shared memory and the output
// (decode_split_epilogue.cuh). The phases are function objects
// holding references to the kernel's values, or function templates over them, as the lambdas
// they replaced were: a per-CTA class with member functions compiled to other schedules, 5-9 %
// slower for k3v4_nc at batch 16 (a7bbadb).
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
  static_assert(!kStaged || HasStagedKernel(kKind, kValueBits, kD, kPacked, V.half) ||
                (V.shared_o && HasSharedOKernel(kKind, kValueBits, kD)));
  static_assert(kSW == kStagedWarps || (kStaged && kKind == KeyKind::kMse3 && kSW == 4) ||
                (V.half && kSW == 4) || (kD == 64 && kSW == 4));
  static_assert(!V.half || (!kPacked && kStaged && !IsPlain(kKind)));
  static_assert(!V.hi_only || (kStaged && kKind == KeyKind::kMse3 && kSW == kStagedWarps));
  static_assert(!kPaired || (kStaged && !IsPlain(kKind) && kSW == kStagedWarps));
  static_assert(!V.one_cta ||
                (kStaged && kKind == KeyKind::kMse4 && kSW == kStagedWarps && !kPaired));
  constexpr int kT = Config::kCtaWarps * 32;
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
  // 8·(l mod 16); Config::kHiTable: the hi pair alone, one per lane at 256·e + 4·l), from the
  // decoder's prebuilt table (decode_launch.h, CodebookTable; 2 KB for 4-bit keys): each thread
  // loads its entries here and writes their replicas in finish_prologue, after the first chunk's
  // loads are out. (Copying the replicated table from L2 per CTA moved 24 MB through L2 at batch 1
  // × 32k, 100 MB at 64 × 4k.)
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
    lane_word = (window & 0xFF000000u) | (Config::kHiTable ? 4u * lane : 8u * (lane & 15));
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
  if (p.trigger_at_start) LaunchDependents();
  // The query rows this warp rotates in finish_prologue (heads warp, warp + kW, ...), for 16-bit
  // queries aligned to 4 bytes, loaded early so that their latency overlaps the chain before the
  // first copies instead of following it. A decode row (head = warp; at GQA 8 a 4-warp CTA's warp
  // rotates a second, loaded in finish_prologue) is loaded here, beside the sequence length (ncu,
  // 4bit_nc 64 x 1k: the warps waited as long for the query as for the first block ids); a
  // verify pass's rows, which depend on query_start_loc, once the span is known (below;
  // ncu, 4bit_nc 64 x 4k with 4 new tokens: the first use of a row loaded in finish_prologue was
  // the kernel's longest wait outside the main loop, 3 % of the warp samples).
  constexpr int kQRows = SplitPrologue<V>::kRowsPerWarp;
  uint32_t q_pre[kQRows][kE / 2];
  int q_prefetched_rows = 0;  // q_pre[r] holds the row of head warp + r·kW for every r below
  const bool q_16bit = p.wait_at_start && p.query_dtype != DType::kF32 &&
                       (reinterpret_cast<uintptr_t>(p.query) & 3u) == 0;
  auto prefetch_query_row = [&](int r, int64_t row) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.query) +
                                                            row * kD + kE * lane);
#pragma unroll
    for (int w = 0; w < kE / 2; ++w) q_pre[r][w] = src[w];
  };
  if (q_16bit && p.verify.query_start_loc == nullptr && warp < p.num_q_heads / p.num_kv_heads &&
      warp < Config::kQueryHeads) {
    prefetch_query_row(
        0, static_cast<int64_t>(b) * p.num_q_heads + h * (p.num_q_heads / p.num_kv_heads) + warp);
    q_prefetched_rows = 1;
  }
  // The block ids of this warp's first chunks, read beside the sequence length instead of after
  // it (one memory round trip less before the first copies): where they lie past the sequence's
  // blocks they are still inside the table's row (max_blocks_per_seq entries) and are dropped by
  // first_block below.
  int begin = split * p.tokens_per_split;
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq;
  const int block_shift = 31 - __clz(p.block_size);
  // A sliding window (SplitParams::window): the splits read the sequence from its origin on,
  // through the table row and positions shifted by it (one memory round trip more before the
  // first copies, for such calls only; the loops are those of a shorter sequence). The origin is
  // that of the span's last column (a verify pass's latest new token, whose window starts last),
  // so every column sees every token from it on; the first column's window starts earliest:
  // split 0 also runs the chunks before the origin from the one holding that position (negative
  // positions; their blocks hold positions of the window, so they are live), masked below each
  // column's first position. The kernels with their own outputs run them after the split's other
  // chunks (window_head); the shared-output kernel's window twin (SplitVariant::window; CudaDecoder
  // ::Run takes it for a window) as its first steps, from a begin below 0. The shared-output
  // kernel without the twin reads no window.
  int table_len = p.max_blocks_per_seq, origin = 0;
  bool window_head = false;
  if ((!V.shared_o || V.window) && p.window > 0) {
    const ColumnSpan columns = SpanOfColumns(p.verify, p.seq_lens, b);
    origin = WindowOrigin(WindowLo(columns.len, p.window), p.block_size);
    table += origin >> block_shift;
    table_len -= origin >> block_shift;
    const int lo = WindowLo(columns.end0, p.window);
    window_head = split == 0 && lo < origin;
    if (V.window && window_head) begin = (lo & -kChunk) - origin;
  }
  int first_block_ids[kStages];
#pragma unroll
  for (int k = 0; k < kStages; ++k) {
    const int at = (begin + (warp + k * kW) * kChunk) >> block_shift;
    first_block_ids[k] = at < table_len ? __ldg(table + at) : 0;
  }
  // The 8-warp staged compressed kernels read the block ids of their later chunks from shared
  // memory (ids_s, written in finish_prologue) instead of from global memory one chunk ahead of
  // each copy: 10 instructions less per chunk; 1-12 % faster from batch 16 or 32k tokens up
  // (16 × 4k the most), 0.1-0.2 µs slower at batch 1 × 1k-4k (v11d).
  // Loaded here into registers, beside the first ids; entries past the sequence as above
  // (Config::kMaxIds: none in the other kernels).
  constexpr int kIdsPerThread = (Config::kMaxIds + kT - 1) / kT;
  const int id0 = begin >> block_shift;
  const int num_ids = min(((begin + p.tokens_per_split - 1) >> block_shift) + 1, table_len) - id0;
  int ids_pre[kIdsPerThread > 0 ? kIdsPerThread : 1];
#pragma unroll
  for (int k = 0; k < kIdsPerThread; ++k) {
    const int i = threadIdx.x + k * kT;
    ids_pre[k] = i < num_ids ? __ldg(table + id0 + i) : 0;
  }
  int* const ids_s = reinterpret_cast<int*>(smem + Config::kIdsOffset);
  // Every column sees the tokens before span.end0; a verify pass's later columns a few more, up
  // to span.len (VerifyColumns).
  const ColumnSpan span = ShiftSpan(SpanOfColumns(p.verify, p.seq_lens, b), origin);
  const int len = span.len;
  if (begin >= len && !window_head) {  // the merge reads only splits that hold tokens
    // No merge: an empty sequence's rows are 0, LSE -inf (a verify pass has no rows there).
    if (p.output != nullptr && p.verify.query_start_loc == nullptr) {
      const int group = p.num_q_heads / p.num_kv_heads;
      const int64_t row0 = static_cast<int64_t>(b) * p.num_q_heads + h0 * group;
      for (int i = threadIdx.x; i < kUnits * group * kD; i += blockDim.x) {
        StoreOutput(p.output, p.out_dtype, row0 * kD + i, 0.0f);
        if (i % kD == 0) p.lse[row0 + i / kD] = -INFINITY;
      }
    }
    return;
  }
  const int end = min(split * p.tokens_per_split + p.tokens_per_split, len);
  const int g = lane >> 2, t = lane & 3;
  const int group = p.num_q_heads / p.num_kv_heads;
  // (Not in k8v4's 32-column kernel: its passes measured 6 % slower with it, H100, 64 x 4k and
  // 32 x 4k with 8 new tokens, where the other kinds' passes gained 2-5 %.)
  constexpr bool kPrefetchVerifyRows = !(kKind == KeyKind::kFp8 && V.n_tiles == 4);
  if (kPrefetchVerifyRows && q_16bit && p.verify.query_start_loc != nullptr) {
#pragma unroll
    for (int r = 0; r < kQRows; ++r) {
      const int head = warp + r * kW;
      if (head >= Config::kQueryHeads || head >= group) continue;
      const int64_t row = RowOfColumn(p.verify, span, p.num_q_heads, p.num_kv_heads, b, h, head);
      if (row >= 0) prefetch_query_row(r, row);
    }
    q_prefetched_rows = kQRows;
  }

  // Query fragments (B operand of the score MMA): head 8·nt + g. The compressed kinds carry q as
  // fp16 hi + lo parts (q ≈ hi + lo to ~2^-22), one MMA chain each, and the codebook kinds the
  // centroids as hi + lo rows of the A operand, so scores keep fp32 accuracy. The plain kinds use
  // the query rounded to the cache's type (exact for a query of that type).
  constexpr int kQParts = Config::kQParts;
  uint32_t qf[kQParts][Config::kFragTiles][kKSteps][2];
  const SplitPrologue<V> finish_prologue{
      p,       unit,  span,   warp,    lane,    b,     h,
      group,   q_pre, q_sign, entries, num_ids, ids_s, q_prefetched_rows,
      ids_pre, g,     t,      qf};

  if constexpr (V.shared_o) {  // the warps share one output: decode_split_shared.cuh
    const typename SharedOSplit<V>::Frame frame{p, begin, end,   lane,      warp,  g,          t, h,
                                                b, group, split, lane_word, table, block_shift};
    SharedOSplit<V>::Run(frame, first_block_ids, finish_prologue);
  } else {
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

    // Per-thread byte offsets within a block (block_bytes < 2^31), computed once; per chunk only
    // the block pointer and the position change.
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
          ck.kg[4 * j] = a.x, ck.kg[4 * j + 1] = a.y;
          ck.kg[4 * j + 2] = a.z, ck.kg[4 * j + 3] = a.w;
          ck.k8[4 * j] = c.x, ck.k8[4 * j + 1] = c.y;
          ck.k8[4 * j + 2] = c.z, ck.k8[4 * j + 3] = c.w;
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
    // (Full chunks only: no masks, so end0 is not read.)
    const SplitCompute<V> compute{p, begin, end, end, g, t, lane_word, qf, acc, m, m_thr, l, z};

    // Chunks that every column sees whole in turn over the warps; the split's last chunks (a
    // partial one, a verify pass's causal part) separately, so that only they pay for the masks.
    const int num_full = max(0, min(end, span.end0) - begin) / kChunk;
    // block_of(warp + k·kW, num_full) for the chunks read in the prologue (k < kStages).
    auto first_block = [&](int k) { return warp + k * kW < num_full ? first_block_ids[k] : 0; };
    const SplitPipelineFrame frame{
        p,          lane,       g,        t,           warp,         cta_warp,
        h,          begin,      num_full, block_shift, stride_token, head_off,
        value_base, meta_field, id0,      ids_s};
    using Pipelines = SplitPipelines<V>;
    if constexpr (Traits::kPlain && kStaged) {
      Pipelines::PlainStaged(frame, first_block, block_of, finish_prologue, compute);
    } else if constexpr (Traits::kPlain) {
      Pipelines::PlainRegisters(frame, first_block, block_of, finish_prologue, load, compute);
    } else if constexpr (kStaged) {
      Pipelines::Staged(frame, lane_word, first_block, block_of, finish_prologue, compute);
    } else {
      Pipelines::Registers(frame, first_block, block_of, finish_prologue, load, compute);
    }
    // The span, a window's origin and its columns' first positions again (not held in registers
    // through the loop), relative to the origin: the first column's (lo) and, for a verify
    // pass's column of new token i, end0 − window + i (SplitCompute::lo_end0).
    const ColumnSpan unshifted = SpanOfColumns(p.verify, p.seq_lens, b);
    const int tail_origin = WindowOrigin(WindowLo(unshifted.len, p.window), p.block_size);
    const int lo = WindowLo(unshifted.end0, p.window) - tail_origin;
    const ColumnSpan last = ShiftSpan(unshifted, tail_origin);
    const int lo_end0 = p.window > 0 ? last.end0 - p.window : kNoWindowStart;
    const SplitCompute<V> masked{p,   begin, end,   last.end0, g, t,  lane_word, qf,
                                 acc, m,     m_thr, l,         z, lo, lo_end0};
    // (end < begin only in split 0 of a window whose origin lies past the sequence's end.)
    const int num_chunks = max(0, end - begin + kChunk - 1) / kChunk;
    // First, in split 0 of a sliding window whose first position is not at its origin, the
    // chunks before the origin from the one holding that position on (c < 0; their blocks hold
    // positions of the window, so they are live), masked below it; then the split's last chunks.
    static_assert((kW & (kW - 1)) == 0);
    const int head_chunks = split == 0 && lo < 0 ? (kChunk - 1 - lo) / kChunk : 0;
#pragma unroll 1
    for (int c = head_chunks > 0 ? -head_chunks : num_full; c < num_chunks;
         c = c == -1 ? num_full : c + 1) {
      if ((c & (kW - 1)) != warp) continue;
      Chunk tail;
      load(c, tail, block_of(c, c + 1));
      masked.template operator()<true>(c, tail);
    }

    // The merge grid (or, without one, the next kernel) may start; it waits for this grid to finish
    // before it reads anything. Not when the next kernel may be a split grid smaller than the SMs'
    // room (p.trigger_dependents = 0): CTAs launched while this grid's last ones still ran were
    // placed next to them, two on some SMs, and a one-wave grid is as slow as its slowest SM
    // (batch 1 × 32k: 20.5 -> 27 µs with the merge's early trigger, measured); then the next
    // kernel is launched when every CTA of this grid has exited.
    if (p.trigger_dependents) LaunchDependents();

    SplitEpilogue<V>::MergeWarps(p, last, acc, m, l, z, g, t, cta_warp, b, h0, group, split);
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
