// Shared helpers for tests that need a CUDA device.
#pragma once

#include <gtest/gtest.h>

#include "runtime/device.h"

// Skips the current test (reported as skipped, not passed) when there is no CUDA device.
#define TQKV_SKIP_WITHOUT_GPU()                                                      \
  do {                                                                               \
    if (::tqkv::CudaDeviceCount() == 0) {                                            \
      GTEST_SKIP() << (::tqkv::CudaCompiledIn() ? "no CUDA device on this machine"   \
                                                : "this build has no CUDA support"); \
    }                                                                                \
  } while (0)
