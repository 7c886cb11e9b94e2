// expert-arena: load, inspect, verify and remove shared expert arenas (see README.md "The command
// line"). Exit codes: 0 success, 1 a clear refusal or failed check, 2 bad usage.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <new>
#include <string>

#include "commands.h"
#include "expert_arena/gpu.h"

namespace {

// "expert-arena 0.9.0; gpu backends: cuda 12.9.79 (PyPI nvidia-cuda-runtime-cu12, ...), hip 5.2.3"
std::string BuildLine() {
  std::string backends;
  for (auto backend : {expert_arena::GpuBackend::kCuda, expert_arena::GpuBackend::kHip}) {
    std::string note = expert_arena::GpuBackendBuildNote(backend);
    if (note.empty()) continue;
    backends += (backends.empty() ? "" : ", ") + note;
  }
  return std::string("expert-arena ") + EXPERT_ARENA_VERSION_STRING +
         "; gpu backends: " + (backends.empty() ? "none" : backends);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"expert-arena: one shared RAM copy of a MoE model's expert weights"};
  app.set_version_flag("--version", BuildLine());
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
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  } catch (const std::bad_alloc&) {
    // The library reports its own allocation failures; this is one of the command's (its
    // output), under a memory limit: a refusal with a message, not an abort.
    std::fputs("expert-arena: out of memory\n", stderr);
    return 1;
  }
  return exit_code;
}
