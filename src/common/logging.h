// The library's logger: the one the engine passed in ArenaOptions, else a shared
// "expert_arena" logger on stderr.
#pragma once

#include <spdlog/spdlog.h>

#include <memory>

namespace expert_arena {

std::shared_ptr<spdlog::logger> ResolveLogger(const std::shared_ptr<spdlog::logger>& given);

}  // namespace expert_arena
