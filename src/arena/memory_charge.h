// Who pays for an arena's pages, checked before the loader writes the first one.
//
// A tmpfs page is charged to the memory cgroup of the process that first touches it and stays
// charged there while the file exists, whoever maps it later; a hugetlbfs page is charged to
// the hugetlb controller. So only the loader pays, for the pages it newly makes; attaching
// engines pay nothing. A loader whose cgroup cannot hold the arena would be OOM-killed part-way
// through (exit 137, no message, its pages left charged): CheckArenaCharge refuses it first,
// naming the cgroup, its limit and usage, the arena's size, and the fixes.
#pragma once

#include <spdlog/spdlog.h>

#include <cstdint>
#include <string>

#include "expert_arena/status.h"
#include "platform/system_info.h"

namespace expert_arena::arena {

// `new_bytes` of pages this process is about to make in the file at `path` on `fs`. Ok with a
// note for the start line ("" when no limit applies, or on a disk filesystem whose page cache
// the kernel can reclaim); kNoSpace with the message when they do not fit. A memory.high below
// the need is logged as a warning (the kernel throttles there; tmpfs pages cannot be reclaimed
// without swap) but not refused. Cgroup files that cannot be read are logged and not refused.
// `spared`: bytes of the arena that the loader's own memory freed as it writes pays for
// (new_bytes is then what it holds at its peak); said in the messages.
Result<std::string> CheckArenaCharge(const platform::FilesystemInfo& fs, uint64_t new_bytes,
                                     const std::string& path, spdlog::logger& log,
                                     uint64_t spared = 0);

}  // namespace expert_arena::arena
