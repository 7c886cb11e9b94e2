// Host-memory registration with a GPU runtime, so that copies from the arena to the device
// are DMA from pinned pages. Backends: CUDA, HIP, none.
//
// A registration is split into chunks (1 GiB by default): drivers refuse single
// registrations past some size when the range is on 4 KiB pages, and chunks let two threads
// register at once. A process-wide pin budget bounds the bytes all registrations of this
// process hold together; what lies beyond it is skipped and reported, never an error.
//
// Thread-safety: RegisterHostRange may be called from any thread. A Registration is a
// move-only owner; its destructor unregisters the range and must run before the range is
// unmapped (Arena::Impl declares it after the mapping for that reason).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expert_arena/gpu.h"
#include "expert_arena/status.h"

namespace spdlog {
class logger;
}

namespace expert_arena::gpu {

using Backend = GpuBackend;
using DeviceSpec = GpuDevice;

struct RegisterOptions {
  GpuDevice device;                // none: nothing is registered
  uint64_t pin_budget_bytes = 0;  // 0: no bound; accounted across the whole process
  uint64_t chunk_bytes = 1ull << 30;  // rounded up to a multiple of 2 MiB
  int threads = 2;                // threads that register (and unregister) chunks
  // The range is mapped PROT_READ: CUDA then needs cudaHostRegisterReadOnly, which some GPUs
  // do not support (the arena maps writable when a GPU is asked for, so this is rare).
  bool read_only = false;
  std::shared_ptr<spdlog::logger> logger;  // null: the "expert_arena" logger
};

// The outcome, for the start line.
struct RegistrationReport {
  std::string backend = "none";  // "none", "cuda", "hip"
  std::string device;            // "cuda:0", or "" for none
  uint64_t requested_bytes = 0;
  uint64_t registered_bytes = 0;  // 0 when skipped
  uint64_t chunk_bytes = 0;
  size_t chunks = 0;
  int threads = 0;
  double seconds = 0;
  uint64_t vmpin_before = 0;     // VmPin of this process before and after, bytes
  uint64_t vmpin_after = 0;
  // One line, self-contained: what happened or why it was skipped, and what VmPin says.
  std::string note;
};

class Registration {
 public:
  virtual ~Registration() = default;
  virtual const RegistrationReport& report() const = 0;
};

// Registers `range` (already populated, page-aligned) with the device named in options.
// - "none" (or ""): a Registration that registered nothing.
// - No usable device or driver, or the pin budget used up: not an error; the Registration's
//   report has registered_bytes 0 and a note that says why in one line (e.g. "cuda: no usable
//   device: cudaErrorInsufficientDriver (35): ...").
// - Errors: a bad device name (InvalidArgument), a backend not built in (Unsupported), a
//   runtime call that failed part-way (IoError naming the call, the chunk and the runtime's
//   error; chunks registered before it are unregistered first).
Result<std::unique_ptr<Registration>> RegisterHostRange(std::span<std::byte> range,
                                                        const RegisterOptions& options);

// Bytes this process holds registered through RegisterHostRange now (all registrations).
uint64_t ProcessRegisteredBytes();

// The address of the process-wide pin budget's counter (remote/core_identity.h).
const void* PinBudgetAddress();

// ---- The pin budget, exposed for tests ---------------------------------------------------
// Reserves up to `want` bytes of the process-wide budget `budget` (0: unbounded), in whole
// multiples of `granule` bytes; returns the bytes reserved (possibly 0).
uint64_t ReservePinBudget(uint64_t want, uint64_t budget, uint64_t granule);
void ReleasePinBudget(uint64_t bytes);

}  // namespace expert_arena::gpu
