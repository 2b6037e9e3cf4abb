#include "runtime/stream.h"

#include <utility>

#include "runtime/error.h"

#if TQKV_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "runtime/cuda_check.h"
#endif

namespace tqkv {

// ---------------------------------------------------------------------------------------------
// Stream

Stream::Stream() {
  RequireCudaDevice("Stream");
#if TQKV_HAVE_CUDA
  TQKV_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
#endif
}

Stream::~Stream() {
#if TQKV_HAVE_CUDA
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
#endif
}

Stream::Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    Stream dying(std::move(*this));
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

void Stream::Synchronize() const {
#if TQKV_HAVE_CUDA
  TQKV_CUDA_CHECK(cudaStreamSynchronize(stream_));
#endif
}

// ---------------------------------------------------------------------------------------------
// Event

Event::Event(bool timing) {
  RequireCudaDevice("Event");
#if TQKV_HAVE_CUDA
  TQKV_CUDA_CHECK(
      cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
#else
  (void)timing;
#endif
}

Event::~Event() {
#if TQKV_HAVE_CUDA
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
#endif
}

Event::Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    Event dying(std::move(*this));
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

void Event::Record(StreamHandle stream) {
#if TQKV_HAVE_CUDA
  TQKV_CUDA_CHECK(cudaEventRecord(event_, stream));
#else
  (void)stream;
#endif
}

void Event::Synchronize() const {
#if TQKV_HAVE_CUDA
  TQKV_CUDA_CHECK(cudaEventSynchronize(event_));
#endif
}

float Event::ElapsedMs(const Event& start, const Event& end) {
  float ms = 0.0f;
#if TQKV_HAVE_CUDA
  TQKV_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, end.event_));
#else
  (void)start;
  (void)end;
#endif
  return ms;
}

// ---------------------------------------------------------------------------------------------
// CublasHandle

CublasHandle::CublasHandle() {
  RequireCudaDevice("CublasHandle");
#if TQKV_HAVE_CUDA
  TQKV_CUBLAS_CHECK(cublasCreate(&handle_));
#endif
}

CublasHandle::~CublasHandle() {
#if TQKV_HAVE_CUDA
  if (handle_ != nullptr) (void)cublasDestroy(handle_);
#endif
}

CublasHandle::CublasHandle(CublasHandle&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)) {}

CublasHandle& CublasHandle::operator=(CublasHandle&& other) noexcept {
  if (this != &other) {
    CublasHandle dying(std::move(*this));
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

void CublasHandle::SetStream(StreamHandle stream) {
#if TQKV_HAVE_CUDA
  TQKV_CUBLAS_CHECK(cublasSetStream(handle_, stream));
#else
  (void)stream;
#endif
}

}  // namespace tqkv
