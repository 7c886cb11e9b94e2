// Progress of long loads: bytes, GiB/s and the time left. Without an engine's logger, a line
// redrawn in place on stderr a few times a second when stderr is a terminal; with one, an info
// message through that logger every 10 s (an engine's log is not a terminal to redraw).
// Nothing is printed for loads under a second.
//
// Thread-safety: the counter is read from the progress thread; Stop() (or the destructor)
// joins it and erases the line.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace spdlog {
class logger;
}

namespace expert_arena::load {

class ProgressLine {
 public:
  // Starts when `enabled` and either `engine_logger` is given or stderr is a terminal; `done`
  // counts bytes in place.
  // `log_period_ms` spaces the messages through the engine's logger.
  ProgressLine(bool enabled, uint64_t total_bytes, const std::atomic<uint64_t>* done,
               spdlog::logger* engine_logger = nullptr, int log_period_ms = 10000);
  ~ProgressLine();
  void Stop();

 private:
  void Run();

  uint64_t total_;
  const std::atomic<uint64_t>* done_;
  spdlog::logger* log_;
  int log_period_ms_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace expert_arena::load
