// The cost of doing without MADV_POPULATE_READ/WRITE (Linux 5.14): the touch fallback
// (platform::PopulateByTouch: one byte per 2 MiB, then every base page pagemap shows absent,
// on the given threads) against MADV_POPULATE_* in the same run, on the same kind of file.
//
// Each round makes a fresh file in DIR (fallocated, so a populate-write maps pages that exist;
// unlinked at once, nothing is left behind), then:
//   write: populate-write a fresh writable mapping of it   (what a loader does)
//   read:  populate-read a second, read-only mapping of it (what an attacher does)
// with MADV_POPULATE_* (split across the same threads) and with the touch fallback, in an
// order that alternates each round. Prints the median seconds and GiB/s of each.
//
//   build/bin/populate_bench [--dir /dev/shm] [--mib 1024] [--rounds 5] [--threads 2]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/units.h"
#include "platform/file.h"
#include "platform/kernel_features.h"
#include "platform/mapping.h"
#include "platform/system_info.h"

using namespace expert_arena;

namespace {

[[noreturn]] void Die(const Status& s) {
  std::fprintf(stderr, "populate_bench: %s\n", s.ToString().c_str());
  std::exit(1);
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// MADV_POPULATE_* of the range split in `threads` equal parts, one thread each.
double PopulateWithMadvise(std::byte* data, uint64_t bytes, bool write, unsigned threads) {
  const auto start = std::chrono::steady_clock::now();
  const uint64_t part = bytes / threads / kHugePageBytes * kHugePageBytes;
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    const uint64_t from = t * part;
    const uint64_t length = t + 1 == threads ? bytes - from : part;
    pool.emplace_back([=] {
      Status s = platform::AdviseRange(
          data + from, length,
          write ? platform::Advice::kPopulateWrite : platform::Advice::kPopulateRead, "bench");
      if (!s.ok()) Die(s);
    });
  }
  for (auto& t : pool) t.join();
  return Seconds(start);
}

struct Times {
  std::vector<double> madvise_write, touch_write, madvise_read, touch_read;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void Round(const std::string& dir, uint64_t bytes, unsigned threads, bool touch_first, Times* times,
           double* huge_share) {
  for (int k = 0; k < 2; ++k) {
    const bool touch = (k == 0) == touch_first;
    const std::string path = dir + "/ea-populate-bench-" + std::to_string(::getpid());
    platform::OpenOptions o;
    o.write = true;
    o.create = true;
    auto fd = platform::OpenFile(path, o);
    if (!fd.ok()) Die(fd.status());
    (void)platform::UnlinkPath(path);
    if (Status s = platform::AllocateFile(*fd, bytes); !s.ok()) Die(s);
    auto w = platform::Mapping::MapFile(*fd, bytes, true, kHugePageBytes);
    if (!w.ok()) Die(w.status());
    if (touch) {
      times->touch_write.push_back(platform::PopulateByTouch(w->data(), bytes, true, threads));
    } else {
      times->madvise_write.push_back(PopulateWithMadvise(w->data(), bytes, true, threads));
    }
    auto r = platform::Mapping::MapFile(*fd, bytes, false, kHugePageBytes);
    if (!r.ok()) Die(r.status());
    if (touch) {
      times->touch_read.push_back(platform::PopulateByTouch(r->data(), bytes, false, threads));
    } else {
      times->madvise_read.push_back(PopulateWithMadvise(r->data(), bytes, false, threads));
    }
    auto huge = platform::HugeBytesInRangeFromSmaps(r->data(), bytes);
    if (huge.ok()) *huge_share = static_cast<double>(*huge) / static_cast<double>(bytes);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/dev/shm";
  uint64_t mib = 1024;
  int rounds = 5;
  unsigned threads = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--dir") {
      dir = argv[i + 1];
    } else if (a == "--mib") {
      mib = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (a == "--rounds") {
      rounds = std::atoi(argv[i + 1]);
    } else if (a == "--threads") {
      threads = static_cast<unsigned>(std::atoi(argv[i + 1]));
    } else {
      std::fprintf(stderr,
                   "usage: populate_bench [--dir D] [--mib N] [--rounds R] [--threads T]\n");
      return 2;
    }
  }
  if (!platform::Kernel().has(platform::KernelFeature::kPopulate)) {
    std::fprintf(stderr, "populate_bench: this kernel lacks MADV_POPULATE_*: nothing to compare\n");
    return 1;
  }
  const uint64_t bytes = mib * kMiB;
  Times t;
  double huge_share = 0;
  for (int r = 0; r < rounds; ++r) Round(dir, bytes, threads, r % 2 == 0, &t, &huge_share);
  auto line = [&](const char* what, const std::vector<double>& madvise,
                  const std::vector<double>& touch) {
    const double m = Median(madvise), x = Median(touch);
    std::printf(
        "%-6s MADV_POPULATE %.4f s (%.1f GiB/s)  touch %.4f s (%.1f GiB/s)  touch/madvise %.2fx\n",
        what, m, static_cast<double>(bytes) / kGiB / m, x, static_cast<double>(bytes) / kGiB / x,
        x / m);
  };
  std::printf(
      "populate_bench: %s, %llu MiB, %d rounds, %u threads, kernel %s, %.0f%% on 2 MiB pages\n",
      dir.c_str(), static_cast<unsigned long long>(mib), rounds, threads,
      platform::Kernel().release.c_str(), huge_share * 100);
  line("write", t.madvise_write, t.touch_write);
  line("read", t.madvise_read, t.touch_read);
  return 0;
}
