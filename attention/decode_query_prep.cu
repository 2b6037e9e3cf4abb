#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode_device.cuh"
#include "attention/decode_launch.h"

namespace tqkv::decode_detail {
namespace {

// q·Πᵀ for a dense Πᵀ, for every (sequence, query head), in fp32. One CTA per kPrepRows rows and
// two threads per output element j (blockDim = 2 · head_dim), so that each element of Πᵀ is read
// once per CTA (not once per row) and applied to all rows from shared memory; the two threads of
// j sum over the two halves of each Πᵀ tile (half the dependent chain: 11 → ~6 µs at batch 64),
// and the second half's sums reach the first through shared memory. Πᵀ is staged by cp.async in
// tiles of 64 KB (all of it for D ≤ 128), every copy of a tile in flight at once: a chain of
// dependent L2 round trips made this kernel 12-16 µs at batch 64. The split grid may start (its
// table copy and first loads) once the sums are done, or at the start when this grid is small
// (≤ kPrepEarlyTriggerCtas CTAs): triggered at the start of a large grid, the split's CTAs took SM
// resources while this grid ran and made k3v4_nc 15-35 % slower (measured); at batch 1 the early
// start saved 1-2 µs.
constexpr int kPrepRows = 8;
constexpr int kPrepTileBytes = 64 * 1024;
constexpr int kPrepEarlyTriggerCtas = 32;

__global__ void QueryPrepKernel(const QueryPrepParams p, bool trigger_early) {
  if (trigger_early) LaunchDependents();
  // [head_dim][kPrepRows] floats of q, a tile of Πᵀ, then [head_dim][kPrepRows] partial sums.
  extern __shared__ float4 q_s4[];
  const int n = p.head_dim;
  float* q_s = reinterpret_cast<float*>(q_s4);
  float* r_s = q_s + n * kPrepRows;
  float* y_s = r_s + kPrepTileBytes / 4;
  const int row0 = blockIdx.x * kPrepRows;
  const int rows = min(kPrepRows, p.rows - row0);
  for (int k = threadIdx.x; k < kPrepRows * n; k += blockDim.x) {
    const int r = k / n, i = k % n;
    float v = 0.0f;
    if (r < rows) {
      const int64_t at = static_cast<int64_t>(row0 + r) * n + i;
      if (p.in_dtype == DType::kF32) {
        v = static_cast<const float*>(p.query)[at];
      } else if (p.in_dtype == DType::kF16) {
        v = __half2float(static_cast<const __half*>(p.query)[at]);
      } else {
        v = __bfloat162float(static_cast<const __nv_bfloat16*>(p.query)[at]);
      }
    }
    q_s[i * kPrepRows + r] = v;
  }
  const int j = threadIdx.x % n, half = threadIdx.x / n;
  float y[kPrepRows];
#pragma unroll
  for (int r = 0; r < kPrepRows; ++r) y[r] = 0.0f;
  const int tile_rows = min(n, kPrepTileBytes / (n * 4));
  for (int i0 = 0; i0 < n; i0 += tile_rows) {
    __syncthreads();                       // the rows are in q_s; the previous tile has been used
    const int pieces = tile_rows * n / 4;  // 16-byte copies
    for (int k = threadIdx.x; k < pieces; k += blockDim.x) {
      CopyAsync16(r_s + 4 * k, p.rotation + static_cast<int64_t>(i0) * n + 4 * k);
    }
    CopyAsyncWait();
    __syncthreads();
    const int i_begin = half * (tile_rows / 2), i_end = i_begin + tile_rows / 2;
#pragma unroll 8
    for (int i = i_begin; i < i_end; ++i) {
      const float w = r_s[i * n + j];
      const float4 a = q_s4[2 * (i0 + i)], b = q_s4[2 * (i0 + i) + 1];
      y[0] = fmaf(a.x, w, y[0]);
      y[1] = fmaf(a.y, w, y[1]);
      y[2] = fmaf(a.z, w, y[2]);
      y[3] = fmaf(a.w, w, y[3]);
      y[4] = fmaf(b.x, w, y[4]);
      y[5] = fmaf(b.y, w, y[5]);
      y[6] = fmaf(b.z, w, y[6]);
      y[7] = fmaf(b.w, w, y[7]);
    }
  }
  if (half == 1) {
#pragma unroll
    for (int r = 0; r < kPrepRows; ++r) y_s[r * n + j] = y[r];
  }
  __syncthreads();
  if (!trigger_early) LaunchDependents();
  if (half == 1) return;
#pragma unroll
  for (int r = 0; r < kPrepRows; ++r) {
    if (r >= rows) break;
    p.out[static_cast<int64_t>(row0 + r) * n + j] = y[r] + y_s[r * n + j];
  }
}

}  // namespace

cudaError_t LaunchQueryPrep(const QueryPrepParams& p, cudaStream_t stream) {
  static_assert(kPrepRows == 8, "the kernel reads a row group as two float4");
  if (p.rotation == nullptr) return cudaErrorInvalidValue;
  const int smem = 2 * kPrepRows * p.head_dim * static_cast<int>(sizeof(float)) + kPrepTileBytes;
  static const cudaError_t configured =
      cudaFuncSetAttribute(QueryPrepKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           2 * kPrepRows * 256 * static_cast<int>(sizeof(float)) + kPrepTileBytes);
  if (configured != cudaSuccess) return configured;
  const int ctas = (p.rows + kPrepRows - 1) / kPrepRows;
  QueryPrepKernel<<<ctas, 2 * p.head_dim, smem, stream>>>(p, ctas <= kPrepEarlyTriggerCtas);
  return cudaGetLastError();
}

}  // namespace tqkv::decode_detail
