// expert-arena: load, inspect, verify and remove shared expert arenas (see README.md "The command
// line"). Exit codes: 0 success, 1 a clear refusal or failed check, 2 bad usage.
#include <CLI/CLI.hpp>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"expert-arena: one shared RAM copy of a MoE model's expert weights"};
  app.require_subcommand(1);
  int exit_code = 0;
  expert_arena::cli::RegisterLoad(app, exit_code);
  expert_arena::cli::RegisterFileCommands(app, exit_code);
  expert_arena::cli::RegisterSweep(app, exit_code);
  expert_arena::cli::RegisterGenModel(app, exit_code);
  expert_arena::cli::RegisterList(app, exit_code);
  expert_arena::cli::RegisterServe(app, exit_code);
  expert_arena::cli::RegisterMetrics(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  return exit_code;
}
