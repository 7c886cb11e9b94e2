#include "stream/segment_placement.h"

#include <algorithm>

#include "pages/page_placement.h"
#include "platform/numa.h"

namespace expert_arena::stream {

Result<SegmentPlacement> ResolveSegmentPlacement(NumaPlacement numa, int node,
                                                 const std::vector<int>& cpu_nodes,
                                                 const std::vector<int>& allowed,
                                                 const std::vector<int>& present) {
  SegmentPlacement out;
  const int only = allowed.size() == 1 ? allowed[0] : -1;
  switch (numa) {
    case NumaPlacement::kReplicate:
      return InvalidArgument(
          "stream numa replicate: a stream has no replica per node; use auto (the producer's "
          "node), local, interleave or node:N");
    case NumaPlacement::kNode: {
      if (node < 0) return InvalidArgument("stream numa node:N without a node number");
      auto p = pages::ResolvePlacement(numa, node, allowed, present);
      if (!p.ok()) return p.status().WithContext("stream producer");
      out.pages = std::move(p).value();
      out.node = node;
      out.description = "node:" + std::to_string(node);
      return out;
    }
    case NumaPlacement::kInterleave: {
      auto p = pages::ResolvePlacement(numa, node, allowed, present);
      if (!p.ok()) return p.status().WithContext("stream producer");
      out.pages = std::move(p).value();
      out.node = only;
      out.description = only >= 0 ? "interleave (one node: node " + std::to_string(only) + ")"
                                  : "interleave over nodes " + platform::FormatNodeList(allowed);
      return out;
    }
    case NumaPlacement::kLocal:
      out.pages.asked = "local";
      out.node = only;
      out.description = only >= 0 ? "local (first touch, node " + std::to_string(only) + ")"
                                  : "local (first touch)";
      return out;
    case NumaPlacement::kAuto:
      break;
  }
  out.pages.asked = "auto";
  out.pages.required = false;
  if (only >= 0) {
    out.node = only;
    out.description = "node:" + std::to_string(only) + " (the producer's node, the only one)";
    return out;
  }
  std::vector<int> mine;
  for (int n : cpu_nodes) {
    if (std::find(allowed.begin(), allowed.end(), n) != allowed.end()) mine.push_back(n);
  }
  if (mine.size() != 1) {
    out.description =
        mine.empty() ? "local (first touch: the producer's node is unknown)"
                     : "local (first touch: the producer's CPUs span nodes " +
                           platform::FormatNodeList(mine) + "; pin it to one node or use node:N)";
    return out;
  }
  out.node = mine[0];
  out.pages.policy = platform::MemPolicy::kBind;
  out.pages.nodes = {mine[0]};
  out.description = "node:" + std::to_string(mine[0]) + " (the producer's node)";
  return out;
}

Result<SegmentPlacement> ResolveSegmentPlacement(NumaPlacement numa, int node) {
  return ResolveSegmentPlacement(numa, node, platform::NodesOfCurrentCpus(),
                                 platform::AllowedMemoryNodes(), platform::MemoryNodes());
}

}  // namespace expert_arena::stream
