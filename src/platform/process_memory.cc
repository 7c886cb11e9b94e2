#include "platform/process_memory.h"

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

namespace expert_arena::platform {
namespace {

// "Key:   123 kB" -> bytes.
bool ParseField(const std::string& line, const char* key, uint64_t* bytes) {
  size_t n = std::strlen(key);
  if (line.compare(0, n, key) != 0 || line.size() <= n || line[n] != ':') return false;
  unsigned long long kb = 0;
  if (std::sscanf(line.c_str() + n + 1, "%llu", &kb) != 1) return false;
  *bytes = static_cast<uint64_t>(kb) * 1024;
  return true;
}

void AddField(const std::string& line, MemoryFigures& m) {
  uint64_t v = 0;
  if (ParseField(line, "Rss", &v)) {
    m.rss += v;
  } else if (ParseField(line, "Pss", &v)) {
    m.pss += v;
  } else if (ParseField(line, "Shared_Clean", &v) || ParseField(line, "Shared_Dirty", &v)) {
    m.shared += v;
  } else if (ParseField(line, "Private_Clean", &v) || ParseField(line, "Private_Dirty", &v)) {
    m.private_bytes += v;
  } else if (ParseField(line, "Anonymous", &v)) {
    m.anonymous += v;
  } else if (ParseField(line, "AnonHugePages", &v) || ParseField(line, "ShmemPmdMapped", &v) ||
             ParseField(line, "FilePmdMapped", &v)) {
    m.huge += v;
  } else if (ParseField(line, "Shared_Hugetlb", &v)) {
    m.rss += v;
    m.shared += v;
    m.huge += v;
  } else if (ParseField(line, "Private_Hugetlb", &v)) {
    m.rss += v;
    m.pss += v;
    m.private_bytes += v;
    m.huge += v;
  }
}

// A VMA header: "7f1200000000-7f1240000000 rw-s 00000000 00:1a 123   /dev/shm/x".
bool ParseVmaHeader(const std::string& line, uintptr_t* start, uintptr_t* end) {
  size_t dash = line.find('-');
  size_t space = line.find(' ');
  if (dash == std::string::npos || space == std::string::npos || dash > space) return false;
  return std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR " ", start, end) == 2;
}

}  // namespace

Result<MemoryFigures> ProcessMemory(pid_t pid) {
  std::string path = pid == 0 ? std::string("/proc/self/smaps_rollup")
                              : "/proc/" + std::to_string(pid) + "/smaps_rollup";
  std::ifstream in(path);
  if (!in) return ErrnoStatus(errno, "open", path);
  MemoryFigures m;
  std::string line;
  bool any = false;
  while (std::getline(in, line)) {
    uintptr_t s = 0, e = 0;
    if (ParseVmaHeader(line, &s, &e)) continue;
    AddField(line, m);
    any = true;
  }
  if (!any) return NotFound(path + ": empty (the process has exited)");
  return m;
}

Result<MemoryFigures> MemoryOfMappingsOverlapping(const void* start, uint64_t length) {
  std::ifstream in("/proc/self/smaps");
  if (!in) return ErrnoStatus(errno, "open", "/proc/self/smaps");
  auto lo = reinterpret_cast<uintptr_t>(start);
  uintptr_t hi = lo + length;
  MemoryFigures m;
  bool in_range = false, seen = false;
  std::string line;
  while (std::getline(in, line)) {
    uintptr_t vma_start = 0, vma_end = 0;
    if (ParseVmaHeader(line, &vma_start, &vma_end)) {
      in_range = vma_start < hi && lo < vma_end;
      seen = seen || in_range;
      continue;
    }
    if (in_range) AddField(line, m);
  }
  if (!seen) return NotFound("no mapping overlaps the given range in /proc/self/smaps");
  return m;
}

}  // namespace expert_arena::platform
