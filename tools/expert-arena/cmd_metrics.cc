// expert-arena metrics [DIR ...] [--textfile PATH]: what `ls` sees, in Prometheus' text
// exposition format (version 0.0.4), for node_exporter's textfile collector (the convention for
// host-level state that no daemon serves) or any scraper that runs a command.
//
// The exposition itself is the library's (src/metrics, expert_arena.metrics() in Python).
#include <cstdio>
#include <string>
#include <vector>

#include "commands.h"
#include "expert_arena/metrics.h"
#include "platform/file.h"

namespace expert_arena::cli {
namespace {

int RunMetrics(const std::vector<std::string>& dirs, const std::string& textfile) {
  std::vector<std::string> problems;
  const std::string text = PrometheusText(dirs, &problems);
  for (const auto& p : problems) {
    std::fprintf(stderr, "expert-arena metrics: %s (reported as expert_arena_directory_up 0)\n",
                 p.c_str());
  }
  if (textfile.empty()) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return std::fflush(stdout) == 0 ? 0 : 1;
  }
  // node_exporter reads the directory while we write: it must see the old file or the new one.
  Status written = platform::ReplaceFileAtomically(textfile, text, 0644);
  if (!written.ok()) {
    std::fprintf(stderr, "expert-arena metrics: %s\n", written.message().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

void RegisterMetrics(CLI::App& app, int& exit_code) {
  auto dirs = std::make_shared<std::vector<std::string>>();
  auto textfile = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "metrics", "Prometheus text exposition of the arenas and stream segments in directories");
  cmd->add_option("dir", *dirs, "Shared directories (default /dev/shm)");
  cmd->add_option("--textfile", *textfile,
                  "Write to this file atomically instead of stdout (node_exporter's textfile "
                  "collector: a .prom file in its --collector.textfile.directory)");
  cmd->callback([dirs, textfile, &exit_code] {
    std::vector<std::string> list = *dirs;
    if (list.empty()) list.push_back("/dev/shm");
    exit_code = RunMetrics(list, *textfile);
  });
}

}  // namespace expert_arena::cli
