// Readers of what the kernel says about filesystems, memory and processes: statfs,
// /proc/buddyinfo, /proc/self/smaps, /proc/self/io, /proc/<pid>/stat and the hugetlb pool.
// Each returns a Status naming the file it could not read or parse.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "expert_arena/status.h"

namespace expert_arena::platform {

enum class FsKind { kTmpfs, kHugetlbfs, kOther };
const char* FsKindName(FsKind kind);

struct FilesystemInfo {
  FsKind kind = FsKind::kOther;
  uint64_t block_bytes = 0;  // f_bsize: the huge page size on hugetlbfs
  // f_blocks and f_bavail times f_frsize. A hugetlbfs mounted without size= has no limit of its
  // own (statfs says 0): its pool of f_bsize pages is, so these are that pool's pages and its
  // free ones less those reserved, and pool_sized says so.
  uint64_t total_bytes = 0;
  uint64_t available_bytes = 0;
  bool pool_sized = false;
  // tmpfs only: the mount's huge= option ("never" when absent, "always", "within_size",
  // "advise"), from /proc/self/mountinfo.
  std::string tmpfs_huge = "never";
  // Where that filesystem is mounted (/proc/self/mountinfo), "" when not found: the path a
  // `mount -o remount,size=` fix names.
  std::string mount_point;
};

// statfs(2) of the filesystem holding `path` (a file or a directory).
Result<FilesystemInfo> StatFilesystem(const std::string& path);

// The number of free 2 MiB blocks the buddy allocator has across all zones
// (/proc/buddyinfo, orders >= 9 counted as 2^(order-9) blocks each).
Result<uint64_t> FreeHugeBlocks();

// Bytes of [start, start+length) mapped by 2 MiB pages, read from the page tables with
// PAGEMAP_SCAN (page_scan.h: exact to the range, and without the per-page walk that makes
// smaps cost 12 ms on a shared 4 GiB tmpfs mapping); on a kernel without it, from smaps.
Result<uint64_t> HugeBytesInRange(const void* start, uint64_t length);

// The same from /proc/self/smaps, for the whole mappings overlapping the range (see
// process_memory.h: ShmemPmdMapped + FilePmdMapped + AnonHugePages, and Shared_Hugetlb +
// Private_Hugetlb for hugetlbfs, where one engine's mapping is private).
Result<uint64_t> HugeBytesInRangeFromSmaps(const void* start, uint64_t length);

// /proc/self/io: rchar (bytes passed to read-like calls) and read_bytes (from storage).
struct ProcessIo {
  uint64_t rchar = 0;
  uint64_t wchar = 0;
  uint64_t read_bytes = 0;
};
Result<ProcessIo> ReadProcessIo();

// Resident set of this process (VmRSS from /proc/self/status), bytes.
Result<uint64_t> ResidentBytes();
// Locked/pinned pages of this process (VmPin), bytes.
Result<uint64_t> PinnedBytes();

// The start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22), or
// kNotFound when no such process exists. With the pid it identifies a process robustly
// against pid reuse.
Result<uint64_t> ProcessStartTime(pid_t pid);
pid_t CurrentPid();
// Lowers the calling thread's CPU priority to `nice` (setpriority on its thread id): for work
// that may wait behind everything else. Best effort.
void LowerThreadPriority(int nice);

// The hugetlb pool for 2 MiB pages (/sys/kernel/mm/hugepages/hugepages-2048kB).
struct HugetlbPool {
  uint64_t total = 0;
  uint64_t free = 0;
  uint64_t reserved = 0;
  uint64_t overcommit = 0;
};
// The pool of `page_bytes` pages: hugepages-2048kB, hugepages-1048576kB.
Result<HugetlbPool> ReadHugetlbPool(uint64_t page_bytes = 2ull << 20);
std::string HugetlbPoolName(uint64_t page_bytes);  // "hugepages-1048576kB"
std::string HugetlbPoolDir(uint64_t page_bytes);   // "/sys/kernel/mm/hugepages/hugepages-...kB/"

// /sys/kernel/mm/transparent_hugepage/shmem_enabled, the bracketed word ("never", ...).
std::string ShmemHugeSetting();

// This boot's id (/proc/sys/kernel/random/boot_id, 36 characters of [0-9a-f-]); "" when it
// cannot be read. Two processes with one boot id run on one kernel (one host).
std::string BootId();

}  // namespace expert_arena::platform
