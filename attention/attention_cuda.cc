#include "attention/attention_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <utility>
#include <vector>

#include "quant/numerics.h"
#include "runtime/error.h"
#include "runtime/memory.h"

#if TQKV_HAVE_CUDA
#include "attention/attention_launch.h"
#include "attention/decode_launch.h"
#include "runtime/cuda_check.h"
#endif

namespace tqkv {

struct CudaAttention::State {
  explicit State(CudaDecoder d) : decoder(std::move(d)) {}
  CudaDecoder decoder;
  bool plain = false;
  BlockFormat format;  // compressed
  Bf16BlockFormat plain_format;
  KeyKind key_kind = KeyKind::kMse4;
  int value_bits = 16;
  CacheLayout layout;                      // what the caches of its calls must be
  DeviceBuffer<float> rotation;            // MSE keys: dense Πᵀ [D, D] for the query prep
  DeviceBuffer<float> rotation_fragments;  // and as the tensor-core query prep's B operands
  bool fwht = false;                       // Πᵀ = diag(signs) · H / √D (hadamard kinds)
  DeviceBuffer<float> signs;               // hadamard_signs: [D] ±1
  uint16_t centroid_hi[16] = {}, centroid_lo[16] = {};
  float centroids[16] = {};
  int sm_count = 0;
};

namespace {

constexpr int64_t kAlign = 256;
int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
constexpr int kMinSplitTokens = 256;  // a split shorter than this costs more than it saves
constexpr int kPrefillMinSplitTokens = 1024;  // the same on the prefill kernel (Plan)
constexpr int kMaxSplits = kMaxChunkSplits;
constexpr int64_t kPrefillCtaRows = 128;  // the prefill kernel's
#if TQKV_HAVE_CUDA
static_assert(kPrefillCtaRows == attention_detail::kPrefillRows);
#endif

// Row-tile slots for `seqs` sequences of `tokens` new tokens in all (attention/attention_tiles.cuh,
// FindRowTile): sequence b's tiles start at slot floor(its first row · group / cta_rows) + b.
int64_t RowTileSlots(int64_t tokens, int64_t seqs, int64_t group, int64_t cta_rows) {
  return (tokens * group + cta_rows - 1) / cta_rows + seqs;
}

int DeviceSmCount() {
  const auto devices = QueryDevices();
  return devices.empty() ? 0 : devices.front().sm_count;
}

// Workspace sections in order: q·Πᵀ (MSE keys), partial outputs and LSEs (with splits), and for a
// mixed call's decode rows the gathered queries, lengths, the decode's outputs and LSEs, then the
// decode's own workspace (leading decode rows: that alone); last the dequantized tiles
// (AttentionPlan::prefill_tiles).
struct Sections {
  int64_t query = 0, partial_out = 0, partial_lse = 0;
  int64_t rows_query = 0, rows_lens = 0, rows_out = 0, rows_lse = 0, rows_workspace = 0;
  int64_t tiles = 0;
  int64_t Before(const int64_t& section) const {  // the offset of a section of this struct
    int64_t at = 0;
    for (const int64_t* x : {&query, &partial_out, &partial_lse, &rows_query, &rows_lens, &rows_out,
                             &rows_lse, &rows_workspace, &tiles}) {
      if (x == &section) return at;
      at += *x;
    }
    return at;
  }
  int64_t Total() const { return Before(tiles) + tiles; }
};
Sections WorkspaceSections(bool rotate, const AttentionPlan& plan, int d,
                           [[maybe_unused]] int hk) {
  const int64_t rows = int64_t{plan.num_tokens} * plan.num_q_heads;
  Sections s;
  s.query = rotate ? AlignUp(rows * d * 4) : 0;
  if (plan.max_splits > 1) {
    s.partial_out = AlignUp(rows * plan.max_splits * d * 4);
    s.partial_lse = AlignUp(rows * plan.max_splits * 4);
  }
  if (plan.leading_decodes > 0) s.rows_workspace = AlignUp(plan.decode_plan.workspace_bytes);
  if (plan.decode_rows) {
    const int64_t seq_rows = int64_t{plan.num_seqs} * plan.num_q_heads;
    s.rows_query = AlignUp(seq_rows * d * 4);
    s.rows_lens = AlignUp(int64_t{plan.num_seqs} * 4);
    s.rows_out = AlignUp(seq_rows * d * 4);
    s.rows_lse = AlignUp(seq_rows * 4);
    s.rows_workspace = AlignUp(plan.decode_plan.workspace_bytes);
  }
#if TQKV_HAVE_CUDA
  if (plan.prefill_tiles) {
    s.tiles = AlignUp(attention_detail::PrefillTileSlots(plan.num_tokens, plan.num_seqs) * hk *
                      attention_detail::kPrefillTileBytes);
  }
#endif
  return s;
}

// A verify call's sections: the query in the keys' space for a dense Πᵀ (the decode kernels
// apply a Hadamard Πᵀ themselves), then the decode's own workspace.
struct VerifySections {
  int64_t mapped = 0, decode = 0;
  int64_t Total() const { return mapped + decode; }
};
VerifySections VerifyLayout(const AttentionPlan& plan, bool dense, int d) {
  VerifySections v;
  v.mapped = dense ? AlignUp(int64_t{plan.num_tokens} * plan.num_q_heads * d * 4) : 0;
  v.decode = AlignUp(plan.decode_plan.workspace_bytes);
  return v;
}

#if TQKV_HAVE_CUDA
// The cache-layout fields of the chunk and prefill kernels' parameters (State: CudaAttention's).
template <typename State>
void SetCacheLayout(const State& s, attention_detail::ChunkParams& p) {
  if (s.plain) {
    p.block_bytes = s.plain_format.block_bytes;
    p.meta_offset = s.plain_format.value_offset;
  } else {
    p.block_bytes = s.format.block_bytes;
    p.meta_offset = s.format.meta_offset;
    p.data_per_slot = s.format.data_per_slot;
    p.key_data_bytes = s.format.key_data_bytes;
    p.num_meta = s.format.num_meta;
  }
  p.block_size = s.layout.block_size;
}
#endif

}  // namespace

int64_t ChunkBusyCtas(const ChunkCall& call) {
  const int64_t seqs_with_rows = (call.num_tokens + call.max_q_len - 1) / call.max_q_len;
  const int64_t tiles = (call.num_tokens * call.group + call.cta_rows - 1) / call.cta_rows;
  return std::max({int64_t{1}, tiles, seqs_with_rows}) * call.num_kv_heads;
}

// H100, 4bit_nc, 32:8:128, one chunk of 256 new tokens after 1k / 4k on the prefill kernel (1, 2,
// 3, 5 splits): 34.9, 38.0, 46.2, 51.5 µs / 91.6 (1 split), 85.2 (5 of 1,024 tokens), 98.6 (9 of
// 512); 512 new tokens after 4k, 2 splits against 3: 116.9 against 128.5 µs. A wave of one CTA
// per SM instead took 1 × 128k with 8 new tokens (prefill kernel) 1.65x longer.
ChunkSplits ChooseChunkSplits(const ChunkCall& call, int sm_count) {
  const int64_t min_split = call.prefill ? kPrefillMinSplitTokens : kMinSplitTokens;
  const int64_t want = 2 * int64_t{std::max(1, sm_count)} / ChunkBusyCtas(call);
  int64_t splits = std::clamp<int64_t>(std::min(want, call.max_len / min_split), 1, kMaxSplits);
  const int64_t tokens = ((call.max_len + splits - 1) / splits + 63) / 64 * 64;
  splits = (call.max_len + tokens - 1) / tokens;
  return {static_cast<int>(tokens), static_cast<int>(splits)};
}

AttentionOptions WithLeadingSequences(AttentionOptions options,
                                      std::span<const int32_t> query_start_loc,
                                      int max_leading_q_len) {
  constexpr const char* kWhere = "WithLeadingSequences";
  if (max_leading_q_len < 1) {
    throw InvalidArgument(kWhere, "max_leading_q_len", max_leading_q_len, ">= 1");
  }
  if (query_start_loc.empty()) {
    throw InvalidArgument(kWhere, "query_start_loc.size()", 0, ">= 1 (num_seqs + 1 offsets)");
  }
  const size_t num_seqs = query_start_loc.size() - 1;
  int lead = 0, most = 1;
  for (size_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = int64_t{query_start_loc[b + 1]} - query_start_loc[b];
    if (q_len < 1 || q_len > max_leading_q_len) break;
    most = std::max(most, static_cast<int>(q_len));
    ++lead;
  }
  options.leading_decode_seqs = lead;
  options.leading_max_q_len = most;
  return options;
}

CudaAttention::CudaAttention(const Quantizer& q) : state_(std::make_unique<State>(CudaDecoder(q))) {
  State& s = *state_;
  s.format = q.format();
  s.layout = q.layout();
  s.value_bits = s.format.value_bits;
  s.key_kind = s.format.key_kind();
  if (!s.format.fp8_keys) {
    s.rotation = DeviceBuffer<float>(int64_t{s.format.head_dim} * s.format.head_dim);
    s.rotation.CopyFromHost(q.rotation().matrix);
    const Rotation& r = q.rotation();
    s.fwht = r.kind == RotationKind::kHadamard || r.kind == RotationKind::kHadamardSigns;
    if (r.kind == RotationKind::kHadamardSigns) {
      s.signs = DeviceBuffer<float>(s.format.head_dim);
      s.signs.CopyFromHost(r.signs);
    }
#if TQKV_HAVE_CUDA
    const std::vector<float> fragments =
        decode_detail::QueryPrepFragments(q.rotation().matrix, s.format.head_dim);
    s.rotation_fragments = DeviceBuffer<float>(static_cast<int64_t>(fragments.size()));
    s.rotation_fragments.CopyFromHost(fragments);
#endif
    const auto& c = q.codebook().centroids;
    for (size_t i = 0; i < c.size() && i < 16; ++i) {
      s.centroids[i] = c[i];
      s.centroid_hi[i] = FloatToHalfBits(c[i]);
      s.centroid_lo[i] = FloatToHalfBits(c[i] - HalfBitsToFloat(s.centroid_hi[i]));
    }
#if TQKV_HAVE_CUDA
    TQKV_CUDA_CHECK(cudaDeviceSynchronize());  // the upload was from pageable memory
#endif
  }
  s.sm_count = DeviceSmCount();
}

CudaAttention::CudaAttention(const Bf16BlockFormat& format)
    : state_(std::make_unique<State>(CudaDecoder(CheckBf16BlockFormat("CudaAttention", format)))) {
  State& s = *state_;
  s.plain = true;
  s.plain_format = format;
  s.layout = format.layout();
  s.key_kind = format.key_kind();
  s.sm_count = DeviceSmCount();
}

CudaAttention::~CudaAttention() = default;
CudaAttention::CudaAttention(CudaAttention&&) noexcept = default;
CudaAttention& CudaAttention::operator=(CudaAttention&&) noexcept = default;

int CudaAttention::head_dim() const { return state_->layout.head_dim; }
int CudaAttention::num_kv_heads() const { return state_->layout.num_kv_heads; }
int CudaAttention::block_size() const { return state_->layout.block_size; }
const CacheLayout& CudaAttention::layout() const { return state_->layout; }

std::pair<int, int> CudaAttention::VerifyLimits(int group, const AttentionOptions& options) const {
  const State& s = *state_;
  const int d = head_dim();
  DecodeOptions decode = options.decode;
  decode.half = options.verify_precision == ChunkPrecision::kHalf;
  // At head_dim 256 the compressed kinds' split kernel of 9-16 columns (two N tiles on the
  // register pipeline) costs more per column than two passes of up to 8: H100, 16:8:256, 64 × 4k,
  // 8 new tokens at GQA 2, one pass of 16 columns against two of 8: 4bit_nc 809 against 474 µs,
  // k3v4_nc 764 / 461, k8v4 864 / 658 (the bf16 cache's kernel the other way: 943 / 1,534). A
  // GQA group above 8 still takes one token of 9-16 columns per pass.
  const int max_columns = std::min(
      {options.verify_max_group, s.decoder.MaxGroup(decode), d == 256 && !s.plain ? 8 : 32});
  // The plan's choice (verify_max_q_len -1): at head_dim 64 the compressed caches' verify passes
  // beat the prefill kernel up to 16 new tokens in 4 passes: H100, SmolLM2's 9:3:64, 64 × 4k, 16
  // new tokens, 4 passes of 5 against the prefill kernel: 4bit_nc 144 against 260 µs, k3v4_nc
  // 147 / 330, 3bit_nc 151 / 332, k8v4 186 / 254; the bf16 / fp16 caches' in 2 passes (32
  // columns), not in 4: the bf16 cache 177.5 against 211 µs at 9:3:64 (2 passes of 10), 375 / 519
  // at 32:8:64 (2 of 8), but 323 / 213 in 4 passes of 5. At head_dim 128 the codebook-key
  // caches' in at most 2 passes (their 32-column kernels; more passes lose): H100, 32:8:128, 16
  // new tokens in 2 passes of 8 against the prefill kernel, 64 × 4k: 4bit_nc 248.0 against 365.1
  // µs, k3v4_nc 261.7 / 368.6, 3bit_nc 281.0 / 406.0; 1 × 128k: 131.5 / 162.1, 140.3 / 163.4,
  // 150.1 / 181.1; at 24:8:128 (2 passes of 10) 4bit_nc 243.9 / 349.1; 32 new tokens in 4
  // passes: 4bit_nc 505.4 against 352.1. Not k8v4 (its passes copy 192-byte slots twice: 350.7
  // / 362.4 at 64 × 4k, but 192.2 / 159.9 at 1 × 128k) nor the bf16 cache (738.7 / 765.6, 370.5
  // / 360.4).
  int verify_q = options.verify_max_q_len;
  if (verify_q < 0) {
    const int rows = std::max(1, max_columns / group);
    const int passes16 = (16 + rows - 1) / rows;
    const bool codebook_keys = !s.plain && s.key_kind != KeyKind::kFp8;
    verify_q =
        (d == 64 && passes16 <= (s.plain ? 2 : 4)) || (d == 128 && codebook_keys && passes16 <= 2)
            ? 16
            : 8;
  }
  return {max_columns, verify_q};
}

int CudaAttention::MaxLeadingQLen(int num_q_heads, const AttentionOptions& options) const {
  constexpr const char* kWhere = "CudaAttention::MaxLeadingQLen";
  const int hk = num_kv_heads();
  if (num_q_heads < 1 || num_q_heads % hk != 0) {
    throw InvalidArgument(kWhere, "num_q_heads", num_q_heads,
                          fmt::format("a positive multiple of num_kv_heads = {}", hk));
  }
  if (options.verify_max_group < 1 || options.verify_max_group > 32) {
    throw InvalidArgument(kWhere, "options.verify_max_group", options.verify_max_group, "1 to 32");
  }
  if (options.verify_max_q_len < -1) {
    throw InvalidArgument(kWhere, "options.verify_max_q_len", options.verify_max_q_len,
                          ">= 0, or -1 (the plan's choice)");
  }
  const int group = num_q_heads / hk;
  // (Plan's conditions for leading verify rows that do not depend on the call's shape.)
  if (!options.decode_kernels || group > 16) return 1;
  return std::max(1, VerifyLimits(group, options).second);
}

namespace {

// Plan's checks of its arguments, before it chooses anything (the row tiles and splits are checked
// where they are chosen).
void CheckPlanArguments(int num_seqs, int num_tokens, int num_q_heads, int max_blocks_per_seq,
                        int max_q_len, const AttentionOptions& options, int hk, int block_size) {
  constexpr const char* kWhere = "CudaAttention::Plan";
  constexpr int kMaxSeqs = CudaAttention::kMaxSeqs;
  constexpr int64_t kMaxContextTokens = CudaAttention::kMaxContextTokens;
  if (num_seqs < 1 || num_seqs > kMaxSeqs) {
    throw InvalidArgument(kWhere, "num_seqs", num_seqs, fmt::format("1 to {}", kMaxSeqs));
  }
  if (num_tokens < 1) throw InvalidArgument(kWhere, "num_tokens", num_tokens, ">= 1");
  if (num_q_heads < 1 || num_q_heads % hk != 0) {
    throw InvalidArgument(kWhere, "num_q_heads", num_q_heads,
                          fmt::format("a positive multiple of num_kv_heads = {}", hk));
  }
  // Positions are int32, and the kernels add a split's length to its first position (a window's
  // start plus the splits before it, each below the context): within kMaxContextTokens (2^29)
  // every such sum stays below 2^31.
  if (max_blocks_per_seq < 1 || int64_t{max_blocks_per_seq} * block_size > kMaxContextTokens) {
    throw InvalidArgument(
        kWhere, "max_blocks_per_seq", max_blocks_per_seq,
        fmt::format("1 to {} (contexts up to {} tokens at block size {})",
                    kMaxContextTokens / block_size, kMaxContextTokens, block_size));
  }
  if (max_q_len < 1 || max_q_len > num_tokens ||
      max_q_len > int64_t{max_blocks_per_seq} * block_size) {
    throw InvalidArgument(
        kWhere, "max_q_len", max_q_len,
        fmt::format("1 to min(num_tokens = {}, max_blocks_per_seq · block_size = {}) (a "
                    "sequence's new tokens are part of its context)",
                    num_tokens, int64_t{max_blocks_per_seq} * block_size));
  }
  if (int64_t{num_tokens} > int64_t{num_seqs} * max_q_len) {
    throw InvalidArgument(
        kWhere, "num_tokens", num_tokens,
        fmt::format("at most num_seqs · max_q_len = {}", int64_t{num_seqs} * max_q_len));
  }
  if (int64_t{num_tokens} * num_q_heads > std::numeric_limits<int32_t>::max()) {
    throw InvalidArgument(
        kWhere, "num_tokens", num_tokens,
        fmt::format("at most {} with {} query heads (int32 rows)",
                    std::numeric_limits<int32_t>::max() / num_q_heads, num_q_heads));
  }
  // (A split's end, its first position plus this, stays within int32 as the context's does.)
  if (options.tokens_per_split < 0 || options.tokens_per_split % 64 != 0 ||
      options.tokens_per_split > kMaxContextTokens) {
    throw InvalidArgument(kWhere, "options.tokens_per_split", options.tokens_per_split,
                          fmt::format("0 (the plan chooses) or a positive multiple of 64 up to {}",
                                      kMaxContextTokens));
  }
  // The decode kernels' options, under their names: the decode plans below see them only where
  // a decode path is chosen (and would name them as their own).
  if (options.decode.tokens_per_split != 0 &&
      (options.decode.tokens_per_split < 64 || options.decode.tokens_per_split % 64 != 0 ||
       options.decode.tokens_per_split > CudaDecoder::kMaxSplitTokens)) {
    throw InvalidArgument(kWhere, "options.decode.tokens_per_split",
                          options.decode.tokens_per_split,
                          fmt::format("0 (the plan chooses) or a multiple of 64 from 64 to {}",
                                      CudaDecoder::kMaxSplitTokens));
  }
  if (options.decode.narrow != DecodeOptions::Narrow::kAuto &&
      options.decode.narrow != DecodeOptions::Narrow::kNever &&
      options.decode.narrow != DecodeOptions::Narrow::kAlways) {
    throw InvalidArgument(kWhere, "options.decode.narrow", static_cast<int>(options.decode.narrow),
                          "Narrow::kAuto (0), kNever (1) or kAlways (2)");
  }
  if (options.verify_max_q_len < -1) {
    throw InvalidArgument(kWhere, "options.verify_max_q_len", options.verify_max_q_len,
                          ">= 0, or -1 (the plan's choice)");
  }
  if (options.leading_max_q_len < 1) {
    throw InvalidArgument(kWhere, "options.leading_max_q_len", options.leading_max_q_len,
                          ">= 1 (1: one new token per leading sequence)");
  }
  const int64_t lead_tokens = int64_t{options.leading_decode_seqs} * options.leading_max_q_len;
  if (options.leading_decode_seqs < 0 || options.leading_decode_seqs > num_seqs ||
      options.leading_decode_seqs > num_tokens ||
      (options.leading_decode_seqs == num_seqs && options.leading_max_q_len == 1 &&
       num_tokens != num_seqs)) {
    throw InvalidArgument(kWhere, "options.leading_decode_seqs", options.leading_decode_seqs,
                          fmt::format("0 to min(num_seqs, num_tokens) = {} (num_seqs only where "
                                      "num_tokens = num_seqs = {} or leading_max_q_len > 1)",
                                      std::min(num_seqs, num_tokens), num_tokens));
  }
  if (const int lead = options.leading_decode_seqs;
      lead > 0 && num_tokens > lead_tokens + int64_t{num_seqs - lead} * max_q_len) {
    throw InvalidArgument(
        kWhere, "num_tokens", num_tokens,
        fmt::format("at most leading_decode_seqs · leading_max_q_len + (num_seqs - "
                    "leading_decode_seqs) · max_q_len = {} (the leading sequences have at most "
                    "leading_max_q_len = {} new tokens each)",
                    lead_tokens + int64_t{num_seqs - lead} * max_q_len, options.leading_max_q_len));
  }
  if (options.verify_max_group < 1 || options.verify_max_group > 32) {
    throw InvalidArgument(kWhere, "options.verify_max_group", options.verify_max_group, "1 to 32");
  }
  for (const auto& [name, precision] :
       {std::pair{"options.chunk_precision", options.chunk_precision},
        std::pair{"options.verify_precision", options.verify_precision}}) {
    if (precision != ChunkPrecision::kHalf && precision != ChunkPrecision::kExact) {
      throw InvalidArgument(kWhere, name, static_cast<int>(precision),
                            "ChunkPrecision::kHalf (0) or ChunkPrecision::kExact (1)");
    }
  }
}

// The decode kernels' arguments for rows they read and write where the caller's arguments have
// them (one-token calls, verify passes, a mixed call's leading rows): the caller's query (or
// `query`, of `query_dtype`, in its place: q·Πᵀ in the workspace), cache, tables, lengths,
// outputs and window, and their share of the workspace.
CudaDecodeArgs DecodeArgsInPlace(const AttentionArgs& a, const void* query, DType query_dtype,
                                 void* workspace, int64_t workspace_bytes) {
  CudaDecodeArgs da;
  da.query = query;
  da.query_dtype = query_dtype;
  da.cache = a.cache;
  da.block_tables = a.block_tables;
  da.seq_lens = a.seq_lens;
  da.scale = a.scale;
  da.output = a.output;
  da.output_dtype = a.output_dtype;
  da.lse = a.lse;
  da.workspace = workspace;
  da.workspace_bytes = workspace_bytes;
  da.sliding_window = a.sliding_window;
  return da;
}

#if TQKV_HAVE_CUDA
// A verify pass's columns (VerifyColumns, decode_launch.h): plan.verify_pass_rows new tokens per
// sequence beside the GQA heads; each pass sets row_begin.
decode_detail::VerifyColumns VerifyColumnsOf(const AttentionPlan& plan, const AttentionArgs& a,
                                             int num_kv_heads) {
  decode_detail::VerifyColumns columns;
  columns.query_start_loc = a.query_start_loc;
  columns.rows = plan.verify_pass_rows;
  columns.group = plan.num_q_heads / num_kv_heads;
  columns.num_q_heads = plan.num_q_heads;
  return columns;
}
#endif

}  // namespace

AttentionPlan CudaAttention::Plan(int num_seqs, int num_tokens, int num_q_heads,
                                  int max_blocks_per_seq, int max_q_len,
                                  const AttentionOptions& options) const {
  constexpr const char* kWhere = "CudaAttention::Plan";
  const State& s = *state_;
  const int hk = num_kv_heads(), d = head_dim();
  CheckPlanArguments(num_seqs, num_tokens, num_q_heads, max_blocks_per_seq, max_q_len, options, hk,
                     block_size());
  const int group = num_q_heads / hk;
  AttentionPlan plan;
  plan.num_seqs = num_seqs;
  plan.num_tokens = num_tokens;
  plan.num_q_heads = num_q_heads;
  plan.max_blocks_per_seq = max_blocks_per_seq;
  plan.max_q_len = max_q_len;
  // One new token per sequence: max_q_len 1, or the caller says every sequence has one.
  const bool all_one =
      max_q_len == 1 || (options.leading_decode_seqs == num_seqs && options.leading_max_q_len == 1);
  // Longer contexts than the decode kernels read run on the chunk kernels alone.
  const bool decode_kernels =
      options.decode_kernels &&
      int64_t{max_blocks_per_seq} * block_size() <= CudaDecoder::kMaxContextTokens;
  // Told of a sliding window (options.decode.sliding_window), every decode plan of the call (one
  // token per sequence, verify passes, a mixed call's gathered or leading rows) has its splits
  // sized for it.
  plan.decode = decode_kernels && all_one && num_tokens == num_seqs && group <= 16;
  if (plan.decode) {
    plan.decode_plan = s.decoder.Plan(num_seqs, num_q_heads, max_blocks_per_seq, options.decode);
  }
  // The chunk kernel.
  const int64_t max_len = int64_t{max_blocks_per_seq} * block_size();
  // 16, 32 or 64 query rows (new tokens x GQA heads) per CTA: the fewest that hold a sequence's
  // rows, up to 64 (the other warps of a CTA with fewer rows split each KV tile; head_dim 256's
  // 32-token tiles split in two at most).
  const int64_t seq_rows = int64_t{max_q_len} * group;
  plan.row_warps = seq_rows <= 16 ? 1 : seq_rows <= 32 ? 2 : 4;
  if (d == 256) plan.row_warps = std::max(plan.row_warps, 2);
  // The prefill kernel from 16 rows per sequence on (H200, 64 × 4k at GQA 4, 4bit_nc: 4 new
  // tokens 394 µs against the chunk kernel's 515, 8 364 against 629, 16 363 against 795; 1 × 128k
  // with 8: 160 against 318); with 4 rows the chunk kernel was faster (451 against 602).
  plan.prefill =
      options.chunk_precision == ChunkPrecision::kHalf && (d == 64 || d == 128) && seq_rows >= 16;
  const int64_t cta_rows = plan.prefill ? kPrefillCtaRows : 16 * plan.row_warps;
  // Row-tile slots: sequence b's tiles take slots from floor(query_start_loc[b] · G / cta_rows) + b
  // on (attention/attention_tiles.cuh, FindRowTile), so no CTA is launched for the tiles a short
  // sequence lacks (a mixed call's decode rows beside one long chunk).
  const int64_t slots = RowTileSlots(num_tokens, num_seqs, group, cta_rows);
  if (slots * kMaxSplits * hk > std::numeric_limits<int32_t>::max()) {
    // The inverse of the check: the most tokens whose slots stay within it.
    const int64_t max_slots = std::numeric_limits<int32_t>::max() / (kMaxSplits * hk);
    throw InvalidArgument(
        kWhere, "num_tokens", num_tokens,
        fmt::format("at most {} for {} sequences with {} query heads per KV "
                    "head and {} rows per CTA",
                    std::max<int64_t>(0, (max_slots - num_seqs) * cta_rows / group), num_seqs,
                    group, cta_rows));
  }
  plan.row_tiles = static_cast<int>(slots);
  const ChunkCall call{.max_len = max_len,
                       .num_tokens = num_tokens,
                       .max_q_len = max_q_len,
                       .group = group,
                       .num_kv_heads = hk,
                       .cta_rows = static_cast<int>(cta_rows),
                       .prefill = plan.prefill};
  int64_t splits = 1;
  if (options.tokens_per_split > 0) {
    plan.tokens_per_split = options.tokens_per_split;
    splits = (max_len + options.tokens_per_split - 1) / options.tokens_per_split;
  } else {
    const ChunkSplits chosen = ChooseChunkSplits(call, s.sm_count);
    plan.tokens_per_split = chosen.tokens_per_split;
    splits = chosen.splits;
  }
  if (splits > kMaxSplits) {
    throw InvalidArgument(
        kWhere, "options.tokens_per_split", options.tokens_per_split,
        fmt::format("at least {} for max_blocks_per_seq · block_size = {} "
                    "(at most {} splits)",
                    (max_len + kMaxSplits - 1) / kMaxSplits, max_len, kMaxSplits));
  }
  plan.max_splits = static_cast<int>(splits);
  // The grid's order. H200, one call, 4bit_nc (bf16 cache): heads fastest at 2,048 after 0 437 µs
  // (259) and the mixed step 548 (531), head by head 573 (356) and 685 (642); heads fastest for
  // every shape cost 4bit_nc 15-20 % after 32k-128k and 9 % at 8,192 after 0 (many waves).
  const int64_t ctas = ChunkBusyCtas(call) * splits;
  plan.heads_fastest =
      max_len <= 2 * int64_t{max_q_len} && ctas <= 4 * 2 * int64_t{std::max(1, s.sm_count)};
  // Some sequences may have one new token (fewer tokens than every sequence at max_q_len): those
  // run on the decode kernels.
  plan.decode_rows = decode_kernels && !plan.decode && max_q_len > 1 && num_seqs > 1 &&
                     int64_t{num_tokens} < int64_t{num_seqs} * max_q_len && group <= 16;
  if (plan.decode_rows) {
    plan.decode_plan = s.decoder.Plan(num_seqs, num_q_heads, max_blocks_per_seq, options.decode);
  }
  // Few new tokens per sequence: the decode kernels, in passes of rows beside the GQA heads.
  // Columns past the decode kernels' largest group (16 but on the half-precision kernels and the
  // plain caches' at head_dim 64 and 128: 32) are left to a further pass. Beyond
  // verify_max_q_len too where one pass holds every new token: one pass of 32 columns took 171 µs
  // where the prefill kernel took 364 for the same 32 rows per sequence (H200, 64 × 4k, 4bit_nc).
  DecodeOptions decode = options.decode;
  decode.half = options.verify_precision == ChunkPrecision::kHalf;
  const auto [max_columns, verify_q] = VerifyLimits(group, options);
  plan.verify_rows = decode_kernels && !plan.decode && max_q_len > 1 && verify_q > 0 &&
                     (max_q_len <= verify_q || int64_t{max_q_len} * group <= max_columns) &&
                     group <= 16;
  if (plan.verify_rows) {
    plan.decode_rows = false;
    plan.verify_pass_rows = std::min(max_q_len, std::max(1, max_columns / group));
    plan.verify_passes = (max_q_len + plan.verify_pass_rows - 1) / plan.verify_pass_rows;
    plan.decode_plan =
        s.decoder.Plan(num_seqs, hk * plan.verify_pass_rows * group, max_blocks_per_seq, decode);
  }
  // The caller's leading one-token sequences: on the decode kernels where they lie. Leading
  // verify rows (leading_max_q_len > 1, up to the verify limit) there too, as verify passes: a
  // draft of 4 tokens per sequence beside a chunk runs at verify speed, not on the chunk's kernel
  // (H100, 4bit_nc, 63 × 4k with 4 new tokens each beside a 2,048-token chunk: 207.3 µs, 1.04x
  // the two parts run apart, against 392.0 with every row on the prefill kernel).
  const int lead_q = std::min(options.leading_max_q_len, max_q_len);
  if (plan.decode_rows && options.leading_decode_seqs > 0 && lead_q == 1) {
    plan.decode_rows = false;
    plan.leading_decodes = options.leading_decode_seqs;
    plan.leading_max_q_len = 1;
    plan.decode_plan =
        s.decoder.Plan(plan.leading_decodes, num_q_heads, max_blocks_per_seq, options.decode);
  } else if (decode_kernels && !plan.decode && !plan.verify_rows && lead_q > 1 &&
             lead_q <= verify_q && options.leading_decode_seqs > 0 &&
             options.leading_decode_seqs < num_seqs && group <= 16) {
    plan.decode_rows = false;
    plan.leading_decodes = options.leading_decode_seqs;
    plan.leading_max_q_len = lead_q;
    plan.verify_pass_rows = std::min(lead_q, std::max(1, max_columns / group));
    plan.verify_passes = (lead_q + plan.verify_pass_rows - 1) / plan.verify_pass_rows;
    plan.decode_plan = s.decoder.Plan(plan.leading_decodes, hk * plan.verify_pass_rows * group,
                                      max_blocks_per_seq, decode);
  }
#if TQKV_HAVE_CUDA
  if (plan.prefill) {
    attention_detail::ChunkParams layout;
    SetCacheLayout(s, layout);
    if (s.fwht) {
      plan.prefill_rotates =
          attention_detail::PrefillRotatesQuery(s.key_kind, s.value_bits, d, layout);
    }
    plan.prefill_tiles = options.prefill_tiles &&
                         max_q_len >= attention_detail::kPrefillTilesMinQLen &&
                         attention_detail::PrefillTakesTiles(s.key_kind, s.value_bits, d, layout);
  }
#endif
  // The chunk right after the leading rows' decode starts on the SMs that decode leaves; it reads
  // nothing the decode writes (its q·Πᵀ, where it needs one, is computed before the leading
  // rows). Not where the decode kernels map one-token rows by a dense Πᵀ with a query prep of
  // their own, before their split grid.
  const bool dense = !s.plain && s.key_kind != KeyKind::kFp8 && !s.fwht;
  if (plan.leading_decodes > 0) {
    plan.decode_plan.overlap_next = !(dense && plan.leading_max_q_len == 1);
  }
  plan.workspace_bytes = WorkspaceBytes(plan);
  return plan;
}

int64_t CudaAttention::WorkspaceBytes(const AttentionPlan& plan) const {
  const State& s = *state_;
  const int d = head_dim();
  const bool chunk_query_prep = !s.plain && s.key_kind != KeyKind::kFp8 && !plan.prefill_rotates;
  int64_t bytes = WorkspaceSections(chunk_query_prep, plan, d, num_kv_heads()).Total();
  if (plan.decode) bytes = std::max(bytes, plan.decode_plan.workspace_bytes);
  if (plan.verify_rows) {
    const bool dense = !s.plain && s.key_kind != KeyKind::kFp8 && !s.fwht;
    bytes = std::max(bytes, VerifyLayout(plan, dense, d).Total());
  }
  return bytes;
}

void CudaAttention::Run(const AttentionPlan& plan, const AttentionArgs& a,
                        StreamHandle stream) const {
  constexpr const char* kWhere = "CudaAttention::Run";
  const State& s = *state_;
  ValidateAttentionShapes(kWhere, s.layout, a);
  if (plan.num_seqs < 1 || plan.row_tiles < 1 || plan.max_splits < 1) {
    throw Error(fmt::format("{}: the plan was not made by CudaAttention::Plan", kWhere));
  }
  if (a.num_seqs != plan.num_seqs || a.num_tokens != plan.num_tokens ||
      a.num_q_heads != plan.num_q_heads || a.max_blocks_per_seq != plan.max_blocks_per_seq) {
    throw Error(
        fmt::format("{}: the arguments' shape (num_seqs {}, num_tokens {}, num_q_heads {}, "
                    "max_blocks_per_seq {}) differs from the plan's ({}, {}, {}, {})",
                    kWhere, a.num_seqs, a.num_tokens, a.num_q_heads, a.max_blocks_per_seq,
                    plan.num_seqs, plan.num_tokens, plan.num_q_heads, plan.max_blocks_per_seq));
  }
  // The rest of the plan as Plan makes it: its kernels are sized by these fields (a decode plan
  // for more sequences than the call's read past its arrays; a leading count past num_seqs made
  // a negative count of chunk sequences).
  {
    const int group = plan.num_q_heads / num_kv_heads();
    const int64_t cta_rows = plan.prefill ? kPrefillCtaRows : 16 * int64_t{plan.row_warps};
    const int64_t max_len = int64_t{plan.max_blocks_per_seq} * block_size();
    const DecodePlan& dp = plan.decode_plan;
    const int decode_paths = int{plan.decode} + int{plan.decode_rows} + int{plan.verify_rows} +
                             int{plan.leading_decodes > 0};
    const bool decode_plan_ok =
        (decode_paths == 0 || dp.max_blocks_per_seq == plan.max_blocks_per_seq) &&
        (plan.decode || plan.decode_rows
             ? dp.num_seqs == plan.num_seqs && dp.num_q_heads == plan.num_q_heads
         : plan.leading_decodes > 0 && plan.leading_max_q_len == 1
             ? dp.num_seqs == plan.leading_decodes && dp.num_q_heads == plan.num_q_heads
         : plan.leading_decodes > 0
             ? dp.num_seqs == plan.leading_decodes && plan.verify_pass_rows >= 1 &&
                   plan.leading_max_q_len <= plan.max_q_len &&
                   dp.num_q_heads == num_kv_heads() * plan.verify_pass_rows * group &&
                   int64_t{plan.verify_pass_rows} * plan.verify_passes >= plan.leading_max_q_len
         : plan.verify_rows
             ? dp.num_seqs == plan.num_seqs && plan.verify_pass_rows >= 1 &&
                   dp.num_q_heads == num_kv_heads() * plan.verify_pass_rows * group &&
                   int64_t{plan.verify_pass_rows} * plan.verify_passes >= plan.max_q_len
             : true);
    const bool prefill_ok = !plan.prefill || head_dim() == 64 || head_dim() == 128;
    bool prefill_options_ok = plan.prefill || (!plan.prefill_tiles && !plan.prefill_rotates);
#if TQKV_HAVE_CUDA
    if (plan.prefill) {
      attention_detail::ChunkParams layout;
      SetCacheLayout(s, layout);
      const int d = head_dim();
      prefill_options_ok =
          (!plan.prefill_tiles ||
           attention_detail::PrefillTakesTiles(s.key_kind, s.value_bits, d, layout)) &&
          (!plan.prefill_rotates ||
           (s.fwht && attention_detail::PrefillRotatesQuery(s.key_kind, s.value_bits, d, layout)));
    }
#endif
    if (plan.num_seqs > kMaxSeqs ||
        int64_t{plan.num_tokens} * plan.num_q_heads > std::numeric_limits<int32_t>::max() ||
        int64_t{plan.row_tiles} * plan.max_splits * num_kv_heads() >
            std::numeric_limits<int32_t>::max() ||
        !prefill_ok || !prefill_options_ok || plan.max_q_len > max_len || plan.max_q_len < 1 ||
        plan.max_q_len > plan.num_tokens || decode_paths > 1 || plan.leading_decodes < 0 ||
        plan.leading_decodes > plan.num_seqs || !decode_plan_ok ||
        (plan.leading_decodes > 0 && plan.leading_max_q_len < 1) ||
        (plan.row_warps != 1 && plan.row_warps != 2 && plan.row_warps != 4) ||
        plan.row_tiles < RowTileSlots(plan.num_tokens, plan.num_seqs, group, cta_rows) ||
        plan.max_splits > kMaxSplits || plan.tokens_per_split < 64 ||
        plan.tokens_per_split > kMaxContextTokens ||
        int64_t{plan.tokens_per_split} * plan.max_splits < max_len) {
      throw Error(
          fmt::format("{}: the plan was not made by CudaAttention::Plan (or was changed)", kWhere));
    }
    // The decode sub-plan's kernel choices too, before any kernel of the call is queued.
    if (decode_paths > 0) s.decoder.CheckPlan("CudaAttention::Run (decode_plan)", dp);
  }
  const int64_t workspace_bytes = std::max(plan.workspace_bytes, WorkspaceBytes(plan));
  if (workspace_bytes > 0 && (a.workspace == nullptr || a.workspace_bytes < workspace_bytes)) {
    throw InvalidArgument(kWhere, "workspace_bytes", a.workspace == nullptr ? 0 : a.workspace_bytes,
                          fmt::format(">= {} (AttentionPlan::workspace_bytes) with a non-null "
                                      "workspace",
                                      workspace_bytes));
  }
  if (reinterpret_cast<uintptr_t>(a.workspace) % 16 != 0) {  // float4 partial outputs
    throw InvalidArgument(kWhere, "workspace", fmt::format("{}", a.workspace),
                          "a 16-byte aligned device pointer");
  }
  if (a.cache.num_blocks < 1) {
    throw InvalidArgument(kWhere, "cache.num_blocks", a.cache.num_blocks, ">= 1");
  }
  if (reinterpret_cast<uintptr_t>(a.cache.data) % 16 != 0) {
    throw InvalidArgument(kWhere, "cache.data",
                          fmt::format("{}", static_cast<const void*>(a.cache.data)),
                          "a 16-byte aligned device pointer");
  }
  CheckRowAlignment(kWhere, a.query, a.query_dtype, a.output, a.output_dtype, a.lse);
  // The kernels' fp32 score scales: scale · log2(e) (the chunk and prefill kernels), over the
  // codebook's scale too where the decode kernels run.
  if (const float scale = a.scale ? *a.scale : 1.0f / std::sqrt(static_cast<float>(head_dim()));
      !std::isfinite(scale * static_cast<float>(std::numbers::log2e))) {
    throw InvalidArgument(
        kWhere, "scale", scale,
        fmt::format("at most {:g} (scale · log2(e), the kernels' fp32 score scale, finite)",
                    std::numeric_limits<float>::max() / static_cast<float>(std::numbers::log2e)));
  }
  const bool any_decode =
      plan.decode || plan.decode_rows || plan.verify_rows || plan.leading_decodes > 0;
  if (any_decode) s.decoder.CheckScale(kWhere, a.scale);
  // (Before anything is queued: a verify call's query prep precedes its passes, a mixed call's
  // chunk prep its decode rows.)
  if (const int32_t w = plan.decode_plan.sliding_window;
      any_decode && w > 0 && (a.sliding_window < 1 || a.sliding_window > w)) {
    throw InvalidArgument(kWhere, "sliding_window", a.sliding_window,
                          fmt::format("1 to {} (AttentionOptions::decode.sliding_window: the "
                                      "plan's decode splits hold that many tokens)",
                                      w));
  }
  if (plan.decode) {
    s.decoder.Run(plan.decode_plan,
                  DecodeArgsInPlace(a, a.query, a.query_dtype, a.workspace, a.workspace_bytes),
                  stream);
    return;
  }
#if TQKV_HAVE_CUDA
  if (plan.verify_rows) {
    RunVerify(plan, a, stream);
  } else {
    RunChunk(plan, a, stream);
  }
#else
  (void)s;
  (void)stream;
  throw Error(fmt::format("{}: this build of tqkv has no CUDA support", kWhere));
#endif
}

void CudaAttention::CheckArrays(const AttentionPlan& plan, const AttentionArgs& a,
                                StreamHandle stream) const {
  constexpr const char* kWhere = "CudaAttention::CheckArrays";
  const State& s = *state_;
  ValidateAttentionShapes(kWhere, s.layout, a);
  if (a.num_seqs != plan.num_seqs || a.num_tokens != plan.num_tokens ||
      a.max_blocks_per_seq != plan.max_blocks_per_seq) {
    throw Error(
        fmt::format("{}: the arguments' shape (num_seqs {}, num_tokens {}, "
                    "max_blocks_per_seq {}) differs from the plan's ({}, {}, {})",
                    kWhere, a.num_seqs, a.num_tokens, a.max_blocks_per_seq, plan.num_seqs,
                    plan.num_tokens, plan.max_blocks_per_seq));
  }
#if TQKV_HAVE_CUDA
  const int64_t b = a.num_seqs;
  std::vector<int32_t> loc(b + 1), lens(b), tables(b * a.max_blocks_per_seq);
  for (const auto& [to, from] : {std::pair{&loc, a.query_start_loc}, std::pair{&lens, a.seq_lens},
                                 std::pair{&tables, a.block_tables}}) {
    if (to->empty()) continue;
    TQKV_CUDA_CHECK(cudaMemcpyAsync(to->data(), from, to->size() * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream));
  }
  TQKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  AttentionArgs host = a;
  host.query_start_loc = loc.data();
  host.seq_lens = lens.data();
  host.block_tables = tables.data();
  ValidateAttentionArrays(kWhere, s.layout, host);
  for (int i = 0; i < a.num_seqs; ++i) {
    const int32_t q_len = loc[i + 1] - loc[i];
    const bool one = plan.decode || (i < plan.leading_decodes && plan.leading_max_q_len == 1);
    const bool lead_verify = !one && i < plan.leading_decodes;
    if (one           ? q_len != 1
        : lead_verify ? q_len < 1 || q_len > plan.leading_max_q_len
                      : q_len > plan.max_q_len) {
      throw InvalidArgument(
          kWhere, fmt::format("query_start_loc[{}]", i + 1), loc[i + 1],
          one ? fmt::format("{} (query_start_loc[{}] + 1: {})", loc[i] + 1, i,
                            plan.decode ? "a one-token plan" : "a leading decode sequence")
          : lead_verify
              ? fmt::format("{} to {} (query_start_loc[{}] + 1 to + plan.leading_max_q_len {}: a "
                            "leading sequence)",
                            int64_t{loc[i]} + 1, int64_t{loc[i]} + plan.leading_max_q_len, i,
                            plan.leading_max_q_len)
              : fmt::format("at most {} (query_start_loc[{}] + plan.max_q_len {})",
                            int64_t{loc[i]} + plan.max_q_len, i, plan.max_q_len));
    }
  }
#else
  (void)stream;
  throw Error(fmt::format("{}: this build of tqkv has no CUDA support", kWhere));
#endif
}

#if TQKV_HAVE_CUDA
// Verify rows (AttentionPlan::verify_rows), in passes of verify_pass_rows new tokens per sequence:
// a pass's rows ride beside the GQA heads as the columns of one decode launch over the context
// they share, each column also seeing the pass's new tokens up to its own (VerifyColumns,
// decode_launch.h): one split grid per pass (and its merge where it splits), reading the caller's
// query rows and writing its output rows.
void CudaAttention::RunVerify(const AttentionPlan& plan, const AttentionArgs& a,
                              StreamHandle stream) const {
  const State& s = *state_;
  const int d = head_dim();
  const bool dense = !s.plain && s.key_kind != KeyKind::kFp8 && !s.fwht;
  const VerifySections v = VerifyLayout(plan, dense, d);
  uint8_t* ws = static_cast<uint8_t*>(a.workspace);
  const void* query = a.query;
  DType query_dtype = a.query_dtype;
  if (dense) {  // q·Πᵀ of every row once, for all passes
    decode_detail::QueryPrepParams qp;
    qp.query = a.query;
    qp.in_dtype = a.query_dtype;
    qp.rotation = s.rotation.data();
    qp.rotation_fragments = s.rotation_fragments.data();
    qp.out = reinterpret_cast<float*>(ws);
    qp.rows = plan.num_tokens * plan.num_q_heads;
    qp.head_dim = d;
    TQKV_CUDA_CHECK(decode_detail::LaunchQueryPrep(qp, stream));
    query = qp.out;
    query_dtype = DType::kF32;
  }
  const CudaDecodeArgs da = DecodeArgsInPlace(a, query, query_dtype, ws + v.mapped, v.decode);
  decode_detail::VerifyColumns columns = VerifyColumnsOf(plan, a, num_kv_heads());
  for (int pass = 0; pass < plan.verify_passes; ++pass) {
    columns.row_begin = pass * plan.verify_pass_rows;
    s.decoder.RunColumns(plan.decode_plan, da, &columns, stream);
  }
}

// Everything else: the caller's leading one-token sequences on the decode kernels in place, other
// one-token sequences of a mixed call gathered onto them, and the chunk or prefill kernel (and
// its merge over splits) for the rest.
void CudaAttention::RunChunk(const AttentionPlan& plan, const AttentionArgs& a,
                             StreamHandle stream) const {
  constexpr const char* kWhere = "CudaAttention::Run";
  using namespace attention_detail;
  const State& s = *state_;
  const int d = head_dim();
  const bool rotate = !s.plain && s.key_kind != KeyKind::kFp8;
  const int64_t rows = int64_t{plan.num_tokens} * plan.num_q_heads;
  if (plan.prefill_rotates && !(plan.prefill && s.fwht)) {
    throw Error(fmt::format("{}: the plan was not made by this CudaAttention's Plan", kWhere));
  }
  const Sections w = WorkspaceSections(rotate && !plan.prefill_rotates, plan, d, num_kv_heads());
  uint8_t* ws = static_cast<uint8_t*>(a.workspace);
  // The caller's leading one-token sequences (AttentionOptions::leading_decode_seqs) on the
  // decode kernels, in place; the chunk or prefill kernel then reads sequences `lead` on.
  const int lead = plan.leading_decodes;
  // The dequantized tiles (AttentionPlan::prefill_tiles), written first: the prefill kernel may
  // start before the leading rows' decode ends, not before it starts.
  uint8_t* const tiles = plan.prefill_tiles ? ws + w.Before(w.tiles) : nullptr;
  const int tile_slots = static_cast<int>(PrefillTileSlots(plan.num_tokens, plan.num_seqs));
  if (tiles != nullptr) {
    ChunkParams tp;
    tp.cache = a.cache.data;
    tp.block_tables = a.block_tables + int64_t{lead} * plan.max_blocks_per_seq;
    tp.seq_lens = a.seq_lens + lead;
    tp.query_start_loc = a.query_start_loc + lead;
    std::copy(std::begin(s.centroid_hi), std::end(s.centroid_hi), tp.centroid_hi);
    tp.num_seqs = plan.num_seqs - lead;
    tp.num_q_heads = plan.num_q_heads;
    tp.num_kv_heads = num_kv_heads();
    tp.max_blocks_per_seq = plan.max_blocks_per_seq;
    SetCacheLayout(s, tp);
    tp.tiles = tiles;
    tp.tile_slots = tile_slots;
    // The kernel's sequences only: CTAs for the leading rows would all find none.
    tp.tile_grid = static_cast<int>(PrefillTileGrid(plan.num_tokens, plan.num_seqs - lead));
    tp.tiles_pass = 1;
    TQKV_CUDA_CHECK(LaunchPrefillAttention(s.key_kind, s.value_bits, d, tp, stream));
  }
  // Leading rows split over their contexts: the split grid lets the chunk or prefill kernel
  // launch at its start and their merge comes last, so that the chunk's CTAs fill the split
  // grid's tail instead of waiting for the merge (k8v4, 63 rows at 4k over three splits beside a
  // 2,048-token chunk: the chunk started only once every split CTA had ended).
  const bool defer_merge =
      lead > 0 && plan.decode_plan.overlap_next && plan.decode_plan.max_splits > 1;
  const auto lead_launch = defer_merge ? CudaDecoder::Launch::kSplits : CudaDecoder::Launch::kAll;
  // q·Πᵀ of every row (MSE keys, where the prefill kernel does not rotate the query itself), for
  // the chunk kernel and a dense Πᵀ's leading verify rows.
  const bool query_prep = rotate && !plan.prefill_rotates;
  if (query_prep) {
    decode_detail::QueryPrepParams qp;
    qp.query = a.query;
    qp.in_dtype = a.query_dtype;
    qp.rotation = s.rotation.data();
    qp.rotation_fragments = s.rotation_fragments.data();
    qp.out = reinterpret_cast<float*>(ws);
    qp.rows = static_cast<int>(rows);
    qp.head_dim = d;
    TQKV_CUDA_CHECK(decode_detail::LaunchQueryPrep(qp, stream));
  }
  // Leading verify rows (plan.leading_max_q_len > 1): passes of verify_pass_rows new tokens,
  // reading and writing the caller's rows in place (RunVerify's columns).
  const bool lead_verify = lead > 0 && plan.leading_max_q_len > 1;
  decode_detail::VerifyColumns lead_columns = VerifyColumnsOf(plan, a, num_kv_heads());
  // A dense Πᵀ's verify passes read q·Πᵀ (the decode kernels apply a Hadamard one themselves).
  const bool mapped = lead_verify && query_prep && !s.fwht;
  const CudaDecodeArgs lead_args = DecodeArgsInPlace(
      a, mapped ? static_cast<const void*>(ws) : a.query, mapped ? DType::kF32 : a.query_dtype,
      ws + w.query + w.partial_out + w.partial_lse, w.rows_workspace);
  if (lead > 0) {
    if (lead_verify) {
      for (int pass = 0; pass < plan.verify_passes; ++pass) {
        lead_columns.row_begin = pass * plan.verify_pass_rows;
        const bool last = pass + 1 == plan.verify_passes;
        s.decoder.RunColumns(plan.decode_plan, lead_args, &lead_columns, stream,
                             last ? lead_launch : CudaDecoder::Launch::kAll);
      }
    } else {
      s.decoder.RunColumns(plan.decode_plan, lead_args, nullptr, stream, lead_launch);
    }
  }
  // A mixed call's one-token sequences: gathered, decoded by the decode kernels, scattered back
  // after the chunk kernel.
  const bool decode_rows = plan.decode_rows;
  DecodeRowsParams rp;
  if (decode_rows) {
    uint8_t* at = ws + w.query + w.partial_out + w.partial_lse;
    rp.query_start_loc = a.query_start_loc;
    rp.seq_lens = a.seq_lens;
    rp.query = a.query;
    rp.query_dtype = a.query_dtype;
    rp.gathered_query = reinterpret_cast<float*>(at);
    rp.gathered_lens = reinterpret_cast<int32_t*>(at + w.rows_query);
    rp.partial_lse =
        plan.max_splits > 1 ? reinterpret_cast<float*>(ws + w.query + w.partial_out) : nullptr;
    rp.max_splits = plan.max_splits;
    rp.decode_out = reinterpret_cast<float*>(at + w.rows_query + w.rows_lens);
    rp.decode_lse = reinterpret_cast<float*>(at + w.rows_query + w.rows_lens + w.rows_out);
    rp.output = a.output;
    rp.lse = a.lse;
    rp.out_dtype = a.output_dtype;
    rp.num_seqs = plan.num_seqs;
    rp.num_q_heads = plan.num_q_heads;
    rp.head_dim = d;
    TQKV_CUDA_CHECK(LaunchGatherDecodeRows(rp, stream));
    CudaDecodeArgs da;
    da.query = rp.gathered_query;
    da.query_dtype = DType::kF32;
    da.cache = a.cache;
    da.block_tables = a.block_tables;
    da.seq_lens = rp.gathered_lens;
    da.scale = a.scale;
    da.output = const_cast<float*>(rp.decode_out);
    da.output_dtype = DType::kF32;
    da.lse = const_cast<float*>(rp.decode_lse);
    da.workspace = at + w.rows_query + w.rows_lens + w.rows_out + w.rows_lse;
    da.workspace_bytes = w.rows_workspace;
    da.sliding_window = a.sliding_window;
    s.decoder.Run(plan.decode_plan, da, stream);
  }
  ChunkParams p;
  p.skip_single = decode_rows ? 1 : 0;
  p.programmatic = lead > 0 && plan.decode_plan.overlap_next ? 1 : 0;
  if (plan.prefill_rotates) {
    p.query = a.query;
    p.query_dtype = a.query_dtype;
    p.query_fwht = 1;
    p.query_signs = s.signs.data();
    p.query_scale = 1.0f / std::sqrt(static_cast<float>(d));
  } else if (rotate) {  // (q·Πᵀ of every row, before the leading rows: see query_prep above)
    p.query = ws;
    p.query_dtype = DType::kF32;
  } else {
    p.query = a.query;
    p.query_dtype = a.query_dtype;
  }
  p.cache = a.cache.data;
  p.block_tables = a.block_tables + int64_t{lead} * plan.max_blocks_per_seq;
  p.seq_lens = a.seq_lens + lead;
  p.query_start_loc = a.query_start_loc + lead;
  std::copy(std::begin(s.centroid_hi), std::end(s.centroid_hi), p.centroid_hi);
  std::copy(std::begin(s.centroid_lo), std::end(s.centroid_lo), p.centroid_lo);
  p.out_dtype = a.output_dtype;
  if (plan.max_splits == 1) {
    p.output = a.output;
    p.lse = a.lse;
  } else {
    p.partial_out = reinterpret_cast<float*>(ws + w.query);
    p.partial_lse = reinterpret_cast<float*>(ws + w.query + w.partial_out);
  }
  p.num_seqs = plan.num_seqs - lead;
  p.num_q_heads = plan.num_q_heads;
  p.num_kv_heads = num_kv_heads();
  p.max_blocks_per_seq = plan.max_blocks_per_seq;
  SetCacheLayout(s, p);
  p.row_warps = plan.row_warps;
  // Without the leading sequences, the slots of the others (rows from row `lead` on).
  p.row_tiles =
      lead == 0
          ? plan.row_tiles
          : static_cast<int>(RowTileSlots(plan.num_tokens - lead, plan.num_seqs - lead,
                                          plan.num_q_heads / num_kv_heads(),
                                          plan.prefill ? kPrefillCtaRows : 16 * plan.row_warps));
  p.heads_fastest = plan.heads_fastest ? 1 : 0;
  p.tokens_per_split = plan.tokens_per_split;
  p.max_splits = plan.max_splits;
  p.sliding_window = a.sliding_window;
  p.tiles = tiles;
  p.tile_slots = tile_slots;
  const float scale = a.scale ? *a.scale : 1.0f / std::sqrt(static_cast<float>(d));
  p.score_scale = scale * static_cast<float>(std::numbers::log2e);
  if (plan.prefill) {
    TQKV_CUDA_CHECK(LaunchPrefillAttention(s.key_kind, s.value_bits, d, p, stream));
  } else {
    TQKV_CUDA_CHECK(LaunchChunkAttention(s.key_kind, s.value_bits, d, p, stream));
  }
  if (plan.max_splits > 1) {
    // The rows from row `lead` on (the leading rows are the decode kernels' outputs; leading
    // verify rows: from query_start_loc[lead] on, found on the device).
    const int64_t first = int64_t{lead} * plan.num_q_heads;
    ChunkMergeParams mp;
    mp.partial_out = p.partial_out + first * plan.max_splits * d;
    mp.partial_lse = p.partial_lse + first * plan.max_splits;
    mp.output = static_cast<uint8_t*>(a.output) + first * d * DTypeSize(a.output_dtype);
    mp.lse = a.lse + first;
    mp.out_dtype = a.output_dtype;
    mp.rows = static_cast<int>(rows - first);
    mp.head_dim = d;
    mp.max_splits = plan.max_splits;
    if (lead_verify) {  // (the leading sequences' tokens past the first `lead`)
      mp.skip_before = a.query_start_loc + lead;
      mp.row0 = first;
      mp.num_q_heads = plan.num_q_heads;
    }
    TQKV_CUDA_CHECK(LaunchChunkMerge(mp, stream));
  }
  if (defer_merge) {
    s.decoder.RunColumns(plan.decode_plan, lead_args, lead_verify ? &lead_columns : nullptr, stream,
                         CudaDecoder::Launch::kMerge);
  }
  if (decode_rows) TQKV_CUDA_CHECK(LaunchScatterDecodeRows(rp, stream));
}
#endif

}  // namespace tqkv
