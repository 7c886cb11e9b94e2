// Host-level metrics: what `expert-arena ls` sees in shared directories, in Prometheus' text
// exposition format (version 0.0.4), the numbers of `expert-arena metrics` (docs/deployment.md#metrics).
#pragma once

#include <string>
#include <vector>

#include "expert_arena/export.h"

namespace expert_arena {

// The exposition for `directories`: per arena its size, bytes on 2 MiB and 1 GiB pages, in
// use, loading, users and an _info identity; per stream segment its size, free bytes, largest
// free block, live blocks, readers and whether its owner lives; per directory what sweep and
// rm would free and the filesystem's size and free space. Takes no lock and changes nothing; a
// directory that cannot be listed is reported as expert_arena_directory_up 0, and a line
// saying why is appended to `problems` (when given).
EXPERT_ARENA_EXPORT std::string PrometheusText(const std::vector<std::string>& directories,
                                               std::vector<std::string>* problems = nullptr);

}  // namespace expert_arena
