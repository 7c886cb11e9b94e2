#include "arena/numa_placement.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>

#include "common/units.h"

namespace expert_arena {

Status ParseNumaPlacement(std::string_view text, NumaPlacement* placement, int* node) {
  *node = -1;
  if (text == "auto") {
    *placement = NumaPlacement::kAuto;
  } else if (text == "local") {
    *placement = NumaPlacement::kLocal;
  } else if (text == "interleave") {
    *placement = NumaPlacement::kInterleave;
  } else if (text == "replicate") {
    *placement = NumaPlacement::kReplicate;
  } else if (text.rfind("node:", 0) == 0) {
    std::string_view number = text.substr(5);
    int n = -1;
    auto r = std::from_chars(number.data(), number.data() + number.size(), n);
    if (number.empty() || number.size() > 4 || r.ec != std::errc() ||
        r.ptr != number.data() + number.size() || n < 0) {
      return InvalidArgument("numa placement \"" + std::string(text) +
                             "\": node:N wants a node number N (0, 1, ...)");
    }
    *placement = NumaPlacement::kNode;
    *node = n;
  } else {
    return InvalidArgument("numa placement \"" + std::string(text) +
                           "\": expected auto, local, interleave, node:N or replicate");
  }
  return Status::Ok();
}

std::string NumaPlacementName(NumaPlacement placement, int node) {
  switch (placement) {
    case NumaPlacement::kAuto:
      return "auto";
    case NumaPlacement::kLocal:
      return "local";
    case NumaPlacement::kInterleave:
      return "interleave";
    case NumaPlacement::kNode:
      return "node:" + std::to_string(node);
    case NumaPlacement::kReplicate:
      return "replicate";
  }
  return "auto";
}

namespace arena {

Result<PagePlacement> ResolvePlacement(const ArenaOptions& options) {
  if (options.numa == NumaPlacement::kNode && options.numa_node < 0) {
    return InvalidArgument("--numa node:N without a node number");
  }
  return pages::ResolvePlacement(options.numa, options.numa_node, platform::AllowedMemoryNodes(),
                                 platform::MemoryNodes());
}

std::string ReplicaPath(const std::string& path, int node) {
  const std::string suffix = ".node" + std::to_string(node);
  constexpr std::string_view kExtension = ".arena";
  const size_t slash = path.rfind('/');
  const std::string_view name =
      std::string_view(path).substr(slash == std::string::npos ? 0 : slash + 1);
  if (name.size() > kExtension.size() &&
      name.substr(name.size() - kExtension.size()) == kExtension) {
    return path.substr(0, path.size() - kExtension.size()) + suffix + std::string(kExtension);
  }
  return path + suffix;
}

Result<ArenaOptions> ResolveReplica(const ArenaOptions& options, int gpu_node, int cpu_node,
                                    const std::vector<int>& allowed, std::string* how) {
  ArenaOptions out = options;
  how->clear();
  if (options.numa != NumaPlacement::kReplicate) return out;
  if (options.shared_path.empty() || allowed.size() <= 1) {
    out.numa = NumaPlacement::kLocal;
    return out;
  }
  auto in = [&](int n) { return std::find(allowed.begin(), allowed.end(), n) != allowed.end(); };
  int node = -1;
  if (gpu_node >= 0 && in(gpu_node)) {
    node = gpu_node;
    *how = "replica of node " + std::to_string(node) + ", the node of " + options.gpu.ToString();
  } else if (cpu_node >= 0 && in(cpu_node)) {
    node = cpu_node;
    *how = "replica of node " + std::to_string(node) + ", the node of this engine's CPUs";
  } else {
    return InvalidArgument(
        "--numa replicate: cannot tell this engine's node (no GPU with a NUMA node, and its CPUs "
        "are not on one of nodes " +
        platform::FormatNodeList(allowed) +
        "); pin it (numactl --cpunodebind=N) or use --numa node:N with a path per node");
  }
  out.shared_path = ReplicaPath(options.shared_path, node);
  out.numa = NumaPlacement::kNode;
  out.numa_node = node;
  return out;
}

Status CheckRoomOnNode(const PagePlacement& placement, uint64_t bytes, uint64_t free_bytes,
                       const std::string& free_source, const std::string& path) {
  if (placement.policy != platform::MemPolicy::kBind || placement.nodes.size() != 1) {
    return Status::Ok();
  }
  if (free_bytes >= bytes) return Status::Ok();
  const std::string node = std::to_string(placement.nodes[0]);
  return NoSpace(path + ": --numa node:" + node + " needs " + FormatBytes(bytes) +
                 " on node " + node + ", which has " + FormatBytes(free_bytes) + " free (" +
                 free_source + "); free memory there, or use --numa interleave or another node");
}

namespace {

// MemFree plus the page cache the kernel can drop (FilePages that is not Shmem): a node whose
// memory holds the model files just read has room for the arena.
Result<uint64_t> NodeRoomBytes(int node, std::string* source) {
  const std::string path = "/sys/devices/system/node/node" + std::to_string(node) + "/meminfo";
  std::ifstream in(path);
  if (!in) return ErrnoStatus(errno, "open", path);
  uint64_t free = 0, file = 0, shmem = 0;
  std::string line;
  while (std::getline(in, line)) {
    auto field = [&](const char* key, uint64_t* out) {
      size_t at = line.find(key);
      if (at == std::string::npos) return;
      *out = std::strtoull(line.c_str() + at + std::strlen(key), nullptr, 10) * kKiB;
    };
    field("MemFree:", &free);
    field("FilePages:", &file);
    field("Shmem:", &shmem);
  }
  *source = "MemFree " + FormatBytes(free) + " and page cache " +
            FormatBytes(file > shmem ? file - shmem : 0) + " of " + path;
  return free + (file > shmem ? file - shmem : 0);
}

}  // namespace

Status CheckRoomOnNode(const PagePlacement& placement, bool hugetlbfs, uint64_t bytes,
                       uint64_t page_bytes, const std::string& path) {
  if (placement.policy != platform::MemPolicy::kBind || placement.nodes.size() != 1) {
    return Status::Ok();
  }
  const int node = placement.nodes[0];
  std::string source;
  uint64_t room = 0;
  if (hugetlbfs) {
    auto pages = platform::NodeFreeHugePages(node, page_bytes);
    if (!pages.ok()) return Status::Ok();  // no per-node pool to read: fallocate will say
    room = *pages * page_bytes;
    source = std::to_string(*pages) + " free pages in /sys/devices/system/node/node" +
             std::to_string(node) + "/hugepages/hugepages-" + std::to_string(page_bytes / kKiB) +
             "kB";
  } else {
    auto r = NodeRoomBytes(node, &source);
    if (!r.ok()) return Status::Ok();
    room = *r;
  }
  return CheckRoomOnNode(placement, bytes, room, source, path);
}

void MeasureNuma(const void* start, ArenaReport& report) {
  if (platform::MemoryNodes().size() <= 1) return;
  std::ifstream in("/proc/self/numa_maps");
  char prefix[32];
  std::snprintf(prefix, sizeof prefix, "%lx ", reinterpret_cast<unsigned long>(start));
  std::string line;
  while (in && std::getline(in, line)) {
    if (line.rfind(prefix, 0) != 0) continue;
    size_t policy_at = line.find(' ') + 1;
    size_t policy_end = line.find(' ', policy_at);
    report.numa_policy = line.substr(policy_at, policy_end - policy_at);
    report.numa_nodes.clear();
    for (int node : platform::MemoryNodes()) report.numa_nodes.push_back({node, 0});
    for (auto& [node, bytes] : platform::ParseNumaMapsLine(line)) {
      // A copy for the lambda: clang 14 cannot capture a structured binding.
      const int wanted = node;
      auto it = std::find_if(report.numa_nodes.begin(), report.numa_nodes.end(),
                             [wanted](const NumaNodeBytes& n) { return n.node == wanted; });
      if (it == report.numa_nodes.end()) {
        report.numa_nodes.push_back({node, bytes});
      } else {
        it->bytes = bytes;
      }
    }
    return;
  }
}

std::string NumaStartLinePart(const ArenaReport& report) {
  if (report.numa_nodes.empty() && report.numa_note.empty()) return "";
  std::string part = "; numa:";
  if (!report.numa.empty()) part += " " + report.numa + ",";
  for (const NumaNodeBytes& n : report.numa_nodes) {
    // GiB where the arena has GiB; a small arena in MiB (FormatBytes), never "0.00 GiB".
    part += " node" + std::to_string(n.node) + " " + FormatBytes(n.bytes) + ",";
  }
  if (part.back() == ',') part.pop_back();
  if (!report.numa_policy.empty()) part += " (" + report.numa_policy + ")";
  if (!report.numa_note.empty()) part += "; " + report.numa_note;
  return part;
}

}  // namespace arena
}  // namespace expert_arena
