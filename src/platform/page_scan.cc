#include "platform/page_scan.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <string>
#include <vector>

#include "platform/file.h"
#include "platform/kernel_features.h"
#include "platform/mapping.h"

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
constexpr uint64_t kPageIsFile = 1u << 2;
constexpr uint64_t kPageIsPresent = 1u << 3;
constexpr uint64_t kPageIsSwapped = 1u << 4;
constexpr uint64_t kPageIsHuge = 1u << 6;

// /proc/self/pagemap's 64-bit entries (Documentation/admin-guide/mm/pagemap.rst).
constexpr uint64_t kEntryPresent = uint64_t{1} << 63;
constexpr uint64_t kEntrySwapped = uint64_t{1} << 62;
constexpr uint64_t kEntryFileOrSharedAnon = uint64_t{1} << 61;

constexpr const char* kPagemap = "/proc/self/pagemap";

// Appends [start, end) clipped to [lo, hi), merged with the last range when they touch.
void AddRange(std::vector<AddressRange>* out, uint64_t start, uint64_t end, uint64_t lo,
              uint64_t hi) {
  start = std::max(start, lo);
  end = std::min(end, hi);
  if (start >= end) return;
  if (!out->empty() && out->back().end >= start) {
    out->back().end = std::max(out->back().end, end);
    return;
  }
  out->push_back({start, end});
}

}  // namespace

Result<uint64_t> ScanHugeBytes(const void* start, uint64_t length) {
  if (!Kernel().has(KernelFeature::kPagemapScan)) {
    return Unsupported(std::string(kPagemap) + ": PAGEMAP_SCAN not supported by this kernel (" +
                       Kernel().get(KernelFeature::kPagemapScan).answer + ")");
  }
  return ScanHugeBytesUnprobed(start, length);
}

// Walks [next, end) with PAGEMAP_SCAN under `masks` (size, start, end and vec filled in here),
// handing each region found to `found`. kUnsupported naming ENOTTY (no such ioctl, before 6.7)
// or EINVAL (a kernel that knows the ioctl but not this argument layout).
template <typename Found>
Status ScanRegions(int fd, uint64_t next, uint64_t end, PmScanArg masks, Found found) {
  std::array<PageRegion, 256> regions;
  while (next < end) {
    PmScanArg arg = masks;
    arg.size = sizeof(arg);
    arg.start = next;
    arg.end = end;
    arg.vec = reinterpret_cast<uintptr_t>(regions.data());
    arg.vec_len = regions.size();
    long n = ::ioctl(fd, kPagemapScan, &arg);
    if (n < 0) {
      int error = errno;
      if (error == ENOTTY || error == EINVAL) {
        return Unsupported(std::string(kPagemap) + ": PAGEMAP_SCAN not supported by this kernel (" +
                           (error == ENOTTY ? "ENOTTY" : "EINVAL") + ")");
      }
      return ErrnoStatus(error, "ioctl(PAGEMAP_SCAN)", kPagemap);
    }
    for (long i = 0; i < n; ++i) found(regions[i]);
    if (arg.walk_end <= next) break;  // no progress: never loop forever on a kernel quirk
    next = arg.walk_end;
  }
  return Status::Ok();
}

Result<uint64_t> ScanHugeBytesUnprobed(const void* start, uint64_t length) {
  const uint64_t first = reinterpret_cast<uintptr_t>(start);
  const uint64_t end = first + length;
  UniqueFd fd(::open(kPagemap, O_RDONLY | O_CLOEXEC), kPagemap);
  if (!fd.valid()) return ErrnoStatus(errno, "open", kPagemap);
  // Only pages that are both present and huge are reported; adjacent ones come back merged,
  // so a fully huge range is one region and a partly huge one a few.
  // (kUnsupported where the kernel has no PAGEMAP_SCAN: smaps can still answer.)
  PmScanArg masks{};
  masks.category_mask = kPageIsPresent | kPageIsHuge;
  masks.return_mask = kPageIsPresent | kPageIsHuge;
  uint64_t huge = 0;
  EA_RETURN_IF_ERROR(ScanRegions(fd.get(), first, end, masks,
                                 [&](const PageRegion& r) { huge += r.end - r.start; }));
  return huge;
}

Result<std::vector<AddressRange>> PrivatePagesInByPagemap(const void* start, uint64_t length) {
  std::vector<AddressRange> out;
  if (length == 0) return out;
  const uint64_t page = BasePageSize();
  const uint64_t lo = reinterpret_cast<uintptr_t>(start);
  const uint64_t hi = lo + length;
  UniqueFd fd(::open(kPagemap, O_RDONLY | O_CLOEXEC), kPagemap);
  if (!fd.valid()) return ErrnoStatus(errno, "open", kPagemap);
  // 64 Ki entries (512 KiB) a read: 256 MiB of 4 KiB pages.
  std::vector<uint64_t> entries(64 * 1024);
  uint64_t first_page = lo / page;
  const uint64_t end_page = (hi + page - 1) / page;
  while (first_page < end_page) {
    const uint64_t count = std::min<uint64_t>(entries.size(), end_page - first_page);
    const uint64_t want = count * sizeof(uint64_t);
    uint64_t got = 0;
    while (got < want) {
      ssize_t n = ::pread(fd.get(), reinterpret_cast<char*>(entries.data()) + got, want - got,
                          static_cast<off_t>(first_page * sizeof(uint64_t) + got));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return ErrnoStatus(errno, "read", kPagemap);
      if (n == 0) {
        return InvalidArgument(std::string(kPagemap) + ": short read at page " +
                               std::to_string(first_page + got / sizeof(uint64_t)));
      }
      got += static_cast<uint64_t>(n);
    }
    for (uint64_t i = 0; i < count; ++i) {
      const uint64_t e = entries[i];
      // A page of this process that is neither the file's (page cache, tmpfs, hugetlbfs) nor
      // shared anonymous memory: a private anonymous page, in memory or in swap.
      if ((e & (kEntryPresent | kEntrySwapped)) != 0 && (e & kEntryFileOrSharedAnon) == 0) {
        const uint64_t at = (first_page + i) * page;
        AddRange(&out, at, at + page, lo, hi);
      }
    }
    first_page += count;
  }
  return out;
}

Result<std::vector<AddressRange>> PrivatePagesIn(const void* start, uint64_t length) {
  if (!Kernel().has(KernelFeature::kPagemapScan)) return PrivatePagesInByPagemap(start, length);
  std::vector<AddressRange> out;
  if (length == 0) return out;
  const uint64_t page = BasePageSize();
  const uint64_t lo = reinterpret_cast<uintptr_t>(start);
  const uint64_t hi = lo + length;
  const uint64_t end = (hi + page - 1) / page * page;
  UniqueFd fd(::open(kPagemap, O_RDONLY | O_CLOEXEC), kPagemap);
  if (!fd.valid()) return ErrnoStatus(errno, "open", kPagemap);
  // Not a file page (PAGE_IS_FILE inverted, then required), and present or swapped.
  PmScanArg masks{};
  masks.category_inverted = kPageIsFile;
  masks.category_mask = kPageIsFile;
  masks.category_anyof_mask = kPageIsPresent | kPageIsSwapped;
  masks.return_mask = kPageIsFile | kPageIsPresent | kPageIsSwapped;
  Status scanned = ScanRegions(fd.get(), lo / page * page, end, masks, [&](const PageRegion& r) {
    AddRange(&out, r.start, r.end, lo, hi);
  });
  // A kernel that refuses this argument (ENOTTY, EINVAL): pagemap answers the same.
  if (scanned.code() == StatusCode::kUnsupported) return PrivatePagesInByPagemap(start, length);
  EA_RETURN_IF_ERROR(scanned);
  return out;
}

Result<uint64_t> PrivateBytesIn(const void* start, uint64_t length) {
  EA_ASSIGN_OR_RETURN(std::vector<AddressRange> ranges, PrivatePagesIn(start, length));
  uint64_t bytes = 0;
  for (const AddressRange& r : ranges) bytes += r.end - r.start;
  return bytes;
}

}  // namespace expert_arena::platform
