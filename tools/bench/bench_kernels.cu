#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "tools/bench/bench_kernels.h"

namespace tqkv::bench {
namespace {

__device__ __forceinline__ uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void FillRandomBytesKernel(uint8_t* dst, int64_t n, uint64_t seed) {
  const int64_t words = n / 8;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < words;
       i += int64_t{gridDim.x} * blockDim.x) {
    reinterpret_cast<uint64_t*>(dst)[i] =
        Mix(seed ^ (i * 0x2545F4914F6CDD1Dull)) | 0x0101010101010101ull;
  }
  if (blockIdx.x == 0 && threadIdx.x < n % 8) dst[words * 8 + threadIdx.x] = 0x5A;
}

__global__ void FixCompressedKernel(uint8_t* cache, int64_t num_blocks, int64_t block_bytes,
                                    int64_t meta_offset, int num_kv_heads, int num_meta,
                                    int block_size, int key_bytes, int data_per_slot,
                                    bool fp8_keys) {
  const int64_t metas = int64_t{num_kv_heads} * num_meta * block_size;
  const int64_t slots = int64_t{block_size} * num_kv_heads;
  for (int64_t blk = blockIdx.x; blk < num_blocks; blk += gridDim.x) {
    uint8_t* base = cache + blk * block_bytes;
    __half* meta = reinterpret_cast<__half*>(base + meta_offset);
    for (int64_t i = threadIdx.x; i < metas; i += blockDim.x) {
      const int field = static_cast<int>((i / block_size) % num_meta);
      const float u = (Mix(blk * 7919 + i) >> 40) * (1.0f / 16777216.0f);
      float v;
      if (!fp8_keys && field == 0)
        v = 0.5f + 1.5f * u;  // key norm
      else if (field == num_meta - 2)
        v = 0.01f + 0.1f * u;  // value scale
      else
        v = -1.0f + u;  // value zero
      meta[i] = __float2half_rn(v);
    }
    if (fp8_keys) {
      for (int64_t i = threadIdx.x; i < slots * key_bytes; i += blockDim.x) {
        const int64_t slot = i / key_bytes, byte = i % key_bytes;
        base[slot * data_per_slot + byte] &= 0xF7;  // 0x7F / 0xFF (NaN) become 0x77 / 0xF7
      }
    }
  }
}

template <bool kFp16>
__global__ void FillRandom16Kernel(uint16_t* dst, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float u = (Mix(seed ^ (i * 0x9E3779B97F4A7C15ull)) >> 40) * (1.0f / 16777216.0f);
    const float x = 4.0f * u - 2.0f;
    dst[i] =
        kFp16 ? __half_as_ushort(__float2half_rn(x)) : __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
}

__global__ void ReadAllKernel(const uint4* src, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  for (int off = 16; off > 0; off >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31) == 0) atomicXor(sink + blockIdx.x, acc);
}

// Each CTA reads one 32 KB tile: 8 independent 16-byte loads per thread, all issued before any
// result is used, so a one-wave grid has the whole tile set in flight at once.
constexpr int kFloorThreads = 256, kFloorLoads = 8;
__global__ void __launch_bounds__(kFloorThreads)
    ReadFloorKernel(const uint4* src, int64_t n, uint32_t* sink, bool trigger) {
  const int64_t base = blockIdx.x * int64_t{kFloorThreads * kFloorLoads} + threadIdx.x;
  uint4 v[kFloorLoads];
#pragma unroll
  for (int k = 0; k < kFloorLoads; ++k) {
    const int64_t i = base + k * kFloorThreads;
    v[k] = i < n ? __ldcs(src + i) : make_uint4(0, 0, 0, 0);
  }
  uint32_t acc = 0;
#pragma unroll
  for (int k = 0; k < kFloorLoads; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  // As the decode's split kernel does once its chunks are done: a programmatic dependent (the
  // merge) may launch now.
  if (trigger) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  // Written only when impossible in practice, so the loads are not dead code.
  if (acc == 0x9E3779B9u) sink[blockIdx.x & 1023] = acc;
}

}  // namespace

void FillRandomBytes(uint8_t* dst, int64_t num_bytes, uint64_t seed, StreamHandle stream) {
  FillRandomBytesKernel<<<2048, 256, 0, stream>>>(dst, num_bytes, seed);
}

void FixCompressedCache(uint8_t* cache, int64_t num_blocks, int64_t block_bytes,
                        int64_t meta_offset, int num_kv_heads, int num_meta, int block_size,
                        int key_bytes, int data_per_slot, bool fp8_keys, StreamHandle stream) {
  FixCompressedKernel<<<4096, 256, 0, stream>>>(cache, num_blocks, block_bytes, meta_offset,
                                                num_kv_heads, num_meta, block_size, key_bytes,
                                                data_per_slot, fp8_keys);
}

void FillRandomBf16(uint16_t* dst, int64_t count, uint64_t seed, StreamHandle stream) {
  FillRandom16Kernel<false><<<2048, 256, 0, stream>>>(dst, count, seed);
}

void FillRandomF16(uint16_t* dst, int64_t count, uint64_t seed, StreamHandle stream) {
  FillRandom16Kernel<true><<<2048, 256, 0, stream>>>(dst, count, seed);
}

void ReadAll(const uint8_t* src, int64_t num_bytes, uint32_t* sink, int sink_len,
             StreamHandle stream) {
  ReadAllKernel<<<sink_len, 512, 0, stream>>>(reinterpret_cast<const uint4*>(src), num_bytes / 16,
                                              sink);
}

void ReadFloor(const uint8_t* src, int64_t num_bytes, uint32_t* sink, StreamHandle stream,
               bool trigger_dependents) {
  const int64_t n = num_bytes / 16;
  const int64_t per_cta = kFloorThreads * kFloorLoads;
  ReadFloorKernel<<<static_cast<unsigned>((n + per_cta - 1) / per_cta), kFloorThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(src), n, sink, trigger_dependents);
}

}  // namespace tqkv::bench
