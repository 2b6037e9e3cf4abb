// Errors and invariant checks.
//
// Two mechanisms (see ../shared/docs/DESIGN.md, "Errors"):
//  - invalid input throws tqkv::Error, whose message names the argument, its value and what is
//    allowed, and the operation leaves all state unchanged;
//  - a broken internal invariant aborts through TQKV_CHECK*, printing the expression, the values,
//    file and line.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tqkv {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// A byte range an operation reads or writes (host or device memory; compared as addresses).
struct ByteRange {
  std::string_view name;
  const void* data = nullptr;
  int64_t bytes = 0;
};

// Throws tqkv::Error, prefixed with `where`, naming the first two of `ranges` that overlap (empty
// and null ones never do): an operation that writes one of them while it reads or writes the
// other does so in no order the caller could rely on.
void CheckDisjoint(std::string_view where, std::initializer_list<ByteRange> ranges);

// Builds the message "<where>: invalid <argument> = <value>; allowed: <allowed>".
template <typename T>
Error InvalidArgument(std::string_view where, std::string_view argument, const T& value,
                      std::string_view allowed) {
  return Error(fmt::format("{}: invalid {} = {}; allowed: {}", where, argument, value, allowed));
}

namespace detail {

[[noreturn]] void CheckFailed(const char* expr, const std::string& values, const char* file,
                              int line);

template <typename A, typename B>
[[noreturn]] void CheckOpFailed(const char* expr, const A& a, const B& b, const char* file,
                                int line) {
  CheckFailed(expr, fmt::format("({} vs {})", a, b), file, line);
}

}  // namespace detail
}  // namespace tqkv

// Invariant checks: abort (never throw) with the expression, the operand values and the location.
#define TQKV_CHECK(cond)                                                     \
  do {                                                                       \
    if (!(cond)) [[unlikely]] {                                              \
      ::tqkv::detail::CheckFailed(#cond, std::string(), __FILE__, __LINE__); \
    }                                                                        \
  } while (0)

#define TQKV_CHECK_OP_(op, a, b)                                                               \
  do {                                                                                         \
    const auto& tqkv_check_a_ = (a);                                                           \
    const auto& tqkv_check_b_ = (b);                                                           \
    if (!(tqkv_check_a_ op tqkv_check_b_)) [[unlikely]] {                                      \
      ::tqkv::detail::CheckOpFailed(#a " " #op " " #b, tqkv_check_a_, tqkv_check_b_, __FILE__, \
                                    __LINE__);                                                 \
    }                                                                                          \
  } while (0)

#define TQKV_CHECK_EQ(a, b) TQKV_CHECK_OP_(==, a, b)
#define TQKV_CHECK_NE(a, b) TQKV_CHECK_OP_(!=, a, b)
#define TQKV_CHECK_LT(a, b) TQKV_CHECK_OP_(<, a, b)
#define TQKV_CHECK_LE(a, b) TQKV_CHECK_OP_(<=, a, b)
#define TQKV_CHECK_GT(a, b) TQKV_CHECK_OP_(>, a, b)
#define TQKV_CHECK_GE(a, b) TQKV_CHECK_OP_(>=, a, b)
