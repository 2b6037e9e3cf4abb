// The CUDA kernels of a Llama forward pass that are not GEMMs (CudaEngine runs those on cuBLAS):
// each mirrors a step of LlamaModel's CPU code (model/llama.cc). Activations are fp32 rows except
// where a GEMM reads them (bf16). Every launcher enqueues on `stream` and returns false when the
// launch failed (cudaGetLastError then says why).
#pragma once

#include <cstdint>

#include "quant/block_format.h"
#include "runtime/device.h"

namespace tqkv::model::cuda {

// x[t, :] = embedding[tokens[t], :] (fp32 rows of `hidden`).
bool LaunchEmbed(const float* embedding, const int32_t* tokens, int n, int hidden, float* x,
                 StreamHandle stream);

// y[r, :] = bf16(x[row, :] / √(mean(x[row, :]²) + eps) · w), row = rows ? rows[r] : r.
bool LaunchRmsNorm(const float* x, const int32_t* rows, int n, int hidden, const float* w,
                   float eps, uint16_t* y, StreamHandle stream);

// From qkv [n, (hq + 2·hk) · d] (a fused projection's rows: q heads, k heads, v heads): q [n, hq,
// d] and k [n, hk, d] rotated by RoPE at each row's position (adjacent pairs (2i, 2i + 1) by
// pos · base^(-2i / d), angles in fp64 as on the CPU), v [n, hk, d] copied.
bool LaunchRopeSplit(const float* qkv, const int32_t* positions, int n, int hq, int hk, int d,
                     float base, float* q, float* k, float* v, StreamHandle stream);

// act[t, i] = bf16(silu(gu[t, i]) · gu[t, ffn + i]) (gu: the fused gate and up projections).
bool LaunchSwiGlu(const float* gu, int n, int ffn, uint16_t* act, StreamHandle stream);

// Writes fp32 K/V rows [n, H, D] as bf16 into an uncompressed paged cache at the slots (slots
// < 0 write nothing), as CpuEngine's StoreBf16.
bool LaunchStoreBf16(const Bf16BlockFormat& format, const float* k, const float* v,
                     const int64_t* slots, int n, uint8_t* cache, StreamHandle stream);

// argmax[r] = the first index of the largest of logits[r, 0 .. vocab).
bool LaunchArgmax(const float* logits, int n, int vocab, int32_t* argmax, StreamHandle stream);

}  // namespace tqkv::model::cuda
