// RAII owners of device memory and (pinned) host memory.
//
// Bytes and elements are kept apart: DeviceAllocation / HostAllocation count bytes; the typed
// DeviceBuffer<T> / PinnedHostBuffer<T> count elements of T and say so in every name
// (size() = elements, size_bytes() = bytes). All are non-copyable and movable.
// Every size and range is checked before any CUDA call: a negative size, or a copy that does not
// fit the buffer, throws tqkv::Error and changes nothing.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#include "runtime/device.h"
#include "runtime/error.h"

namespace tqkv {

// Untyped device memory, in bytes.
class DeviceAllocation {
 public:
  DeviceAllocation() = default;
  explicit DeviceAllocation(int64_t num_bytes);
  ~DeviceAllocation();
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  DeviceAllocation(DeviceAllocation&& other) noexcept;
  DeviceAllocation& operator=(DeviceAllocation&& other) noexcept;

  void* data() { return data_; }
  const void* data() const { return data_; }
  int64_t size_bytes() const { return size_bytes_; }

  // Copies num_bytes between host memory and [offset_bytes, offset_bytes + num_bytes) of this
  // allocation. With a stream the copy is asynchronous on it; with nullptr it is synchronous: the
  // bytes are in place when the call returns, for kernels on any stream.
  void CopyFromHost(const void* src, int64_t num_bytes, int64_t offset_bytes, StreamHandle stream);
  void CopyToHost(void* dst, int64_t num_bytes, int64_t offset_bytes, StreamHandle stream) const;
  // Sets every byte to `value` (asynchronous on `stream` when given).
  void FillBytes(uint8_t value, StreamHandle stream);

 private:
  void CheckRange(std::string_view op, int64_t num_bytes, int64_t offset_bytes) const;
  void Reset() noexcept;

  void* data_ = nullptr;
  int64_t size_bytes_ = 0;
};

// Host memory, page-locked when a CUDA device is available (fast, asynchronous copies), plain
// otherwise (CPU-only builds and machines without a device); pinned() says which.
class HostAllocation {
 public:
  HostAllocation() = default;
  explicit HostAllocation(int64_t num_bytes);
  ~HostAllocation();
  HostAllocation(const HostAllocation&) = delete;
  HostAllocation& operator=(const HostAllocation&) = delete;
  HostAllocation(HostAllocation&& other) noexcept;
  HostAllocation& operator=(HostAllocation&& other) noexcept;

  void* data() { return data_; }
  const void* data() const { return data_; }
  int64_t size_bytes() const { return size_bytes_; }
  bool pinned() const { return pinned_; }

 private:
  void Reset() noexcept;

  void* data_ = nullptr;
  int64_t size_bytes_ = 0;
  bool pinned_ = false;
};

namespace detail {
// Throws tqkv::Error unless 0 <= num_elements and num_elements * element_size fits int64.
int64_t CheckedByteSize(std::string_view owner, int64_t num_elements, size_t element_size);
// Throws tqkv::Error unless [offset, offset + count) lies within [0, size) (elements).
void CheckElementRange(std::string_view op, int64_t count, int64_t offset, int64_t size);
}  // namespace detail

// Typed device memory, in elements of T.
template <typename T>
class DeviceBuffer {
  static_assert(std::is_trivially_copyable_v<T>, "DeviceBuffer holds trivially copyable types");

 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(int64_t num_elements)
      : memory_(detail::CheckedByteSize("DeviceBuffer", num_elements, sizeof(T))),
        size_(num_elements) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : memory_(std::move(other.memory_)), size_(std::exchange(other.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    memory_ = std::move(other.memory_);
    size_ = std::exchange(other.size_, 0);
    return *this;
  }

  T* data() { return static_cast<T*>(memory_.data()); }
  const T* data() const { return static_cast<const T*>(memory_.data()); }
  int64_t size() const { return size_; }  // elements
  int64_t size_bytes() const { return memory_.size_bytes(); }
  bool empty() const { return size_ == 0; }

  // Copies src into elements [offset, offset + src.size()).
  void CopyFromHost(std::span<const T> src, int64_t offset = 0, StreamHandle stream = nullptr) {
    const auto count = static_cast<int64_t>(src.size());
    detail::CheckElementRange("DeviceBuffer::CopyFromHost", count, offset, size_);
    memory_.CopyFromHost(src.data(), count * static_cast<int64_t>(sizeof(T)),
                         offset * static_cast<int64_t>(sizeof(T)), stream);
  }
  // Copies elements [offset, offset + dst.size()) into dst.
  void CopyToHost(std::span<T> dst, int64_t offset = 0, StreamHandle stream = nullptr) const {
    const auto count = static_cast<int64_t>(dst.size());
    detail::CheckElementRange("DeviceBuffer::CopyToHost", count, offset, size_);
    memory_.CopyToHost(dst.data(), count * static_cast<int64_t>(sizeof(T)),
                       offset * static_cast<int64_t>(sizeof(T)), stream);
  }
  void FillBytes(uint8_t value, StreamHandle stream = nullptr) { memory_.FillBytes(value, stream); }

  DeviceAllocation& allocation() { return memory_; }

 private:
  DeviceAllocation memory_;
  int64_t size_ = 0;
};

// Typed host memory for staging copies, in elements of T (pinned when a device is available).
template <typename T>
class PinnedHostBuffer {
  static_assert(std::is_trivially_copyable_v<T>, "PinnedHostBuffer holds trivially copyable types");

 public:
  PinnedHostBuffer() = default;
  explicit PinnedHostBuffer(int64_t num_elements)
      : memory_(detail::CheckedByteSize("PinnedHostBuffer", num_elements, sizeof(T))),
        size_(num_elements) {}
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
      : memory_(std::move(other.memory_)), size_(std::exchange(other.size_, 0)) {}
  PinnedHostBuffer& operator=(PinnedHostBuffer&& other) noexcept {
    memory_ = std::move(other.memory_);
    size_ = std::exchange(other.size_, 0);
    return *this;
  }

  T* data() { return static_cast<T*>(memory_.data()); }
  const T* data() const { return static_cast<const T*>(memory_.data()); }
  int64_t size() const { return size_; }  // elements
  int64_t size_bytes() const { return memory_.size_bytes(); }
  bool pinned() const { return memory_.pinned(); }
  std::span<T> span() { return {data(), static_cast<size_t>(size_)}; }
  std::span<const T> span() const { return {data(), static_cast<size_t>(size_)}; }
  T& operator[](int64_t i) { return data()[i]; }
  const T& operator[](int64_t i) const { return data()[i]; }

  // Copies src into elements [offset, offset + src.size()).
  void CopyFrom(std::span<const T> src, int64_t offset = 0) {
    detail::CheckElementRange("PinnedHostBuffer::CopyFrom", static_cast<int64_t>(src.size()),
                              offset, size_);
    if (!src.empty()) std::copy(src.begin(), src.end(), data() + offset);
  }

 private:
  HostAllocation memory_;
  int64_t size_ = 0;
};

}  // namespace tqkv
