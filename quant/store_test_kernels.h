// Kernels used only by quant/store_cuda_test: the store's device arithmetic on chosen inputs.
#pragma once

#include <cstdint>

#include "runtime/device.h"

namespace tqkv::store::testing {

// For i < n: fast[i] = ValueCode(v[i], vmin[i], scale[i], DivisionReciprocal(scale[i]), levels)
// (quant/store_device.h), in_range[i] = ValueCodeInRange(...) (meaningful where v lies in
// [vmin, vmin + levels · scale] or is NaN), exact[i] = the same code through __fdiv_rn and floorf.
// All pointers are device memory of n elements.
void LaunchValueCodes(const float* v, const float* vmin, const float* scale, int n, uint32_t levels,
                      uint32_t* fast, uint32_t* in_range, uint32_t* exact, StreamHandle stream);

}  // namespace tqkv::store::testing
