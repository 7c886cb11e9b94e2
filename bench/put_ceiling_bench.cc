// How close a large Put is to the fastest copy this machine can make (docs/streaming.md,
// the 1 x 64 MiB shape). A 64 MiB stream round is one Put: the library's copy of
// the tensor into a segment, then a publish of a few bytes. So the round can be no faster than
// the fastest way to move 64 MiB from private memory into a segment's 2 MiB pages; this
// measures those ways against the Put itself, all into the same reservation of a real segment,
// interleaved round by round so that the machine's noise hits all alike:
//
//   glibc memcpy         ordinary stores (each destination line is read for ownership first)
//   streaming stores     platform::CopyNonTemporal, what Put uses from non_temporal_copy_from
//   rep movsb            the CPU's string copy (x86-64 only)
//   Put + Abort          the library's whole put of the tensor (another key), then its free
//   Put after memcpy     the same right after a 64 MiB glibc memcpy into private memory, which
//                        leaves the cache full of dirty lines for the put to write back
//
// Usage: flock /tmp/expert-arena-bench.lock build/bin/put_ceiling_bench [--dir /dev/shm]
//            [--mib N (default 64)] [--rounds N (default 40)]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/units.h"
#include "expert_arena/stream.h"
#include "platform/memory_copy.h"

namespace {

using Clock = std::chrono::steady_clock;
using expert_arena::StreamOptions;
using expert_arena::StreamProducer;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

void RepMovsb(void* to, const void* from, size_t bytes) {
#if defined(__x86_64__)
  asm volatile("rep movsb" : "+D"(to), "+S"(from), "+c"(bytes) : : "memory");
#else
  std::memcpy(to, from, bytes);
#endif
}

struct Case {
  const char* name;
  std::function<bool()> run;
  std::vector<double> seconds;
};

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/dev/shm";
  uint64_t mib = 64;
  int rounds = 40;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--dir") dir = argv[i + 1];
    if (a == "--mib") mib = std::max<uint64_t>(1, std::strtoull(argv[i + 1], nullptr, 10));
    if (a == "--rounds") rounds = std::max(3, std::atoi(argv[i + 1]));
  }
  const uint64_t bytes = mib << 20;

  StreamOptions o;
  o.directory = dir;
  o.spill_directory = dir;
  o.logical_name = "benchceiling";
  // Two tensors' worth per segment: the held reservation the plain copies go into, and the
  // Put's block.
  o.segment_bytes = *expert_arena::AlignUp(2 * bytes, expert_arena::kHugePageBytes);
  o.max_segments = 1;
  o.strict = true;  // never a spill file: the put must land in the segment or fail
  auto producer = StreamProducer::Create(o);
  if (!producer.ok()) {
    std::fprintf(stderr, "%s\n", producer.status().ToString().c_str());
    return 1;
  }
  auto target = producer->Reserve("copies", bytes);
  if (!target.ok()) {
    std::fprintf(stderr, "%s\n", target.status().ToString().c_str());
    return 1;
  }
  std::byte* to = target->bytes().data();

  std::vector<std::byte> source(bytes);
  std::mt19937_64 rng(1);
  for (size_t i = 0; i + 8 <= source.size(); i += 8) {
    uint64_t v = rng();
    std::memcpy(source.data() + i, &v, 8);
  }
  std::vector<std::byte> scratch(bytes);
  std::memset(scratch.data(), 0, scratch.size());
  std::memset(to, 0, bytes);

  auto put = [&] {
    auto d = producer->Put("put", std::span(source.data(), bytes), {"u8", {bytes}});
    if (!d.ok()) {
      std::fprintf(stderr, "%s\n", d.status().ToString().c_str());
      return false;
    }
    return producer->Abort("put").ok();
  };
  std::vector<Case> cases = {
      {"glibc memcpy", [&] { return std::memcpy(to, source.data(), bytes) != nullptr; }, {}},
      {"streaming stores (CopyNonTemporal)",
       [&] {
         expert_arena::platform::CopyNonTemporal(to, source.data(), bytes);
         return true;
       },
       {}},
      {"rep movsb",
       [&] {
         RepMovsb(to, source.data(), bytes);
         return true;
       },
       {}},
      {"Put + Abort", put, {}},
  };
  std::vector<double> after_memcpy;
  for (int r = 0; r < rounds + 3; ++r) {
    // Rotate the order so that no case always follows the same one.
    for (size_t k = 0; k < cases.size(); ++k) {
      Case& c = cases[(k + static_cast<size_t>(r)) % cases.size()];
      auto t0 = Clock::now();
      if (!c.run()) return 1;
      auto t1 = Clock::now();
      if (r >= 3) c.seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    std::memcpy(scratch.data(), source.data(), bytes);
    auto t0 = Clock::now();
    if (!put()) return 1;
    auto t1 = Clock::now();
    if (r >= 3) after_memcpy.push_back(std::chrono::duration<double>(t1 - t0).count());
  }

  double fastest = 1e30;
  for (const Case& c : cases) {
    if (std::string(c.name) != "Put + Abort") fastest = std::min(fastest, Median(c.seconds));
  }
  std::printf("%llu MiB from private memory into a held reservation of a %s segment, %d rounds\n\n",
              static_cast<unsigned long long>(mib), dir.c_str(), rounds);
  std::printf("| copy | median | p10 | p90 | GB/s | fastest copy / this |\n|---|---|---|---|---|---|\n");
  auto row = [&](const char* name, const std::vector<double>& s) {
    double m = Median(s);
    std::printf("| %s | %.0f us | %.0f us | %.0f us | %.1f | %.2f |\n", name, m * 1e6,
                Percentile(s, 0.1) * 1e6, Percentile(s, 0.9) * 1e6,
                static_cast<double>(bytes) / m / 1e9, fastest / m);
  };
  for (const Case& c : cases) row(c.name, c.seconds);
  row("Put + Abort right after a memcpy into private memory", after_memcpy);
  return 0;
}
