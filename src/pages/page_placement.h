// Where the page code puts a mapping's pages on NUMA nodes: the kernel policy and its nodes,
// resolved from an engine's NUMA option (for arenas and stream segments alike).
#pragma once

#include <string>
#include <vector>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"
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

// The placement `placement`/`node` means where this process may allocate from `allowed` (its
// cpuset's mems with memory) of `present` (every node with memory). kInvalidArgument for
// node:N outside `allowed`, naming what is allowed; Internal for an unresolved replicate (the
// arena resolves it to one replica's node:N first). One allowed node: first touch whatever was
// asked (the only node there is).
Result<PagePlacement> ResolvePlacement(NumaPlacement placement, int node,
                                       const std::vector<int>& allowed,
                                       const std::vector<int>& present);

}  // namespace expert_arena::pages
