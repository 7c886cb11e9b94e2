// Micro-benchmark behind the loader's hot hashing (docs/loader.md):
// ways to copy a page-cached file into a populated 2 MiB-page buffer while computing xxh3 of
// each 48 MiB unit (a "tensor", hashed front to back by the thread that copies it), on 2
// threads, against the 2-thread memcpy from a pre-faulted mapping. Variants:
//   memcpy        the peer: memcpy of 4 MiB pieces from the pre-faulted mapping, no hash
//   pread-4M      pread of 4 MiB pieces, no hash (the kernel copy)
//   pread-4M+h    pread 4 MiB, then hash those 4 MiB (the loader before hot hashing)
//   pread-S+h     pread S bytes, hash them at once while in L1/L2 (S = --blocks)
//   mmap-S+hd     memcpy S bytes from the pre-faulted mapping, hash the destination block
//   mmap-S+hs     the same, hashing the source block
// with the loader's XXH3 (FastXxh3: the library's code built for AVX-512 or AVX2, whichever
// the CPU has).
//
//   hot_hash_bench --file PATH [--runs N] [--threads N] [--unit-mib N]
#include <sys/mman.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/units.h"
#include "common/fast_xxh3.h"
#include "common/fast_xxh3_build.h"
#include "platform/file.h"
#include "platform/mapping.h"

using namespace expert_arena;
using Clock = std::chrono::steady_clock;

namespace {

// The loader's XXH3 build for this CPU.
using Hasher = Xxh3Build;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Runs body(unit) for every unit on `threads` threads; returns seconds.
double RunUnits(size_t units, unsigned threads, const std::function<void(size_t)>& body) {
  std::atomic<size_t> next{0};
  auto start = Clock::now();
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < threads; ++w) {
    pool.emplace_back([&] {
      for (size_t u; (u = next.fetch_add(1)) < units;) body(u);
    });
  }
  for (auto& t : pool) t.join();
  return Since(start);
}

std::atomic<uint64_t> g_sink{0};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hot hashing micro-benchmark"};
  std::string file;
  int runs = 3;
  unsigned threads = 2;
  uint64_t unit_mib = 48;
  app.add_option("--file", file)->required();
  app.add_option("--runs", runs);
  app.add_option("--threads", threads);
  app.add_option("--unit-mib", unit_mib);
  CLI11_PARSE(app, argc, argv);

  auto fd = platform::OpenFile(file, {.no_follow = false});
  if (!fd.ok()) return std::fprintf(stderr, "%s\n", fd.status().ToString().c_str()), 1;
  const uint64_t size = platform::StatFd(*fd)->size;
  const uint64_t unit = unit_mib * kMiB;
  const size_t units = size / unit;
  const uint64_t total = units * unit;
  const double gib = static_cast<double>(total) / kGiB;

  auto buffer = platform::Mapping::MapAnonymous(total, kHugePageBytes);
  (void)platform::AdviseRange(buffer->data(), buffer->size(), platform::Advice::kHugePage, "b");
  (void)platform::AdviseRange(buffer->data(), buffer->size(), platform::Advice::kPopulateWrite,
                              "b");
  (void)platform::AdviseRange(buffer->data(), buffer->size(), platform::Advice::kCollapse, "b");
  std::byte* dst = buffer->data();

  auto map_start = Clock::now();
  auto source = platform::Mapping::MapFile(*fd, size, false, kHugePageBytes);
  (void)platform::AdviseRange(source->data(), source->size(), platform::Advice::kPopulateRead,
                              "model");
  const double map_s = Since(map_start);
  const std::byte* src = source->data();

  std::vector<Hasher> hashers = {ChosenXxh3Build()};

  struct Case {
    std::string name;
    std::function<void(size_t)> body;
  };
  std::vector<Case> cases;
  const uint64_t piece = 4 * kMiB;
  cases.push_back({"memcpy 4M (peer)", [&](size_t u) {
                     for (uint64_t at = u * unit; at < (u + 1) * unit; at += piece) {
                       std::memcpy(dst + at, src + at, piece);
                     }
                   }});
  cases.push_back({"pread 4M, no hash", [&](size_t u) {
                     for (uint64_t at = u * unit; at < (u + 1) * unit; at += piece) {
                       (void)platform::ReadFull(*fd, at, {dst + at, piece});
                     }
                   }});
  for (const Hasher& h : hashers) {
    cases.push_back({std::string("pread 4M then hash 4M, ") + h.name, [&, h](size_t u) {
                       void* s = h.create();
                       h.reset(s);
                       for (uint64_t at = u * unit; at < (u + 1) * unit; at += piece) {
                         (void)platform::ReadFull(*fd, at, {dst + at, piece});
                         h.update(s, dst + at, piece);
                       }
                       g_sink += h.digest(s);
                       h.free(s);
                     }});
    for (uint64_t block : {32 * kKiB, 64 * kKiB, 128 * kKiB, 256 * kKiB, 512 * kKiB, kMiB}) {
      cases.push_back({"pread " + std::to_string(block / kKiB) + "K + hash, " + h.name,
                       [&, h, block](size_t u) {
                         void* s = h.create();
                         h.reset(s);
                         for (uint64_t at = u * unit; at < (u + 1) * unit; at += block) {
                           (void)platform::ReadFull(*fd, at, {dst + at, block});
                           h.update(s, dst + at, block);
                         }
                         g_sink += h.digest(s);
                         h.free(s);
                       }});
    }
    for (uint64_t block : {16 * kKiB, 32 * kKiB, 64 * kKiB, 256 * kKiB}) {
      for (bool hash_source : {false, true}) {
        cases.push_back({"mmap memcpy " + std::to_string(block / kKiB) + "K + hash " +
                             (hash_source ? "src, " : "dst, ") + h.name,
                         [&, h, block, hash_source](size_t u) {
                           void* s = h.create();
                           h.reset(s);
                           for (uint64_t at = u * unit; at < (u + 1) * unit; at += block) {
                             std::memcpy(dst + at, src + at, block);
                             h.update(s, (hash_source ? src : dst) + at, block);
                           }
                           g_sink += h.digest(s);
                           h.free(s);
                         }});
      }
    }
    // pread into a small per-thread buffer that stays in L1/L2, hash it there, copy it out.
    for (uint64_t block : {32 * kKiB, 64 * kKiB, 128 * kKiB, 256 * kKiB}) {
      cases.push_back(
          {"pread " + std::to_string(block / kKiB) + "K to scratch + hash + memcpy, " + h.name,
           [&, h, block](size_t u) {
             thread_local std::vector<std::byte> scratch;
             scratch.resize(block);
             void* s = h.create();
             h.reset(s);
             for (uint64_t at = u * unit; at < (u + 1) * unit; at += block) {
               (void)platform::ReadFull(*fd, at, {scratch.data(), block});
               h.update(s, scratch.data(), block);
               std::memcpy(dst + at, scratch.data(), block);
             }
             g_sink += h.digest(s);
             h.free(s);
           }});
    }
    // The mapping made per unit inside the timing: what a loader would pay (faults, or
    // MAP_POPULATE, and munmap).
    for (int how = 0; how < 3; ++how) {
      static const char* kHow[] = {"faulted in the copy", "MAP_POPULATE", "MADV_POPULATE_READ"};
      cases.push_back(
          {std::string("mmap per unit (") + kHow[how] + "), memcpy 64K + hash dst, " + h.name,
           [&, h, how](size_t u) {
             const uint64_t block = 64 * kKiB;
             int flags = MAP_SHARED | (how == 1 ? MAP_POPULATE : 0);
             void* m = ::mmap(nullptr, unit, PROT_READ, flags, fd->get(), u * unit);
             if (m == MAP_FAILED) std::abort();
             if (how == 2) ::madvise(m, unit, MADV_POPULATE_READ);
             const std::byte* from = static_cast<const std::byte*>(m);
             void* s = h.create();
             h.reset(s);
             for (uint64_t at = 0; at < unit; at += block) {
               std::memcpy(dst + u * unit + at, from + at, block);
               h.update(s, dst + u * unit + at, block);
             }
             g_sink += h.digest(s);
             h.free(s);
             ::munmap(m, unit);
           }});
    }
    cases.push_back({std::string("hash only (from DRAM), ") + h.name, [&, h](size_t u) {
                       void* s = h.create();
                       h.reset(s);
                       h.update(s, dst + u * unit, unit);
                       g_sink += h.digest(s);
                       h.free(s);
                     }});
    cases.push_back(
        {std::string("hash only (256K in L2, same bytes), ") + h.name, [&, h](size_t u) {
           void* s = h.create();
           h.reset(s);
           const std::byte* b = dst + u * 256 * kKiB;
           for (uint64_t at = 0; at < unit; at += 256 * kKiB) h.update(s, b, 256 * kKiB);
           g_sink += h.digest(s);
           h.free(s);
         }});
  }

  std::vector<std::vector<double>> times(cases.size());
  for (int r = 0; r < runs; ++r) {
    for (size_t c = 0; c < cases.size(); ++c) {
      times[c].push_back(RunUnits(units, threads, cases[c].body));
    }
  }
  std::printf(
      "file %s: %.2f GiB in %zu units of %llu MiB, %u threads; mapping + populate %.3f s\n\n",
      file.c_str(), gib, units, static_cast<unsigned long long>(unit_mib), threads, map_s);
  std::printf("| case | seconds (median of %d) | GiB/s | vs memcpy |\n|---|---|---|---|\n", runs);
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double peer = median(times[0]);
  for (size_t c = 0; c < cases.size(); ++c) {
    double s = median(times[c]);
    std::printf("| %s | %.3f | %.2f | %.2fx |\n", cases[c].name.c_str(), s, gib / s, peer / s);
  }
  return 0;
}
