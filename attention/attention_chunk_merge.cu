// The split merge of the chunk attention kernels and the dispatch by key kind.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "attention/attention_launch.h"
#include "attention/decode_device.cuh"

namespace tqkv::attention_detail {
namespace {

// One CTA per output row (token, query head), one thread per d: the log-sum-exp merge of the
// row's split partials (an empty split has lse −inf and weight 0).
__global__ void ChunkMergeKernel(const ChunkMergeParams p) {
  const int64_t row = blockIdx.x;
  const int d = threadIdx.x;
  const float* lse = p.partial_lse + row * p.max_splits;
  float m = -INFINITY;
  for (int s = 0; s < p.max_splits; ++s) m = fmaxf(m, lse[s]);
  float sum = 0.0f, x = 0.0f;
  if (m != -INFINITY) {
    for (int s = 0; s < p.max_splits; ++s) {
      const float w = __expf(lse[s] - m);
      sum += w;
      x += w * p.partial_out[(row * p.max_splits + s) * p.head_dim + d];
    }
  }
  const bool empty = sum == 0.0f;
  decode_detail::StoreOutput(p.output, p.out_dtype, row * p.head_dim + d, empty ? 0.0f : x / sum);
  if (d == 0) p.lse[row] = empty ? -INFINITY : m + __logf(sum);
}

// One CTA per sequence: its query row (one new token) or zeros, its length or 0, and its rows'
// partials marked empty.
__global__ void GatherDecodeRowsKernel(const DecodeRowsParams p) {
  const int b = blockIdx.x;
  const int q0 = p.query_start_loc[b];
  const bool single = p.query_start_loc[b + 1] - q0 == 1;
  if (threadIdx.x == 0) p.gathered_lens[b] = single ? p.seq_lens[b] : 0;
  const int n = p.num_q_heads * p.head_dim;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float x = 0.0f;
    if (single) {
      const int64_t at = int64_t{q0} * n + i;
      if (p.query_dtype == DType::kF32) {
        x = static_cast<const float*>(p.query)[at];
      } else if (p.query_dtype == DType::kF16) {
        x = __half2float(static_cast<const __half*>(p.query)[at]);
      } else {
        x = __bfloat162float(static_cast<const __nv_bfloat16*>(p.query)[at]);
      }
    }
    p.gathered_query[int64_t{b} * n + i] = x;
  }
  if (single && p.partial_lse != nullptr) {
    for (int i = threadIdx.x; i < p.num_q_heads * p.max_splits; i += blockDim.x) {
      p.partial_lse[int64_t{q0} * p.num_q_heads * p.max_splits + i] = -INFINITY;
    }
  }
}

// One CTA per sequence: each of its rows' length and block-table row.
__global__ void VerifyRowsKernel(const VerifyRowsParams p) {
  const int b = blockIdx.x;
  const int q0 = p.query_start_loc[b], q1 = p.query_start_loc[b + 1];
  const int32_t* table = p.block_tables + int64_t{b} * p.max_blocks_per_seq;
  for (int t = q0; t < q1; ++t) {
    if (threadIdx.x == 0) p.row_lens[t] = p.seq_lens[b] - q1 + t + 1;
    int32_t* row = p.row_tables + int64_t{t} * p.max_blocks_per_seq;
    for (int i = threadIdx.x; i < p.max_blocks_per_seq; i += blockDim.x) row[i] = table[i];
  }
}

__global__ void ScatterDecodeRowsKernel(const DecodeRowsParams p) {
  const int b = blockIdx.x;
  const int q0 = p.query_start_loc[b];
  if (p.query_start_loc[b + 1] - q0 != 1) return;
  const int n = p.num_q_heads * p.head_dim;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    decode_detail::StoreOutput(p.output, p.out_dtype, int64_t{q0} * n + i,
                               p.decode_out[int64_t{b} * n + i]);
  }
  for (int h = threadIdx.x; h < p.num_q_heads; h += blockDim.x) {
    p.lse[int64_t{q0} * p.num_q_heads + h] = p.decode_lse[int64_t{b} * p.num_q_heads + h];
  }
}

}  // namespace

cudaError_t LaunchVerifyRows(const VerifyRowsParams& p, cudaStream_t stream) {
  VerifyRowsKernel<<<static_cast<unsigned>(p.num_seqs), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchGatherDecodeRows(const DecodeRowsParams& p, cudaStream_t stream) {
  GatherDecodeRowsKernel<<<static_cast<unsigned>(p.num_seqs), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchScatterDecodeRows(const DecodeRowsParams& p, cudaStream_t stream) {
  ScatterDecodeRowsKernel<<<static_cast<unsigned>(p.num_seqs), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchChunkMerge(const ChunkMergeParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  ChunkMergeKernel<<<static_cast<unsigned>(p.rows), p.head_dim, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchChunkAttention(KeyKind kind, int value_bits, int head_dim, const ChunkParams& p,
                                 cudaStream_t stream) {
  switch (kind) {
    case KeyKind::kMse4:
      return LaunchChunkOfKind<KeyKind::kMse4>(value_bits, head_dim, p, stream);
    case KeyKind::kMse3:
      return LaunchChunkOfKind<KeyKind::kMse3>(value_bits, head_dim, p, stream);
    case KeyKind::kFp8:
      return LaunchChunkOfKind<KeyKind::kFp8>(value_bits, head_dim, p, stream);
    case KeyKind::kBf16:
      return LaunchChunkOfKind<KeyKind::kBf16>(value_bits, head_dim, p, stream);
    case KeyKind::kF16:
      return LaunchChunkOfKind<KeyKind::kF16>(value_bits, head_dim, p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace tqkv::attention_detail
