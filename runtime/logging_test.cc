#include "runtime/logging.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <cstdlib>
#include <sstream>

#include "runtime/error.h"

namespace tqkv {
namespace {

using ::testing::HasSubstr;

TEST(LoggingTest, LoggerIsNamedTqkvAndRegistered) {
  EXPECT_EQ(Logger().name(), "tqkv");
  EXPECT_EQ(spdlog::get("tqkv").get(), &Logger());
}

TEST(LoggingTest, QuietByDefaultUnlessEnvironmentSaysOtherwise) {
  // Bazel passes TQKV_LOG_LEVEL through (see .bazelrc); unset it is warn.
  const char* env = std::getenv("TQKV_LOG_LEVEL");
  if (env == nullptr || *env == '\0') {
    EXPECT_EQ(LogLevel(), spdlog::level::warn);
  }
}

TEST(LoggingTest, SetLevelByEnumAndByName) {
  const auto saved = LogLevel();
  SetLogLevel(spdlog::level::debug);
  EXPECT_EQ(LogLevel(), spdlog::level::debug);
  SetLogLevel("error");
  EXPECT_EQ(LogLevel(), spdlog::level::err);
  SetLogLevel("off");
  EXPECT_EQ(LogLevel(), spdlog::level::off);
  SetLogLevel(saved);
}

TEST(LoggingTest, UnknownLevelNameIsAnErrorListingValidNames) {
  const auto saved = LogLevel();
  try {
    SetLogLevel("verbose");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("\"verbose\""));
    EXPECT_THAT(e.what(), HasSubstr("trace, debug, info, warn, error, critical, off"));
  }
  EXPECT_EQ(LogLevel(), saved);  // unchanged
}

TEST(LoggingTest, MessagesBelowTheLevelAreDropped) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  Logger().sinks().push_back(sink);
  const auto saved = LogLevel();
  SetLogLevel("warn");
  LogInfo("hidden {}", 1);
  LogWarn("shown {} of {}", 2, 3);
  SetLogLevel(saved);
  Logger().sinks().pop_back();
  EXPECT_THAT(out.str(), ::testing::Not(HasSubstr("hidden")));
  EXPECT_THAT(out.str(), HasSubstr("shown 2 of 3"));
}

}  // namespace
}  // namespace tqkv
