#include "platform/memory_copy.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace expert_arena::platform {

namespace {

// "32768K" / "1M" / "512" as sysfs writes cache sizes.
uint64_t ParseCacheSize(const std::string& text) {
  char* end = nullptr;
  uint64_t value = std::strtoull(text.c_str(), &end, 10);
  if (end == text.c_str()) return 0;
  char unit = *end;
  if (unit == 'K') return value << 10;
  if (unit == 'M') return value << 20;
  if (unit == 'G') return value << 30;
  return value;
}

uint64_t ReadLastLevelCacheBytes() {
  int best_level = 0;
  uint64_t best_bytes = 0;
  for (int i = 0; i < 16; ++i) {
    std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_file(dir + "level");
    std::ifstream size_file(dir + "size");
    int level = 0;
    std::string size;
    if (!(level_file >> level) || !(size_file >> size)) continue;
    uint64_t bytes = ParseCacheSize(size);
    if (level > best_level || (level == best_level && bytes > best_bytes)) {
      best_level = level;
      best_bytes = bytes;
    }
  }
  return best_bytes;
}

#if defined(__x86_64__)
// 128 bytes per step: four loads, then four streaming stores. `to` is 32-byte aligned.
__attribute__((target("avx2"))) void StreamAvx2(std::byte* to, const std::byte* from,
                                                size_t bytes) {
  for (size_t i = 0; i < bytes; i += 128) {
    auto* s = reinterpret_cast<const __m256i*>(from + i);
    auto* d = reinterpret_cast<__m256i*>(to + i);
    __m256i a = _mm256_loadu_si256(s);
    __m256i b = _mm256_loadu_si256(s + 1);
    __m256i c = _mm256_loadu_si256(s + 2);
    __m256i e = _mm256_loadu_si256(s + 3);
    _mm256_stream_si256(d, a);
    _mm256_stream_si256(d + 1, b);
    _mm256_stream_si256(d + 2, c);
    _mm256_stream_si256(d + 3, e);
  }
}

// Four 4 KiB pages at once, 128 bytes of each per step, with the next step's lines of each
// page prefetched: what glibc's memcpy does above its non-temporal threshold (its
// large_memcpy_4x), which keeps four DRAM pages open and the prefetchers on four streams. A
// warm 2 GiB copy on two threads of the development VM took 0.09 s so, 0.12 s streaming one
// page after the other, as glibc's 1 GiB memcpy took (bench/results/2026-12-05-vm/
// load_ceiling.txt). `bytes` is a multiple of 16 KiB and `to` is 32-byte aligned.
__attribute__((target("avx2"))) void StreamFourPagesAvx2(std::byte* to, const std::byte* from,
                                                         size_t bytes) {
  constexpr size_t kPage = 4096, kStep = 128;
  for (size_t group = 0; group < bytes; group += 4 * kPage) {
    const std::byte* s = from + group;
    std::byte* d = to + group;
    for (size_t at = 0; at < kPage; at += kStep) {
      __m256i v[16];
      for (int p = 0; p < 4; ++p) {
        // prefetcht0 (_mm_prefetch's hint is not a constant to GCC without optimization).
        __builtin_prefetch(s + p * kPage + at + kStep, 0, 3);
        __builtin_prefetch(s + p * kPage + at + kStep + 64, 0, 3);
        for (int k = 0; k < 4; ++k) {
          v[p * 4 + k] =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + p * kPage + at + k * 32));
        }
      }
      for (int p = 0; p < 4; ++p) {
        for (int k = 0; k < 4; ++k) {
          _mm256_stream_si256(reinterpret_cast<__m256i*>(d + p * kPage + at + k * 32),
                              v[p * 4 + k]);
        }
      }
    }
  }
}

// The same with SSE2 (every x86-64 CPU has it). `to` is 16-byte aligned.
void StreamSse2(std::byte* to, const std::byte* from, size_t bytes) {
  for (size_t i = 0; i < bytes; i += 64) {
    auto* s = reinterpret_cast<const __m128i*>(from + i);
    auto* d = reinterpret_cast<__m128i*>(to + i);
    __m128i a = _mm_loadu_si128(s);
    __m128i b = _mm_loadu_si128(s + 1);
    __m128i c = _mm_loadu_si128(s + 2);
    __m128i e = _mm_loadu_si128(s + 3);
    _mm_stream_si128(d, a);
    _mm_stream_si128(d + 1, b);
    _mm_stream_si128(d + 2, c);
    _mm_stream_si128(d + 3, e);
  }
}
#endif

}  // namespace

uint64_t LastLevelCacheBytes() {
  static const uint64_t bytes = ReadLastLevelCacheBytes();
  return bytes;
}

void CopyNonTemporal(void* to, const void* from, size_t bytes) {
#if defined(__x86_64__)
  constexpr size_t kStep = 128;
  auto* d = static_cast<std::byte*>(to);
  auto* s = static_cast<const std::byte*>(from);
  // Ordinary stores up to the first 64-byte boundary of the destination (a cache line), so the
  // streaming stores write whole, aligned lines.
  size_t head = std::min(bytes, (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  size_t body = bytes / kStep * kStep;
  if (body > 0) {
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2) {
      constexpr size_t kFourPages = 4 * 4096;
      const size_t grouped = body / kFourPages * kFourPages;
      StreamFourPagesAvx2(d, s, grouped);
      StreamAvx2(d + grouped, s + grouped, body - grouped);
    } else {
      StreamSse2(d, s, body);
    }
    // Streaming stores are weakly ordered: fence them before anything publishes the bytes.
    _mm_sfence();
  }
  std::memcpy(d + body, s + body, bytes - body);
#else
  std::memcpy(to, from, bytes);
#endif
}

}  // namespace expert_arena::platform
