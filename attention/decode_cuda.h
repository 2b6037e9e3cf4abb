// Decode attention on a CUDA device over a paged cache: TurboQuant SoA blocks (all four presets)
// or uncompressed bf16 or fp16 blocks (Bf16BlockFormat, its dtype). Plan on the host, run on the
// device:
//
//   CudaDecoder decoder(quantizer);                         // once: uploads Πᵀ and the codebook
//   DecodePlan plan = decoder.Plan(B, Hq, max_blocks);      // host only: split layout, workspace
//   decoder.Run(plan, args, stream);                        // never allocates; graph-capturable
//
// Run launches on `stream` the split-KV attention kernel (one CTA per split × KV head × sequence,
// serving all query heads of the group) and, when the plan has more than one split per sequence,
// the log-sum-exp merge of the splits (by programmatic dependent launch: it may start while the
// split grid finishes); with one split (max_splits == 1) the split kernel writes the output
// itself. The query rotation q·Πᵀ is done once per CTA in the split kernel's prologue for the
// Hadamard rotations (a fast Walsh-Hadamard transform of the group's rows, with the random signs
// of hadamard_signs); a dense Πᵀ (haar, custom) gets one more launch before the split kernel,
// which computes q·Πᵀ for every query head once per step. The split kernel is itself launched
// as a programmatic dependent of whatever kernel precedes it in the stream (an engine's store,
// the previous step's merge): its launch overlaps that kernel's tail, and it waits for that
// kernel to finish before it reads or writes anything. The plan picks the split kernel
// (decode_detail::SplitVariant, attention/decode_variant.h); DecodeOptions lets benchmarks force
// the alternatives.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

#include "attention/decode_variant.h"
#include "quant/block_format.h"
#include "quant/quantizer.h"
#include "runtime/device.h"
#include "runtime/dtype.h"

namespace tqkv {

namespace decode_detail {
struct VerifyColumns;  // attention/decode_launch.h
}  // namespace decode_detail
class CudaAttention;

// How a split kernel occupies an SM, as CudaDecoder::Plan's cost model sees it.
struct SplitKernelOccupancy {
  int resident_per_sm = 1;  // CTAs of it that fit on one SM (occupancy query)
  bool staged = false;      // chunks copied ahead through shared memory (decode_split_kernel.cuh)
  bool bf16 = false;        // the uncompressed kernel
  // 4-warp units of its narrow variant that fit on one SM (k3v4_nc: 4-warp CTAs, or their paired
  // 8-warp CTAs of two units, D = 128 only; 4bit_nc: paired CTAs only, so an even number of KV
  // heads; the half-precision kernels of GQA groups 9-32: 4-warp CTAs, two per SM, three at
  // D = 64; 4bit_nc at D = 64, groups 9-16, exact: 4-warp CTAs, three per SM), 0 where there is
  // none.
  int narrow_resident_per_sm = 0;
  // The 8-warp staged kernel of 3-bit keys has a twin that computes scores from the codebook's
  // scaled fp16 hi parts alone (attention/codebook_fp16.h), and this codebook is close enough to
  // fp16 for it.
  bool hi_only = false;
  // The narrow layout can run on that twin's paired CTAs (two KV heads' 4-warp units per 8-warp
  // CTA): hi_only, a narrow variant (GQA groups 1-4) and an even number of KV heads.
  bool narrow_hi_only = false;
  // Where non-zero (4bit_nc: its narrow layout runs on paired exact CTAs), the narrow variant only
  // for sequences of at most this many tokens, and only where the 8-warp kernel's grid would
  // need a second round of CTA pairs: measured faster than the 8-warp kernel there and slower
  // over 8,192-token splits and at one round (ChooseSplitLayout).
  int64_t narrow_max_len = 0;
  // The 8-warp staged kernel of 4-bit keys at D = 128 has a twin compiled for one CTA per SM
  // (more registers; DecodeOptions::one_cta_twin).
  bool one_cta_twin = false;
  // The narrow variant is the half-precision kernels' (4-warp CTAs, two per SM, three at D = 64;
  // its tokens cost
  // more than the 8-warp kernel's: ChooseSplitLayout's kHalfNarrowCost).
  bool narrow_half = false;
};

// The kernel choices of a plan. The defaults are what a serving engine wants; benchmarks and the
// CLI set the others to compare kernels side by side.
struct DecodeOptions {
  // Tokens per split: 0 lets the plan's cost model choose; otherwise a multiple of 64 from 64 to
  // 8,192 with at most 256 splits of max_blocks_per_seq · block_size (tuning, benchmarks).
  int tokens_per_split = 0;
  // The narrow layout (SplitLayout::narrow): where the cost model takes it, never, or wherever
  // the cache and GQA group have one.
  enum class Narrow { kAuto, kNever, kAlways };
  Narrow narrow = Narrow::kAuto;
  // false: the register-buffered split kernels even where staged ones exist (4bit_nc and k3v4_nc
  // and 3bit_nc at head_dim 128 and 64 with GQA groups up to 4, and above 4 with `half`;
  // 4bit_nc at head_dim 64 for every group; k8v4 at head_dim 128 with GQA groups up to 4;
  // bf16/fp16 at head_dim 64 and 128).
  bool staged = true;
  // false: never 4bit_nc's one-CTA-per-SM twin (SplitLayout::one_cta).
  bool one_cta_twin = true;
  // false: the split kernel as an ordinary launch instead of a programmatic dependent of the
  // kernel before it.
  bool dependent_launch = true;
  // true: 4-bit and 3-bit keys with 4-bit values (4bit_nc, k3v4_nc) at head_dim 128 and GQA
  // groups above 4, and those at head_dim 64 and 3bit_nc at 128 and 64 with groups 5-16
  // (speculative verify's passes put new tokens beside the GQA heads) run the staged
  // half-precision kernels
  // (decode_detail::SplitVariant::half: the query, the centroids and P' rounded once to fp16, as
  // FlashAttention rounds) instead of the hi + lo products' fp32-level scores; a third of the MMAs.
  // Elsewhere (and with staged = false) ignored.
  bool half = false;
  // With half: verify passes of 9-32 columns on the kernel whose warps share their outputs, 4
  // warps to one (decode_detail::SplitVariant::shared_o: 32 accumulator registers per thread
  // instead of 128, so two 8-warp CTAs per SM instead of two 4-warp ones;
  // attention/decode_split_shared.cuh), with the same numerics as the other half-precision
  // kernels. H200, 64 × 4k at GQA 4 against the 4-warp kernels, one run: 4 new tokens
  // 110.4 -> 104.1 µs (4bit_nc) and 119.5 -> 113.8 (k3v4_nc), 8 new tokens 172.0 -> 165.9 and
  // 187.2 -> 171.7; on sm_90a its 17-32-column kernel runs both products as warpgroup MMAs (8 new
  // tokens 163.0 -> 136.3 and 172.4 -> 145.4). 3bit_nc's passes of 17-32 columns run on it
  // alone (MaxGroup), and so do k8v4's of 5-32 (FP8 keys have no other half-precision kernel:
  // without shared_o their groups 5-16 run the exact kernels; H200, 64 × 4k at GQA 4, 4 / 8 new
  // tokens 153.1 / 305.5 µs on those, 118.1 / 180.4 on it; H100, 2 new tokens (8 columns, two N
  // tiles here) 182.6 -> 159.9).
  bool shared_o = true;
  // The sliding window Run will be given (CudaDecodeArgs::sliding_window), or 0 for any or none:
  // the splits are sized for the tokens such a window reads (at most that many from the block
  // boundary at or after its first position), not for max_blocks_per_seq's, and Run takes only
  // windows from 1 to this one.
  int32_t sliding_window = 0;
};

// A split layout: tokens per split (a multiple of 64 from 64 to 8,192; at most 256 splits) and
// whether the narrow variant of the split kernel runs it.
struct SplitLayout {
  int64_t tokens_per_split = 0;
  bool narrow = false;
  // The 8-warp kernel's hi-only twin (SplitKernelOccupancy::hi_only): where it exists and the
  // split grid holds at most one CTA per SM. Measured on the H200 (v20, tools/bench/README.md):
  // 5-15 % faster there, 8 % slower with two CTAs per SM over 8,192-token splits. With narrow:
  // the twin's paired CTAs instead of the 4-warp ones, wherever SplitKernelOccupancy::
  // narrow_hi_only (v21: 3-15 % faster at every narrow shape measured).
  bool hi_only = false;
  // The 8-warp kernel's one-CTA-per-SM twin (SplitKernelOccupancy::one_cta_twin): where it exists,
  // the split grid fits the SMs and splits hold at least 1,024 tokens. Measured on the H200
  // (v23): 3-5 % faster there, 3 % slower over splits of 256 tokens. The
  // cost model prices it, so a plan takes one twin CTA per SM over twice the tokens instead of
  // two CTAs per SM where that measured faster (2-10 %, e.g. 4 × 32k, 16 × 8k; commit 3447a5e).
  bool one_cta = false;
};

// The split layout that CudaDecoder::Plan picks for sequences of up to max_len tokens,
// num_seqs · num_kv_heads = seq_heads CTAs per split, on sm_count SMs; with tokens_per_split != 0
// only the variant is chosen; narrow forces the narrow layout on or off where it exists. Host only;
// exposed for tests (attention/decode_plan_test.cc).
SplitLayout ChooseSplitLayout(int64_t max_len, int64_t seq_heads, int sm_count,
                              const SplitKernelOccupancy& occupancy, int64_t tokens_per_split = 0,
                              DecodeOptions::Narrow narrow = DecodeOptions::Narrow::kAuto);

// The split layout of one decode shape, fixed at plan time so the launch is the same every step.
struct DecodePlan {
  int num_seqs = 0;
  int num_q_heads = 0;
  int max_blocks_per_seq = 0;
  int tokens_per_split = 0;  // a multiple of 64
  int max_splits = 0;        // upper bound on the splits of any sequence
  bool narrow = false;       // the split kernel's narrow variant (SplitKernelOccupancy)
  bool hi_only = false;      // 3-bit keys: the hi-only twin (with narrow: paired CTAs; SplitLayout)
  bool one_cta = false;      // 4-bit keys: the one-CTA-per-SM twin (SplitLayout)
  bool staged = true;        // DecodeOptions::staged
  bool half = false;         // DecodeOptions::half
  bool shared_o = false;     // DecodeOptions::shared_o
  bool dependent_launch = true;  // DecodeOptions::dependent_launch
  int32_t sliding_window = 0;    // DecodeOptions::sliding_window
  // Set by a caller whose next kernel in the stream reads nothing this decode writes and waits
  // for it only at its end (CudaAttention's chunk after a call's leading decode rows): the last
  // grid lets that kernel launch once each of its CTAs has started, so that its CTAs take the SMs
  // as this decode's leave. Only with dependent_launch and a Hadamard or no rotation (no query
  // prep); ignored otherwise.
  bool overlap_next = false;
  // The split kernel these choices select (decode_detail::ChooseSplitVariant).
  decode_detail::SplitVariant variant;
  int64_t workspace_bytes = 0;
};

struct CudaDecodeArgs {
  const void* query = nullptr;            // [num_seqs, num_q_heads, head_dim] device
  DType query_dtype = DType::kBF16;       // F16, BF16 or F32
  ConstCacheRef cache;                    // device
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq] device
  const int32_t* seq_lens = nullptr;      // [num_seqs] device; each <= max_blocks · block_size
  std::optional<float> scale;             // default 1/√D
  void* output = nullptr;                 // [num_seqs, num_q_heads, head_dim] device
  DType output_dtype = DType::kF32;       // F32, F16 or BF16
  float* lse = nullptr;                   // [num_seqs, num_q_heads] device, natural log
  void* workspace = nullptr;              // device, >= plan.workspace_bytes
  int64_t workspace_bytes = 0;
  // Sliding window: 0 none; else each row (at position seq_len − 1) reads positions
  // (seq_len − 1 − sliding_window, seq_len − 1], as AttentionArgs::sliding_window; the block-table
  // entries before the block holding the first of them are not read (a window may have released
  // them). A verify pass's columns (RunColumns) each read their own token's window. Not for a
  // plan on the shared-output kernel (DecodePlan::variant.shared_o: with DecodeOptions::half,
  // GQA groups above 8, above 4 with FP8 keys, and verify passes).
  int32_t sliding_window = 0;
};

// The alignment the CUDA attention kernels need of a call's rows: query and output their
// elements' (the kernels take 16-byte vectors only where the pointer allows them), lse 4 bytes.
// Throws tqkv::Error naming the pointer, its value and the alignment.
void CheckRowAlignment(std::string_view where, const void* query, DType query_dtype,
                       const void* output, DType output_dtype, const float* lse);

class CudaDecoder {
 public:
  // For a compressed cache written by `quantizer` (its format, rotation and codebook). A 3-bit
  // codebook is scaled so that its fp16 hi parts alone are close enough, where possible, for
  // k3v4_nc's hi-only 8-warp kernel (attention/codebook_fp16.h, SplitLayout::hi_only).
  explicit CudaDecoder(const Quantizer& quantizer);
  // For an uncompressed cache of format.dtype elements (BF16 or F16; anything else throws).
  explicit CudaDecoder(const Bf16BlockFormat& format);
  ~CudaDecoder();
  CudaDecoder(CudaDecoder&&) noexcept;
  CudaDecoder& operator=(CudaDecoder&&) noexcept;

  int head_dim() const;
  int num_kv_heads() const;
  int block_size() const;
  // The layout its calls' caches must have (CacheRef::layout).
  const CacheLayout& layout() const;

  // The largest GQA group Plan takes with these options: 32 for the half-precision kernels
  // (DecodeOptions::half and ::staged on 4bit_nc and k3v4_nc caches at head_dim 128, and with
  // ::shared_o on 3bit_nc's and k8v4's there: verify passes of up to 32 columns) and for the bf16
  // / fp16 caches' staged kernel at head_dim 64 and 128 (four N tiles, 4-warp CTAs), else 16.
  int MaxGroup(const DecodeOptions& options = {}) const;

  // The longest context the decode kernels read: 256 splits of at most 8,192 tokens (a split's
  // block ids are staged in shared memory, and its softmax sums stay within their accuracy).
  static constexpr int64_t kMaxSplits = 256;
  static constexpr int64_t kMaxSplitTokens = 8192;
  static constexpr int64_t kMaxContextTokens = kMaxSplits * kMaxSplitTokens;

  // Host only. Throws tqkv::Error for shapes the kernels do not support (num_q_heads must be a
  // multiple of num_kv_heads with a group of at most MaxGroup(options); num_seqs 1..65535;
  // max_blocks_per_seq · block_size at most kMaxContextTokens) and for options out of range
  // (DecodeOptions::tokens_per_split).
  DecodePlan Plan(int num_seqs, int num_q_heads, int max_blocks_per_seq,
                  const DecodeOptions& options = {}) const;

  // Validates the arguments against the plan (throws tqkv::Error, nothing launched) and launches.
  // The cache must be of this decoder's layout (CacheRef::layout: the quantizer's or the bf16
  // format's). The workspace must be 16-byte aligned (a device allocation is); the query, output
  // and lse aligned to their elements (CheckRowAlignment).
  // seq_lens and block_tables are not read on the host: they must hold lengths <= max_blocks ·
  // block_size and block ids < num_blocks (as the CPU reference checks).
  void Run(const DecodePlan& plan, const CudaDecodeArgs& args, StreamHandle stream) const;

 private:
  friend class CudaAttention;
  // Run, or with `verify` (not null) one of CudaAttention's verify passes: the plan's query heads
  // are the pass's columns (decode_detail::VerifyColumns), args.query, output and lse the call's
  // rows, args.seq_lens the call's; for a dense Πᵀ args.query is already q·Πᵀ in fp32 (the
  // caller's query prep over its rows).
  // `launch`: kAll both kernels; kSplits the split kernel alone, which then lets the next kernel
  // launch at its start (DecodePlan::overlap_next; with one split the same as kAll), and kMerge
  // the merge alone, later in the stream (nothing where the plan has one split).
  enum class Launch { kAll, kSplits, kMerge };
  void RunColumns(const DecodePlan& plan, const CudaDecodeArgs& args,
                  const decode_detail::VerifyColumns* verify, StreamHandle stream,
                  Launch launch = Launch::kAll) const;
  // Throws tqkv::Error (from `where`) for a plan this decoder's Plan would not make: its shape
  // (sizes, splits, group) and kernel choices (narrow, one_cta, hi_only, the variant). Returns the
  // occupancy of the plan's split kernels.
  SplitKernelOccupancy CheckPlan(std::string_view where, const DecodePlan& plan) const;
  // Throws tqkv::Error unless the kernels' fp32 score scale, scale · log2(e) over the codebook's
  // fp16 scale (default scale 1/√D), is finite.
  void CheckScale(std::string_view where, std::optional<float> scale) const;
  // How the split kernel for a GQA group occupies an SM (cached), staged or not.
  SplitKernelOccupancy SplitOccupancy(int group, bool staged, bool half, bool shared_o) const;
  // The split kernel of a GQA group for a plan's choices (ok = false where there is none).
  decode_detail::MaybeSplitVariant Variant(int group, const DecodePlan& plan) const;
  // The workspace a plan's shape needs on this decoder.
  int64_t WorkspaceBytes(const DecodePlan& plan) const;

  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace tqkv
