// NUMA placement of an arena's pages (docs/numa.md): the option resolved against the nodes this
// process may use, the room check for a bound node, and the per-node report.
//
// How the policy holds whoever touches a page first: on tmpfs the loader maps the sized,
// still empty file and sets the file's shared policy with mbind before any page exists, so
// fallocate, collapse workers, a later swap-in by another engine all follow it; on hugetlbfs
// the pages are all made by the loader's fallocate, run under a thread policy
// (set_mempolicy), and drawn from the per-node pools.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"
#include "pages/page_placement.h"
#include "platform/numa.h"

namespace expert_arena::arena {

using pages::PagePlacement;
using pages::ResolvePlacement;

// pages::ResolvePlacement of the options on this host.
Result<PagePlacement> ResolvePlacement(const ArenaOptions& options);

// `path` of node `node`'s replica: "/dev/shm/m.arena" -> "/dev/shm/m.node1.arena", a path
// without the .arena extension gets ".node1" appended.
std::string ReplicaPath(const std::string& path, int node);

// --numa replicate turned into the options of this engine's replica: its node is the GPU's
// (`gpu_node`, the PCI slot's node of the device it registers with) when that is one of
// `allowed`, else the one holding its CPUs (`cpu_node`); the path is ReplicaPath and the
// placement node:N. Other placements, a private arena (its own copy: first touch) and a host
// with one allowed node (the arena itself) come back as they are, replicate as local.
// kInvalidArgument when neither node is known. `*how` says which node was taken and why.
Result<ArenaOptions> ResolveReplica(const ArenaOptions& options, int gpu_node, int cpu_node,
                                    const std::vector<int>& allowed, std::string* how);

// Bound to one node: kNoSpace when `free_bytes` there is less than `bytes`, naming the node,
// what it has free and where that was read. OK for other policies.
Status CheckRoomOnNode(const PagePlacement& placement, uint64_t bytes, uint64_t free_bytes,
                       const std::string& free_source, const std::string& path);
// CheckRoomOnNode with this host's figures: on hugetlbfs the node's pool of `page_bytes`
// pages, elsewhere the node's free and reclaimable page cache.
Status CheckRoomOnNode(const PagePlacement& placement, bool hugetlbfs, uint64_t bytes,
                       uint64_t page_bytes, const std::string& path);

// Fills report.numa_policy and numa_nodes from /proc/self/numa_maps for the mapping at
// `start`, on a host with more than one memory node (nothing otherwise).
void MeasureNuma(const void* start, ArenaReport& report);

// "; numa: interleave, node0 1.00 GiB, node1 1.00 GiB (interleave:0-1)" for the start line; ""
// on a one-node host.
std::string NumaStartLinePart(const ArenaReport& report);

}  // namespace expert_arena::arena
