// RAII owners of a CUDA stream, a CUDA event and a cuBLAS handle. Non-copyable, movable.
// Constructing one without CUDA support or without a device throws tqkv::Error.
#pragma once

#include "runtime/device.h"

namespace tqkv {

class Stream {
 public:
  // A non-blocking stream (does not synchronize with the legacy default stream).
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;

  StreamHandle get() const { return stream_; }
  void Synchronize() const;

 private:
  StreamHandle stream_ = nullptr;
};

class Event {
 public:
  // `timing` = false creates a cheaper event that cannot measure elapsed time.
  explicit Event(bool timing = true);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;

  EventHandle get() const { return event_; }
  void Record(StreamHandle stream);
  void Synchronize() const;
  // Milliseconds between two recorded, completed timing events.
  static float ElapsedMs(const Event& start, const Event& end);

 private:
  EventHandle event_ = nullptr;
};

class CublasHandle {
 public:
  CublasHandle();
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  CublasHandle(CublasHandle&& other) noexcept;
  CublasHandle& operator=(CublasHandle&& other) noexcept;

  BlasHandle get() const { return handle_; }
  // Subsequent cuBLAS calls on this handle run on `stream`.
  void SetStream(StreamHandle stream);

 private:
  BlasHandle handle_ = nullptr;
};

}  // namespace tqkv
