// The MMA path's key tiles (KeySource::kMma): each row's norm and scaled fp16 key (hi and lo
// parts) into the swizzled key tile, then y = key · Πᵀ on tensor cores into the y tile, from which
// StoreRow reads its row.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "quant/store_loads.cuh"
#include "quant/store_row_math.cuh"

namespace tqkv::store {
namespace {

template <int D, DType T, int G, int kRows>
struct MmaKeyTile {
  using Tiles = MmaTiles<D, T>;

  // Row r's norm and scaling, and its fp16 key into the key tile (this lane: chunks q, q + G).
  template <typename Loaded>
  __device__ __forceinline__ static void Prepare(Loaded& in, int r, int q, uint8_t* key_s) {
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
  }

  // y tile = key tile · Πᵀ. Warp w computes rows [32 (w / (D / 16)), +32) × columns
  // [16 (w % (D / 16)), +16) of the tile: 2 × 2 m16n8 tiles, D / 16 k-steps of 2 (fp32 keys: 3)
  // MMAs per tile.
  __device__ __forceinline__ static void Multiply(int tid, int lane, const uint8_t* rot_s,
                                                  const uint8_t* key_s, float* y_s) {
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
          *reinterpret_cast<float2*>(dst) = make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
        }
      }
    }
  }
};

}  // namespace
}  // namespace tqkv::store
