// Checks for CUDA runtime and cuBLAS status codes: one generic checker, two thin macros.
//
// Include only from files that already include cuda_runtime.h / cublas_v2.h (host code).
// A failed call throws tqkv::Error naming the call, the status name and text, file and line.
#pragma once

#include <string>

#include "runtime/error.h"

namespace tqkv::detail {

// StatusTraits<S> says whether a status is success and how to name it.
template <typename S>
struct StatusTraits;

[[noreturn]] void ThrowApiError(const char* api, const char* expr, int code,
                                const std::string& name, const std::string& text, const char* file,
                                int line);

template <typename S>
inline void CheckApiStatus(S status, const char* expr, const char* file, int line) {
  using Traits = StatusTraits<S>;
  if (!Traits::Ok(status)) [[unlikely]] {
    ThrowApiError(Traits::kApi, expr, static_cast<int>(status), Traits::Name(status),
                  Traits::Text(status), file, line);
  }
}

}  // namespace tqkv::detail

#define TQKV_API_CHECK_(expr) ::tqkv::detail::CheckApiStatus((expr), #expr, __FILE__, __LINE__)
