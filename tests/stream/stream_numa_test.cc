// NUMA placement of a stream producer's segments (StreamOptions::numa, docs/numa.md): the
// option resolved against a producer's CPUs and the nodes it may use, the refusals, and, on
// this host's own nodes, where a producer's segments land (read back from numa_maps). On a
// one-node host the last part checks that everything is on node 0 and that the stats say so;
// tests/kernel/qemu_numa.sh runs this binary in guests with two nodes, where it checks that a
// producer pinned to the last node puts its segments there, node:0 puts them on node 0 and
// interleave splits them.
#include <sched.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <vector>

#include "common/units.h"
#include "expert_arena/stream.h"
#include "platform/numa.h"
#include "stream/segment_placement.h"
#include "stream_test_util.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using platform::MemPolicy;
using stream::ResolveSegmentPlacement;
using testing::StreamDirs;

TEST(StreamNumaResolveTest, AutoIsTheNodeOfTheProducersCpus) {
  ASSERT_OK_AND_ASSIGN(auto p, ResolveSegmentPlacement(NumaPlacement::kAuto, -1, {1}, {0, 1},
                                                       {0, 1}));
  EXPECT_EQ(p.pages.policy, MemPolicy::kBind);
  EXPECT_EQ(p.pages.nodes, std::vector<int>{1});
  EXPECT_FALSE(p.pages.required);  // a kernel that refuses mbind leaves first touch
  EXPECT_EQ(p.node, 1);
  EXPECT_EQ(p.description, "node:1 (the producer's node)");
}

TEST(StreamNumaResolveTest, AutoOfAProducerOnSeveralNodesIsFirstTouch) {
  ASSERT_OK_AND_ASSIGN(auto p, ResolveSegmentPlacement(NumaPlacement::kAuto, -1, {0, 1},
                                                       {0, 1}, {0, 1}));
  EXPECT_EQ(p.pages.policy, MemPolicy::kDefault);
  EXPECT_EQ(p.node, -1);
  EXPECT_NE(p.description.find("span nodes 0-1"), std::string::npos) << p.description;
  // CPUs only on a node the cpuset does not allow: unknown, first touch.
  ASSERT_OK_AND_ASSIGN(p, ResolveSegmentPlacement(NumaPlacement::kAuto, -1, {0}, {1, 2},
                                                  {0, 1, 2}));
  EXPECT_EQ(p.pages.policy, MemPolicy::kDefault);
  EXPECT_NE(p.description.find("unknown"), std::string::npos) << p.description;
}

TEST(StreamNumaResolveTest, OneNodeIsFirstTouchOnThatNode) {
  for (NumaPlacement n : {NumaPlacement::kAuto, NumaPlacement::kLocal,
                          NumaPlacement::kInterleave, NumaPlacement::kNode}) {
    ASSERT_OK_AND_ASSIGN(auto p, ResolveSegmentPlacement(n, 0, {0}, {0}, {0}));
    EXPECT_EQ(p.pages.policy, MemPolicy::kDefault) << NumaPlacementName(n, 0);
    EXPECT_EQ(p.node, 0) << NumaPlacementName(n, 0);
  }
  ASSERT_OK_AND_ASSIGN(auto p, ResolveSegmentPlacement(NumaPlacement::kAuto, -1, {0}, {0}, {0}));
  EXPECT_EQ(p.description, "node:0 (the producer's node, the only one)");
}

TEST(StreamNumaResolveTest, InterleaveNodeAndLocal) {
  ASSERT_OK_AND_ASSIGN(auto p, ResolveSegmentPlacement(NumaPlacement::kInterleave, -1, {1},
                                                       {0, 1}, {0, 1}));
  EXPECT_EQ(p.pages.policy, MemPolicy::kInterleave);
  EXPECT_EQ(p.pages.nodes, (std::vector<int>{0, 1}));
  EXPECT_TRUE(p.pages.required);
  EXPECT_EQ(p.node, -1);
  EXPECT_EQ(p.description, "interleave over nodes 0-1");
  ASSERT_OK_AND_ASSIGN(p, ResolveSegmentPlacement(NumaPlacement::kNode, 0, {1}, {0, 1}, {0, 1}));
  EXPECT_EQ(p.pages.policy, MemPolicy::kBind);
  EXPECT_EQ(p.pages.nodes, std::vector<int>{0});
  EXPECT_TRUE(p.pages.required);
  EXPECT_EQ(p.node, 0);
  ASSERT_OK_AND_ASSIGN(p, ResolveSegmentPlacement(NumaPlacement::kLocal, -1, {1}, {0, 1}, {0, 1}));
  EXPECT_EQ(p.pages.policy, MemPolicy::kDefault);
  EXPECT_EQ(p.node, -1);
}

TEST(StreamNumaResolveTest, RefusesReplicateAndNodesItMayNotUse) {
  auto r = ResolveSegmentPlacement(NumaPlacement::kReplicate, -1, {0}, {0, 1}, {0, 1});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("no replica per node"), std::string::npos);
  r = ResolveSegmentPlacement(NumaPlacement::kNode, 4, {0}, {0, 1}, {0, 1});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no node 4 with memory on this host (nodes 0-1)"),
            std::string::npos)
      << r.status().message();
  r = ResolveSegmentPlacement(NumaPlacement::kNode, 0, {1}, {1}, {0, 1});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cpuset's mems are 1"), std::string::npos)
      << r.status().message();
  r = ResolveSegmentPlacement(NumaPlacement::kNode, -1, {0}, {0}, {0});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("without a node number"), std::string::npos);
}

TEST(StreamNumaProducerTest, CreateRefusesReplicateAndANodeThatIsNotThere) {
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.numa = NumaPlacement::kReplicate;
  auto r = StreamProducer::Create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  const std::vector<int> nodes = platform::MemoryNodes();
  o.numa = NumaPlacement::kNode;
  o.numa_node = nodes.back() + 1;
  r = StreamProducer::Create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no node " + std::to_string(o.numa_node)),
            std::string::npos)
      << r.status().message();
  EXPECT_TRUE(dirs.remaining().empty());
}

// The CPUs of `node` (its sysfs cpulist).
std::vector<int> CpusOfNode(int node) {
  std::ifstream in("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  auto cpus = platform::ParseNodeList(text);
  return cpus.ok() ? *cpus : std::vector<int>{};
}

// Pins the calling thread to `cpus` for its lifetime, restoring the affinity it had.
class PinnedThread {
 public:
  explicit PinnedThread(const std::vector<int>& cpus) {
    CPU_ZERO(&before_);
    ok_ = sched_getaffinity(0, sizeof before_, &before_) == 0;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : cpus) CPU_SET(cpu, &set);
    ok_ = ok_ && !cpus.empty() && sched_setaffinity(0, sizeof set, &set) == 0;
  }
  ~PinnedThread() { (void)sched_setaffinity(0, sizeof before_, &before_); }
  bool ok() const { return ok_; }

 private:
  cpu_set_t before_;
  bool ok_ = false;
};

// A producer pinned to the CPUs of `cpu_node` with `numa` puts two tensors (one segment and a
// dedicated one); returns its stats and where the segments' pages are.
void PutFromNode(const StreamDirs& dirs, int cpu_node, NumaPlacement numa, int numa_node,
                 StreamStats* stats, std::vector<NumaNodeBytes>* where) {
  PinnedThread pin(CpusOfNode(cpu_node));
  ASSERT_TRUE(pin.ok()) << "cannot pin to node " << cpu_node << "'s CPUs";
  StreamOptions o = dirs.Producer();
  o.numa = numa;
  o.numa_node = numa_node;
  o.huge = HugePages::kAuto;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  std::vector<std::byte> small(4 * kMiB, std::byte{1});
  std::vector<std::byte> large(12 * kMiB, std::byte{2});  // more than a segment: dedicated
  ASSERT_OK(producer.Put("small", small, {}).status());
  ASSERT_OK(producer.Put("large", large, {}).status());
  ASSERT_OK_AND_ASSIGN(*stats, producer.Stats());
  EXPECT_EQ(stats->dedicated_segments, 1u);
  *where = producer.SegmentNodeBytes();
}

uint64_t BytesOn(const std::vector<NumaNodeBytes>& where, int node) {
  for (const NumaNodeBytes& n : where) {
    if (n.node == node) return n.bytes;
  }
  return 0;
}
uint64_t Total(const std::vector<NumaNodeBytes>& where) {
  uint64_t t = 0;
  for (const NumaNodeBytes& n : where) t += n.bytes;
  return t;
}

TEST(StreamNumaKernelTest, SegmentsOnTheProducersNode) {
  const std::vector<int> nodes = platform::AllowedMemoryNodes();
  ASSERT_FALSE(nodes.empty());
  const int mine = nodes.back();  // node 1 on two nodes: not where first touch would be anyway
  if (CpusOfNode(mine).empty()) GTEST_SKIP() << "node " << mine << " has no CPUs";
  StreamDirs dirs;
  StreamStats stats;
  std::vector<NumaNodeBytes> where;
  ASSERT_NO_FATAL_FAILURE(PutFromNode(dirs, mine, NumaPlacement::kAuto, -1, &stats, &where));
  EXPECT_EQ(stats.numa_node, mine) << stats.numa;
  EXPECT_NE(stats.numa.find("node:" + std::to_string(mine) + " (the producer's node"),
            std::string::npos)
      << stats.numa;
  if (where.empty()) GTEST_SKIP() << "no /proc/self/numa_maps (a kernel without NUMA)";
  const uint64_t total = Total(where);
  // Two segment files: 2 MiB header + 8 MiB, 2 MiB header + 12 MiB.
  EXPECT_GE(total, 24 * kMiB);
  EXPECT_GE(BytesOn(where, mine) * 100, total * 95)
      << BytesOn(where, mine) << " of " << total << " bytes on node " << mine << "; "
      << stats.numa;
  EXPECT_TRUE(dirs.remaining().empty());
}

TEST(StreamNumaKernelTest, NodeZeroFromTheLastNodesCpus) {
  const std::vector<int> nodes = platform::AllowedMemoryNodes();
  const int cpu_node = nodes.back();
  if (CpusOfNode(cpu_node).empty()) GTEST_SKIP() << "node " << cpu_node << " has no CPUs";
  StreamDirs dirs;
  StreamStats stats;
  std::vector<NumaNodeBytes> where;
  ASSERT_NO_FATAL_FAILURE(
      PutFromNode(dirs, cpu_node, NumaPlacement::kNode, nodes.front(), &stats, &where));
  EXPECT_EQ(stats.numa_node, nodes.front());
  EXPECT_EQ(stats.numa, "node:" + std::to_string(nodes.front()));
  if (where.empty()) GTEST_SKIP() << "no /proc/self/numa_maps (a kernel without NUMA)";
  const uint64_t total = Total(where);
  EXPECT_GE(BytesOn(where, nodes.front()) * 100, total * 95)
      << BytesOn(where, nodes.front()) << " of " << total << " bytes on node " << nodes.front();
}

TEST(StreamNumaKernelTest, InterleaveSplitsTheSegments) {
  const std::vector<int> nodes = platform::AllowedMemoryNodes();
  StreamDirs dirs;
  StreamStats stats;
  std::vector<NumaNodeBytes> where;
  ASSERT_NO_FATAL_FAILURE(
      PutFromNode(dirs, nodes.back(), NumaPlacement::kInterleave, -1, &stats, &where));
  if (nodes.size() < 2) {
    EXPECT_EQ(stats.numa_node, nodes.front());
    GTEST_SKIP() << "one node: interleave is first touch on node " << nodes.front();
  }
  EXPECT_EQ(stats.numa_node, -1);
  ASSERT_FALSE(where.empty());
  const uint64_t total = Total(where);
  for (int node : nodes) {
    // 35-65% each of two nodes.
    EXPECT_GE(BytesOn(where, node) * 100 * nodes.size(), total * 70)
        << BytesOn(where, node) << " of " << total << " bytes on node " << node;
  }
}

}  // namespace
}  // namespace expert_arena
