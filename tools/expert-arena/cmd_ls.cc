// expert-arena ls [DIR]: what holds memory in a shared directory (default /dev/shm): every
// arena file and stream segment, with its state, size, who uses or owns it, and whether
// `sweep` or `rm` would free it; other files are only counted. Takes no lock and changes
// nothing; does not map arenas (`info PATH` reads their page tables).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "arena/arena_file.h"
#include "commands.h"
#include "common/escape.h"
#include "common/units.h"
#include "expert_arena/stream.h"
#include "format/arena_format.h"
#include "platform/directory.h"
#include "platform/file.h"
#include "platform/pid_namespace.h"

namespace expert_arena::cli {
namespace {

struct Listing {
  nlohmann::json arenas = nlohmann::json::array();
  nlohmann::json segments = nlohmann::json::array();
  std::vector<std::string> lines;
  uint64_t arena_bytes = 0, segment_bytes = 0;
  uint64_t arenas_in_use = 0, freeable_arenas = 0, dead_segments = 0, other_files = 0;
};

// What an operator may do about an arena in `state`.
std::string ArenaAction(const arena::ArenaFileInfo& a) {
  if (a.state == "published") {
    return a.in_use ? "in use by " + arena::DescribeHolders(a.holders, a.users,
                                                           a.holders_unreadable)
                    : "not in use; kept for the next engine (rm frees it)";
  }
  // The loader may be in another container: its pid is then named as one of another namespace.
  const std::string loader =
      platform::DescribePid(a.summary.loader_pid, a.summary.loader_pid_namespace);
  if (a.state == "loading") return "being loaded by " + loader;
  if (a.state == "loading (loader gone)") {
    return "left unfinished by " + loader + ", which is gone (sweep frees it)";
  }
  if (a.state == "damaged") return "damaged: " + a.problem + " (rm frees it when unused)";
  if (a.state == "built, awaiting confirmation") {
    return "built by " + loader + ", published once its first forwards ran on it";
  }
  if (a.state == "built, never confirmed" || a.state == "build failed") {
    // What engines of its identity do with it: rebuild once, then refuse with this reason.
    return a.state + ": " + a.problem +
           (a.summary.build_attempt >= 2 ? "; engines of its identity refuse it"
                                         : "; the next engine of its identity rebuilds it") +
           " (rm frees it)";
  }
  return a.state;
}

// The processes /proc names as holding the arena's locks (pid, command).
nlohmann::json HoldersJson(const arena::ArenaFileInfo& a) {
  nlohmann::json holders = nlohmann::json::array();
  for (const auto& h : a.holders) {
    holders.push_back({{"pid", h.pid}, {"command", EscapeForMessage(h.command)}});
  }
  return holders;
}

void AddArena(const std::string& path, Listing& out) {
  auto info = arena::InspectArenaFile(path, /*scan_pages=*/false, /*name_holders=*/true);
  if (!info.ok()) {
    out.lines.push_back("arena    ?          " + EscapeForMessage(path) +
                        ": cannot be read: " + info.status().message());
    out.arenas.push_back({{"path", EscapeForDisplay(path)},
                          {"problem", EscapeForDisplay(info.status().message())}});
    return;
  }
  const auto& a = *info;
  const std::string action = ArenaAction(a);
  const std::string identity = EscapeForMessage(a.summary.identity_text);
  out.arena_bytes += a.file_bytes;
  if (a.in_use) ++out.arenas_in_use;
  if (!a.in_use && !a.loading_now && a.state != "loading") ++out.freeable_arenas;
  char size[32];
  std::snprintf(size, sizeof size, "%-10s", FormatBytes(a.file_bytes).c_str());
  out.lines.push_back("arena    " + std::string(size) + " " + EscapeForMessage(path) + ": " +
                      action + (identity.empty() ? "" : "; model " + identity));
  out.arenas.push_back({{"path", EscapeForDisplay(path)},
                        {"file_bytes", a.file_bytes},
                        {"state", a.state},
                        {"in_use", a.in_use},
                        {"loading_now", a.loading_now},
                        {"loader_pid", a.summary.loader_pid},
                        {"loader_pid_local", platform::PidIsLocal(a.summary.loader_pid_namespace)},
                        {"owner_uid", a.owner_uid},
                        {"users", a.users},
                        {"holders", HoldersJson(a)},
                        {"identity", identity},
                        {"action", action}});
}

void AddSegment(const std::string& path, Listing& out) {
  auto info = InspectSegment(path);
  if (!info.ok() || !info->ours) {
    const std::string problem = info.ok() ? info->problem : info.status().message();
    out.lines.push_back("segment  ?          " + EscapeForMessage(path) +
                        ": cannot be read: " + problem);
    out.segments.push_back(
        {{"path", EscapeForDisplay(path)}, {"problem", EscapeForDisplay(problem)}});
    return;
  }
  const auto& g = *info;
  out.segment_bytes += g.file_bytes;
  if (!g.owner_alive) ++out.dead_segments;
  const char* kind = g.spill ? "spill" : g.dedicated ? "dedicated" : "regular";
  const std::string name = EscapeForMessage(g.logical_name);
  const std::string owner =
      "owner " + g.owner_text + (g.owner_alive ? " alive" : " gone (sweep frees it)");
  char size[32];
  std::snprintf(size, sizeof size, "%-10s", FormatBytes(g.file_bytes).c_str());
  out.lines.push_back("segment  " + std::string(size) + " " + EscapeForMessage(path) + ": " + kind +
                      " of stream \"" + name + "\", " + owner + ", " +
                      std::to_string(g.live_blocks) + " live blocks (" + FormatBytes(g.live_bytes) +
                      "), " + std::to_string(g.readers) + " readers");
  out.segments.push_back({{"path", EscapeForDisplay(path)},
                          {"file_bytes", g.file_bytes},
                          {"kind", kind},
                          {"logical_name", name},
                          {"owner_pid", g.owner_pid},
                          {"owner_pid_local", g.owner_pid_local},
                          {"owner_uid", g.owner_uid},
                          {"owner_alive", g.owner_alive},
                          {"live_blocks", g.live_blocks},
                          {"live_bytes", g.live_bytes},
                          {"readers", g.readers}});
}

// "1 arena", "2 arenas".
std::string Count(uint64_t n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

int RunList(const std::string& dir, bool json) {
  auto names = platform::ListDirectory(dir);
  if (!names.ok()) {
    std::fprintf(stderr, "expert-arena ls: %s\n", names.status().message().c_str());
    return 1;
  }
  std::sort(names->begin(), names->end());
  Listing out;
  for (const auto& name : *names) {
    const std::string path = dir + "/" + name;
    auto st = platform::StatPath(path);
    // Only regular files are opened: a FIFO or device would block or mean nothing here.
    if (!st.ok() || !st->regular) {
      ++out.other_files;
      continue;
    }
    if (IsStreamSegment(path)) {
      AddSegment(path, out);
    } else if (arena::HasArenaMagic(path, st->size)) {
      AddArena(path, out);
    } else {
      ++out.other_files;
    }
  }
  if (json) {
    nlohmann::json j;
    j["directory"] = dir;
    j["arenas"] = out.arenas;
    j["segments"] = out.segments;
    j["arena_bytes"] = out.arena_bytes;
    j["segment_bytes"] = out.segment_bytes;
    j["arenas_in_use"] = out.arenas_in_use;
    j["dead_owner_segments"] = out.dead_segments;
    j["other_files"] = out.other_files;
    // A path with bytes that are not UTF-8 must not throw out of dump().
    std::cout << j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
    return 0;
  }
  for (const auto& line : out.lines) std::printf("%s\n", line.c_str());
  std::printf(
      "%s: %s (%s; %llu in use, %llu not in use or unfinished), %s (%s; %llu of owners "
      "that are gone); %s not shown\n",
      EscapeForMessage(dir).c_str(), Count(out.arenas.size(), "arena").c_str(),
      FormatBytes(out.arena_bytes).c_str(), static_cast<unsigned long long>(out.arenas_in_use),
      static_cast<unsigned long long>(out.freeable_arenas),
      Count(out.segments.size(), "stream segment").c_str(), FormatBytes(out.segment_bytes).c_str(),
      static_cast<unsigned long long>(out.dead_segments),
      Count(out.other_files, "other file").c_str());
  return 0;
}

}  // namespace

void RegisterList(CLI::App& app, int& exit_code) {
  auto dir = std::make_shared<std::string>("/dev/shm");
  auto json = std::make_shared<bool>(false);
  CLI::App* ls = app.add_subcommand(
      "ls", "List the arenas and stream segments in a directory: size, state, users, owners");
  ls->add_option("dir", *dir, "Shared directory")->capture_default_str();
  ls->add_flag("--json", *json, "Print one JSON object");
  ls->callback([dir, json, &exit_code] { exit_code = RunList(*dir, *json); });
}

}  // namespace expert_arena::cli
