// NUMA placement (docs/numa.md): the option's parsing, its resolution against the nodes a
// process may use, the room check, numa_maps parsing, the seed page that keeps interleave
// through MADV_COLLAPSE, and, on this host's own nodes, a mapping bound with mbind.
#include "arena/numa_placement.h"

#include <sys/mman.h>

#include <cstring>

#include "pages/page_backing.h"
#include "common/units.h"
#include "platform/mapping.h"
#include "platform/numa.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using arena::PagePlacement;
using arena::ResolvePlacement;
using platform::MemPolicy;

TEST(NumaOptionTest, ParsesEveryForm) {
  NumaPlacement p;
  int node = 7;
  ASSERT_OK(ParseNumaPlacement("auto", &p, &node));
  EXPECT_EQ(p, NumaPlacement::kAuto);
  EXPECT_EQ(node, -1);
  ASSERT_OK(ParseNumaPlacement("local", &p, &node));
  EXPECT_EQ(p, NumaPlacement::kLocal);
  ASSERT_OK(ParseNumaPlacement("interleave", &p, &node));
  EXPECT_EQ(p, NumaPlacement::kInterleave);
  ASSERT_OK(ParseNumaPlacement("replicate", &p, &node));
  EXPECT_EQ(p, NumaPlacement::kReplicate);
  ASSERT_OK(ParseNumaPlacement("node:12", &p, &node));
  EXPECT_EQ(p, NumaPlacement::kNode);
  EXPECT_EQ(node, 12);
  EXPECT_EQ(NumaPlacementName(p, node), "node:12");
}

TEST(NumaOptionTest, RefusesWhatIsNotAForm) {
  for (const char* bad : {"", "Local", "node:", "node:-1", "node:1x", "node:99999", "node 1",
                          "interleave ", "numa", "node:0x1"}) {
    NumaPlacement p = NumaPlacement::kLocal;
    int node = 3;
    Status s = ParseNumaPlacement(bad, &p, &node);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find(std::string("\"") + bad + "\""), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(std::strncmp(bad, "node:", 5) == 0 ? "node number" : "interleave"),
              std::string::npos)
        << s.message();
  }
}

TEST(NumaPlacementTest, OneNodeIsFirstTouchWhateverIsAsked) {
  for (auto [placement, node] : {std::pair{NumaPlacement::kAuto, -1},
                                 {NumaPlacement::kLocal, -1},
                                 {NumaPlacement::kInterleave, -1},
                                 {NumaPlacement::kNode, 0},
                                 {NumaPlacement::kReplicate, -1}}) {
    auto p = ResolvePlacement(placement, node, {0}, {0});
    ASSERT_OK(p.status());
    EXPECT_EQ(p->policy, MemPolicy::kDefault) << NumaPlacementName(placement, node);
  }
}

TEST(NumaPlacementTest, TwoNodes) {
  auto interleave = ResolvePlacement(NumaPlacement::kInterleave, -1, {0, 1}, {0, 1});
  ASSERT_OK(interleave.status());
  EXPECT_EQ(interleave->policy, MemPolicy::kInterleave);
  EXPECT_EQ(interleave->nodes, (std::vector<int>{0, 1}));
  EXPECT_TRUE(interleave->required);
  auto automatic = ResolvePlacement(NumaPlacement::kAuto, -1, {0, 1}, {0, 1});
  ASSERT_OK(automatic.status());
  EXPECT_EQ(automatic->policy, MemPolicy::kInterleave);
  EXPECT_FALSE(automatic->required) << "auto falls back to first touch where mbind is refused";
  auto bound = ResolvePlacement(NumaPlacement::kNode, 1, {0, 1}, {0, 1});
  ASSERT_OK(bound.status());
  EXPECT_EQ(bound->policy, MemPolicy::kBind);
  EXPECT_EQ(bound->nodes, std::vector<int>{1});
  auto local = ResolvePlacement(NumaPlacement::kLocal, -1, {0, 1}, {0, 1});
  ASSERT_OK(local.status());
  EXPECT_EQ(local->policy, MemPolicy::kDefault);
}

TEST(NumaPlacementTest, ACpusetLimitsTheNodes) {
  // A pod limited to node 1 of a two-node host: interleave is over node 1 only (first touch
  // there), node:0 is refused naming the cpuset's mems.
  auto interleave = ResolvePlacement(NumaPlacement::kInterleave, -1, {1}, {0, 1});
  ASSERT_OK(interleave.status());
  EXPECT_EQ(interleave->policy, MemPolicy::kDefault);
  auto node0 = ResolvePlacement(NumaPlacement::kNode, 0, {1}, {0, 1});
  EXPECT_EQ(node0.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(node0.status().message().find("cpuset's mems are 1"), std::string::npos)
      << node0.status().message();
  auto three = ResolvePlacement(NumaPlacement::kInterleave, -1, {0, 2, 3}, {0, 1, 2, 3});
  ASSERT_OK(three.status());
  EXPECT_EQ(three->nodes, (std::vector<int>{0, 2, 3}));
}

TEST(NumaPlacementTest, ANodeThatIsNotThere) {
  auto p = ResolvePlacement(NumaPlacement::kNode, 4, {0, 1}, {0, 1});
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("no node 4 with memory on this host (nodes 0-1)"),
            std::string::npos)
      << p.status().message();
}

TEST(NumaReplicaTest, TheReplicaPathNamesTheNode) {
  EXPECT_EQ(arena::ReplicaPath("/dev/shm/m.arena", 1), "/dev/shm/m.node1.arena");
  EXPECT_EQ(arena::ReplicaPath("/dev/shm/model", 0), "/dev/shm/model.node0");
  EXPECT_EQ(arena::ReplicaPath("/dev/shm/.arena", 2), "/dev/shm/.arena.node2");
  EXPECT_EQ(arena::ReplicaPath("/a.arena/m", 3), "/a.arena/m.node3");
}

TEST(NumaReplicaTest, TheGpusNodeFirstThenTheCpus) {
  ArenaOptions o;
  o.shared_path = "/dev/shm/m.arena";
  o.numa = NumaPlacement::kReplicate;
  o.gpu = GpuDevice{GpuBackend::kCuda, 5};
  std::string how;
  auto by_gpu = arena::ResolveReplica(o, /*gpu_node=*/1, /*cpu_node=*/0, {0, 1}, &how);
  ASSERT_OK(by_gpu.status());
  EXPECT_EQ(by_gpu->shared_path, "/dev/shm/m.node1.arena");
  EXPECT_EQ(by_gpu->numa, NumaPlacement::kNode);
  EXPECT_EQ(by_gpu->numa_node, 1);
  EXPECT_NE(how.find("cuda:5"), std::string::npos) << how;
  // A GPU on a node this process may not use (a cpuset): the CPUs' node.
  auto by_cpu = arena::ResolveReplica(o, 3, 0, {0, 1}, &how);
  ASSERT_OK(by_cpu.status());
  EXPECT_EQ(by_cpu->shared_path, "/dev/shm/m.node0.arena");
  EXPECT_NE(how.find("CPUs"), std::string::npos) << how;
  auto unknown = arena::ResolveReplica(o, -1, -1, {0, 1}, &how);
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("numactl --cpunodebind"), std::string::npos);
}

TEST(NumaReplicaTest, OneNodeOrAPrivateArenaIsTheArenaItself) {
  ArenaOptions o;
  o.shared_path = "/dev/shm/m.arena";
  o.numa = NumaPlacement::kReplicate;
  std::string how;
  auto one = arena::ResolveReplica(o, -1, 0, {0}, &how);
  ASSERT_OK(one.status());
  EXPECT_EQ(one->shared_path, "/dev/shm/m.arena");
  EXPECT_EQ(one->numa, NumaPlacement::kLocal);
  o.shared_path.clear();
  auto priv = arena::ResolveReplica(o, 1, 1, {0, 1}, &how);
  ASSERT_OK(priv.status());
  EXPECT_EQ(priv->numa, NumaPlacement::kLocal);
  o.numa = NumaPlacement::kInterleave;
  o.shared_path = "/dev/shm/m.arena";
  auto other = arena::ResolveReplica(o, 1, 1, {0, 1}, &how);
  ASSERT_OK(other.status());
  EXPECT_EQ(other->shared_path, "/dev/shm/m.arena") << "only replicate changes the path";
}

TEST(NumaPlacementTest, ThisHostsNodesResolve) {
  ArenaOptions options;
  options.numa = NumaPlacement::kNode;
  options.numa_node = platform::AllowedMemoryNodes().front();
  ASSERT_OK(ResolvePlacement(options).status());
  options.numa_node = 4095;
  EXPECT_EQ(ResolvePlacement(options).status().code(), StatusCode::kInvalidArgument);
  options.numa_node = -1;
  EXPECT_EQ(ResolvePlacement(options).status().code(), StatusCode::kInvalidArgument);
}

TEST(NumaRoomTest, ABoundNodeWithoutRoomIsRefusedNamingItsFreeMemory) {
  PagePlacement bound{MemPolicy::kBind, {1}, true, "node:1"};
  Status s = arena::CheckRoomOnNode(bound, 2 * kGiB, 512 * kMiB, "MemFree of node1/meminfo",
                                    "/dev/shm/a.arena");
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  for (const char* part : {"/dev/shm/a.arena", "node 1", "2.00 GiB", "512.0 MiB free",
                           "MemFree of node1/meminfo", "--numa interleave"}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " in " << s.message();
  }
  EXPECT_OK(arena::CheckRoomOnNode(bound, 2 * kGiB, 2 * kGiB, "", ""));
  PagePlacement interleave{MemPolicy::kInterleave, {0, 1}, true, "interleave"};
  // Interleave falls back to other nodes: no per-node room is needed.
  EXPECT_OK(arena::CheckRoomOnNode(interleave, 2 * kGiB, 0, "", ""));
}

TEST(NodeListTest, ParsesAndFormatsTheKernelsLists) {
  auto nodes = platform::ParseNodeList("0-2,5,7-8\n");
  ASSERT_OK(nodes.status());
  EXPECT_EQ(*nodes, (std::vector<int>{0, 1, 2, 5, 7, 8}));
  EXPECT_EQ(platform::FormatNodeList(*nodes), "0-2,5,7-8");
  EXPECT_TRUE(platform::ParseNodeList("")->empty());
  for (const char* bad : {"a", "1-", "-1", "2-1", "1,", "0-99999", "1,,2"}) {
    EXPECT_FALSE(platform::ParseNodeList(bad).ok()) << bad;
  }
}

TEST(NumaMapsTest, CountsPagesOnEachNodeInBytes) {
  auto small = platform::ParseNumaMapsLine(
      "7f0000000000 interleave:0-1 file=/dev/shm/a.arena dirty=10 mapped=3072 N0=1536 N1=1536 "
      "kernelpagesize_kB=4");
  EXPECT_EQ(small.at(0), 1536 * 4 * kKiB);
  EXPECT_EQ(small.at(1), 1536 * 4 * kKiB);
  auto huge = platform::ParseNumaMapsLine(
      "7f0000000000 default file=/mnt/huge/a.arena huge dirty=6 N1=6 kernelpagesize_kB=2048");
  EXPECT_EQ(huge.size(), 1u);
  EXPECT_EQ(huge.at(1), 6 * 2 * kMiB);
  EXPECT_TRUE(platform::ParseNumaMapsLine("7f0000000000 default").empty());
}

TEST(SeedPageTest, InterleaveGivesBlockINodeIModN) {
  constexpr uint64_t kPage = 4096;
  EXPECT_EQ(pages::SeedPageOffset(6 * kHugePageBytes, 1, kPage), 6 * kHugePageBytes);
  for (unsigned n : {2u, 3u, 4u, 7u}) {
    for (uint64_t block = 0; block < 64; ++block) {
      const uint64_t at = block * kHugePageBytes;
      const uint64_t seed = pages::SeedPageOffset(at, n, kPage);
      ASSERT_GE(seed, at);
      ASSERT_LT(seed, at + kHugePageBytes);
      // The kernel's interleave of small pages: node (page index mod n).
      EXPECT_EQ((seed / kPage) % n, block % n) << "n " << n << " block " << block;
    }
  }
}

TEST(NumaStartLineTest, NodesInTheUnitThatShowsThem) {
  ArenaReport r;
  EXPECT_EQ(arena::NumaStartLinePart(r), "") << "a one-node host adds nothing";
  r.numa = "interleave";
  r.numa_policy = "interleave:0-1";
  r.numa_nodes = {{0, 7 * kMiB}, {1, 3 * kGiB}};
  EXPECT_EQ(arena::NumaStartLinePart(r),
            "; numa: interleave, node0 7.0 MiB, node1 3.00 GiB (interleave:0-1)");
}

TEST(NumaKernelTest, AMappingBoundToAnAllowedNodeIsThere) {
  const int node = platform::AllowedMemoryNodes().front();
  auto mapping = platform::Mapping::MapAnonymous(8 * kMiB, kHugePageBytes);
  ASSERT_OK(mapping.status());
  Status bound = platform::BindRange(mapping->data(), mapping->size(), MemPolicy::kBind, {node},
                                     "test mapping");
  if (bound.code() == StatusCode::kPermission || bound.code() == StatusCode::kUnsupported) {
    GTEST_SKIP() << "mbind refused here (a seccomp profile, no CONFIG_NUMA): " << bound.message();
  }
  ASSERT_OK(bound);
  std::memset(mapping->data(), 1, mapping->size());
  auto bytes = platform::MappingBytesPerNode(mapping->data());
  ASSERT_OK(bytes.status());
  if (bytes->empty()) GTEST_SKIP() << "no /proc/self/numa_maps (CONFIG_NUMA off)";
  uint64_t total = 0;
  for (auto& [n, b] : *bytes) total += b;
  EXPECT_EQ(total, mapping->size());
  EXPECT_EQ((*bytes)[node], mapping->size());
  ArenaReport r;
  arena::MeasureNuma(mapping->data(), r);
  if (platform::MemoryNodes().size() > 1) {
    EXPECT_EQ(r.numa_policy, "bind:" + std::to_string(node));
  } else {
    EXPECT_TRUE(r.numa_nodes.empty()) << "nothing measured on a one-node host";
  }
}

TEST(NumaKernelTest, AThreadPolicyIsRestored) {
  const int node = platform::AllowedMemoryNodes().front();
  Status set = platform::SetThreadPolicy(MemPolicy::kBind, {node}, "test");
  if (set.code() == StatusCode::kPermission || set.code() == StatusCode::kUnsupported) {
    GTEST_SKIP() << set.message();
  }
  ASSERT_OK(set);
  ASSERT_OK(platform::RestoreThreadPolicy("test"));
  // The thread is back on first touch: a new mapping shows "default".
  auto mapping = platform::Mapping::MapAnonymous(2 * kMiB, kHugePageBytes);
  ASSERT_OK(mapping.status());
  std::memset(mapping->data(), 1, mapping->size());
  ArenaReport r;
  arena::MeasureNuma(mapping->data(), r);
  if (platform::MemoryNodes().size() > 1) {
    EXPECT_EQ(r.numa_policy, "default");
  }
}

}  // namespace
}  // namespace expert_arena
