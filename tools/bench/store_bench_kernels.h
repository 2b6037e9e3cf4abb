// Kernels of the store benchmark: synthetic inputs and the read-only memory ceiling.
#pragma once

#include <cstdint>

#include "runtime/device.h"

namespace tqkv::bench {

// rows × dim bf16 values: N(0, 1) · s_r + o_r with per-row s_r = e^u, u ∈ [-2, 2), o_r ∈ [-1, 1)
// (offset only when `offsets`), and a few channels 8x larger when `outliers` (post-RoPE keys).
// Deterministic in `seed`; never all zeros.
void FillRowsBf16(uint16_t* dst, int64_t rows, int dim, uint64_t seed, bool offsets, bool outliers,
                  StreamHandle stream);

// The same values as fp32 (for GEMM timings).
void FillRowsF32(float* dst, int64_t rows, int dim, uint64_t seed, StreamHandle stream);

// Reads num_bytes (a multiple of 16) with 16-byte loads; one word per CTA goes to sink[0..1023].
void ReadOnlyPass(const void* src, int64_t num_bytes, uint32_t* sink, StreamHandle stream);

}  // namespace tqkv::bench
