#include "pages/page_placement.h"

#include <algorithm>

namespace expert_arena::pages {

Result<PagePlacement> ResolvePlacement(NumaPlacement placement, int node,
                                       const std::vector<int>& allowed,
                                       const std::vector<int>& present) {
  PagePlacement p;
  p.asked = NumaPlacementName(placement, node);
  switch (placement) {
    case NumaPlacement::kReplicate:
      if (allowed.size() <= 1) return p;  // one node: its one replica is the arena itself
      // ResolveReplica turns it into node:N of a path per node before any arena is opened.
      return Internal("--numa replicate reached the page placement unresolved");
    case NumaPlacement::kNode: {
      if (std::find(allowed.begin(), allowed.end(), node) == allowed.end()) {
        const bool exists = std::find(present.begin(), present.end(), node) != present.end();
        return InvalidArgument(
            "--numa node:" + std::to_string(node) + ": " +
            (exists ? "this process may not allocate on node " + std::to_string(node) +
                          " (its cpuset's mems are " + platform::FormatNodeList(allowed) + ")"
                    : "no node " + std::to_string(node) + " with memory on this host (nodes " +
                          platform::FormatNodeList(present) + ")"));
      }
      if (allowed.size() <= 1) return p;  // the only node: first touch puts everything there
      p.policy = platform::MemPolicy::kBind;
      p.nodes = {node};
      return p;
    }
    case NumaPlacement::kAuto:
    case NumaPlacement::kInterleave:
      if (allowed.size() <= 1) return p;
      p.policy = platform::MemPolicy::kInterleave;
      p.nodes = allowed;
      p.required = placement == NumaPlacement::kInterleave;
      return p;
    case NumaPlacement::kLocal:
      return p;
  }
  return p;
}

}  // namespace expert_arena::pages
