// A GPU device by name: which backend (CUDA or HIP) and which of its devices. Options name
// the device an arena or a stream segment is registered with (ArenaOptions::gpu); gpu.h has
// the copies to it.
#pragma once

#include <string>
#include <string_view>

#include "expert_arena/export.h"
#include "expert_arena/status.h"

namespace expert_arena {

enum class GpuBackend { kNone, kCuda, kHip };
EXPERT_ARENA_EXPORT const char* GpuBackendName(GpuBackend backend);

struct GpuDevice {
  GpuBackend backend = GpuBackend::kNone;
  int index = 0;
  // "cuda:0", "hip:1", "none".
  EXPERT_ARENA_EXPORT std::string ToString() const;
  bool operator==(const GpuDevice&) const = default;
};

// "none" (or ""), "cuda", "cuda:N", "hip", "hip:N" (N a decimal device index; "cuda" is
// "cuda:0"). Anything else is InvalidArgument naming the text.
EXPERT_ARENA_EXPORT Result<GpuDevice> ParseGpuDevice(std::string_view spec);

}  // namespace expert_arena
