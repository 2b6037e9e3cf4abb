// The store kernels' memory side: raw row loads (16 or 32 elements per lane), the tensor-core
// helpers and shared tiles of the kMma path, and the fp32 warp tiles of the GEMM path.
// (Each kernel file includes these headers into its own anonymous namespace.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "quant/store_launch.h"

namespace tqkv::store {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Loads: 16 elements of a row per lane, kept raw (so that a loop iteration can prefetch the next
// rows while it computes, and bf16/fp16 min/max can run on packed pairs).

template <DType T, int N = kLaneElems>
struct RawRow {
  static constexpr int kWords = (N / 8) * (T == DType::kF32 ? 2 : 1);
  uint4 w[kWords];
};

__device__ __forceinline__ uint4 LoadStreaming(const void* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));
}

// A plain (weak, default-cached) 16-byte store, written as PTX: the compiler split a uint4
// assignment into four 4-byte stores (bf16 x̂, first chunk), and __stwb gives a .STRONG.SM store.
__device__ __forceinline__ void StoreVector(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// ---------------------------------------------------------------------------------------------
// Tensor-core helpers (KeySource::kMma).

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global → shared, asynchronous (cp.async, L2 only); zeros when !valid (nothing read).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void CpAsyncWaitAll() {
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}

// Shared slot of vector v of a wide kernel's warp tile (rows of D / 8 vectors): bit 2 flipped by
// bit 4. A quarter-warp's 16-byte accesses then hit 8 distinct bank groups both when copying (8
// consecutive vectors) and when reading the lane layout (at D = 128 lanes 4r .. 4r + 7 read vectors
// q + 4c of rows r and r + 1, 16 apart; at D = 256 8 consecutive vectors of one row).
__device__ __forceinline__ int WideTileSlot(int v) { return v ^ (((v >> 4) & 1) << 2); }

// Four 8x8 fp16 matrices; lanes 8i .. 8i + 7 give the row addresses of matrix i.
__device__ __forceinline__ void LdMatrix4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// c += a · b, m16n8k16, fp16 inputs, fp32 accumulation.
__device__ __forceinline__ void MmaF16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Shared-memory tiles of the kMma kernels, all rows of 16-byte chunks:
//  - Πᵀ hi and lo, [2][D][D] fp16 (row n = output column n), and the key tile [parts][kRows][D]
//    fp16: chunk c of row r at c ^ (r & 7), so that the 8 rows of one ldmatrix matrix hit 8
//    distinct bank groups;
//  - the y tile [kRows][D] fp32 (chunks of 4 floats): chunk c of row r at
//    c ^ ((c >> 3) & 1) ^ (r & 7). The MMA writes a float2 per row and lane (8 rows at one chunk
//    pair per instruction: 2 wavefronts) and each lane then reads chunks 2q, 2q + 1, 2(q + G),
//    2(q + G) + 1 of its row (8 lanes at chunks 2q + j: 8 distinct bank groups), both
//    conflict-free.
__device__ __forceinline__ int HalfTileChunk(int r, int c) { return c ^ (r & 7); }
__device__ __forceinline__ int YTileChunk(int r, int c) { return c ^ ((c >> 3) & 1) ^ (r & 7); }

template <int D, DType T>
struct MmaTiles {
  static constexpr int kRows = kThreads / (D / kLaneElems);
  static constexpr int kKeyParts = T == DType::kF32 ? 2 : 1;  // fp32 keys: hi + lo
  static constexpr int kRotationBytes = 2 * D * D * 2;
  static constexpr int kKeyBytes = kKeyParts * kRows * D * 2;
  static constexpr int kYBytes = kRows * D * 4;
  static constexpr int kBytes = kRotationBytes + kKeyBytes + kYBytes;
  static_assert(kBytes % 16 == 0 && kYBytes > 0);
};

// The 16 elements of lane q of a row (row_elem = row · D; quant/store_device.h, LaneElement) of a
// tensor of type T (16-byte aligned); zeros when !valid. 16-bit inputs: one 16-byte load per
// chunk, consecutive across the lanes; fp32: two per chunk.
template <DType T, int G, int N>
__device__ __forceinline__ void LoadRaw(const void* base, int64_t row_elem, int q, bool valid,
                                        RawRow<T, N>& r) {
  constexpr int kSize = T == DType::kF32 ? 4 : 2;
  const uint8_t* row = static_cast<const uint8_t*>(base) + row_elem * kSize;
#pragma unroll
  for (int j = 0; j < RawRow<T, N>::kWords; ++j) {
    const int chunk = T == DType::kF32 ? j / 2 : j;
    const int half = T == DType::kF32 ? j % 2 : 0;
    r.w[j] = valid ? LoadStreaming(row + 8 * (q + chunk * G) * kSize + 16 * half)
                   : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ void Unpack2(DType t, uint32_t w, float& a, float& b) {
  if (t == DType::kBF16) {
    a = __uint_as_float(w << 16);
    b = __uint_as_float(w & 0xffff0000u);
  } else {
    __half2 h;
    memcpy(&h, &w, sizeof(h));
    const float2 f = __half22float2(h);
    a = f.x;
    b = f.y;
  }
}

// The two 16-bit elements of a word straight to fp64 (exact; one conversion each, from the
// word's halves: no unpacking to fp32 first).
template <DType T>
__device__ __forceinline__ void Unpack2F64(uint32_t w, double& a, double& b) {
  static_assert(T == DType::kBF16 || T == DType::kF16);
  if constexpr (T == DType::kBF16) {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.f64.bf16 %0, lo;\n"
        " cvt.f64.bf16 %1, hi;\n}\n"
        : "=d"(a), "=d"(b)
        : "r"(w));
  } else {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.f64.f16 %0, lo;\n"
        " cvt.f64.f16 %1, hi;\n}\n"
        : "=d"(a), "=d"(b)
        : "r"(w));
  }
}

template <DType T, int N>
__device__ __forceinline__ void ToFloat(const RawRow<T, N>& r, float (&out)[N]) {
#pragma unroll
  for (int j = 0; j < RawRow<T, N>::kWords; ++j) {
    const uint32_t w[4] = {r.w[j].x, r.w[j].y, r.w[j].z, r.w[j].w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if constexpr (T == DType::kF32) {
        out[4 * j + c] = __uint_as_float(w[c]);
      } else {
        Unpack2(T, w[c], out[8 * j + 2 * c], out[8 * j + 2 * c + 1]);
      }
    }
  }
}

// min and max of the lane's 16 elements, NaN skipped (fminf semantics); +inf / -inf if all NaN.
// 16-bit inputs reduce as packed pairs (HMNMX2), which skip NaN the same way.
template <DType T, int N>
__device__ __forceinline__ void LaneMinMax(const RawRow<T, N>& r, const float (&v)[N], float& vmin,
                                           float& vmax) {
  vmin = INFINITY;
  vmax = -INFINITY;
  if constexpr (T == DType::kF32) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      vmin = fminf(vmin, v[i]);
      vmax = fmaxf(vmax, v[i]);
    }
  } else {
    using Pair = std::conditional_t<T == DType::kBF16, __nv_bfloat162, __half2>;
    constexpr int kPairs = N / 2;
    Pair p[kPairs];
#pragma unroll
    for (int j = 0; j < RawRow<T, N>::kWords; ++j) {
      memcpy(&p[4 * j + 0], &r.w[j].x, 4);
      memcpy(&p[4 * j + 1], &r.w[j].y, 4);
      memcpy(&p[4 * j + 2], &r.w[j].z, 4);
      memcpy(&p[4 * j + 3], &r.w[j].w, 4);
    }
    // Pairwise tree over the kPairs packed pairs (a power of two).
    Pair lo[kPairs / 2], hi[kPairs / 2];
#pragma unroll
    for (int j = 0; j < kPairs / 2; ++j) {
      lo[j] = __hmin2(p[2 * j], p[2 * j + 1]);
      hi[j] = __hmax2(p[2 * j], p[2 * j + 1]);
    }
#pragma unroll
    for (int n = kPairs / 4; n >= 1; n /= 2) {  // adjacent pairs, as ((0, 1), (2, 3)) at N = 16
#pragma unroll
      for (int j = 0; j < n; ++j) {
        lo[j] = __hmin2(lo[2 * j], lo[2 * j + 1]);
        hi[j] = __hmax2(hi[2 * j], hi[2 * j + 1]);
      }
    }
    float a, b, c, d;
    uint32_t lw, hw;
    memcpy(&lw, &lo[0], 4);
    memcpy(&hw, &hi[0], 4);
    Unpack2(T, lw, a, b);
    Unpack2(T, hw, c, d);
    vmin = fminf(fminf(vmin, a), b);
    vmax = fmaxf(fmaxf(vmax, c), d);
  }
}

__device__ __forceinline__ int64_t LoadSlot(const StoreParams& p, int64_t token) {
  return p.slots_are_i64
             ? __ldg(static_cast<const long long*>(p.slot_mapping) + token)
             : static_cast<int64_t>(__ldg(static_cast<const int*>(p.slot_mapping) + token));
}

// ---------------------------------------------------------------------------------------------
// fp32 warp tiles. In the LaneElement layout a lane's fp32 elements are 16-byte vectors at a
// 32-byte stride (vector 2·(q + c·G) + h of its row for chunk c, half h), so a warp instruction
// that reads or writes them directly touches every sector with half its bytes. Instead the 32 / G
// consecutive rows of a warp (2 KB of fp32, 128 vectors) move to and from global memory as one
// contiguous tile, lane L taking vectors L, L + 32, L + 64, L + 96 (512 contiguous bytes per
// instruction), and change layout through a 2 KB shared buffer per warp. Only the data movement
// changes: every lane ends up with the same elements in the same registers.

constexpr int kTileVecs = 128;  // 16-byte vectors of a warp tile (32 lanes × 16 fp32)

// Shared-memory position of tile vector v: bit 0 flipped by bit 3 ^ bit 4, so that a quarter-warp
// (8 lanes, one 128-byte wavefront of a 16-byte access) hits 8 distinct bank groups both in the
// contiguous layout (8 consecutive vectors, bits 3 and 4 equal) and in the LaneElement layout
// (2·q + h for 8 consecutive q at D = 128 and 256, two rows at D = 64: see RowVector).
__device__ __forceinline__ int TileSlot(int v) { return v ^ (((v >> 3) ^ (v >> 4)) & 1); }

// Tile vector of LaneElement vector j (= 2·chunk + half, as RawRow<kF32>::w[j]) of a lane.
template <int G>
__device__ __forceinline__ int RowVector(int lane, int j) {
  return (lane / G) * (4 * G) + 2 * (lane % G + (j / 2) * G) + j % 2;
}

// The tile of rows [row0, row0 + 32 / G) of a [rows, D] fp32 tensor (16-byte aligned), contiguous
// layout; zeros for rows at or past `rows`.
template <int D>
__device__ __forceinline__ void LoadTile(const void* base, int64_t row0, int64_t rows, int lane,
                                         uint4 (&t)[4]) {
  constexpr int kRowVecs = D / 4;
  const uint4* src = static_cast<const uint4*>(base) + row0 * kRowVecs;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int v = lane + 32 * i;
    t[i] = row0 + v / kRowVecs < rows ? LoadStreaming(src + v) : make_uint4(0, 0, 0, 0);
  }
}

// Contiguous tile → LaneElement layout (r[j] = LoadRaw<kF32>'s w[j]) through the warp's buffer.
// Every lane of the warp calls it; it begins with __syncwarp, so the buffer may be reused at once.
template <int G>
__device__ __forceinline__ void TileToRows(const uint4 (&t)[4], uint4* stage, int lane,
                                           uint4 (&r)[4]) {
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; ++i) stage[TileSlot(lane + 32 * i)] = t[i];
  __syncwarp();
#pragma unroll
  for (int j = 0; j < 4; ++j) r[j] = stage[TileSlot(RowVector<G>(lane, j))];
}

// The reverse: LaneElement layout → contiguous tile.
template <int G>
__device__ __forceinline__ void RowsToTile(const uint4 (&r)[4], uint4* stage, int lane,
                                           uint4 (&t)[4]) {
  __syncwarp();
#pragma unroll
  for (int j = 0; j < 4; ++j) stage[TileSlot(RowVector<G>(lane, j))] = r[j];
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; ++i) t[i] = stage[TileSlot(lane + 32 * i)];
}

}  // namespace
}  // namespace tqkv::store
