// Split-KV decode attention over paged caches: TurboQuant SoA blocks (4/3-bit codebook keys, FP8
// keys; 4/3-bit uniform values) and uncompressed bf16 or fp16 blocks (the "plain" kinds: one
// kernel family with bf16 or fp16 MMAs), plus the LSE merge and the query preparation for a dense
// Πᵀ (q·Πᵀ once per step; Hadamard rotations are applied to the query by each CTA's prologue, as
// a Walsh-Hadamard transform of its group's rows).
//
// One CTA = (split of the context, KV head, sequence), 4 warps (8 for the staged kernels of
// 4bit_nc and k3v4_nc; the staged kernels, those two and bf16 at D = 128, copy their chunks into
// shared memory ahead of use: see StagedLayout); it serves all query heads of the GQA group, so
// every compressed byte is read once. Each warp takes 16-token chunks in turn (a chunk never
// crosses a block: block sizes are multiples of 16) and runs both products on tensor cores with
// mma.sync m16n8k16:
//
//   scores  Sᵀ[token, head] = K̂[token, d] · Qᵀ[d, head]       (M = 16 tokens, N = 8 heads)
//   output  Oᵀ[d, head]    += Vcodesᵀ[d, token] · P'ᵀ[token, head]   (M = 16 d, N = 8 heads)
//
// (codebook keys: M = 8 tokens × {c_hi, c_lo} rows per score MMA). Everything that is rounded to
// 16 bits for an MMA is split into a hi and a lo part — q·Πᵀ, the codebook, p·scale — so scores
// and outputs keep fp32 accuracy; the online softmax rescales lazily (only when a score passes
// the running maximum by 2^6), and P' reaches the B operand of P·V by an 8x8 movmatrix.
//
// A dot product does not care in which order its terms are summed, so each thread's fragment
// slots are mapped to the d's (and tokens) that make its loads contiguous: a thread reads whole
// 8- or 16-byte runs of one token's codes. The key codebook is applied through a shared-memory
// table indexed by a code pair (one 64-bit load gives the fp16 pair and the pair of its
// remainders, so keys keep ~22 bits), replicated once per lane of a half-warp so that lookups
// never conflict (a 64-bit shared load is served as two half-warp wavefronts). Values
// are never dequantized inside the loop:
// Σ_t p_t (code_t · scale_t + zero_t) = Σ_t (p_t · scale_t) · code_t + Σ_t p_t · zero_t, so the MMA
// multiplies exact integer codes (fp16 subnormals: one AND per two codes) by p · scale, and the
// zero-point term is one scalar per head.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <utility>

#include "attention/decode_launch.h"

namespace tqkv::decode_detail {
namespace {

constexpr int kWarps = 4;      // per CTA, except the staged kernels'
constexpr int kChunk = 16;     // tokens per MMA chunk
// sm_90 starts a CTA's dynamic shared memory 1 KB into its shared window (the window's top byte is
// the CTA's rank in its cluster); the codebook table's lookups add it as an immediate offset.
constexpr uint32_t kSmemStart = 0x400;
// Lazy softmax maximum: a chunk rescales the running sums only when a score exceeds the running
// maximum by more than this (log2 units), so p = 2^(s - m) ≤ 2^kLazyMax; otherwise no reduction.
// P' = p · value scale must stay below the fp16 maximum: that holds for value scales up to
// kMaxLazyValueScale = 65504 / 2^6 (value ranges up to ~15,000); a chunk with a larger scale
// rescales to the exact maximum instead (p ≤ 1, P' ≤ the scale ≤ 65504).
constexpr float kLazyMax = 6.0f;
constexpr float kMaxLazyValueScale = 1023.0f;
constexpr float kLn2 = 0.69314718055994530942f;

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

// Transpose of an 8x8 matrix of 16-bit elements held as an MMA fragment (thread 4·g + t holds row
// g, columns 2t and 2t+1): afterwards it holds row g, columns 2t, 2t+1 of the transpose.
__device__ __forceinline__ uint32_t Transpose8x8(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// One table entry: the hi and lo fp16 pairs of a code pair, at shared address addr + kSmemStart.
__device__ __forceinline__ void LutLoad(uint32_t addr, uint32_t& hi, uint32_t& lo) {
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2+1024];\n" : "=r"(hi), "=r"(lo) : "r"(addr));
  static_assert(kSmemStart == 1024);
}
// The c_hi pair of a table entry alone (the hi-only kernel's layout, 4 bytes per lane).
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
// An L2 evict-first policy for the cache copies (kStream below): a call reads each cache byte
// once, so its lines should go before the block tables, the query and the partials, which the
// next calls read again (an engine's next layer reads the same tables). Not for 3-bit keys,
// whose 48-byte pieces share 32-byte sectors with the neighbouring KV head's, read by another
// CTA moments later. Measured on the H200 (session 25, tools/bench/NOTES.md "l2ef"): 4bit_nc
// 16 × 4k 22.2-22.5 -> 21.8-21.9 µs, 64 × 1k 24.4 -> 23.7-23.9, 1 × 32k 15.5-15.7 -> 15.3-15.5,
// 1 × 4k 7.1 -> 7.2-7.3; k3v4_nc 64 × 4k 77.0-77.3 -> 77.6 with it, so its kernels copy without.
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

// A measurement build, TQKV_DECODE_PHASE_TIMES (session 19, NOTES): lane 0 of every warp records
// the %globaltimer at fixed points of the split and merge kernels as the earliest and latest time
// any warp passed them (DecodePhaseTimes reads and resets them); otherwise no code.
#ifdef TQKV_DECODE_PHASE_TIMES
constexpr int kPhases = 9;
__device__ unsigned long long g_phase_first[kPhases];
__device__ unsigned long long g_phase_last[kPhases];
__device__ __forceinline__ void Phase(int k) {
  if ((threadIdx.x & 31) == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    atomicMin(&g_phase_first[k], t);
    atomicMax(&g_phase_last[k], t);
  }
}
// Per split CTA (the first kMaxPhaseCtas): its SM and the earliest and latest time one of its warps
// finished its chunks.
constexpr int kMaxPhaseCtas = 1024;
__device__ unsigned long long g_cta_first[kMaxPhaseCtas];
__device__ unsigned long long g_cta_last[kMaxPhaseCtas];
__device__ unsigned int g_cta_sm[kMaxPhaseCtas];
__device__ unsigned long long g_cta_start[kMaxPhaseCtas];  // its last warp's prologue done
__device__ __forceinline__ void CtaPrologueDone() {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if ((threadIdx.x & 31) == 0 && cta < kMaxPhaseCtas) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    atomicMax(&g_cta_start[cta], t);
  }
}
__device__ __forceinline__ void CtaChunksDone() {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if ((threadIdx.x & 31) == 0 && cta < kMaxPhaseCtas) {
    unsigned long long t;
    unsigned sm;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
    atomicMin(&g_cta_first[cta], t);
    atomicMax(&g_cta_last[cta], t);
    g_cta_sm[cta] = sm;
  }
}
#else
__device__ __forceinline__ void Phase(int) {}
__device__ __forceinline__ void CtaChunksDone() {}
__device__ __forceinline__ void CtaPrologueDone() {}
#endif

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

// out[i] = x in the output dtype (0 fp32, 1 fp16, 2 bf16).
__device__ __forceinline__ void StoreOutput(void* out, int dtype, int64_t i, float x) {
  if (dtype == 0) {
    static_cast<float*>(out)[i] = x;
  } else if (dtype == 1) {
    static_cast<__half*>(out)[i] = __float2half_rn(x);
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

// ------------------------------------------------------------------------------------------------
// Key and value access per cache kind. Fragment conventions (PTX m16n8k16, lane = 4·g + t):
//   A: a0 = (row g, cols 2t..2t+1), a1 = (row g+8, cols 2t..), a2 = (row g, cols 2t+8..),
//      a3 = (row g+8, cols 2t+8..);   B: b0 = (rows 2t..2t+1, col g), b1 = (rows 2t+8.., col g);
//   C: c0,c1 = (row g, cols 2t, 2t+1), c2,c3 = (row g+8, cols 2t, 2t+1).
// Score MMA k-slot ↔ d: slot 2t+e of k-step s is d = (D/4)·t + 4s + e, slot 2t+8+e is ... + 2 + e.
// PV MMA row ↔ d: row g of m-tile mt is d0 = 2·((D/16)·g + mt) (4-bit / bf16) or (D/8)·g + 2mt
// (3-bit); row g+8 is d0 + 1.

template <KeyKind kKind, int kValueBits, int kD>
struct CacheTraits;

// Common to the compressed kinds: fp16 metadata, codes as MMA operands in fp16.
template <int kValueBits, int kD>
struct CompressedValues {
  static constexpr int kValueCodesPerThread = kD / 8;  // per token: 2 rows x D/16 m-tiles
  static constexpr int kValueBytes = kValueCodesPerThread * kValueBits / 8;
  static constexpr int kValueWords = (kValueBytes + 3) / 4;
  // Guaranteed alignment of a thread's value bytes (slot strides and key sizes of the presets).
  static constexpr int kValueAlign =
      kValueBits == 4 ? kValueBytes : (kD == 256 ? 4 : (kD == 128 ? 2 : 1));

  // 3-bit codes of m-tile mt for tokens (ta, tb): a half2 for row g (d0) and for row g+8 (d0+1).
  // (4-bit codes go through RowsPair.)
  template <int kMt>
  __device__ __forceinline__ static void Rows(const uint32_t (&wa)[kValueWords],
                                              const uint32_t (&wb)[kValueWords], uint32_t& row_g,
                                              uint32_t& row_g8) {
    static_assert(kValueBits == 3);
    const uint32_t ca0 = Bits<6 * kMt, 3>(wa), ca1 = Bits<6 * kMt + 3, 3>(wa);
    const uint32_t cb0 = Bits<6 * kMt, 3>(wb), cb1 = Bits<6 * kMt + 3, 3>(wb);
    row_g = ca0 | (cb0 << 16);  // subnormal halves c · 2^-24
    row_g8 = ca1 | (cb1 << 16);
  }

  __device__ __forceinline__ static int D0(int g, int mt) {
    return kValueBits == 4 ? 2 * ((kD / 16) * g + mt) : (kD / 8) * g + 2 * mt;
  }

  // 4-bit codes: m-tiles kMt and kMt+1 (kMt even) at once. One byte-permute gathers bytes kMt,
  // kMt+1 of both tokens; low nibbles become c · 2^-24, high nibbles (masked in place, no shift)
  // 16·c · 2^-24, so rows g (even d) and g+8 (odd d) are scaled back at the end (k*RowScale).
  static constexpr float kEvenRowScale = kSubnormalScale;
  static constexpr float kOddRowScale =
      kValueBits == 4 ? kSubnormalScale / 16.0f : kSubnormalScale;
  template <int kMt>
  __device__ __forceinline__ static void RowsPair(const uint32_t (&wa)[kValueWords],
                                                  const uint32_t (&wb)[kValueWords],
                                                  uint32_t (&rows)[2][2]) {
    static_assert(kValueBits == 4 && kMt % 2 == 0);
    constexpr int j = kMt % 4;
    const uint32_t x = __byte_perm(wa[kMt / 4], wb[kMt / 4],
                                   j | ((j + 1) << 4) | ((4 + j) << 8) | ((5 + j) << 12));
    const uint32_t y = x >> 8;
    rows[0][0] = x & 0x000F000Fu;
    rows[0][1] = x & 0x00F000F0u;
    rows[1][0] = y & 0x000F000Fu;
    rows[1][1] = y & 0x00F000F0u;
  }
};

// The key codebook table: entry e (a pair of codes) of lane l at byte 256·e + 8·(l mod 16) of
// dynamic shared memory, holding the fp16 pair (c_hi[e0], c_hi[e1]) and the pair of remainders
// (c_lo): a lookup address is one byte-permute of the packed codes with lane_word = (window top
// byte) | 8·(lane mod 16). 16 replicas suffice: lanes l and l + 16 share one but sit in different
// half-warp wavefronts of the 64-bit load (ncu, session 7: 0.3 % of shared-load wavefronts
// conflict). The second 128 bytes of every 256-byte row hold the staged kernels' stages 0-1.
// (The hi-only kernel, Config::kHiOnly, keeps 32 replicas of the hi pair alone at 256·e + 4·l.)

template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kMse4, kValueBits, kD> : CompressedValues<kValueBits, kD> {
  static constexpr bool kPlain = false;
  static constexpr bool kHasNorm = true;
  static constexpr int kKeyBytes = kD / 8;  // 32 codes of 4 bits per thread (D = 128)
  static constexpr int kKeyWords = kKeyBytes / 4 + (kKeyBytes % 4 != 0);
  static constexpr int kKeyAlign = 16;
  static constexpr int kLutEntries = 256;  // code pairs
  // Address of the entry for byte kB of `w`: byte kB%4 of w to bits 8-15, bytes 0, 2, 3 of
  // lane_word (8·(lane mod 16); 0; the window's top byte) around it.
  template <int kB>
  __device__ __forceinline__ static uint32_t Addr(uint32_t w, uint32_t lane_word) {
    return __byte_perm(w, lane_word, 0x7604 | ((kB % 4) << 4));
  }
  // A fragment of k-step s for one token (words w): row g = hi parts, row g + 8 = lo parts.
  // (mask: all ones but in the TQKV_DECODE_LOOKUP_MASK measurement build.)
  template <int kS>
  __device__ __forceinline__ static void KeyFragHiLo(const uint32_t (&w)[kKeyWords],
                                                     uint32_t lane_word, uint32_t (&a)[4],
                                                     uint32_t mask = ~0u) {
    constexpr int kB0 = 2 * kS, kB1 = 2 * kS + 1;
    LutLoad(Addr<kB0>(w[kB0 / 4], lane_word) & mask, a[0], a[1]);
    LutLoad(Addr<kB1>(w[kB1 / 4], lane_word) & mask, a[2], a[3]);
  }
};

template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kMse3, kValueBits, kD> : CompressedValues<kValueBits, kD> {
  static constexpr bool kPlain = false;
  static constexpr bool kHasNorm = true;
  static constexpr int kKeyBytes = 3 * kD / 32;  // 32 codes of 3 bits per thread (D = 128)
  static constexpr int kKeyWords = (kKeyBytes + 3) / 4;
  static constexpr int kKeyAlign = kD == 64 ? 2 : (kD == 128 ? 4 : 8);
  static constexpr int kLutEntries = 64;
  template <int kS>
  __device__ __forceinline__ static void KeyFragHiLo(const uint32_t (&w)[kKeyWords],
                                                     uint32_t lane_word, uint32_t (&a)[4],
                                                     uint32_t mask = ~0u) {
    LutLoad(((Bits<12 * kS, 6>(w) << 8) | lane_word) & mask, a[0], a[1]);
    LutLoad(((Bits<12 * kS + 6, 6>(w) << 8) | lane_word) & mask, a[2], a[3]);
  }
  // Hi-only A fragment of k-step s for two tokens (words wg: row g, w8: row g + 8): c_hi pairs.
  template <int kS>
  __device__ __forceinline__ static void KeyFragHi(const uint32_t (&wg)[kKeyWords],
                                                   const uint32_t (&w8)[kKeyWords],
                                                   uint32_t lane_word, uint32_t (&a)[4]) {
    a[0] = LutLoadHi((Bits<12 * kS, 6>(wg) << 8) | lane_word);
    a[1] = LutLoadHi((Bits<12 * kS, 6>(w8) << 8) | lane_word);
    a[2] = LutLoadHi((Bits<12 * kS + 6, 6>(wg) << 8) | lane_word);
    a[3] = LutLoadHi((Bits<12 * kS + 6, 6>(w8) << 8) | lane_word);
  }
};

template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kFp8, kValueBits, kD> : CompressedValues<kValueBits, kD> {
  static constexpr bool kPlain = false;
  static constexpr bool kHasNorm = false;
  static constexpr int kKeyBytes = kD / 4;
  static constexpr int kKeyWords = kKeyBytes / 4;
  static constexpr int kKeyAlign = 16;
  static constexpr int kLutEntries = 0;
  template <int kS>
  __device__ __forceinline__ static void KeyFrag(const uint32_t (&kg)[kKeyWords],
                                                 const uint32_t (&k8)[kKeyWords],
                                                 uint32_t (&a)[4]) {
    a[0] = E4M3x2ToHalf2(kg[kS] & 0xFFFFu);
    a[1] = E4M3x2ToHalf2(k8[kS] & 0xFFFFu);
    a[2] = E4M3x2ToHalf2(kg[kS] >> 16);
    a[3] = E4M3x2ToHalf2(k8[kS] >> 16);
  }
};

template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kBf16, kValueBits, kD> {
  static constexpr float kEvenRowScale = 1.0f;
  static constexpr float kOddRowScale = 1.0f;
  static constexpr bool kPlain = true;  // uncompressed 16-bit K and V
  static constexpr bool kFp16 = false;  // bf16 elements (CacheTraits<kF16>: fp16)
  static constexpr bool kHasNorm = false;
  static constexpr int kKeyBytes = kD / 2;  // D/4 bf16 elements per thread
  static constexpr int kKeyWords = kKeyBytes / 4;
  static constexpr int kKeyAlign = 16;
  static constexpr int kLutEntries = 0;
  static constexpr int kValueBytes = kD / 4;  // D/16 m-tiles x one word (2 elements)
  static constexpr int kValueWords = kValueBytes / 4;
  static constexpr int kValueAlign = 16;
  template <int kS>
  __device__ __forceinline__ static void KeyFrag(const uint32_t (&kg)[kKeyWords],
                                                 const uint32_t (&k8)[kKeyWords],
                                                 uint32_t (&a)[4]) {
    a[0] = kg[2 * kS];
    a[1] = k8[2 * kS];
    a[2] = kg[2 * kS + 1];
    a[3] = k8[2 * kS + 1];
  }
  template <int kMt>
  __device__ __forceinline__ static void Rows(const uint32_t (&wa)[kValueWords],
                                              const uint32_t (&wb)[kValueWords], uint32_t& row_g,
                                              uint32_t& row_g8) {
    row_g = __byte_perm(wa[kMt], wb[kMt], 0x5410);   // element d0 of both tokens
    row_g8 = __byte_perm(wa[kMt], wb[kMt], 0x7632);  // element d0 + 1
  }
  __device__ __forceinline__ static int D0(int g, int mt) { return 2 * ((kD / 16) * g + mt); }
};

// Uncompressed fp16 K and V: the bf16 kind's layout and loads, fp16 MMAs.
template <int kValueBits, int kD>
struct CacheTraits<KeyKind::kF16, kValueBits, kD> : CacheTraits<KeyKind::kBf16, kValueBits, kD> {
  static constexpr bool kFp16 = true;
};

// ------------------------------------------------------------------------------------------------
// The split kernel.

// Staged kernels (4-bit keys and 4-bit values, or 3-bit keys and 4-bit values; D = 128, GQA
// group <= 4: 4bit_nc and k3v4_nc): 8 warps per CTA at 2 CTAs per SM (<= 128 registers, 16 warps
// per SM instead of 12) or, for 3-bit keys, also a narrow variant of 4 warps at 4 CTAs per SM
// (the same 16 warps; a batch that needs two rounds of 8-warp CTAs fits one round of these, so
// the CTAs' fixed prologue and epilogue are paid once; the plan picks the variant), and each
// warp copies its next chunks into shared memory by cp.async,
// kStages - 1 chunks ahead, instead of holding the next chunk in registers. A stage holds the 16
// slots of a chunk (one KV head) at a fixed pitch, then a 128-byte metadata cell per stage (3
// runs of 16 fp16). Within a slot the 16-byte units are XOR-swizzled by token (Swizzle) so that
// the lanes' key and value reads hit distinct banks. StagedLayout says where everything is.
template <KeyKind kKind, int kValueBits, int kD, bool kPacked>
constexpr bool kHasStagedKernel = (kPacked && kD == 128 && kValueBits == 4 &&
                                   (kKind == KeyKind::kMse4 || kKind == KeyKind::kMse3)) ||
                                  (!kPacked && kD <= 128 && IsPlain(kKind));
constexpr int kStagedWarps = 8;
constexpr int kStages = 4;

template <KeyKind kKind, int kW>  // kW: warps per CTA
struct StagedLayout;

// 4-bit keys: 128-byte slots at a 256-byte pitch. Stages 0 and 1 of warp w are the free second
// halves of table rows 32w + 16s .. + 15 (the 64 KB table uses the first halves), stages 2 and 3
// the two halves of rows 16w .. 16w + 15 of a 32 KB region after the table: 100 KB per CTA.
// The swizzle: unit bits 1-2 from token bits 2-3 (the four tokens a half-warp's value reads
// touch get four distinct 32-byte pairs), bit 2 also from token bit 1 (the two tokens of an
// 8-lane key read phase get disjoint halves), bit 0 from token bit 1 (v7y's copies needed it;
// the reads do not mind). Never from token bit 0: a read of token 2m + 1 is the read of 2m plus
// the pitch. The copies (one token's 8 units per 8-lane phase) are conflict-free under any XOR.
template <int kW>
struct StagedLayout<KeyKind::kMse4, kW> {
  static_assert(kW == kStagedWarps, "the stages fill the table rows' halves of 8 warps");
  static constexpr uint32_t kPitch = 256;
  static constexpr uint32_t kExtra = 256 * 256;
  static constexpr uint32_t kMeta = kExtra + kStagedWarps * 16 * 256;
  static constexpr int kBytes = kMeta + kStagedWarps * kStages * 128;
  __device__ __forceinline__ static uint32_t Stage(int warp, int s) {
    return s < 2 ? 8192u * warp + 4096u * s + 128u : kExtra + 4096u * warp + 128u * (s - 2);
  }
  __device__ __forceinline__ static uint32_t Swizzle(uint32_t i) {
    return ((i >> 1) & 1u) ^ (2u * ((i >> 2) & 3u)) ^ (4u * ((i >> 1) & 1u));
  }
};

// 3-bit keys: 112-byte slots (48 key + 64 value bytes) at a 128-byte pitch, all stages after the
// 16 KB table: 84 KB per CTA (8 warps), 50 KB (4 warps). The swizzle is a bit permutation of token
// / 2 (bits 2, 0, 1 -> unit bits 2, 1, 0): the 8 tokens of a key read (32 lanes, 4-byte words at
// 12t + 4w) get 8 distinct unit masks, which tile the 32 banks exactly, and the four tokens of a
// half-warp's value reads (units 3-4 or 5-6) get masks from {0, 1, 4, 5} or {2, 3, 6, 7}, whose
// unit pairs are disjoint.
template <int kW>
struct StagedLayout<KeyKind::kMse3, kW> {
  static constexpr uint32_t kPitch = 128;
  static constexpr uint32_t kFirst = 64 * 256;
  static constexpr uint32_t kMeta = kFirst + kW * kStages * 16 * 128;
  static constexpr int kBytes = kMeta + kW * kStages * 128;
  __device__ __forceinline__ static uint32_t Stage(int warp, int s) {
    return kFirst + 2048u * (kStages * warp + s);
  }
  __device__ __forceinline__ static uint32_t Swizzle(uint32_t i) {
    const uint32_t x = i >> 1;
    return (x & 4u) | ((x & 1u) << 1) | ((x >> 1) & 1u);
  }
};

// bf16 keys and values (D = 64 and 128, any GQA group; at D = 256 a staged chunk's registers
// spilled, so D = 256 keeps the unstaged kernel): 4 warps per CTA, each with kStages stages of
// 16 tokens × 4·D bytes (a token's 2·D key bytes, then its 2·D value bytes: 8 KB at D = 128)
// copied kStages - 1 chunks ahead, so that a warp keeps 2 chunks of loads in flight instead of the
// unstaged kernel's one chunk at a time (which leaves small batches latency-bound). A thread's key
// words are the 16-byte units 4j + t of its two tokens (not 4t·D/32 ..: the query fragments follow
// the same d order), its value words the units (D/64)·g + hh of tokens 4t + c. The units of a token
// are XOR-swizzled by Swizzle(token) (unit bits 0-2) so that every 8-lane phase of those reads
// touches 8 distinct 16-byte bank groups: bit 2 = token bits 1 ⊕ 2 separates the two tokens of a
// key read (4q, 4q + 2); the four tokens 4t + c of a value read differ in token bits 2-3, which go
// to the unit bits that the lane's g leaves free (D = 64: bits 1-2; 128: bits 0 and 2). The
// copies (8 consecutive units of one token per phase) are conflict-free under any XOR.
template <int kD>
struct Bf16StagedLayout {  // instantiated for D = 64 and 128 (kHasStagedKernel)
  static constexpr int kWarps = 4;
  static constexpr int kStages = 3;
  static constexpr uint32_t kPitch = 4 * kD;  // bytes per token
  static constexpr int kUnits = kD / 4;       // 16-byte units per token
  static constexpr uint32_t kStageBytes = 16 * kPitch;
  static constexpr int kBytes = kWarps * kStages * kStageBytes;
  __device__ __forceinline__ static uint32_t Stage(int warp, int s) {
    return kStageBytes * (kStages * warp + s);
  }
  __host__ __device__ static constexpr uint32_t Swizzle(uint32_t i) {
    const uint32_t b1 = (i >> 1) & 1u, b2 = (i >> 2) & 1u, b3 = (i >> 3) & 1u;
    return kD == 64 ? (4u * (b1 ^ b2) | 2u * b3) : (4u * (b1 ^ b2) | b3);
  }
};

// kSW: warps per CTA of a staged compressed kernel (kStagedWarps, or 4 for the narrow variant).
// kExactScores: the 8-warp staged kernel of 3-bit keys with hi + lo codebook parts (kHiOnly).
// kPaired: 8-warp CTAs (3-bit keys: the hi-only twin; 4-bit keys: exact scores) whose warps 0-3
// and 4-7 serve KV heads 2y and 2y + 1 of one sequence, each as a narrow CTA would (chunks
// interleaved over 4 warps, block ids from global memory), for the plan's narrow layouts. An SM
// holds two, i.e. the same four units as four narrow CTAs, but the warp schedulers favour the
// earlier-launched CTAs of an SM: four narrow CTAs of equal work finished 20 µs apart at 64 × 4k
// (~67, 72, 80, 88 µs), the last one alone on its SM with 4 warps for 8 µs; with pairs the SM keeps
// 8 warps to the end (tools/bench/NOTES.md, session 21).
template <KeyKind kKind, int kValueBits, int kD, int kNTiles, bool kStaged = false,
          int kSW = kStagedWarps, bool kExactScores = false, bool kPaired = false>
struct SplitKernelConfig {
  using Traits = CacheTraits<kKind, kValueBits, kD>;
  static constexpr bool kPlainStaged = kStaged && IsPlain(kKind);
  static constexpr int kCtaWarps = [] {
    if constexpr (kPlainStaged) {
      return Bf16StagedLayout<kD>::kWarps;
    } else {
      return kStaged ? kSW : kWarps;
    }
  }();
  static constexpr int kUnits = kPaired ? 2 : 1;  // KV heads per CTA
  static constexpr int kKSteps = kD / 16;
  static constexpr int kMTiles = kD / 16;
  static constexpr int kLutBytes = [] {
    if constexpr (kPlainStaged) {
      return Bf16StagedLayout<kD>::kBytes;
    } else if constexpr (kStaged) {
      return StagedLayout<kKind, kSW>::kBytes;
    } else {
      return Traits::kLutEntries * 256;
    }
  }();
  // The warps' merge: accumulators [kCtaWarps][heads][kD], (m, l, z) [3][kCtaWarps][heads], then
  // the per-head factors [kCtaWarps][heads], 1/l [heads] and z [heads].
  // An accumulator row (one warp's head) holds element d at d + d / 32 and rows are kAccStride
  // floats apart (≡ 4 mod 32 words for D ≤ 128): the fragment stores of a packed warp — lane
  // (g, t) writes d = 16g + 2·mt (+1) of head t — then hit 32 distinct banks (unpadded rows of
  // 128 floats put all 32 lanes on 2 banks), and the final pass's reads of consecutive d stay
  // conflict-free. D = 256 keeps plain rows (its merge region would outgrow the table).
  static constexpr int kAccRow = kD <= 128 ? kD + kD / 32 : kD;
  static constexpr int kAccStride = kD <= 128 ? kAccRow + (36 - kAccRow % 32) % 32 : kD;
  __host__ __device__ static constexpr int AccAt(int row, int d) {
    return row * kAccStride + (kD <= 128 ? d + d / 32 : d);
  }
  static constexpr int kMergeBytes =
      (kCtaWarps * 8 * kNTiles * kAccStride + (4 * kCtaWarps + 2) * 8 * kNTiles) * 4;
  // The group's rotated query rows as fp16 hi [heads][kD] then lo [heads][kD] parts (plain caches:
  // the cache's type in the first array), rows past the group zero, after everything else (the
  // prologue writes them while the first chunks' copies land in the stages).
  static constexpr int kQueryOffset = kLutBytes > kMergeBytes ? kLutBytes : kMergeBytes;
  static constexpr int kQueryHeads = kStaged && !kPlainStaged ? 4 : 8 * kNTiles;  // per unit
  // The 8-warp staged compressed kernels: the split's block ids (int32, after the query rows):
  // at most one per 16 tokens, one more for a split that starts inside a block, and room for
  // the ids the loop reads (and drops) for the (kStages - 1)·kW chunks it looks past the end.
  // Not the narrow kernel: measured 8-18 % slower with them at one round of 512 CTAs (k3v4_nc
  // 64 × 4k 83.5 -> 91.1 µs, 16 × 32k 164.6 -> 194.2; session 16, not understood).
  static constexpr int kIdsOffset = kQueryOffset + kUnits * kQueryHeads * kD * 4;
  static constexpr int kMaxIds = kStaged && !kPlainStaged && kSW == kStagedWarps && !kPaired
                                     ? kMaxSplitTokens / 16 + 1 + (kStages - 1) * kSW
                                     : 0;
  static constexpr int kSmemBytes = kIdsOffset + (kMaxIds * 4 + 15) / 16 * 16;
  // Scores from the codebook's hi parts alone (DecodeSplitKernel): the 8-warp staged kernel of
  // 3-bit keys, unless instantiated with kExactScores (the plan picks one of the two).
  // TQKV_DECODE_EXACT_SCORES: a measurement build in which it never does (session 20's A/B).
#ifdef TQKV_DECODE_EXACT_SCORES
  static constexpr bool kHiOnly = false;
#else
  static constexpr bool kHiOnly =
      kStaged && kKind == KeyKind::kMse3 && kSW == kStagedWarps && !kExactScores;
#endif
};

// Token order inside a 16-token chunk (any order works for a dot product; this one makes the
// metadata of a thread's two score rows adjacent):
//   score MMA row g ↔ token 2g, row g + 8 ↔ token 2g + 1;
//   P·V MMA k-slots 2t, 2t+1 ↔ tokens 4t, 4t+2 and k-slots 2t+8, 2t+9 ↔ tokens 4t+1, 4t+3,
// which is where the 8x8 transposes of the score fragment put P'.
// CTAs per SM the kernel is compiled for (D ≤ 128, one N tile; the others take what they need).
// The bf16 kernel fits 128 registers without spilling, so four CTAs (16 warps) per SM keep more
// loads in flight: 4 % faster at batch 64 × 4k. The compressed kernels are held to three (≤ 168
// registers; left alone, the unpacked ones for GQA groups 5-8 took 179-198, i.e. two CTAs);
// capped at 128 for four they spilled and ran 20-35 % slower (measured, k3v4_nc and k8v4), and
// the 4-bit table (64 KB) allows three anyway.
template <KeyKind kKind, int kD, int kNTiles>
constexpr int kSplitMinCtas = (kNTiles != 1 || kD > 128) ? 1
                              : IsPlain(kKind)           ? 4
                                                         : 3;

//
// Packed heads (kPacked: compressed kinds, GQA group ≤ 4): column 2h of the score MMA's N = 8
// holds q_hi of head h and column 2h + 1 its q_lo, so one MMA computes both parts and thread t
// holds both halves of head t's score (one add, no shuffle, and no thread computes a softmax
// twice); the P·V B operand holds P'_hi of head h in column 2h and P'_lo in 2h + 1, so one P·V
// MMA per m-tile does what two did, and the accumulator's two columns are added once per split.
// Half the MMAs per chunk, and half the softmax work per thread.
//
// kOneCta: 4-bit keys' 8-warp staged kernel compiled for one CTA per SM (up to 255 registers
// instead of 128; ptxas takes 151, the loop keeps its length), which the plan takes where the
// split grid fits the SMs (SplitLayout::one_cta): 3-5 % faster there (tools/bench/NOTES.md, v23).
template <KeyKind kKind, int kValueBits, int kD, int kNTiles, bool kPacked, bool kStaged,
          int kSW = kStagedWarps, bool kExactScores = false, bool kPaired = false,
          bool kOneCta = false>
__global__ void __launch_bounds__(
    SplitKernelConfig<kKind, kValueBits, kD, kNTiles, kStaged, kSW>::kCtaWarps * 32,
    kStaged ? (IsPlain(kKind) ? 2 : (kOneCta ? 1 : 16 / kSW)) : (kSplitMinCtas<kKind, kD, kNTiles>))
    DecodeSplitKernel(const SplitParams p) {
  static_assert(!kPacked || (kNTiles == 1 && !IsPlain(kKind)));
  static_assert(!kStaged || kHasStagedKernel<kKind, kValueBits, kD, kPacked>);
  static_assert(kSW == kStagedWarps || (kStaged && kKind == KeyKind::kMse3 && kSW == 4));
  static_assert(!kExactScores || (kStaged && kKind == KeyKind::kMse3 && kSW == kStagedWarps));
  static_assert(!kPaired || (kStaged && !IsPlain(kKind) && kSW == kStagedWarps));
  static_assert(!kOneCta ||
                (kStaged && kKind == KeyKind::kMse4 && kSW == kStagedWarps && !kPaired));
  using Config =
      SplitKernelConfig<kKind, kValueBits, kD, kNTiles, kStaged, kSW, kExactScores, kPaired>;
  constexpr int kT = Config::kCtaWarps * 32;
  // The cache copies with the L2 evict-first policy (CopyAsync16Fill), except 3-bit keys'.
  constexpr bool kStreamCopies = kKind != KeyKind::kMse3;
  // kW: the warps that share one KV head's chunks (all of the CTA's but in a paired CTA).
  constexpr int kUnits = Config::kUnits;
  constexpr int kW = Config::kCtaWarps / kUnits;
  using Traits = typename Config::Traits;
  constexpr int kKSteps = Config::kKSteps;
  constexpr int kMTiles = Config::kMTiles;
  constexpr int kKW = Traits::kKeyWords;
  constexpr int kVW = Traits::kValueWords;
  constexpr bool kCodebook = Traits::kLutEntries > 0;
  // The 8-warp staged kernel for 3-bit keys reads the centroids' scaled fp16 hi parts alone
  // (codebook_fp16.h: the plan picks it only for a codebook that scales to within kMaxHiOnlyError
  // of fp16, and only at one CTA per SM; its kExactScores twin keeps hi + lo): one score MMA per
  // k-step covers 16 tokens instead of 8, so a chunk needs 16 MMAs, not 24.
  constexpr bool kHiOnly = Config::kHiOnly;
  // The staged bf16 kernel maps a thread's key words to the 16-byte units 4j + t of a token (not
  // to 4t .. 4t + 3), so that its shared-memory reads spread over the banks (StagedLayout).
  constexpr bool kInterleavedKeys = Config::kPlainStaged;

  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x & 31, cta_warp = threadIdx.x >> 5;
  // warp: the warp's index among its KV head's kW warps; unit: which of the CTA's KV heads.
  const int unit = kPaired ? cta_warp / kW : 0, warp = kPaired ? cta_warp % kW : cta_warp;
  const int split = blockIdx.x, h0 = blockIdx.y * kUnits, h = h0 + unit, b = blockIdx.z;

  // Key codebook table, one replica per lane of a half-warp (entry e of lane l at byte 256·e +
  // 8·(l mod 16)), from the decoder's prebuilt table (decode_launch.h, CodebookTable; 2 KB for
  // 4-bit keys): each thread loads its entries here and writes their 16 replicas in
  // finish_prologue, after the first chunk's loads are out. (Copying the replicated table from L2
  // per CTA moved 24 MB through L2 at batch 1 × 32k, 100 MB at 64 × 4k.)
  constexpr int kEntriesPerThread = (Traits::kLutEntries + kT - 1) / kT;
  uint2 entries[kEntriesPerThread > 0 ? kEntriesPerThread : 1];
  uint32_t lane_word = 0;
  if constexpr (kCodebook) {
    const uint32_t window = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    if ((window & 0x00FFFFFFu) != kSmemStart) __trap();  // the lookups assume this layout
#pragma unroll
    for (int k = 0; k < kEntriesPerThread; ++k) {
      const int e = threadIdx.x + k * kT;
      if (e < Traits::kLutEntries) entries[k] = __ldg(p.codebook_table + e);
    }
    lane_word = (window & 0xFF000000u) | (kHiOnly ? 4u * lane : 8u * (lane & 15));
  }
  // The random signs of the query rotation are the decoder's constants: read before the wait.
  constexpr int kE = kD / 32;  // query elements per lane in finish_prologue
  float q_sign[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    q_sign[e] = p.query_signs != nullptr && warp < Config::kQueryHeads
                    ? __ldg(p.query_signs + kE * lane + e)
                    : 1.0f;
  }
  // Launched as a programmatic dependent of whatever kernel precedes it in the stream (the
  // default without a query prep: CudaDecoder::Run), the CTA may be resident before that kernel
  // has finished; everything below reads inputs it may have written (query, seq_lens, tables,
  // cache) or writes what it may still read (workspace, output), so it waits here. Only the
  // launch and the table and sign loads above (decoder-owned constants) overlap the kernel before.
  Phase(0);
  if (p.wait_at_start) GridDependencyWait();
  Phase(1);
  // The first query row this warp rotates in finish_prologue (head = warp), for 16-bit queries:
  // its load is issued here, beside the sequence length's, so that its latency overlaps the
  // seq_len -> block table -> first copies chain instead of following it (ncu, 4bit_nc 64 x 1k:
  // the warps waited as long for the query as for the first block ids).
  uint32_t q_pre[kE / 2];
  const bool q_prefetched = p.wait_at_start && p.query_dtype != 0 &&
                            warp < p.num_q_heads / p.num_kv_heads && warp < Config::kQueryHeads;
  if (q_prefetched) {
    const int64_t row =
        static_cast<int64_t>(b) * p.num_q_heads + h * (p.num_q_heads / p.num_kv_heads) + warp;
    const uint32_t* src = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.query) +
                                                            row * kD + kE * lane);
#pragma unroll
    for (int w = 0; w < kE / 2; ++w) q_pre[w] = src[w];
  }
  // The block ids of this warp's first chunks, read beside the sequence length instead of after
  // it (one memory round trip less before the first copies): where they lie past the sequence's
  // blocks they are still inside the table's row (max_blocks_per_seq entries) and are dropped by
  // first_block below.
  const int begin = split * p.tokens_per_split;
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq;
  const int block_shift = 31 - __clz(p.block_size);
  int first_block_ids[kStages];
#pragma unroll
  for (int k = 0; k < kStages; ++k) {
    const int at = (begin + (warp + k * kW) * kChunk) >> block_shift;
    first_block_ids[k] = at < p.max_blocks_per_seq ? __ldg(table + at) : 0;
  }
  // The 8-warp staged compressed kernels read the block ids of their later chunks from shared
  // memory (ids_s, written in finish_prologue) instead of from global memory one chunk ahead of
  // each copy: 10 instructions less per chunk; 1-12 % faster from batch 16 or 32k tokens up
  // (16 × 4k the most), 0.1-0.2 µs slower at batch 1 × 1k-4k (v11d in tools/bench/NOTES.md).
  // Loaded here into registers, beside the first ids; entries past the sequence as above
  // (Config::kMaxIds: none in the other kernels).
  constexpr int kIdsPerThread = (Config::kMaxIds + kT - 1) / kT;
  const int id0 = begin >> block_shift;
  const int num_ids =
      min(((begin + p.tokens_per_split - 1) >> block_shift) + 1, p.max_blocks_per_seq) - id0;
  int ids_pre[kIdsPerThread > 0 ? kIdsPerThread : 1];
#pragma unroll
  for (int k = 0; k < kIdsPerThread; ++k) {
    const int i = threadIdx.x + k * kT;
    ids_pre[k] = i < num_ids ? __ldg(table + id0 + i) : 0;
  }
  int* const ids_s = reinterpret_cast<int*>(smem + Config::kIdsOffset);
  const int len = p.seq_lens[b];
  if (begin >= len) {           // the merge reads only splits that hold tokens
    if (p.output != nullptr) {  // no merge: an empty sequence's rows are 0, LSE -inf
      const int group = p.num_q_heads / p.num_kv_heads;
      const int64_t row0 = static_cast<int64_t>(b) * p.num_q_heads + h0 * group;
      for (int i = threadIdx.x; i < kUnits * group * kD; i += blockDim.x) {
        StoreOutput(p.output, p.out_dtype, row0 * kD + i, 0.0f);
        if (i % kD == 0) p.lse[row0 + i / kD] = -INFINITY;
      }
    }
    return;
  }
  const int end = min(begin + p.tokens_per_split, len);
  const int g = lane >> 2, t = lane & 3;
  const int group = p.num_q_heads / p.num_kv_heads;

  // Query fragments (B operand of the score MMA): head 8·nt + g. The compressed kinds carry q as
  // fp16 hi + lo parts (q ≈ hi + lo to ~2^-22), one MMA chain each, and the codebook kinds the
  // centroids as hi + lo rows of the A operand, so scores keep fp32 accuracy. The plain kinds use
  // the query rounded to the cache's type (exact for a query of that type).
  constexpr int kQParts = Traits::kPlain || kPacked ? 1 : 2;
  uint32_t qf[kQParts][kNTiles][kKSteps][2];
  // Everything the split needs from earlier work: waits for the query prep grid where there is
  // one (programmatic launch), rotates the group's query rows into shared memory and loads the
  // fragments from there, and completes the table copy.
  auto finish_prologue = [&] {
    GridDependencyWait();
    // Warp w rotates rows w, w + kW, ... of the group: lane l holds elements kE·l .. kE·l + kE - 1,
    // so the transform's first log2(kE) butterfly stages are in registers and the other five
    // cross lanes (shuffles). Sylvester order: y[j] = Σ_i x[i] (-1)^popcount(i & j).
    uint16_t* q_hi = reinterpret_cast<uint16_t*>(smem + Config::kQueryOffset) +
                     unit * 2 * Config::kQueryHeads * kD;
    uint16_t* q_lo = q_hi + Config::kQueryHeads * kD;
    for (int head = warp; head < Config::kQueryHeads; head += kW) {
      float x[kE];
#pragma unroll
      for (int e = 0; e < kE; ++e) x[e] = 0.0f;
      if (head < group) {
        const int64_t row = static_cast<int64_t>(b) * p.num_q_heads + h * group + head;
#pragma unroll
        for (int e = 0; e < kE; ++e) {
          const int64_t at = row * kD + kE * lane + e;
          if (head == warp && q_prefetched) {
            const auto bits = static_cast<uint16_t>(q_pre[e / 2] >> (16 * (e % 2)));
            x[e] = p.query_dtype == 1 ? __half2float(__ushort_as_half(bits))
                                      : __bfloat162float(__ushort_as_bfloat16(bits));
          } else if (p.query_dtype == 0) {
            x[e] = static_cast<const float*>(p.query)[at];
          } else if (p.query_dtype == 1) {
            x[e] = __half2float(static_cast<const __half*>(p.query)[at]);
          } else {
            x[e] = __bfloat162float(static_cast<const __nv_bfloat16*>(p.query)[at]);
          }
          x[e] *= q_sign[e];  // 1 without signs
        }
        if (p.query_fwht) {
#pragma unroll
          for (int m = 1; m < kE; m <<= 1) {
#pragma unroll
            for (int e = 0; e < kE; ++e) {
              if ((e & m) == 0) {
                const float u = x[e], v = x[e + m];
                x[e] = u + v;
                x[e + m] = u - v;
              }
            }
          }
#pragma unroll
          for (int m = 1; m < 32; m <<= 1) {
#pragma unroll
            for (int e = 0; e < kE; ++e) {
              const float o = __shfl_xor_sync(0xffffffffu, x[e], m);
              x[e] = (lane & m) ? o - x[e] : x[e] + o;
            }
          }
#pragma unroll
          for (int e = 0; e < kE; ++e) x[e] *= p.query_scale;
        }
      }
      // Fragment words hold element pairs (low half = even element), so the rows are stored as
      // pairs.
#pragma unroll
      for (int e = 0; e < kE; e += 2) {
        const int at = head * kD + kE * lane + e;
        if constexpr (Traits::kPlain) {  // the cache's element type
          *reinterpret_cast<uint32_t*>(q_hi + at) = PackPlain<Traits::kFp16>(x[e], x[e + 1]);
        } else {
          const __half2 hi = __floats2half2_rn(x[e], x[e + 1]);
          const float2 hf = __half22float2(hi);
          *reinterpret_cast<__half2*>(q_hi + at) = hi;
          *reinterpret_cast<__half2*>(q_lo + at) = __floats2half2_rn(x[e] - hf.x, x[e + 1] - hf.y);
        }
      }
    }
    if constexpr (kCodebook) {
      // 16-byte stores of two replicas (hi-only: four replicas of the hi pair, 32 per entry at
      // 4-byte steps, so that the 32 lanes' 4-byte lookups hit 32 distinct banks: one wavefront);
      // store c of lane l goes to 16-byte slot (c + l) mod 8 of its entry's 256-byte row, so each
      // 8-lane phase of a store covers 8 distinct bank groups.
      const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
#pragma unroll
      for (int k = 0; k < kEntriesPerThread; ++k) {
        const int e = threadIdx.x + k * kT;
        if (e < Traits::kLutEntries) {
#pragma unroll
          for (int c = 0; c < 8; ++c) {
            const uint32_t at = base + 256u * e + 16u * ((c + lane) & 7);
            const uint32_t second = kHiOnly ? entries[k].x : entries[k].y;
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %1, %2};\n" ::"r"(at), "r"(entries[k].x),
                         "r"(second)
                         : "memory");
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kIdsPerThread; ++k) {
      const int i = threadIdx.x + k * kT;
      if (i < num_ids) ids_s[i] = ids_pre[k];
    }
    __syncthreads();  // the rotated rows, the table replicas and the block ids
#pragma unroll
    for (int part = 0; part < kQParts; ++part) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        // Packed: column g holds part g % 2 of head g / 2.
        const int head = kPacked ? (g >> 1) : 8 * nt + g;
        const uint16_t* q = ((kPacked ? (g & 1) : part) ? q_lo : q_hi) + head * kD +
                            (kInterleavedKeys ? 8 : kD / 4) * t;
#pragma unroll
        for (int s = 0; s < kKSteps; ++s) {
          // A thread's key element i is d = (D/4)·t + i, or with interleaved keys (its units are
          // 4j + t) d = 32·(i / 8) + 8·t + i % 8.
          const int at = kInterleavedKeys ? 32 * (s / 2) + 4 * (s % 2) : 4 * s;
          qf[part][nt][s][0] = *reinterpret_cast<const uint32_t*>(q + at);
          qf[part][nt][s][1] = *reinterpret_cast<const uint32_t*>(q + at + 2);
        }
      }
    }
  };

  float acc[kMTiles][kNTiles][4];
  float m[kNTiles][2], m_thr[kNTiles][2], l[kNTiles][2], z[kNTiles][2];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m[nt][i] = -INFINITY;
      m_thr[nt][i] = -INFINITY;
      l[nt][i] = 0.0f;
      z[nt][i] = 0.0f;
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
    }
  }

  // Per-thread byte offsets within a block (block_bytes < 2^31), computed once; per chunk only the
  // block pointer and the position change.
  const int stride_token =
      Traits::kPlain ? 2 * p.num_kv_heads * kD : p.num_kv_heads * p.data_per_slot;
  const int head_off = Traits::kPlain ? 2 * h * kD : h * p.data_per_slot;
  const int value_base = Traits::kPlain ? static_cast<int>(p.meta_offset) : p.key_data_bytes;
  const int off_kg = head_off + (kInterleavedKeys ? 16 : Traits::kKeyBytes) * t +
                     2 * g * stride_token;                                     // token 2g
  const int off_k8 = off_kg + stride_token;                                    // token 2g + 1
  const int off_v = value_base + head_off + Traits::kValueBytes * g + 4 * t * stride_token;
  const int off_meta =
      static_cast<int>(p.meta_offset) + 2 * (h * p.num_meta * p.block_size + 2 * g);
  const int meta_field = 2 * p.block_size;  // bytes between fields of one head

  // Registers of one chunk.
  struct Chunk {
    uint32_t kg[kKW], k8[kKW];       // key bytes of score rows g, g + 8 (tokens 2g, 2g + 1)
    uint32_t v[4][kVW];              // value bytes of tokens 4t, 4t+2, 4t+1, 4t+3
    uint32_t norm, vscale, vzero;    // fp16 pairs: tokens 2g (low half), 2g + 1 (high half)
  };
  // Block id of chunk c, or 0 past the split's full chunks. Loaded one chunk before the chunk's
  // data loads need it, so that a warp never waits for a table read before its next compute.
  auto block_of = [&](int c, int num_chunks) -> int {
    return c < num_chunks ? __ldg(table + ((begin + c * kChunk) >> block_shift)) : 0;
  };
  auto load = [&](int c, Chunk& ck, int block) {
    const int t0 = begin + c * kChunk;
    const uint32_t pos0 = t0 & (p.block_size - 1);
    const uint8_t* base = p.cache + static_cast<int64_t>(block) * p.block_bytes;
    const uint8_t* at = base + pos0 * stride_token;
    if constexpr (kInterleavedKeys) {  // units 4j + t
#pragma unroll
      for (int j = 0; j < kKW / 4; ++j) {
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(at + off_kg + 64 * j));
        const uint4 c = __ldg(reinterpret_cast<const uint4*>(at + off_k8 + 64 * j));
        ck.kg[4 * j] = a.x, ck.kg[4 * j + 1] = a.y, ck.kg[4 * j + 2] = a.z, ck.kg[4 * j + 3] = a.w;
        ck.k8[4 * j] = c.x, ck.k8[4 * j + 1] = c.y, ck.k8[4 * j + 2] = c.z, ck.k8[4 * j + 3] = c.w;
      }
    } else {
      LoadBytes<Traits::kKeyBytes, Traits::kKeyAlign>(at + off_kg, ck.kg);
      LoadBytes<Traits::kKeyBytes, Traits::kKeyAlign>(at + off_k8, ck.k8);
    }
    LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v, ck.v[0]);
    LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v + 2 * stride_token, ck.v[1]);
    LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v + stride_token, ck.v[2]);
    LoadBytes<Traits::kValueBytes, Traits::kValueAlign>(at + off_v + 3 * stride_token, ck.v[3]);
    if constexpr (!Traits::kPlain) {
      const uint8_t* meta = base + off_meta + 2 * pos0;
      constexpr int kScaleField = Traits::kHasNorm ? 1 : 0;
      ck.norm = Traits::kHasNorm ? __ldg(reinterpret_cast<const uint32_t*>(meta)) : 0u;
      ck.vscale = __ldg(reinterpret_cast<const uint32_t*>(meta + kScaleField * meta_field));
      ck.vzero = __ldg(reinterpret_cast<const uint32_t*>(meta + (kScaleField + 1) * meta_field));
    }
  };

#ifdef TQKV_DECODE_LOOKUP_MASK
  // A measurement build (wrong results; session 18, NOTES): every codebook lookup address ANDed
  // with an opaque mask, TQKV_DECODE_LOOKUP_MASK=0xFFFFFFFFu (the control: one LOP3 more per
  // lookup, the same reads) or 0xFF000000u (every lane reads entry 0 of replica 0: a broadcast,
  // one shared-memory wavefront per lookup instead of two).
  const uint32_t lut_mask = (TQKV_DECODE_LOOKUP_MASK) ^ (static_cast<uint32_t>(p.block_size) >> 16);
#else
  constexpr uint32_t lut_mask = ~0u;
#endif
#if defined(TQKV_DECODE_EXTRA_MMA) || defined(TQKV_DECODE_EXTRA_ALU)
  // Measurement builds (session 19, NOTES): TQKV_DECODE_EXTRA_MMA=N issues N more score MMAs per
  // k-step of the packed codebook kernels into two spare accumulators, TQKV_DECODE_EXTRA_ALU=N N
  // more integer instructions per k-step in two spare chains; neither feeds the loop's chains
  // (the results only reach a store that never happens), so they load the tensor pipe or the
  // issue slots alone. Results stay correct.
  float junk_acc[2][4] = {};
  uint32_t junk_alu[2] = {static_cast<uint32_t>(p.block_size), static_cast<uint32_t>(lane)};
#endif
  auto compute = [&]<bool kTail>(int c, Chunk& cur) {
    const int t0 = begin + c * kChunk;
    bool valid[2] = {true, true};  // tokens 2g, 2g + 1
    if constexpr (kTail) {
      valid[0] = t0 + 2 * g < end;
      valid[1] = t0 + 2 * g + 1 < end;
    }

    // Scores Sᵀ[token, head] for tokens 2g, 2g+1 and heads 8·nt + 2t, +1, in independent MMA
    // chains sp[k] (summed below). FP8 / bf16 keys: M rows g, g + 8 are tokens 2g, 2g + 1;
    // chains k = q parts. Codebook keys: one MMA per token half (k = 2·half + q part), whose rows
    // g and g + 8 hold the c_hi and c_lo parts of the same token (one 64-bit table load gives
    // both, in the consecutive registers an MMA operand needs), so S = C[row g] + C[row g + 8].
    // (Three chains c_hi·q_hi, c_hi·q_lo, c_lo·q_hi with token rows would save a quarter of these
    // MMAs but cost 8 register moves per k-step to regroup the loaded pairs: measured in SASS.)
    // (Staged: each token half's chain split in two by k-step parity, chains of 4 MMAs, not 8.)
    constexpr int kParts = kPacked          ? (kCodebook ? (kStaged ? 4 : 2) : 1)
                           : Traits::kPlain ? 1
                                            : (kCodebook ? 4 : 2);
    float sp[kParts][kNTiles][4];
#pragma unroll
    for (int k = 0; k < kParts; ++k) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) sp[k][nt][i] = 0.0f;
      }
    }
    StaticFor<kKSteps>([&](auto ks_c) {
      constexpr int ks = decltype(ks_c)::value;
      if constexpr (kHiOnly) {  // rows g, g + 8 = tokens 2g, 2g + 1; chains k = k-step mod 4
        uint32_t a[4];
        Traits::template KeyFragHi<ks>(cur.kg, cur.k8, lane_word, a);
        MmaF16(sp[ks & 3][0], a, qf[0][0][ks][0], qf[0][0][ks][1]);
      } else if constexpr (kCodebook) {
        uint32_t a0[4], a1[4];
        Traits::template KeyFragHiLo<ks>(cur.kg, lane_word, a0, lut_mask);
        Traits::template KeyFragHiLo<ks>(cur.k8, lane_word, a1, lut_mask);
        if constexpr (kPacked) {  // chains k = token half; q parts are columns
          constexpr int kChain = kStaged ? 2 * (ks & 1) : 0;
          MmaF16(sp[kChain][0], a0, qf[0][0][ks][0], qf[0][0][ks][1]);
          MmaF16(sp[kChain + 1][0], a1, qf[0][0][ks][0], qf[0][0][ks][1]);
#ifdef TQKV_DECODE_EXTRA_MMA
#pragma unroll
          for (int x = 0; x < (TQKV_DECODE_EXTRA_MMA); ++x) {
            MmaF16(junk_acc[x & 1], x & 1 ? a1 : a0, qf[0][0][ks][0], qf[0][0][ks][1]);
          }
#endif
#ifdef TQKV_DECODE_EXTRA_ALU
#pragma unroll
          for (int x = 0; x < (TQKV_DECODE_EXTRA_ALU); ++x) {
            asm volatile("shf.l.wrap.b32 %0, %0, %1, %2;\n"
                         : "+r"(junk_alu[x & 1])
                         : "r"(a0[x & 3]), "r"(x % 31 + 1));
          }
#endif
        } else {
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            MmaF16(sp[0][nt], a0, qf[0][nt][ks][0], qf[0][nt][ks][1]);
            MmaF16(sp[1][nt], a0, qf[1][nt][ks][0], qf[1][nt][ks][1]);
            MmaF16(sp[2][nt], a1, qf[0][nt][ks][0], qf[0][nt][ks][1]);
            MmaF16(sp[3][nt], a1, qf[1][nt][ks][0], qf[1][nt][ks][1]);
          }
        }
      } else {
        uint32_t a[4];
        Traits::template KeyFrag<ks>(cur.kg, cur.k8, a);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          if constexpr (Traits::kPlain) {
            MmaPlain<Traits::kFp16>(sp[0][nt], a, qf[0][nt][ks][0], qf[0][nt][ks][1]);
          } else if constexpr (kPacked) {
            MmaF16(sp[0][nt], a, qf[0][nt][ks][0], qf[0][nt][ks][1]);
          } else {
            MmaF16(sp[0][nt], a, qf[0][nt][ks][0], qf[0][nt][ks][1]);
            MmaF16(sp[1][nt], a, qf[1][nt][ks][0], qf[1][nt][ks][1]);
          }
        }
      }
    });
    float row_scale[2], vs[2], vz[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row_scale[i] = Traits::kHasNorm
                         ? HalfBitsToFloat(static_cast<uint16_t>(cur.norm >> (16 * i))) *
                               p.score_scale
                         : p.score_scale;
      vs[i] =
          Traits::kPlain ? 1.0f : HalfBitsToFloat(static_cast<uint16_t>(cur.vscale >> (16 * i)));
      vz[i] = Traits::kPlain ? 0.0f : HalfBitsToFloat(static_cast<uint16_t>(cur.vzero >> (16 * i)));
      if constexpr (kTail) {  // metadata of slots past the end may be NaN garbage (0 · NaN = NaN)
        vs[i] = valid[i] ? vs[i] : 0.0f;
        vz[i] = valid[i] ? vz[i] : 0.0f;
      }
    }

    uint32_t pb[kNTiles][2], pb_lo[kNTiles][2];  // P' as 16-bit hi and lo parts
    if constexpr (kPacked) {
      // Head t: its scores for tokens 2g + r (columns 2t, 2t + 1 = q_hi, q_lo; codebook keys add
      // the c_lo row g + 8), its running state in [0][0].
      float s[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum;
        if constexpr (kHiOnly) {  // row g + 8r of the four chains
          sum =
              ((sp[0][0][2 * r] + sp[0][0][2 * r + 1]) + (sp[2][0][2 * r] + sp[2][0][2 * r + 1])) +
              ((sp[1][0][2 * r] + sp[1][0][2 * r + 1]) + (sp[3][0][2 * r] + sp[3][0][2 * r + 1]));
        } else {
          sum = kCodebook ? (sp[r][0][0] + sp[r][0][1]) + (sp[r][0][2] + sp[r][0][3])
                          : sp[0][0][2 * r] + sp[0][0][2 * r + 1];
          if constexpr (kCodebook && kParts == 4) {
            sum += (sp[r + 2][0][0] + sp[r + 2][0][1]) + (sp[r + 2][0][2] + sp[r + 2][0][3]);
          }
        }
        s[r] = sum * row_scale[r];
        if constexpr (kTail) s[r] = valid[r] ? s[r] : -INFINITY;
      }
      float mx = fmaxf(s[0], s[1]);
      // As below: lazy unless a value scale is too large for p ≤ 2^kLazyMax.
      const bool exact = fmaxf(vs[0], vs[1]) > kMaxLazyValueScale;
      if (__any_sync(0xffffffffu, mx > (exact ? m[0][0] : m_thr[0][0]))) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m[0][0], mx);
        const float corr = m_new == -INFINITY ? 1.0f : exp2f(m[0][0] - m_new);
        m[0][0] = m_new;
        m_thr[0][0] = m_new + kLazyMax;
        l[0][0] *= corr;
        z[0][0] *= corr;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][0][i] *= corr;
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float pr = FastExp2(s[r] - m[0][0]);  // 0 past the end (s = -inf)
        l[0][0] += pr;
        z[0][0] += pr * vz[r];
        const float pw = pr * vs[r];
        // (row g = token 2g + r, columns 2t, 2t + 1) = (P'_hi, P'_lo) of head t.
        const __half hi = __float2half_rn(pw);
        const __half2 x = __halves2half2(hi, __float2half_rn(pw - __half2float(hi)));
        pb[0][r] = Transpose8x8(*reinterpret_cast<const uint32_t*>(&x));
        pb_lo[0][r] = 0u;
      }
    } else {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      // s[0..1]: token 2g, heads 2t, 2t+1; s[2..3]: token 2g + 1.
      float s[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float sum;
        if constexpr (kCodebook) {
          const int half = i / 2, j = i % 2;  // token 2g + half, head 2t + j
          sum = (sp[2 * half][nt][j] + sp[2 * half][nt][j + 2]) +
                (sp[2 * half + 1][nt][j] + sp[2 * half + 1][nt][j + 2]);
        } else {
          sum = sp[0][nt][i];
          if constexpr (kParts > 1) sum += sp[1][nt][i];
        }
        s[i] = sum * row_scale[i / 2];
        if constexpr (kTail) s[i] = valid[i / 2] ? s[i] : -INFINITY;
      }
      float mx[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
      // Rescale only when some score of the warp passes its head's running maximum by more than
      // kLazyMax (a few times per split), or by anything when a value scale of the chunk is too
      // large for p ≤ 2^kLazyMax; then m becomes the exact maximum so far.
      const bool exact = !Traits::kPlain && fmaxf(vs[0], vs[1]) > kMaxLazyValueScale;
      const float thr0 = exact ? m[nt][0] : m_thr[nt][0];
      const float thr1 = exact ? m[nt][1] : m_thr[nt][1];
      if (__any_sync(0xffffffffu, mx[0] > thr0 || mx[1] > thr1)) {
        float corr[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 4));
          mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 8));
          mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 16));
          const float m_new = fmaxf(m[nt][j], mx[j]);
          corr[j] = m_new == -INFINITY ? 1.0f : exp2f(m[nt][j] - m_new);
          m[nt][j] = m_new;
          m_thr[nt][j] = m_new + kLazyMax;
          l[nt][j] *= corr[j];
          z[nt][j] *= corr[j];
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          acc[mt][nt][0] *= corr[0];
          acc[mt][nt][1] *= corr[1];
          acc[mt][nt][2] *= corr[0];
          acc[mt][nt][3] *= corr[1];
        }
      }
      float pw[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i / 2, j = i % 2;
        // Past the end s = -inf and m is finite (the chunk's first token is valid): pr = 0.
        const float pr = FastExp2(s[i] - m[nt][j]);
        l[nt][j] += pr;
        if constexpr (!Traits::kPlain) z[nt][j] += pr * vz[r];
        pw[i] = pr * vs[r];
      }
      // P'ᵀ as the B operand of P·V: the 8x8 tiles (tokens 2g | 2g+1, heads 2t, 2t+1) transposed
      // give head g at tokens 4t, 4t+2 (k-slots 2t, 2t+1) and 4t+1, 4t+3 (k-slots 2t+8, 2t+9).
      // Compressed kinds: P' = hi + lo (fp16 each, ~2^-22 together), two P·V MMAs keep the output
      // at fp32 level (one fp16 P' leaves 2^-12 per token, which the zero-point term amplifies).
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        uint32_t packed, packed_lo = 0;
        if constexpr (Traits::kPlain) {  // P' in the cache's type, as flash-attention rounds it
          packed = PackPlain<Traits::kFp16>(pw[2 * r], pw[2 * r + 1]);
        } else {
          const __half2 x = __floats2half2_rn(pw[2 * r], pw[2 * r + 1]);
          const __half2 y =
              __floats2half2_rn(pw[2 * r] - __low2float(x), pw[2 * r + 1] - __high2float(x));
          packed = *reinterpret_cast<const uint32_t*>(&x);
          packed_lo = *reinterpret_cast<const uint32_t*>(&y);
        }
        pb[nt][r] = Transpose8x8(packed);
        pb_lo[nt][r] = Traits::kPlain ? 0u : Transpose8x8(packed_lo);
      }
    }
    }

    // Plain values of tokens past the end may be NaN garbage; zero them (P' is 0 there, but
    // 0 · NaN is NaN). Codes of the compressed kinds are always finite.
    if constexpr (Traits::kPlain && kTail) {
      const bool vvalid[4] = {t0 + 4 * t < end, t0 + 4 * t + 2 < end, t0 + 4 * t + 1 < end,
                              t0 + 4 * t + 3 < end};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int w = 0; w < kVW; ++w) cur.v[i][w] = vvalid[i] ? cur.v[i][w] : 0u;
      }
    }
    // Oᵀ[d, head] += Vᵀ[d, token] · P'ᵀ[token, head].
    if constexpr (!Traits::kPlain && kValueBits == 4) {
      StaticFor<kMTiles / 2>([&](auto pair_c) {
        constexpr int mt = 2 * decltype(pair_c)::value;
        uint32_t r01[2][2], r89[2][2];  // [m-tile][row g / g+8]
        Traits::template RowsPair<mt>(cur.v[0], cur.v[1], r01);
        Traits::template RowsPair<mt>(cur.v[2], cur.v[3], r89);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const uint32_t a[4] = {r01[k][0], r01[k][1], r89[k][0], r89[k][1]};
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            MmaF16(acc[mt + k][nt], a, pb[nt][0], pb[nt][1]);
            if constexpr (!kPacked) MmaF16(acc[mt + k][nt], a, pb_lo[nt][0], pb_lo[nt][1]);
          }
        }
      });
    } else {
      StaticFor<kMTiles>([&](auto mt_c) {
        constexpr int mt = decltype(mt_c)::value;
        uint32_t a[4];
        Traits::template Rows<mt>(cur.v[0], cur.v[1], a[0], a[1]);
        Traits::template Rows<mt>(cur.v[2], cur.v[3], a[2], a[3]);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          if constexpr (Traits::kPlain) {
            MmaPlain<Traits::kFp16>(acc[mt][nt], a, pb[nt][0], pb[nt][1]);
          } else {
            MmaF16(acc[mt][nt], a, pb[nt][0], pb[nt][1]);
            if constexpr (!kPacked) MmaF16(acc[mt][nt], a, pb_lo[nt][0], pb_lo[nt][1]);
          }
        }
      });
    }
  };

  // Full chunks in turn over the warps; the split's last, partial chunk (if any) separately, so
  // that only it pays for the end-of-sequence masks.
  const int num_full = (end - begin) / kChunk;
  // block_of(warp + k·kW, num_full) for the chunks read in the prologue (k < kStages).
  auto first_block = [&](int k) { return warp + k * kW < num_full ? first_block_ids[k] : 0; };
  if constexpr (Traits::kPlain && kStaged) {
    // Chunk c + (S - 1)·kW is copied into stage (k + S - 1) mod S while chunk c (this warp's k-th)
    // is read from stage k mod S and computed, one commit group per chunk (empty past the end).
    // Copy instruction i covers units 32·i .. 32·i + 31 of the chunk's 16 × kU units (token by
    // token): lane l copies unit e % kU of token e / kU, e = 32·i + l (D = 64: two tokens per
    // instruction), so each instruction reads whole runs of 128 or 256 key or value bytes.
    using Layout = Bf16StagedLayout<kD>;
    constexpr int kS = Layout::kStages;
    constexpr uint32_t kPitch = Layout::kPitch;
    constexpr int kU = Layout::kUnits;
    constexpr int kCopies = 16 * kU / 32;
    const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    uint32_t stage[kS];  // shared addresses of this warp's stages, stage[0] = the next read
#pragma unroll
    for (int s = 0; s < kS; ++s) stage[s] = smem_base + Layout::Stage(warp, s);
    // Lane l's unit and its token within the instruction.
    const uint32_t lane_unit = lane % kU;
    const uint32_t lane_token = lane / kU;
    // Destination of lane l's unit for each swizzle mask x (the mask is a compile-time function
    // of the token, so each instruction picks one of these).
    uint32_t copy_dst[8];
#pragma unroll
    for (int x = 0; x < 8; ++x) copy_dst[x] = kPitch * lane_token + 16u * (lane_unit ^ x);
    // Source of lane l's unit: a key unit below kU / 2, a value unit above.
    const uint32_t copy_src =
        Pinned((lane_unit < kU / 2 ? 0u : static_cast<uint32_t>(value_base)) + head_off +
               16u * (lane_unit % (kU / 2)) + lane_token * static_cast<uint32_t>(stride_token));
    const uint32_t block_bytes = static_cast<uint32_t>(p.block_bytes);
    const uint32_t token_bytes = static_cast<uint32_t>(stride_token);
    auto issue = [&](int cc, uint32_t dst, int block) {
      const uint32_t bytes = cc < num_full ? 16u : 0u;
      const uint8_t* base =
          p.cache + static_cast<uint64_t>(static_cast<uint32_t>(block)) * block_bytes;
      const uint32_t pos0 = (begin + cc * kChunk) & (p.block_size - 1);
      const uint8_t* src = base + pos0 * token_bytes;
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        // The instruction's first token and its swizzle mask (compile-time after unrolling; the
        // mask ignores token bit 0, so both tokens of a D = 64 instruction share it).
        const int tok = (32 * i) / kU;
        const uint32_t x = Layout::Swizzle(tok);
        CopyAsync16Fill<kStreamCopies>(dst + copy_dst[x] + kPitch * tok,
                                       src + copy_src + tok * token_bytes, bytes);
      }
    };
    // Reads: keys of token 2g (units 4j + t: from read_k[j % 2] + 64·(j - j % 2)) and 2g + 1
    // (+kPitch: same mask); values of token 4t + c, units (D/64)·g + hh, from read_v[c / 2][hh]
    // (+kPitch for odd c).
    constexpr int kKeyUnits = kD / 32, kValueUnits = kD / 64;
    const uint32_t key_x = t ^ Layout::Swizzle(2 * g);
    const uint32_t read_k0 = Pinned(kPitch * (2 * g) + 16u * key_x);
    const uint32_t read_k1 = Pinned(kPitch * (2 * g) + 16u * (key_x ^ 4u));
    uint32_t read_v[2][kValueUnits];
#pragma unroll
    for (int c2 = 0; c2 < 2; ++c2) {
      const uint32_t tok = 4 * t + 2 * c2;
#pragma unroll
      for (int hh = 0; hh < kValueUnits; ++hh) {
        read_v[c2][hh] =
            Pinned(kPitch * tok + 2u * kD + 16u * ((kValueUnits * g + hh) ^ Layout::Swizzle(tok)));
      }
    }
    auto read = [&](uint32_t st, Chunk& ck) {
#pragma unroll
      for (int j = 0; j < kKeyUnits; ++j) {
        const uint32_t a = st + (j & 1 ? read_k1 : read_k0) + 128u * (j >> 1);
        uint32_t w[4];
        SharedLoad16(a, w);
#pragma unroll
        for (int i = 0; i < 4; ++i) ck.kg[4 * j + i] = w[i];
        SharedLoad16(a + kPitch, w);
#pragma unroll
        for (int i = 0; i < 4; ++i) ck.k8[4 * j + i] = w[i];
      }
      // v[0..3] = tokens 4t, 4t + 2, 4t + 1, 4t + 3.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c2 = i & 1, odd = i >> 1;
#pragma unroll
        for (int hh = 0; hh < kValueUnits; ++hh) {
          uint32_t w[4];
          SharedLoad16(st + read_v[c2][hh] + kPitch * odd, w);
#pragma unroll
          for (int k = 0; k < 4; ++k) ck.v[i][4 * hh + k] = w[k];
        }
      }
    };
    int first_blocks[kS];  // all read before any copy waits for one
#pragma unroll
    for (int k = 0; k < kS; ++k) first_blocks[k] = first_block(k);
#pragma unroll
    for (int k = 0; k < kS - 1; ++k) {
      issue(warp + k * kW, stage[k], first_blocks[k]);
      CopyAsyncCommit();
    }
    int next_block = first_blocks[kS - 1];
    finish_prologue();
    Chunk cur;
#pragma unroll 1
    for (int c = warp; c < num_full; c += kW) {
      const int ahead = c + (kS - 1) * kW;
      const int following = block_of(ahead + kW, num_full);
      CopyAsyncWaitGroup<kS - 2>();
      __syncwarp();  // every lane's copies of chunk c are complete and visible
      read(stage[0], cur);
      // The stage written here was read in the previous step (by mma operands every lane
      // reached), so it is free.
      issue(ahead, stage[kS - 1], next_block);
      CopyAsyncCommit();
      compute.template operator()<false>(c, cur);
      next_block = following;
      const uint32_t first = stage[0];
#pragma unroll
      for (int i = 0; i + 1 < kS; ++i) stage[i] = stage[i + 1];
      stage[kS - 1] = first;
    }
    CopyAsyncWait();  // (only empty groups remain) before the merge reuses shared memory
  } else if constexpr (Traits::kPlain) {
    // A bf16 chunk is 4x the bytes of a compressed one: one buffer, and occupancy (more warps
    // per SM) keeps enough loads in flight.
    Chunk buf;
    int block = first_block(0);
    finish_prologue();
#pragma unroll 1
    for (int c = warp; c < num_full; c += kW) {
      const int next = block_of(c + kW, num_full);
      load(c, buf, block);
      compute.template operator()<false>(c, buf);
      block = next;
    }
  } else if constexpr (kStaged) {
    // Chunk c + (kStages - 1)·kW is copied into stage (k + 3) mod 4 while chunk c (this warp's
    // k-th) is read from stage k mod 4 and computed; one commit group per chunk (empty past the
    // end) keeps the wait count fixed. In copy instruction j (j = 0..3) lane l copies the 16-byte
    // unit l mod 8 of token 4j + l / 8, so each 8-lane phase moves one token's whole slot: one
    // L2 request per 128-byte line of the slot (two where a 112-byte slot of 3-bit keys crosses a
    // line), where lane pairs over 16 tokens (v7y) made four per line, and twice that for the
    // 3-bit slots at 112·h: that request rate held k3v4_nc's copies to 57 % of the read ceiling
    // (NOTES, v8a). A phase writes one token's 8 units of one stage row, conflict-free under any
    // swizzle. Lanes 0-5 also copy one 16-byte half of a metadata run each.
    using Layout = StagedLayout<kKind, kSW>;
    constexpr uint32_t kPitch = Layout::kPitch;
    constexpr uint32_t kKeyBytes = Traits::kKeyBytes * 4;  // per token (4 lanes)
    static_assert(kKeyBytes % 16 == 0 && kKeyBytes + 64 <= kPitch);
    const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    uint32_t stage[kStages];  // shared addresses of this warp's stages, stage[0] = the next read
#pragma unroll
    for (int s = 0; s < kStages; ++s) stage[s] = smem_base + Layout::Stage(cta_warp, s);
    const uint32_t meta_cells = smem_base + Layout::kMeta + 128u * kStages * cta_warp;
    const uint32_t copy_tok = lane >> 3, copy_unit = lane & 7u;
    // The swizzles are XOR-linear in the token's bits, so token 4j + r's destination is r's with
    // Swizzle(4j) applied (kPitch is a multiple of 128: the XOR touches only the unit bits).
    const uint32_t copy_dst =
        Pinned(kPitch * copy_tok + 16u * (copy_unit ^ Layout::Swizzle(copy_tok)));
#ifdef TQKV_DECODE_ALIGNED_COPIES
    // A measurement build, with TQKV_DECODE_COPY_ONLY (wrong bytes, the copies' speed only): each
    // 3-bit slot is read from the 128-byte aligned line 128·(h mod 7) of its token row instead of
    // from 112·h, where the slots of heads 1-6 straddle two lines (heads 0 and 7 share line 0).
    const uint32_t copy_head =
        kKind == KeyKind::kMse3 ? 128u * static_cast<uint32_t>(h % 7) : head_off;
#else
    const uint32_t copy_head = head_off;
#endif
    // A warp's chunks lie kW·16 tokens apart; in the 8-warp kernels that is 128 tokens, a multiple
    // of every block size (16-128), so the position of each of its chunks in its block is the
    // same (kFixedPos: folded into copy_src once, no per-chunk position arithmetic).
    constexpr bool kFixedPos = kW * kChunk == 128;
    const uint32_t warp_pos =
        kFixedPos ? (static_cast<uint32_t>(begin + warp * kChunk) & (p.block_size - 1)) : 0u;
    const uint32_t copy_src =
        Pinned((warp_pos + copy_tok) * stride_token + copy_head + 16u * copy_unit);
    const uint32_t copy_step = Pinned(4u * static_cast<uint32_t>(stride_token));  // 4 tokens
    // Unit 7 of a 112-byte slot (3-bit keys) is past the slot: that lane copies nothing.
    const bool copy_lane = 16u * copy_unit < kKeyBytes + 64u;
    const bool meta_lane = lane < 6;  // field lane / 2, half lane % 2
    const uint32_t copy_meta =
        Pinned(static_cast<uint32_t>(p.meta_offset) + 2 * h * p.num_meta * p.block_size +
               (lane >> 1) * meta_field + 16 * (lane & 1) + 2 * warp_pos);
    const uint32_t meta_dst_lane = Pinned(meta_cells + 16u * lane);
    const uint32_t block_bytes = static_cast<uint32_t>(p.block_bytes);
    // Chunk cc into a stage; past the split's full chunks (block 0) nothing is read.
    // (One 64-bit address per chunk, then 64-bit steps: a 64-bit product and sum per copy cost
    // 7 more instructions per chunk.)
    auto issue = [&](int cc, uint32_t dst, uint32_t meta_dst, int block) {
      const uint32_t bytes = cc < num_full ? 16u : 0u;
      const uint8_t* base =
          p.cache + static_cast<uint64_t>(static_cast<uint32_t>(block)) * block_bytes;
      const uint32_t pos0 = kFixedPos ? 0u : (begin + cc * kChunk) & (p.block_size - 1);
      const uint8_t* from = base + (pos0 * stride_token + copy_src);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t to = dst + 4u * kPitch * j + (copy_dst ^ (16u * Layout::Swizzle(4u * j)));
        if constexpr (kKeyBytes + 64 == 128) {
          CopyAsync16Fill<kStreamCopies>(to, from, bytes);
        } else {
          CopyAsync16FillIf<kStreamCopies>(copy_lane, to, from, bytes);
        }
        from += copy_step;
      }
      CopyAsync16FillIf<kStreamCopies>(meta_lane, meta_dst, base + (copy_meta + 2 * pos0), bytes);
    };
    // Read offsets within a stage: keys of token 2g and 2g + 1 (+kPitch: the swizzle depends on
    // token / 2); values of tokens 4t, 4t + 1 (+kPitch) and 4t + 2, 4t + 3 (+kPitch), bytes
    // kKeyBytes + 8g; metadata of tokens 2g, 2g + 1.
    auto at = [](uint32_t token, uint32_t byte) {
      return kPitch * token + 16u * ((byte >> 4) ^ Layout::Swizzle(token)) + (byte & 15u);
    };
    constexpr int kKeyReads = kKind == KeyKind::kMse4 ? 1 : 3;  // 16-byte or 4-byte reads
    uint32_t read_k[kKeyReads];
#pragma unroll
    for (int w = 0; w < kKeyReads; ++w) {
      read_k[w] = Pinned(at(2 * g, kKind == KeyKind::kMse4 ? 16u * t : 12u * t + 4u * w));
    }
    const uint32_t read_v0 = Pinned(at(4 * t, kKeyBytes + 8u * g));
    const uint32_t read_v1 = Pinned(at(4 * t + 2, kKeyBytes + 8u * g));
    const uint32_t read_meta = Pinned(meta_cells + 4u * g);
    auto read = [&](uint32_t st, uint32_t meta, Chunk& ck) {
      if constexpr (kKind == KeyKind::kMse4) {
        SharedLoad16(st + read_k[0], ck.kg);
        SharedLoad16(st + read_k[0] + kPitch, ck.k8);
      } else {
#pragma unroll
        for (int w = 0; w < kKeyReads; ++w) {
          ck.kg[w] = SharedLoad4(st + read_k[w]);
          ck.k8[w] = SharedLoad4(st + read_k[w] + kPitch);
        }
      }
      SharedLoad8(st + read_v0, ck.v[0]);
      SharedLoad8(st + read_v0 + kPitch, ck.v[2]);
      SharedLoad8(st + read_v1, ck.v[1]);
      SharedLoad8(st + read_v1 + kPitch, ck.v[3]);
      ck.norm = SharedLoad4(meta);
      ck.vscale = SharedLoad4(meta + 32);
      ck.vzero = SharedLoad4(meta + 64);
    };
    int first_blocks[kStages];  // all read before any copy waits for one
#pragma unroll
    for (int k = 0; k < kStages; ++k) first_blocks[k] = first_block(k);
#ifdef TQKV_DECODE_COMPUTE_ONLY  // a measurement build: every stage copied once, then reused
    constexpr int kPrologueStages = kStages;
#else
    constexpr int kPrologueStages = kStages - 1;
#endif
#pragma unroll
    for (int k = 0; k < kPrologueStages; ++k) {
      issue(warp + k * kW, stage[k], meta_dst_lane + 128u * k, first_blocks[k]);
      CopyAsyncCommit();
    }
    // The narrow kernel: block ids from global memory, each read one chunk before its copy.
    [[maybe_unused]] int next_block = first_blocks[kStages - 1];
    Phase(2);
    finish_prologue();
    Phase(3);
    CtaPrologueDone();
    lane_word = Pinned(lane_word);
    // The 8-warp kernels: block id of chunk cc from the split's ids in shared memory (read there
    // past the end too, inside Config::kMaxIds, and dropped), 0 past its full chunks.
    const uint32_t ids_lane = Pinned(static_cast<uint32_t>(__cvta_generic_to_shared(ids_s)) -
                                     4u * static_cast<uint32_t>(id0));
    auto staged_block = [&](int cc) -> int {
      const uint32_t at =
          ids_lane + 4u * static_cast<uint32_t>((begin + cc * kChunk) >> block_shift);
      return cc < num_full ? static_cast<int>(SharedLoad4(at)) : 0;
    };
    Chunk cur;
    uint32_t s = 0;  // stage of chunk c
#pragma unroll 1
    for (int c = warp; c < num_full; c += kW) {
      const int ahead = c + (kStages - 1) * kW;
      int following = 0;
      if constexpr (Config::kMaxIds > 0) {
        next_block = staged_block(ahead);
      } else {
        following = block_of(ahead + kW, num_full);
      }
#ifndef TQKV_DECODE_NO_WAIT  // a measurement build: wrong results, the loop never waits for data
      CopyAsyncWaitGroup<kStages - 2>();
#endif
      __syncwarp();            // every lane's copies of chunk c are complete and visible
#ifndef TQKV_DECODE_COPY_ONLY  // a measurement build: the copies alone (tools/bench/NOTES.md)
      read(stage[0], read_meta + 128u * s, cur);
#endif
      // The stage written here was read in the previous step; its reads fed that step's
      // mma.sync instructions, which every lane of the warp had to reach, so it is free. (Issued
      // after this step's reads: an LDGSTS holds its address registers until the memory pipe
      // takes it, and the reads' destinations would otherwise reuse them and wait.)
#ifndef TQKV_DECODE_COMPUTE_ONLY
      issue(ahead, stage[kStages - 1], meta_dst_lane + 128u * ((s + kStages - 1) % kStages),
            next_block);
#endif
      CopyAsyncCommit();
#ifndef TQKV_DECODE_COPY_ONLY
      compute.template operator()<false>(c, cur);
#endif
      if constexpr (Config::kMaxIds == 0) next_block = following;
      s = (s + 1) % kStages;
      const uint32_t first = stage[0];
#pragma unroll
      for (int i = 0; i + 1 < kStages; ++i) stage[i] = stage[i + 1];
      stage[kStages - 1] = first;
    }
    CopyAsyncWait();  // (only empty groups remain) before the merge reuses shared memory
  } else {
    // Two register buffers in turn. While chunk c is computed, the registers of chunk c + 1
    // (this warp's next) are loading and the block id of chunk c + 2 is being read.
    Chunk buf0, buf1;
    int c = warp;
    int next1 = first_block(1);
    if (c < num_full) load(c, buf0, first_block(0));
    finish_prologue();
    auto step = [&](int cc, Chunk& cur, Chunk& nxt) {
      const int next2 = block_of(cc + 2 * kW, num_full);
      if (cc + kW < num_full) load(cc + kW, nxt, next1);
      compute.template operator()<false>(cc, cur);
      next1 = next2;
    };
#pragma unroll 1
    for (; c < num_full; c += 2 * kW) {
      step(c, buf0, buf1);
      if (c + kW >= num_full) break;
      step(c + kW, buf1, buf0);
    }
  }
  if ((end - begin) % kChunk != 0 && num_full % kW == warp) {
    Chunk tail;
    load(num_full, tail, block_of(num_full, num_full + 1));
    compute.template operator()<true>(num_full, tail);
  }

  // The merge grid (or, without one, the next kernel) may start; it waits for this grid to finish
  // before it reads anything. Not when the next kernel may be a split grid smaller than the SMs'
  // room (p.trigger_dependents = 0): CTAs launched while this grid's last ones still ran were
  // placed next to them, two on some SMs, and a one-wave grid is as slow as its slowest SM
  // (batch 1 × 32k: 20.5 -> 27 µs with the merge's early trigger, measured); then the next
  // kernel is launched when every CTA of this grid has exited.
  Phase(4);
  CtaChunksDone();
  if (p.trigger_dependents) LaunchDependents();
#if defined(TQKV_DECODE_EXTRA_MMA) || defined(TQKV_DECODE_EXTRA_ALU)
  if (p.block_size == 3) {  // never (block sizes are multiples of 16): keeps the spare work
    p.lse[threadIdx.x] = junk_acc[0][0] + junk_acc[0][1] + junk_acc[0][2] + junk_acc[0][3] +
                         junk_acc[1][0] + junk_acc[1][1] + junk_acc[1][2] + junk_acc[1][3] +
                         static_cast<float>(junk_alu[0] ^ junk_alu[1]);
  }
#endif

  if constexpr (kPacked) {  // columns 2t, 2t + 1 hold the P'_hi and P'_lo sums of head t
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      acc[mt][0][0] += acc[mt][0][1];  // row g
      acc[mt][0][2] += acc[mt][0][3];  // row g + 8
    }
  }

  // Row sums: l and z are per-thread partials over tokens 2g, 2g+1; m is already warp-uniform
  // per head column.
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        l[nt][j] += __shfl_xor_sync(0xffffffffu, l[nt][j], off);
        z[nt][j] += __shfl_xor_sync(0xffffffffu, z[nt][j], off);
      }
    }
  }

  // Merge the four warps through shared memory (the table is no longer needed): every warp
  // stores its (m, l, z) and its accumulator unscaled, then one pass rescales and sums them.
  __syncthreads();
  constexpr int kHeads = 8 * kNTiles;
  // Rows per CTA warp (kCW); a paired CTA's heads 0-3 of unit u are its row heads 4u .. 4u + 3
  // in the per-head arrays below.
  constexpr int kCW = Config::kCtaWarps;
  float* acc_s = reinterpret_cast<float*>(smem);             // [kCW][kHeads] rows, AccAt
  float* stats = acc_s + kCW * kHeads * Config::kAccStride;  // [3][kCW][kHeads]: m, l, z
  if (g == 0) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int j = 0; j < (kPacked ? 1 : 2); ++j) {
        const int head = kPacked ? t : 8 * nt + 2 * t + j;
        stats[(0 * kCW + cta_warp) * kHeads + head] = m[nt][j];
        stats[(1 * kCW + cta_warp) * kHeads + head] = l[nt][j];
        stats[(2 * kCW + cta_warp) * kHeads + head] = z[nt][j];
      }
    }
  }
  float* my_acc = acc_s + Config::AccAt(cta_warp * kHeads, 0);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    const int d0 = Traits::D0(g, mt);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (kPacked && i % 2 == 1) continue;  // folded into i - 1
        const int head = kPacked ? t : 8 * nt + 2 * t + (i % 2);
        my_acc[Config::AccAt(head, d0 + i / 2)] =
            acc[mt][nt][i] * (i < 2 ? Traits::kEvenRowScale : Traits::kOddRowScale);
      }
    }
  }
  __syncthreads();

  // Final: out[head][d] = (Σ_w f_w · acc_w + z) / l with f_w = 2^(m_w - max m), z = Σ_w f_w z_w,
  // l = Σ_w f_w l_w, lse = (max m + log2 l) · ln 2, for the group's heads. A warp without tokens
  // has m = -inf and f = 0. The per-head factors first (one thread per head), then the elements.
  // Paired CTAs: unit u's warps are u·kW .. u·kW + kW - 1 and its heads hh = u·group + head of
  // the per-head arrays (rows b·Hq + h0·group + hh: the two KV heads' query rows are adjacent).
  static_assert(kUnits * 4 <= kHeads || !kPaired);
  float* factor = stats + 3 * kCW * kHeads;  // [kCW][kHeads] f_w, [kHeads] 1/l, [kHeads] z
  if (threadIdx.x < kUnits * group) {
    const int hh = threadIdx.x, u = kPaired ? hh / group : 0, head = kPaired ? hh % group : hh;
    const int w0 = u * kW;
    float mm = -INFINITY;
#pragma unroll
    for (int w = w0; w < w0 + kW; ++w) mm = fmaxf(mm, stats[w * kHeads + head]);
    float ll = 0.0f, zz = 0.0f;
#pragma unroll
    for (int w = w0; w < w0 + kW; ++w) {
      const float mw = stats[w * kHeads + head];
      const float f = mw == -INFINITY ? 0.0f : exp2f(mw - mm);
      factor[w * kHeads + head] = f;
      ll += f * stats[(kCW + w) * kHeads + head];
      zz += f * stats[(2 * kCW + w) * kHeads + head];
    }
    factor[kCW * kHeads + hh] = 1.0f / ll;
    factor[(kCW + 1) * kHeads + hh] = zz;
    const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + h0 * group + hh);
    const float lse = (mm + log2f(ll)) * kLn2;
    if (p.output != nullptr) {  // one split per sequence: the final LSE, no merge
      p.lse[row] = lse;
    } else {
      p.partial_lse[row * p.max_splits + split] = lse;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kUnits * group * kD; i += kT) {
    const int hh = i / kD, d = i % kD, u = kPaired ? hh / group : 0;
    const int head = kPaired ? hh % group : hh, w0 = u * kW;
    float aa = 0.0f;
#pragma unroll
    for (int w = w0; w < w0 + kW; ++w) {
      const float f = factor[w * kHeads + head];
      aa += f == 0.0f ? 0.0f : f * acc_s[Config::AccAt(w * kHeads + head, d)];
    }
    const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + h0 * group + hh);
    const float out = (aa + factor[(kCW + 1) * kHeads + hh]) * factor[kCW * kHeads + hh];
    if (p.output != nullptr) {  // one split per sequence: the final output, no merge
      StoreOutput(p.output, p.out_dtype, row * kD + d, out);
    } else {
      p.partial_out[(row * p.max_splits + split) * kD + d] = out;
    }
  }
  Phase(5);
}

// ------------------------------------------------------------------------------------------------
// Merge of the split partials by log-sum-exp; one CTA per (sequence, query head), one thread per d.
// Up to kFastSplits splits every thread loads all LSEs and its d of every split at once and
// reduces them in registers (session 24: 1 × 4k 7.4 -> 7.1 µs, k3v4_nc 1 × 16k 11.1 -> 10.9,
// bf16 1 × 32k 36.0 -> 35.6; 4bit_nc 1 × 32k unchanged). Beyond that the splits' LSEs are loaded
// at once (one per thread) and reduced within each warp by shuffles when there are at most 32 (no
// barrier before the weighted sums: 0.3-0.5 µs less at batch 1), across the CTA otherwise; each
// thread's loads of its d over the splits are independent and unrolled, so the kernel waits for a
// few memory round trips, not one per split (that chain made it 13.7 µs at batch 1 × 32k, 47
// splits).
constexpr int kMaxMergeSplits = 256;  // CudaDecoder::Plan's kMaxSplits
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
  const int row = blockIdx.x;  // b · Hq + hq
  const int b = row / p.num_q_heads;
  const int d = threadIdx.x;
  const int len = p.seq_lens[b];
  const int splits = (len + p.tokens_per_split - 1) / p.tokens_per_split;
  if (splits > kMaxMergeSplits) __trap();  // the plan never makes more
  // (No early trigger for the kernel after this one: a next step's split kernel launched while
  // these CTAs and the split grid's last ones still ran took 4-7 µs longer at batch 1, see
  // LaunchDependents in the split kernel.)
  Phase(6);
  GridDependencyWait();  // the split grid's partials
  Phase(7);
#ifndef TQKV_DECODE_OLD_MERGE  // a measurement build: the shuffle path for every split count
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
    StoreOutput(p.output, p.out_dtype, static_cast<int64_t>(row) * p.head_dim + d, wx[0] / w[0]);
    if (d == 0) p.lse[row] = m[0] + logf(w[0]);
    Phase(8);
    return;
  }
#endif
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
  StoreOutput(p.output, p.out_dtype, static_cast<int64_t>(row) * p.head_dim + d, out);
  if (d == 0) p.lse[row] = splits > 0 ? mx + logf(total) : -INFINITY;
  Phase(8);
}

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
      if (p.in_dtype == 0) {
        v = static_cast<const float*>(p.query)[at];
      } else if (p.in_dtype == 1) {
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

// Launch and occupancy of one instantiation of the split kernel.
template <KeyKind kKind, int kValueBits, int kD, int kNTiles, bool kPacked, bool kStaged_ = false,
          int kSW = kStagedWarps, bool kExactScores = false, bool kPaired = false,
          bool kOneCta = false>
struct SplitKernelOps {
  using Config =
      SplitKernelConfig<kKind, kValueBits, kD, kNTiles, kStaged_, kSW, kExactScores, kPaired>;
  static constexpr auto kKernel = DecodeSplitKernel<kKind, kValueBits, kD, kNTiles, kPacked,
                                                    kStaged_, kSW, kExactScores, kPaired, kOneCta>;
  static constexpr int kCtaThreads = Config::kCtaWarps * 32;
  static constexpr bool kStaged = kStaged_;

  // Shared memory above 48 KB must be opted into once per kernel.
  static cudaError_t Configure() {
    static const cudaError_t configured = cudaFuncSetAttribute(
        kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Config::kSmemBytes);
    return configured;
  }
  static cudaError_t Launch(const SplitParams& p, bool programmatic, cudaStream_t stream) {
    if (const cudaError_t e = Configure(); e != cudaSuccess) return e;
    if (p.num_kv_heads % Config::kUnits != 0) return cudaErrorInvalidValue;
    const dim3 grid(p.max_splits, p.num_kv_heads / Config::kUnits, p.num_seqs);
    if (programmatic) {
      return LaunchDependent(kKernel, grid, dim3(kCtaThreads), Config::kSmemBytes, stream, p);
    }
    kKernel<<<grid, kCtaThreads, Config::kSmemBytes, stream>>>(p);
    return cudaGetLastError();
  }
  static cudaError_t CtasPerSm(int* ctas) {
    if (const cudaError_t e = Configure(); e != cudaSuccess) return e;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, kKernel, kCtaThreads,
                                                         Config::kSmemBytes);
  }
};

// The staged kernels are the default where they exist; TQKV_DECODE_UNSTAGED=1 in the environment
// selects the register-buffered ones instead (for side-by-side benchmarks). Read once.
bool StagedKernelsEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("TQKV_DECODE_UNSTAGED");
    return v == nullptr || v[0] == '\0' || v[0] == '0';
  }();
  return enabled;
}

// Calls fn(SplitKernelOps<...>{}) for the instantiation that serves (kind, value bits, D, group)
// and, with narrow, its narrow variant (4-warp staged CTAs, or with hi_only the paired hi-only
// CTAs: two KV heads' 4-warp units in one 8-warp CTA; fn(nullptr) where there is none), and for
// 3-bit keys' 8-warp staged kernel its hi-only or (hi_only = false) exact-scores twin: the one
// place where runtime values become template arguments.
template <typename Fn>
cudaError_t Dispatch(KeyKind kind, int value_bits, int head_dim, int group, bool narrow,
                     bool hi_only, bool one_cta, Fn&& fn) {
  if (group < 1 || group > 16) return cudaErrorInvalidValue;
  auto by_dim = [&]<KeyKind kKind, int kVB>() -> cudaError_t {
    auto by_tiles = [&]<int kD>() -> cudaError_t {
      if (narrow) {
        if constexpr (!IsPlain(kKind) && kHasStagedKernel<kKind, kVB, kD, true>) {
          if (group <= 4 && StagedKernelsEnabled()) {
            // Paired CTAs: two KV heads' 4-warp units per 8-warp CTA (3-bit keys: the hi-only
            // twin's; 4-bit keys have only these, with exact scores), else 4-warp CTAs.
            if (kKind == KeyKind::kMse4 || hi_only) {
              return fn(SplitKernelOps<kKind, kVB, kD, 1, true, true, kStagedWarps, false, true>{});
            }
            if constexpr (kKind == KeyKind::kMse3) {
              return fn(SplitKernelOps<kKind, kVB, kD, 1, true, true, 4>{});
            }
          }
        }
        return fn(nullptr);
      }
      if constexpr (!IsPlain(kKind)) {
        if constexpr (kHasStagedKernel<kKind, kVB, kD, true>) {
          if (group <= 4 && StagedKernelsEnabled()) {
            if constexpr (kKind == KeyKind::kMse3) {
              if (!hi_only) {
                return fn(SplitKernelOps<kKind, kVB, kD, 1, true, true, kStagedWarps, true>{});
              }
            }
            if constexpr (kKind == KeyKind::kMse4) {
              if (one_cta) {
                return fn(SplitKernelOps<kKind, kVB, kD, 1, true, true, kStagedWarps, false, false,
                                         true>{});
              }
            }
            return fn(SplitKernelOps<kKind, kVB, kD, 1, true, true>{});
          }
        }
        if (group <= 4) return fn(SplitKernelOps<kKind, kVB, kD, 1, true>{});
      } else if constexpr (kHasStagedKernel<kKind, kVB, kD, false>) {
        if (StagedKernelsEnabled()) {
          return group <= 8 ? fn(SplitKernelOps<kKind, kVB, kD, 1, false, true>{})
                            : fn(SplitKernelOps<kKind, kVB, kD, 2, false, true>{});
        }
      }
      return group <= 8 ? fn(SplitKernelOps<kKind, kVB, kD, 1, false>{})
                        : fn(SplitKernelOps<kKind, kVB, kD, 2, false>{});
    };
    switch (head_dim) {
      case 64:
        return by_tiles.template operator()<64>();
      case 128:
        return by_tiles.template operator()<128>();
      case 256:
        return by_tiles.template operator()<256>();
    }
    return cudaErrorInvalidValue;
  };
  switch (kind) {
    case KeyKind::kMse4:
      if (value_bits == 4) return by_dim.template operator()<KeyKind::kMse4, 4>();
      break;
    case KeyKind::kMse3:
      if (value_bits == 4) return by_dim.template operator()<KeyKind::kMse3, 4>();
      if (value_bits == 3) return by_dim.template operator()<KeyKind::kMse3, 3>();
      break;
    case KeyKind::kFp8:
      if (value_bits == 4) return by_dim.template operator()<KeyKind::kFp8, 4>();
      break;
    case KeyKind::kBf16:
      return by_dim.template operator()<KeyKind::kBf16, 16>();
    case KeyKind::kF16:
      return by_dim.template operator()<KeyKind::kF16, 16>();
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchDecodeSplits(const SplitParams& p, KeyKind kind, int value_bits, int head_dim,
                               int group, bool narrow, bool hi_only, bool one_cta,
                               bool programmatic, cudaStream_t stream) {
  return Dispatch(kind, value_bits, head_dim, group, narrow, hi_only, one_cta, [&](auto ops) {
    if constexpr (std::is_same_v<decltype(ops), std::nullptr_t>) {
      return cudaErrorInvalidValue;  // no narrow variant
    } else {
      return decltype(ops)::Launch(p, programmatic, stream);
    }
  });
}

cudaError_t DecodeSplitCtasPerSm(KeyKind kind, int value_bits, int head_dim, int group, bool narrow,
                                 int* ctas, bool* staged) {
  // The hi-only and exact twins of 3-bit keys' 8-warp kernel have the same occupancy; the narrow
  // layout's is counted in 4-warp units: 3-bit keys' 4-warp kernel's CTAs (four per SM: their
  // paired CTAs hold the same four units), 4-bit keys' paired CTAs times their two units.
  return Dispatch(kind, value_bits, head_dim, group, narrow, /*hi_only=*/!narrow, /*one_cta=*/false,
                  [&](auto ops) {
                    if constexpr (std::is_same_v<decltype(ops), std::nullptr_t>) {
                      *ctas = 0;
                      *staged = false;
                      return cudaSuccess;
                    } else {
                      using Ops = decltype(ops);
                      *staged = Ops::kStaged;
                      const cudaError_t e = Ops::CtasPerSm(ctas);
                      *ctas *= Ops::Config::kUnits;
                      return e;
                    }
                  });
}

cudaError_t LaunchDecodeMerge(const MergeParams& p, cudaStream_t stream) {
  return LaunchDependent(DecodeMergeKernel, dim3(p.num_seqs * p.num_q_heads), dim3(p.head_dim), 0,
                         stream, p);
}

cudaError_t LaunchQueryPrep(const QueryPrepParams& p, cudaStream_t stream) {
  static_assert(kPrepRows == 8, "the kernel reads a row group as two float4");
  if (p.rotation == nullptr) return cudaErrorInvalidValue;
  const int smem = 2 * kPrepRows * p.head_dim * static_cast<int>(sizeof(float)) + kPrepTileBytes;
  static const cudaError_t configured = cudaFuncSetAttribute(
      QueryPrepKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
      2 * kPrepRows * 256 * static_cast<int>(sizeof(float)) + kPrepTileBytes);
  if (configured != cudaSuccess) return configured;
  const int ctas = (p.rows + kPrepRows - 1) / kPrepRows;
  QueryPrepKernel<<<ctas, 2 * p.head_dim, smem, stream>>>(p, ctas <= kPrepEarlyTriggerCtas);
  return cudaGetLastError();
}

cudaError_t DecodePhaseTimes(unsigned long long* first, unsigned long long* last,
                             unsigned long long* cta_first, unsigned long long* cta_last,
                             unsigned* cta_sm, unsigned long long* cta_start) {
#ifdef TQKV_DECODE_PHASE_TIMES
  if (cta_start != nullptr) {
    if (const cudaError_t e = cudaMemcpyFromSymbol(cta_start, g_cta_start, sizeof(g_cta_start));
        e != cudaSuccess) {
      return e;
    }
  }
  if (cta_first != nullptr) {
    if (const cudaError_t e = cudaMemcpyFromSymbol(cta_first, g_cta_first, sizeof(g_cta_first));
        e != cudaSuccess) {
      return e;
    }
    if (const cudaError_t e = cudaMemcpyFromSymbol(cta_last, g_cta_last, sizeof(g_cta_last));
        e != cudaSuccess) {
      return e;
    }
    if (const cudaError_t e = cudaMemcpyFromSymbol(cta_sm, g_cta_sm, sizeof(g_cta_sm));
        e != cudaSuccess) {
      return e;
    }
  }
  {
    static unsigned long long ones[kMaxPhaseCtas], zeros[kMaxPhaseCtas];
    for (auto& x : ones) x = ~0ull;
    if (const cudaError_t e = cudaMemcpyToSymbol(g_cta_first, ones, sizeof(ones));
        e != cudaSuccess) {
      return e;
    }
    if (const cudaError_t e = cudaMemcpyToSymbol(g_cta_last, zeros, sizeof(zeros));
        e != cudaSuccess) {
      return e;
    }
    if (const cudaError_t e = cudaMemcpyToSymbol(g_cta_start, zeros, sizeof(zeros));
        e != cudaSuccess) {
      return e;
    }
  }
  if (first != nullptr) {
    if (const cudaError_t e = cudaMemcpyFromSymbol(first, g_phase_first, sizeof(g_phase_first));
        e != cudaSuccess) {
      return e;
    }
    if (const cudaError_t e = cudaMemcpyFromSymbol(last, g_phase_last, sizeof(g_phase_last));
        e != cudaSuccess) {
      return e;
    }
  }
  unsigned long long reset_first[kPhases], reset_last[kPhases] = {};
  for (auto& x : reset_first) x = ~0ull;
  if (const cudaError_t e = cudaMemcpyToSymbol(g_phase_first, reset_first, sizeof(reset_first));
      e != cudaSuccess) {
    return e;
  }
  return cudaMemcpyToSymbol(g_phase_last, reset_last, sizeof(reset_last));
#else
  (void)first, (void)last, (void)cta_first, (void)cta_last, (void)cta_sm, (void)cta_start;
  return cudaErrorNotSupported;
#endif
}

}  // namespace tqkv::decode_detail
