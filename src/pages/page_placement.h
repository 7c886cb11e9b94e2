// Where the page code puts a mapping's pages on NUMA nodes: the kernel policy and its nodes,
// resolved by the caller (arena/numa_placement.h) from the engine's options.
#pragma once

#include <string>
#include <vector>

#include "platform/numa.h"

namespace expert_arena::pages {

struct PagePlacement {
  platform::MemPolicy policy = platform::MemPolicy::kDefault;  // kDefault: first touch
  std::vector<int> nodes;
  // false for NumaPlacement::kAuto: a kernel that refuses the policy (EPERM in a container
  // without CAP_SYS_NICE, ENOSYS without CONFIG_NUMA) leaves first touch, and the note says so.
  bool required = true;
  std::string asked;  // NumaPlacementName of the option, for messages
};

}  // namespace expert_arena::pages
