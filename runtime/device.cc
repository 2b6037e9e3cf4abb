#include "runtime/device.h"

#include <fmt/format.h>

#include "runtime/error.h"
#include "runtime/logging.h"

#if TQKV_HAVE_CUDA
#include <cuda_runtime.h>

#include "runtime/cuda_check.h"
#endif

namespace tqkv {

bool CudaCompiledIn() {
#if TQKV_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

int CudaDeviceCount() {
#if TQKV_HAVE_CUDA
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    // No driver, no device, or a driver older than the runtime: report "no device".
    LogDebug("cudaGetDeviceCount: {} ({})", cudaGetErrorName(status), cudaGetErrorString(status));
    (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

std::vector<DeviceInfo> QueryDevices() {
  std::vector<DeviceInfo> devices;
#if TQKV_HAVE_CUDA
  const int count = CudaDeviceCount();
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    TQKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, i));
    DeviceInfo info;
    info.ordinal = i;
    info.name = prop.name;
    info.sm_count = prop.multiProcessorCount;
    info.total_memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
    info.l2_cache_bytes = prop.l2CacheSize;
    info.compute_major = prop.major;
    info.compute_minor = prop.minor;
    info.shared_memory_per_sm_bytes = static_cast<int64_t>(prop.sharedMemPerMultiprocessor);
    devices.push_back(std::move(info));
  }
#endif
  return devices;
}

void RequireCudaDevice(std::string_view what) {
  if (!CudaCompiledIn()) {
    throw Error(
        fmt::format("{}: this build of tqkv has no CUDA support (built without nvcc)", what));
  }
  if (CudaDeviceCount() == 0) {
    throw Error(fmt::format("{}: no CUDA device is available", what));
  }
}

}  // namespace tqkv
