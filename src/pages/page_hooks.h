// Fault-injection point of the page code for tests (never set in production).
#pragma once

#include <cstddef>
#include <functional>

namespace expert_arena::pages::test_hooks {

// Runs in a BackgroundPages worker before it makes piece `piece` (from several threads at
// once: the hook must be thread-safe).
void SetBeforePagePiece(std::function<void(size_t piece)> hook);
void RunBeforePagePiece(size_t piece);

}  // namespace expert_arena::pages::test_hooks
