// Scalar and bit helpers of the CUDA store kernels, written once for host and device so that the
// CPU tests check them against the reference (quant/packing.h, Codebook::Bucketize) bit for bit.
// Included by kernel files: no fmt, no spdlog, no exceptions.
//
// Work split of every store kernel: one (token, head) row is handled by G = D / E consecutive
// lanes ("a lane group"), E = 16 elements per lane (kLaneElems) or 32 (the wide FWHT kernel);
// lane q of the group holds chunks q, q + G, q + 2G, ... of 8 elements (elements [8c, 8c + 8) of
// chunk c) in registers e = 0 .. E-1 (LaneElement). So each 16-byte load of a 16-bit input and each
// 4-byte code store of one warp instruction covers consecutive bytes across the lanes of a row
// (coalesced), and a row's FWHT has log2(E) in-register and log2(G) cross-lane stages.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

#include "runtime/host_device.h"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

#if defined(__CUDACC__)
#define TQKV_UNROLL _Pragma("unroll")
#else
#define TQKV_UNROLL
#endif

namespace tqkv {

// Which build of the FWHT store kernel runs (MSE presets with a Hadamard rotation, 16-bit inputs
// at head_dim 128 and 256; every other store has one kernel). kAuto: the wide kernel from 32,768
// rows (tokens × heads), the narrow one below. The others exist so that tests and benchmarks can
// compare the builds in one run.
enum class StoreFwhtKernel {
  kAuto,
  kNarrow,    // 16 elements per lane, 256-thread CTAs
  kWide,      // 32 elements per lane, 128-thread CTAs, H16 FWHT stages on tensor cores
  kWideFp32,  // the wide kernel with its FWHT as fp32 butterflies only
};

}  // namespace tqkv

namespace tqkv::store {

inline constexpr int kLaneElems = 16;        // elements of one row a lane owns
inline constexpr int kMaxLutCells = 1024;    // bucketize lookup table limit (8 KiB of smem)
inline constexpr int kMaxCodebookSize = 16;  // 4-bit codes
// The wide FWHT kernel's bucketize table holds 64 cells fewer, so that four of its CTAs (the
// table, 16 copies of the pair table at 4-bit keys and the input tiles: 56.5 KB each, plus the
// 1 KB the runtime reserves per CTA) fit in an SM's 228 KB; the launcher takes the narrow kernel
// for a codebook that needs more cells (the built-in ones at D 128 and 256 do not).
inline constexpr int kWideLutCells = kMaxLutCells - 64;

// The row element held in register e (0 .. E-1) of lane q (0 .. lanes-1).
TQKV_HOST_DEVICE constexpr int LaneElement(int q, int e, int lanes) {
  return 8 * (q + (e / 8) * lanes) + e % 8;
}

// 16 codes (each < 16) → 64 bits, code i at bits [4i, 4i + 4): the little-endian bytes are the
// 4-bit packing of TURBOQUANT.md (low nibble = even element).
TQKV_HOST_DEVICE inline uint64_t Pack16x4(const uint32_t (&c)[kLaneElems]) {
  uint32_t lo = 0, hi = 0;
  TQKV_UNROLL
  for (int i = 0; i < 8; ++i) {
    lo |= c[i] << (4 * i);
    hi |= c[i + 8] << (4 * i);
  }
  return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
}

// 16 codes (each < 8) → 48 bits, code i at bits [3i, 3i + 3): the 3-bit bit stream.
TQKV_HOST_DEVICE inline uint64_t Pack16x3(const uint32_t (&c)[kLaneElems]) {
  uint32_t lo = 0, hi = 0;
  TQKV_UNROLL
  for (int i = 0; i < 8; ++i) {
    lo |= c[i] << (3 * i);
    hi |= c[i + 8] << (3 * i);
  }
  return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 24);
}

// Builds the same 64-bit word code by code: code i (< 2^bits) of a lane at bits [bits·i, ...).
// Two 32-bit halves (codes 0-7 and 8-15), so each step is one shift-add.
template <int kBits>
struct PackedCodes {
  uint32_t lo = 0, hi = 0;
  TQKV_HOST_DEVICE void Add(int i, uint32_t code) {
    if (i < 8) {
      lo += code << (kBits * i);
    } else {
      hi += code << (kBits * (i - 8));
    }
  }
  TQKV_HOST_DEVICE uint64_t Word() const {
    return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << (8 * kBits));
  }
};

// The same for any number of 8-code chunks: chunk j (codes 8j .. 8j + 7) in word j, code i at
// bits [bits·(i mod 8), ...) of its word (PackedCodes<kBits> has w[0] = lo, w[1] = hi).
template <int kBits, int kChunks>
struct LaneCodes {
  uint32_t w[kChunks] = {};
  TQKV_HOST_DEVICE void Add(int i, uint32_t code) { w[i / 8] += code << (kBits * (i % 8)); }
};

// ---------------------------------------------------------------------------------------------
// The FWHT on tensor cores (the wide FWHT kernel, 16-bit inputs, G = 4 or 8 lanes per row). A
// lane's chunk of 8 elements is one 16-byte load: four 32-bit words, word i holding elements
// 2i and 2i + 1. One m16n8k16 MMA per n-tile j (j = 0, 1) multiplies the chunk by H16 over the
// row index bits {0, 2, 3, 4}; the others (bit 1, the chunk bits 5, 6 and at D = 256 bit 7) stay
// butterflies. With g = lane / 4 and t = lane % 4 (= the chunk's index bits 3-4, since G is a
// multiple of 4 and lanes of a row are consecutive):
//  - A (16 × 16): row g + 8h holds element bit 1 = h of lane group g; column k has k bit 0 =
//    element bit 0, bits 1-2 = t, bit 3 = element bit 2. So A register i (PTX: a0 row g, a1 row
//    g + 8, a2 / a3 the same rows at columns + 8) is word i of the chunk, as loaded: the MMA
//    takes the load's registers with no moves.
//  - B (16 × 8): H16[k][n] with n = g + 8j, ±1 (exact in bf16 and fp16): HadamardFragment.
//  - C: register r of n-tile j (c0 / c1 row g, c2 / c3 row g + 8, columns 2t, 2t + 1) is element
//    MmaOutputElement(j, r) = 4j + r of the same chunk, so the lane keeps the elements it owned.
// The bit maps are the same on both sides, so B is the Sylvester H16 itself.

TQKV_HOST_DEVICE constexpr int MmaOutputElement(int j, int r) { return 4 * j + r; }

// B register `reg` (0: k = 2t, 2t + 1; 1: k = 2t + 8, 2t + 9) of n-tile j for `lane`; `one` is
// the 16-bit pattern of +1.0 (0x3F80 bf16, 0x3C00 fp16), −1.0 = one | 0x8000.
TQKV_HOST_DEVICE constexpr uint32_t HadamardFragment(int lane, int j, int reg, uint32_t one) {
  const int n = lane / 4 + 8 * j;
  const int k = 2 * (lane % 4) + 8 * reg;
  auto entry = [&](int kk) {
    const int x = kk & n;  // < 16
    const uint32_t odd = static_cast<uint32_t>((x ^ (x >> 1) ^ (x >> 2) ^ (x >> 3)) & 1);
    return one | (odd << 15);
  };
  return entry(k) | (entry(k + 1) << 16);
}

// hadamard_signs on the raw 16-bit words: `sign_bits` bit e = the sign of lane element e (32
// elements); the spread word has the sign of element 2i at bit 15 − i and of element 2i + 1 at bit
// 31 − i, so that word i's flip mask is one shift and AND (PairSignMask).
TQKV_HOST_DEVICE constexpr uint32_t SpreadPairSigns(uint32_t sign_bits) {
  uint32_t s = 0;
  for (int i = 0; i < 16; ++i) {
    s |= ((sign_bits >> (2 * i)) & 1u) << (15 - i);
    s |= ((sign_bits >> (2 * i + 1)) & 1u) << (31 - i);
  }
  return s;
}
TQKV_HOST_DEVICE constexpr uint32_t PairSignMask(uint32_t spread, int i) {
  return (spread << i) & 0x80008000u;
}

// 3-bit codes are written as 4-byte words: the 24-bit chunks of four lanes make three words.
// Lane r (r = 0, 1, 2 within its four) writes word r from its own chunk and that of lane r + 1:
// bits [8r + 8, 8r + 40) of the 64-bit (next : own << 8), one funnel shift.
TQKV_HOST_DEVICE inline uint32_t Join3Bit32(uint32_t own, uint32_t next, int r) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(own << 8, next, 8 * r + 8);
#else
  return static_cast<uint32_t>(((static_cast<uint64_t>(next) << 32) | (own << 8)) >> (8 * r + 8));
#endif
}

TQKV_HOST_DEVICE inline int32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(f);
#else
  int32_t i;
  std::memcpy(&i, &f, sizeof(i));
  return i;
#endif
}

// Bucketize by lookup. A uniform grid covers |y| <= kLutRange (every finite y of a unit key
// rotated by a (near-)orthogonal Πᵀ: |y| <= 1 + rounding) and is fine enough that no cell, widened
// by a quarter cell on each side, holds more than one midpoint. For y in cell u the index is then
// base_index + (y >= next_midpoint) exactly; the widening absorbs the rounding of the cell
// computation. `next_midpoint` is NaN where no midpoint follows (the comparison is false).
inline constexpr float kLutRange = 1.5f;

struct LutEntry {
  float next_midpoint;
  int32_t base_index;
};

struct BucketLut {
  float inv_step = 0;    // 1 / cell width (the cell edges are defined with this fp32 value)
  float magic_bias = 0;  // 1.5 · 2^23 + K: fma(y, inv_step, magic_bias) = 1.5 · 2^23 + round(u)
  int cells = 0;         // 0: no table (midpoints too close for kMaxLutCells): binary search
};

// Number of midpoints m with m <= y, as Codebook::Bucketize, for |y| <= kLutRange (not NaN); `lut`
// has p.cells entries. One FMA gives the cell in the low mantissa bits (the sum lies in
// [2^23, 2^24), where the ulp is 1); the unsigned min only keeps a y outside the range (which the
// kernels never pass) inside the table.
TQKV_HOST_DEVICE inline int LutBucketize(float y, const LutEntry* lut, const BucketLut& p) {
#if defined(__CUDA_ARCH__)
  const float t = __fmaf_rn(y, p.inv_step, p.magic_bias);
  const uint32_t cell =
      min(static_cast<uint32_t>(FloatBits(t) - 0x4B400000), static_cast<uint32_t>(p.cells - 1));
#else
  const float t = std::fma(y, p.inv_step, p.magic_bias);
  const uint32_t raw = static_cast<uint32_t>(FloatBits(t) - 0x4B400000);
  const uint32_t cell =
      raw < static_cast<uint32_t>(p.cells - 1) ? raw : static_cast<uint32_t>(p.cells - 1);
#endif
  const LutEntry e = lut[cell];
  return e.base_index + (y >= e.next_midpoint ? 1 : 0);
}

// The same by binary search over `num_midpoints` (= 2^bits - 1) increasing midpoints.
TQKV_HOST_DEVICE inline int SearchBucketize(float y, const float* midpoints, int bits) {
  int idx = 0;
  for (int half = 1 << (bits - 1); half > 0; half >>= 1) {
    if (y >= midpoints[idx + half - 1]) idx += half;
  }
  return idx;
}

// ---------------------------------------------------------------------------------------------
// Tensor-core rotation (KeySource::kMma): y = x̂ · Πᵀ from fp16 MMAs with fp32 accumulation.
// Πᵀ is scaled by 2^kMmaRotationShift and split into two fp16 matrices, hi = fp16(256·Πᵀ) and
// lo = fp16(256·Πᵀ − hi), whose sum carries ~22 bits of each entry. The key row is scaled by a
// power of two 2^s to a norm in [32, 64) (exact for 16-bit inputs: every bf16 or fp16 element
// of the row above 2^-19 of the norm is an fp16 number after the scaling; fp32 keys are split
// into hi + lo fp16 as well). Then y = (k'·hi + k'·lo) · 2^(-s-8) / (‖k‖ + 1e-8): a few ulp from
// the reference's fp64 product, as any fp32 GEMM.
inline constexpr int kMmaRotationShift = 8;

// 2^n as a float, n in [-126, 127].
TQKV_HOST_DEVICE inline float Exp2i(int n) {
#if defined(__CUDA_ARCH__)
  return __int_as_float((127 + n) << 23);
#else
  return std::bit_cast<float>(static_cast<uint32_t>(127 + n) << 23);
#endif
}

struct MmaRowScale {
  float up;      // 2^s: the row is multiplied by it before the fp16 conversion
  float factor;  // 2^(-s - kMmaRotationShift) / (norm + 1e-8) (rounded): y = MMA sum · factor
};

// The scaling of a row of norm `norm` (fp32, as RowNorm rounds it). s puts the scaled norm in
// [32, 64): s = 132 − (biased exponent of norm), capped at 126 (norm 0 or subnormal). A norm that
// overflowed fp32 (finite elements, exponent field 255) gets s = −123, which keeps every element
// below 2^5, and factor 0: y = 0, as the reference's k / inf. inf or NaN elements make the MMA
// sum inf or NaN and y NaN (factor 0 or NaN), as the reference's x̂ = k / inf.
// (`rotation_shift` 0: the GEMM path's replicated bf16 keys, NormalizeParams::replicate_scaled.)
TQKV_HOST_DEVICE inline MmaRowScale MmaScaleForNorm(float norm,
                                                    int rotation_shift = kMmaRotationShift) {
  const int biased = (FloatBits(norm) >> 23) & 0xff;
  const int s = 132 - biased < 126 ? 132 - biased : 126;
  const int ex = -s - rotation_shift;  // in [-134, 123]: two factors, each a normal float
  const int ea = ex / 2, eb = ex - ea;
  const float inv = 1.0f / (norm + 1e-8f);  // IEEE division (no fast-math in the kernels)
  return {Exp2i(s), inv * Exp2i(ea) * Exp2i(eb)};
}

#if defined(__CUDACC__)
// Device-only arithmetic of the value quantizer (used by store_kernels.cu and checked against
// __fdiv_rn by store_cuda_test).

// The reciprocal the fast path of IEEE fp32 division (__fdiv_rn) computes: MUFU.RCP and one
// Newton step. Hoisted out of a row's divisions, which share their divisor.
__device__ __forceinline__ float DivisionReciprocal(float b) {
  float r0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(b));
  return __fmaf_rn(r0, __fmaf_rn(-b, r0, 1.0f), r0);
}

// a / b by the three FMAs of __fdiv_rn's fast path (r = DivisionReciprocal(b)): bit-identical to
// __fdiv_rn wherever that path needs no fix-up, i.e. for normal a, b and a quotient far from
// overflow and underflow. The value quantizer needs the exact quotient only where it decides a
// code (quotient in [0.5, levels], a and b normal); elsewhere any close value gives the same code.
__device__ __forceinline__ float DivideFast(float a, float b, float r) {
  const float q0 = __fmul_rn(a, r);
  return __fmaf_rn(r, __fmaf_rn(-b, q0, a), q0);
}

// min that propagates NaN (fminf returns the other operand).
__device__ __forceinline__ float MinPropagateNan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The same for a value of a row whose values all lie in [-65504, 65504] (or are NaN): then
// 0 <= v - vmin <= vmax - vmin, so the code cannot pass `levels` and no cap is needed.
__device__ __forceinline__ uint32_t ValueCodeInRange(float v, float vmin, float scale, float r) {
  return __float2uint_rd(__fadd_rn(DivideFast(__fsub_rn(v, vmin), scale, r), 0.5f));
}

// The code of one value: floor((v - vmin) / scale + 0.5) clamped to [0, levels], as
// Quantizer::EncodeSlot computes it in IEEE fp32 (r = DivisionReciprocal(scale), scale normal).
// a = v - vmin is >= 0 or NaN. Capping a at 2^40 (any a that large gives `levels`) keeps the
// quotient finite, so +inf gives `levels` as in the reference; NaN stays NaN and converts to 0, as
// do negative quotients (v = -inf).
__device__ __forceinline__ uint32_t ValueCode(float v, float vmin, float scale, float r,
                                              uint32_t levels) {
  const float a = MinPropagateNan(__fsub_rn(v, vmin), 0x1p40f);
  return min(__float2uint_rd(__fadd_rn(DivideFast(a, scale, r), 0.5f)), levels);
}
#endif  // __CUDACC__

}  // namespace tqkv::store
