// Device primitives of the decode kernels: tensor-core MMAs, cp.async copies, shared-memory
// loads, programmatic-dependent-launch controls, conversions and packed-bit access. Everything
// here is a one-instruction (or few-instruction) wrapper; the kernels above it say why they use it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "attention/decode_launch.h"
#include "runtime/dtype.h"

namespace tqkv::decode_detail {

// ------------------------------------------------------------------------------------------------
// Small device helpers

// f(std::integral_constant<int, I>{}) for I = 0 .. N-1, unrolled at compile time.
template <int N, typename F>
__device__ __forceinline__ void StaticFor(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }
  (std::make_integer_sequence<int, N>{});
}

__device__ __forceinline__ void MmaF16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The uncompressed kinds' MMA: fp16 or bf16 operands, fp32 accumulation.
template <bool kFp16>
__device__ __forceinline__ void MmaPlain(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (kFp16) {
    MmaF16(c, a, b0, b1);
  } else {
    MmaBf16(c, a, b0, b1);
  }
}

// x clamped to fp16's finite range, NaN kept (numerics.h's FloatToHalfBitsClamped): 4-bit values
// dequantize up to ~60 past 65504, where a plain conversion rounds to inf.
__device__ __forceinline__ float SaturateToHalfRange(float x) {
  return x > 65504.0f ? 65504.0f : x < -65504.0f ? -65504.0f : x;
}

// (x, y) rounded to fp16 or bf16, x in the low half.
template <bool kFp16>
__device__ __forceinline__ uint32_t PackPlain(float x, float y) {
  if constexpr (kFp16) {
    const __half2 r = __floats2half2_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&r);
  } else {
    const __nv_bfloat162 r = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&r);
  }
}

// PackPlain for an attention output: fp16 saturating (SaturateToHalfRange).
template <bool kFp16>
__device__ __forceinline__ uint32_t PackOutput(float x, float y) {
  if constexpr (kFp16) return PackPlain<true>(SaturateToHalfRange(x), SaturateToHalfRange(y));
  return PackPlain<false>(x, y);
}

// Transpose of an 8x8 matrix of 16-bit elements held as an MMA fragment (thread 4·g + t holds row
// g, columns 2t and 2t+1): afterwards it holds row g, columns 2t, 2t+1 of the transpose.
__device__ __forceinline__ uint32_t Transpose8x8(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// sm_90 starts a CTA's dynamic shared memory 1 KB into its shared window (the window's top byte is
// the CTA's rank in its cluster); the codebook table's lookups add it as an immediate offset.
constexpr uint32_t kSmemStart = 0x400;

// One table entry: the hi and lo fp16 pairs of a code pair, at shared address addr + kSmemStart.
__device__ __forceinline__ void LutLoad(uint32_t addr, uint32_t& hi, uint32_t& lo) {
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2+1024];\n" : "=r"(hi), "=r"(lo) : "r"(addr));
  static_assert(kSmemStart == 1024);
}
// The c_hi pair of a table entry alone (Config::kHiTable layout, 4 bytes per lane).
__device__ __forceinline__ uint32_t LutLoadHi(uint32_t addr) {
  uint32_t hi;
  asm volatile("ld.shared.u32 %0, [%1+1024];\n" : "=r"(hi) : "r"(addr));
  return hi;
}

// 16 bytes global -> shared, asynchronously (L2 only); completed by CopyAsyncWait.
__device__ __forceinline__ void CopyAsync16(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst))),
               "l"(gmem_src));
}
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}
// cp.async groups: commit, and wait until at most N are pending.
__device__ __forceinline__ void CopyAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// x, computed once and kept in a register: the compiler cannot rematerialize a value that comes
// out of a volatile asm (it did, from the thread index, in every step of the staged loop).
__device__ __forceinline__ uint32_t Pinned(uint32_t x) {
  uint32_t r;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}
// A pointer the compiler cannot take apart: base + 32-bit offsets then stay a 64-bit add each,
// instead of being folded into one wide multiply-add per offset that holds each offset as a
// 64-bit register pair.
__device__ __forceinline__ const uint8_t* PinnedPointer(const uint8_t* x) {
  const uint8_t* r;
  asm volatile("mov.b64 %0, %1;\n" : "=l"(r) : "l"(x));
  return r;
}
// An L2 evict-first policy for the cache copies (kStream below): a call reads each cache byte
// once, so its lines should go before the block tables, the query and the partials, which the
// next calls read again (an engine's next layer reads the same tables). Not for 3-bit keys in
// the decode kernels, whose 48-byte pieces share 32-byte sectors with the neighbouring KV head's,
// read by another CTA moments later (the verify passes' shared-output kernels do use it). Measured
// on the H200 (l2ef, commit 9d65190): 4bit_nc 16 × 4k 22.2-22.5 -> 21.8-21.9 µs, 64 × 1k 24.4
// -> 23.7-23.9, 1 × 32k 15.5-15.7 -> 15.3-15.5, 1 × 4k 7.1 -> 7.2-7.3; k3v4_nc 64 × 4k 77.0-77.3
// -> 77.6 with it, so its kernels copy without.
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));  // hoisted, CSE'd
  return pol;
}
// cp.async of 16 bytes that reads only `src_bytes` (16 or 0) of them and zero-fills the rest:
// with 0 nothing is read, so a copy past the end needs no branch. kStream: with the L2
// evict-first policy (the policy travels in the instruction's memory descriptor: no extra
// instruction in the loop).
template <bool kStream = false>
__device__ __forceinline__ void CopyAsync16Fill(uint32_t smem_dst, const void* gmem_src,
                                                uint32_t src_bytes) {
  if constexpr (kStream) {
    asm volatile(
        "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_dst),
        "l"(gmem_src), "r"(src_bytes), "l"(EvictFirstPolicy())
        : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
                 "r"(src_bytes)
                 : "memory");
  }
}
// CopyAsync16Fill where `issue`, else nothing at all (a zero-filling copy still writes shared
// memory: many lanes zero-filling one address serialize).
template <bool kStream = false>
__device__ __forceinline__ void CopyAsync16FillIf(bool issue, uint32_t smem_dst,
                                                  const void* gmem_src, uint32_t src_bytes) {
  if constexpr (kStream) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n"
        "@p cp.async.cg.shared.global.L2::cache_hint [%1], [%2], 16, %3, %4;\n}\n" ::"r"(
            static_cast<uint32_t>(issue)),
        "r"(smem_dst), "l"(gmem_src), "r"(src_bytes), "l"(EvictFirstPolicy())
        : "memory");
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n"
        "@p cp.async.cg.shared.global [%1], [%2], 16, %3;\n}\n" ::"r"(static_cast<uint32_t>(issue)),
        "r"(smem_dst), "l"(gmem_src), "r"(src_bytes)
        : "memory");
  }
}
// 8 bytes, where `issue`, reading `src_bytes` (8 or 0) of them and zero-filling the rest: the
// copy for sources only 8 bytes aligned (cp.async.cg copies 16 bytes only; .ca goes through L1).
__device__ __forceinline__ void CopyAsync8FillIf(bool issue, uint32_t smem_dst,
                                                 const void* gmem_src, uint32_t src_bytes) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n"
      "@p cp.async.ca.shared.global [%1], [%2], 8, %3;\n}\n" ::"r"(static_cast<uint32_t>(issue)),
      "r"(smem_dst), "l"(gmem_src), "r"(src_bytes)
      : "memory");
}
__device__ __forceinline__ void SharedLoad16(uint32_t addr, uint32_t (&w)[4]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "r"(addr));
}
__device__ __forceinline__ void SharedLoad8(uint32_t addr, uint32_t (&w)[2]) {
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(w[0]), "=r"(w[1]) : "r"(addr));
}
__device__ __forceinline__ uint32_t SharedLoad4(uint32_t addr) {
  uint32_t w;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w) : "r"(addr));
  return w;
}
template <int N>
__device__ __forceinline__ void CopyAsyncWaitGroup() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Programmatic dependent launch (the host launches the split and merge kernels with
// cudaLaunchAttributeProgrammaticStreamSerialization): a dependent grid may start while the grid
// before it runs, and waits for that grid's completion (and its memory) at GridDependencyWait;
// without the attribute both are no-ops.
__device__ __forceinline__ void GridDependencyWait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
__device__ __forceinline__ void LaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Where a sequence's columns end (VerifyColumns): every column sees positions < end0, the last
// one positions < len; rows = the pass's new tokens in this sequence (<= 0: none, len = 0).
// Decode rows: end0 = len = seq_len, q0 = 0.
struct ColumnSpan {
  int q0 = 0, rows = 1, end0 = 0, len = 0;
};
__device__ __forceinline__ ColumnSpan SpanOfColumns(const VerifyColumns& v,
                                                    const int32_t* seq_lens, int b) {
  ColumnSpan s;
  s.len = seq_lens[b];
  s.end0 = s.len;
  if (v.query_start_loc != nullptr) {
    s.q0 = v.query_start_loc[b];
    const int q_len = v.query_start_loc[b + 1] - s.q0;
    s.rows = min(v.rows, q_len - v.row_begin);
    s.end0 = s.len - q_len + v.row_begin + 1;
    s.len = s.rows > 0 ? s.end0 + s.rows - 1 : 0;
  }
  return s;
}
// The span's positions counted from `origin` (a sliding window's, SplitParams::window).
__device__ __forceinline__ ColumnSpan ShiftSpan(ColumnSpan s, int origin) {
  s.end0 -= origin;
  s.len -= origin;
  return s;
}
// The new token of verify column c, c / group (decode_variant.h: a multiply and a shift).
__device__ __forceinline__ int NewTokenOfColumn(const VerifyColumns& v, int c) {
  return NewTokenOfColumn(c, v.group_reciprocal);
}
// The caller's row (query and output) of column c of KV head h in sequence b, of a plan with
// num_q_heads = columns · num_kv_heads; −1 for a verify column past the sequence's new tokens.
__device__ __forceinline__ int64_t RowOfColumn(const VerifyColumns& v, const ColumnSpan& s,
                                               int num_q_heads, int num_kv_heads, int b, int h,
                                               int c) {
  if (v.query_start_loc == nullptr) {
    return static_cast<int64_t>(b) * num_q_heads + h * (num_q_heads / num_kv_heads) + c;
  }
  const int i = NewTokenOfColumn(v, c);
  if (i >= s.rows) return -1;
  return static_cast<int64_t>(s.q0 + v.row_begin + i) * v.num_q_heads + h * v.group + c -
         i * v.group;
}

// 2^x by the SFU alone (exp2f adds a range check and a scaling for results below 2^-126, which
// only matter for weights that vanish next to the running maximum's 1); 2^-inf = 0.
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two E4M3 bytes (low byte -> low half) to f16x2.
__device__ __forceinline__ uint32_t E4M3x2ToHalf2(uint32_t two_bytes) {
  uint32_t out;
  asm("{\n .reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;\n}\n"
      : "=r"(out)
      : "r"(two_bytes));
  return out;
}
// The same for bytes 2-3 of `word`: a conversion of the register's upper half (no shift).
__device__ __forceinline__ uint32_t E4M3x2HiToHalf2(uint32_t word) {
  uint32_t out;
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, h;\n}\n"
      : "=r"(out)
      : "r"(word));
  return out;
}

// out[i] = x in the output dtype (F32, F16 or BF16; F16 saturating).
__device__ __forceinline__ void StoreOutput(void* out, DType dtype, int64_t i, float x) {
  if (dtype == DType::kF32) {
    static_cast<float*>(out)[i] = x;
  } else if (dtype == DType::kF16) {
    static_cast<__half*>(out)[i] = __float2half_rn(SaturateToHalfRange(x));
  } else {
    static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x);
  }
}

// Value codes enter the P·V MMA as fp16 subnormals: a small integer c in the mantissa bits of a
// half with a zero exponent is exactly c · 2^-24 (tensor cores keep fp16 subnormals), so a code
// becomes an MMA operand with one AND and no conversion; the 2^24 goes into the final scaling.
constexpr float kSubnormalScale = 16777216.0f;  // 2^24

__device__ __forceinline__ float HalfBitsToFloat(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

// Loads N bytes (a multiple of 2) from `src` into words, using the widest access that the
// guaranteed alignment A allows.
template <int N, int A>
__device__ __forceinline__ void LoadBytes(const uint8_t* src, uint32_t (&w)[(N + 3) / 4]) {
  if constexpr (A >= 16 && N % 16 == 0) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(src) + i);
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  } else if constexpr (A >= 8 && N % 8 == 0) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(src) + i);
      w[2 * i] = v.x;
      w[2 * i + 1] = v.y;
    }
  } else if constexpr (A >= 4 && N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) w[i] = __ldg(reinterpret_cast<const uint32_t*>(src) + i);
  } else if constexpr (A >= 2 && N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < (N + 3) / 4; ++i) w[i] = 0;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const uint32_t h = __ldg(reinterpret_cast<const unsigned short*>(src) + i);
      w[i / 2] |= h << (16 * (i % 2));
    }
  } else {
#pragma unroll
    for (int i = 0; i < (N + 3) / 4; ++i) w[i] = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) w[i / 4] |= uint32_t{__ldg(src + i)} << (8 * (i % 4));
  }
}

// `bits` bits starting at bit `pos` of a little-endian word array (compile-time pos).
template <int kPos, int kBits, int W>
__device__ __forceinline__ uint32_t Bits(const uint32_t (&w)[W]) {
  constexpr int kWord = kPos / 32;
  constexpr int kShift = kPos % 32;
  uint32_t v = w[kWord] >> kShift;
  if constexpr (kShift + kBits > 32 && kWord + 1 < W) v |= w[kWord + 1] << (32 - kShift);
  return v & ((1u << kBits) - 1u);
}

// Launches `kernel` so that it may start before the kernel ahead of it in `stream` finishes
// (programmatic dependent launch); the kernel calls GridDependencyWait before it reads that
// kernel's results. Graph-capturable (a programmatic edge).
template <typename Params>
cudaError_t LaunchDependent(void (*kernel)(Params), dim3 grid, dim3 block, int smem,
                            cudaStream_t stream, const Params& p) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, p);
}

}  // namespace tqkv::decode_detail
