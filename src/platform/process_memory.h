// Memory figures of a process and of its mappings, from /proc/<pid>/smaps_rollup and
// /proc/self/smaps, for reports that tell one shared copy from several private ones.
//
// Rss counts a page once in every process that maps it; Pss divides a shared page between
// the processes that map it, so summing Pss over processes counts a shared arena once.
// hugetlb pages are in neither (smaps lists them as Shared_Hugetlb / Private_Hugetlb); they
// are added to rss and shared/private here, and to pss only when private (the kernel gives
// no mapcount for them).
#pragma once

#include <sys/types.h>

#include <cstdint>

#include "expert_arena/status.h"

namespace expert_arena::platform {

struct MemoryFigures {
  uint64_t rss = 0;
  uint64_t pss = 0;
  uint64_t shared = 0;         // Shared_Clean + Shared_Dirty + Shared_Hugetlb
  uint64_t private_bytes = 0;  // Private_Clean + Private_Dirty + Private_Hugetlb
  uint64_t huge = 0;  // on 2 MiB pages: AnonHugePages, ShmemPmdMapped, FilePmdMapped, hugetlb
  // Anonymous: in a private mapping of a file, the pages a write copied into this process.
  uint64_t anonymous = 0;
};

// The whole process `pid` (0: this process), from /proc/<pid>/smaps_rollup. Fails naming
// the file when the process is gone or its smaps cannot be read.
Result<MemoryFigures> ProcessMemory(pid_t pid);

// Every mapping of this process that overlaps [start, start + length): whole mappings,
// since smaps cannot split one. Fails when no mapping overlaps the range.
Result<MemoryFigures> MemoryOfMappingsOverlapping(const void* start, uint64_t length);

}  // namespace expert_arena::platform
