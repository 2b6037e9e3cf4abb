// Small kernels used only by the runtime's GPU tests.
#pragma once

#include "runtime/device.h"

namespace tqkv::testing {

// dst[i] = value for i < n, launched with `threads_per_block` threads. Kernel files do not check
// errors (no fmt in device code); the caller follows the launch with TQKV_CHECK_LAUNCH. An invalid
// count such as 2048 threads makes the launch fail.
void LaunchFill(float* dst, int n, float value, int threads_per_block, StreamHandle stream);

}  // namespace tqkv::testing
