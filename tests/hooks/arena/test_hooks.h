// What a test runs at the arena code's fault-injection points (src/common/fault_points.h;
// never set in production, and not in libexpert_arena.so: tests/hooks). A hook runs in the
// loading process at a named point of the protocol; a test's child role sets it to announce
// itself and sleep, so the parent can start a rival engine or SIGKILL the loader at exactly
// that point.
#pragma once

#include <cstddef>
#include <functional>

namespace expert_arena::arena::test_hooks {

// Runs after the data is loaded and checked, just before the header is published.
void SetBeforePublish(std::function<void()> hook);

// Runs in RemoveArenaFile after it opened the file, before it takes the locks (where an
// engine may replace the file under it).
void SetAfterRemoveOpened(std::function<void()> hook);

// How many times this process planned a model for a shared arena (an engine that attaches
// through the fingerprint plans nothing).
size_t PlansMade();

}  // namespace expert_arena::arena::test_hooks
