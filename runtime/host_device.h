// TQKV_HOST_DEVICE marks functions shared by host code and CUDA kernels (e.g. the block format).
#pragma once

#if defined(__CUDACC__)
#define TQKV_HOST_DEVICE __host__ __device__
#else
#define TQKV_HOST_DEVICE
#endif
