#include "platform/cgroup.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <fstream>
#include <sstream>
#include <vector>

namespace expert_arena::platform {
namespace {

// Values at or above this are "no limit": v1 writes PAGE_COUNTER_MAX pages
// (9223372036854771712 with 4 KiB pages), v2 writes "max".
constexpr uint64_t kUnlimitedFloor = 1ull << 62;

std::optional<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A file of one number or "max". nullopt when absent (the root cgroup has no memory.max).
Result<std::optional<uint64_t>> ReadLimitFile(const std::string& path) {
  auto text = ReadSmallFile(path);
  if (!text) return std::optional<uint64_t>();
  std::string word;
  std::istringstream(*text) >> word;
  if (word == "max") return std::optional<uint64_t>(kNoCgroupLimit);
  uint64_t value = 0;
  auto [end, err] = std::from_chars(word.data(), word.data() + word.size(), value);
  if (err != std::errc() || end != word.data() + word.size() || word.empty()) {
    return Corrupt(path + ": expected a number or \"max\", read \"" + word + "\"");
  }
  return std::optional<uint64_t>(value >= kUnlimitedFloor ? kNoCgroupLimit : value);
}

// `key value` lines of memory.stat.
uint64_t StatValue(const std::string& stat, const std::string& key) {
  std::istringstream in(stat);
  std::string k;
  uint64_t v = 0;
  while (in >> k >> v) {
    if (k == key) return v;
  }
  return 0;
}

struct Hierarchy {
  int version = 0;
  std::string cgroup_path;  // from /proc/self/cgroup
  std::string mount_point;
  std::string mount_root;  // the cgroup the mount shows at its top
};

// The hierarchy `controller` is attached to for this process: v1 when a v1 hierarchy has it,
// else v2 when the v2 mount lists it in cgroup.controllers. version 0: neither.
Result<Hierarchy> FindHierarchy(const std::string& controller) {
  auto cgroups = ReadSmallFile("/proc/self/cgroup");
  if (!cgroups) return ErrnoStatus(errno, "read", "/proc/self/cgroup");
  std::string v1_path, v2_path;
  bool have_v2 = false;
  std::istringstream lines(*cgroups);
  for (std::string line; std::getline(lines, line);) {
    size_t a = line.find(':');
    size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    std::string controllers = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && controllers.empty()) {
      v2_path = path;
      have_v2 = true;
      continue;
    }
    std::istringstream names(controllers);
    for (std::string name; std::getline(names, name, ',');) {
      if (name == controller) v1_path = path;
    }
  }
  auto mountinfo = ReadSmallFile("/proc/self/mountinfo");
  if (!mountinfo) return ErrnoStatus(errno, "read", "/proc/self/mountinfo");
  Hierarchy v1, v2;
  std::istringstream mounts(*mountinfo);
  for (std::string line; std::getline(mounts, line);) {
    std::istringstream fields(line);
    std::vector<std::string> f;
    for (std::string w; fields >> w;) f.push_back(w);
    size_t dash = 0;
    while (dash < f.size() && f[dash] != "-") ++dash;
    if (dash < 5 || dash + 3 >= f.size()) continue;
    const std::string& fstype = f[dash + 1];
    const std::string& super_options = f[dash + 3];
    if (fstype == "cgroup" && !v1_path.empty() && v1.version == 0) {
      std::istringstream opts(super_options);
      for (std::string o; std::getline(opts, o, ',');) {
        if (o == controller) v1 = {1, v1_path, f[4], f[3]};
      }
    } else if (fstype == "cgroup2" && have_v2 && v2.version == 0) {
      v2 = {2, v2_path, f[4], f[3]};
    }
  }
  if (v1.version == 1) return v1;
  if (v2.version == 2) {
    auto listed = ReadSmallFile(v2.mount_point + "/cgroup.controllers");
    std::istringstream words(listed.value_or(""));
    for (std::string w; words >> w;) {
      if (w == controller) return v2;
    }
  }
  return Hierarchy{};
}

// The cgroup paths from `path` up to `root`, this process's first.
std::vector<std::string> PathsUpTo(const std::string& path, const std::string& root) {
  std::vector<std::string> out;
  std::string p = path;
  for (;;) {
    out.push_back(p);
    if (p == root || p == "/" || p.empty()) break;
    size_t slash = p.find_last_of('/');
    p = slash == 0 ? "/" : p.substr(0, slash);
    if (p.size() < root.size()) break;
  }
  return out;
}

std::string DirectoryOf(const Hierarchy& h, const std::string& cgroup_path) {
  std::string rel = cgroup_path.substr(h.mount_root == "/" ? 0 : h.mount_root.size());
  if (rel == "/") rel.clear();
  return h.mount_point + rel;
}

// The hugetlb controller's name for a page size: 2MB, 1GB, 64KB.
std::string HugetlbSizeName(uint64_t page_bytes) {
  constexpr uint64_t kKiB = 1024, kMiB = kKiB * 1024, kGiB = kMiB * 1024;
  if (page_bytes % kGiB == 0) return std::to_string(page_bytes / kGiB) + "GB";
  if (page_bytes % kMiB == 0) return std::to_string(page_bytes / kMiB) + "MB";
  return std::to_string(page_bytes / kKiB) + "KB";
}

struct ControllerFiles {
  std::string limit, usage, high, stat, reclaimable_key;
};

Result<CgroupLimits> ReadLimits(const std::string& controller, const ControllerFiles& v1,
                                const ControllerFiles& v2) {
  CgroupLimits out;
  out.controller = controller;
  EA_ASSIGN_OR_RETURN(Hierarchy h, FindHierarchy(controller));
  if (h.version == 0) return out;
  // A cgroup outside what the mount shows (a cgroup namespace above ours): nothing readable.
  if (h.cgroup_path.compare(0, h.mount_root.size(), h.mount_root) != 0) return out;
  out.found = true;
  out.own_path = h.cgroup_path;
  out.version = h.version;
  const ControllerFiles& files = h.version == 1 ? v1 : v2;
  for (const std::string& path : PathsUpTo(h.cgroup_path, h.mount_root)) {
    CgroupLevel level;
    level.path = path;
    level.directory = DirectoryOf(h, path);
    level.version = h.version;
    level.limit_file = files.limit;
    EA_ASSIGN_OR_RETURN(auto limit, ReadLimitFile(level.directory + "/" + files.limit));
    level.limit = limit.value_or(kNoCgroupLimit);
    if (!files.high.empty()) {
      EA_ASSIGN_OR_RETURN(auto high, ReadLimitFile(level.directory + "/" + files.high));
      level.high = high.value_or(kNoCgroupLimit);
    }
    EA_ASSIGN_OR_RETURN(auto usage, ReadLimitFile(level.directory + "/" + files.usage));
    level.usage = usage.value_or(0) == kNoCgroupLimit ? 0 : usage.value_or(0);
    if (!files.stat.empty()) {
      auto stat = ReadSmallFile(level.directory + "/" + files.stat);
      if (stat) level.reclaimable = StatValue(*stat, files.reclaimable_key);
    }
    if (level.limit != kNoCgroupLimit && (!out.tightest || level.Room() < out.tightest->Room())) {
      out.tightest = level;
    }
    if (level.high != kNoCgroupLimit &&
        (!out.tightest_high || level.high < out.tightest_high->high)) {
      out.tightest_high = level;
    }
  }
  return out;
}

}  // namespace

uint64_t CgroupLevel::Room() const {
  if (limit == kNoCgroupLimit) return kNoCgroupLimit;
  uint64_t kept = usage - std::min(usage, reclaimable);
  return limit - std::min(limit, kept);
}

Result<CgroupLimits> ReadMemoryCgroupLimits() {
  // v1 memory.stat's total_inactive_file counts the cgroup's descendants too, like its usage.
  return ReadLimits(
      "memory",
      {"memory.limit_in_bytes", "memory.usage_in_bytes", "", "memory.stat", "total_inactive_file"},
      {"memory.max", "memory.current", "memory.high", "memory.stat", "inactive_file"});
}

Result<CgroupLimits> ReadHugetlbCgroupLimits(uint64_t page_bytes) {
  const std::string size = "hugetlb." + HugetlbSizeName(page_bytes);
  return ReadLimits("hugetlb", {size + ".limit_in_bytes", size + ".usage_in_bytes", "", "", ""},
                    {size + ".max", size + ".current", "", "", ""});
}

}  // namespace expert_arena::platform
