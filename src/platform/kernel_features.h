// What this kernel offers beyond the floor (Linux 4.18, RHEL 8), probed once per process, and
// what doing without it has cost so far.
//
// The floor needs OFD locks (3.15). Everything newer is optional: each feature here is asked
// for once, the way the kernel answers an old or filtered call (an unknown madvise advice is
// EINVAL, an unknown ioctl ENOTTY, a missing syscall ENOSYS, a container's seccomp policy
// EPERM or ENOSYS), and the code that would use it takes its fallback:
//
//   MADV_POPULATE_READ/WRITE (5.14)  pages touched from threads (PopulateByTouch, mapping.h)
//   MADV_COLLAPSE (6.1)              MADV_HUGEPAGE before the first touch on a tmpfs mounted
//                                    huge=advise; elsewhere 4 KiB pages, and the start line
//                                    names the fixes (pages/page_backing.h)
//   PAGEMAP_SCAN (6.7)               /proc/self/smaps (system_info.h)
//   io_uring (5.1; IORING_OP_READ 5.6) pread (load/readers.cc)
//   cachestat (6.5)                  mincore on a mapping (load/loader.cc)
//
// The loader's guard over a model file's mapping needs the real MADV_POPULATE_READ (an error,
// not a SIGBUS, on a truncated file): without it those pieces are read (FaultInChecked).
//
// Thread-safety: each feature is probed once, on its first use from any thread (call_once),
// and is then read-only; the fallback ledger is atomic.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace expert_arena::platform {

enum class KernelFeature : int {
  kPopulate = 0,  // MADV_POPULATE_READ and MADV_POPULATE_WRITE
  kCollapse,      // MADV_COLLAPSE
  kPagemapScan,   // ioctl(PAGEMAP_SCAN) on /proc/self/pagemap
  kIoUring,       // io_uring_setup, and IORING_OP_READ on the ring
  kCachestat,     // cachestat(2)
  kCount,
};

struct FeatureProbe {
  bool present = false;
  int error = 0;       // the errno the probe got (0 when present)
  std::string answer;  // what the kernel answered, e.g. "EINVAL", "ENOSYS: ..." ("" when present)
};

// Each feature is probed on the first get() or has() of it, once per process: an attach asks
// only for what it uses (a ring set up and torn down to probe io_uring costs 0.2-5 ms).
class KernelFeatures {
 public:
  KernelFeatures();
  KernelFeatures(const KernelFeatures&) = delete;
  KernelFeatures& operator=(const KernelFeatures&) = delete;

  std::string release;        // uname -r
  std::string shmem_enabled;  // /sys/kernel/mm/transparent_hugepage/shmem_enabled, selected

  const FeatureProbe& get(KernelFeature f) const;
  bool has(KernelFeature f) const { return get(f).present; }
  // Whether f was probed already (by get or has).
  bool probed(KernelFeature f) const;

 private:
  struct Slot;
  Slot* slots_;  // kCount of them, never freed (the object lives as long as the process)
};

// The process's probes.
const KernelFeatures& Kernel();

// The feature's name for messages ("MADV_POPULATE_READ/WRITE"), the first kernel that has it
// ("5.14"), and what is done without it.
const char* FeatureName(KernelFeature f);
const char* FeatureSince(KernelFeature f);
const char* FeatureFallback(KernelFeature f);

// The fallback ledger: time and bytes spent in each feature's fallback in this process.
struct FallbackCost {
  uint64_t calls = 0;
  uint64_t bytes = 0;
  double seconds = 0;
};
void CountFallback(KernelFeature f, double seconds, uint64_t bytes);
FallbackCost FallbackTotal(KernelFeature f);

// One feature this kernel lacks, with what its fallback cost between two ledger readings.
struct MissingFeature {
  KernelFeature feature;
  std::string name;
  std::string since;
  std::string answer;
  std::string fallback;
  FallbackCost cost;  // since the `before` reading (all zero: not needed in that span)
};

// A reading of the whole ledger, to diff later.
struct FallbackLedger {
  FallbackCost costs[static_cast<int>(KernelFeature::kCount)];
};
FallbackLedger ReadFallbackLedger();

// The features this kernel lacks, each with the cost of its fallback since `before`: those
// probed so far (what this process needed), or every one with `probe_all`.
std::vector<MissingFeature> MissingFeatures(const FallbackLedger& before, bool probe_all = false);

// For the start line: "" when nothing used in the span was missing, else e.g. "kernel 4.18.0
// lacks MADV_POPULATE_READ/WRITE (5.14; pages touched from 2 threads: 0.31 s for 4.00 GiB)".
// Only features whose fallback ran in the span are named.
std::string KernelNote(const std::vector<MissingFeature>& missing);

}  // namespace expert_arena::platform
