#include "platform/kernel_features.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>

#include "common/units.h"
#include "platform/page_scan.h"
#include "platform/linux_uapi.h"

namespace expert_arena::platform {
namespace {

constexpr int kFeatures = static_cast<int>(KernelFeature::kCount);

std::string ErrnoName(int err) {
  switch (err) {
    case EINVAL:
      return "EINVAL";
    case ENOSYS:
      return "ENOSYS";
    case EPERM:
      return "EPERM";
    case ENOTTY:
      return "ENOTTY";
    case EACCES:
      return "EACCES";
    case EOPNOTSUPP:
      return "EOPNOTSUPP";
    default:
      return "errno " + std::to_string(err);
  }
}

FeatureProbe Present() { return FeatureProbe{true, 0, ""}; }
FeatureProbe Absent(int err, std::string answer = "") {
  return FeatureProbe{false, err, answer.empty() ? ErrnoName(err) : std::move(answer)};
}

// An advice the kernel does not know is refused with EINVAL before the range is looked at;
// a known one over an empty range succeeds without doing anything (mm/madvise.c, since 2.6).
FeatureProbe ProbeAdvice(int advice) {
  static char page[4096] __attribute__((aligned(4096)));
  // By its number, as AdviseRange calls it (mapping.cc: UCX rewrites libc's madvise).
  if (::syscall(SYS_madvise, page, 0, advice) == 0) return Present();
  return Absent(errno);
}

FeatureProbe ProbePopulate() {
  FeatureProbe read = ProbeAdvice(MADV_POPULATE_READ);
  if (!read.present) return read;
  return ProbeAdvice(MADV_POPULATE_WRITE);
}

FeatureProbe ProbePagemapScan() {
  static char page[4096] __attribute__((aligned(4096)));
  Result<uint64_t> scanned = ScanHugeBytesUnprobed(page, sizeof page);
  if (scanned.ok()) return Present();
  if (scanned.status().code() == StatusCode::kUnsupported) {
    // ScanHugeBytesUnprobed says which errno; the kernel before 6.7 answers ENOTTY.
    return Absent(ENOTTY, scanned.status().message().find("EINVAL") != std::string::npos
                              ? "EINVAL"
                              : "ENOTTY");
  }
  // /proc not mounted or pagemap not readable: smaps will not be there either, but say so.
  return Absent(EACCES, scanned.status().message());
}

FeatureProbe ProbeIoUring() {
  io_uring ring;
  std::memset(&ring, 0, sizeof ring);
  int rc = io_uring_queue_init(2, &ring, 0);
  if (rc < 0) {
    const int err = -rc;
    std::string answer = ErrnoName(err);
    std::string disabled;
    std::ifstream sysctl("/proc/sys/kernel/io_uring_disabled");
    if (sysctl) std::getline(sysctl, disabled);
    if (err == EPERM && !disabled.empty() && disabled != "0") {
      answer += ": kernel.io_uring_disabled=" + disabled;
    } else if (err == EPERM) {
      answer += ": refused by a seccomp filter or policy (Docker 25+, containerd 2)";
    } else if (err == ENOSYS) {
      answer += ": no io_uring in this kernel, or a seccomp filter (Podman)";
    }
    return Absent(err, answer);
  }
  // The loader reads with IORING_OP_READ (5.6); a 5.1-5.5 ring would fail each read.
  FeatureProbe out = Present();
  io_uring_probe* probe = io_uring_get_probe_ring(&ring);
  if (probe == nullptr || !io_uring_opcode_supported(probe, IORING_OP_READ)) {
    out = Absent(EINVAL, "io_uring without IORING_OP_READ (before 5.6)");
  }
  if (probe != nullptr) io_uring_free_probe(probe);
  io_uring_queue_exit(&ring);
  return out;
}

FeatureProbe ProbeCachestat() {
#ifdef SYS_cachestat
  constexpr long kCachestat = SYS_cachestat;
#else
  constexpr long kCachestat = 451;
#endif
  // An invalid fd: EBADF from a kernel that has the call, ENOSYS (or a filter's answer) from
  // one that does not.
  if (::syscall(kCachestat, -1, nullptr, nullptr, 0) == 0 || errno == EBADF || errno == EFAULT) {
    return Present();
  }
  return Absent(errno);
}

std::string ShmemEnabled() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string text;
  if (!in || !std::getline(in, text)) return "unknown";
  size_t open = text.find('['), close = text.find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) return "unknown";
  return text.substr(open + 1, close - open - 1);
}

FeatureProbe ProbeFeature(KernelFeature f) {
  switch (f) {
    case KernelFeature::kPopulate:
      return ProbePopulate();
    case KernelFeature::kCollapse:
      return ProbeAdvice(MADV_COLLAPSE);
    case KernelFeature::kPagemapScan:
      return ProbePagemapScan();
    case KernelFeature::kIoUring:
      return ProbeIoUring();
    case KernelFeature::kCachestat:
      return ProbeCachestat();
    case KernelFeature::kCount:
      break;
  }
  return Absent(EINVAL, "no such feature");
}

struct AtomicCost {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> nanoseconds{0};
};
AtomicCost ledger[kFeatures];

}  // namespace

struct KernelFeatures::Slot {
  std::once_flag once;
  std::atomic<bool> done{false};
  FeatureProbe probe;
};

KernelFeatures::KernelFeatures() : slots_(new Slot[kFeatures]) {
  utsname u{};
  if (::uname(&u) == 0) release = u.release;
  shmem_enabled = ShmemEnabled();
}

const FeatureProbe& KernelFeatures::get(KernelFeature f) const {
  Slot& slot = slots_[static_cast<int>(f)];
  std::call_once(slot.once, [&] {
    slot.probe = ProbeFeature(f);
    slot.done.store(true, std::memory_order_release);
  });
  return slot.probe;
}

bool KernelFeatures::probed(KernelFeature f) const {
  return slots_[static_cast<int>(f)].done.load(std::memory_order_acquire);
}

const KernelFeatures& Kernel() {
  static const KernelFeatures* features = new KernelFeatures();  // never destroyed
  return *features;
}

const char* FeatureName(KernelFeature f) {
  switch (f) {
    case KernelFeature::kPopulate:
      return "MADV_POPULATE_READ/WRITE";
    case KernelFeature::kCollapse:
      return "MADV_COLLAPSE";
    case KernelFeature::kPagemapScan:
      return "PAGEMAP_SCAN";
    case KernelFeature::kIoUring:
      return "io_uring";
    case KernelFeature::kCachestat:
      return "cachestat";
    case KernelFeature::kCount:
      break;
  }
  return "?";
}

const char* FeatureSince(KernelFeature f) {
  switch (f) {
    case KernelFeature::kPopulate:
      return "5.14";
    case KernelFeature::kCollapse:
      return "6.1";
    case KernelFeature::kPagemapScan:
      return "6.7";
    case KernelFeature::kIoUring:
      return "5.6";
    case KernelFeature::kCachestat:
      return "6.5";
    case KernelFeature::kCount:
      break;
  }
  return "?";
}

const char* FeatureFallback(KernelFeature f) {
  switch (f) {
    case KernelFeature::kPopulate:
      return "pages touched from threads";
    case KernelFeature::kCollapse:
      return "no collapse, 2 MiB pages only where the filesystem or MADV_HUGEPAGE gives them";
    case KernelFeature::kPagemapScan:
      return "2 MiB share read from /proc/self/smaps";
    case KernelFeature::kIoUring:
      return "pread";
    case KernelFeature::kCachestat:
      return "mincore";
    case KernelFeature::kCount:
      break;
  }
  return "?";
}

void CountFallback(KernelFeature f, double seconds, uint64_t bytes) {
  AtomicCost& c = ledger[static_cast<int>(f)];
  c.calls.fetch_add(1, std::memory_order_relaxed);
  c.bytes.fetch_add(bytes, std::memory_order_relaxed);
  c.nanoseconds.fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
}

FallbackCost FallbackTotal(KernelFeature f) {
  const AtomicCost& c = ledger[static_cast<int>(f)];
  FallbackCost out;
  out.calls = c.calls.load(std::memory_order_relaxed);
  out.bytes = c.bytes.load(std::memory_order_relaxed);
  out.seconds = static_cast<double>(c.nanoseconds.load(std::memory_order_relaxed)) / 1e9;
  return out;
}

FallbackLedger ReadFallbackLedger() {
  FallbackLedger l;
  for (int i = 0; i < kFeatures; ++i) l.costs[i] = FallbackTotal(static_cast<KernelFeature>(i));
  return l;
}

std::vector<MissingFeature> MissingFeatures(const FallbackLedger& before, bool probe_all) {
  const KernelFeatures& k = Kernel();
  std::vector<MissingFeature> out;
  for (int i = 0; i < kFeatures; ++i) {
    const auto f = static_cast<KernelFeature>(i);
    if (!probe_all && !k.probed(f)) continue;
    if (k.has(f)) continue;
    MissingFeature m;
    m.feature = f;
    m.name = FeatureName(f);
    m.since = FeatureSince(f);
    m.answer = k.get(f).answer;
    m.fallback = FeatureFallback(f);
    const FallbackCost now = FallbackTotal(f);
    m.cost.calls = now.calls - before.costs[i].calls;
    m.cost.bytes = now.bytes - before.costs[i].bytes;
    m.cost.seconds = now.seconds - before.costs[i].seconds;
    out.push_back(std::move(m));
  }
  return out;
}

std::string KernelNote(const std::vector<MissingFeature>& missing) {
  std::string parts;
  for (const MissingFeature& m : missing) {
    if (m.cost.calls == 0) continue;
    char buf[160];
    if (m.feature == KernelFeature::kIoUring || m.cost.seconds <= 0) {
      std::snprintf(buf, sizeof buf, "%s (%s, %s: %s)", m.name.c_str(), m.since.c_str(),
                    m.answer.substr(0, m.answer.find(':')).c_str(), m.fallback.c_str());
    } else {
      std::snprintf(buf, sizeof buf, "%s (%s, %s: %s, %.3f s for %s)", m.name.c_str(),
                    m.since.c_str(), m.answer.substr(0, m.answer.find(':')).c_str(),
                    m.fallback.c_str(), m.cost.seconds, FormatBytes(m.cost.bytes).c_str());
    }
    parts += parts.empty() ? "" : ", ";
    parts += buf;
  }
  if (parts.empty()) return "";
  return "kernel " + Kernel().release + " lacks (or a seccomp filter refuses) " + parts;
}

}  // namespace expert_arena::platform
