// Where a stream producer's segments live on a host with several NUMA nodes (docs/numa.md):
// StreamOptions::numa resolved once, at StreamProducer::Create, into the page placement every
// segment it makes is created with (pages/page_backing.h places the pages before the first
// one exists, whichever thread makes the segment: a put or the grow-ahead thread).
#pragma once

#include <string>
#include <vector>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"
#include "pages/page_placement.h"

namespace expert_arena::stream {

struct SegmentPlacement {
  pages::PagePlacement pages;  // kDefault: first touch
  int node = -1;               // the node every segment is on; -1: interleaved or first touch
  std::string description;     // for the start line and StreamStats::numa
};

// `numa`/`node` (StreamOptions::numa, numa_node) for a producer whose CPU affinity covers
// `cpu_nodes` (platform::NodesOfCurrentCpus), allowed to allocate on `allowed` of `present`:
// - kAuto (the default): bound to the producer's own node when its CPUs are on one allowed
//   node; first touch when they span several (nothing tells which is its own) or are unknown.
//   Not required: a kernel that refuses the policy (a container without CAP_SYS_NICE) leaves
//   first touch, which for a pinned producer lands on the same node.
// - kLocal: first touch, by whichever thread makes the segment.
// - kInterleave: over `allowed`; kNode: bound to `node`, refused (kInvalidArgument) when not
//   one of `allowed`, naming what is.
// - kReplicate: kInvalidArgument (a stream is not copied per node).
// On a host with one allowed node every form is first touch, and `node` is that node.
Result<SegmentPlacement> ResolveSegmentPlacement(NumaPlacement numa, int node,
                                                 const std::vector<int>& cpu_nodes,
                                                 const std::vector<int>& allowed,
                                                 const std::vector<int>& present);
// ResolveSegmentPlacement for the calling thread on this host.
Result<SegmentPlacement> ResolveSegmentPlacement(NumaPlacement numa, int node);

}  // namespace expert_arena::stream
