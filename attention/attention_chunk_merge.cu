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

// A query element of the call's query in its dtype, as float.
__device__ __forceinline__ float LoadQuery(const void* query, DType dtype, int64_t at) {
  if (dtype == DType::kF32) return static_cast<const float*>(query)[at];
  if (dtype == DType::kF16) return __half2float(static_cast<const __half*>(query)[at]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(query)[at]);
}

// The gathers and the scatter move rows in pieces of 8 elements, one piece per thread, with
// 16-byte loads and stores where the pointers allow (vec: 16-byte aligned, head_dim a multiple of
// 8); a CTA per sequence and element, or with scalar loads, took 8.6 µs to gather the 64 × 4k
// verify's 4 MB (ncu, H200): latency-bound, two rounds of dependent loads per tiny CTA.
constexpr int kPiece = 8;
constexpr int kCopyThreads = 256;

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Elements [at, at + n) (n <= 8) of the query as float; the rest 0.
__device__ __forceinline__ void LoadQueryPiece(const void* query, DType dtype, int64_t at, int n,
                                               bool vec, float (&x)[kPiece]) {
  if (vec && n == kPiece) {
    if (dtype == DType::kF32) {
      const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(query) + at);
      const float4 u = __ldg(src), v = __ldg(src + 1);
      x[0] = u.x, x[1] = u.y, x[2] = u.z, x[3] = u.w, x[4] = v.x, x[5] = v.y, x[6] = v.z,
      x[7] = v.w;
    } else {
      const uint4 u =
          __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(query) + at));
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int j = 0; j < kPiece; ++j) {
        const auto bits = static_cast<uint16_t>(w[j / 2] >> (16 * (j % 2)));
        x[j] = dtype == DType::kF16 ? __half2float(__ushort_as_half(bits))
                                    : __bfloat162float(__ushort_as_bfloat16(bits));
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kPiece; ++j) x[j] = j < n ? LoadQuery(query, dtype, at + j) : 0.0f;
}

__device__ __forceinline__ void StoreF32Piece(float* dst, int n, bool vec,
                                              const float (&x)[kPiece]) {
  if (vec && n == kPiece) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(x[0], x[1], x[2], x[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(x[4], x[5], x[6], x[7]);
    return;
  }
  for (int j = 0; j < n; ++j) dst[j] = x[j];
}

// Grid (num_seqs, pieces of num_q_heads · head_dim / 256 threads): the sequence's query row (a
// one-token sequence) or zeros; the sequence's length (q_len 1) or 0; its rows' split partials
// marked empty.
__global__ void GatherDecodeRowsKernel(const DecodeRowsParams p, bool vec) {
  const int b = blockIdx.x;
  const int q0 = p.query_start_loc[b];
  const bool single = p.query_start_loc[b + 1] - q0 == 1;
  const int pieces = (p.head_dim + kPiece - 1) / kPiece;
  const int u = blockIdx.y * blockDim.x + threadIdx.x;  // piece u of the row's heads
  if (u < p.num_q_heads * pieces) {
    const int h = u / pieces, e0 = (u % pieces) * kPiece, n = min(kPiece, p.head_dim - e0);
    const int64_t at = int64_t{h} * p.head_dim + e0;
    const int64_t row = int64_t{p.num_q_heads} * p.head_dim;
    float x[kPiece] = {};
    if (single) LoadQueryPiece(p.query, p.query_dtype, q0 * row + at, n, vec, x);
    StoreF32Piece(p.gathered_query + b * row + at, n, vec, x);
  }
  if (blockIdx.y != 0) return;
  if (threadIdx.x == 0) p.gathered_lens[b] = single ? p.seq_lens[b] : 0;
  if (single && p.partial_lse != nullptr) {
    for (int i = threadIdx.x; i < p.num_q_heads * p.max_splits; i += blockDim.x) {
      p.partial_lse[int64_t{q0} * p.num_q_heads * p.max_splits + i] = -INFINITY;
    }
  }
}

// Grid (num_seqs, num_kv_heads): the pass's rows of the sequence as the KV head's decode columns,
// and the length of the context they share.
__global__ void GatherVerifyRowsKernel(const VerifyGroupParams p, bool vec) {
  const int b = blockIdx.x, h = blockIdx.y;
  const int q0 = p.query_start_loc[b], q_len = p.query_start_loc[b + 1] - q0;
  const int group = p.num_q_heads / p.num_kv_heads, columns = p.rows * group;
  if (h == 0 && threadIdx.x == 0) {
    p.gathered_lens[b] = q_len > p.row_begin ? p.seq_lens[b] - q_len + p.row_begin + 1 : 0;
  }
  const int pieces = (p.head_dim + kPiece - 1) / kPiece;
#pragma unroll 2
  for (int u = threadIdx.x; u < columns * pieces; u += blockDim.x) {
    const int c = u / pieces, e0 = (u % pieces) * kPiece, n = min(kPiece, p.head_dim - e0);
    const int i = p.row_begin + c / group, g = c % group;
    float x[kPiece] = {};
    if (i < q_len) {
      const int64_t at = (int64_t{q0 + i} * p.num_q_heads + h * group + g) * p.head_dim + e0;
      LoadQueryPiece(p.query, p.query_dtype, at, n, vec, x);
    }
    StoreF32Piece(
        p.gathered_query + ((int64_t{b} * p.num_kv_heads + h) * columns + c) * p.head_dim + e0, n,
        vec, x);
  }
}

// Code i of a little-endian bit stream of `bits`-bit codes.
__device__ __forceinline__ uint32_t UnpackCode(const uint8_t* codes, int i, int bits) {
  const int bit = i * bits;
  uint32_t two = codes[bit / 8];
  if (bit % 8 + bits > 8) two |= uint32_t{codes[bit / 8 + 1]} << 8;  // never past the stream
  return (two >> (bit % 8)) & ((1u << bits) - 1u);
}

constexpr int kMaxVerifyTail = 15;         // a pass has at most 16 rows: each row's tail is shorter
constexpr int kMaxFinishLanes = 256 / 32;  // head_dim / 32 elements of a row per lane

// One CTA per (sequence, KV head), a warp per row of the pass (up to 16): the tail tokens of the
// pass's rows dequantized into shared memory in fp32, then per row its scores against its own
// tail (its query held in registers), merged with the decode's output and LSE for the shared
// context. Every global load of a row is issued before its first use: with 4 warps and the query
// reloaded per tail token this kernel took 23.7 µs at 64 × 4k, 4 new tokens (ncu, H200). A
// Hadamard Πᵀ is applied here (query_fwht: the warp's FWHT of the row), a dense one by the query
// prep before.
template <int kLanes>
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

  // The row's query, decode output and LSE, loaded while the tail is dequantized.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int columns = p.rows * group;
  const int r = warp;  // the pass's row (new token row_begin + r / group, head h · group + g)
  const bool has_row = r < (last - p.row_begin + 1) * group;
  const int ii = r / group, g = r % group;
  const int64_t row = int64_t{q0 + p.row_begin + ii} * p.num_q_heads + h * group + g;
  const int64_t drow = (int64_t{b} * p.num_kv_heads + h) * columns + r;
  float q[kLanes], o[kLanes];
  float lse_d = -INFINITY;
  if (has_row) {
#pragma unroll
    for (int k = 0; k < kLanes; ++k) {
      const int e = lane + 32 * k;
      q[k] = 0.0f;
      if (e < d) {
        if (ii > 0) {
          q[k] = p.mapped_query != nullptr ? p.mapped_query[row * d + e]
                                           : LoadQuery(p.query, p.query_dtype, row * d + e);
          if (p.query_signs != nullptr) q[k] *= p.query_signs[e];
        }
      }
    }
    if (p.query_fwht && ii > 0) {  // element lane + 32k: bits 0-4 the lane's, the rest k's
#pragma unroll
      for (int m = 1; m < kLanes; m <<= 1) {
#pragma unroll
        for (int k = 0; k < kLanes; ++k) {
          if ((k & m) == 0) {
            const float u = q[k], v = q[k + m];
            q[k] = u + v;
            q[k + m] = u - v;
          }
        }
      }
#pragma unroll
      for (int m = 1; m < 32; m <<= 1) {
#pragma unroll
        for (int k = 0; k < kLanes; ++k) {
          const float o = __shfl_xor_sync(0xffffffffu, q[k], m);
          q[k] = (lane & m) ? o - q[k] : q[k] + o;
        }
      }
#pragma unroll
      for (int k = 0; k < kLanes; ++k) q[k] *= p.query_scale;
    }
  }
  // Launched as a programmatic dependent of the decode's last kernel: all of the above (the tail,
  // the query) overlaps that grid's end; its output and LSE only after it has finished.
  decode_detail::GridDependencyWait();
  if (has_row) {
    lse_d = p.decode_lse[drow];
#pragma unroll
    for (int k = 0; k < kLanes; ++k) {
      const int e = lane + 32 * k;
      o[k] = e < d ? p.decode_out[drow * d + e] : 0.0f;
    }
  }
  __syncthreads();
  if (!has_row) return;
  float s[kMaxVerifyTail];
  float m = lse_d;
#pragma unroll
  for (int j = 0; j < kMaxVerifyTail; ++j) {
    if (j >= ii) break;
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < kLanes; ++k) {
      const int e = lane + 32 * k;
      if (e < d) dot = fmaf(q[k], keys[j * d + e], dot);
    }
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, x);
    s[j] = dot * p.scale;
    m = fmaxf(m, s[j]);
  }
  const float w_d = lse_d == -INFINITY ? 0.0f : __expf(lse_d - m);
  float denom = w_d;
#pragma unroll
  for (int j = 0; j < kMaxVerifyTail; ++j) {
    if (j >= ii) break;
    s[j] = __expf(s[j] - m);
    denom += s[j];
  }
#pragma unroll
  for (int k = 0; k < kLanes; ++k) {
    const int e = lane + 32 * k;
    if (e >= d) break;
    float x = w_d * o[k];
#pragma unroll
    for (int j = 0; j < kMaxVerifyTail; ++j) {
      if (j >= ii) break;
      x = fmaf(s[j], values[j * d + e], x);
    }
    decode_detail::StoreOutput(p.output, p.out_dtype, row * d + e, denom > 0.0f ? x / denom : 0.0f);
  }
  if (lane == 0) p.lse[row] = denom > 0.0f ? m + __logf(denom) : -INFINITY;
}

// Grid (num_seqs, pieces / 256 threads), like the gather: a one-token sequence's decode rows to
// their places in the call's output and LSE.
__global__ void ScatterDecodeRowsKernel(const DecodeRowsParams p, bool vec) {
  const int b = blockIdx.x;
  const int q0 = p.query_start_loc[b];
  if (p.query_start_loc[b + 1] - q0 != 1) return;
  const int pieces = (p.head_dim + kPiece - 1) / kPiece;
  const int u = blockIdx.y * blockDim.x + threadIdx.x;
  if (u < p.num_q_heads * pieces) {
    const int h = u / pieces, e0 = (u % pieces) * kPiece, n = min(kPiece, p.head_dim - e0);
    const int64_t at = int64_t{h} * p.head_dim + e0;
    const int64_t row = int64_t{p.num_q_heads} * p.head_dim;
    float x[kPiece];
    LoadQueryPiece(p.decode_out, DType::kF32, b * row + at, n, vec, x);
    const int64_t to = q0 * row + at;
    if (vec && n == kPiece && p.out_dtype == DType::kF32) {
      StoreF32Piece(static_cast<float*>(p.output) + to, n, vec, x);
    } else if (vec && n == kPiece) {
      uint32_t w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        w[j] = p.out_dtype == DType::kF16 ? decode_detail::PackPlain<true>(x[2 * j], x[2 * j + 1])
                                          : decode_detail::PackPlain<false>(x[2 * j], x[2 * j + 1]);
      }
      *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.output) + to) =
          uint4{w[0], w[1], w[2], w[3]};
    } else {
      for (int j = 0; j < n; ++j) decode_detail::StoreOutput(p.output, p.out_dtype, to + j, x[j]);
    }
  }
  if (blockIdx.y == 0) {
    for (int h = threadIdx.x; h < p.num_q_heads; h += blockDim.x) {
      p.lse[int64_t{q0} * p.num_q_heads + h] = p.decode_lse[int64_t{b} * p.num_q_heads + h];
    }
  }
}

}  // namespace

cudaError_t LaunchGatherVerifyRows(const VerifyGroupParams& p, cudaStream_t stream) {
  const bool vec = p.head_dim % kPiece == 0 && Aligned16(p.query) && Aligned16(p.gathered_query);
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_kv_heads));
  GatherVerifyRowsKernel<<<grid, kCopyThreads, 0, stream>>>(p, vec);
  return cudaGetLastError();
}

cudaError_t LaunchFinishVerifyRows(const VerifyGroupParams& p, cudaStream_t stream) {
  const int rows = p.rows * (p.num_q_heads / p.num_kv_heads);  // a warp each
  if (rows < 1 || rows > kMaxVerifyTail + 1 || p.head_dim > 32 * kMaxFinishLanes) {
    return cudaErrorInvalidValue;
  }
  if (p.query_fwht && p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) {
    return cudaErrorInvalidValue;  // the transform covers 32 · kLanes elements
  }
  const int smem = 2 * kMaxVerifyTail * p.head_dim * static_cast<int>(sizeof(float));
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_kv_heads));
  const unsigned threads = 32u * static_cast<unsigned>(rows);
  auto* kernel = p.head_dim <= 64    ? FinishVerifyRowsKernel<2>
                 : p.head_dim <= 128 ? FinishVerifyRowsKernel<4>
                                     : FinishVerifyRowsKernel<kMaxFinishLanes>;
  return decode_detail::LaunchDependent(kernel, grid, dim3(threads), smem, stream, p);
}

// Grid y: the CTAs of 256 pieces that cover a sequence's num_q_heads · head_dim elements.
dim3 DecodeRowsGrid(const DecodeRowsParams& p) {
  const int pieces = p.num_q_heads * ((p.head_dim + kPiece - 1) / kPiece);
  return dim3(static_cast<unsigned>(p.num_seqs),
              static_cast<unsigned>((pieces + kCopyThreads - 1) / kCopyThreads));
}

cudaError_t LaunchGatherDecodeRows(const DecodeRowsParams& p, cudaStream_t stream) {
  const bool vec = p.head_dim % kPiece == 0 && Aligned16(p.query) && Aligned16(p.gathered_query);
  GatherDecodeRowsKernel<<<DecodeRowsGrid(p), kCopyThreads, 0, stream>>>(p, vec);
  return cudaGetLastError();
}

cudaError_t LaunchScatterDecodeRows(const DecodeRowsParams& p, cudaStream_t stream) {
  const bool vec = p.head_dim % kPiece == 0 && Aligned16(p.output) && Aligned16(p.decode_out);
  ScatterDecodeRowsKernel<<<DecodeRowsGrid(p), kCopyThreads, 0, stream>>>(p, vec);
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

cudaError_t LaunchPrefillAttention(KeyKind kind, int value_bits, int head_dim, const ChunkParams& p,
                                   cudaStream_t stream) {
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
