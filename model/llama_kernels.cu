#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>

#include "model/llama_kernels.h"

namespace tqkv::model::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint16_t Bf16Bits(float x) {
  const __nv_bfloat16 b = __float2bfloat16_rn(x);
  uint16_t bits;
  memcpy(&bits, &b, sizeof(bits));
  return bits;
}

int Blocks(int64_t work) {
  const int64_t b = (work + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 16 ? (b > 0 ? b : 1) : 65535 * 16);
}

__global__ void EmbedKernel(const float* embedding, const int32_t* tokens, int n, int hidden,
                            float* x) {
  const int64_t total = int64_t{n} * hidden;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / hidden, c = i % hidden;
    x[i] = embedding[int64_t{tokens[t]} * hidden + c];
  }
}

// One CTA per row: the sum of squares in fp64 (as the CPU), then the scaled row.
__global__ void RmsNormKernel(const float* x, const int32_t* rows, int hidden, const float* w,
                              float eps, uint16_t* y) {
  const int r = blockIdx.x;
  const int64_t row = rows != nullptr ? rows[r] : r;
  const float* xr = x + row * hidden;
  double ss = 0.0;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) ss += double{xr[i]} * xr[i];
  for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  __shared__ double warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  double total = 0.0;
  for (int i = 0; i < kThreads / 32; ++i) total += warp_sums[i];
  const float inv = 1.0f / sqrtf(static_cast<float>(total / hidden) + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    y[int64_t{r} * hidden + i] = Bf16Bits(xr[i] * inv * w[i]);
  }
}

// One thread per (row, head of q, k or v, pair).
__global__ void RopeSplitKernel(const float* qkv, const int32_t* positions, int n, int hq, int hk,
                                int d, float base, float* q, float* k, float* v) {
  const int heads = hq + 2 * hk, pairs = d / 2;
  const int64_t total = int64_t{n} * heads * pairs;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int pair = static_cast<int>(i % pairs);
    const int head = static_cast<int>(i / pairs % heads);
    const int64_t t = i / (int64_t{pairs} * heads);
    const float* src = qkv + (t * heads + head) * d + 2 * pair;
    const float a = src[0], b = src[1];
    float* dst;
    if (head < hq + hk) {
      const double theta =
          positions[t] * pow(static_cast<double>(base), -2.0 * pair / static_cast<double>(d));
      double sd, cd;
      sincos(theta, &sd, &cd);
      const float c = static_cast<float>(cd), s = static_cast<float>(sd);
      dst = head < hq ? q + (t * hq + head) * d : k + (t * hk + head - hq) * d;
      dst[2 * pair] = a * c - b * s;
      dst[2 * pair + 1] = a * s + b * c;
    } else {
      dst = v + (t * hk + head - hq - hk) * d;
      dst[2 * pair] = a;
      dst[2 * pair + 1] = b;
    }
  }
}

__global__ void SwiGluKernel(const float* gu, int n, int ffn, uint16_t* act) {
  const int64_t total = int64_t{n} * ffn;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / ffn, c = i % ffn;
    const float g = gu[t * 2 * ffn + c], u = gu[t * 2 * ffn + ffn + c];
    act[i] = Bf16Bits(g / (1.0f + expf(-g)) * u);
  }
}

// One thread per (token, head, element); keys and values of a token-head are contiguous rows of
// D bf16 in the block (Bf16BlockFormat).
__global__ void StoreBf16Kernel(Bf16BlockFormat f, const float* k, const float* v,
                                const int64_t* slots, int n, uint8_t* cache) {
  const int row = f.num_kv_heads * f.head_dim;
  const int64_t total = int64_t{n} * row;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / row;
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int h = static_cast<int>(i % row) / f.head_dim, e = static_cast<int>(i % row) % f.head_dim;
    uint8_t* block = cache + slot / f.block_size * f.block_bytes;
    const int pos = static_cast<int>(slot % f.block_size);
    reinterpret_cast<uint16_t*>(block + f.KeyOffset(pos, h))[e] = Bf16Bits(k[i]);
    reinterpret_cast<uint16_t*>(block + f.ValueOffset(pos, h))[e] = Bf16Bits(v[i]);
  }
}

// One CTA per row; ties go to the smaller index (std::max_element's first maximum).
__global__ void ArgmaxKernel(const float* logits, int vocab, int32_t* argmax) {
  const float* row = logits + int64_t{blockIdx.x} * vocab;
  float best = -FLT_MAX;
  int index = vocab;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    if (row[i] > best) best = row[i], index = i;
  }
  for (int o = 16; o > 0; o /= 2) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, index, o);
    if (ob > best || (ob == best && oi < index)) best = ob, index = oi;
  }
  __shared__ float bests[kThreads / 32];
  __shared__ int indices[kThreads / 32];
  if (threadIdx.x % 32 == 0) bests[threadIdx.x / 32] = best, indices[threadIdx.x / 32] = index;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) {
      if (bests[w] > best || (bests[w] == best && indices[w] < index)) best = bests[w], index = indices[w];
    }
    argmax[blockIdx.x] = index < vocab ? index : 0;
  }
}

}  // namespace

bool LaunchEmbed(const float* embedding, const int32_t* tokens, int n, int hidden, float* x,
                 StreamHandle stream) {
  EmbedKernel<<<Blocks(int64_t{n} * hidden), kThreads, 0, stream>>>(embedding, tokens, n, hidden, x);
  return cudaGetLastError() == cudaSuccess;
}

bool LaunchRmsNorm(const float* x, const int32_t* rows, int n, int hidden, const float* w,
                   float eps, uint16_t* y, StreamHandle stream) {
  if (n == 0) return true;
  RmsNormKernel<<<n, kThreads, 0, stream>>>(x, rows, hidden, w, eps, y);
  return cudaGetLastError() == cudaSuccess;
}

bool LaunchRopeSplit(const float* qkv, const int32_t* positions, int n, int hq, int hk, int d,
                     float base, float* q, float* k, float* v, StreamHandle stream) {
  RopeSplitKernel<<<Blocks(int64_t{n} * (hq + 2 * hk) * (d / 2)), kThreads, 0, stream>>>(
      qkv, positions, n, hq, hk, d, base, q, k, v);
  return cudaGetLastError() == cudaSuccess;
}

bool LaunchSwiGlu(const float* gu, int n, int ffn, uint16_t* act, StreamHandle stream) {
  SwiGluKernel<<<Blocks(int64_t{n} * ffn), kThreads, 0, stream>>>(gu, n, ffn, act);
  return cudaGetLastError() == cudaSuccess;
}

bool LaunchStoreBf16(const Bf16BlockFormat& format, const float* k, const float* v,
                     const int64_t* slots, int n, uint8_t* cache, StreamHandle stream) {
  StoreBf16Kernel<<<Blocks(int64_t{n} * format.num_kv_heads * format.head_dim), kThreads, 0,
                    stream>>>(format, k, v, slots, n, cache);
  return cudaGetLastError() == cudaSuccess;
}

bool LaunchArgmax(const float* logits, int n, int vocab, int32_t* argmax, StreamHandle stream) {
  if (n == 0) return true;
  ArgmaxKernel<<<n, kThreads, 0, stream>>>(logits, vocab, argmax);
  return cudaGetLastError() == cudaSuccess;
}

}  // namespace tqkv::model::cuda
