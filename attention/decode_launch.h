// Device-side interface of the CUDA decode kernels (attention/decode_kernels.cu): plain parameter
// structs and launch functions that return the launch status. Included by the kernel file and by
// the host launcher (decode_cuda.cc) in CUDA builds only. No fmt, no exceptions here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace tqkv::decode_detail {

// How keys are stored; picks the kernel family.
enum class KeyKind : int {
  kMse4 = 0,  // 4-bit codebook indices + fp16 norm (turboquant_4bit_nc)
  kMse3 = 1,  // 3-bit codebook indices + fp16 norm (turboquant_k3v4_nc, turboquant_3bit_nc)
  kFp8 = 2,   // FP8 E4M3 per element (turboquant_k8v4)
  kBf16 = 3,  // uncompressed bf16 K and V (the baseline layout of Bf16BlockFormat)
  kF16 = 4,   // uncompressed fp16 K and V (Bf16BlockFormat with dtype F16)
};

// The uncompressed kinds (one kernel family, fp16 or bf16 MMAs).
// clang-format off
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr bool IsPlain(KeyKind k) { return k == KeyKind::kBf16 || k == KeyKind::kF16; }
// clang-format on

// The longest split CudaDecoder::Plan makes (tokens): the staged kernels size their shared-memory
// copy of a split's block ids by it.
inline constexpr int kMaxSplitTokens = 8192;

// Everything one decode launch needs. Pointers are device pointers.
struct SplitParams {
  const uint8_t* cache = nullptr;         // [num_blocks, block_bytes]
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens = nullptr;      // [num_seqs]
  // The query [num_seqs, num_q_heads, head_dim] in query_dtype (0 fp32, 1 fp16, 2 bf16): the
  // caller's, rotated by each CTA in its prologue (query_fwht: y = FWHT(q ⊙ signs) · query_scale,
  // the Hadamard kinds' q·Πᵀ; otherwise y = q), or the query prep's fp32 q·Πᵀ for dense Πᵀ.
  const void* query = nullptr;
  const float* query_signs = nullptr;  // [head_dim] ±1 (hadamard_signs) or nullptr
  int query_dtype = 0;
  int query_fwht = 0;
  float query_scale = 1.0f;               // 1/√D with query_fwht
  float* partial_out = nullptr;           // [num_seqs, num_q_heads, max_splits, head_dim]
  float* partial_lse = nullptr;           // [num_seqs, num_q_heads, max_splits] natural log
  const uint2* codebook_table = nullptr;  // MSE keys: CodebookTable()
  // With one split per sequence (max_splits == 1) the split kernel writes the final output and
  // LSE itself and no merge runs: output [num_seqs, num_q_heads, head_dim] in out_dtype (0 fp32,
  // 1 fp16, 2 bf16), lse [num_seqs, num_q_heads]. nullptr: partials for the merge.
  void* output = nullptr;
  float* lse = nullptr;
  int out_dtype = 0;
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
};

struct MergeParams {
  const float* partial_out = nullptr;  // [num_seqs, num_q_heads, max_splits, head_dim]
  const float* partial_lse = nullptr;  // [num_seqs, num_q_heads, max_splits]
  const int32_t* seq_lens = nullptr;   // [num_seqs]
  void* output = nullptr;              // [num_seqs, num_q_heads, head_dim] in out_dtype
  float* lse = nullptr;                // [num_seqs, num_q_heads]
  int out_dtype = 0;                   // 0 fp32, 1 fp16, 2 bf16
  int num_seqs = 0;
  int num_q_heads = 0;
  int head_dim = 0;
  int tokens_per_split = 0;
  int max_splits = 0;
};

// q·Πᵀ for a dense Πᵀ (haar, custom), as its own launch before the split kernel. (Hadamard
// rotations and unrotated kinds need none: the split kernel's prologue does their part.)
struct QueryPrepParams {
  const void* query = nullptr;      // [num_seqs, num_q_heads, head_dim] in in_dtype
  int in_dtype = 0;                 // 0 fp32, 1 fp16, 2 bf16
  const float* rotation = nullptr;  // Πᵀ [head_dim, head_dim]
  float* out = nullptr;             // [rows, head_dim] fp32
  int rows = 0;  // num_seqs * num_q_heads
  int head_dim = 0;
};

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

// group = num_q_heads / num_kv_heads (1..16). programmatic: launched as a programmatic dependent
// of the kernel before it in the stream, so that its launch overlaps that kernel's tail: after
// LaunchQueryPrep (p.wait_at_start = 0: it reads the cache before it waits for the query prep's
// q·Πᵀ, which an ordinary launch of the query prep makes safe), or after any kernel with
// p.wait_at_start = 1. Otherwise an ordinary launch, ordered after all earlier work in the stream.
// narrow: the narrow variant of the staged kernel (4 warps per CTA instead of 8; 3-bit keys, 4-bit
// values, D = 128, group <= 4 only: cudaErrorInvalidValue elsewhere). hi_only: 3-bit keys' 8-warp
// staged kernel scores from the codebook's hi parts alone (the table must come from a codebook
// that ScaleCodebookForFp16 put within kMaxHiOnlyError of fp16); false: its hi + lo twin. With
// narrow, hi_only runs the narrow layout on that twin's paired CTAs (KV heads 2y and 2y + 1 in one
// 8-warp CTA: p.num_kv_heads must be even, else cudaErrorInvalidValue). Other kernels ignore it.
// one_cta: 4-bit keys' 8-warp staged kernel runs as its twin compiled for one CTA per SM (more
// registers; for grids that fit the SMs: DecodePlan::one_cta). Other kernels ignore it.
cudaError_t LaunchDecodeSplits(const SplitParams& p, KeyKind kind, int value_bits, int head_dim,
                               int group, bool narrow, bool hi_only, bool one_cta,
                               bool programmatic, cudaStream_t stream);
// How many CTAs of that split kernel (or of its narrow variant: 0 where there is none) fit on one
// SM at once (registers, shared memory), and whether it is a staged kernel (cp.async stages in
// shared memory).
cudaError_t DecodeSplitCtasPerSm(KeyKind kind, int value_bits, int head_dim, int group, bool narrow,
                                 int* ctas, bool* staged);
cudaError_t LaunchDecodeMerge(const MergeParams& p, cudaStream_t stream);
// The TQKV_DECODE_PHASE_TIMES measurement build (tools/bench/NOTES.md, session 19): copies the
// earliest and latest %globaltimer (ns) at which any warp passed each of the 9 points (split
// kernel: entry, after the dependency wait, before and after the prologue's finish (staged
// compressed kernels only), after the chunks, exit; merge kernel: entry, after its wait, exit)
// into first[9] and last[9] (if first is not null), and per split CTA (up to 1,024, linear block
// index) the earliest and latest time one of its warps finished its chunks and its SM (if
// cta_first is not null) and when its last warp finished the prologue (staged kernels, if
// cta_start is not null), then resets them. cudaErrorNotSupported in every other build.
cudaError_t DecodePhaseTimes(unsigned long long* first, unsigned long long* last,
                             unsigned long long* cta_first = nullptr,
                             unsigned long long* cta_last = nullptr, unsigned* cta_sm = nullptr,
                             unsigned long long* cta_start = nullptr);
cudaError_t LaunchQueryPrep(const QueryPrepParams& p, cudaStream_t stream);

}  // namespace tqkv::decode_detail
