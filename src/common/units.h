// Byte-size constants and formatting shared by every layer.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

namespace expert_arena {

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kGiB = 1024 * kMiB;
inline constexpr uint64_t kHugePageBytes = 2 * kMiB;

// Rounds up to a multiple of `align` (a power of two); nullopt on overflow.
inline std::optional<uint64_t> AlignUp(uint64_t value, uint64_t align) {
  uint64_t mask = align - 1;
  if (value > UINT64_MAX - mask) return std::nullopt;
  return (value + mask) & ~mask;
}

inline bool IsPowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

// "4.00 GiB", "512.0 MiB", "12 KiB", "17 B".
inline std::string FormatBytes(uint64_t bytes) {
  char buf[64];
  if (bytes >= kGiB) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / kGiB);
  } else if (bytes >= kMiB) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / kMiB);
  } else if (bytes >= kKiB) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(bytes) / kKiB);
  } else {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  }
  return buf;
}

// "1.25 s", "340 ms", "4.2 ms": small durations in milliseconds, so a fast attach never prints
// "0.00 s".
inline std::string FormatDuration(double seconds) {
  char buf[64];
  if (seconds >= 1) {
    std::snprintf(buf, sizeof buf, "%.2f s", seconds);
  } else if (seconds >= 0.01) {
    std::snprintf(buf, sizeof buf, "%.0f ms", seconds * 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f ms", seconds * 1e3);
  }
  return buf;
}

// A page size as the kernel's documentation names it: "4 KiB", "2 MiB", "1 GiB".
inline std::string FormatPageSize(uint64_t bytes) {
  if (bytes >= kGiB && bytes % kGiB == 0) return std::to_string(bytes / kGiB) + " GiB";
  if (bytes >= kMiB && bytes % kMiB == 0) return std::to_string(bytes / kMiB) + " MiB";
  return std::to_string(bytes / 1024) + " KiB";
}

// "2.10 GiB/s", "350.0 MiB/s": bytes per second in the unit FormatBytes would use.
inline std::string FormatRate(uint64_t bytes, double seconds) {
  if (seconds <= 0) return "-";
  return FormatBytes(static_cast<uint64_t>(static_cast<double>(bytes) / seconds)) + "/s";
}

}  // namespace expert_arena
