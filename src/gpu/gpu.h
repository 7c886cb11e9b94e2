// Host-memory registration with a GPU runtime, so that copies from the arena to the device
// are DMA from pinned pages. Backends: CUDA, HIP, none.
//
// Thread-safety: a Registration is move-only; its destructor unregisters the range, and must
// run before the range is unmapped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "expert_arena/status.h"

namespace spdlog {
class logger;
}

namespace expert_arena::gpu {

struct RegisterOptions {
  std::string device = "none";  // "none", "cuda[:N]", "hip[:N]"
  uint64_t pin_budget_bytes = 0;  // 0: no bound
};

// The outcome, for the start line.
struct RegistrationReport {
  std::string backend;    // "none", "cuda", "hip"
  uint64_t registered_bytes = 0;
  double seconds = 0;
  std::string note;       // one line: what happened or why it was skipped
};

class Registration {
 public:
  virtual ~Registration() = default;
  virtual const RegistrationReport& report() const = 0;
};

// Registers `range` (already populated) with the device named in options. A missing device or
// driver is not an error: the result carries a Registration whose report says why nothing was
// registered. An error is returned only for a bad device name, or a backend not built in.
Result<std::unique_ptr<Registration>> RegisterHostRange(std::span<std::byte> range,
                                                        const RegisterOptions& options);

}  // namespace expert_arena::gpu
