// CUDA availability and device query. Usable in builds without CUDA (everything reports "none").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

// Opaque CUDA handle types, so that headers need not include cuda_runtime.h / cublas_v2.h
// (these are exactly cudaStream_t, cudaEvent_t and cublasHandle_t).
struct CUstream_st;
struct CUevent_st;
struct cublasContext;

namespace tqkv {

using StreamHandle = CUstream_st*;  // cudaStream_t; nullptr is the legacy default stream
using EventHandle = CUevent_st*;    // cudaEvent_t
using BlasHandle = cublasContext*;  // cublasHandle_t

// True when this build was compiled with the CUDA toolkit.
bool CudaCompiledIn();

// Number of usable CUDA devices; 0 without CUDA support, without a driver or without a device
// (never throws for those).
int CudaDeviceCount();

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int sm_count = 0;                // streaming multiprocessors
  int64_t total_memory_bytes = 0;  // global memory
  int64_t l2_cache_bytes = 0;
  int compute_major = 0;  // compute capability, e.g. 9.0 for Hopper
  int compute_minor = 0;
  int64_t shared_memory_per_sm_bytes = 0;
};

// One entry per device CudaDeviceCount() reports.
std::vector<DeviceInfo> QueryDevices();

// Throws tqkv::Error naming `what` when CUDA is not compiled in or no device is present.
void RequireCudaDevice(std::string_view what);

}  // namespace tqkv
