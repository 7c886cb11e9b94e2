// The `kernel` object of the tools' --json output: what this kernel (or its seccomp filter)
// lacks of what expert-arena can use, and what its fallbacks cost (docs/kernels.md).
#pragma once

#include <nlohmann/json.hpp>

#include "expert_arena/arena.h"
#include "platform/kernel_features.h"

namespace expert_arena::tools {

// From an arena's report: the costs are those of its Open().
inline nlohmann::json KernelJson(const ArenaReport& r) {
  nlohmann::json k;
  k["release"] = r.kernel_release;
  k["note"] = r.kernel_note;
  k["missing"] = nlohmann::json::array();
  for (const KernelFallbackReport& m : r.kernel_missing) {
    k["missing"].push_back({{"feature", m.feature},
                            {"since", m.since},
                            {"answer", m.answer},
                            {"fallback", m.fallback},
                            {"used", m.used},
                            {"seconds", m.seconds},
                            {"bytes", m.bytes}});
  }
  return k;
}

// For this process so far (expert-arena info): every feature it lacks, with what the
// fallbacks cost since the process started.
inline nlohmann::json KernelJsonNow() {
  const platform::FallbackLedger zero{};
  nlohmann::json k;
  k["release"] = platform::Kernel().release;
  const auto missing = platform::MissingFeatures(zero, /*probe_all=*/true);
  k["note"] = platform::KernelNote(missing);
  k["missing"] = nlohmann::json::array();
  for (const platform::MissingFeature& m : missing) {
    k["missing"].push_back({{"feature", m.name},
                            {"since", m.since},
                            {"answer", m.answer},
                            {"fallback", m.fallback},
                            {"used", m.cost.calls > 0},
                            {"seconds", m.cost.seconds},
                            {"bytes", m.cost.bytes}});
  }
  return k;
}

}  // namespace expert_arena::tools
