// The GEMM path's first step: x̂ = k / (‖k‖ + 1e-8) and ‖k‖ for every row (NormalizeKernel), and
// its launcher.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "quant/store_launch.h"
#include "quant/store_loads.cuh"
#include "quant/store_resident.cuh"
#include "quant/store_row_math.cuh"

namespace tqkv::store {
namespace {

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
template <int D, DType T>
constexpr int kNormalizeGroups = (T != DType::kF32) ? 4 : (D / 64 > 2 ? D / 64 : 2);

template <int D, DType T>
constexpr int kNormalizeTileRows = kNormalizeGroups<D, T> * 32 / (D / kLaneElems);

// Three CTAs (24 warps, at most 80 registers) per SM: 96 KB of loads in flight per SM. fp32 keys
// at D = 256 hold 64 registers of loads (four 2 KB tiles per warp) and get two CTAs instead.
template <int D, DType T>
constexpr int kNormalizeMinCtas = (T == DType::kF32 && D == 256) ? 2 : 3;

// kOut: 0 = x̂ in fp32, 1 = x̂ in bf16, 2 = three copies of k · 2^s in bf16 and the row factors
// (NormalizeParams::replicate_scaled; bf16 keys only).
template <int D, DType T, int kOut>
__global__ void __launch_bounds__(kThreads, kNormalizeMinCtas<D, T>)
    NormalizeKernel(const NormalizeParams p) {
  constexpr bool kBf16Out = kOut == 1;
  constexpr bool kReplicate = kOut == 2;
  static_assert(!kReplicate || T == DType::kBF16);
  constexpr int G = D / kLaneElems;
  constexpr int kWarpRows = 32 / G;  // rows of one group
  constexpr int kGroups = kNormalizeGroups<D, T>;
  constexpr int kTileRows = kNormalizeTileRows<D, T>;
  constexpr int kWarps = kThreads / 32;
  constexpr bool kTileIn = T == DType::kF32;
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

template <int D, DType T, int kOut>
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
    case DType::kF32:
      LaunchNormalizeTyped<D, DType::kF32, kOut>(p, stream);
      return true;
    case DType::kF16:
      LaunchNormalizeTyped<D, DType::kF16, kOut>(p, stream);
      return true;
    case DType::kBF16:
      LaunchNormalizeTyped<D, DType::kBF16, kOut>(p, stream);
      return true;
  }
  return false;
}

template <int D>
bool LaunchNormalizeDim(const NormalizeParams& p, StreamHandle stream) {
  if (p.replicate_scaled) {
    if (p.input != DType::kBF16 || p.factors == nullptr) return false;
    LaunchNormalizeTyped<D, DType::kBF16, 2>(p, stream);
    return true;
  }
  return p.unit_keys_bf16 ? LaunchNormalizeOut<D, 1>(p, stream)
                          : LaunchNormalizeOut<D, 0>(p, stream);
}

}  // namespace

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
