// How much of an address range is mapped with 2 MiB entries, read from the page tables with
// the PAGEMAP_SCAN ioctl on /proc/self/pagemap (Linux 6.7+).
//
// /proc/self/smaps gives the same answer per mapping (ShmemPmdMapped, FilePmdMapped,
// AnonHugePages, *_Hugetlb) but, for a file folio mapped by several processes, the kernel
// visits each of its 512 pages to weigh the mapcounts: 12 ms for a 4 GiB tmpfs arena on this
// VM, most of an attach. PAGEMAP_SCAN reports PMD-mapped THPs and hugetlb pages as one region
// each without visiting their pages (0.05 ms for the same range). Callers fall back to smaps
// when the kernel lacks the ioctl.
#pragma once

#include <cstdint>
#include <vector>

#include "expert_arena/status.h"

namespace expert_arena::platform {

// Bytes of [start, start + length) that are present and mapped by 2 MiB (or larger)
// entries: PMD-mapped transparent huge pages (shmem, file, anonymous) and hugetlb pages.
// kUnsupported when this kernel has no PAGEMAP_SCAN; other failures name the operation.
// Asks only when the probe (kernel_features.h) found the ioctl.
Result<uint64_t> ScanHugeBytes(const void* start, uint64_t length);

// The same without consulting the probe: what the probe itself calls.
Result<uint64_t> ScanHugeBytesUnprobed(const void* start, uint64_t length);

// Addresses [start, end).
struct AddressRange {
  uint64_t start = 0;
  uint64_t end = 0;
};

// The parts of [start, start + length) held by this process's private anonymous pages, present
// or swapped out: in a MAP_PRIVATE mapping of a file (an arena's copy-on-write views), the
// pages a write copied into this process, which no longer are the file's pages every other
// process reads. Decided by what the pages are, not by addresses: the file's own pages (tmpfs,
// hugetlbfs, page cache) are "file pages" in the page tables, a copy-on-write copy (a 4 KiB page,
// or a huge page on hugetlbfs) is anonymous; pages never touched are neither. Adjacent ranges
// come merged, clipped to the range asked for. PAGEMAP_SCAN's PAGE_IS_FILE (6.7+) where the
// probe found the ioctl, else /proc/self/pagemap's "file page or shared anonymous" bit (61).
Result<std::vector<AddressRange>> PrivatePagesIn(const void* start, uint64_t length);

// The same read from /proc/self/pagemap whatever the kernel (the fallback, and the tests').
Result<std::vector<AddressRange>> PrivatePagesInByPagemap(const void* start, uint64_t length);

// Bytes of [start, start + length) that PrivatePagesIn finds.
Result<uint64_t> PrivateBytesIn(const void* start, uint64_t length);

}  // namespace expert_arena::platform
