// Attention of a step's new tokens on a CUDA device (attention/attention.h): decode rows, verify
// rows and prefill chunks in one call, over a TurboQuant cache (every preset) or a bf16/fp16 one.
// Plan on the host, run on the device:
//
//   CudaAttention attention(quantizer);                 // once: uploads Πᵀ and the codebook
//   AttentionPlan plan = attention.Plan(B, T, Hq, max_blocks, max_q_len);   // host only
//   attention.Run(plan, args, stream);                  // never allocates; graph-capturable
//
// Which kernels run which rows (AttentionPlan's fields say what a plan chose):
// - One new token per sequence (max_q_len 1, or AttentionOptions::leading_decode_seqs =
//   num_seqs): the decode kernels (attention/decode_cuda.h). Under a sliding window they read
//   from the 16-token chunk holding the window's first position.
// - Few new tokens per sequence (speculative verify, AttentionOptions::verify_max_q_len): the
//   decode kernels too. The new tokens ride beside the GQA heads as decode columns (up to 16 per
//   KV head and pass; 32 on 4bit_nc, k3v4_nc, 3bit_nc and k8v4 at head_dim 128 in half
//   precision; 8 on the compressed caches at head_dim 256), each column over the context up to
//   its own token (causal masks in its last chunks), one split grid per pass. Wide passes run in
//   half precision (AttentionOptions::verify_precision); under a sliding window each column reads
//   its own token's window.
// - A mixed call's one-token and verify rows: on the decode kernels as above, in place where the
//   caller says they come first (AttentionOptions::leading_decode_seqs, ::leading_max_q_len), else
//   (one-token rows) gathered and scattered back; the other sequences on the kernels below.
// - Chunks of 16 query rows (new tokens × GQA heads) or more per sequence at head_dim 64 or 128:
//   the prefill kernel in half precision (attention/attention_prefill.cuh: 128 rows per CTA, one
//   MMA per product; from 16 rows on it beat the chunk kernel 1.1-3x at 64 × 4k and 1 × 128k on
//   the H200, its tiles mostly empty), unless AttentionOptions::chunk_precision asks for kExact.
// - Everything else: the chunk kernel (attention/attention_kernel.cuh: 16 to 64 rows per CTA,
//   fp32-level scores).
// The chunk and prefill kernels read KV tiles dequantized into shared memory, split over the
// context where the grid would not fill the device (ChooseChunkSplits), then merge the splits by
// their log-sum-exp. The workspace holds no dequantized cache and nothing that grows with the
// context: q·Πᵀ for MSE keys (not where the kernels rotate the query themselves: a Hadamard Πᵀ on
// the wgmma prefill kernel and the decode kernels) and, with splits, the partial outputs of the
// step's rows.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "attention/attention.h"
#include "attention/decode_cuda.h"
#include "quant/block_format.h"
#include "quant/quantizer.h"
#include "runtime/device.h"

namespace tqkv {

// The numerics of several new tokens per sequence: long chunks (prefill, prefix-hit continuations:
// more than 64 query rows — new tokens × GQA heads — per sequence, head_dim 64 or 128) and verify
// passes (AttentionOptions::chunk_precision, ::verify_precision).
enum class ChunkPrecision : uint8_t {
  // The prefill kernels (attention/attention_prefill.cuh, attention_prefill_wgmma.cuh): one MMA
  // per product, the query, the keys and P rounded once to fp16 (bf16 for a bf16 cache), as
  // FlashAttention computes: about 2^-11 relative per operand (bf16: 2^-8). On Hopper at
  // head_dim 128 the compressed caches are dequantized to fp16 keys and values (rounded once)
  // as FlashAttention over an fp16 cache would read them.
  kHalf,
  // The chunk kernel's fp32-level scores and P (hi and lo parts), the decode kernels' numerics, at
  // about 2.5x the MMAs (verify passes: 3x).
  kExact,
};

struct AttentionOptions {
  // Context tokens per split of the chunk and prefill kernels: 0 lets the plan choose
  // (ChooseChunkSplits); otherwise a multiple of 64 up to CudaAttention::kMaxContextTokens
  // (tuning, benchmarks, tests).
  int tokens_per_split = 0;
  // false: never the decode kernels, the chunk kernel for one-token plans too.
  bool decode_kernels = true;
  // Calls whose sequences have at most this many new tokens each (speculative verify) run every
  // query row on the decode kernels, as a sequence of its own whose context ends at the row's
  // position; so do calls with more whose new tokens all fit one pass (max_q_len · group up to
  // the columns of verify_max_group; 0: never). -1, the default: the plan's choice, 16 at
  // head_dim 64 where that takes at most 4 passes on the compressed caches (SmolLM2's GQA 3: 5
  // new tokens per pass) or 2 on the bf16 / fp16 caches (10 per pass), 16 at head_dim 128 where
  // that takes at most 2 passes on 4bit_nc, k3v4_nc and 3bit_nc (GQA 4: 8 per pass), else 8.
  int verify_max_q_len = -1;
  // The most decode columns (new tokens × GQA heads, per KV head) one verify pass puts beside each
  // other, 1 to 32 (16 at most but on the half-precision kernels and the bf16 / fp16 caches'
  // staged kernel at head_dim 64 and 128: CudaDecoder::MaxGroup; 8 on the compressed caches at
  // head_dim 256, whose 9-16-column kernel is slower per column): a call of q_len new tokens per
  // sequence runs ceil(q_len / rows) passes of rows = max(1, columns / group) tokens, each reading
  // the cache once.
  int verify_max_group = 32;
  // The decode kernels' choices, where they run. decode.sliding_window: the window Run will be
  // given (AttentionArgs::sliding_window, 1 to it) where the plan runs rows on the decode kernels
  // (a one-token or verify plan, a mixed call's one-token or leading rows), so that their splits
  // are sized for the tokens the window reads rather than for max_blocks_per_seq's (batch 1 ×
  // 32k under a window of 4,000: 16 CTAs per KV head instead of 2 with tokens).
  DecodeOptions decode;
  ChunkPrecision chunk_precision = ChunkPrecision::kHalf;
  // The numerics of verify passes (verify_max_q_len) on 4bit_nc and k3v4_nc caches at head_dim
  // 128 and 64, and 3bit_nc, wherever a pass has more than 4 decode columns per KV head, and on
  // k8v4 caches at head_dim 128 wherever it has more than 8 (the shared-output kernel):
  // kHalf runs the decode
  // kernels' half-precision variant (DecodeOptions::half: one MMA per product, the query, the
  // centroids and P rounded once to fp16; a third of the hi + lo kernel's MMAs), kExact the
  // decode's fp32-level numerics. Other caches and head dims, passes of up to 4 columns and
  // decode.staged = false keep the decode kernels' numerics either way. Sets decode.half for the
  // verify passes' decode plan.
  ChunkPrecision verify_precision = ChunkPrecision::kHalf;
  // How many sequences at the front of the batch have exactly one new token each, where the
  // caller knows it (vLLM orders a step's decodes first: its num_decodes). A mixed call then runs
  // those rows on the decode kernels where they lie (no gather, no scatter) and launches the
  // chunk or prefill kernel's tiles for the other sequences only, which start on the SMs the
  // decode leaves (a programmatic dependent launch; not for one-token rows under a dense Πᵀ,
  // whose decode runs a query prep of its own first); 0: the one-token sequences are found on the
  // device. 0 to num_seqs; Run's arrays must agree (query_start_loc[b] = b up to it).
  int leading_decode_seqs = 0;
  // The most new tokens each of those leading sequences has (1, the default: exactly one each).
  // More: they are verify rows (vLLM's decodes with draft tokens, up to its
  // reorder_batch_threshold), 1 to leading_max_q_len new tokens each, and where that is at most
  // the plan's verify limit (verify_max_q_len or the plan's choice of it) they run as verify
  // passes in place beside the chunk or prefill kernel's tiles for the others, as one-token rows
  // do; past it every sequence runs on the chunk or prefill kernel. A call of leading sequences
  // alone (leading_decode_seqs = num_seqs) is planned as any call of few new tokens.
  int leading_max_q_len = 1;
  // Whether the prefill kernel may take long chunks' own tiles dequantized once into the
  // workspace (AttentionPlan::prefill_tiles; the same values its producers would write): less
  // time, more workspace (32 KB per 64 new tokens and KV head, not growing with the context
  // before the chunk). false: every row tile dequantizes the tiles it reads.
  bool prefill_tiles = true;
};

// AttentionOptions for a step whose decoding sequences come first (as vLLM and model::Server
// order a step): the leading run of sequences with 1 to max_leading_q_len new tokens each (one
// token, or one plus its drafts) as leading_decode_seqs, the most new tokens among them as
// leading_max_q_len (1 where the run is empty); the other options as given. query_start_loc: the
// step's num_seqs + 1 offsets on the host. max_leading_q_len: CudaAttention::MaxLeadingQLen for
// the layer (past the plan's limit none of the leading rows would run in place); 16, the
// default, is the most the plan ever takes. Throws InvalidArgument for max_leading_q_len < 1 or a
// query_start_loc of fewer than 1 entry.
AttentionOptions WithLeadingSequences(AttentionOptions options,
                                      std::span<const int32_t> query_start_loc,
                                      int max_leading_q_len = 16);

struct AttentionPlan {
  int num_seqs = 0;
  int num_tokens = 0;
  int num_q_heads = 0;
  int max_blocks_per_seq = 0;
  int max_q_len = 0;
  // One new token per sequence: the decode kernels (under a sliding window too).
  bool decode = false;
  // A mixed call (some sequences of one new token, some of more): those of one token run on the
  // decode kernels (gathered, decoded, scattered back; under a sliding window too), the others on
  // the chunk kernel.
  bool decode_rows = false;
  // A mixed call whose first leading_decodes sequences have one new token each
  // (AttentionOptions::leading_decode_seqs): those run on the decode kernels in place, the chunk
  // or prefill kernel's grid covers the others (decode_plan.overlap_next: launched as the decode's
  // programmatic dependent), under a sliding window too. leading_max_q_len > 1
  // (AttentionOptions::leading_max_q_len): they have 1 to that many each and run as verify_passes
  // passes of verify_pass_rows (below) in place.
  int leading_decodes = 0;
  int leading_max_q_len = 0;
  // Few new tokens per sequence (max_q_len up to options.verify_max_q_len, or the plan's choice of
  // it): the decode kernels in passes of verify_pass_rows new tokens per sequence beside the GQA
  // heads (a decode of group verify_pass_rows · G, each column over the context up to its own
  // token).
  bool verify_rows = false;
  int verify_pass_rows = 0;
  int verify_passes = 0;
  DecodePlan decode_plan;  // decode, decode_rows or verify_rows
  // Long chunks in half precision (ChunkPrecision::kHalf): the prefill kernel, 128 query rows per
  // CTA, in place of the chunk kernel (row_warps unused).
  bool prefill = false;
  // The prefill kernel rotates the query itself (a Hadamard rotation on the wgmma kernel: the
  // compressed MSE kinds at head_dim 128 on compute capability 9.0), so no q·Πᵀ of every row is
  // computed before it and the workspace holds none.
  bool prefill_rotates = false;
  // The prefill kernel takes the tiles of long chunks' own tokens dequantized once, into the
  // workspace, rather than dequantizing each for every row tile (the wgmma kernel, every kind;
  // sequences of 256 new tokens or more after at most 4x as many cached ones, found on the
  // device): 32 KB per 64 new tokens and KV head, plus 64 KB per 256 new tokens (or per sequence,
  // if fewer) and KV head, whatever the context before the chunk.
  bool prefill_tiles = false;
  // The chunk kernel: 16 · row_warps query rows per CTA (1, 2 or 4); row-tile slots per KV head
  // (every sequence's tiles, and one slot each more), context tokens per split, splits.
  int row_warps = 4;
  int row_tiles = 0;
  // The CTAs' order: every KV head's first (longest, causal) tiles first where the grid is a few
  // waves of CTAs whose lengths differ (a chunk longer than half its context); otherwise head by
  // head (measured faster for chunks after a long prefix).
  bool heads_fastest = false;
  int tokens_per_split = 0;
  int max_splits = 0;
  int64_t workspace_bytes = 0;
};

// How CudaAttention::Plan splits each sequence's context over CTAs for the chunk and prefill
// kernels where AttentionOptions::tokens_per_split is 0 (host arithmetic, so that tests check it
// without a device). A split's CTA costs its query load, pipeline fill and partial output
// whatever its length, so the context is split only while the CTAs of all splits fit one wave of
// two per SM, and while each split keeps 256 context tokens (1,024 on the prefill kernel).
struct ChunkCall {
  int64_t max_len = 0;     // the longest context: max_blocks_per_seq · block_size
  int64_t num_tokens = 0;  // new tokens of the call
  int max_q_len = 1;       // the most new tokens of one sequence
  int group = 1;           // query heads per KV head
  int num_kv_heads = 1;
  int cta_rows = 16;     // query rows (new tokens × GQA heads) per CTA
  bool prefill = false;  // the prefill kernel (else the chunk kernel)
};
struct ChunkSplits {
  int tokens_per_split = 0;  // a multiple of 64
  int splits = 1;            // ceil(max_len / tokens_per_split): 1 to kMaxChunkSplits
};
inline constexpr int kMaxChunkSplits = 64;
// The CTAs with rows in one split: the new tokens packed into as few row tiles as possible, and
// a tile of its own for each of the at least num_tokens / max_q_len sequences with new tokens (a
// CTA holds one sequence's rows), for every KV head.
int64_t ChunkBusyCtas(const ChunkCall& call);
ChunkSplits ChooseChunkSplits(const ChunkCall& call, int sm_count);

class CudaAttention {
 public:
  explicit CudaAttention(const Quantizer& quantizer);
  // For an uncompressed cache of format.dtype elements (BF16 or F16; anything else throws).
  explicit CudaAttention(const Bf16BlockFormat& format);
  ~CudaAttention();
  CudaAttention(CudaAttention&&) noexcept;
  CudaAttention& operator=(CudaAttention&&) noexcept;

  int head_dim() const;
  int num_kv_heads() const;
  int block_size() const;
  // The layout its calls' caches must have (CacheRef::layout).
  const CacheLayout& layout() const;

  // The longest context a plan takes (max_blocks_per_seq · block_size), and the longest split:
  // 2^29 tokens, so that a split's end, its first position plus its length, stays within int32.
  static constexpr int64_t kMaxContextTokens = int64_t{1} << 29;
  // The most sequences one call may have (a grid dimension).
  static constexpr int kMaxSeqs = 65535;

  // Host only. max_q_len bounds every sequence's query length (query_start_loc[b + 1] −
  // query_start_loc[b]); Run reads no more rows per sequence than that. Throws tqkv::Error for
  // num_seqs outside 1..65535, num_tokens < 1, a num_q_heads that is not a multiple of
  // num_kv_heads, max_blocks_per_seq · block_size past kMaxContextTokens, max_q_len outside
  // 1..min(num_tokens, max_blocks_per_seq · block_size), more tokens than the leading one-token
  // sequences and max_q_len allow, or options out of range (options.decode's too).
  AttentionPlan Plan(int num_seqs, int num_tokens, int num_q_heads, int max_blocks_per_seq,
                     int max_q_len, const AttentionOptions& options = {}) const;

  // Validates the arguments against the plan (throws tqkv::Error, nothing launched) and launches
  // on `stream`: ValidateAttentionShapes (outputs over the cache or any input too), the query,
  // output and lse aligned to their elements, the cache and workspace to 16 bytes, a scale whose
  // fp32 score scale is finite. The per-sequence arrays are device memory and are not read on the
  // host: they must hold what ValidateAttentionArrays accepts, with query lengths up to
  // plan.max_q_len (a one-token plan: query_start_loc[b] = b).
  void Run(const AttentionPlan& plan, const AttentionArgs& args, StreamHandle stream) const;

  // A debugging aid for engines, not for the step loop: copies the call's per-sequence arrays
  // from the device (synchronizing `stream` after the copies) and throws tqkv::Error, naming the
  // entry, where they break Run's contract: ValidateAttentionArrays (query starts, lengths, the
  // block ids each sequence reads), query lengths up to plan.max_q_len, one new token per
  // sequence for a one-token plan and for the plan's leading decode sequences. Run itself never
  // reads the arrays on the host (they may not exist there yet, as in a captured graph).
  void CheckArrays(const AttentionPlan& plan, const AttentionArgs& args, StreamHandle stream) const;

  // The most new tokens per leading sequence that Plan runs as verify passes in place
  // (AttentionOptions::leading_max_q_len) with num_q_heads query heads and these options, where
  // the decode kernels take the contexts; 1 where it runs none. WithLeadingSequences' limit.
  int MaxLeadingQLen(int num_q_heads, const AttentionOptions& options = {}) const;

 private:
  // Run's device paths: verify passes on the decode kernels, and the chunk or prefill kernel with
  // the call's one-token rows on the decode kernels.
  void RunVerify(const AttentionPlan& plan, const AttentionArgs& args, StreamHandle stream) const;
  void RunChunk(const AttentionPlan& plan, const AttentionArgs& args, StreamHandle stream) const;
  // The workspace a plan needs on this instance (Plan's workspace_bytes; Run checks it again).
  int64_t WorkspaceBytes(const AttentionPlan& plan) const;
  // The verify passes' columns per pass and the most new tokens per sequence they take
  // (verify_max_q_len, or the plan's choice of it) at GQA `group` with these options.
  std::pair<int, int> VerifyLimits(int group, const AttentionOptions& options) const;

  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace tqkv
