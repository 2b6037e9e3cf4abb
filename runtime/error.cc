#include "runtime/error.h"

#include <cstdio>
#include <cstdlib>

namespace tqkv::detail {

void CheckFailed(const char* expr, const std::string& values, const char* file, int line) {
  // Written straight to stderr: the logger may be the thing that is broken.
  std::fprintf(stderr, "tqkv: TQKV_CHECK failed: %s %s at %s:%d\n", expr, values.c_str(), file,
               line);
  std::fflush(stderr);
  std::abort();
}

}  // namespace tqkv::detail
