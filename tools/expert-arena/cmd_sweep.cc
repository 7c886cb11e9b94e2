// expert-arena sweep [DIR]: remove stream segments whose owner process is gone and arena
// files a dead loader left unfinished (published arenas are listed, never removed), and the
// `info` view of one stream segment (cmd_file.cc calls RunSegmentInfo when PATH is one).
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "arena/arena_file.h"
#include "commands.h"
#include "common/escape.h"
#include "common/units.h"
#include "expert_arena/stream.h"

namespace expert_arena::cli {
namespace {

int RunSweep(const std::string& dir, bool json) {
  auto report = SweepStreamDirectory(dir);
  if (!report.ok()) {
    std::fprintf(stderr, "expert-arena sweep: %s\n", report.status().message().c_str());
    return 1;
  }
  auto arenas = arena::SweepArenaFiles(dir);
  if (!arenas.ok()) {
    std::fprintf(stderr, "expert-arena sweep: %s\n", arenas.status().message().c_str());
    return 1;
  }
  if (json) {
    nlohmann::json j;
    j["directory"] = dir;
    j["removed"] = report->removed;
    j["live"] = report->live;
    j["notes"] = report->notes;
    j["arenas_removed"] = arenas->removed;
    j["arenas_removed_bytes"] = arenas->removed_bytes;
    j["arenas_kept"] = arenas->kept;
    j["arena_notes"] = arenas->notes;
    // A path or note with bytes that are not UTF-8 must not throw out of dump().
    std::cout << j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
    return 0;
  }
  for (const auto& note : report->notes) std::printf("%s\n", note.c_str());
  for (const auto& note : arenas->notes) std::printf("%s\n", note.c_str());
  std::printf(
      "%s: removed %zu segments of dead owners; %zu of live owners left alone; removed %zu "
      "unfinished arenas (%s); %zu arenas kept\n",
      dir.c_str(), report->removed.size(), report->live.size(), arenas->removed.size(),
      FormatBytes(arenas->removed_bytes).c_str(), arenas->kept.size());
  return 0;
}

}  // namespace

int RunSegmentInfo(const std::string& path, bool json) {
  auto info = InspectSegment(path);
  if (!info.ok()) {
    std::fprintf(stderr, "expert-arena info: %s\n", info.status().message().c_str());
    return 1;
  }
  const auto& i = *info;
  if (!i.ours) {
    std::fprintf(stderr, "expert-arena info: %s: %s\n", EscapeForMessage(path).c_str(),
                 i.problem.c_str());
    return 1;
  }
  const char* kind = i.spill ? "spill" : i.dedicated ? "dedicated" : "regular";
  // The logical name comes from the file (a header whose name holds a control byte is refused
  // by ValidateHeader; bytes of 0x80 and up still come out as \xNN here), and the path may be a
  // name a peer chose.
  const std::string logical_name = EscapeForMessage(i.logical_name);
  if (json) {
    nlohmann::json j;
    j["path"] = i.path;  // raw: JSON escapes control bytes itself
    j["type"] = "stream segment";
    j["kind"] = kind;
    j["logical_name"] = logical_name;
    j["owner_pid"] = i.owner_pid;
    j["owner_pid_local"] = i.owner_pid_local;
    j["owner_start_time"] = i.owner_start_time;
    j["owner_uid"] = i.owner_uid;
    j["owner_alive"] = i.owner_alive;
    j["file_bytes"] = i.file_bytes;
    j["data_bytes"] = i.data_bytes;
    j["slots"] = i.slots;
    j["live_blocks"] = i.live_blocks;
    j["live_bytes"] = i.live_bytes;
    j["published_blocks"] = i.published_blocks;
    j["aborted_blocks"] = i.aborted_blocks;
    j["readers"] = i.readers;
    // A path or note with bytes that are not UTF-8 must not throw out of dump().
    std::cout << j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
    return 0;
  }
  std::printf("path:      %s\n", EscapeForMessage(i.path).c_str());
  std::printf("type:      stream segment (%s) of \"%s\"\n", kind, logical_name.c_str());
  std::printf(
      "owner:     %s (start tick %llu), uid %u: %s\n", i.owner_text.c_str(),
      static_cast<unsigned long long>(i.owner_start_time), i.owner_uid,
      i.owner_alive ? "alive (holds its lock)" : "gone (`expert-arena sweep` removes this file)");
  std::printf("size:      %s file, %s data, %u block entries\n", FormatBytes(i.file_bytes).c_str(),
              FormatBytes(i.data_bytes).c_str(), i.slots);
  std::printf("blocks:    %llu live (%s): %llu published, %llu aborted and still held\n",
              static_cast<unsigned long long>(i.live_blocks), FormatBytes(i.live_bytes).c_str(),
              static_cast<unsigned long long>(i.published_blocks),
              static_cast<unsigned long long>(i.aborted_blocks));
  std::printf("readers:   %u processes map it\n", i.readers);
  return 0;
}

void RegisterSweep(CLI::App& app, int& exit_code) {
  auto dir = std::make_shared<std::string>("/dev/shm");
  auto json = std::make_shared<bool>(false);
  CLI::App* sweep = app.add_subcommand(
      "sweep",
      "Remove stream segments whose owner is gone and arenas a dead loader left unfinished");
  sweep->add_option("dir", *dir, "Stream, spill or arena directory")->capture_default_str();
  sweep->add_flag("--json", *json, "Print one JSON object");
  sweep->callback([dir, json, &exit_code] { exit_code = RunSweep(*dir, *json); });
}

}  // namespace expert_arena::cli
