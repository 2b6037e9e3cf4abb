#include <cuda_runtime.h>

#include "tools/bench/store_bench_kernels.h"

namespace tqkv::bench {
namespace {

__device__ __forceinline__ uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ float Uniform(uint64_t h) {  // (0, 1]
  return (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777216.0f);
}

template <typename T>
__global__ void FillRowsKernel(T* dst, int64_t rows, int dim, uint64_t seed, bool offsets,
                               bool outliers) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * dim) return;
  const int64_t r = i / dim;
  const int c = static_cast<int>(i - r * dim);
  const uint64_t hr = SplitMix(seed ^ (static_cast<uint64_t>(r) * 0x2545F4914F6CDD1Dull));
  const float scale = __expf(4.0f * Uniform(hr) - 2.0f);
  const float offset = offsets ? 2.0f * Uniform(SplitMix(hr)) - 1.0f : 0.0f;
  const uint64_t h = SplitMix(seed + 0x632BE59BD9B4E019ull * static_cast<uint64_t>(i + 1));
  const float z = sqrtf(-2.0f * __logf(Uniform(h))) * __cosf(6.2831853f * Uniform(SplitMix(h)));
  const bool big = outliers && (c % 37 == 5);
  const float x = z * scale * (big ? 8.0f : 1.0f) + offset;
  if constexpr (sizeof(T) == 4) {
    dst[i] = x;
  } else {
    const uint32_t bits = __float_as_uint(x);
    dst[i] = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
}

__global__ void ReadOnlyKernel(const uint4* src, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  acc = __reduce_xor_sync(0xffffffffu, acc);
  if ((threadIdx.x & 31) == 0 && acc == 0x12345678u) sink[blockIdx.x & 1023] = acc;
}

}  // namespace

void FillRowsBf16(uint16_t* dst, int64_t rows, int dim, uint64_t seed, bool offsets, bool outliers,
                  StreamHandle stream) {
  const int64_t n = rows * dim;
  FillRowsKernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(dst, rows, dim, seed,
                                                                             offsets, outliers);
}

void FillRowsF32(float* dst, int64_t rows, int dim, uint64_t seed, StreamHandle stream) {
  const int64_t n = rows * dim;
  FillRowsKernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(dst, rows, dim, seed,
                                                                             false, false);
}

void ReadOnlyPass(const void* src, int64_t num_bytes, uint32_t* sink, StreamHandle stream) {
  ReadOnlyKernel<<<132 * 8, 512, 0, stream>>>(static_cast<const uint4*>(src), num_bytes / 16, sink);
}

}  // namespace tqkv::bench
