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

// One CTA per sequence: the pass's rows of the sequence as decode columns, and the length of the
// context they share.
__global__ void GatherVerifyRowsKernel(const VerifyGroupParams p) {
  const int b = blockIdx.x;
  const int q0 = p.query_start_loc[b], q_len = p.query_start_loc[b + 1] - q0;
  const int group = p.num_q_heads / p.num_kv_heads, columns = p.rows * group;
  if (threadIdx.x == 0) {
    p.gathered_lens[b] = q_len > p.row_begin ? p.seq_lens[b] - q_len + p.row_begin + 1 : 0;
  }
  const int n = p.num_kv_heads * columns * p.head_dim;
  for (int u = threadIdx.x; u < n; u += blockDim.x) {
    const int e = u % p.head_dim, col = u / p.head_dim;
    const int h = col / columns, c = col % columns;
    const int i = p.row_begin + c / group, g = c % group;
    float x = 0.0f;
    if (i < q_len) {
      const int64_t at = (int64_t{q0 + i} * p.num_q_heads + h * group + g) * p.head_dim + e;
      if (p.query_dtype == DType::kF32) {
        x = static_cast<const float*>(p.query)[at];
      } else if (p.query_dtype == DType::kF16) {
        x = __half2float(static_cast<const __half*>(p.query)[at]);
      } else {
        x = __bfloat162float(static_cast<const __nv_bfloat16*>(p.query)[at]);
      }
    }
    p.gathered_query[int64_t{b} * n + u] = x;
  }
}

// Code i of a little-endian bit stream of `bits`-bit codes.
__device__ __forceinline__ uint32_t UnpackCode(const uint8_t* codes, int i, int bits) {
  const int bit = i * bits;
  uint32_t two = codes[bit / 8];
  if (bit % 8 + bits > 8) two |= uint32_t{codes[bit / 8 + 1]} << 8;  // never past the stream
  return (two >> (bit % 8)) & ((1u << bits) - 1u);
}

constexpr int kMaxVerifyTail = 15;  // a pass has at most 16 rows: each row's tail is shorter

// One CTA (4 warps) per (sequence, KV head): the tail tokens of the pass's rows dequantized into
// shared memory in fp32, then per row (a warp each) its scores against its own tail, merged with
// the decode's output and LSE for the shared context.
__global__ void FinishVerifyRowsKernel(const VerifyGroupParams p) {
  extern __shared__ float tail[];  // keys [kMaxVerifyTail][D], then values
  const int b = blockIdx.x, h = blockIdx.y;
  const int q0 = p.query_start_loc[b], q_len = p.query_start_loc[b + 1] - q0;
  const int last = min(q_len, p.row_begin + p.rows) - 1;  // the pass's last row
  if (last < p.row_begin) return;
  const int d = p.head_dim, group = p.num_q_heads / p.num_kv_heads;
  const int first_tail = p.seq_lens[b] - q_len + p.row_begin + 1;
  const int n_tail = last - p.row_begin;
  const int32_t* table = p.block_tables + int64_t{b} * p.max_blocks_per_seq;
  float* keys = tail;
  float* values = tail + kMaxVerifyTail * d;
  const bool plain = p.kind == KeyKind::kBf16 || p.kind == KeyKind::kF16;
  for (int u = threadIdx.x; u < n_tail * d; u += blockDim.x) {
    const int j = u / d, e = u % d, t = first_tail + j;
    const uint8_t* block = p.cache + int64_t{table[t / p.block_size]} * p.block_bytes;
    const int pos = t % p.block_size;
    float k, v;
    if (plain) {
      const int64_t at = 2 * ((int64_t{pos} * p.num_kv_heads + h) * d + e);
      const uint16_t kb = *reinterpret_cast<const uint16_t*>(block + at);
      const uint16_t vb = *reinterpret_cast<const uint16_t*>(block + p.meta_offset + at);
      k = p.kind == KeyKind::kF16 ? __half2float(__ushort_as_half(kb))
                                  : __bfloat162float(__ushort_as_bfloat16(kb));
      v = p.kind == KeyKind::kF16 ? __half2float(__ushort_as_half(vb))
                                  : __bfloat162float(__ushort_as_bfloat16(vb));
    } else {
      const uint8_t* slot = block + (int64_t{pos} * p.num_kv_heads + h) * p.data_per_slot;
      const __half* meta = reinterpret_cast<const __half*>(block + p.meta_offset) +
                           int64_t{h} * p.num_meta * p.block_size + pos;
      int f = 0;
      if (p.kind == KeyKind::kFp8) {
        const uint32_t h2 = decode_detail::E4M3x2ToHalf2(slot[e]);
        k = __half2float(__ushort_as_half(static_cast<uint16_t>(h2 & 0xFFFFu)));
      } else {
        const float norm = __half2float(meta[p.block_size * f++]);
        k = norm * p.centroids[UnpackCode(slot, e, p.key_bits)];
      }
      const float vs = __half2float(meta[p.block_size * f++]);
      const float vz = __half2float(meta[p.block_size * f]);
      v = fmaf(static_cast<float>(UnpackCode(slot + p.key_data_bytes, e, p.value_bits)), vs, vz);
    }
    keys[j * d + e] = k;
    values[j * d + e] = v;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int columns = p.rows * group;
  for (int r = warp; r < (last - p.row_begin + 1) * group; r += blockDim.x >> 5) {
    const int ii = r / group, g = r % group, i = p.row_begin + ii;
    const int64_t row = int64_t{q0 + i} * p.num_q_heads + h * group + g;
    const int64_t drow = (int64_t{b} * p.num_kv_heads + h) * columns + r;
    float s[kMaxVerifyTail];
    float m = p.decode_lse[drow];
#pragma unroll
    for (int j = 0; j < kMaxVerifyTail; ++j) {
      if (j >= ii) break;
      float dot = 0.0f;
      for (int e = lane; e < d; e += 32) {
        const float q = p.mapped_query != nullptr
                            ? p.mapped_query[row * d + e]
                            : (p.query_dtype == DType::kF32
                                   ? static_cast<const float*>(p.query)[row * d + e]
                               : p.query_dtype == DType::kF16
                                   ? __half2float(static_cast<const __half*>(p.query)[row * d + e])
                                   : __bfloat162float(
                                         static_cast<const __nv_bfloat16*>(p.query)[row * d + e]));
        dot = fmaf(q, keys[j * d + e], dot);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      s[j] = dot * p.scale;
      m = fmaxf(m, s[j]);
    }
    const float lse_d = p.decode_lse[drow];
    const float w_d = lse_d == -INFINITY ? 0.0f : __expf(lse_d - m);
    float denom = w_d;
#pragma unroll
    for (int j = 0; j < kMaxVerifyTail; ++j) {
      if (j >= ii) break;
      s[j] = __expf(s[j] - m);
      denom += s[j];
    }
    for (int e = lane; e < d; e += 32) {
      float x = w_d * p.decode_out[drow * d + e];
#pragma unroll
      for (int j = 0; j < kMaxVerifyTail; ++j) {
        if (j >= ii) break;
        x = fmaf(s[j], values[j * d + e], x);
      }
      decode_detail::StoreOutput(p.output, p.out_dtype, row * d + e,
                                 denom > 0.0f ? x / denom : 0.0f);
    }
    if (lane == 0) p.lse[row] = denom > 0.0f ? m + __logf(denom) : -INFINITY;
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

cudaError_t LaunchGatherVerifyRows(const VerifyGroupParams& p, cudaStream_t stream) {
  GatherVerifyRowsKernel<<<static_cast<unsigned>(p.num_seqs), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchFinishVerifyRows(const VerifyGroupParams& p, cudaStream_t stream) {
  if (p.rows < 1 || p.rows > kMaxVerifyTail + 1) return cudaErrorInvalidValue;
  const int smem = 2 * kMaxVerifyTail * p.head_dim * static_cast<int>(sizeof(float));
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_kv_heads));
  FinishVerifyRowsKernel<<<grid, 128, smem, stream>>>(p);
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

cudaError_t LaunchPrefillAttention(KeyKind kind, int value_bits, int head_dim,
                                   const ChunkParams& p, cudaStream_t stream) {
  switch (kind) {
    case KeyKind::kMse4:
      return LaunchPrefillOfKind<KeyKind::kMse4>(value_bits, head_dim, p, stream);
    case KeyKind::kMse3:
      return LaunchPrefillOfKind<KeyKind::kMse3>(value_bits, head_dim, p, stream);
    case KeyKind::kFp8:
      return LaunchPrefillOfKind<KeyKind::kFp8>(value_bits, head_dim, p, stream);
    case KeyKind::kBf16:
      return LaunchPrefillOfKind<KeyKind::kBf16>(value_bits, head_dim, p, stream);
    case KeyKind::kF16:
      return LaunchPrefillOfKind<KeyKind::kF16>(value_bits, head_dim, p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace tqkv::attention_detail
