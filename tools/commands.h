// Subcommands of the `tqkv` program. Each Add*Command registers its flags and its callback.
#pragma once

#include <CLI/CLI.hpp>

namespace tqkv::cli {

void AddInfoCommand(CLI::App& app);
void AddStoreCommand(CLI::App& app);
void AddDecodeCommand(CLI::App& app);
void AddSimCommand(CLI::App& app);
void AddEvalCommand(CLI::App& app);
void AddGenerateCommand(CLI::App& app);

}  // namespace tqkv::cli
