// The `numa` object of the tools' --json output (docs/numa.md): the placement asked for, the
// kernel's policy for the mapping, and this mapping's bytes on each node (empty on a one-node
// host).
#pragma once

#include <nlohmann/json.hpp>

#include "expert_arena/arena.h"

namespace expert_arena::tools {

inline nlohmann::json NumaJson(const ArenaReport& r) {
  nlohmann::json n;
  n["placement"] = r.numa;
  n["policy"] = r.numa_policy;
  n["note"] = r.numa_note;
  n["nodes"] = nlohmann::json::array();
  for (const NumaNodeBytes& b : r.numa_nodes) {
    n["nodes"].push_back({{"node", b.node}, {"bytes", b.bytes}});
  }
  return n;
}

}  // namespace expert_arena::tools
