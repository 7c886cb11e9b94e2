// Memory and hugetlb cgroup limits of this process, v1 and v2, read before a loader writes a
// page (docs/deployment.md).
//
// tmpfs and /dev/shm pages are charged to the memory cgroup of the process that first touches
// them, and stay charged to it after that process exits for as long as the file exists (not
// to the engines that map them later). hugetlbfs pages are charged to the hugetlb controller
// instead. A loader whose cgroup cannot hold the arena is OOM-killed part-way through, with no
// message; reading the limits first turns that into a refusal that says why.
//
// The cgroup of a controller is the line of /proc/self/cgroup for it (v1: "N:memory:/path";
// v2: "0::/path"), found under the mount of that hierarchy in /proc/self/mountinfo (inside a
// container with a cgroup namespace both say "/", and the mount is the container's own). v1 is
// used for a controller that has a v1 hierarchy; v2 for one listed in cgroup.controllers of
// the v2 mount. Limits are hierarchical: every ancestor up to the mount point is read, and the
// one with the least room left is the one that matters.
//
// Thread-safety: plain functions of the file system; no state.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "expert_arena/status.h"

namespace expert_arena::platform {

inline constexpr uint64_t kNoCgroupLimit = UINT64_MAX;

// One cgroup on the way up from this process's, with the limit that applies at it.
struct CgroupLevel {
  std::string path;        // the cgroup's path, as /proc/self/cgroup names it ("/kubepods/...")
  std::string directory;   // where its files are ("/sys/fs/cgroup/memory/kubepods/...")
  int version = 0;         // 1 or 2
  std::string limit_file;  // "memory.max", "memory.limit_in_bytes", "hugetlb.2MB.max"
  uint64_t limit = kNoCgroupLimit;  // bytes, or kNoCgroupLimit
  uint64_t usage = 0;               // bytes charged now (memory.current / usage_in_bytes)
  uint64_t reclaimable = 0;         // inactive_file of memory.stat: page cache it can drop
  uint64_t high = kNoCgroupLimit;   // v2 memory.high (throttling starts there), or none
  // Room left: limit less the usage that cannot be reclaimed (what kubelet calls the working
  // set: usage - inactive_file). kNoCgroupLimit when there is no limit.
  uint64_t Room() const;
};

// What a controller's limits say for this process.
struct CgroupLimits {
  std::string controller;  // "memory" or "hugetlb"
  bool found = false;      // the controller is mounted and this process is in one of its cgroups
  std::string own_path;    // this process's cgroup of that controller
  int version = 0;
  // The level with the least room, when any level up the hierarchy has a limit.
  std::optional<CgroupLevel> tightest;
  // The level with the lowest memory.high (v2 memory only), when one is set.
  std::optional<CgroupLevel> tightest_high;
};

// The memory controller's limits for this process. kNotFound is never returned: a machine
// without the controller gives found = false. An unreadable file is an error naming it.
Result<CgroupLimits> ReadMemoryCgroupLimits();

// The hugetlb controller's limits for pages of `page_bytes` (2 MiB: hugetlb.2MB.*, 1 GiB:
// hugetlb.1GB.*), same conventions.
Result<CgroupLimits> ReadHugetlbCgroupLimits(uint64_t page_bytes);

}  // namespace expert_arena::platform
