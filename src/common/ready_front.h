// A front that moves forward through a region as its pages are made: bytes [0, ready) may be
// written, the rest not yet. One side (the page maker) advances it; the other (the loader)
// waits for the range it is about to write. When the maker fails, the front stops with that
// error and every waiter gets it.
//
// Thread-safety: all members may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "expert_arena/status.h"

namespace expert_arena {

class ReadyFront {
 public:
  // Moves the front to `ready` (never back) and wakes the waiters.
  void Advance(uint64_t ready) {
    {
      std::lock_guard lock(mu_);
      if (ready <= ready_) return;
      ready_ = ready;
    }
    cv_.notify_all();
  }

  // Stops the front for good: waiters for bytes past it get `error`.
  void Fail(Status error) {
    {
      std::lock_guard lock(mu_);
      if (failed_) return;
      failed_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }

  // Blocks until [0, end) may be written; the maker's error if it failed first. Returns at
  // once when the range is already ready.
  Status WaitFor(uint64_t end) const {
    std::unique_lock lock(mu_);
    if (ready_ < end && !failed_) ++waits_;
    cv_.wait(lock, [&] { return ready_ >= end || failed_; });
    if (ready_ >= end) return Status::Ok();
    return error_;
  }

  uint64_t ready() const {
    std::lock_guard lock(mu_);
    return ready_;
  }

  // How many WaitFor calls found their range not ready yet and blocked.
  uint64_t waits() const {
    std::lock_guard lock(mu_);
    return waits_;
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  uint64_t ready_ = 0;
  mutable uint64_t waits_ = 0;
  bool failed_ = false;
  Status error_;
};

}  // namespace expert_arena
