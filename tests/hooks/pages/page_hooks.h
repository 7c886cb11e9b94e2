// What a test runs at the page code's fault-injection point (src/common/fault_points.h;
// never set in production, and not in libexpert_arena.so: tests/hooks).
#pragma once

#include <cstddef>
#include <functional>

namespace expert_arena::pages::test_hooks {

// Runs in a BackgroundPages worker before it makes piece `piece` (from several threads at
// once: the hook must be thread-safe).
void SetBeforePagePiece(std::function<void(size_t piece)> hook);

}  // namespace expert_arena::pages::test_hooks
