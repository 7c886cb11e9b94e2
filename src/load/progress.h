// A progress line on a terminal for long loads: bytes, GiB/s and the time left, redrawn in
// place on stderr a few times a second. Nothing is printed for loads under a second or when
// stderr is not a terminal.
//
// Thread-safety: the counter is read from the progress thread; Stop() (or the destructor)
// joins it and erases the line.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace expert_arena::load {

class ProgressLine {
 public:
  // Starts drawing when `enabled` and stderr is a terminal; `done` counts bytes in place.
  ProgressLine(bool enabled, uint64_t total_bytes, const std::atomic<uint64_t>* done);
  ~ProgressLine();
  void Stop();

 private:
  void Run();

  uint64_t total_;
  const std::atomic<uint64_t>* done_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace expert_arena::load
