#include "platform/numa.h"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/units.h"

namespace expert_arena::platform {

namespace {

// The kernel's mode numbers (uapi/linux/mempolicy.h), fixed since 2.6.
constexpr int kMpolDefault = 0;
constexpr int kMpolBind = 2;
constexpr int kMpolInterleave = 3;
constexpr int kMaxNode = 4096;  // CONFIG_NODES_SHIFT is at most 10 (1024 nodes) on x86-64
constexpr size_t kMaskWords = kMaxNode / 64;

int ModeOf(MemPolicy policy) {
  switch (policy) {
    case MemPolicy::kBind:
      return kMpolBind;
    case MemPolicy::kInterleave:
      return kMpolInterleave;
    case MemPolicy::kDefault:
      return kMpolDefault;
  }
  return kMpolDefault;
}

const char* PolicyName(MemPolicy policy) {
  switch (policy) {
    case MemPolicy::kBind:
      return "bind";
    case MemPolicy::kInterleave:
      return "interleave";
    case MemPolicy::kDefault:
      return "default";
  }
  return "default";
}

std::vector<unsigned long> MaskOf(const std::vector<int>& nodes) {
  std::vector<unsigned long> mask(kMaskWords, 0);
  for (int n : nodes) {
    if (n >= 0 && n < kMaxNode) mask[n / 64] |= 1UL << (n % 64);
  }
  return mask;
}

std::string ReadText(const std::string& path, bool* ok) {
  std::ifstream in(path);
  *ok = static_cast<bool>(in);
  if (!in) return "";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\t')) s.pop_back();
  size_t b = 0;
  while (b < s.size() && (s[b] == ' ' || s[b] == '\t')) ++b;
  return s.substr(b);
}

bool ParseInt(std::string_view s, int* out) {
  if (s.empty()) return false;
  auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

}  // namespace

Result<std::vector<int>> ParseNodeList(std::string_view text) {
  std::vector<int> nodes;
  std::string t = Trim(std::string(text));
  std::string_view rest = t;
  auto bad = [&] {
    return InvalidArgument("\"" + t + "\" is not a node list such as 0-1,3");
  };
  while (!rest.empty()) {
    size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    if (comma != std::string_view::npos && rest.empty()) return bad();
    size_t dash = item.find('-');
    int lo = 0, hi = 0;
    if (dash == std::string_view::npos) {
      if (!ParseInt(item, &lo)) return bad();
      hi = lo;
    } else if (!ParseInt(item.substr(0, dash), &lo) || !ParseInt(item.substr(dash + 1), &hi)) {
      return bad();
    }
    if (lo < 0 || hi < lo || hi >= kMaxNode) return bad();
    for (int n = lo; n <= hi; ++n) nodes.push_back(n);
  }
  std::sort(nodes.begin(), nodes.end());
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  return nodes;
}

std::string FormatNodeList(const std::vector<int>& nodes) {
  std::string out;
  for (size_t i = 0; i < nodes.size();) {
    size_t j = i;
    while (j + 1 < nodes.size() && nodes[j + 1] == nodes[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(nodes[i]);
    if (j > i) {
      // Appended, not "-" + std::to_string(): g++ 12 -O3 false -Wrestrict (GCC PR 105651).
      out += '-';
      out += std::to_string(nodes[j]);
    }
    i = j + 1;
  }
  return out;
}

std::vector<int> MemoryNodes() {
  for (const char* file :
       {"/sys/devices/system/node/has_memory", "/sys/devices/system/node/online"}) {
    bool ok = false;
    std::string text = ReadText(file, &ok);
    if (!ok) continue;
    auto nodes = ParseNodeList(text);
    if (nodes.ok() && !nodes->empty()) return *nodes;
  }
  return {0};
}

std::vector<int> AllowedMemoryNodes() {
  std::vector<int> memory = MemoryNodes();
  std::ifstream in("/proc/self/status");
  std::string line;
  while (in && std::getline(in, line)) {
    constexpr std::string_view kKey = "Mems_allowed_list:";
    if (line.rfind(kKey, 0) != 0) continue;
    auto allowed = ParseNodeList(std::string_view(line).substr(kKey.size()));
    if (!allowed.ok()) break;
    std::vector<int> both;
    std::set_intersection(memory.begin(), memory.end(), allowed->begin(), allowed->end(),
                          std::back_inserter(both));
    return both.empty() ? memory : both;
  }
  return memory;
}

namespace {

Result<uint64_t> ReadNodeNumber(const std::string& path) {
  bool ok = false;
  std::string text = ReadText(path, &ok);
  if (!ok) return ErrnoStatus(errno, "open", path);
  return std::strtoull(text.c_str(), nullptr, 10);
}

}  // namespace

Result<uint64_t> NodeFreeHugePages(int node, uint64_t page_bytes) {
  return ReadNodeNumber("/sys/devices/system/node/node" + std::to_string(node) +
                        "/hugepages/hugepages-" + std::to_string(page_bytes / kKiB) +
                        "kB/free_hugepages");
}

namespace {

// How many CPUs of this thread's affinity each memory node holds ({} when unknown).
std::map<int, int> CurrentCpusPerNode() {
  std::map<int, int> counts;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return counts;
  for (int node : MemoryNodes()) {
    bool ok = false;
    std::string text =
        ReadText("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist", &ok);
    if (!ok) continue;
    auto cpus = ParseNodeList(text);  // the same list format
    if (!cpus.ok()) continue;
    int count = 0;
    for (int cpu : *cpus) {
      if (cpu < CPU_SETSIZE && CPU_ISSET(cpu, &set)) ++count;
    }
    if (count > 0) counts[node] = count;
  }
  return counts;
}

}  // namespace

int NodeOfCurrentCpus() {
  int best = -1, best_count = 0;
  for (const auto& [node, count] : CurrentCpusPerNode()) {
    if (count > best_count) best = node, best_count = count;
  }
  return best;
}

std::vector<int> NodesOfCurrentCpus() {
  std::vector<int> nodes;
  for (const auto& entry : CurrentCpusPerNode()) nodes.push_back(entry.first);
  return nodes;
}

int NodeOfPciDevice(const std::string& bus_id) {
  if (bus_id.empty() || bus_id.find('/') != std::string::npos) return -1;
  bool ok = false;
  std::string text = ReadText("/sys/bus/pci/devices/" + bus_id + "/numa_node", &ok);
  int node = -1;
  if (!ok || !ParseInt(Trim(text), &node)) return -1;
  return node;
}

Status BindRange(void* start, uint64_t length, MemPolicy policy, const std::vector<int>& nodes,
                 const std::string& what) {
  std::vector<unsigned long> mask = MaskOf(nodes);
  long rc = ::syscall(SYS_mbind, start, length, ModeOf(policy),
                      policy == MemPolicy::kDefault ? nullptr : mask.data(),
                      policy == MemPolicy::kDefault ? 0UL : kMaxNode + 1UL, 0U);
  if (rc != 0) {
    return ErrnoStatus(errno, std::string("mbind ") + PolicyName(policy) + " to nodes " +
                                  FormatNodeList(nodes) + " of",
                       what);
  }
  return Status::Ok();
}

namespace {
struct SavedPolicy {
  bool saved = false;
  int mode = kMpolDefault;
  std::vector<unsigned long> mask;
};
thread_local SavedPolicy saved_policy;
}  // namespace

Status SetThreadPolicy(MemPolicy policy, const std::vector<int>& nodes, const std::string& what) {
  SavedPolicy before;
  before.mask.assign(kMaskWords, 0);
  if (::syscall(SYS_get_mempolicy, &before.mode, before.mask.data(), kMaxNode + 1UL, nullptr,
                0UL) != 0) {
    return ErrnoStatus(errno, "get_mempolicy for", what);
  }
  before.saved = true;
  std::vector<unsigned long> mask = MaskOf(nodes);
  long rc = ::syscall(SYS_set_mempolicy, ModeOf(policy),
                      policy == MemPolicy::kDefault ? nullptr : mask.data(),
                      policy == MemPolicy::kDefault ? 0UL : kMaxNode + 1UL);
  if (rc != 0) {
    return ErrnoStatus(errno, std::string("set_mempolicy ") + PolicyName(policy) +
                                  " to nodes " + FormatNodeList(nodes) + " for",
                       what);
  }
  saved_policy = std::move(before);
  return Status::Ok();
}

Status RestoreThreadPolicy(const std::string& what) {
  if (!saved_policy.saved) return Status::Ok();
  SavedPolicy before = std::move(saved_policy);
  saved_policy = SavedPolicy();
  // The mode read back may carry MPOL_F_* flags in its high bits; they go back as they were.
  const bool no_mask = (before.mode & 0xff) == kMpolDefault;
  if (::syscall(SYS_set_mempolicy, before.mode, no_mask ? nullptr : before.mask.data(),
                no_mask ? 0UL : kMaxNode + 1UL) != 0) {
    return ErrnoStatus(errno, "set_mempolicy (restoring the thread's own) for", what);
  }
  return Status::Ok();
}

std::map<int, uint64_t> ParseNumaMapsLine(std::string_view line) {
  std::map<int, uint64_t> pages;
  uint64_t page_kb = 4;
  size_t at = 0;
  while (at < line.size()) {
    size_t end = line.find(' ', at);
    if (end == std::string_view::npos) end = line.size();
    std::string_view field = line.substr(at, end - at);
    at = end + 1;
    size_t eq = field.find('=');
    if (eq == std::string_view::npos) continue;
    std::string_view key = field.substr(0, eq), value = field.substr(eq + 1);
    uint64_t number = 0;
    auto r = std::from_chars(value.data(), value.data() + value.size(), number);
    if (r.ec != std::errc() || r.ptr != value.data() + value.size()) continue;
    int node = 0;
    if (key == "kernelpagesize_kB") {
      page_kb = number;
    } else if (key.size() > 1 && key[0] == 'N' && ParseInt(key.substr(1), &node)) {
      pages[node] += number;
    }
  }
  for (auto& [node, count] : pages) count *= page_kb * kKiB;
  return pages;
}

Result<std::map<int, uint64_t>> MappingBytesPerNode(const void* start) {
  std::ifstream in("/proc/self/numa_maps");
  if (!in) return std::map<int, uint64_t>{};  // CONFIG_NUMA off
  char prefix[32];
  std::snprintf(prefix, sizeof prefix, "%lx ", reinterpret_cast<unsigned long>(start));
  // One line per mapping (VMA). The arena is one mapping (one policy, one protection).
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) return ParseNumaMapsLine(line);
  }
  return NotFound("no mapping at the arena's address in /proc/self/numa_maps");
}

std::map<int, uint64_t> MappingsBytesPerNode(const std::vector<const void*>& starts) {
  std::map<int, uint64_t> total;
  std::ifstream in("/proc/self/numa_maps");
  if (!in) return total;
  std::vector<std::string> prefixes;
  for (const void* start : starts) {
    char prefix[32];
    std::snprintf(prefix, sizeof prefix, "%lx ", reinterpret_cast<unsigned long>(start));
    prefixes.emplace_back(prefix);
  }
  std::string line;
  while (std::getline(in, line)) {
    const size_t space = line.find(' ');
    if (space == std::string::npos) continue;
    const std::string_view head(line.data(), space + 1);
    if (std::find(prefixes.begin(), prefixes.end(), head) == prefixes.end()) continue;
    for (const auto& [node, bytes] : ParseNumaMapsLine(line)) total[node] += bytes;
  }
  return total;
}

}  // namespace expert_arena::platform
