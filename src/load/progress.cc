#include "load/progress.h"

#include <chrono>
#include <cstdio>

#include <spdlog/spdlog.h>

#include "common/units.h"
#include "platform/file_cache.h"

namespace expert_arena::load {

ProgressLine::ProgressLine(bool enabled, uint64_t total_bytes, const std::atomic<uint64_t>* done,
                           spdlog::logger* engine_logger, int log_period_ms)
    : total_(total_bytes), done_(done), log_(engine_logger), log_period_ms_(log_period_ms) {
  if (enabled && (log_ != nullptr || platform::StderrIsTerminal())) {
    thread_ = std::thread([this] { Run(); });
  }
}

ProgressLine::~ProgressLine() { Stop(); }

void ProgressLine::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ProgressLine::Run() {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto period = std::chrono::milliseconds(log_ != nullptr ? log_period_ms_ : 250);
  bool drawn = false;
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait_for(lock, period, [this] { return stop_; });
    if (stop_) break;
    double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    if (elapsed < 1.0) continue;
    uint64_t done = done_->load(std::memory_order_relaxed);
    double rate = static_cast<double>(done) / elapsed;
    double left = rate > 0 ? static_cast<double>(total_ - std::min(done, total_)) / rate : 0;
    if (log_ != nullptr) {
      log_->info("expert-arena: loading {:.2f} / {:.2f} GiB, {:.2f} GiB/s, {:.0f} s left",
                 static_cast<double>(done) / kGiB, static_cast<double>(total_) / kGiB,
                 rate / kGiB, left);
      continue;
    }
    std::fprintf(stderr, "\rexpert-arena: loading %.2f / %.2f GiB, %.2f GiB/s, %.0f s left   ",
                 static_cast<double>(done) / kGiB, static_cast<double>(total_) / kGiB, rate / kGiB,
                 left);
    std::fflush(stderr);
    drawn = true;
  }
  if (drawn) {
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
  }
}

}  // namespace expert_arena::load
