// The `expert-arena` subcommands. Each Register* adds one CLI11 subcommand whose callback
// stores its exit code (0 success, 1 a refusal or failed check, 2 bad usage) in `exit_code`.
#pragma once

#include <CLI/CLI.hpp>

namespace expert_arena::cli {

void RegisterLoad(CLI::App& app, int& exit_code);
void RegisterFileCommands(CLI::App& app, int& exit_code);  // info, verify, rm
void RegisterSweep(CLI::App& app, int& exit_code);
// `info` of a stream segment (cmd_sweep.cc).
int RunSegmentInfo(const std::string& path, bool json);
void RegisterGenModel(CLI::App& app, int& exit_code);
void RegisterList(CLI::App& app, int& exit_code);  // ls
void RegisterMetrics(CLI::App& app, int& exit_code);
void RegisterServe(CLI::App& app, int& exit_code);

}  // namespace expert_arena::cli
