// StoreKernel: one launch quantizes K/V rows into the SoA blocks (every path but the GEMM's
// normalize step). Instantiated per head_dim by store_kernels_d{64,128,256}.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "quant/store_loads.cuh"
#include "quant/store_mma_tile.cuh"
#include "quant/store_row.cuh"
#include "quant/store_row_math.cuh"

namespace tqkv::store {
namespace {

// ---------------------------------------------------------------------------------------------
// The store kernel: one launch writes codes and metadata of every row. A persistent grid (as many
// CTAs as fit at once) walks the rows in chunks of kRows; each iteration loads the next chunk's
// inputs before it computes the current one.
//   KB: key bits (8 = FP8 E4M3 keys; 3 or 4 = MSE codes), VB: value bits.

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

template <int D, int KB, int VB, DType T, KeySource S, StoreLayout kLayout>
__global__ void __launch_bounds__(kCtaThreadsFor<kLayout>, MinCtasPerSm(KB, S, kLayout))
    StoreKernel(const StoreParams p) {
  constexpr int kThreads = kCtaThreadsFor<kLayout>;  // this kernel's CTA size
  constexpr int E = kLaneElemsFor<kLayout>;          // elements per lane
  constexpr int G = D / E;                           // lanes per row
  constexpr int kRows = kThreads / G;                // rows per CTA and iteration
  static_assert(kLayout != kWide || (S == KeySource::kFwht && KB != 8 && T != DType::kF32));
  constexpr bool kFp8 = KB == 8;
  constexpr bool kLoadY = S == KeySource::kLoadY && !kFp8;
  constexpr bool kMma = S == KeySource::kMma && !kFp8;
  constexpr DType KT = KeyInput<D, KB, T, S>::kType;
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
    constexpr uint32_t kOne = T == DType::kBF16 ? 0x3F80u : 0x3C00u;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int r = 0; r < 2; ++r) hadamard_b[j][r] = HadamardFragment(lane, j, r, kOne);
    }
    sign_spread = SpreadPairSigns(sign_bits);
  }
  const int block_shift = __ffs(f.block_size) - 1;  // block sizes are powers of two

  using Loaded = LoadedRow<D, KB, T, S, E>;
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

  const StoreRow<D, KB, VB, T, S, E, kLayout == kWide, kMaxPairCopiesLog2> process{
      p,         f,          tid,         q,         lane,        stage, y_s,       num_heads,
      sign_bits, hadamard_b, sign_spread, pair_log2, block_shift, lut_s, pair_sq_s, midpoints_s};

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
    using KeyTile = MmaKeyTile<D, T, G, kRows>;
    auto prepare = [&](Loaded& in) { KeyTile::Prepare(in, r, q, key_s); };
    auto mma_tile = [&]() { KeyTile::Multiply(tid, lane, rot_s, key_s, y_s); };
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
    static_assert(E * 32 / 8 == kWideTileVecs && T != DType::kF32);
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
    constexpr int kElemBytes = T == DType::kF32 ? 4 : 2;
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

}  // namespace
}  // namespace tqkv::store
