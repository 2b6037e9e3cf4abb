#include "runtime/api_check.h"

#include <fmt/format.h>

namespace tqkv::detail {

void ThrowApiError(const char* api, const char* expr, int code, const std::string& name,
                   const std::string& text, const char* file, int line) {
  throw Error(fmt::format("{} error {} ({}: {}) in `{}` at {}:{}", api, code, name, text, expr,
                          file, line));
}

}  // namespace tqkv::detail
