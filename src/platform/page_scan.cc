#include "platform/page_scan.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <array>
#include <cerrno>

#include "platform/file.h"
#include "platform/kernel_features.h"

namespace expert_arena::platform {
namespace {

// The PAGEMAP_SCAN ABI (include/uapi/linux/fs.h since Linux 6.7); Debian 12's kernel headers
// (6.1) predate it, so it is spelled out here, layout unchanged upstream.
struct PageRegion {
  uint64_t start;
  uint64_t end;
  uint64_t categories;
};
struct PmScanArg {
  uint64_t size;
  uint64_t flags;
  uint64_t start;
  uint64_t end;
  uint64_t walk_end;
  uint64_t vec;
  uint64_t vec_len;
  uint64_t max_pages;
  uint64_t category_inverted;
  uint64_t category_mask;
  uint64_t category_anyof_mask;
  uint64_t return_mask;
};
constexpr unsigned long kPagemapScan = _IOWR('f', 16, PmScanArg);
constexpr uint64_t kPageIsPresent = 1u << 3;
constexpr uint64_t kPageIsHuge = 1u << 6;

constexpr const char* kPagemap = "/proc/self/pagemap";

}  // namespace

Result<uint64_t> ScanHugeBytes(const void* start, uint64_t length) {
  if (!Kernel().has(KernelFeature::kPagemapScan)) {
    return Unsupported(std::string(kPagemap) + ": PAGEMAP_SCAN not supported by this kernel (" +
                       Kernel().get(KernelFeature::kPagemapScan).answer + ")");
  }
  return ScanHugeBytesUnprobed(start, length);
}

Result<uint64_t> ScanHugeBytesUnprobed(const void* start, uint64_t length) {
  const uint64_t first = reinterpret_cast<uintptr_t>(start);
  const uint64_t end = first + length;
  UniqueFd fd(::open(kPagemap, O_RDONLY | O_CLOEXEC), kPagemap);
  if (!fd.valid()) return ErrnoStatus(errno, "open", kPagemap);
  // Only pages that are both present and huge are reported; adjacent ones come back merged,
  // so a fully huge range is one region and a partly huge one a few.
  std::array<PageRegion, 256> regions;
  uint64_t huge = 0;
  uint64_t next = first;
  while (next < end) {
    PmScanArg arg{};
    arg.size = sizeof(arg);
    arg.start = next;
    arg.end = end;
    arg.vec = reinterpret_cast<uintptr_t>(regions.data());
    arg.vec_len = regions.size();
    arg.category_mask = kPageIsPresent | kPageIsHuge;
    arg.return_mask = kPageIsPresent | kPageIsHuge;
    long n = ::ioctl(fd.get(), kPagemapScan, &arg);
    if (n < 0) {
      int error = errno;
      // ENOTTY: no such ioctl (before 6.7). EINVAL: a kernel that knows the ioctl but not
      // this argument layout. Either way smaps can still answer.
      if (error == ENOTTY || error == EINVAL) {
        return Unsupported(std::string(kPagemap) + ": PAGEMAP_SCAN not supported by this kernel (" +
                           (error == ENOTTY ? "ENOTTY" : "EINVAL") + ")");
      }
      return ErrnoStatus(error, "ioctl(PAGEMAP_SCAN)", kPagemap);
    }
    for (long i = 0; i < n; ++i) huge += regions[i].end - regions[i].start;
    if (arg.walk_end <= next) break;  // no progress: never loop forever on a kernel quirk
    next = arg.walk_end;
  }
  return huge;
}

}  // namespace expert_arena::platform
