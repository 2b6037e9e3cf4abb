// TQKV_CUDA_CHECK, TQKV_CUBLAS_CHECK and the launch-error check, for host code built with CUDA.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "runtime/api_check.h"

namespace tqkv::detail {

template <>
struct StatusTraits<cudaError_t> {
  static constexpr const char* kApi = "CUDA";
  static bool Ok(cudaError_t s) { return s == cudaSuccess; }
  static std::string Name(cudaError_t s) { return cudaGetErrorName(s); }
  static std::string Text(cudaError_t s) { return cudaGetErrorString(s); }
};

template <>
struct StatusTraits<cublasStatus_t> {
  static constexpr const char* kApi = "cuBLAS";
  static bool Ok(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; }
  static std::string Name(cublasStatus_t s) { return cublasGetStatusName(s); }
  static std::string Text(cublasStatus_t s) { return cublasGetStatusString(s); }
};

}  // namespace tqkv::detail

#define TQKV_CUDA_CHECK(expr) TQKV_API_CHECK_(static_cast<cudaError_t>(expr))
#define TQKV_CUBLAS_CHECK(expr) TQKV_API_CHECK_(static_cast<cublasStatus_t>(expr))

// After a kernel launch: reports a bad launch configuration (or an earlier asynchronous error)
// with the kernel's name. Does not synchronize.
#define TQKV_CHECK_LAUNCH(kernel_name) \
  ::tqkv::detail::CheckApiStatus(cudaGetLastError(), "launch of " kernel_name, __FILE__, __LINE__)
