// expert-arena info | verify | rm: operations on an arena file by path.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "../kernel_json.h"
#include "../numa_json.h"
#include "arena/arena_file.h"
#include "commands.h"
#include "common/escape.h"
#include "common/units.h"
#include "expert_arena/stream.h"
#include "platform/pid_namespace.h"

namespace expert_arena::cli {
namespace {

std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

int RunInfo(const std::string& path, bool json) {
  if (IsStreamSegment(path)) return RunSegmentInfo(path, json);
  auto info = arena::InspectArenaFile(path, /*scan_pages=*/true, /*name_holders=*/true);
  if (!info.ok()) {
    std::fprintf(stderr, "expert-arena info: %s\n",
                 EscapeForDisplay(info.status().message()).c_str());
    return 1;
  }
  const auto& i = *info;
  uint64_t data_offset = i.summary.layout.header_bytes;
  if (json) {
    nlohmann::json j;
    // Every text from the file or the user is shown escaped (common/escape.h): a path may hold
    // any byte, an edited file any identity, name or dtype, and none may reach the terminal
    // as a control sequence or make the JSON invalid.
    j["path"] = EscapeForDisplay(i.path);
    j["state"] = i.state;
    if (!i.problem.empty()) j["problem"] = EscapeForDisplay(i.problem);
    j["file_bytes"] = i.file_bytes;
    j["owner_uid"] = i.owner_uid;
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", i.mode);
    j["mode"] = mode;
    j["in_use"] = i.in_use;
    j["users"] = i.users;
    j["holders"] = nlohmann::json::array();
    for (const auto& h : i.holders) {
      j["holders"].push_back({{"pid", h.pid}, {"command", EscapeForMessage(h.command)}});
    }
    j["loading_now"] = i.loading_now;
    j["backing"] = i.backing;
    j["huge_bytes"] = i.huge_bytes;
    j["page_bytes"] = i.page_bytes;
    {
      ArenaReport numa;
      numa.numa_policy = i.numa_policy;
      numa.numa_nodes = i.numa_nodes;
      j["numa"] = tools::NumaJson(numa);
    }
    j["kernel"] = tools::KernelJsonNow();
    j["format_version"] = i.summary.version;
    j["header_bytes"] = i.summary.layout.header_bytes;
    j["data_bytes"] = i.summary.layout.data_bytes;
    j["loader_pid"] = i.summary.loader_pid;
    j["loader_pid_local"] = platform::PidIsLocal(i.summary.loader_pid_namespace);
    j["identity"] = EscapeForDisplay(i.summary.identity_text);
    j["identity_hash"] = Hex(i.summary.identity_hash);
    j["alignment"] = i.table.alignment;
    j["sources"] = nlohmann::json::array();
    for (const auto& s : i.table.sources) {
      j["sources"].push_back(
          {{"path", EscapeForDisplay(s.path)}, {"bytes", s.size}, {"mtime_ns", s.mtime_ns}});
    }
    j["tensors"] = nlohmann::json::array();
    for (const auto& t : i.table.tensors) {
      j["tensors"].push_back({{"name", EscapeForDisplay(t.name)},
                              {"dtype", EscapeForDisplay(t.dtype)},
                              {"shape", t.shape},
                              {"file_offset", data_offset + t.arena_offset},
                              {"bytes", t.bytes},
                              {"source", t.source_index},
                              {"source_offset", t.source_offset},
                              {"checksum", Hex(t.checksum)}});
    }
    std::cout << j.dump(1) << std::endl;
    return 0;
  }
  std::printf("path:      %s\n", EscapeForDisplay(i.path).c_str());
  std::printf("state:     %s%s%s\n", i.state.c_str(), i.problem.empty() ? "" : ": ",
              EscapeForDisplay(i.problem).c_str());
  std::printf("size:      %s (%llu bytes), owner uid %u, mode %04o, on %s\n",
              FormatBytes(i.file_bytes).c_str(), static_cast<unsigned long long>(i.file_bytes),
              i.owner_uid, i.mode, i.backing.c_str());
  const std::string users =
      i.in_use ? "yes, by " + arena::DescribeHolders(i.holders, i.users, i.holders_unreadable)
               : "no";
  std::printf("in use:    %s%s\n", users.c_str(),
              i.loading_now ? "; an engine is loading it now" : "");
  if (i.summary.our_magic) {
    std::printf("format:    version %u, header %s, data %s\n", i.summary.version,
                FormatBytes(i.summary.layout.header_bytes).c_str(),
                FormatBytes(i.summary.layout.data_bytes).c_str());
    std::printf("identity:  %s (%s)\n", EscapeForDisplay(i.summary.identity_text).c_str(),
                Hex(i.summary.identity_hash).c_str());
    std::printf(
        "loader:    %s\n",
        platform::DescribePid(i.summary.loader_pid, i.summary.loader_pid_namespace).c_str());
  }
  if (i.state == "published") {
    std::printf("pages:     %s of %s on %s pages\n", FormatBytes(i.huge_bytes).c_str(),
                FormatBytes(i.mapped_bytes).c_str(),
                FormatPageSize(i.page_bytes != 0 ? i.page_bytes : kHugePageBytes).c_str());
    if (!i.numa_nodes.empty()) {
      std::string nodes;
      for (const NumaNodeBytes& n : i.numa_nodes) {
        nodes += (nodes.empty() ? "node" : ", node") + std::to_string(n.node) + " " +
                 FormatBytes(n.bytes);
      }
      std::printf("numa:      %s (%s)\n", nodes.c_str(), i.numa_policy.c_str());
    }
    {
      // What this kernel lacks of what expert-arena uses, and what reading the pages cost.
      const auto missing =
          platform::MissingFeatures(platform::FallbackLedger{}, /*probe_all=*/true);
      std::string note = platform::KernelNote(missing);
      if (note.empty()) {
        note = "Linux " + platform::Kernel().release;
        for (size_t m = 0; m < missing.size(); ++m) {
          note += (m == 0 ? ", lacks (not needed here) " : ", ") + missing[m].name;
        }
        if (missing.empty()) note += ", nothing missing";
      }
      std::printf("kernel:    %s\n", note.c_str());
    }
    std::printf("tensors:   %zu\n", i.table.tensors.size());
    size_t shown = 0;
    for (const auto& t : i.table.tensors) {
      if (++shown > 20) {
        std::printf("  ... %zu more (--json lists all)\n", i.table.tensors.size() - 20);
        break;
      }
      std::string shape;
      for (size_t d = 0; d < t.shape.size(); ++d) {
        shape += (d ? "x" : "") + std::to_string(t.shape[d]);
      }
      std::printf("  %-48s %-6s %-16s %12llu bytes at %llu\n", EscapeForDisplay(t.name).c_str(),
                  EscapeForDisplay(t.dtype).c_str(),
                  shape.c_str(), static_cast<unsigned long long>(t.bytes),
                  static_cast<unsigned long long>(data_offset + t.arena_offset));
    }
  }
  return 0;
}

int RunVerify(const std::string& path) {
  format::ArenaTable table;
  auto bad = arena::VerifyArenaFile(path, &table);
  if (!bad.ok()) {
    std::fprintf(stderr, "expert-arena verify: %s\n",
                 EscapeForDisplay(bad.status().message()).c_str());
    return 1;
  }
  if (*bad >= 0) {
    const auto& t = table.tensors[static_cast<size_t>(*bad)];
    std::fprintf(stderr, "expert-arena verify: %s: tensor %s: checksum mismatch (expected %s)\n",
                 EscapeForDisplay(path).c_str(), EscapeForDisplay(t.name).c_str(),
                 Hex(t.checksum).c_str());
    return 1;
  }
  std::printf("%s: %zu tensors, every checksum matches\n", EscapeForDisplay(path).c_str(),
              table.tensors.size());
  return 0;
}

int RunRemove(const std::string& path) {
  Status s = arena::RemoveArenaFile(path);
  if (!s.ok()) {
    std::fprintf(stderr, "expert-arena rm: %s\n",
                 EscapeForDisplay(s.message()).c_str());
    return 1;
  }
  std::printf("removed %s\n", EscapeForDisplay(path).c_str());
  return 0;
}

}  // namespace

void RegisterFileCommands(CLI::App& app, int& exit_code) {
  auto path = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  CLI::App* info = app.add_subcommand("info", "Header, state, identity, use, pages, tensors");
  info->add_option("path", *path, "Arena file")->required();
  info->add_flag("--json", *json, "Print one JSON object with the tensor table");
  info->callback([path, json, &exit_code] { exit_code = RunInfo(*path, *json); });

  auto verify_path = std::make_shared<std::string>();
  CLI::App* verify = app.add_subcommand("verify", "Recompute every tensor checksum");
  verify->add_option("path", *verify_path, "Arena file")->required();
  verify->callback([verify_path, &exit_code] { exit_code = RunVerify(*verify_path); });

  auto rm_path = std::make_shared<std::string>();
  CLI::App* rm = app.add_subcommand("rm", "Unlink the arena file when no engine uses it");
  rm->add_option("path", *rm_path, "Arena file")->required();
  rm->callback([rm_path, &exit_code] { exit_code = RunRemove(*rm_path); });
}

}  // namespace expert_arena::cli
