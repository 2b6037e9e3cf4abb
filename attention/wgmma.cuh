// Hopper (sm_90a) primitives of the wgmma prefill kernel (attention/attention_prefill_wgmma.cuh):
// warpgroup MMAs with operands in shared memory behind descriptors, their fences, shared-memory
// barriers (mbarrier) between producer and consumer warps, and the proxy fence that makes plain
// shared-memory stores visible to the MMAs' reads. Compiled only where the target has them
// (__CUDA_ARCH_FEAT_SM90_ALL); each wrapper is one instruction or a wait loop.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tqkv::attention_detail::wgmma {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The descriptor of a K-major operand tile with the 128-byte swizzle: rows of 64 fp16 (128
// bytes), 8-row groups 1024 bytes apart, 16-byte chunk c of row r stored at chunk c ^ (r % 8) (the
// XOR takes address bits 7-9, so a tile starts on a 1024-byte boundary). A k-step of 16 elements
// starts 32 bytes further into the rows.
// The descriptor is split in its low word (start address, leading offset) and a constant high
// word, so that the descriptors of a tile's k-steps are one 32-bit add each from the tile's:
// Descriptor(a + off) = DescriptorOf(DescriptorLow(a) + off / 16) for 16-byte multiples a and off
// with a + off inside shared memory (the 14-bit address field never carries).
__device__ __forceinline__ uint32_t DescriptorLow(uint32_t smem_addr) {
  return ((smem_addr & 0x3FFFFu) >> 4)  // start address
         | (1u << 16);                  // leading offset: unused by swizzled K-major tiles
}
__device__ __forceinline__ uint64_t DescriptorOf(uint32_t low) {
  constexpr uint32_t kHigh = (1024u >> 4)  // stride offset: the next 8-row group
                             | (1u << 30);  // 128-byte swizzle (bit 62)
  return (uint64_t{kHigh} << 32) | low;
}
__device__ __forceinline__ uint64_t Descriptor(uint32_t smem_addr) {
  return DescriptorOf(DescriptorLow(smem_addr));
}

// The byte offset of 16-byte chunk `chunk` (0-7) of row `row` in a swizzled tile.
__device__ __forceinline__ uint32_t SwizzledChunk(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// Orders the warpgroup's register accesses before the MMAs that follow (their accumulators).
__device__ __forceinline__ void Fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void Commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed groups of MMAs are still running.
template <int N>
__device__ __forceinline__ void Wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Plain stores to shared memory become visible to the MMAs (the async proxy) after this.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Named barrier `id` (1-15) over `count` threads, a multiple of 32: waits until that many have
// arrived.
__device__ __forceinline__ void NamedBarrierSync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void BarrierInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void BarrierArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on the barrier and adds `bytes` to the transfers its phase waits for (BulkCopy).
__device__ __forceinline__ void BarrierArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory
// by the copy engine, completing them on barrier `bar` (BarrierArriveExpectTx).
__device__ __forceinline__ void BulkCopy(uint32_t dst, const void* src, uint32_t bytes,
                                         uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// Waits for the completion of the barrier's phase of parity `parity`.
__device__ __forceinline__ void BarrierWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// D (64 × 128, fp32) += A · Bᵀ: A 64 × 16 fp16 (bf16 with kBf16) in registers (per warp, the
// m16n8k16 A fragment of its 16 rows), B 128 × 16 from shared memory through a descriptor.
template <bool kBf16 = false>
__device__ __forceinline__ void MmaRS64x128(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (kBf16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
}

// D (64 × 64, fp32) = A · Bᵀ, plus D where `accumulate`: A 64 × 16 fp16 (bf16 with kBf16) in
// registers (per warp, the m16n8k16 A fragment of its 16 rows), B 64 × 16 from shared memory
// through a descriptor. With A in registers the MMA reads 2 KB of shared memory per 32 cycles of
// the tensor cores; with both operands there it would read 4 KB, the SM's whole bandwidth.
template <bool kBf16 = false>
__device__ __forceinline__ void MmaRS64x64(float (&d)[32], const uint32_t (&a)[4], uint64_t b,
                                           bool accumulate) {
#define TQKV_WGMMA_RS64X64(TYPE)                                                                  \
  asm volatile(                                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {"                            \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                    \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"            \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                            \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),       \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),   \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),             \
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),             \
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])              \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)))
  if constexpr (kBf16) {
    TQKV_WGMMA_RS64X64("bf16");
  } else {
    TQKV_WGMMA_RS64X64("f16");
  }
#undef TQKV_WGMMA_RS64X64
}

// D (64 × N, fp32; N = 16 or 32: N / 2 accumulators per thread, 8-column group i in d[4i .. 4i +
// 3] as an m16n8 fragment) = A · Bᵀ, plus D where kAccumulate: A 64 × 16 fp16 in registers (per
// warp, the m16n8k16 A fragment of its 16 rows), B N × 16 fp16 from shared memory through a
// descriptor (K-major, 128-byte swizzle). Without kAccumulate D is only written.
template <int N, bool kAccumulate>
__device__ __forceinline__ void MmaRS64xN(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
  static_assert(N == 16 || N == 32);
#define TQKV_WGMMA_A "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)
#define TQKV_WGMMA_D8(M) M(d[0]), M(d[1]), M(d[2]), M(d[3]), M(d[4]), M(d[5]), M(d[6]), M(d[7])
#define TQKV_WGMMA_D16(M) \
  TQKV_WGMMA_D8(M), M(d[8]), M(d[9]), M(d[10]), M(d[11]), M(d[12]), M(d[13]), M(d[14]), M(d[15])
#define TQKV_WGMMA_RW(x) "+f"(x)
#define TQKV_WGMMA_W(x) "=f"(x)
  if constexpr (N == 16) {
    if constexpr (kAccumulate) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
          : TQKV_WGMMA_D8(TQKV_WGMMA_RW)
          : TQKV_WGMMA_A);
    } else {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
          : TQKV_WGMMA_D8(TQKV_WGMMA_W)
          : TQKV_WGMMA_A);
    }
  } else {
    if constexpr (kAccumulate) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
          "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
          : TQKV_WGMMA_D16(TQKV_WGMMA_RW)
          : TQKV_WGMMA_A);
    } else {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
          "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
          : TQKV_WGMMA_D16(TQKV_WGMMA_W)
          : TQKV_WGMMA_A);
    }
  }
#undef TQKV_WGMMA_A
#undef TQKV_WGMMA_D8
#undef TQKV_WGMMA_D16
#undef TQKV_WGMMA_RW
#undef TQKV_WGMMA_W
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace tqkv::attention_detail::wgmma
