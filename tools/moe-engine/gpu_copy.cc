#include "gpu_copy.h"

namespace expert_arena::moe {

GpuCopyReport CopyUsedExpertsToDevice(const Arena& arena, const ExpertTable& table,
                                      const std::vector<uint32_t>& expert_hits,
                                      const std::string& requested) {
  GpuCopyReport report;
  if (requested.empty() || requested == "none") return report;
  const ArenaReport& r = arena.report();
  if (r.gpu_registered_bytes == 0) {
    report.note = "no device copy (" + (r.gpu_note.empty() ? std::string("not registered")
                                                            : r.gpu_note) +
                  "); the experts are computed on the CPU";
    return report;
  }
  uint64_t used_bytes = 0;
  for (uint64_t l = 0; l < table.layers(); ++l) {
    for (uint64_t e = 0; e < table.experts(); ++e) {
      if (expert_hits[l * table.experts() + e] > 0) used_bytes += table.ExpertBytes(l, e);
    }
  }
  report.note = "arena registered, but this build has no device copy helper; " +
                std::to_string(used_bytes) + " bytes of used experts stay on the CPU";
  return report;
}

}  // namespace expert_arena::moe
