// What a test runs at the io_uring submit's fault-injection point (src/common/fault_points.h;
// never set in production, and not in libexpert_arena.so: tests/hooks).
#pragma once

#include <functional>

namespace expert_arena::platform::test_hooks {

// Runs before each io_uring submit of this process (from any reader thread): a negative errno
// fails that submit before the kernel takes anything, 0 lets it run. An empty hook: none.
void SetRingSubmit(std::function<int()> hook);

}  // namespace expert_arena::platform::test_hooks
