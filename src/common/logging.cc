#include "common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace expert_arena {

std::shared_ptr<spdlog::logger> ResolveLogger(const std::shared_ptr<spdlog::logger>& given) {
  if (given) return given;
  static std::shared_ptr<spdlog::logger> fallback = [] {
    auto existing = spdlog::get("expert_arena");
    if (existing) return existing;
    auto logger = spdlog::stderr_color_mt("expert_arena");
    logger->set_pattern("%v");
    return logger;
  }();
  return fallback;
}

}  // namespace expert_arena
