#include "platform/meminfo.h"

#include <cstdlib>
#include <fstream>
#include <string>

namespace expert_arena::platform {

Result<uint64_t> AvailableMemoryBytes() {
  std::ifstream in("/proc/meminfo");
  if (!in) return ErrnoStatus(errno, "open", "/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) == 0) {
      // "MemAvailable:   23456789 kB"
      return std::strtoull(line.c_str() + 13, nullptr, 10) * 1024;
    }
  }
  return Corrupt("/proc/meminfo: no MemAvailable line (Linux 3.14 or later has one)");
}

}  // namespace expert_arena::platform
