#include "runtime/memory.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#if TQKV_HAVE_CUDA
#include <cuda_runtime.h>

#include "runtime/cuda_check.h"
#endif

namespace tqkv {
namespace detail {

int64_t CheckedByteSize(std::string_view owner, int64_t num_elements, size_t element_size) {
  const int64_t max_elements =
      std::numeric_limits<int64_t>::max() / static_cast<int64_t>(element_size);
  if (num_elements < 0 || num_elements > max_elements) {
    throw InvalidArgument(owner, "num_elements", num_elements,
                          fmt::format("0 to {} elements of {} bytes", max_elements, element_size));
  }
  return num_elements * static_cast<int64_t>(element_size);
}

void CheckElementRange(std::string_view op, int64_t count, int64_t offset, int64_t size) {
  if (offset < 0 || offset > size) {
    throw InvalidArgument(op, "offset", offset, fmt::format("0 to {} (buffer size)", size));
  }
  if (count < 0 || count > size - offset) {
    throw InvalidArgument(
        op, "count", count,
        fmt::format("0 to {} (buffer of {} elements, offset {})", size - offset, size, offset));
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// DeviceAllocation

DeviceAllocation::DeviceAllocation(int64_t num_bytes) {
  if (num_bytes < 0) {
    throw InvalidArgument("DeviceAllocation", "num_bytes", num_bytes, ">= 0");
  }
  if (num_bytes == 0) return;
  RequireCudaDevice("DeviceAllocation");
#if TQKV_HAVE_CUDA
  TQKV_CUDA_CHECK(cudaMalloc(&data_, static_cast<size_t>(num_bytes)));
  size_bytes_ = num_bytes;
#endif
}

DeviceAllocation::~DeviceAllocation() { Reset(); }

DeviceAllocation::DeviceAllocation(DeviceAllocation&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)) {}

DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

void DeviceAllocation::Reset() noexcept {
#if TQKV_HAVE_CUDA
  if (data_ != nullptr) (void)cudaFree(data_);  // a destructor must not throw
#endif
  data_ = nullptr;
  size_bytes_ = 0;
}

void DeviceAllocation::CheckRange(std::string_view op, int64_t num_bytes,
                                  int64_t offset_bytes) const {
  if (offset_bytes < 0 || offset_bytes > size_bytes_) {
    throw InvalidArgument(op, "offset_bytes", offset_bytes,
                          fmt::format("0 to {} (allocation size)", size_bytes_));
  }
  if (num_bytes < 0 || num_bytes > size_bytes_ - offset_bytes) {
    throw InvalidArgument(op, "num_bytes", num_bytes,
                          fmt::format("0 to {} (allocation of {} bytes, offset {})",
                                      size_bytes_ - offset_bytes, size_bytes_, offset_bytes));
  }
}

void DeviceAllocation::CopyFromHost(const void* src, int64_t num_bytes, int64_t offset_bytes,
                                    StreamHandle stream) {
  CheckRange("DeviceAllocation::CopyFromHost", num_bytes, offset_bytes);
  if (num_bytes == 0) return;
#if TQKV_HAVE_CUDA
  char* dst = static_cast<char*>(data_) + offset_bytes;
  if (stream != nullptr) {
    TQKV_CUDA_CHECK(
        cudaMemcpyAsync(dst, src, static_cast<size_t>(num_bytes), cudaMemcpyHostToDevice, stream));
  } else {
    TQKV_CUDA_CHECK(cudaMemcpy(dst, src, static_cast<size_t>(num_bytes), cudaMemcpyHostToDevice));
    // From pageable memory cudaMemcpy may return before the DMA to the device has finished; a
    // kernel on a non-blocking stream could then read stale bytes. "Synchronous" means done.
    TQKV_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }
#else
  (void)src;
  (void)stream;
#endif
}

void DeviceAllocation::CopyToHost(void* dst, int64_t num_bytes, int64_t offset_bytes,
                                  StreamHandle stream) const {
  CheckRange("DeviceAllocation::CopyToHost", num_bytes, offset_bytes);
  if (num_bytes == 0) return;
#if TQKV_HAVE_CUDA
  const char* src = static_cast<const char*>(data_) + offset_bytes;
  if (stream != nullptr) {
    TQKV_CUDA_CHECK(
        cudaMemcpyAsync(dst, src, static_cast<size_t>(num_bytes), cudaMemcpyDeviceToHost, stream));
  } else {
    TQKV_CUDA_CHECK(cudaMemcpy(dst, src, static_cast<size_t>(num_bytes), cudaMemcpyDeviceToHost));
  }
#else
  (void)dst;
  (void)stream;
#endif
}

void DeviceAllocation::FillBytes(uint8_t value, StreamHandle stream) {
  if (size_bytes_ == 0) return;
#if TQKV_HAVE_CUDA
  TQKV_CUDA_CHECK(cudaMemsetAsync(data_, value, static_cast<size_t>(size_bytes_), stream));
  if (stream == nullptr) TQKV_CUDA_CHECK(cudaStreamSynchronize(nullptr));
#else
  (void)value;
  (void)stream;
#endif
}

// ---------------------------------------------------------------------------------------------
// HostAllocation

HostAllocation::HostAllocation(int64_t num_bytes) {
  // (Past 2^62 the rounding up to 64 bytes wrapped int64; no host holds that much.)
  if (num_bytes < 0 || num_bytes > (int64_t{1} << 62)) {
    throw InvalidArgument("HostAllocation", "num_bytes", num_bytes, "0 to 2^62");
  }
  if (num_bytes == 0) return;
#if TQKV_HAVE_CUDA
  if (CudaDeviceCount() > 0) {
    TQKV_CUDA_CHECK(cudaMallocHost(&data_, static_cast<size_t>(num_bytes)));
    pinned_ = true;
  }
#endif
  if (data_ == nullptr) {
    data_ = std::aligned_alloc(64, static_cast<size_t>((num_bytes + 63) / 64 * 64));
    if (data_ == nullptr) throw std::bad_alloc();
  }
  size_bytes_ = num_bytes;
}

HostAllocation::~HostAllocation() { Reset(); }

HostAllocation::HostAllocation(HostAllocation&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)),
      pinned_(std::exchange(other.pinned_, false)) {}

HostAllocation& HostAllocation::operator=(HostAllocation&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    pinned_ = std::exchange(other.pinned_, false);
  }
  return *this;
}

void HostAllocation::Reset() noexcept {
  if (data_ != nullptr) {
#if TQKV_HAVE_CUDA
    if (pinned_) {
      (void)cudaFreeHost(data_);
    } else {
      std::free(data_);
    }
#else
    std::free(data_);
#endif
  }
  data_ = nullptr;
  size_bytes_ = 0;
  pinned_ = false;
}

}  // namespace tqkv
