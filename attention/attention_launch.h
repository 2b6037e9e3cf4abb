// Device-side interface of the attention kernels for several new tokens per sequence
// (attention/attention_kernel.cuh): plain parameter structs and launch functions that return the
// launch status. Included by the kernel files and by the host launcher (attention_cuda.cc) in CUDA
// builds only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode_variant.h"
#include "runtime/dtype.h"

namespace tqkv::attention_detail {


// The most query rows per CTA (4 warps × 16 rows of the MMAs; ChunkParams::row_warps picks 16, 32
// or 64) and the tokens of one KV tile by head_dim (the tile's dequantized keys, hi and lo parts,
// and values live in shared memory).
inline constexpr int kRowsPerCta = 64;
inline constexpr int kWarps = 4;
// The prefill kernel's query rows per CTA (attention/attention_prefill.cuh: 4 warps × 32 rows).
inline constexpr int kPrefillRows = 128;
constexpr int KvTile(int head_dim) { return head_dim == 256 ? 32 : 64; }

// ChunkParams::tiles: a sequence of at least kPrefillTilesMinQLen new tokens after at most
// kPrefillTilesMaxPrefix times as many cached ones has the tiles of its own tokens dequantized
// once (PrefillTilesFor), in tile_slots = num_tokens / 64 + 2 · min(num_seqs, num_tokens / 256)
// slots of kPrefillTileBytes per KV head. Fewer new tokens: too few row tiles read each tile for
// a dequantization of their own to pay. A longer prefix: the chunk's tiles are few of what each
// row tile reads, and their 32 KB each take L2 from the prefix's raw tiles (H200, 2,048 new
// tokens after 32k: +1.6 % on 4bit_nc with them).
inline constexpr int kPrefillTilesMinQLen = 256;
inline constexpr int kPrefillTilesMaxPrefix = 4;
inline constexpr int64_t kPrefillTileBytes = 32768;
inline constexpr bool PrefillTilesFor(int q_len, int prefix) {
  return q_len >= kPrefillTilesMinQLen && prefix <= kPrefillTilesMaxPrefix * q_len;
}
// The slots of ChunkParams::tiles per KV head for a call of `tokens` new tokens in `seqs`
// sequences, and the CTAs per KV head of their dequantization, `seqs` there counting the
// sequences after the leading one-token rows (a sequence of q_len new tokens has q_len / 64 + 2
// of them: from query_start_loc[b] / 64 + 2 · b on, b counted after those rows).
inline constexpr int64_t PrefillTileSlots(int64_t tokens, int64_t seqs) {
  return tokens / 64 + 2 * (seqs < tokens / 256 ? seqs : tokens / 256);
}
inline constexpr int64_t PrefillTileGrid(int64_t tokens, int64_t seqs) {
  return tokens / 64 + 2 * seqs;
}
// A sequence's first slot, given its first new token's place in the call (query_start_loc[b]) and
// how many sequences before it take tiles: those have at least kPrefillTilesMinQLen new tokens
// each, and each reaches into at most q_len / 64 + 2 tiles (PrefillTilesOf), so no two overlap
// and the last ends within PrefillTileSlots (PrefillTileSlotsHoldEveryCall checks it).
inline constexpr int PrefillFirstTileSlot(int q_start, int takers_before) {
  return q_start / 64 + 2 * takers_before;
}
// The tiles a sequence's new tokens reach into: from the one holding its first to the one holding
// its last (q_len >= 1).
inline constexpr int PrefillTilesOf(int q_len, int prefix) {
  return (prefix + q_len - 1) / 64 - prefix / 64 + 1;
}
// The first dequantization CTA of sequence b (PrefillTileGrid), and the sequence whose CTAs hold
// CTA x: the last b with PrefillFirstTileCta(b) <= x, or -1 for an x before the first
// sequence's (leading one-token rows before the kernel's sequences put its query_start_loc[0]
// past 63). CTA x then dequantizes the sequence's tile x - PrefillFirstTileCta(b) counted from
// the one holding its first new token (past its last: nothing).
inline constexpr int PrefillFirstTileCta(const int32_t* query_start_loc, int b) {
  return query_start_loc[b] / 64 + 2 * b;
}
inline constexpr int PrefillTileSequence(const int32_t* query_start_loc, int num_seqs, int x) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (PrefillFirstTileCta(query_start_loc, mid) <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return PrefillFirstTileCta(query_start_loc, lo) <= x ? lo : -1;
}

struct ChunkParams {
  const uint8_t* cache = nullptr;            // [num_blocks, block_bytes]
  const int32_t* block_tables = nullptr;     // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens = nullptr;         // [num_seqs]
  const int32_t* query_start_loc = nullptr;  // [num_seqs + 1]
  // [num_tokens, num_q_heads, head_dim] in query_dtype: the caller's query, or for MSE keys the
  // query prep's fp32 q·Πᵀ.
  const void* query = nullptr;
  DType query_dtype = DType::kF32;
  // Non-zero: `query` is the caller's, and the kernel rotates it itself, y = FWHT(q ⊙ signs) ·
  // query_scale (a Hadamard Πᵀ; signs null for plain Hadamard). Only the wgmma prefill kernel
  // does (PrefillRotatesQuery); every other launch refuses it.
  int query_fwht = 0;
  const float* query_signs = nullptr;  // [head_dim] ±1, or null
  float query_scale = 1.0f;            // 1/√D
  // MSE keys: the 2^key_bits centroids as fp16 hi and lo parts (centroid = hi + lo to ~2^-22).
  uint16_t centroid_hi[16] = {};
  uint16_t centroid_lo[16] = {};
  // max_splits == 1: the final output [num_tokens, num_q_heads, head_dim] in out_dtype and lse;
  // otherwise partials [num_tokens · num_q_heads, max_splits, head_dim] and [.., max_splits].
  void* output = nullptr;
  float* lse = nullptr;
  DType out_dtype = DType::kF32;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  int num_seqs = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int block_size = 0;
  int max_blocks_per_seq = 0;
  int64_t block_bytes = 0;
  int64_t meta_offset = 0;  // compressed: start of the fp16 metadata; plain: value_offset
  int data_per_slot = 0;    // compressed only
  int key_data_bytes = 0;   // compressed only
  int num_meta = 0;         // compressed only
  int row_warps = 4;        // 1, 2 or 4 (not 1 at head_dim 256): 16 · row_warps rows per CTA
  int row_tiles = 0;        // row-tile slots (FindRowTile) per KV head: grid.x / max_splits
  int tokens_per_split = 0;  // a multiple of the KV tile
  int max_splits = 0;
  int sliding_window = 0;
  float score_scale = 0.0f;  // softmax scale · log2(e)
  // The grid's order (SlotOfBlock): 0 by KV head; 1 every head's longest tiles first (AttentionPlan::
  // heads_fastest).
  int heads_fastest = 0;
  // Leave sequences of one new token alone (a mixed call runs them on the decode kernels).
  int skip_single = 0;
  // Host: launch as a programmatic dependent of the kernel before it in the stream, the decode of
  // the call's leading rows (DecodePlan::overlap_next), which writes nothing this kernel reads:
  // its CTAs take the SMs as the decode's leave. Every kernel of this family waits for the grid
  // before it (GridDependencyWait, a no-op in an ordinary launch) only before its CTAs exit, so
  // that its completion still implies the decode's for the kernels after it.
  int programmatic = 0;
  // The wgmma prefill kernel (AttentionPlan::prefill_tiles): the 64-token tiles of a long chunk's
  // own tokens, from the tile holding its first new token on, dequantized once into the stages'
  // layout, [num_kv_heads][tile_slots][32 KB] (attention_prefill_wgmma.cuh, FirstTileSlot), and
  // copied into its stages rather than dequantized by every row tile; null: none. With
  // `tiles_pass` LaunchPrefillAttention launches their dequantization instead of the attention,
  // tile_grid = num_tokens / 64 + 2 · num_seqs CTAs per KV head.
  uint8_t* tiles = nullptr;
  int tile_slots = 0;
  int tile_grid = 0;
  int tiles_pass = 0;
};

struct ChunkMergeParams {
  const float* partial_out = nullptr;  // [rows, max_splits, head_dim]
  const float* partial_lse = nullptr;  // [rows, max_splits]
  void* output = nullptr;              // [rows, head_dim] in out_dtype
  float* lse = nullptr;                // [rows]
  DType out_dtype = DType::kF32;
  int rows = 0;  // num_tokens · num_q_heads
  int head_dim = 0;
  int max_splits = 0;
  // Where set (a mixed call's leading verify rows, whose count only the device knows): the rows
  // above hold global rows row0 on, and those before skip_before[0] · num_q_heads (written by the
  // decode kernels) are left alone.
  const int32_t* skip_before = nullptr;
  int64_t row0 = 0;
  int num_q_heads = 0;
};

// A mixed call's one-token sequences on the decode kernels: GatherDecodeRows writes, per sequence,
// its query row (q_len 1) or zeros into query [num_seqs, num_q_heads, head_dim] F32 and its length
// (q_len 1) or 0 into seq_lens, and marks those rows' split partials empty (lse −inf) so that the
// chunk merge leaves them alone; ScatterDecodeRows copies the decode's rows to their places in the
// call's output and LSE (after the chunk kernel and its merge).
struct DecodeRowsParams {
  const int32_t* query_start_loc = nullptr;  // [num_seqs + 1]
  const int32_t* seq_lens = nullptr;         // [num_seqs]
  const void* query = nullptr;               // the call's [num_tokens, num_q_heads, head_dim]
  DType query_dtype = DType::kF32;
  float* gathered_query = nullptr;  // [num_seqs, num_q_heads, head_dim]
  int32_t* gathered_lens = nullptr;  // [num_seqs]
  float* partial_lse = nullptr;      // the chunk kernel's [num_tokens · num_q_heads, max_splits] or null
  int max_splits = 0;
  const float* decode_out = nullptr;  // [num_seqs, num_q_heads, head_dim]
  const float* decode_lse = nullptr;  // [num_seqs, num_q_heads]
  void* output = nullptr;             // the call's output in out_dtype, and LSE
  float* lse = nullptr;
  DType out_dtype = DType::kF32;
  int num_seqs = 0;
  int num_q_heads = 0;
  int head_dim = 0;
};
cudaError_t LaunchGatherDecodeRows(const DecodeRowsParams& p, cudaStream_t stream);

cudaError_t LaunchScatterDecodeRows(const DecodeRowsParams& p, cudaStream_t stream);

// The chunk kernel of (kind, value_bits, head_dim) on grid row_tiles · max_splits · num_kv_heads; cudaErrorInvalidValue for a combination that has none.
cudaError_t LaunchChunkAttention(KeyKind kind, int value_bits, int head_dim, const ChunkParams& p,
                                 cudaStream_t stream);
cudaError_t LaunchChunkMerge(const ChunkMergeParams& p, cudaStream_t stream);

template <KeyKind kKind>
cudaError_t LaunchChunkOfKind(int value_bits, int head_dim, const ChunkParams& p,
                              cudaStream_t stream);

// The prefill kernel (half precision, 128 rows per CTA; head_dim 64 and 128) on the chunk
// kernel's grid and parameters (row_warps unused); cudaErrorInvalidValue where it has none.
cudaError_t LaunchPrefillAttention(KeyKind kind, int value_bits, int head_dim,
                                   const ChunkParams& p, cudaStream_t stream);

// Whether LaunchPrefillAttention(kind, value_bits, head_dim, p) runs the wgmma kernel on the
// current device (the compressed MSE kinds at head_dim 128 on compute capability 9.0, for their
// slot layouts and blocks of whole 8-token groups), which can rotate the query itself
// (ChunkParams::query_fwht). Reads only p's cache-layout fields.
bool PrefillRotatesQuery(KeyKind kind, int value_bits, int head_dim, const ChunkParams& p);

// Whether LaunchPrefillAttention(kind, value_bits, head_dim, p) runs the wgmma kernel on the
// current device (every kind at head_dim 128 on compute capability 9.0, for the slot layouts it
// was built for and blocks of whole 8-token groups), which can take dequantized tiles
// (ChunkParams::tiles). Reads only p's cache-layout fields.
bool PrefillTakesTiles(KeyKind kind, int value_bits, int head_dim, const ChunkParams& p);
template <KeyKind kKind>
bool PrefillTakesTilesOfKind(int value_bits, int head_dim, const ChunkParams& p);

template <KeyKind kKind>
cudaError_t LaunchPrefillOfKind(int value_bits, int head_dim, const ChunkParams& p,
                                cudaStream_t stream);

}  // namespace tqkv::attention_detail
