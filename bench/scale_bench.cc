// How the costs of a shared arena grow with the model's metadata (docs/scale.md): one
// measurement per run, printed as one JSON line; bench/scale_bench.sh makes the models (gen-model
// --layout deepseek-v3), runs each measurement in a fresh process and plots the figures.
//
//   scale_bench plan   --model M            PlanModel: seconds and peak heap (best of --runs)
//   scale_bench load   --model M --arena A  removes A, loads it: Open() seconds, load seconds,
//                                           and the same bytes copied by memcpy (the ceiling of
//                                           moving them) measured in the same process
//   scale_bench attach --model M --arena A  attaches (A must hold M): Open() seconds, heap
//                                           retained and peak, RSS beyond the mapping, Find
//
// Heap is counted by this program's operator new/delete (the library allocates through them),
// so "heap" here is C++ allocations: the library's own (xxhash states are malloc'd, 500 B).
#include <malloc.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <string>
#include <vector>

#include "expert_arena/arena.h"
#include "source/model_source.h"

namespace {

std::atomic<int64_t> g_heap{0};
std::atomic<int64_t> g_peak{0};

void Count(int64_t delta) {
  int64_t now = g_heap.fetch_add(delta, std::memory_order_relaxed) + delta;
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

}  // namespace

void* operator new(size_t n) {
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  Count(static_cast<int64_t>(malloc_usable_size(p)));
  return p;
}
void* operator new[](size_t n) { return operator new(n); }
void operator delete(void* p) noexcept {
  if (p == nullptr) return;
  Count(-static_cast<int64_t>(malloc_usable_size(p)));
  std::free(p);
}
void operator delete[](void* p) noexcept { operator delete(p); }
void operator delete(void* p, size_t) noexcept { operator delete(p); }
void operator delete[](void* p, size_t) noexcept { operator delete(p); }

using namespace expert_arena;
using Clock = std::chrono::steady_clock;

namespace {

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void Check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "scale_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// VmRSS and RssFile (kB) from /proc/self/status.
uint64_t StatusKb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::strtoull(line.c_str() + std::strlen(key), nullptr, 10);
  }
  return 0;
}

// Seconds to copy `bytes` with memcpy between two pre-faulted buffers: the floor of moving
// a load's bytes once they are in memory. Measured on at most 256 MiB and scaled (two buffers
// of an 8 GiB load beside its arena would not fit the machine).
double CopySeconds(uint64_t bytes) {
  const uint64_t measured = std::clamp<uint64_t>(bytes, 4096, 256ull << 20);
  const double scale = static_cast<double>(std::max<uint64_t>(bytes, 4096)) /
                       static_cast<double>(measured);
  bytes = measured;
  std::vector<char> a(bytes, 1), b(bytes, 0);
  double best = 1e9;
  for (int i = 0; i < 3; ++i) {
    auto t = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    best = std::min(best, Since(t));
  }
  if (b[bytes / 2] != 1) std::abort();
  return best * scale;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("scale_bench: attach, load and plan costs against the model's metadata");
  std::string mode, model, arena_path;
  int runs = 3;
  app.add_option("mode", mode, "plan|load|attach")->required();
  app.add_option("--model", model, "model file or directory")->required();
  app.add_option("--arena", arena_path, "arena file");
  app.add_option("--runs", runs, "best of N (plan)");
  CLI11_PARSE(app, argc, argv);
  ModelSpec spec;
  spec.files = {model};
  ArenaOptions options;
  options.shared_path = arena_path;
  options.progress = false;

  if (mode == "plan") {
    double best = 1e9;
    int64_t peak = 0;
    size_t tensors = 0;
    for (int i = 0; i < runs; ++i) {
      int64_t base = g_heap.load();
      g_peak.store(base);
      auto t = Clock::now();
      auto plan = source::PlanModel(spec);
      double s = Since(t);
      Check(plan.status(), "plan");
      best = std::min(best, s);
      peak = g_peak.load() - base;
      tensors = plan->table.tensors.size();
    }
    std::printf("{\"mode\":\"plan\",\"tensors\":%zu,\"seconds\":%.6f,\"heap_peak\":%lld}\n",
                tensors, best, static_cast<long long>(peak));
    return 0;
  }
  if (arena_path.empty()) {
    std::fprintf(stderr, "scale_bench: --arena is required for %s\n", mode.c_str());
    return 2;
  }
  if (mode == "load") {
    unlink(arena_path.c_str());
    auto t = Clock::now();
    auto arena = Arena::Open(spec, options);
    double open_seconds = Since(t);
    Check(arena.status(), "load");
    const ArenaReport& r = arena->report();
    if (r.role != ArenaRole::kLoaded) {
      std::fprintf(stderr, "scale_bench: expected to load, was %s\n", ArenaRoleName(r.role));
      return 1;
    }
    double copy = CopySeconds(r.tensor_bytes);
    std::printf(
        "{\"mode\":\"load\",\"tensors\":%llu,\"tensor_bytes\":%llu,\"data_bytes\":%llu,"
        "\"mapped_bytes\":%llu,\"open_seconds\":%.6f,\"load_seconds\":%.6f,\"copy_seconds\":%.6f,"
        "\"overhead_seconds\":%.6f}\n",
        static_cast<unsigned long long>(r.tensors), static_cast<unsigned long long>(r.tensor_bytes),
        static_cast<unsigned long long>(r.data_bytes),
        static_cast<unsigned long long>(r.mapped_bytes), open_seconds, r.load_seconds, copy,
        open_seconds - copy);
    return 0;
  }
  if (mode == "attach") {
    const uint64_t rss_before = StatusKb("VmRSS:");
    const int64_t base = g_heap.load();
    g_peak.store(base);
    auto t = Clock::now();
    auto arena = Arena::Open(spec, options);
    double open_seconds = Since(t);
    Check(arena.status(), "attach");
    const int64_t peak = g_peak.load() - base;
    const int64_t retained = g_heap.load() - base;
    const ArenaReport& r = arena->report();
    if (r.role != ArenaRole::kAttached) {
      std::fprintf(stderr, "scale_bench: expected to attach, was %s\n", ArenaRoleName(r.role));
      return 1;
    }
    const uint64_t rss_after = StatusKb("VmRSS:");
    // Find: every name once, then the mean of a second pass (names copied out first).
    std::vector<std::string> names;
    names.reserve(arena->tensor_count());
    for (size_t i = 0; i < arena->tensor_count(); ++i) names.emplace_back(arena->tensor(i).name);
    size_t found = 0;
    auto f = Clock::now();
    for (const std::string& name : names) found += arena->Find(name).has_value();
    double find_ns = Since(f) * 1e9 / static_cast<double>(std::max<size_t>(1, names.size()));
    if (found != names.size()) {
      std::fprintf(stderr, "scale_bench: Find missed %zu names\n", names.size() - found);
      return 1;
    }
    std::printf(
        "{\"mode\":\"attach\",\"tensors\":%llu,\"data_bytes\":%llu,\"mapped_bytes\":%llu,"
        "\"open_seconds\":%.6f,\"report_seconds\":%.6f,\"bytes_read\":%llu,\"heap_peak\":%lld,"
        "\"heap_retained\":%lld,\"rss_beyond_mapping\":%lld,\"find_ns\":%.1f}\n",
        static_cast<unsigned long long>(r.tensors), static_cast<unsigned long long>(r.data_bytes),
        static_cast<unsigned long long>(r.mapped_bytes), open_seconds, r.seconds,
        static_cast<unsigned long long>(r.bytes_read), static_cast<long long>(peak),
        static_cast<long long>(retained),
        static_cast<long long>(rss_after * 1024) - static_cast<long long>(rss_before * 1024) -
            static_cast<long long>(r.mapped_bytes),
        find_ns);
    return 0;
  }
  std::fprintf(stderr, "scale_bench: unknown mode %s (plan|load|attach)\n", mode.c_str());
  return 2;
}
