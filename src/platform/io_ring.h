// io_uring through liburing: one ring per thread, reads only, -errno results turned into
// Status at the edge (liburing's convention inside, ours outside).
//
// Rings can be unavailable although the kernel has io_uring: kernel.io_uring_disabled (6.6)
// set to 2 (or 1 for users outside io_uring_group), a seccomp filter (containers), or an old
// kernel. Create() then fails with kUnsupported and a message that says which, so the loader
// can fall back to pread and say why.
//
// Thread-safety: an IoRing is used by one thread at a time; it is move-only.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "expert_arena/status.h"

struct io_uring;

namespace expert_arena::platform {

struct IoCompletion {
  uint64_t user_data = 0;
  int32_t result = 0;  // bytes read, or -errno
};

class IoRing {
 public:
  // A ring with `entries` submission slots (rounded up to a power of two by the kernel).
  static Result<IoRing> Create(unsigned entries);

  IoRing(IoRing&& other) noexcept;
  IoRing& operator=(IoRing&& other) noexcept;
  IoRing(const IoRing&) = delete;
  IoRing& operator=(const IoRing&) = delete;
  ~IoRing();

  // Queues a read of `bytes` at `offset` of fd into buffer; false when the queue is full.
  bool QueueRead(int fd, void* buffer, uint32_t bytes, uint64_t offset, uint64_t user_data);
  // Submits what was queued. Buffered reads of cached pages are copied during this call. On
  // failure what the kernel did not take stays queued (Queued()); the kernel still holds, and
  // writes into their buffers, the reads earlier calls submitted.
  Status Submit();
  // Requests queued and not yet taken by the kernel (a failed or not yet called Submit).
  unsigned Queued() const;
  // Queues a request that cancels every request the kernel holds (IORING_ASYNC_CANCEL_ANY,
  // Linux 5.19; older kernels complete it with -EINVAL and cancel nothing); its completion
  // carries `user_data`. false when the queue is full. A cancelled read completes with
  // -ECANCELED; one already under way completes as usual: the caller still waits for them all.
  bool QueueCancelAll(uint64_t user_data);
  // Waits for one completion and consumes it.
  Result<IoCompletion> WaitOne();

 private:
  IoRing();
  std::unique_ptr<io_uring> ring_;
};

}  // namespace expert_arena::platform
