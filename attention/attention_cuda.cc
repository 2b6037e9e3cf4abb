#include "attention/attention_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>

#include "quant/numerics.h"
#include "runtime/error.h"
#include "runtime/memory.h"

#if TQKV_HAVE_CUDA
#include "attention/attention_launch.h"
#include "attention/decode_launch.h"
#include "runtime/cuda_check.h"
#endif

namespace tqkv {

using decode_detail::KeyKind;

struct CudaAttention::State {
  explicit State(CudaDecoder d) : decoder(std::move(d)) {}
  CudaDecoder decoder;
  bool plain = false;
  BlockFormat format;  // compressed
  Bf16BlockFormat plain_format;
  KeyKind key_kind = KeyKind::kMse4;
  int value_bits = 16;
  AttentionShape shape;
  DeviceBuffer<float> rotation;  // MSE keys: dense Πᵀ [D, D] for the query prep
  uint16_t centroid_hi[16] = {}, centroid_lo[16] = {};
  int sm_count = 0;
};

namespace {

constexpr int64_t kAlign = 256;
int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
constexpr int kRowsPerCta = 64;      // attention_detail::kRowsPerCta
constexpr int kMinSplitTokens = 256;  // a split shorter than this costs more than it saves
constexpr int kMaxSplits = 64;

int DeviceSmCount() {
  const auto devices = QueryDevices();
  return devices.empty() ? 0 : devices.front().sm_count;
}

// Workspace sections: q·Πᵀ (MSE keys), partial outputs and LSEs (with splits).
struct Sections {
  int64_t query = 0, partial_out = 0, partial_lse = 0;
};
Sections WorkspaceSections(bool rotate, int64_t rows, int d, int splits) {
  Sections s;
  s.query = rotate ? AlignUp(rows * d * 4) : 0;
  if (splits > 1) {
    s.partial_out = AlignUp(rows * splits * d * 4);
    s.partial_lse = AlignUp(rows * splits * 4);
  }
  return s;
}

}  // namespace

CudaAttention::CudaAttention(const Quantizer& q)
    : state_(std::make_unique<State>(CudaDecoder(q))) {
  State& s = *state_;
  s.format = q.format();
  s.shape = {s.format.head_dim, s.format.num_kv_heads, s.format.block_size};
  s.value_bits = s.format.value_bits;
  if (s.format.fp8_keys) {
    s.key_kind = KeyKind::kFp8;
  } else {
    s.key_kind = s.format.key_bits == 4 ? KeyKind::kMse4 : KeyKind::kMse3;
    s.rotation = DeviceBuffer<float>(int64_t{s.format.head_dim} * s.format.head_dim);
    s.rotation.CopyFromHost(q.rotation().matrix);
    const auto& c = q.codebook().centroids;
    for (size_t i = 0; i < c.size() && i < 16; ++i) {
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
    : state_(std::make_unique<State>(CudaDecoder(format))) {
  State& s = *state_;
  s.plain = true;
  s.plain_format = format;
  s.shape = {format.head_dim, format.num_kv_heads, format.block_size};
  s.key_kind = format.dtype == DType::kF16 ? KeyKind::kF16 : KeyKind::kBf16;
  s.sm_count = DeviceSmCount();
}

CudaAttention::~CudaAttention() = default;
CudaAttention::CudaAttention(CudaAttention&&) noexcept = default;
CudaAttention& CudaAttention::operator=(CudaAttention&&) noexcept = default;

int CudaAttention::head_dim() const { return state_->shape.head_dim; }
int CudaAttention::num_kv_heads() const { return state_->shape.num_kv_heads; }
int CudaAttention::block_size() const { return state_->shape.block_size; }

AttentionPlan CudaAttention::Plan(int num_seqs, int num_tokens, int num_q_heads,
                                  int max_blocks_per_seq, int max_q_len,
                                  const AttentionOptions& options) const {
  constexpr const char* kWhere = "CudaAttention::Plan";
  const State& s = *state_;
  const int hk = num_kv_heads(), d = head_dim();
  if (num_seqs < 1 || num_seqs > 65535) {
    throw InvalidArgument(kWhere, "num_seqs", num_seqs, "1 to 65535");
  }
  if (num_tokens < 1) throw InvalidArgument(kWhere, "num_tokens", num_tokens, ">= 1");
  if (num_q_heads < 1 || num_q_heads % hk != 0) {
    throw InvalidArgument(kWhere, "num_q_heads", num_q_heads,
                          fmt::format("a positive multiple of num_kv_heads = {}", hk));
  }
  if (max_blocks_per_seq < 1) {
    throw InvalidArgument(kWhere, "max_blocks_per_seq", max_blocks_per_seq, ">= 1");
  }
  if (max_q_len < 1 || max_q_len > num_tokens) {
    throw InvalidArgument(kWhere, "max_q_len", max_q_len,
                          fmt::format("1 to num_tokens = {}", num_tokens));
  }
  if (options.tokens_per_split < 0 || options.tokens_per_split % 64 != 0) {
    throw InvalidArgument(kWhere, "options.tokens_per_split", options.tokens_per_split,
                          "0 (the plan chooses) or a positive multiple of 64");
  }
  const int group = num_q_heads / hk;
  AttentionPlan plan;
  plan.num_seqs = num_seqs;
  plan.num_tokens = num_tokens;
  plan.num_q_heads = num_q_heads;
  plan.max_blocks_per_seq = max_blocks_per_seq;
  plan.max_q_len = max_q_len;
  plan.decode = options.decode_kernels && max_q_len == 1 && num_tokens == num_seqs && group <= 16;
  int64_t decode_bytes = 0;
  if (plan.decode) {
    plan.decode_plan = s.decoder.Plan(num_seqs, num_q_heads, max_blocks_per_seq, options.decode);
    decode_bytes = plan.decode_plan.workspace_bytes;
  }
  // The chunk kernel (also a one-token plan's, for a sliding window).
  const int64_t max_len = int64_t{max_blocks_per_seq} * block_size();
  plan.row_tiles = static_cast<int>((int64_t{max_q_len} * group + kRowsPerCta - 1) / kRowsPerCta);
  // At least this many CTAs have rows (the tokens packed into as few tiles as possible); split
  // the context until about two CTAs per SM have work.
  const int64_t busy_ctas =
      std::max<int64_t>(1, (int64_t{num_tokens} * group + kRowsPerCta - 1) / kRowsPerCta) * hk;
  int64_t splits = 1;
  if (options.tokens_per_split > 0) {
    plan.tokens_per_split = options.tokens_per_split;
    splits = (max_len + options.tokens_per_split - 1) / options.tokens_per_split;
  } else {
    const int64_t want = (2 * int64_t{std::max(1, s.sm_count)} + busy_ctas - 1) / busy_ctas;
    splits = std::clamp<int64_t>(std::min(want, max_len / kMinSplitTokens), 1, kMaxSplits);
    plan.tokens_per_split = static_cast<int>(((max_len + splits - 1) / splits + 63) / 64 * 64);
    splits = (max_len + plan.tokens_per_split - 1) / plan.tokens_per_split;
  }
  if (splits > kMaxSplits) {
    throw InvalidArgument(kWhere, "options.tokens_per_split", options.tokens_per_split,
                          fmt::format("at least {} for max_blocks_per_seq · block_size = {} "
                                      "(at most {} splits)",
                                      (max_len + kMaxSplits - 1) / kMaxSplits, max_len,
                                      kMaxSplits));
  }
  plan.max_splits = static_cast<int>(splits);
  const Sections w = WorkspaceSections(!s.plain && s.key_kind != KeyKind::kFp8,
                                       int64_t{num_tokens} * num_q_heads, d, plan.max_splits);
  plan.workspace_bytes = std::max(decode_bytes, w.query + w.partial_out + w.partial_lse);
  return plan;
}

void CudaAttention::Run(const AttentionPlan& plan, const AttentionArgs& a,
                        StreamHandle stream) const {
  constexpr const char* kWhere = "CudaAttention::Run";
  const State& s = *state_;
  ValidateAttentionShapes(kWhere, s.shape, a);
  if (plan.num_seqs < 1 || plan.row_tiles < 1 || plan.max_splits < 1) {
    throw Error(fmt::format("{}: the plan was not made by CudaAttention::Plan", kWhere));
  }
  if (a.num_seqs != plan.num_seqs || a.num_tokens != plan.num_tokens ||
      a.num_q_heads != plan.num_q_heads || a.max_blocks_per_seq != plan.max_blocks_per_seq) {
    throw Error(fmt::format(
        "{}: the arguments' shape (num_seqs {}, num_tokens {}, num_q_heads {}, "
        "max_blocks_per_seq {}) differs from the plan's ({}, {}, {}, {})",
        kWhere, a.num_seqs, a.num_tokens, a.num_q_heads, a.max_blocks_per_seq, plan.num_seqs,
        plan.num_tokens, plan.num_q_heads, plan.max_blocks_per_seq));
  }
  if (plan.workspace_bytes > 0 && (a.workspace == nullptr || a.workspace_bytes < plan.workspace_bytes)) {
    throw InvalidArgument(kWhere, "workspace_bytes", a.workspace == nullptr ? 0 : a.workspace_bytes,
                          fmt::format(">= {} (AttentionPlan::workspace_bytes) with a non-null "
                                      "workspace",
                                      plan.workspace_bytes));
  }
  if (a.num_blocks < 1) throw InvalidArgument(kWhere, "num_blocks", a.num_blocks, ">= 1");
  if (reinterpret_cast<uintptr_t>(a.cache) % 16 != 0) {
    throw InvalidArgument(kWhere, "cache", fmt::format("{}", static_cast<const void*>(a.cache)),
                          "a 16-byte aligned device pointer");
  }
  if (plan.decode && a.sliding_window == 0) {
    CudaDecodeArgs da;
    da.query = a.query;
    da.query_dtype = a.query_dtype;
    da.cache = a.cache;
    da.num_blocks = a.num_blocks;
    da.block_tables = a.block_tables;
    da.seq_lens = a.seq_lens;
    da.scale = a.scale;
    da.output = a.output;
    da.output_dtype = a.output_dtype;
    da.lse = a.lse;
    da.workspace = a.workspace;
    da.workspace_bytes = a.workspace_bytes;
    s.decoder.Run(plan.decode_plan, da, stream);
    return;
  }
#if TQKV_HAVE_CUDA
  using namespace attention_detail;
  const int d = head_dim();
  const int64_t rows = int64_t{plan.num_tokens} * plan.num_q_heads;
  const bool rotate = !s.plain && s.key_kind != KeyKind::kFp8;
  const Sections w = WorkspaceSections(rotate, rows, d, plan.max_splits);
  uint8_t* ws = static_cast<uint8_t*>(a.workspace);
  ChunkParams p;
  if (rotate) {
    decode_detail::QueryPrepParams qp;
    qp.query = a.query;
    qp.in_dtype = a.query_dtype;
    qp.rotation = s.rotation.data();
    qp.out = reinterpret_cast<float*>(ws);
    qp.rows = static_cast<int>(rows);
    qp.head_dim = d;
    TQKV_CUDA_CHECK(decode_detail::LaunchQueryPrep(qp, stream));
    p.query = ws;
    p.query_dtype = DType::kF32;
  } else {
    p.query = a.query;
    p.query_dtype = a.query_dtype;
  }
  p.cache = a.cache;
  p.block_tables = a.block_tables;
  p.seq_lens = a.seq_lens;
  p.query_start_loc = a.query_start_loc;
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
  p.num_seqs = plan.num_seqs;
  p.num_q_heads = plan.num_q_heads;
  p.num_kv_heads = num_kv_heads();
  p.block_size = block_size();
  p.max_blocks_per_seq = plan.max_blocks_per_seq;
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
  p.row_tiles = plan.row_tiles;
  p.tokens_per_split = plan.tokens_per_split;
  p.max_splits = plan.max_splits;
  p.sliding_window = a.sliding_window;
  const float scale = a.scale ? *a.scale : 1.0f / std::sqrt(static_cast<float>(d));
  p.score_scale = scale * static_cast<float>(std::numbers::log2e);
  TQKV_CUDA_CHECK(LaunchChunkAttention(s.key_kind, s.value_bits, d, p, stream));
  if (plan.max_splits == 1) return;
  ChunkMergeParams mp;
  mp.partial_out = p.partial_out;
  mp.partial_lse = p.partial_lse;
  mp.output = a.output;
  mp.lse = a.lse;
  mp.out_dtype = a.output_dtype;
  mp.rows = static_cast<int>(rows);
  mp.head_dim = d;
  mp.max_splits = plan.max_splits;
  TQKV_CUDA_CHECK(LaunchChunkMerge(mp, stream));
#else
  (void)s;
  (void)stream;
  throw Error(fmt::format("{}: this build of tqkv has no CUDA support", kWhere));
#endif
}

}  // namespace tqkv
