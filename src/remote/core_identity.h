// Which copy of the core a caller reaches: the addresses of the core's process-wide objects (the
// fork registry, the pin budget, the kernel-feature probe). One core per process
// (docs/building.md, "How the pieces link"): the Python module, the UCX plugin and the tools
// all link libexpert_arena.so, so each of them sees the same addresses; a part that carried its
// own copy of the core would see its own. A diagnostic for the tests
// (tests/python/test_one_core.py), through expert_arena._core_identity().
#pragma once

#include <cstdint>
#include <string>

#include "expert_arena/status.h"

namespace expert_arena::remote {

struct CoreIdentity {
  uintptr_t fork_registry = 0;    // stream/fork_guard.cc's registry of fork participants
  uintptr_t pin_budget = 0;       // gpu/registration.cc's process-wide registered bytes
  uintptr_t kernel_features = 0;  // platform::Kernel(), the kernel-feature probe
  std::string object;             // the file that holds the code that answered
};

// As seen from the caller's own link.
CoreIdentity ThisCoreIdentity();

// As seen from the UCX transport plugin (loading it if it is not loaded yet): the core it is
// linked to. kUnsupported when the plugin is not built or cannot be loaded.
Result<CoreIdentity> PluginCoreIdentity();

}  // namespace expert_arena::remote
