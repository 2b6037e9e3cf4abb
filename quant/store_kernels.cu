// CUDA store kernels: quantize K/V rows into the SoA blocks of quant/block_format.h.
//
// Every kernel mirrors Quantizer::EncodeSlot (quant/quantizer.cc) line for line; the README of
// quant/ lists the numeric choices they share (fp64 norm accumulation rounded to fp32 once, fp64
// norm correction, IEEE divisions, NaN/inf rules). The only intended difference is the rotation:
// the reference accumulates y = x̂ · Πᵀ in fp64, these kernels in fp32 (FWHT or cuBLAS), so an
// index may differ by one where y lies within a few ulp of a midpoint.
//
// Work split (quant/store_device.h): a row (token, head) is D/16 lanes, 16 elements per lane, so
// a warp holds 32·16/D rows and a 256-thread CTA 4096/D rows; the wide FWHT kernel (kWide, the
// default for large 16-bit stores) has 32 elements per lane and 128-thread CTAs. Each lane reads
// its 16 (32) key and value elements with 16-byte loads and writes its packed codes as 8-byte
// stores (lanes of a row write consecutive words; rows of consecutive heads of one token are
// contiguous in the block). The fp16 metadata of a CTA goes through shared memory and is written
// head-major, so that consecutive tokens of one head (consecutive positions in a block during
// prefill) are adjacent lanes. fp32 tensors of the GEMM path (y read by StoreKernel; x̂ written and
// fp32 keys read by NormalizeKernel) move as contiguous 2 KB warp tiles through shared memory
// instead ("fp32 warp tiles" below), so that every 16-byte access instruction covers whole sectors.
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

template <InputType T, int N = kLaneElems>
struct RawRow {
  static constexpr int kWords = (N / 8) * (T == InputType::kF32 ? 2 : 1);
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

template <int D, InputType T>
struct MmaTiles {
  static constexpr int kRows = kThreads / (D / kLaneElems);
  static constexpr int kKeyParts = T == InputType::kF32 ? 2 : 1;  // fp32 keys: hi + lo
  static constexpr int kRotationBytes = 2 * D * D * 2;
  static constexpr int kKeyBytes = kKeyParts * kRows * D * 2;
  static constexpr int kYBytes = kRows * D * 4;
  static constexpr int kBytes = kRotationBytes + kKeyBytes + kYBytes;
  static_assert(kBytes % 16 == 0 && kYBytes > 0);
};

// The 16 elements of lane q of a row (row_elem = row · D; quant/store_device.h, LaneElement) of a
// tensor of type T (16-byte aligned); zeros when !valid. 16-bit inputs: one 16-byte load per
// chunk, consecutive across the lanes; fp32: two per chunk.
template <InputType T, int G, int N>
__device__ __forceinline__ void LoadRaw(const void* base, int64_t row_elem, int q, bool valid,
                                        RawRow<T, N>& r) {
  constexpr int kSize = T == InputType::kF32 ? 4 : 2;
  const uint8_t* row = static_cast<const uint8_t*>(base) + row_elem * kSize;
#pragma unroll
  for (int j = 0; j < RawRow<T, N>::kWords; ++j) {
    const int chunk = T == InputType::kF32 ? j / 2 : j;
    const int half = T == InputType::kF32 ? j % 2 : 0;
    r.w[j] = valid ? LoadStreaming(row + 8 * (q + chunk * G) * kSize + 16 * half)
                   : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ void Unpack2(InputType t, uint32_t w, float& a, float& b) {
  if (t == InputType::kBF16) {
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
template <InputType T>
__device__ __forceinline__ void Unpack2F64(uint32_t w, double& a, double& b) {
  static_assert(T == InputType::kBF16 || T == InputType::kF16);
  if constexpr (T == InputType::kBF16) {
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

template <InputType T, int N>
__device__ __forceinline__ void ToFloat(const RawRow<T, N>& r, float (&out)[N]) {
#pragma unroll
  for (int j = 0; j < RawRow<T, N>::kWords; ++j) {
    const uint32_t w[4] = {r.w[j].x, r.w[j].y, r.w[j].z, r.w[j].w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if constexpr (T == InputType::kF32) {
        out[4 * j + c] = __uint_as_float(w[c]);
      } else {
        Unpack2(T, w[c], out[8 * j + 2 * c], out[8 * j + 2 * c + 1]);
      }
    }
  }
}

// min and max of the lane's 16 elements, NaN skipped (fminf semantics); +inf / -inf if all NaN.
// 16-bit inputs reduce as packed pairs (HMNMX2), which skip NaN the same way.
template <InputType T, int N>
__device__ __forceinline__ void LaneMinMax(const RawRow<T, N>& r, const float (&v)[N], float& vmin,
                                           float& vmax) {
  vmin = INFINITY;
  vmax = -INFINITY;
  if constexpr (T == InputType::kF32) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      vmin = fminf(vmin, v[i]);
      vmax = fmaxf(vmax, v[i]);
    }
  } else {
    using Pair = std::conditional_t<T == InputType::kBF16, __nv_bfloat162, __half2>;
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

// ---------------------------------------------------------------------------------------------
// Reductions over the G lanes of a row (xor butterflies: every lane gets the same value, since
// a + b == b + a bitwise).

template <int G, typename V>
__device__ __forceinline__ V GroupSum(V x) {
#pragma unroll
  for (int m = G / 2; m >= 1; m >>= 1) x += __shfl_xor_sync(kFullMask, x, m);
  return x;
}

template <int G>
__device__ __forceinline__ float GroupMin(float x) {
#pragma unroll
  for (int m = G / 2; m >= 1; m >>= 1) x = fminf(x, __shfl_xor_sync(kFullMask, x, m));
  return x;
}

template <int G>
__device__ __forceinline__ float GroupMax(float x) {
#pragma unroll
  for (int m = G / 2; m >= 1; m >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, m));
  return x;
}

// ‖k‖ as the reference computes it: Σ k² in fp64 (exact products), sqrt in fp64, one rounding.
// Four partial sums (elements i mod 4) instead of one chain of N dependent DFMAs: the fp64 sum's
// order already differs from the reference's (lanes, butterfly), which the final rounding to fp32
// absorbs (see quant/README.md).
template <int G, int N>
__device__ __forceinline__ float RowNorm(const float (&k)[N]) {
  double ss[4] = {0.0, 0.0, 0.0, 0.0};
#pragma unroll
  for (int i = 0; i < N; ++i) ss[i % 4] = fma(double(k[i]), double(k[i]), ss[i % 4]);
  return static_cast<float>(sqrt(GroupSum<G>((ss[0] + ss[1]) + (ss[2] + ss[3]))));
}

// The same from the raw 16-bit words (the same products in the same partial sums).
template <int G, InputType T, int N>
__device__ __forceinline__ float RowNorm(const RawRow<T, N>& r) {
  static_assert(T != InputType::kF32);
  double ss[4] = {0.0, 0.0, 0.0, 0.0};
#pragma unroll
  for (int j = 0; j < RawRow<T, N>::kWords; ++j) {
    const uint32_t w[4] = {r.w[j].x, r.w[j].y, r.w[j].z, r.w[j].w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      double a, b;
      Unpack2F64<T>(w[c], a, b);
      const int i = 8 * j + 2 * c;  // element of a
      ss[i % 4] = fma(a, a, ss[i % 4]);
      ss[(i + 1) % 4] = fma(b, b, ss[(i + 1) % 4]);
    }
  }
  return static_cast<float>(sqrt(GroupSum<G>((ss[0] + ss[1]) + (ss[2] + ss[3]))));
}

// y = FWHT(x) over the row (Sylvester order: y[j] = Σ_i x[i] (-1)^popcount(i & j)), unscaled.
// Register bits (e) are index bits 0-2 and 3 + log2(G) ..; lane bits (q) index bits 3 .. 2 +
// log2(G).
// kRegSkip (register strides) and kLaneFrom skip stages that FwhtOnTensorCores did.
template <int G, int N, int kRegSkip = 0, int kLaneFrom = 1>
__device__ __forceinline__ void Fwht(float (&x)[N], int q) {
#pragma unroll
  for (int h = 1; h < N; h <<= 1) {
    if (h & kRegSkip) continue;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int m = kLaneFrom; m < G; m <<= 1) {
    // The lane whose bit is set keeps (partner − own), the other (own + partner); fma with ±1 is
    // one exactly rounded add either way.
    const float sign = (q & m) ? -1.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float other = __shfl_xor_sync(kFullMask, x[i], m);
      x[i] = __fmaf_rn(sign, x[i], other);
    }
  }
}

// c = a · b, m16n8k16, 16-bit inputs of type T, fp32 accumulation from zero.
template <InputType T>
__device__ __forceinline__ void MmaFromZero(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  if constexpr (T == InputType::kBF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %10, %10, %10};"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
  } else {
    static_assert(T == InputType::kF16);
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %10, %10, %10};"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
  }
}

// The wide kernel's FWHT of a row, scaled by `scale` (as Fwht, then · scale), from the raw 16-bit
// words of its 32 lane elements: per chunk, H16 over the index bits {0, 2, 3, 4} on tensor cores
// (quant/store_device.h, MmaOutputElement and above; hadamard_signs applied to the words first
// when kSigns), then the stages of the other bits as butterflies: 2 MMAs + 24 adds per chunk
// instead of 56 adds, 16 shuffles and 16 FMAs. The last stage (register stride 16) takes the scale
// in: (a + b)·s, (a − b)·s as a·s ± fl(b·s), three operations per pair instead of four. The
// products are exact and the sums fp32, so y is within the same few-ulp bound as the butterflies'
// (the order of the sums and the scaling's rounding differ). Every lane of the warp must call it.
template <InputType T, int G, bool kSigns>
__device__ __forceinline__ void FwhtOnTensorCores(const RawRow<T, 32>& raw, uint32_t sign_spread,
                                                  const uint32_t (&b)[2][2], float scale,
                                                  float (&x)[32], int q) {
  static_assert(G % 4 == 0);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t w[4] = {raw.w[c].x, raw.w[c].y, raw.w[c].z, raw.w[c].w};
    if constexpr (kSigns) {
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] ^= PairSignMask(sign_spread, 4 * c + i);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float acc[4];
      MmaFromZero<T>(acc, w, b[j][0], b[j][1]);
#pragma unroll
      for (int r = 0; r < 4; ++r) x[8 * c + MmaOutputElement(j, r)] = acc[r];
    }
  }
  // Element bits 0 and 2 (register strides 1, 4) and t were done; strides 2 and 8 and the lane
  // strides from 4 (D = 256) now, stride 16 last with the scale.
  Fwht<G, 32, 1 | 4 | 16, 4>(x, q);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float bs = __fmul_rn(x[i + 16], scale);
    const float a = x[i];
    x[i] = __fmaf_rn(a, scale, bs);
    x[i + 16] = __fmaf_rn(a, scale, -bs);
  }
}

// Writes a lane's packed `bits`-bit codes (chunks q, q + G, ... of 8 codes) into the row's code
// region at `dst` (8-aligned): 4-bit: one 4-byte word per chunk; 3-bit: three words per four
// chunks (G is a multiple of 4, so lane q + 1 holds the next chunk). The lanes of a row write
// consecutive words.
template <int kBits, int G, int C>
__device__ __forceinline__ void StoreCodes(const LaneCodes<kBits, C>& c, int q, bool active,
                                           uint8_t* dst) {
  uint32_t* const words = reinterpret_cast<uint32_t*>(dst);
  if constexpr (kBits == 4) {
    if (active) {
#pragma unroll
      for (int j = 0; j < C; ++j) words[q + j * G] = c.w[j];
    }
  } else {
    static_assert(kBits == 3 && G % 4 == 0);
    uint32_t next[C];
#pragma unroll
    for (int j = 0; j < C; ++j) next[j] = __shfl_down_sync(kFullMask, c.w[j], 1);
    const int r = q & 3;
    if (active && r < 3) {
      // Chunk q + jG's four lanes write words 3·((q + jG) / 4) .. + 2: (q + jG) / 4 = q / 4 +
      // j·G / 4, so one address and immediate offsets.
      uint32_t* const at = words + 3 * (q >> 2) + r;
#pragma unroll
      for (int j = 0; j < C; ++j) at[3 * (G / 4) * j] = Join3Bit32(c.w[j], next[j], r);
    }
  }
}

// Σ c[idx]² over a lane's 16 (32) packed codes, by pairs (DeviceTables::pair_sq), in fp64. The
// table holds 2^copies_log2 interleaved copies (entry p of copy c at p · 2^copies_log2 + c) and
// `pair_sq` points at this lane's copy.
template <int kBits, int C>
__device__ __forceinline__ double CodeSquareSum(const LaneCodes<kBits, C>& c, const double* pair_sq,
                                                int copies_log2) {
  double sum[4];  // partial sums, as in RowNorm
#pragma unroll
  for (int i = 0; i < 4 * C; ++i) {
    const uint32_t word = c.w[i / 4];
    const uint32_t pair = (word >> (2 * kBits * (i % 4))) & ((1u << (2 * kBits)) - 1);
    const double v = pair_sq[pair << copies_log2];
    sum[i % 4] = i < 4 ? v : sum[i % 4] + v;
  }
  return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

// The same with 2^kCopiesLog2 copies fixed at compile time, `table` the whole (shared) table and
// `lane_bytes` = 8 · this lane's copy: entry p of the lane's copy is at byte
// (p << (3 + kCopiesLog2)) | lane_bytes, so a lookup's address is a shift and a LOP3 of the
// code word plus the table's base (five instructions per pair with the load and the add, where
// the runtime copy count took seven).
template <int kBits, int C, int kCopiesLog2>
__device__ __forceinline__ double CodeSquareSumFixedCopies(const LaneCodes<kBits, C>& c,
                                                           const double* table,
                                                           uint32_t lane_bytes) {
  constexpr int kShift = 3 + kCopiesLog2;
  constexpr uint32_t kMask = ((1u << (2 * kBits)) - 1) << kShift;
  const char* const base = reinterpret_cast<const char*>(table);
  double sum[4];
#pragma unroll
  for (int i = 0; i < 4 * C; ++i) {
    const uint32_t word = c.w[i / 4];
    const int sh = 2 * kBits * (i % 4) - kShift;  // constant after unrolling
    const uint32_t x = sh >= 0 ? word >> sh : word << -sh;
    const double v = *reinterpret_cast<const double*>(base + ((x & kMask) | lane_bytes));
    sum[i % 4] = i < 4 ? v : sum[i % 4] + v;
  }
  return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

// Values: uniform min/max over the finite fp16 range (EncodeSlot). Takes the lane's min/max,
// returns the lane's packed codes and the row's fp16 scale and zero.
template <int G, int kBits, int N>
__device__ __forceinline__ void QuantizeValues(const float (&v)[N], float vmin, float vmax,
                                               LaneCodes<kBits, N / 8>& codes, uint16_t& scale_bits,
                                               uint16_t& zero_bits) {
  const float row_min = GroupMin<G>(vmin), row_max = GroupMax<G>(vmax);
  vmin = fminf(fmaxf(row_min, -65504.0f), 65504.0f);
  vmax = fminf(fmaxf(row_max, -65504.0f), 65504.0f);
  constexpr uint32_t kLevels = (1u << kBits) - 1;
  float scale = __fdiv_rn(__fsub_rn(vmax, vmin), static_cast<float>(kLevels));
  if (!(scale > 1e-8f)) scale = 1e-8f;
  const float r = DivisionReciprocal(scale);  // scale is normal: 1e-8 <= scale <= 131008 / 7
  if (row_min >= -65504.0f && row_max <= 65504.0f) {  // the usual row: no cap needed
#pragma unroll
    for (int i = 0; i < N; ++i) codes.Add(i, ValueCodeInRange(v[i], vmin, scale, r));
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) codes.Add(i, ValueCode(v[i], vmin, scale, r, kLevels));
  }
  scale_bits = __half_as_ushort(__float2half_rn(scale));
  zero_bits = __half_as_ushort(__float2half_rn(vmin));
}

// ---------------------------------------------------------------------------------------------
// The store kernel: one launch writes codes and metadata of every row. A persistent grid (as many
// CTAs as fit at once) walks the rows in chunks of kRows; each iteration loads the next chunk's
// inputs before it computes the current one.
//   KB: key bits (8 = FP8 E4M3 keys; 3 or 4 = MSE codes), VB: value bits.

template <int D, int KB, InputType T, KeySource S, int N = kLaneElems>
struct KeyInput {
  static constexpr InputType kType = (S == KeySource::kLoadY && KB != 8) ? InputType::kF32 : T;
  using Raw = RawRow<kType, N>;
};

// The store kernel's layouts: kNarrow (16 elements per lane, 256-thread CTAs; every path) and, for
// the FWHT path with 16-bit inputs, kWide.
enum class StoreLayout { kNarrow, kWide };

// The wide FWHT kernel (StoreLayout::kWide): E = 32 elements per lane instead of 16,
// so G = D / 32 lanes per row, a warp holds twice the rows, and every per-row step (reductions,
// norm, divisions, norm correction, value range, metadata) is shared by half as many lanes; one
// cross-lane FWHT stage fewer. 22 % fewer instructions than the narrow kernel at D = 128; it needs
// 128 registers, so it runs 128-thread CTAs, four per SM (at 96 registers for five it spilled and
// was slower). The default for the FWHT path with 16-bit inputs at D = 128 and 256.
inline constexpr StoreLayout kWide = StoreLayout::kWide;
inline constexpr int64_t kWideMinRows = 32768;
template <StoreLayout kLayout>
inline constexpr int kLaneElemsFor = kLayout == kWide ? 32 : kLaneElems;
template <StoreLayout kLayout>
inline constexpr int kCtaThreadsFor = kLayout == kWide ? 128 : kThreads;
inline constexpr int kWideTileVecs = 128;  // 16-byte vectors of one tensor's warp tile (2 KB)
inline constexpr int kWideTileBytes = kCtaThreadsFor<kWide> / 32 * 2 * kWideTileVecs * 16;

// Minimum CTAs per SM the kernel is compiled for (register budget): the MSE kernels need 80
// registers for three CTAs (24 warps) per SM, which hides their dependency chains (shuffles,
// lookups, fp64 sums) better than two CTAs of 100+ registers; FP8 needs no bound; the wide kernel
// (kWide) four 128-thread CTAs.
constexpr int MinCtasPerSm(int key_bits, KeySource source, StoreLayout layout) {
  if (source == KeySource::kMma && key_bits != 8) return 2;  // ~100 KB of shared memory each
  if (layout == kWide) return 4;  // 128-thread CTAs (kCtaThreadsFor): 128 registers
  return key_bits == 8 ? 1 : 3;
}

template <int D, int KB, int VB, InputType T, KeySource S, StoreLayout kLayout>
__global__ void __launch_bounds__(kCtaThreadsFor<kLayout>, MinCtasPerSm(KB, S, kLayout))
    StoreKernel(const StoreParams p) {
  constexpr int kThreads = kCtaThreadsFor<kLayout>;  // this kernel's CTA size
  constexpr int E = kLaneElemsFor<kLayout>;          // elements per lane
  constexpr int G = D / E;                           // lanes per row
  constexpr int kRows = kThreads / G;                // rows per CTA and iteration
  static_assert(kLayout != kWide || (S == KeySource::kFwht && KB != 8 && T != InputType::kF32));
  constexpr bool kFp8 = KB == 8;
  constexpr bool kLoadY = S == KeySource::kLoadY && !kFp8;
  constexpr bool kMma = S == KeySource::kMma && !kFp8;
  constexpr InputType KT = KeyInput<D, KB, T, S>::kType;
  constexpr int kPairs = kFp8 ? 1 : 1 << (2 * KB);
  using Tiles = MmaTiles<D, T>;

  __shared__ LutEntry lut_s[kFp8 ? 1 : (kLayout == kWide ? kWideLutCells : kMaxLutCells)];
  // The pair table, for large stores (StoreParams::pair_copies_log2) in 16 interleaved copies,
  // lane l reading copy l % 16: the 8-byte lookups of a half-warp then hit 16 distinct bank pairs
  // (one copy: ~5-way conflicts on random codes). Only the FWHT kernel: the MMA kernels spend
  // their shared memory on the rotation tiles, and the y-reading kernel's y staging would take its
  // static shared memory past 48 KB.
  constexpr int kMaxPairCopiesLog2 = S == KeySource::kFwht ? 4 : 0;
  constexpr int kMaxPairCopies = 1 << kMaxPairCopiesLog2;
  // The wide kernel (large stores only) always fills the 16 copies: its lookups then address
  // them with compile-time shifts (CodeSquareSumFixedCopies).
  const int pair_log2 = kLayout == kWide     ? kMaxPairCopiesLog2
                        : kMaxPairCopies > 1 ? min(p.pair_copies_log2, kMaxPairCopiesLog2)
                                             : 0;
  __shared__ double pair_sq_s[kPairs * kMaxPairCopies];
  __shared__ double centroid_sq_s[kMaxCodebookSize];
  __shared__ float midpoints_s[kMaxCodebookSize];
  __shared__ uint4 stage_s[kLoadY ? kThreads / 32 * kTileVecs : 1];  // y tiles (TileToRows)
  // kMma: Πᵀ hi/lo, the key tile and the y tile (MmaTiles), in dynamic shared memory.
  extern __shared__ uint4 mma_s[];
  uint8_t* const rot_s = reinterpret_cast<uint8_t*>(mma_s);
  uint8_t* const key_s = rot_s + Tiles::kRotationBytes;
  float* const y_s = reinterpret_cast<float*>(key_s + Tiles::kKeyBytes);
  // The wide kernel's input tiles (kWideTileBytes of dynamic shared memory): per warp, the next
  // key and value rows (2 KB each), copied in by cp.async one iteration ahead (WideTileSlot).
  uint4* const tile_s = mma_s;

  const BlockFormat& f = p.format;
  const int tid = threadIdx.x;
  const int q = tid % G;
  const int lane = tid % 32;
  uint4* const stage = stage_s + (kLoadY ? tid / 32 * kTileVecs : 0);
  const int num_heads = f.num_kv_heads;
  const int64_t rows = p.num_tokens * num_heads;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRows;

  if constexpr (!kFp8) {
    if constexpr (kMma) {  // Πᵀ hi/lo into the swizzled tile (HalfTileChunk)
      constexpr int kRowChunks = D / 8, kChunks = 2 * D * kRowChunks;
      const uint4* const src = reinterpret_cast<const uint4*>(p.rotation_f16);
      for (int i = tid; i < kChunks; i += kThreads) {
        const int row = i / kRowChunks, c = i % kRowChunks;  // row: split · D + n
        mma_s[row * kRowChunks + HalfTileChunk(row, c)] = __ldg(src + i);
      }
    }
    for (int i = tid; i < p.lut.cells; i += kThreads) lut_s[i] = p.tables->lut[i];
    for (int i = tid; i < (kPairs << pair_log2); i += kThreads) {
      pair_sq_s[i] = p.tables->pair_sq[i >> pair_log2];
    }
    if (tid < kMaxCodebookSize) {
      centroid_sq_s[tid] = p.tables->centroid_sq[tid];
      midpoints_s[tid] = p.tables->midpoints[tid];
    }
    __syncthreads();
  }
  uint32_t sign_bits = 0;
  if constexpr (S == KeySource::kFwht && !kFp8) {
    if (p.use_signs) {  // bit e = the sign of element LaneElement(q, e, G)
#pragma unroll
      for (int c = 0; c < E / 8; ++c) {
        const int j = 8 * (q + c * G);
        sign_bits |= ((__ldg(p.tables->sign_bits + j / 32) >> (j % 32)) & 0xFFu) << (8 * c);
      }
    }
  }
  // The wide kernel's FWHT on tensor cores (FwhtOnTensorCores): this lane's H16 fragments and
  // its sign bits spread over the 16-bit words.
  constexpr bool kTensorFwht = kLayout == kWide;
  uint32_t hadamard_b[2][2] = {};
  uint32_t sign_spread = 0;
  if constexpr (kTensorFwht) {
    constexpr uint32_t kOne = T == InputType::kBF16 ? 0x3F80u : 0x3C00u;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int r = 0; r < 2; ++r) hadamard_b[j][r] = HadamardFragment(lane, j, r, kOne);
    }
    sign_spread = SpreadPairSigns(sign_bits);
  }
  const int block_shift = __ffs(f.block_size) - 1;  // block sizes are powers of two

  // Loads of one row (token, head): slot, key (or y and norm), value. y (fp32) is loaded as the
  // warp's contiguous tile (the rows of a warp are consecutive) and rearranged by `process`.
  struct Loaded {
    typename KeyInput<D, KB, T, S, E>::Raw k;
    RawRow<T, E> v;
    int64_t slot;
    float norm;
    float factor;  // kMma: MmaRowScale::factor
  };
  auto load = [&](int64_t token, int head, Loaded& n) {
    const bool in_range = token < p.num_tokens;
    const int64_t row = token * num_heads + head;
    const int64_t row_elem = row * D;
    n.slot = in_range ? LoadSlot(p, token) : -1;
    if constexpr (kLoadY) {
      LoadTile<D>(p.y, row - lane / G, rows, lane, n.k.w);
      n.norm = in_range ? __ldg(p.norms + row) : 0.0f;
      n.factor = p.y_factors != nullptr && in_range ? __ldg(p.y_factors + row) : 0.0f;
    } else {
      LoadRaw<KT, G>(p.key, row_elem, q, in_range, n.k);
      n.norm = 0.0f;
    }
    if constexpr (!kLoadY) n.factor = 0.0f;
    LoadRaw<T, G>(p.value, row_elem, q, in_range, n.v);
  };

  // Quantizes and writes one row.
  auto process = [&](const Loaded& in, int64_t token, int head) {
    const int64_t slot = in.slot;
    if (slot >= p.num_slots && p.status != nullptr && head == 0 && q == 0) {
      atomicMax(&p.status->inverted_first_bad_token, ~static_cast<unsigned long long>(token));
      atomicAdd(&p.status->num_bad_tokens, 1ull);
    }
    const bool active = slot >= 0 && slot < p.num_slots;  // never write outside the cache
    // Block ids and offsets within a block fit 32 bits (ValidateStoreArguments checks the
    // cache: fewer than 2^32 blocks of fewer than 2^31 bytes), so a row's addresses are one
    // 32 x 32 -> 64-bit multiply-add from the block id (64-bit products cost ~35 instructions
    // per row).
    const uint32_t block = active ? static_cast<uint32_t>(slot >> block_shift) : 0u;
    const uint32_t pos = active ? static_cast<uint32_t>(slot) & (f.block_size - 1) : 0u;
    uint8_t* const block_base =
        p.cache + static_cast<uint64_t>(block) * static_cast<uint32_t>(f.block_bytes);
    const uint32_t dps = static_cast<uint32_t>(f.data_per_slot);
    uint8_t* const key_dst = block_base + (pos * static_cast<uint32_t>(num_heads) + head) * dps;

    float k[E], v[E];
    if constexpr (kLoadY) {
      typename KeyInput<D, KB, T, S, E>::Raw y;
      TileToRows<G>(in.k.w, stage, lane, y.w);
      ToFloat<KT>(y, k);
      if (p.y_factors != nullptr) {  // y of the scaled keys (replicate_scaled), as kMma's
#pragma unroll
        for (int i = 0; i < E; ++i) k[i] = __fmul_rn(k[i], in.factor);
      }
    } else if constexpr (kMma) {  // this row of the y tile (MmaTile), in LaneElement order
      const int r = tid / G;
      const float* const y_row = y_s + r * D;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = (j < 2 ? 2 * q : 2 * (q + G)) + (j & 1);
        const float4 y4 = *reinterpret_cast<const float4*>(y_row + 4 * YTileChunk(r, c));
        k[4 * j + 0] = __fmul_rn(y4.x, in.factor);
        k[4 * j + 1] = __fmul_rn(y4.y, in.factor);
        k[4 * j + 2] = __fmul_rn(y4.z, in.factor);
        k[4 * j + 3] = __fmul_rn(y4.w, in.factor);
      }
    } else if constexpr (!kTensorFwht) {  // the tensor-core FWHT reads the raw words
      ToFloat<KT>(in.k, k);
    }
    uint16_t meta0 = 0;  // k_norm (MSE)

    if constexpr (kFp8) {
      uint32_t packed[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(k[4 * j], k[4 * j + 1]),
                                                     __NV_SATFINITE, __NV_E4M3);
        const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(k[4 * j + 2], k[4 * j + 3]),
                                                     __NV_SATFINITE, __NV_E4M3);
        packed[j] = lo | (hi << 16);
      }
      if (active) {
        uint64_t* dst = reinterpret_cast<uint64_t*>(key_dst);  // chunks q and q + G
        dst[q] = packed[0] | (static_cast<uint64_t>(packed[1]) << 32);
        dst[q + G] = packed[2] | (static_cast<uint64_t>(packed[3]) << 32);
      }
    } else {
      float norm = in.norm;
      if constexpr (S == KeySource::kFwht) {
        // y = x̂ · Πᵀ = FWHT(x̂ ⊙ s) · fp32(1/√D), x̂ = k / (‖k‖ + 1e-8). The division is folded
        // into the final scale, y = FWHT(k ⊙ s) · (fp32(1/√D) / denom): a few ulp from the
        // reference's fp64 product, like any fp32 rotation. Keys whose sums could overflow fp32
        // are divided first instead.
        if constexpr (kTensorFwht) {
          norm = RowNorm<G>(in.k);
        } else {
          norm = RowNorm<G>(k);
        }
        const float denom = norm + 1e-8f;
        float post_scale = p.fwht_scale;
        bool transformed = false;
        if constexpr (kTensorFwht) {
          // On tensor cores when every row of the warp has a norm of 0 or in [1e-24, 1e36):
          // then no fp32 sum can overflow, and subnormal inputs (were they flushed) weigh < 2^-40
          // of the row. Other warps (inf / NaN / huge / tiny keys) take the fp32 butterflies.
          const bool plain = norm == 0.0f || (norm >= 1e-24f && norm < 1e36f);
          if (p.fwht_on_tensor_cores && __all_sync(kFullMask, plain)) {
            post_scale = __fdiv_rn(p.fwht_scale, denom);
            if (p.use_signs) {
              FwhtOnTensorCores<T, G, true>(in.k, sign_spread, hadamard_b, post_scale, k, q);
            } else {
              FwhtOnTensorCores<T, G, false>(in.k, sign_spread, hadamard_b, post_scale, k, q);
            }
            transformed = true;  // and scaled
          }
        }
        if (!transformed) {
          if constexpr (kTensorFwht) ToFloat<KT>(in.k, k);
          if (norm < 1e36f) {
            post_scale = __fdiv_rn(p.fwht_scale, denom);
          } else {
#pragma unroll
            for (int i = 0; i < E; ++i) k[i] = __fdiv_rn(k[i], denom);
          }
          if (p.use_signs) {
#pragma unroll
            for (int i = 0; i < E; ++i) {
              k[i] =
                  __uint_as_float(__float_as_uint(k[i]) ^ ((sign_bits << (31 - i)) & 0x80000000u));
            }
          }
          Fwht<G>(k, q);
#pragma unroll
          for (int i = 0; i < E; ++i) k[i] = __fmul_rn(k[i], post_scale);
        }
      }
      // Rows with a finite norm have |y| <= 1 (+ rounding): the lookup table's domain. NaN and
      // inf keys (NaN y) take the binary search, which sends NaN to 0 as the reference does.
      LaneCodes<KB, E / 8> codes;
      if (p.lut.cells > 0 && norm <= 3.4e38f) {
        // LutBucketize without its clamp (y is finite and |y| <= 1 + rounding here, inside the
        // table's ±kLutRange), the cell's byte address in one shift-add: t's bits are 0x4B400000
        // + cell, so (bits << 3) + (table address − (0x4B400000 << 3)) is the entry (mod 2^32).
        // The code is packed as base_index << s plus, if y passes the cell's midpoint, 1 << s.
        const uint32_t lut_biased = SmemAddr(lut_s) + p.lut_address_bias;
#pragma unroll
        for (int i = 0; i < E; ++i) {
          const float t = __fmaf_rn(k[i], p.lut.inv_step, p.lut.magic_bias);
          const uint32_t at = (static_cast<uint32_t>(__float_as_int(t)) << 3) + lut_biased;
          float next_midpoint;
          uint32_t base_index;
          asm("ld.shared.v2.b32 {%0, %1}, [%2];" : "=f"(next_midpoint), "=r"(base_index) : "r"(at));
          const int s = KB * (i % 8);  // constant after unrolling
          uint32_t& word = codes.w[i / 8];
          word += base_index << s;
          // + (1 << s) if y >= the cell's midpoint: one predicated add (the compiler makes it a
          // select and an add otherwise).
          asm("{\n .reg .pred p;\n setp.ge.f32 p, %1, %2;\n @p add.u32 %0, %0, %3;\n}\n"
              : "+r"(word)
              : "f"(k[i]), "f"(next_midpoint), "r"(1u << s));
        }
      } else {
#pragma unroll
        for (int i = 0; i < E; ++i) codes.Add(i, SearchBucketize(k[i], midpoints_s, KB));
      }
      double csum;
      if constexpr (kLayout == kWide) {
        csum = GroupSum<G>(CodeSquareSumFixedCopies<KB, E / 8, kMaxPairCopiesLog2>(
            codes, pair_sq_s, 8u * (lane & (kMaxPairCopies - 1))));
      } else {
        csum = GroupSum<G>(
            CodeSquareSum<KB>(codes, pair_sq_s + (lane & ((1 << pair_log2) - 1)), pair_log2));
      }
      StoreCodes<KB, G>(codes, q, active, key_dst);
      float stored =
          p.norm_correction ? static_cast<float>(double(norm) / sqrt(csum + 1e-16)) : norm;
      if (isnan(stored)) stored = 0.0f;  // NaN keys: a zero norm, never NaN metadata
      meta0 = __half_as_ushort(__float2half_rn(fminf(fmaxf(stored, -65504.0f), 65504.0f)));
    }

    float vmin, vmax;
    ToFloat<T>(in.v, v);
    LaneMinMax<T>(in.v, v, vmin, vmax);
    uint16_t scale_bits, zero_bits;
    LaneCodes<VB, E / 8> vcodes;
    QuantizeValues<G, VB>(v, vmin, vmax, vcodes, scale_bits, zero_bits);
    StoreCodes<VB, G>(vcodes, q, active, key_dst + f.key_data_bytes);

    // Metadata: lane q of the row writes field q (fp16 arrays [H][fields][block_size]).
    constexpr int kMeta = kFp8 ? 2 : 3;
    if (active && q < kMeta) {
      const MetaField first = kFp8 ? MetaField::kValueScale : MetaField::kKeyNorm;
      const uint16_t bits = kFp8 ? (q == 0 ? scale_bits : zero_bits)
                                 : (q == 0 ? meta0 : (q == 1 ? scale_bits : zero_bits));
      // f.MetaOffset(first, pos, head) + 2 q · block_size, in 32 bits.
      const uint32_t bs = static_cast<uint32_t>(f.block_size);
      const uint32_t at = static_cast<uint32_t>(f.meta_offset) +
                          2u * ((head * static_cast<uint32_t>(f.num_meta) +
                                 static_cast<uint32_t>(f.MetaFieldIndex(first)) + q) *
                                    bs +
                                pos);
      *reinterpret_cast<uint16_t*>(block_base + at) = bits;
    }
  };

  // Rows advance by `stride` per iteration; (token, head) is carried along, so the kernel divides
  // by the head count only here. The loop runs over chunks (uniform in the CTA), so the shuffles
  // stay convergent.
  const int64_t num_chunks = (rows + kRows - 1) / kRows;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kRows + tid / G;
  int64_t token = first_row / num_heads;
  int head = static_cast<int>(first_row - token * num_heads);
  const int64_t stride_tokens = stride / num_heads;
  const int stride_heads = static_cast<int>(stride - stride_tokens * num_heads);
  auto advance = [&](int64_t& t, int& h) {
    t += stride_tokens;
    h += stride_heads;
    if (h >= num_heads) {
      h -= num_heads;
      ++t;
    }
  };
  if constexpr (kMma) {
    // Per chunk: the norm and scaling of each row and its fp16 key into the key tile; the next
    // chunk's loads; the tile's y on tensor cores into the y tile; then `process` per row.
    const int r = tid / G;  // row of the tile
    auto prepare = [&](Loaded& in) {
      float kf[kLaneElems];
      ToFloat<T>(in.k, kf);
      in.norm = RowNorm<G>(kf);
      const MmaRowScale sc = MmaScaleForNorm(in.norm);
      in.factor = sc.factor;
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // chunks q and q + G of the row
        uint32_t hi[4], lo[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float a = __fmul_rn(kf[8 * h + 2 * j], sc.up);
          const float b = __fmul_rn(kf[8 * h + 2 * j + 1], sc.up);
          const __half2 hh = __floats2half2_rn(a, b);
          memcpy(&hi[j], &hh, 4);
          if constexpr (Tiles::kKeyParts == 2) {
            const float2 back = __half22float2(hh);
            const __half2 hl = __floats2half2_rn(__fsub_rn(a, back.x), __fsub_rn(b, back.y));
            memcpy(&lo[j], &hl, 4);
          }
        }
        const int c = HalfTileChunk(r, q + h * G);
        uint4* const dst = reinterpret_cast<uint4*>(key_s) + r * (D / 8) + c;
        *dst = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        if constexpr (Tiles::kKeyParts == 2) {
          dst[kRows * (D / 8)] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        }
      }
    };
    // Warp w computes rows [32 (w / (D / 16)), +32) × columns [16 (w % (D / 16)), +16) of the
    // tile: 2 × 2 m16n8 tiles, D / 16 k-steps of 2 (fp32 keys: 3) MMAs per tile.
    auto mma_tile = [&]() {
      constexpr int kWarpCols = D / 16;
      static_assert(kRows == 32 * (8 / kWarpCols), "8 warps of 32 rows x 16 columns");
      const int warp = tid / 32;
      const int row0 = 32 * (warp / kWarpCols), col0 = 16 * (warp % kWarpCols);
      float acc[2][2][4] = {};
      const uint32_t rot_base = SmemAddr(rot_s), key_base = SmemAddr(key_s);
#pragma unroll 2
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[Tiles::kKeyParts][2][4];
#pragma unroll
        for (int part = 0; part < Tiles::kKeyParts; ++part) {
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            const int row = row0 + 16 * mt + (lane & 15);
            const int c = HalfTileChunk(row, 2 * ks + (lane >> 4));
            LdMatrix4(key_base + ((part * kRows + row) * (D / 8) + c) * 16, a[part][mt]);
          }
        }
        uint32_t b[2][4];  // per n-tile: hi (k 0-7, 8-15), lo (k 0-7, 8-15)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int n = col0 + 8 * nt + (lane & 7);
          const int row = (lane >> 4) * D + n;  // split · D + n
          const int c = HalfTileChunk(row, 2 * ks + ((lane >> 3) & 1));
          LdMatrix4(rot_base + (row * (D / 8) + c) * 16, b[nt]);
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            MmaF16(acc[mt][nt], a[0][mt], b[nt][2], b[nt][3]);  // hi key · lo Πᵀ
            if constexpr (Tiles::kKeyParts == 2) {
              MmaF16(acc[mt][nt], a[1][mt], b[nt][0], b[nt][1]);  // lo key · hi Πᵀ
            }
            MmaF16(acc[mt][nt], a[0][mt], b[nt][0], b[nt][1]);  // hi key · hi Πᵀ
          }
        }
      }
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int n = col0 + 8 * nt + 2 * t;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = row0 + 16 * mt + g + 8 * h;
            float* const dst = y_s + row * D + 4 * YTileChunk(row, n / 4) + n % 4;
            *reinterpret_cast<float2*>(dst) =
                make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
          }
        }
      }
    };
    Loaded cur;
    load(token, head, cur);
    for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
      prepare(cur);
      int64_t next_token = token;
      int next_head = head;
      advance(next_token, next_head);
      Loaded next;
      load(next_token, next_head, next);  // past the end: no loads (slot -1)
      __syncthreads();                    // key tile written
      mma_tile();
      __syncthreads();  // y tile written (and the key tile read)
      process(cur, token, head);
      cur = next;
      token = next_token;
      head = next_head;
    }
  } else if constexpr (kLayout == kWide) {
    // The warp's rows are consecutive, so its key rows (and value rows) are one contiguous 2 KB
    // tile: cp.async copies the next iteration's tiles into the warp's shared buffers, lane L
    // taking vectors L, L + 32, L + 64, L + 96 (512 contiguous bytes per instruction: whole lines,
    // half the L2 requests of direct 16-byte loads at 4 lanes per row), while this iteration
    // computes. At the top of an iteration the lanes read their chunks from the buffers.
    static_assert(E * 32 / 8 == kWideTileVecs && T != InputType::kF32);
    constexpr int kRowVecs = D / 8;                              // 16-byte vectors per row
    uint4* const tiles = tile_s + tid / 32 * 2 * kWideTileVecs;  // keys, then values
    const uint32_t tiles_addr = SmemAddr(tiles);
    // Vector v = lane + 32 i has slot WideTileSlot(lane) + 32 i (bit 4 of v is bit 4 of lane), so
    // a whole tile is 8 copies at immediate offsets from three addresses; only the last tile of
    // the store checks its rows.
    const uint32_t lane_dst = tiles_addr + 16 * WideTileSlot(lane);
    auto issue = [&](int64_t t, int h) {
      const int64_t row0 = t * num_heads + h - lane / G;  // the warp's first row
      if (row0 + kWideTileVecs / kRowVecs <= rows) {
        const int64_t at = row0 * (D * 2) + 16 * lane;
        const uint8_t* const k_src = static_cast<const uint8_t*>(p.key) + at;
        const uint8_t* const v_src = static_cast<const uint8_t*>(p.value) + at;
#pragma unroll
        for (int i = 0; i < kWideTileVecs / 32; ++i) {
          CpAsync16(lane_dst + 512 * i, k_src + 512 * i);
          CpAsync16(lane_dst + 16 * kWideTileVecs + 512 * i, v_src + 512 * i);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kWideTileVecs / 32; ++i) {
          const int v = lane + 32 * i;
          const bool valid = row0 + v / kRowVecs < rows;
          const int64_t at = valid ? row0 * D * 2 + 16 * v : 0;
          const uint32_t dst = tiles_addr + 16 * WideTileSlot(v);
          CpAsync16(dst, static_cast<const uint8_t*>(p.key) + at, valid);
          CpAsync16(dst + 16 * kWideTileVecs, static_cast<const uint8_t*>(p.value) + at, valid);
        }
      }
      CpAsyncCommit();
    };
    issue(token, head);
    int64_t slot = token < p.num_tokens ? LoadSlot(p, token) : -1;
    for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
      CpAsyncWaitAll();
      __syncwarp();
      Loaded a;
#pragma unroll
      for (int c = 0; c < E / 8; ++c) {
        const int v = WideTileSlot((lane / G) * kRowVecs + q + c * G);
        a.k.w[c] = tiles[v];
        a.v.w[c] = tiles[kWideTileVecs + v];
      }
      a.slot = slot;
      a.norm = 0.0f;
      a.factor = 0.0f;
      __syncwarp();  // every lane has read the buffers
      int64_t next_token = token;
      int next_head = head;
      advance(next_token, next_head);
      if (chunk + gridDim.x < num_chunks) issue(next_token, next_head);  // uniform in the CTA
      slot = next_token < p.num_tokens ? LoadSlot(p, next_token) : -1;
      process(a, token, head);
      token = next_token;
      head = next_head;
    }
  } else {
    // Loads at the top of each iteration; other warps (three or more CTAs per SM) cover them.
    // The next chunk's key and value rows are prefetched into L2 meanwhile (each lane one or two
    // 32-byte sectors of each), so its loads wait for L2, not DRAM.
    constexpr int kElemBytes = T == InputType::kF32 ? 4 : 2;
    constexpr int kLaneBytes = E * kElemBytes;  // this lane's share of a row
    for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
      Loaded a;
      load(token, head, a);
      if constexpr (kLayout == StoreLayout::kNarrow && S != KeySource::kLoadY) {
        int64_t next_token = token;
        int next_head = head;
        advance(next_token, next_head);
        if (next_token < p.num_tokens) {
          const int64_t at =
              (next_token * num_heads + next_head) * (D * kElemBytes) + q * kLaneBytes;
#pragma unroll
          for (int s = 0; s < kLaneBytes; s += 32) {
            asm volatile(
                "prefetch.global.L2 [%0];" ::"l"(static_cast<const uint8_t*>(p.key) + at + s));
            asm volatile(
                "prefetch.global.L2 [%0];" ::"l"(static_cast<const uint8_t*>(p.value) + at + s));
          }
        }
      }
      process(a, token, head);
      advance(token, head);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GEMM path, step 1: x̂ = k / (‖k‖ + 1e-8) and ‖k‖ for every row.
//
// The arithmetic of a row is StoreKernel's (same LaneElement ownership, so the same fp64 sum order
// and butterfly for ‖k‖, then IEEE divisions); only the data movement is arranged for bandwidth:
// a persistent grid of warps, each taking tiles of kGroups · 32 / G consecutive rows with all the
// tile's loads issued before any arithmetic; 16-bit keys read directly (16 G contiguous bytes per
// row and instruction), fp32 keys and fp32 x̂ moved as contiguous warp tiles (TileToRows,
// RowsToTile: 512 contiguous bytes per instruction); bf16 x̂ written directly (16 G contiguous
// bytes per row and instruction); the tile's norms gathered into lanes 0.. and written by one
// instruction (at least 32 bytes).

// Row groups (32 / G rows each) per warp tile: 4 KB of key loads in flight per warp, and at least
// 8 norms (one sector) per tile.
template <int D, InputType T>
constexpr int kNormalizeGroups = (T != InputType::kF32) ? 4 : (D / 64 > 2 ? D / 64 : 2);

template <int D, InputType T>
constexpr int kNormalizeTileRows = kNormalizeGroups<D, T> * 32 / (D / kLaneElems);

// Three CTAs (24 warps, at most 80 registers) per SM: 96 KB of loads in flight per SM. fp32 keys
// at D = 256 hold 64 registers of loads (four 2 KB tiles per warp) and get two CTAs instead.
template <int D, InputType T>
constexpr int kNormalizeMinCtas = (T == InputType::kF32 && D == 256) ? 2 : 3;

// kOut: 0 = x̂ in fp32, 1 = x̂ in bf16, 2 = three copies of k · 2^s in bf16 and the row factors
// (NormalizeParams::replicate_scaled; bf16 keys only).
template <int D, InputType T, int kOut>
__global__ void __launch_bounds__(kThreads, kNormalizeMinCtas<D, T>)
    NormalizeKernel(const NormalizeParams p) {
  constexpr bool kBf16Out = kOut == 1;
  constexpr bool kReplicate = kOut == 2;
  static_assert(!kReplicate || T == InputType::kBF16);
  constexpr int G = D / kLaneElems;
  constexpr int kWarpRows = 32 / G;  // rows of one group
  constexpr int kGroups = kNormalizeGroups<D, T>;
  constexpr int kTileRows = kNormalizeTileRows<D, T>;
  constexpr int kWarps = kThreads / 32;
  constexpr bool kTileIn = T == InputType::kF32;
  constexpr bool kTileOut = kOut == 0;
  static_assert(kTileRows <= 32 && kTileRows * 4 >= 32);
  // A group's raw key: the contiguous tile (fp32) or LoadRaw's words (16-bit).
  constexpr int kInWords = kTileIn ? 4 : RawRow<T>::kWords;

  __shared__ uint4 stage_s[(kTileIn || kTileOut) ? kWarps * kTileVecs : 1];
  const int lane = threadIdx.x % 32;
  const int q = lane % G;
  uint4* const stage = stage_s + ((kTileIn || kTileOut) ? threadIdx.x / 32 * kTileVecs : 0);
  const int64_t rows = p.rows;
  constexpr int kCtaRows = kWarps * kTileRows;  // a chunk: one tile per warp
  const int64_t num_chunks = (rows + kCtaRows - 1) / kCtaRows;

  // The loop runs over chunks (uniform in the CTA, as the compiler can see: the shuffles and
  // __syncwarp need no convergence handling); rows past the end are masked.
  for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    const int64_t row0 = chunk * kCtaRows + threadIdx.x / 32 * kTileRows;
    uint4 in[kGroups][kInWords];
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      const int64_t group_row0 = row0 + u * kWarpRows;
      if constexpr (kTileIn) {
        LoadTile<D>(p.key, group_row0, rows, lane, in[u]);
      } else {
        const int64_t row = group_row0 + lane / G;
        RawRow<T> raw;
        LoadRaw<T, G>(p.key, row * D, q, row < rows, raw);
#pragma unroll
        for (int j = 0; j < kInWords; ++j) in[u][j] = raw.w[j];
      }
    }

    float tile_norm = 0.0f;  // lane L < kTileRows: the norm of row row0 + L
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      const int64_t group_row0 = row0 + u * kWarpRows;
      const int64_t row = group_row0 + lane / G;
      RawRow<T> raw;
      if constexpr (kTileIn) {
        TileToRows<G>(in[u], stage, lane, raw.w);
      } else {
#pragma unroll
        for (int j = 0; j < kInWords; ++j) raw.w[j] = in[u][j];
      }
      float k[kLaneElems];
      ToFloat<T>(raw, k);
      const float norm = RowNorm<G>(k);
      if constexpr (kReplicate) {
        // k · 2^s is exact in bf16 (a power-of-two scaling) except for elements below ~2^-133 of
        // the norm, which weigh nothing in y.
        const MmaRowScale scale = MmaScaleForNorm(norm, 0);
#pragma unroll
        for (int i = 0; i < kLaneElems; ++i) k[i] = __fmul_rn(k[i], scale.up);
        if (q == 0 && row < rows) p.factors[row] = scale.factor;
      } else {
        const float denom = norm + 1e-8f;
#pragma unroll
        for (int i = 0; i < kLaneElems; ++i) k[i] = __fdiv_rn(k[i], denom);
      }

      const float n = __shfl_sync(kFullMask, norm, (lane % kWarpRows) * G);
      if (lane / kWarpRows == u) tile_norm = n;

      if constexpr (kReplicate || kBf16Out) {
        // bf16 rows in the key's layout (LaneElement): x̂, or the scaled key three times.
        constexpr int kCopies = kReplicate ? 3 : 1;
        if (row < rows) {
#pragma unroll
          for (int chunk = 0; chunk < 2; ++chunk) {
            const float* x = k + 8 * chunk;
            uint32_t w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * j], x[2 * j + 1]);
              memcpy(&w[j], &b, sizeof(uint32_t));
            }
            __nv_bfloat16* const dst = static_cast<__nv_bfloat16*>(p.unit_keys) +
                                       row * (kCopies * D) + 8 * (q + chunk * G);
#pragma unroll
            for (int copy = 0; copy < kCopies; ++copy) {
              StoreVector(dst + copy * D, make_uint4(w[0], w[1], w[2], w[3]));
            }
          }
        }
      } else {
        uint4 r[4], t[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          r[j] = make_uint4(__float_as_uint(k[4 * j]), __float_as_uint(k[4 * j + 1]),
                            __float_as_uint(k[4 * j + 2]), __float_as_uint(k[4 * j + 3]));
        }
        RowsToTile<G>(r, stage, lane, t);
        uint4* const dst = static_cast<uint4*>(p.unit_keys) + group_row0 * (D / 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int v = lane + 32 * i;
          if (group_row0 + v / (D / 4) < rows) StoreVector(dst + v, t[i]);
        }
      }
    }
    if (lane < kTileRows && row0 + lane < rows) p.norms[row0 + lane] = tile_norm;
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch: head_dim, then bits, then input type, then key source, each in one switch.

// CTAs of `Kernel` that fit on the device at once with `smem_bytes` of dynamic shared memory
// (one cache per kernel, whose dynamic size is fixed; the device is the current one at first
// use). Kernels with dynamic shared memory get their limit raised to it first.
template <auto Kernel, int kCtaThreads = kThreads>
int ResidentCtas(int smem_bytes = 0) {
  static const int ctas = [smem_bytes] {
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (smem_bytes > 0) {
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    }
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kCtaThreads, smem_bytes);
    return std::max(1, sms * per_sm);
  }();
  return ctas;
}

template <auto Kernel, int kCtaThreads = kThreads>
void LaunchPersistent(const StoreParams& p, int64_t chunks, StreamHandle stream,
                      int smem_bytes = 0) {
  const int grid =
      static_cast<int>(std::min<int64_t>(chunks, ResidentCtas<Kernel, kCtaThreads>(smem_bytes)));
  Kernel<<<grid, kCtaThreads, smem_bytes, stream>>>(p);
}

template <int D, int KB, int VB, InputType T>
constexpr auto kMmaKernel = StoreKernel<D, KB, VB, T, KeySource::kMma, StoreLayout::kNarrow>;

template <int D, int KB, int VB>
bool PrepareMmaBits() {
  if constexpr (D <= 128 && KB != 8) {
    ResidentCtas<kMmaKernel<D, KB, VB, InputType::kF32>>(MmaTiles<D, InputType::kF32>::kBytes);
    ResidentCtas<kMmaKernel<D, KB, VB, InputType::kF16>>(MmaTiles<D, InputType::kF16>::kBytes);
    ResidentCtas<kMmaKernel<D, KB, VB, InputType::kBF16>>(MmaTiles<D, InputType::kBF16>::kBytes);
    return true;
  }
  return false;
}

template <int D, int KB, int VB, InputType T, StoreLayout kLayout>
void LaunchStoreLayout(const StoreParams& p, int64_t chunks, StreamHandle stream) {
  if constexpr (KB == 8) {
    LaunchPersistent<StoreKernel<D, KB, VB, T, KeySource::kFwht, kLayout>>(p, chunks, stream);
  } else if (p.key_source == KeySource::kFwht) {
    LaunchPersistent<StoreKernel<D, KB, VB, T, KeySource::kFwht, kLayout>>(p, chunks, stream);
  } else {
    // y is fp32 whatever the input type; only the values are read as T.
    LaunchPersistent<StoreKernel<D, KB, VB, T, KeySource::kLoadY, kLayout>>(p, chunks, stream);
  }
}

template <int D, int KB, int VB, InputType T>
bool LaunchStoreTyped(const StoreParams& p, int64_t chunks, StreamHandle stream) {
  if (p.key_source == KeySource::kMma) {
    if constexpr (D <= 128 && KB != 8) {
      LaunchPersistent<kMmaKernel<D, KB, VB, T>>(p, chunks, stream, MmaTiles<D, T>::kBytes);
      return true;
    }
    return false;
  }
  // The wide FWHT kernel: the default for 16-bit inputs at D = 128 and 256 from kWideMinRows rows
  // (StoreFwhtKernel forces either, to compare and to test). Below that the narrow kernel is as
  // fast or faster: a 128-thread CTA takes twice as long to copy the lookup tables into shared
  // memory, and with one iteration per CTA the tiles' copy has nothing to overlap (8 heads: N =
  // 2,048 tokens 10.4 µs narrow vs 11.8 wide; 4,096: 17.1 vs 16.8; 8,192: 25.6 vs 25.5).
  if constexpr ((D == 128 || D == 256) && T != InputType::kF32 && KB != 8) {
    const int64_t rows = p.num_tokens * p.format.num_kv_heads;
    const bool wide =
        ((p.fwht_kernel == StoreFwhtKernel::kAuto && rows >= kWideMinRows) ||
         p.fwht_kernel == StoreFwhtKernel::kWide || p.fwht_kernel == StoreFwhtKernel::kWideFp32) &&
        p.lut.cells <= kWideLutCells;
    if (wide && p.key_source == KeySource::kFwht) {
      constexpr int64_t kRowsPerCta = kCtaThreadsFor<kWide> / (D / kLaneElemsFor<kWide>);
      LaunchPersistent<StoreKernel<D, KB, VB, T, KeySource::kFwht, kWide>, kCtaThreadsFor<kWide>>(
          p, (rows + kRowsPerCta - 1) / kRowsPerCta, stream, kWideTileBytes);
      return true;
    }
  }
  LaunchStoreLayout<D, KB, VB, T, StoreLayout::kNarrow>(p, chunks, stream);
  return true;
}

template <int D, int KB, int VB>
bool LaunchStoreBits(const StoreParams& p, int64_t chunks, StreamHandle stream) {
  switch (p.input) {
    case InputType::kF32:
      return LaunchStoreTyped<D, KB, VB, InputType::kF32>(p, chunks, stream);
    case InputType::kF16:
      return LaunchStoreTyped<D, KB, VB, InputType::kF16>(p, chunks, stream);
    case InputType::kBF16:
      return LaunchStoreTyped<D, KB, VB, InputType::kBF16>(p, chunks, stream);
  }
  return false;
}

template <int D>
bool LaunchStoreDim(const StoreParams& p, int64_t chunks, StreamHandle stream) {
  const int kb = p.format.fp8_keys ? 8 : p.format.key_bits;
  const int vb = p.format.value_bits;
  if (kb == 8 && vb == 4) return LaunchStoreBits<D, 8, 4>(p, chunks, stream);
  if (kb == 4 && vb == 4) return LaunchStoreBits<D, 4, 4>(p, chunks, stream);
  if (kb == 3 && vb == 4) return LaunchStoreBits<D, 3, 4>(p, chunks, stream);
  if (kb == 3 && vb == 3) return LaunchStoreBits<D, 3, 3>(p, chunks, stream);
  return false;
}

template <int D>
bool PrepareMmaDim(const BlockFormat& f) {
  const int kb = f.fp8_keys ? 8 : f.key_bits;
  const int vb = f.value_bits;
  if (kb == 4 && vb == 4) return PrepareMmaBits<D, 4, 4>();
  if (kb == 3 && vb == 4) return PrepareMmaBits<D, 3, 4>();
  if (kb == 3 && vb == 3) return PrepareMmaBits<D, 3, 3>();
  return false;
}

constexpr int64_t kPairCopyMinRows = 65536;

int GridFor(int64_t rows, int head_dim) {
  const int64_t rows_per_cta = kThreads / (head_dim / kLaneElems);
  return static_cast<int>((rows + rows_per_cta - 1) / rows_per_cta);
}

template <int D, InputType T, int kOut>
void LaunchNormalizeTyped(const NormalizeParams& p, StreamHandle stream) {
  constexpr auto kKernel = NormalizeKernel<D, T, kOut>;
  constexpr int64_t kRowsPerCta = int64_t{kNormalizeTileRows<D, T>} * (kThreads / 32);
  const int64_t ctas = (p.rows + kRowsPerCta - 1) / kRowsPerCta;
  const int grid = static_cast<int>(std::min<int64_t>(ctas, ResidentCtas<kKernel>()));
  kKernel<<<grid, kThreads, 0, stream>>>(p);
}

template <int D, int kOut>
bool LaunchNormalizeOut(const NormalizeParams& p, StreamHandle stream) {
  switch (p.input) {
    case InputType::kF32:
      LaunchNormalizeTyped<D, InputType::kF32, kOut>(p, stream);
      return true;
    case InputType::kF16:
      LaunchNormalizeTyped<D, InputType::kF16, kOut>(p, stream);
      return true;
    case InputType::kBF16:
      LaunchNormalizeTyped<D, InputType::kBF16, kOut>(p, stream);
      return true;
  }
  return false;
}

template <int D>
bool LaunchNormalizeDim(const NormalizeParams& p, StreamHandle stream) {
  if (p.replicate_scaled) {
    if (p.input != InputType::kBF16 || p.factors == nullptr) return false;
    LaunchNormalizeTyped<D, InputType::kBF16, 2>(p, stream);
    return true;
  }
  return p.unit_keys_bf16 ? LaunchNormalizeOut<D, 1>(p, stream)
                          : LaunchNormalizeOut<D, 0>(p, stream);
}

}  // namespace

bool LaunchStore(const StoreParams& params, StreamHandle stream) {
  const int64_t rows = params.num_tokens * params.format.num_kv_heads;
  if (rows == 0) return true;
  // Copies of the pair table cost each CTA ~0.4 µs to write (+0.4 µs per call at decode sizes,
  // measured) and pay off once a CTA stores many chunks (3 % at 65,536 tokens x 8 heads).
  StoreParams p = params;
  p.pair_copies_log2 = rows >= kPairCopyMinRows ? 4 : 0;
  const int64_t chunks = GridFor(rows, p.format.head_dim);  // kRows rows each
  switch (p.format.head_dim) {
    case 64:
      return LaunchStoreDim<64>(p, chunks, stream);
    case 128:
      return LaunchStoreDim<128>(p, chunks, stream);
    case 256:
      return LaunchStoreDim<256>(p, chunks, stream);
    default:
      return false;
  }
}

bool PrepareMmaStore(const BlockFormat& f) {
  switch (f.head_dim) {
    case 64:
      return PrepareMmaDim<64>(f);
    case 128:
      return PrepareMmaDim<128>(f);
    default:
      return false;
  }
}

bool LaunchNormalize(const NormalizeParams& p, StreamHandle stream) {
  if (p.rows == 0) return true;
  switch (p.head_dim) {
    case 64:
      return LaunchNormalizeDim<64>(p, stream);
    case 128:
      return LaunchNormalizeDim<128>(p, stream);
    case 256:
      return LaunchNormalizeDim<256>(p, stream);
    default:
      return false;
  }
}

}  // namespace tqkv::store
