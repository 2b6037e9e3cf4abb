// Logging through one spdlog logger named "tqkv", quiet (warn) by default.
//
// The level comes from the TQKV_LOG_LEVEL environment variable when the logger is first used
// (trace, debug, info, warn, error, critical, off) and can be changed with SetLogLevel().
// Format strings are checked at compile time (fmt::format_string). Kernels never log.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>
#include <utility>

namespace tqkv {

// The "tqkv" logger (created on first use, or the one the host application registered).
spdlog::logger& Logger();

void SetLogLevel(spdlog::level::level_enum level);
// Accepts the names above; anything else throws tqkv::Error listing the valid names.
void SetLogLevel(std::string_view level_name);
spdlog::level::level_enum LogLevel();

// Parses a level name; throws tqkv::Error naming `argument` for an unknown name.
spdlog::level::level_enum ParseLogLevel(std::string_view level_name, std::string_view argument);

template <typename... Args>
void LogDebug(fmt::format_string<Args...> format, Args&&... args) {
  Logger().debug(format, std::forward<Args>(args)...);
}
template <typename... Args>
void LogInfo(fmt::format_string<Args...> format, Args&&... args) {
  Logger().info(format, std::forward<Args>(args)...);
}
template <typename... Args>
void LogWarn(fmt::format_string<Args...> format, Args&&... args) {
  Logger().warn(format, std::forward<Args>(args)...);
}
template <typename... Args>
void LogError(fmt::format_string<Args...> format, Args&&... args) {
  Logger().error(format, std::forward<Args>(args)...);
}

}  // namespace tqkv
