// Device-side interface of the CUDA decode kernels (attention/decode_*.cu): plain parameter
// structs and launch functions that return the launch status. Included by the kernel files and by
// the host launcher (decode_cuda.cc) in CUDA builds only. No fmt, no exceptions here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "attention/decode_variant.h"
#include "runtime/dtype.h"

namespace tqkv::decode_detail {

// The longest split CudaDecoder::Plan makes (tokens): the staged kernels size their shared-memory
// copy of a split's block ids by it.
inline constexpr int kMaxSplitTokens = 8192;

// A verify pass of CudaAttention on the decode kernels: the plan's query heads of KV head h are
// the pass's columns, `rows` new tokens of each sequence times the call's GQA group. Column c is
// new token i = row_begin + c / group of its sequence (query head h · group + c % group): its
// query and output are the caller's row (query_start_loc[b] + i) · num_q_heads + that head, and
// it sees the context up to that token (positions < seq_len − q_len + i + 1), so one launch does
// the causal part too. Columns past the sequence's new tokens read and write nothing.
// query_start_loc == nullptr: ordinary decode rows.
struct VerifyColumns {
  const int32_t* query_start_loc = nullptr;  // [num_seqs + 1]
  int rows = 0;                              // new tokens per pass
  int row_begin = 0;                         // the pass's first new token
  int group = 0;                             // the call's query heads per KV head
  int num_q_heads = 0;                       // the call's query heads
  // GroupReciprocal(group), set by CudaDecoder::RunColumns: NewTokenOfColumn's multiplier.
  int group_reciprocal = 0;
};

// Everything one decode launch needs. Pointers are device pointers.
struct SplitParams {
  const uint8_t* cache = nullptr;         // [num_blocks, block_bytes]
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens = nullptr;      // [num_seqs]
  // The query [num_seqs, num_q_heads, head_dim] in query_dtype (F32, F16 or BF16): the
  // caller's, rotated by each CTA in its prologue (query_fwht: y = FWHT(q ⊙ signs) · query_scale,
  // the Hadamard kinds' q·Πᵀ; otherwise y = q), or the query prep's fp32 q·Πᵀ for dense Πᵀ.
  const void* query = nullptr;
  const float* query_signs = nullptr;  // [head_dim] ±1 (hadamard_signs) or nullptr
  DType query_dtype = DType::kF32;
  int query_fwht = 0;
  float query_scale = 1.0f;               // 1/√D with query_fwht
  float* partial_out = nullptr;           // [num_seqs, num_q_heads, max_splits, head_dim]
  float* partial_lse = nullptr;           // [num_seqs, num_q_heads, max_splits] natural log
  const uint2* codebook_table = nullptr;  // MSE keys: CodebookTable()
  // With one split per sequence (max_splits == 1) the split kernel writes the final output and
  // LSE itself and no merge runs: output [num_seqs, num_q_heads, head_dim] in out_dtype (F32,
  // 1 fp16, 2 bf16), lse [num_seqs, num_q_heads]. nullptr: partials for the merge.
  void* output = nullptr;
  float* lse = nullptr;
  DType out_dtype = DType::kF32;
  int num_seqs = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int block_size = 0;
  int max_blocks_per_seq = 0;
  int64_t block_bytes = 0;
  int64_t meta_offset = 0;   // compressed: start of the fp16 metadata; bf16: value_offset
  int data_per_slot = 0;     // compressed only
  int key_data_bytes = 0;    // compressed only
  int num_meta = 0;          // compressed only
  int tokens_per_split = 0;  // a multiple of 64
  int max_splits = 0;
  float score_scale = 0.0f;  // softmax scale · log2(e)
  // Launched as a programmatic dependent of the kernel before it in the stream (not a query
  // prep): wait for it (GridDependencyWait) before reading any input or writing anything.
  int wait_at_start = 0;
  // Let the kernel after this one launch once every CTA has finished its chunks (griddepcontrol
  // .launch_dependents): the merge, or a next split grid that fills the SMs anyway.
  int trigger_dependents = 1;
  // The kernel after this one reads nothing this grid writes and waits for it only at its end
  // (CudaAttention's chunk after the call's leading decode rows): let it launch as soon as every
  // CTA has passed its wait at start, so that its CTAs take the SMs as this grid's leave. Needs
  // wait_at_start.
  int trigger_at_start = 0;
  VerifyColumns verify;
  // Sliding window (0: none): the row of a sequence of length len reads positions
  // WindowLo(len, window) .. len − 1 (its position is len − 1, as AttentionArgs::sliding_window
  // defines it; a verify column, ColumnSpan, is the row of a sequence of end0 + its new token).
  // The splits read the sequence from WindowOrigin on (the span's last column's first position
  // rounded up to a block), through its block-table row and positions shifted by it, so that the
  // pipelines are those of a sequence of len − origin tokens; the chunks between the first
  // column's first position and the origin run masked in split 0. Blocks before the one holding
  // that position are not read.
  int window = 0;
};

// A column's first position without a window (SplitCompute::lo_end0, the shared-output kernel's
// masked steps): below any position, also plus a column's new token.
inline constexpr int kNoWindowStart = -(1 << 30);

// Sliding window (SplitParams::window): the first position a one-token row at len − 1 reads,
// the origin its splits start from (block_size: a power of two), and how many splits hold
// tokens: ceil((len − origin) / tokens_per_split), or split 0 alone where only the chunks before
// the origin do.
__host__ __device__ inline int WindowLo(int len, int window) {
  return window > 0 && len > window ? len - window : 0;
}
__host__ __device__ inline int WindowOrigin(int lo, int block_size) {
  return (lo + block_size - 1) & -block_size;
}
__host__ __device__ inline int SplitsHoldingTokens(int len, int tokens_per_split, int window,
                                                   int block_size) {
  const int lo = WindowLo(len, window), origin = WindowOrigin(lo, block_size);
  const int splits = len > origin ? (len - origin + tokens_per_split - 1) / tokens_per_split : 0;
  return lo < origin && splits == 0 ? 1 : splits;
}

struct MergeParams {
  const float* partial_out = nullptr;  // [num_seqs, num_q_heads, max_splits, head_dim]
  const float* partial_lse = nullptr;  // [num_seqs, num_q_heads, max_splits]
  const int32_t* seq_lens = nullptr;   // [num_seqs]
  void* output = nullptr;              // [num_seqs, num_q_heads, head_dim] in out_dtype
  float* lse = nullptr;                // [num_seqs, num_q_heads]
  DType out_dtype = DType::kF32;       // F32, F16 or BF16
  int num_seqs = 0;
  int num_q_heads = 0;
  int head_dim = 0;
  int tokens_per_split = 0;
  int max_splits = 0;
  // As SplitParams::trigger_at_start: the kernel after the merge may launch once every merge CTA
  // has seen the split grid finish.
  int trigger_at_start = 0;
  int num_kv_heads = 0;  // read with verify only
  VerifyColumns verify;
  int window = 0;      // SplitParams::window
  int block_size = 0;  // read with window only
};

// q·Πᵀ for a dense Πᵀ (haar, custom), as its own launch before the split kernel. (Hadamard
// rotations and unrotated kinds need none: the split kernel's prologue does their part.)
struct QueryPrepParams {
  const void* query = nullptr;      // [num_seqs, num_q_heads, head_dim] in in_dtype
  DType in_dtype = DType::kF32;     // F32, F16 or BF16
  const float* rotation = nullptr;  // Πᵀ [head_dim, head_dim]
  float* out = nullptr;             // [rows, head_dim] fp32
  int rows = 0;                     // num_seqs * num_q_heads
  int head_dim = 0;
  // QueryPrepFragments(Πᵀ) on the device, or nullptr. With it (and a 16-byte aligned query) the
  // tensor-core kernel runs: for the many rows of attention's chunk and verify calls, where the
  // 8-row kernel reads all of Πᵀ from L2 once per 8 rows (179 µs of a 2,048-token chunk's call).
  const float* rotation_fragments = nullptr;
};

// Πᵀ [head_dim, head_dim] as the tensor-core query prep's B operands (mma.sync m16n8k8, tf32):
// for output columns 8·nt.. and k-step s, lane l (g = l / 4, t = l % 4) holds Πᵀ[d][8·nt + g] for
// d = head_dim / 4 · t + 2s and d + 1 (this order of the k-slots lets a thread read its part of a
// query row as one contiguous run), each as its tf32 rounding and the tf32 rounding of the
// remainder: four floats at ((nt · head_dim / 8 + s) · 32 + l) · 4. The two parts keep Πᵀ to
// ~22 bits, so q·Πᵀ stays fp32-accurate (16-bit queries are exact in tf32; fp32 queries are
// split the same way in the kernel).
inline float RoundToTf32(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, 4);
  if ((u & 0x7F800000u) != 0x7F800000u) u = (u + 0x0FFFu + ((u >> 13) & 1u)) & 0xFFFFE000u;
  float y;
  __builtin_memcpy(&y, &u, 4);
  return y;
}
inline std::vector<float> QueryPrepFragments(const std::vector<float>& rotation, int head_dim) {
  const int d = head_dim, steps = d / 8;
  std::vector<float> f(static_cast<size_t>(d) * d * 2);
  for (int nt = 0; nt < d / 8; ++nt) {
    for (int s = 0; s < steps; ++s) {
      for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        float* at = f.data() + ((static_cast<size_t>(nt) * steps + s) * 32 + l) * 4;
        for (int k = 0; k < 2; ++k) {
          const float w = rotation[static_cast<size_t>(d / 4 * t + 2 * s + k) * d + 8 * nt + g];
          at[k] = RoundToTf32(w);
          at[2 + k] = RoundToTf32(w - at[k]);
        }
      }
    }
  }
  return f;
}

// The key codebook table of the split kernel: entry e = a code pair (e & (2^bits - 1), e >> bits)
// as two words, the fp16 pair of the hi parts (low code in the low half) and the pair of the
// remainders c - hi. The kernel replicates each entry once per lane of a half-warp (16 times) in
// shared memory.
// `hi` and `lo` hold the 2^bits centroids as fp16 bits.
inline std::vector<uint32_t> CodebookTable(int key_bits, const uint16_t* hi, const uint16_t* lo) {
  const int n = 1 << key_bits, mask = n - 1;
  std::vector<uint32_t> words(static_cast<size_t>(n) * n * 2);
  for (int e = 0; e < n * n; ++e) {
    words[2 * static_cast<size_t>(e)] =
        uint32_t{hi[e & mask]} | (uint32_t{hi[e >> key_bits]} << 16);
    words[2 * static_cast<size_t>(e) + 1] =
        uint32_t{lo[e & mask]} | (uint32_t{lo[e >> key_bits]} << 16);
  }
  return words;
}

// LaunchDecodeSplits (below): launches the split kernel `variant` (a value ChooseSplitVariant
// returned). programmatic: launched as a programmatic dependent of the kernel before it in the
// stream, so that its launch overlaps that kernel's tail: after LaunchQueryPrep (p.wait_at_start =
// 0: it reads the cache before it waits for the query prep's q·Πᵀ, which an ordinary launch of the
// query prep makes safe), or after any kernel with p.wait_at_start = 1. Otherwise an ordinary
// launch, ordered after all earlier work in the stream. Paired variants need an even p.num_kv_heads
// (cudaErrorInvalidValue otherwise, as for a variant that was never instantiated).
// DecodeSplitCtasPerSm (below): how many CTAs of the split kernel `variant` fit on one SM at
// once (registers, shared memory), counting a paired CTA as its two 4-warp units.
cudaError_t LaunchDecodeMerge(const MergeParams& p, cudaStream_t stream);
cudaError_t LaunchQueryPrep(const QueryPrepParams& p, cudaStream_t stream);

// The split kernels of one key kind (decode_split_<kind>.cu, one instantiation unit per kind so
// that nvcc builds them in parallel); LaunchDecodeSplits and DecodeSplitCtasPerSm pick by kind.
template <KeyKind kKind>
cudaError_t LaunchSplitKernelOfKind(const SplitParams& p, const SplitVariant& variant,
                                    bool programmatic, cudaStream_t stream);
template <KeyKind kKind>
cudaError_t SplitKernelOfKindCtasPerSm(const SplitVariant& variant, int* ctas);

#define TQKV_DECODE_KIND_EXTERN(kind)                               \
  extern template cudaError_t LaunchSplitKernelOfKind<kind>(        \
      const SplitParams&, const SplitVariant&, bool, cudaStream_t); \
  extern template cudaError_t SplitKernelOfKindCtasPerSm<kind>(const SplitVariant&, int*);
TQKV_DECODE_KIND_EXTERN(KeyKind::kMse4)
TQKV_DECODE_KIND_EXTERN(KeyKind::kMse3)
TQKV_DECODE_KIND_EXTERN(KeyKind::kFp8)
TQKV_DECODE_KIND_EXTERN(KeyKind::kBf16)
TQKV_DECODE_KIND_EXTERN(KeyKind::kF16)
#undef TQKV_DECODE_KIND_EXTERN

inline cudaError_t LaunchDecodeSplits(const SplitParams& p, const SplitVariant& variant,
                                      bool programmatic, cudaStream_t stream) {
  switch (variant.kind) {
    case KeyKind::kMse4:
      return LaunchSplitKernelOfKind<KeyKind::kMse4>(p, variant, programmatic, stream);
    case KeyKind::kMse3:
      return LaunchSplitKernelOfKind<KeyKind::kMse3>(p, variant, programmatic, stream);
    case KeyKind::kFp8:
      return LaunchSplitKernelOfKind<KeyKind::kFp8>(p, variant, programmatic, stream);
    case KeyKind::kBf16:
      return LaunchSplitKernelOfKind<KeyKind::kBf16>(p, variant, programmatic, stream);
    case KeyKind::kF16:
      return LaunchSplitKernelOfKind<KeyKind::kF16>(p, variant, programmatic, stream);
  }
  return cudaErrorInvalidValue;
}

inline cudaError_t DecodeSplitCtasPerSm(const SplitVariant& variant, int* ctas) {
  switch (variant.kind) {
    case KeyKind::kMse4:
      return SplitKernelOfKindCtasPerSm<KeyKind::kMse4>(variant, ctas);
    case KeyKind::kMse3:
      return SplitKernelOfKindCtasPerSm<KeyKind::kMse3>(variant, ctas);
    case KeyKind::kFp8:
      return SplitKernelOfKindCtasPerSm<KeyKind::kFp8>(variant, ctas);
    case KeyKind::kBf16:
      return SplitKernelOfKindCtasPerSm<KeyKind::kBf16>(variant, ctas);
    case KeyKind::kF16:
      return SplitKernelOfKindCtasPerSm<KeyKind::kF16>(variant, ctas);
  }
  return cudaErrorInvalidValue;
}

}  // namespace tqkv::decode_detail
