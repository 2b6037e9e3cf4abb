#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode_device.cuh"
#include "attention/decode_launch.h"

namespace tqkv::decode_detail {
namespace {

// ------------------------------------------------------------------------------------------------
// Merge of the split partials by log-sum-exp; one CTA per (sequence, query head), one thread per d.
// Up to kFastSplits splits every thread loads all LSEs and its d of every split at once and
// reduces them in registers (commit e89dd8c: 1 × 4k 7.4 -> 7.1 µs, k3v4_nc 1 × 16k 11.1 -> 10.9,
// bf16 1 × 32k 36.0 -> 35.6; 4bit_nc 1 × 32k unchanged). Beyond that the splits' LSEs are loaded
// at once (one per thread) and reduced within each warp by shuffles when there are at most 32 (no
// barrier before the weighted sums: 0.3-0.5 µs less at batch 1), across the CTA otherwise; each
// thread's loads of its d over the splits are independent and unrolled, so the kernel waits for a
// few memory round trips, not one per split (that chain made it 13.7 µs at batch 1 × 32k, 47
// splits).
constexpr int kMaxMergeSplits = 256;   // CudaDecoder::Plan's kMaxSplits
constexpr int kMaxMergeThreads = 256;  // blockDim = head_dim
constexpr int kFastSplits = 16;        // the merge's register-only path, up to this many splits

__device__ __forceinline__ float BlockReduce(float v, float* scratch, bool is_max) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = is_max ? fmaxf(v, o) : v + o;
  }
  __syncthreads();  // scratch is free
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < warps; ++w) v = is_max ? fmaxf(v, scratch[w]) : v + scratch[w];
  return v;
}

__global__ void DecodeMergeKernel(const MergeParams p) {
  __shared__ float weight_s[kMaxMergeSplits];
  __shared__ float scratch_s[32];
  const int row = blockIdx.x;  // b · Hq + hq (the partials' row)
  const int b = row / p.num_q_heads;
  const int d = threadIdx.x;
  const ColumnSpan span = SpanOfColumns(p.verify, p.seq_lens, b);
  const int len = span.len;
  int64_t out_row = row;
  if (p.verify.query_start_loc != nullptr) {  // the caller's row of the pass's column
    const int columns = p.num_q_heads / p.num_kv_heads, hq = row % p.num_q_heads;
    out_row =
        RowOfColumn(p.verify, span, p.num_q_heads, p.num_kv_heads, b, hq / columns, hq % columns);
    if (out_row < 0) return;  // past the sequence's new tokens
  }
  const int splits = SplitsHoldingTokens(len, p.tokens_per_split, p.window, p.block_size);
  if (splits > kMaxMergeSplits) __trap();  // the plan never makes more
  // No early trigger for a next step's split kernel: launched while these CTAs and the split
  // grid's last ones still ran, it took 4-7 µs longer at batch 1 (see LaunchDependents in the
  // split kernel). Only a kernel that waits for this grid at its end (trigger_at_start).
  GridDependencyWait();  // the split grid's partials
  if (p.trigger_at_start) LaunchDependents();
  // Up to kFastSplits splits (every batch-1 plan up to 128k tokens): thread d loads its element of
  // every split and every split's LSE at once and reduces them in registers by pairwise trees:
  // one memory round trip, no shuffles, no shared memory, no barrier.
  if (splits >= 1 && splits <= kFastSplits) {
    const float* lse_row = p.partial_lse + static_cast<int64_t>(row) * p.max_splits;
    const float* x_row = p.partial_out + static_cast<int64_t>(row) * p.max_splits * p.head_dim + d;
    float l[kFastSplits], x[kFastSplits];
#pragma unroll
    for (int s = 0; s < kFastSplits; ++s) {
      l[s] = s < splits ? lse_row[s] : -INFINITY;
      x[s] = s < splits ? x_row[static_cast<int64_t>(s) * p.head_dim] : 0.0f;
    }
    float m[kFastSplits];
#pragma unroll
    for (int s = 0; s < kFastSplits; ++s) m[s] = l[s];
    static_assert(kFastSplits == 16, "the trees below have four levels");
#pragma unroll
    for (int s = 0; s < 8; ++s) m[s] = fmaxf(m[s], m[s + 8]);
#pragma unroll
    for (int s = 0; s < 4; ++s) m[s] = fmaxf(m[s], m[s + 4]);
#pragma unroll
    for (int s = 0; s < 2; ++s) m[s] = fmaxf(m[s], m[s + 2]);
    m[0] = fmaxf(m[0], m[1]);
    float w[kFastSplits], wx[kFastSplits];
#pragma unroll
    for (int s = 0; s < kFastSplits; ++s) {
      w[s] = __expf(l[s] - m[0]);  // 0 past the splits (l = -inf)
      wx[s] = w[s] * x[s];
    }
    auto fold = [&](int half) {
#pragma unroll
      for (int s = 0; s < half; ++s) {
        w[s] += w[s + half];
        wx[s] += wx[s + half];
      }
    };
    fold(8);
    fold(4);
    fold(2);
    fold(1);
    StoreOutput(p.output, p.out_dtype, out_row * p.head_dim + d, wx[0] / w[0]);
    if (d == 0) p.lse[out_row] = m[0] + logf(w[0]);
    return;
  }
  // Thread (group, v) adds 4 consecutive d (one 16-byte load per split) over the splits ≡ group
  // (mod groups); the groups' sums meet in shared memory. Its first kPreloaded partials are
  // loaded before the LSE reduction, so that their L2 round trip overlaps it.
  const int vecs = p.head_dim / 4, groups = blockDim.x / vecs;
  const int v = d % vecs, group = d / vecs;
  const float4* partial = reinterpret_cast<const float4*>(
      p.partial_out + static_cast<int64_t>(row) * p.max_splits * p.head_dim);
  constexpr int kPreloaded = 8;
  float4 pre[kPreloaded];
#pragma unroll
  for (int i = 0; i < kPreloaded; ++i) {
    const int s = group + i * groups;
    pre[i] = s < splits ? partial[static_cast<int64_t>(s) * vecs + v]
                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  const float* lse = p.partial_lse + static_cast<int64_t>(row) * p.max_splits;
  float mx = -INFINITY, total = 0.0f;
  // Up to 32 splits (every batch-1 plan but the longest contexts): each warp reduces the LSEs by
  // shuffles and keeps split s's weight in lane s, so no barrier is needed before the sums (the
  // preloaded partials then cover every split: groups · kPreloaded = 32 for every head_dim).
  const bool in_warp = splits <= 32;
  float lane_w = 0.0f;  // in_warp: the weight of split (lane)
  if (in_warp) {
    const int lane = d & 31;
    const float l = lane < splits ? lse[lane] : -INFINITY;
    mx = l;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    lane_w = lane < splits ? __expf(l - mx) : 0.0f;
    total = lane_w;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
  } else {
    for (int s = d; s < splits; s += blockDim.x) mx = fmaxf(mx, lse[s]);
    mx = BlockReduce(mx, scratch_s, true);
    float part = 0.0f;
    for (int s = d; s < splits; s += blockDim.x) {
      const float w = __expf(lse[s] - mx);
      weight_s[s] = w;
      part += w;
    }
    total = BlockReduce(part, scratch_s, false);  // its barriers publish weight_s
  }
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int i = 0; i < kPreloaded; ++i) {
    const int s = group + i * groups;
    const float ws = in_warp ? __shfl_sync(0xffffffffu, lane_w, s & 31) : 0.0f;
    const float w = s < splits ? (in_warp ? ws : weight_s[s]) : 0.0f;
    sum.x += w * pre[i].x;
    sum.y += w * pre[i].y;
    sum.z += w * pre[i].z;
    sum.w += w * pre[i].w;
  }
#pragma unroll 4
  for (int s = group + kPreloaded * groups; s < splits; s += groups) {
    const float w = weight_s[s];
    const float4 x = partial[static_cast<int64_t>(s) * vecs + v];
    sum.x += w * x.x;
    sum.y += w * x.y;
    sum.z += w * x.z;
    sum.w += w * x.w;
  }
  __shared__ float4 sum_s[kMaxMergeThreads];
  sum_s[d] = sum;
  __syncthreads();
  float acc = 0.0f;
  for (int g = 0; g < groups; ++g) acc += reinterpret_cast<const float*>(sum_s + g * vecs)[d];
  const float out = splits > 0 ? acc / total : 0.0f;
  StoreOutput(p.output, p.out_dtype, out_row * p.head_dim + d, out);
  if (d == 0) p.lse[out_row] = splits > 0 ? mx + logf(total) : -INFINITY;
}

}  // namespace

cudaError_t LaunchDecodeMerge(const MergeParams& p, cudaStream_t stream) {
  return LaunchDependent(DecodeMergeKernel, dim3(p.num_seqs * p.num_q_heads), dim3(p.head_dim), 0,
                         stream, p);
}

}  // namespace tqkv::decode_detail
