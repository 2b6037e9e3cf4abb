// CUDA store kernels: quantize K/V rows into the SoA blocks of quant/block_format.h.
//
// Every kernel mirrors Quantizer::EncodeSlot (quant/quantizer.cc) line for line; the README of
// quant/ lists the numeric choices they share (fp64 norm accumulation rounded to fp32 once, fp64
// norm correction, IEEE divisions, NaN/inf rules). The only intended difference is the rotation:
// the reference accumulates y = x̂ · Πᵀ in fp64, these kernels in fp32 (FWHT or cuBLAS), so an
// index may differ by one where y lies within a few ulp of a midpoint.
//
// Work split (quant/store_device.h): a row (token, head) is D/16 lanes, 16 elements per lane, so
// a warp holds 32·16/D rows and a 256-thread CTA 4096/D rows. Each lane reads its 16 key and 16
// value elements with 16-byte loads and writes its packed codes as 8-byte stores (lanes of a row
// write consecutive words; rows of consecutive heads of one token are contiguous in the block).
// The fp16 metadata of a CTA goes through shared memory and is written head-major, so that
// consecutive tokens of one head (consecutive positions in a block during prefill) are adjacent
// lanes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "quant/store_launch.h"

namespace tqkv::store {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Loads

__device__ __forceinline__ uint4 LoadStreaming(const void* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ float Bf16Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ void Unpack2(InputType t, uint32_t w, float& a, float& b) {
  if (t == InputType::kBF16) {
    a = Bf16Lo(w);
    b = Bf16Hi(w);
  } else {
    __half2 h;
    memcpy(&h, &w, sizeof(h));
    const float2 f = __half22float2(h);
    a = f.x;
    b = f.y;
  }
}

// Elements [elem, elem + 16) of a tensor of type T as fp32 (16-byte aligned); zeros when !valid.
template <InputType T>
__device__ __forceinline__ void Load16(const void* base, int64_t elem, bool valid,
                                       float (&out)[kLaneElems]) {
  if constexpr (T == InputType::kF32) {
    uint4 w[4] = {};
    const float* p = static_cast<const float*>(base) + elem;
    if (valid) {
#pragma unroll
      for (int j = 0; j < 4; ++j) w[j] = LoadStreaming(p + 4 * j);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      out[4 * j + 0] = __uint_as_float(w[j].x);
      out[4 * j + 1] = __uint_as_float(w[j].y);
      out[4 * j + 2] = __uint_as_float(w[j].z);
      out[4 * j + 3] = __uint_as_float(w[j].w);
    }
  } else {
    uint4 w[2] = {};
    const uint16_t* p = static_cast<const uint16_t*>(base) + elem;
    if (valid) {
      w[0] = LoadStreaming(p);
      w[1] = LoadStreaming(p + 8);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      Unpack2(T, w[j].x, out[8 * j + 0], out[8 * j + 1]);
      Unpack2(T, w[j].y, out[8 * j + 2], out[8 * j + 3]);
      Unpack2(T, w[j].z, out[8 * j + 4], out[8 * j + 5]);
      Unpack2(T, w[j].w, out[8 * j + 6], out[8 * j + 7]);
    }
  }
}

__device__ __forceinline__ int64_t LoadSlot(const StoreParams& p, int64_t token) {
  return p.slots_are_i64 ? __ldg(static_cast<const long long*>(p.slot_mapping) + token)
                         : static_cast<int64_t>(__ldg(static_cast<const int*>(p.slot_mapping) + token));
}

// ---------------------------------------------------------------------------------------------
// Reductions over the G lanes of a row (xor butterflies: every lane gets the same value, since
// a + b == b + a bitwise).

template <int G>
__device__ __forceinline__ double GroupSum(double x) {
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
template <int G>
__device__ __forceinline__ float RowNorm(const float (&k)[kLaneElems]) {
  double ss = 0.0;
#pragma unroll
  for (int i = 0; i < kLaneElems; ++i) ss = fma(double(k[i]), double(k[i]), ss);
  return static_cast<float>(sqrt(GroupSum<G>(ss)));
}

// y = FWHT(x) over the row (Sylvester order: y[j] = Σ_i x[i] (-1)^popcount(i & j)), unscaled.
// Index bits 0-3 are inside the lane, bits 4.. across the lanes of the group.
template <int G>
__device__ __forceinline__ void Fwht(float (&x)[kLaneElems], int q) {
#pragma unroll
  for (int h = 1; h < kLaneElems; h <<= 1) {
#pragma unroll
    for (int i = 0; i < kLaneElems; ++i) {
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int m = 1; m < G; m <<= 1) {
    // The lane whose bit is set keeps (partner − own), the other (own + partner); fma with ±1 is
    // one exactly rounded add either way.
    const float sign = (q & m) ? -1.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < kLaneElems; ++i) {
      const float other = __shfl_xor_sync(kFullMask, x[i], m);
      x[i] = __fmaf_rn(sign, x[i], other);
    }
  }
}

// Writes `bits`-bit codes of a lane (16 codes) into the row's code region at `dst` (8-aligned):
// 4-bit: one 8-byte word per lane; 3-bit: three words per four lanes.
template <int kBits>
__device__ __forceinline__ void StoreCodes(const uint32_t (&codes)[kLaneElems], int q,
                                           bool active, uint8_t* dst) {
  if constexpr (kBits == 4) {
    const uint64_t w = Pack16x4(codes);
    if (active) reinterpret_cast<uint64_t*>(dst)[q] = w;
  } else {
    static_assert(kBits == 3);
    const uint64_t own = Pack16x3(codes);
    const uint64_t next = __shfl_down_sync(kFullMask, own, 1);
    const int r = q & 3;
    if (active && r < 3) {
      reinterpret_cast<uint64_t*>(dst)[3 * (q >> 2) + r] = Join3BitWord(own, next, r);
    }
  }
}

// Values: uniform min/max over the finite fp16 range (EncodeSlot). Returns the lane's codes and
// the row's fp16 scale and zero.
template <int G, int kBits>
__device__ __forceinline__ void QuantizeValues(const float (&v)[kLaneElems],
                                               uint32_t (&codes)[kLaneElems], uint16_t& scale_bits,
                                               uint16_t& zero_bits) {
  float vmin = INFINITY, vmax = -INFINITY;
#pragma unroll
  for (int i = 0; i < kLaneElems; ++i) {  // fminf/fmaxf skip NaN, as the reference does
    vmin = fminf(vmin, v[i]);
    vmax = fmaxf(vmax, v[i]);
  }
  vmin = fminf(fmaxf(GroupMin<G>(vmin), -65504.0f), 65504.0f);
  vmax = fminf(fmaxf(GroupMax<G>(vmax), -65504.0f), 65504.0f);
  constexpr uint32_t kLevels = (1u << kBits) - 1;
  float scale = __fdiv_rn(__fsub_rn(vmax, vmin), static_cast<float>(kLevels));
  if (!(scale > 1e-8f)) scale = 1e-8f;
  const float r = DivisionReciprocal(scale);  // scale is normal: 1e-8 <= scale <= 131008 / 7
#pragma unroll
  for (int i = 0; i < kLaneElems; ++i) codes[i] = ValueCode(v[i], vmin, scale, r, kLevels);
  scale_bits = __half_as_ushort(__float2half_rn(scale));
  zero_bits = __half_as_ushort(__float2half_rn(vmin));
}

// ---------------------------------------------------------------------------------------------
// The store kernel: one launch writes codes and metadata of every row.
//   KB: key bits (8 = FP8 E4M3 keys; 3 or 4 = MSE codes), VB: value bits.

template <int D, int KB, int VB, InputType T, KeySource S>
__global__ void __launch_bounds__(kThreads) StoreKernel(const StoreParams p) {
  constexpr int G = D / kLaneElems;   // lanes per row
  constexpr int kRows = kThreads / G;  // rows per CTA
  constexpr bool kFp8 = KB == 8;
  constexpr int kMeta = kFp8 ? 2 : 3;

  __shared__ LutEntry lut_s[kFp8 ? 1 : kMaxLutCells];
  __shared__ double centroid_sq_s[kMaxCodebookSize];
  __shared__ float midpoints_s[kMaxCodebookSize];
  __shared__ uint16_t meta_s[kRows][kMeta];
  __shared__ long long meta_at_s[kRows];  // byte offset of the row's first fp16 field, or -1

  const BlockFormat& f = p.format;
  const int tid = threadIdx.x;
  const int q = tid % G;
  const int row_in_cta = tid / G;
  const int num_heads = f.num_kv_heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + row_in_cta;
  const bool in_range = row < p.num_tokens * num_heads;
  const int64_t token = row / num_heads;
  const int head = static_cast<int>(row - token * num_heads);

  int64_t slot = -1;
  if (in_range) slot = LoadSlot(p, token);
  if (slot >= p.num_slots && p.status != nullptr && head == 0 && q == 0) {
    atomicMax(&p.status->inverted_first_bad_token, ~static_cast<unsigned long long>(token));
    atomicAdd(&p.status->num_bad_tokens, 1ull);
  }
  const bool active = slot >= 0 && slot < p.num_slots;  // never write outside the cache

  // All loads first, so that a lane has 64-128 bytes in flight before its first use.
  const int64_t elem = row * D + q * kLaneElems;
  float k[kLaneElems], v[kLaneElems];
  float norm = 0.0f;
  if constexpr (S == KeySource::kLoadY && !kFp8) {
    Load16<InputType::kF32>(p.y, elem, active, k);
    if (active) norm = __ldg(p.norms + row);
  } else {
    Load16<T>(p.key, elem, active, k);
  }
  Load16<T>(p.value, elem, active, v);

  if constexpr (!kFp8) {
    for (int i = tid; i < p.lut.cells; i += kThreads) lut_s[i] = p.tables->lut[i];
    if (tid < kMaxCodebookSize) {
      centroid_sq_s[tid] = p.tables->centroid_sq[tid];
      midpoints_s[tid] = p.tables->midpoints[tid];
    }
  }
  __syncthreads();

  const int64_t block = active ? slot / f.block_size : 0;
  const int pos = active ? static_cast<int>(slot - block * f.block_size) : 0;
  uint8_t* const block_base = p.cache + block * f.block_bytes;
  uint8_t* const key_dst = block_base + f.KeyCodesOffset(pos, head);
  uint32_t codes[kLaneElems];
  uint16_t norm_bits = 0;

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
      uint64_t* dst = reinterpret_cast<uint64_t*>(key_dst) + 2 * q;
      dst[0] = packed[0] | (static_cast<uint64_t>(packed[1]) << 32);
      dst[1] = packed[2] | (static_cast<uint64_t>(packed[3]) << 32);
    }
  } else {
    if constexpr (S == KeySource::kFwht) {
      // y = x̂ · Πᵀ = FWHT(x̂ ⊙ s) · fp32(1/√D), x̂ = k / (‖k‖ + 1e-8). The division is folded
      // into the final scale, y = FWHT(k ⊙ s) · (fp32(1/√D) / denom): a few ulp from the
      // reference's fp64 product, like any fp32 rotation. Keys whose sums could overflow fp32
      // are divided first instead.
      norm = RowNorm<G>(k);
      const float denom = norm + 1e-8f;
      float post_scale = p.fwht_scale;
      if (norm < 1e36f) {
        post_scale = __fdiv_rn(p.fwht_scale, denom);
      } else {
#pragma unroll
        for (int i = 0; i < kLaneElems; ++i) k[i] = __fdiv_rn(k[i], denom);
      }
      if (p.use_signs) {
        const uint32_t bits = __ldg(p.tables->sign_bits + q / 2) >> (16 * (q & 1));
#pragma unroll
        for (int i = 0; i < kLaneElems; ++i) {
          k[i] = __uint_as_float(__float_as_uint(k[i]) ^ ((bits << (31 - i)) & 0x80000000u));
        }
      }
      Fwht<G>(k, q);
#pragma unroll
      for (int i = 0; i < kLaneElems; ++i) k[i] = __fmul_rn(k[i], post_scale);
    }
    double csum = 0.0;
    if (p.lut.cells > 0) {
#pragma unroll
      for (int i = 0; i < kLaneElems; ++i) {
        const int idx = LutBucketize(k[i], lut_s, p.lut);
        codes[i] = static_cast<uint32_t>(idx);
        csum += centroid_sq_s[idx];
      }
    } else {
#pragma unroll
      for (int i = 0; i < kLaneElems; ++i) {
        const int idx = SearchBucketize(k[i], midpoints_s, KB);
        codes[i] = static_cast<uint32_t>(idx);
        csum += centroid_sq_s[idx];
      }
    }
    csum = GroupSum<G>(csum);
    StoreCodes<KB>(codes, q, active, key_dst);
    float stored =
        p.norm_correction ? static_cast<float>(double(norm) / sqrt(csum + 1e-16)) : norm;
    if (isnan(stored)) stored = 0.0f;  // NaN keys: a zero norm, never NaN metadata
    norm_bits = __half_as_ushort(__float2half_rn(fminf(fmaxf(stored, -65504.0f), 65504.0f)));
  }

  uint16_t scale_bits, zero_bits;
  QuantizeValues<G, VB>(v, codes, scale_bits, zero_bits);
  StoreCodes<VB>(codes, q, active, key_dst + f.key_data_bytes);

  // Metadata through shared memory, written head-major.
  if (q == 0) {
    int i = 0;
    if constexpr (!kFp8) meta_s[row_in_cta][i++] = norm_bits;
    meta_s[row_in_cta][i++] = scale_bits;
    meta_s[row_in_cta][i] = zero_bits;
    meta_at_s[row_in_cta] =
        active ? (block * f.block_bytes + f.MetaOffset(kFp8 ? MetaField::kValueScale
                                                            : MetaField::kKeyNorm,
                                                       pos, head))
               : -1;
  }
  __syncthreads();
  const bool head_major = kRows % num_heads == 0;
  const int tokens_in_cta = kRows / num_heads;
  for (int e = tid; e < kRows * kMeta; e += kThreads) {
    const int field = e / kRows;
    const int r = e - field * kRows;
    const int row_i =
        head_major ? (r % tokens_in_cta) * num_heads + r / tokens_in_cta : r;
    const long long at = meta_at_s[row_i];
    if (at >= 0) {
      *reinterpret_cast<uint16_t*>(p.cache + at + 2 * static_cast<int64_t>(field) * f.block_size) =
          meta_s[row_i][field];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GEMM path, step 1: x̂ = k / (‖k‖ + 1e-8) and ‖k‖ for every row.

template <int D, InputType T, bool kBf16Out>
__global__ void __launch_bounds__(kThreads) NormalizeKernel(const NormalizeParams p) {
  constexpr int G = D / kLaneElems;
  constexpr int kRows = kThreads / G;
  const int q = threadIdx.x % G;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / G;
  const bool valid = row < p.rows;
  const int64_t elem = row * D + q * kLaneElems;
  float k[kLaneElems];
  Load16<T>(p.key, elem, valid, k);
  const float norm = RowNorm<G>(k);
  const float denom = norm + 1e-8f;
#pragma unroll
  for (int i = 0; i < kLaneElems; ++i) k[i] = __fdiv_rn(k[i], denom);
  if (!valid) return;
  if (q == 0) p.norms[row] = norm;
  if constexpr (kBf16Out) {
    uint32_t w[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(k[2 * j], k[2 * j + 1]);
      memcpy(&w[j], &b, sizeof(uint32_t));
    }
    uint4* dst = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.unit_keys) + elem);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  } else {
    float4* dst = reinterpret_cast<float4*>(static_cast<float*>(p.unit_keys) + elem);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      dst[j] = make_float4(k[4 * j], k[4 * j + 1], k[4 * j + 2], k[4 * j + 3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch: head_dim, then bits, then input type, then key source, each in one switch.

template <int D, int KB, int VB, InputType T>
bool LaunchStoreTyped(const StoreParams& p, int grid, StreamHandle stream) {
  if constexpr (KB == 8) {
    StoreKernel<D, KB, VB, T, KeySource::kFwht><<<grid, kThreads, 0, stream>>>(p);
  } else if (p.key_source == KeySource::kFwht) {
    StoreKernel<D, KB, VB, T, KeySource::kFwht><<<grid, kThreads, 0, stream>>>(p);
  } else {
    // y is fp32 whatever the input type; only the values are read as T.
    StoreKernel<D, KB, VB, T, KeySource::kLoadY><<<grid, kThreads, 0, stream>>>(p);
  }
  return true;
}

template <int D, int KB, int VB>
bool LaunchStoreBits(const StoreParams& p, int grid, StreamHandle stream) {
  switch (p.input) {
    case InputType::kF32:
      return LaunchStoreTyped<D, KB, VB, InputType::kF32>(p, grid, stream);
    case InputType::kF16:
      return LaunchStoreTyped<D, KB, VB, InputType::kF16>(p, grid, stream);
    case InputType::kBF16:
      return LaunchStoreTyped<D, KB, VB, InputType::kBF16>(p, grid, stream);
  }
  return false;
}

template <int D>
bool LaunchStoreDim(const StoreParams& p, int grid, StreamHandle stream) {
  const int kb = p.format.fp8_keys ? 8 : p.format.key_bits;
  const int vb = p.format.value_bits;
  if (kb == 8 && vb == 4) return LaunchStoreBits<D, 8, 4>(p, grid, stream);
  if (kb == 4 && vb == 4) return LaunchStoreBits<D, 4, 4>(p, grid, stream);
  if (kb == 3 && vb == 4) return LaunchStoreBits<D, 3, 4>(p, grid, stream);
  if (kb == 3 && vb == 3) return LaunchStoreBits<D, 3, 3>(p, grid, stream);
  return false;
}

int GridFor(int64_t rows, int head_dim) {
  const int64_t rows_per_cta = kThreads / (head_dim / kLaneElems);
  return static_cast<int>((rows + rows_per_cta - 1) / rows_per_cta);
}

template <int D, bool kBf16Out>
bool LaunchNormalizeOut(const NormalizeParams& p, int grid, StreamHandle stream) {
  switch (p.input) {
    case InputType::kF32:
      NormalizeKernel<D, InputType::kF32, kBf16Out><<<grid, kThreads, 0, stream>>>(p);
      return true;
    case InputType::kF16:
      NormalizeKernel<D, InputType::kF16, kBf16Out><<<grid, kThreads, 0, stream>>>(p);
      return true;
    case InputType::kBF16:
      NormalizeKernel<D, InputType::kBF16, kBf16Out><<<grid, kThreads, 0, stream>>>(p);
      return true;
  }
  return false;
}

template <int D>
bool LaunchNormalizeDim(const NormalizeParams& p, int grid, StreamHandle stream) {
  return p.unit_keys_bf16 ? LaunchNormalizeOut<D, true>(p, grid, stream)
                          : LaunchNormalizeOut<D, false>(p, grid, stream);
}

}  // namespace

bool LaunchStore(const StoreParams& p, StreamHandle stream) {
  const int64_t rows = p.num_tokens * p.format.num_kv_heads;
  if (rows == 0) return true;
  const int grid = GridFor(rows, p.format.head_dim);
  switch (p.format.head_dim) {
    case 64:
      return LaunchStoreDim<64>(p, grid, stream);
    case 128:
      return LaunchStoreDim<128>(p, grid, stream);
    case 256:
      return LaunchStoreDim<256>(p, grid, stream);
    default:
      return false;
  }
}

bool LaunchNormalize(const NormalizeParams& p, StreamHandle stream) {
  if (p.rows == 0) return true;
  const int grid = GridFor(p.rows, p.head_dim);
  switch (p.head_dim) {
    case 64:
      return LaunchNormalizeDim<64>(p, grid, stream);
    case 128:
      return LaunchNormalizeDim<128>(p, grid, stream);
    case 256:
      return LaunchNormalizeDim<256>(p, grid, stream);
    default:
      return false;
  }
}

}  // namespace tqkv::store
