// The child "engine" used by the shared-arena selftests: opens an arena the way an engine
// does and prints one JSON line describing what it saw.
#pragma once

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "arena/test_hooks.h"
#include "expert_arena/arena.h"
#include "platform/system_info.h"
#include "test_util.h"

namespace expert_arena::testing {

inline std::string HexSum(std::span<const std::byte> bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(bytes.data(), bytes.size())));
  return buf;
}

inline std::string FileSum(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  std::string data;
  char buf[1 << 16];
  size_t n;
  while (f != nullptr && (n = std::fread(buf, 1, sizeof buf, f)) > 0) data.append(buf, n);
  if (f != nullptr) std::fclose(f);
  return HexSum({reinterpret_cast<const std::byte*>(data.data()), data.size()});
}

inline HugePages ParseHuge(const std::string& s) {
  return s == "on" ? HugePages::kOn : s == "off" ? HugePages::kOff : HugePages::kAuto;
}

// args: arena_path model_file hook(none|slow|hang) release_file(- for none) [huge] [wait_s]
//       [mode] [foreign]
// With hook=slow the loader says "LOADING" and sleeps 1.5 s before publishing; with hang it
// says "LOADING" and sleeps until killed. With a release file the engine keeps the arena open
// (says "HOLDING") until that file exists.
inline int EngineRole(const std::vector<std::string>& args) {
  const std::string& arena_path = args.at(0);
  const std::string& model = args.at(1);
  const std::string& hook = args.at(2);
  const std::string& release = args.at(3);
  if (hook == "slow" || hook == "hang") {
    arena::test_hooks::SetBeforePublish([hook] {
      std::printf("LOADING\n");
      std::fflush(stdout);
      if (hook == "hang") {
        for (;;) pause();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    });
  }
  ArenaOptions options;
  options.shared_path = arena_path;
  options.progress = false;
  if (args.size() > 4) options.huge = ParseHuge(args[4]);
  if (args.size() > 5 && args[5] != "-") options.wait_timeout_seconds = std::stod(args[5]);
  // [mode] (octal, or -) [foreign]: the file mode a loader gives, and whether a file of another
  // user is accepted (group sharing).
  if (args.size() > 6 && args[6] != "-") options.file_mode = std::stoul(args[6], nullptr, 8);
  if (args.size() > 7) options.allow_foreign_owner = args[7] == "foreign";
  ModelSpec spec;
  spec.files = {model};
  spec.format = ModelFormat::kRaw;  // the models of these tests are data files (ScopedDataFile)
  auto io_before = platform::ReadProcessIo();
  auto arena = Arena::Open(spec, options);
  auto io_after = platform::ReadProcessIo();
  nlohmann::json j;
  if (!arena.ok()) {
    j["error"] = arena.status().message();
    j["code"] = StatusCodeName(arena.status().code());
    std::printf("%s\n", j.dump().c_str());
    return 1;
  }
  const ArenaReport& r = arena->report();
  j["role"] = ArenaRoleName(r.role);
  j["sum"] = HexSum(arena->tensor(0).bytes);
  j["bytes_read"] = r.bytes_read;
  j["rchar"] = io_after->rchar - io_before->rchar;
  j["huge"] = r.huge_bytes;
  j["data_bytes"] = r.data_bytes;
  j["wait"] = r.wait_seconds;
  j["waited_for"] = r.waited_for_pid;
  j["pid"] = getpid();
  j["line"] = r.StartLine();
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
  if (release != "-") {
    std::printf("HOLDING\n");
    std::fflush(stdout);
    struct stat st;
    while (stat(release.c_str(), &st) != 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  return 0;
}

// The JSON line a child printed (the first line that parses as an object).
inline nlohmann::json ParseEngineOutput(const std::string& out) {
  size_t start = 0;
  while (start < out.size()) {
    size_t end = out.find('\n', start);
    if (end == std::string::npos) end = out.size();
    std::string line = out.substr(start, end - start);
    if (!line.empty() && line[0] == '{') return nlohmann::json::parse(line, nullptr, false);
    start = end + 1;
  }
  return nlohmann::json();
}

}  // namespace expert_arena::testing
