#include "runtime/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <array>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "runtime/error.h"

namespace tqkv {
namespace {

constexpr std::array<std::pair<std::string_view, spdlog::level::level_enum>, 7> kLevels = {{
    {"trace", spdlog::level::trace},
    {"debug", spdlog::level::debug},
    {"info", spdlog::level::info},
    {"warn", spdlog::level::warn},
    {"error", spdlog::level::err},
    {"critical", spdlog::level::critical},
    {"off", spdlog::level::off},
}};

std::shared_ptr<spdlog::logger> CreateLogger() {
  if (auto existing = spdlog::get("tqkv")) return existing;
  auto logger = spdlog::stderr_color_mt("tqkv");
  logger->set_level(spdlog::level::warn);
  if (const char* env = std::getenv("TQKV_LOG_LEVEL"); env != nullptr && *env != '\0') {
    try {
      logger->set_level(ParseLogLevel(env, "TQKV_LOG_LEVEL"));
    } catch (const Error& e) {
      logger->warn("{}; keeping level warn", e.what());
    }
  }
  return logger;
}

}  // namespace

spdlog::logger& Logger() {
  static const std::shared_ptr<spdlog::logger> logger = CreateLogger();
  return *logger;
}

spdlog::level::level_enum ParseLogLevel(std::string_view level_name, std::string_view argument) {
  for (const auto& [name, level] : kLevels) {
    if (name == level_name) return level;
  }
  throw InvalidArgument("SetLogLevel", argument, fmt::format("\"{}\"", level_name),
                        "trace, debug, info, warn, error, critical, off");
}

void SetLogLevel(spdlog::level::level_enum level) { Logger().set_level(level); }

void SetLogLevel(std::string_view level_name) {
  SetLogLevel(ParseLogLevel(level_name, "level_name"));
}

spdlog::level::level_enum LogLevel() { return Logger().level(); }

}  // namespace tqkv
