#include "arena/memory_charge.h"

#include "common/units.h"
#include "platform/cgroup.h"

namespace expert_arena::arena {
namespace {

std::string Limit(uint64_t bytes) {
  return bytes == platform::kNoCgroupLimit ? std::string("max") : FormatBytes(bytes);
}

// "cgroup /kubepods/pod1 (v1, /sys/fs/cgroup/memory/kubepods/pod1)".
std::string Name(const platform::CgroupLevel& level) {
  return "cgroup " + level.path + " (v" + std::to_string(level.version) + ", " + level.directory +
         ")";
}

}  // namespace

Result<std::string> CheckArenaCharge(const platform::FilesystemInfo& fs, uint64_t new_bytes,
                                     const std::string& path, spdlog::logger& log,
                                     uint64_t spared) {
  const bool hugetlbfs = fs.kind == platform::FsKind::kHugetlbfs;
  if (!hugetlbfs && fs.kind != platform::FsKind::kTmpfs) return std::string();
  auto limits = hugetlbfs ? platform::ReadHugetlbCgroupLimits(fs.block_bytes)
                          : platform::ReadMemoryCgroupLimits();
  if (!limits.ok()) {
    log.warn(
        "expert-arena: cannot read this process's {} cgroup limits ({}); loading {} without "
        "checking that they hold it",
        hugetlbfs ? "hugetlb" : "memory", limits.status().message(), path);
    return std::string();
  }
  if (!limits->found) return std::string();
  const std::string what =
      hugetlbfs ? "hugetlbfs pages of " + FormatBytes(fs.block_bytes) : "tmpfs pages";
  const std::string how =
      path + " needs " + FormatBytes(new_bytes) + " of new " + what +
      (spared > 0 ? " at the build's peak (the arena's " + FormatBytes(new_bytes + spared) +
                        ", less the engine's own memory it frees as it writes)"
                  : std::string()) +
      ", charged to the " + limits->controller + " cgroup of the process that loads it";
  if (limits->tightest_high) {
    const platform::CgroupLevel& h = *limits->tightest_high;
    uint64_t kept = h.usage - std::min(h.usage, h.reclaimable);
    if (h.high != platform::kNoCgroupLimit && new_bytes > h.high - std::min(h.high, kept)) {
      log.warn(
          "expert-arena: {}; {} has memory.high {} with {} in use: past it the kernel "
          "throttles this process and reclaims, and tmpfs pages are not reclaimable without "
          "swap, so the load will crawl. Load from a holder outside this limit, or raise "
          "memory.high",
          how, Name(h), FormatBytes(h.high), FormatBytes(h.usage));
    }
  }
  if (!limits->tightest) {
    return std::string("charged to ") + limits->controller + " cgroup " + limits->own_path +
           " (no limit)";
  }
  const platform::CgroupLevel& t = *limits->tightest;
  const uint64_t room = t.Room();
  if (new_bytes <= room) {
    return std::string("charged to ") + limits->controller + " cgroup " + limits->own_path + " (" +
           FormatBytes(new_bytes) + (spared > 0 ? " at the build's peak" : "") + " of " +
           FormatBytes(room) + " left under " + t.limit_file + " of " + t.path + ")";
  }
  const uint64_t kept = t.usage - std::min(t.usage, t.reclaimable);
  std::string message = how + ", but " + Name(t) + " has " + t.limit_file + " " + Limit(t.limit) +
                        " with " + FormatBytes(t.usage) + " in use";
  if (t.reclaimable > 0) {
    message += " (" + FormatBytes(t.reclaimable) + " of it reclaimable page cache)";
  }
  message += ": " + FormatBytes(room) +
             " left. Not loaded, nothing published (loading would be OOM-killed part-way). "
             "Fixes: (1) load the arena from a holder outside this limit (`expert-arena load "
             "--hold --arena " +
             path +
             " --model ...` as a systemd service, or a Kubernetes DaemonSet) and let the engines "
             "attach: attaching charges them nothing; (2) raise " +
             t.limit_file + " of " + t.path + " to at least " + FormatBytes(kept + new_bytes);
  if (hugetlbfs) {
    message += " (in Kubernetes, request resources.limits.hugepages-" +
               (fs.block_bytes >= kGiB ? std::string("1Gi") : std::string("2Mi")) + ": " +
               std::to_string((new_bytes + kMiB - 1) / kMiB) +
               "Mi; a pod that requests none gets a hugetlb limit of 0)";
  } else {
    message +=
        " (in Kubernetes, the container's resources.limits.memory; a Memory emptyDir "
        "counts against it)";
    message +=
        "; (3) put the arena on hugetlbfs, whose pages are charged to the hugetlb "
        "controller, not to memory";
  }
  message += ". See docs/deployment.md";
  return NoSpace(message);
}

}  // namespace expert_arena::arena
