// /proc/meminfo, for sizing work to what the machine can hold.
#pragma once

#include <cstdint>

#include "expert_arena/status.h"

namespace expert_arena::platform {

// MemAvailable (bytes): what can be allocated without swapping, per the kernel's estimate.
Result<uint64_t> AvailableMemoryBytes();

}  // namespace expert_arena::platform
