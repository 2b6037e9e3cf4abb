#include "runtime/error.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "runtime/api_check.h"

namespace tqkv {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(ErrorTest, InvalidArgumentNamesWhereArgumentValueAndAllowed) {
  const Error e = InvalidArgument("MakeBlockFormat", "block_size", 48, "16, 32, 64, 128");
  EXPECT_STREQ(e.what(), "MakeBlockFormat: invalid block_size = 48; allowed: 16, 32, 64, 128");
}

// Ranges overlap when they share a byte; touching, empty and null ones do not.
TEST(ErrorTest, CheckDisjointNamesTheFirstOverlappingPair) {
  char buffer[64];
  EXPECT_NO_THROW(CheckDisjoint("Op", {{"a", buffer, 16},
                                       {"b", buffer + 16, 16},
                                       {"empty", buffer + 4, 0},
                                       {"null", nullptr, 64}}));
  try {
    CheckDisjoint("Op", {{"a", buffer, 16}, {"b", buffer + 32, 16}, {"c", buffer + 15, 2}});
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("Op: a (16 bytes at"), HasSubstr("and c (2 bytes at"),
                                HasSubstr("overlap; allowed: disjoint buffers")));
  }
}

TEST(ErrorTest, IsARuntimeError) {
  try {
    throw InvalidArgument("f", "x", -1, ">= 0");
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("x = -1"));
    return;
  }
  FAIL() << "not caught as std::runtime_error";
}

TEST(CheckDeathTest, CheckPrintsExpressionAndLocation) {
  const int blocks = 3;
  EXPECT_DEATH(TQKV_CHECK(blocks == 4),
               AllOf(HasSubstr("blocks == 4"), HasSubstr("error_test.cc")));
}

TEST(CheckDeathTest, CheckOpPrintsBothValues) {
  const int free_blocks = 3;
  const int total = 7;
  EXPECT_DEATH(TQKV_CHECK_EQ(free_blocks, total), HasSubstr("free_blocks == total (3 vs 7)"));
  EXPECT_DEATH(TQKV_CHECK_GT(free_blocks, total), HasSubstr("(3 vs 7)"));
}

TEST(CheckTest, PassingChecksDoNothing) {
  int evaluations = 0;
  auto once = [&] { return ++evaluations; };
  TQKV_CHECK_EQ(once(), 1);  // operands are evaluated exactly once
  TQKV_CHECK_LE(1, 2);
  TQKV_CHECK_NE(1, 2);
  TQKV_CHECK_LT(1, 2);
  TQKV_CHECK_GE(2, 2);
  TQKV_CHECK(true);
  EXPECT_EQ(evaluations, 1);
}

// A fake status type exercises the generic API checker without CUDA.
enum class FakeStatus { kOk = 0, kBroken = 7 };

}  // namespace

namespace detail {
template <>
struct StatusTraits<FakeStatus> {
  static constexpr const char* kApi = "Fake";
  static bool Ok(FakeStatus s) { return s == FakeStatus::kOk; }
  static std::string Name(FakeStatus) { return "FAKE_BROKEN"; }
  static std::string Text(FakeStatus) { return "it broke"; }
};
}  // namespace detail

namespace {

TEST(ApiCheckTest, ThrowsErrorNamingCallStatusAndLocation) {
  EXPECT_NO_THROW(TQKV_API_CHECK_(FakeStatus::kOk));
  try {
    TQKV_API_CHECK_(FakeStatus::kBroken);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("Fake error 7"), HasSubstr("FAKE_BROKEN"), HasSubstr("it broke"),
                      HasSubstr("FakeStatus::kBroken"), HasSubstr("error_test.cc")));
  }
}

}  // namespace
}  // namespace tqkv
