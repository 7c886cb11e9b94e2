// How long 2 MiB pages cost on plain tmpfs (/dev/shm, shmem_enabled=never), where only
// MADV_COLLAPSE makes them: collapse of the fallocated, unfaulted file vs fault-in then
// collapse, on 1 thread and on every core, alternating so that neither order always runs
// on the fresher memory. Prints seconds per GiB and the share that ended on 2 MiB pages.
//
//   build/bin/collapse_bench [MiB per run, default 1024] [rounds, default 2]
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "arena/page_backing.h"
#include "common/units.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "platform/system_info.h"

using namespace expert_arena;

static double Run(uint64_t bytes, bool populate_first, unsigned threads, double* huge_share) {
  std::string path = "/dev/shm/ea-collapse-bench-" + std::to_string(getpid());
  platform::OpenOptions o;
  o.write = true;
  o.create = true;
  auto fd = platform::OpenFile(path, o);
  if (!fd.ok()) {
    std::fprintf(stderr, "%s\n", fd.status().ToString().c_str());
    std::exit(1);
  }
  (void)platform::UnlinkPath(path);  // nothing is left behind, whatever happens next
  if (!platform::AllocateFile(*fd, bytes).ok()) std::exit(1);
  auto m = platform::Mapping::MapFile(*fd, bytes, true, kHugePageBytes);
  if (!m.ok()) std::exit(1);
  auto seconds = arena::CollapseParallel(m->data(), bytes, path, populate_first, threads);
  if (!seconds.ok()) {
    std::fprintf(stderr, "%s\n", seconds.status().ToString().c_str());
    return -1;
  }
  (void)platform::AdviseRange(m->data(), bytes, platform::Advice::kPopulateWrite, path);
  auto huge = platform::HugeBytesInRange(m->data(), bytes);
  *huge_share = huge.ok() ? static_cast<double>(*huge) / static_cast<double>(bytes) : 0;
  return *seconds;
}

int main(int argc, char** argv) {
  uint64_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  int rounds = argc > 2 ? std::atoi(argv[2]) : 2;
  uint64_t bytes = mib * kMiB;
  unsigned cores = std::thread::hardware_concurrency();
  auto blocks = platform::FreeHugeBlocks();
  std::printf("collapse bench: %llu MiB per run, %u cores, %llu free 2 MiB blocks at start\n",
              static_cast<unsigned long long>(mib), cores,
              static_cast<unsigned long long>(blocks.ok() ? *blocks : 0));
  std::printf(
      "| order                     | threads | s/GiB (each round)      | on 2 MiB pages |\n");
  std::printf(
      "|---------------------------|---------|-------------------------|----------------|\n");
  struct Case {
    bool populate_first;
    unsigned threads;
  };
  Case cases[] = {{false, 1}, {true, 1}, {false, cores}, {true, cores}};
  std::string rows[4];
  double shares[4] = {0, 0, 0, 0};
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < 4; ++k) {
      int i = (r % 2 == 0) ? k : 3 - k;  // alternate the order each round
      double share = 0;
      double s = Run(bytes, cases[i].populate_first, cases[i].threads, &share);
      char buf[32];
      std::snprintf(buf, sizeof buf, "%s%.2f", rows[i].empty() ? "" : ", ",
                    s / (static_cast<double>(bytes) / kGiB));
      rows[i] += buf;
      shares[i] = share;
    }
  }
  for (int i = 0; i < 4; ++i) {
    std::printf("| %-25s | %7u | %-23s | %13.1f%% |\n",
                cases[i].populate_first ? "fault in, then collapse" : "collapse the empty file",
                cases[i].threads, rows[i].c_str(), 100 * shares[i]);
  }
  return 0;
}
