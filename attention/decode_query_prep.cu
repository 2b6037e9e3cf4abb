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

// Tensor-core q·Πᵀ (QueryPrepParams::rotation_fragments): each warp computes 32 rows × 32 output
// columns with mma.sync m16n8k8 in tf32, fp32-accurate: a 16-bit query is exact in tf32 and meets
// Πᵀ's hi and lo parts (two MMAs), an fp32 query is split too (three: hi·hi, hi·lo, lo·hi). The B
// fragments come from global memory already in fragment order (one coalesced 16-byte load per
// lane feeds four to six MMAs; the warps of a column group all read its D · 32 · 8 bytes, from L1
// or L2); the A fragments follow QueryPrepFragments' order of k-slots, so a thread reads 8
// consecutive elements of each of its 4 rows per 4 k-steps. The kernel waits on its loads (ncu
// of 64-column tiles in 158 registers: 16.7 % occupancy, L1 hits 76 %, 50.4 µs at 65,536 rows on
// the H200); 32-column tiles in 128 registers (4 CTAs per SM) took it to 42.6 µs, 80 registers
// (6 CTAs) spilled: 56 µs.
constexpr int kMmaPrepWarps = 4;
constexpr int kMmaPrepRows = 32;
constexpr int kMmaPrepCols = 32;
constexpr int kMmaPrepNTiles = kMmaPrepCols / 8;

__device__ __forceinline__ void MmaTf32(float (&c)[4], const uint32_t (&a)[4], float b0, float b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(__float_as_uint(b0)),
        "r"(__float_as_uint(b1)));
}

__device__ __forceinline__ uint32_t ToTf32(float x) {
  uint32_t y;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(y) : "f"(x));
  return y;
}

// Eight consecutive query elements as loaded (zeros for a row past the end), kept in the input's
// width until used: 4 words for 16-bit inputs (the kernel fits 128 registers, 4 CTAs per SM).
template <DType kIn>
struct EightElements {
  static constexpr int kWords = kIn == DType::kF32 ? 8 : 4;
  uint32_t w[kWords];
  __device__ __forceinline__ void Load(const void* query, int64_t at, bool valid) {
    const uint4* q = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(query) +
                                                    at * (kIn == DType::kF32 ? 4 : 2));
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      const uint4 v = valid ? __ldg(q + i) : uint4{0, 0, 0, 0};
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  }
  __device__ __forceinline__ float operator[](int e) const {
    if constexpr (kIn == DType::kF32) {
      return __uint_as_float(w[e]);
    } else if constexpr (kIn == DType::kBF16) {
      return __uint_as_float(e % 2 ? w[e / 2] & 0xFFFF0000u : w[e / 2] << 16);
    } else {
      return __half2float(__ushort_as_half(static_cast<uint16_t>(w[e / 2] >> (16 * (e % 2)))));
    }
  }
};

template <DType kIn, int kD>
__global__ void __launch_bounds__(kMmaPrepWarps * 32, 4)
    QueryPrepMmaKernel(const QueryPrepParams p) {
  constexpr int kColGroups = kD / kMmaPrepCols;
  constexpr int kSteps = kD / 8;  // k-steps of 8
  // A thread's run of each row: its k-slot t of step s is d = kSlice·t + 2s (slot t + 4: d + 1).
  constexpr int kSlice = kD / 4;
  constexpr bool kSplitQuery = kIn == DType::kF32;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t warp = int64_t{blockIdx.x} * kMmaPrepWarps + threadIdx.x / 32;
  const int64_t row0 = warp / kColGroups * kMmaPrepRows;
  const int col_group = static_cast<int>(warp % kColGroups);
  if (row0 >= p.rows) return;
  const float4* frag = reinterpret_cast<const float4*>(p.rotation_fragments) +
                       static_cast<int64_t>(col_group) * kMmaPrepNTiles * kSteps * 32 + lane;
  float acc[2][kMmaPrepNTiles][4];
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int nt = 0; nt < kMmaPrepNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][nt][e] = 0.0f;
    }
  }
#pragma unroll 1
  for (int c = 0; c < kSteps / 4; ++c) {
    EightElements<kIn> x[4];  // rows g, g + 8, g + 16, g + 24 of the warp's 32
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t row = row0 + g + 8 * r;
      x[r].Load(p.query, row * kD + kSlice * t + 8 * c, row < p.rows);
    }
#pragma unroll
    for (int s4 = 0; s4 < 4; ++s4) {
      uint32_t hi[2][4], lo[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const float v[4] = {x[2 * m][2 * s4], x[2 * m + 1][2 * s4], x[2 * m][2 * s4 + 1],
                            x[2 * m + 1][2 * s4 + 1]};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if constexpr (kSplitQuery) {
            hi[m][e] = ToTf32(v[e]);
            lo[m][e] = ToTf32(v[e] - __uint_as_float(hi[m][e]));
          } else {
            hi[m][e] = __float_as_uint(v[e]);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < kMmaPrepNTiles; ++nt) {
        const float4 b = __ldg(frag + (nt * kSteps + 4 * c + s4) * 32);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          // The small products first.
          MmaTf32(acc[m][nt], hi[m], b.z, b.w);
          if constexpr (kSplitQuery) MmaTf32(acc[m][nt], lo[m], b.x, b.y);
          MmaTf32(acc[m][nt], hi[m], b.x, b.y);
        }
      }
    }
  }
  LaunchDependents();
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + 16 * m + g + 8 * h;
      if (row >= p.rows) continue;
      float* out = p.out + row * kD + col_group * kMmaPrepCols + 2 * t;
#pragma unroll
      for (int nt = 0; nt < kMmaPrepNTiles; ++nt) {
        *reinterpret_cast<float2*>(out + 8 * nt) =
            make_float2(acc[m][nt][2 * h], acc[m][nt][2 * h + 1]);
      }
    }
  }
}

template <DType kIn, int kD>
cudaError_t LaunchQueryPrepMma(const QueryPrepParams& p, cudaStream_t stream) {
  const int64_t warps = (int64_t{p.rows} + kMmaPrepRows - 1) / kMmaPrepRows * (kD / kMmaPrepCols);
  const int64_t ctas = (warps + kMmaPrepWarps - 1) / kMmaPrepWarps;
  QueryPrepMmaKernel<kIn, kD><<<static_cast<unsigned>(ctas), kMmaPrepWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

template <DType kIn>
cudaError_t LaunchQueryPrepMmaOfDim(const QueryPrepParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:
      return LaunchQueryPrepMma<kIn, 64>(p, stream);
    case 128:
      return LaunchQueryPrepMma<kIn, 128>(p, stream);
    case 256:
      return LaunchQueryPrepMma<kIn, 256>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchQueryPrep(const QueryPrepParams& p, cudaStream_t stream) {
  static_assert(kPrepRows == 8, "the kernel reads a row group as two float4");
  if (p.rotation == nullptr) return cudaErrorInvalidValue;
  if (p.rotation_fragments != nullptr && reinterpret_cast<uintptr_t>(p.query) % 16 == 0) {
    switch (p.in_dtype) {
      case DType::kF32:
        return LaunchQueryPrepMmaOfDim<DType::kF32>(p, stream);
      case DType::kF16:
        return LaunchQueryPrepMmaOfDim<DType::kF16>(p, stream);
      default:
        return LaunchQueryPrepMmaOfDim<DType::kBF16>(p, stream);
    }
  }
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
