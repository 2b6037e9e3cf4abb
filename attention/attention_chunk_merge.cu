// The split merge of the chunk attention kernels and the dispatch by key kind.
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

}  // namespace

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
