// tqkv: command-line front end of the library (info, store, decode, sim, eval, generate).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <new>

#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/version.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  CLI::App app{fmt::format("tqkv {}: TurboQuant-compressed paged KV cache", tqkv::kVersion),
               "tqkv"};
  app.require_subcommand(1);
  app.set_version_flag("--version", tqkv::kVersion);
  std::string log_level;
  app.add_option(
      "--log-level", log_level,
      "trace, debug, info, warn, error, critical, off (default: $TQKV_LOG_LEVEL or warn)");
  app.parse_complete_callback([&] {
    if (!log_level.empty()) tqkv::SetLogLevel(tqkv::ParseLogLevel(log_level, "--log-level"));
  });
  // Flag errors, like every other error, are one line.
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return fmt::format("tqkv: error: {} (see --help)\n", e.what());
  });
  tqkv::cli::AddInfoCommand(app);
  tqkv::cli::AddStoreCommand(app);
  tqkv::cli::AddDecodeCommand(app);
  tqkv::cli::AddSimCommand(app);
  tqkv::cli::AddEvalCommand(app);
  tqkv::cli::AddGenerateCommand(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "tqkv: error: out of host memory (an allocation failed)\n");
    return 1;
  } catch (const std::exception& e) {
    // One clear line, non-zero exit.
    std::fprintf(stderr, "tqkv: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
