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
  if (p.skip_before != nullptr && p.row0 + row < int64_t{*p.skip_before} * p.num_q_heads) return;
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

// The gather and the scatter of a mixed call's one-token rows move rows in pieces of 8 elements,
// one piece per thread, with 16-byte loads and stores where the pointers allow (vec: 16-byte
// aligned, head_dim a multiple of 8); a CTA per sequence and element, or scalar loads, took 8.6 µs
// to gather 4 MB of rows (ncu, H200): latency-bound, two rounds of dependent loads per tiny CTA.
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
        w[j] = p.out_dtype == DType::kF16
                   ? decode_detail::PackOutput<true>(x[2 * j], x[2 * j + 1])
                   : decode_detail::PackOutput<false>(x[2 * j], x[2 * j + 1]);
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

bool PrefillTakesTiles(KeyKind kind, int value_bits, int head_dim, const ChunkParams& p) {
  switch (kind) {
    case KeyKind::kMse4:
      return PrefillTakesTilesOfKind<KeyKind::kMse4>(value_bits, head_dim, p);
    case KeyKind::kMse3:
      return PrefillTakesTilesOfKind<KeyKind::kMse3>(value_bits, head_dim, p);
    case KeyKind::kFp8:
      return PrefillTakesTilesOfKind<KeyKind::kFp8>(value_bits, head_dim, p);
    case KeyKind::kBf16:
      return PrefillTakesTilesOfKind<KeyKind::kBf16>(value_bits, head_dim, p);
    case KeyKind::kF16:
      return PrefillTakesTilesOfKind<KeyKind::kF16>(value_bits, head_dim, p);
  }
  return false;
}

}  // namespace tqkv::attention_detail
