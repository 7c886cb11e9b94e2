// Device copies of the experts a run used, from the registered arena.
//
// moe-engine computes on the CPU; with a GPU build and a device it also copies every expert
// that the run routed to at least once from the arena (registered, so the copy is DMA) to
// device memory, the way an engine that keeps experts in host RAM would stream them, and
// reports the bytes and the rate. Without a device the report says why in one line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "expert_arena/arena.h"
#include "expert_table.h"

namespace expert_arena::moe {

struct GpuCopyReport {
  uint64_t copied_bytes = 0;
  double seconds = 0;
  bool verified = false;  // a read-back of the device copy equals the arena's bytes
  std::string note;       // one line; empty when no device was asked for
};

// `requested` is the --gpu value; `expert_hits` comes from RunForward. Never fails: a
// missing device or a failed copy is reported in the note.
GpuCopyReport CopyUsedExpertsToDevice(const Arena& arena, const ExpertTable& table,
                                      const std::vector<uint32_t>& expert_hits,
                                      const std::string& requested);

}  // namespace expert_arena::moe
