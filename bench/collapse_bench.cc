// How long 2 MiB pages cost on plain tmpfs (/dev/shm, shmem_enabled=never), where only
// MADV_COLLAPSE makes them: collapse of the fallocated, unfaulted file vs fault-in then
// collapse vs fallocate-and-collapse piece by piece (what the shared arena does), on 1
// thread and on every core, rotating the order each round so that no case always runs on
// the fresher memory. The time includes the fallocate. Prints seconds per GiB and the share
// that ended on 2 MiB pages.
//
//   build/bin/collapse_bench [MiB per run, default 1024] [rounds, default 2]
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "pages/page_backing.h"
#include "common/units.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "platform/system_info.h"

using namespace expert_arena;

enum class Order { kEmpty, kFaultIn, kPieces };

static const char* OrderName(Order o) {
  switch (o) {
    case Order::kEmpty:
      return "collapse the empty file";
    case Order::kFaultIn:
      return "fault in, then collapse";
    case Order::kPieces:
      return "allocate+collapse pieces";
  }
  return "";
}

static double Run(uint64_t bytes, Order order, unsigned threads, double* huge_share) {
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
  auto start = std::chrono::steady_clock::now();
  bool pieces = order == Order::kPieces;
  if (!(pieces ? platform::ExtendFile(*fd, bytes) : platform::AllocateFile(*fd, bytes)).ok()) {
    std::exit(1);
  }
  auto m = platform::Mapping::MapFile(*fd, bytes, true, kHugePageBytes);
  if (!m.ok()) std::exit(1);
  auto collapsed = pages::CollapseParallel(m->data(), bytes, path, order == Order::kFaultIn,
                                           threads, pieces ? &*fd : nullptr);
  if (!collapsed.ok()) {
    std::fprintf(stderr, "%s\n", collapsed.status().ToString().c_str());
    return -1;
  }
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  (void)platform::AdviseRange(m->data(), bytes, platform::Advice::kPopulateWrite, path);
  auto huge = platform::HugeBytesInRange(m->data(), bytes);
  *huge_share = huge.ok() ? static_cast<double>(*huge) / static_cast<double>(bytes) : 0;
  return seconds;
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
    Order order;
    unsigned threads;
  };
  const Case cases[] = {{Order::kEmpty, 1},     {Order::kFaultIn, 1}, {Order::kPieces, 1},
                        {Order::kEmpty, cores}, {Order::kFaultIn, cores}, {Order::kPieces, cores}};
  constexpr int kCases = 6;
  std::string rows[kCases];
  double shares[kCases] = {};
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < kCases; ++k) {
      int i = (k + r) % kCases;  // rotate the order each round
      double share = 0;
      double s = Run(bytes, cases[i].order, cases[i].threads, &share);
      char buf[32];
      std::snprintf(buf, sizeof buf, "%s%.2f", rows[i].empty() ? "" : ", ",
                    s / (static_cast<double>(bytes) / kGiB));
      rows[i] += buf;
      shares[i] = share;
    }
  }
  for (int i = 0; i < kCases; ++i) {
    std::printf("| %-25s | %7u | %-23s | %13.1f%% |\n", OrderName(cases[i].order),
                cases[i].threads, rows[i].c_str(), 100 * shares[i]);
  }
  return 0;
}
