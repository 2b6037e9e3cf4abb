#include "runtime/error.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace tqkv {

void CheckDisjoint(std::string_view where, std::initializer_list<ByteRange> ranges) {
  auto begin = [](const ByteRange& r) { return reinterpret_cast<uintptr_t>(r.data); };
  for (auto a = ranges.begin(); a != ranges.end(); ++a) {
    if (a->data == nullptr || a->bytes <= 0) continue;
    for (auto b = a + 1; b != ranges.end(); ++b) {
      if (b->data == nullptr || b->bytes <= 0) continue;
      if (begin(*a) < begin(*b) + static_cast<uintptr_t>(b->bytes) &&
          begin(*b) < begin(*a) + static_cast<uintptr_t>(a->bytes)) {
        throw Error(fmt::format(
            "{}: {} ({} bytes at {}) and {} ({} bytes at {}) overlap; allowed: disjoint buffers",
            where, a->name, a->bytes, a->data, b->name, b->bytes, b->data));
      }
    }
  }
}

}  // namespace tqkv

namespace tqkv::detail {

void CheckFailed(const char* expr, const std::string& values, const char* file, int line) {
  // Written straight to stderr: the logger may be the thing that is broken.
  std::fprintf(stderr, "tqkv: TQKV_CHECK failed: %s %s at %s:%d\n", expr, values.c_str(), file,
               line);
  std::fflush(stderr);
  std::abort();
}

}  // namespace tqkv::detail
