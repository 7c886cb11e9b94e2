// Engines in separate containers: each child gets new PID, mount, IPC and UTS namespaces, its
// own /proc, and the test's host directory bind-mounted at /dev/shm (what a hostPath volume
// gives a pod). They share one arena and streams through it; a loader or producer killed in one
// is recovered from another; `ls` and `sweep` are right from each; and no message presents a
// pid of another namespace (every engine here is pid 1 in its own) as a local one.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "../arena/engine_role.h"
#include "common/units.h"
#include "contain.h"
#include "expert_arena/stream.h"

namespace expert_arena::testing {
namespace {

EA_CHILD_ROLE(engine) { return EngineRole(args); }

constexpr char kInside[] = "/dev/shm";  // where each container sees the shared directory

void Fill(std::span<std::byte> bytes) {
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>((i * 31 + 7) & 0xff);
}

bool WaitFor(const std::string& path, double seconds) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!std::filesystem::exists(path)) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// args: name [stop]: puts one 3 MB tensor in a stream in /dev/shm, writes its descriptor to
// /dev/shm/NAME.desc and then /dev/shm/NAME.ready; waits for /dev/shm/NAME.stop (or forever
// without `stop`); exits 0 once its block came back.
EA_CHILD_ROLE(ns_produce) {
  StreamOptions o;
  o.directory = kInside;
  o.spill_directory = kInside;
  o.logical_name = args[0];
  o.segment_bytes = 8 * kMiB;
  o.huge = HugePages::kOff;
  auto producer = StreamProducer::Create(o);
  if (!producer.ok()) {
    std::printf("producer: %s\n", producer.status().message().c_str());
    return 3;
  }
  std::vector<std::byte> data(3'000'000);
  Fill(data);
  auto d = producer->Put("k", data, {"u8", {data.size()}});
  if (!d.ok()) return 4;
  const std::string base = std::string(kInside) + "/" + args[0];
  std::ofstream(base + ".desc", std::ios::binary) << *d;
  std::ofstream(base + ".ready") << "1";
  std::printf("PRODUCED\n");
  std::fflush(stdout);
  if (args.size() < 2) {
    for (;;) pause();
  }
  if (!WaitFor(base + ".stop", 120)) return 5;
  for (int i = 0; i < 6000 && producer->Stats()->live_blocks > 0; ++i) {
    (void)producer->Reclaim();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return producer->Stats()->live_blocks == 0 ? 0 : 6;
}

// args: name: opens the descriptor in /dev/shm/NAME.desc, checks every byte, releases.
EA_CHILD_ROLE(ns_consume) {
  ConsumerOptions o;
  o.directory = kInside;
  o.spill_directory = kInside;
  auto consumer = StreamConsumer::Create(o);
  if (!consumer.ok()) return 3;
  std::ifstream in(std::string(kInside) + "/" + args[0] + ".desc", std::ios::binary);
  std::string desc((std::istreambuf_iterator<char>(in)), {});
  auto t = consumer->Open(desc);
  if (!t.ok()) {
    std::printf("refused: %s\n", t.status().message().c_str());
    return 4;
  }
  std::vector<std::byte> want(t->bytes().size());
  Fill(want);
  bool same = std::equal(want.begin(), want.end(), t->bytes().begin());
  std::printf("%s %zu\n", same ? "ok" : "bad", want.size());
  t->Release();
  return same ? 0 : 5;
}

class NamespacesTest : public ::testing::Test {
 protected:
  NamespacesTest() : model_(24 * kMiB, 29), dir_("ns") {}
  void SetUp() override {
    if (!WhyCannotContain().empty()) EA_SKIP_OR_FAIL_IN_CI(WhyCannotContain());
    // Probe once: a kernel or sandbox without namespaces for us.
    Child probe = SpawnContained(Container(), "/bin/true", {});
    if (probe.Wait(30) != 0) EA_SKIP_OR_FAIL_IN_CI("cannot unshare PID/mount/IPC/UTS namespaces");
  }
  Containment Container() const {
    return {
        .namespaces = true, .bind_from = dir_.path(), .bind_to = kInside, .stderr_to_stdout = true};
  }
  // An engine in a container of its own; the arena is /dev/shm/model.arena inside.
  Child Engine(const std::string& hook = "none", const std::string& wait = "-") {
    return SpawnContained(
        Container(), "engine",
        {std::string(kInside) + "/model.arena", model_.path(), hook, "-", "-", wait});
  }
  // `expert-arena ARGS...` in a container of its own; its output (stdout and stderr).
  std::string Tool(const std::vector<std::string>& args, int expected_exit = 0) {
    Child c = SpawnContained(Container(), BinDir() + "/expert-arena", args);
    EXPECT_EQ(c.Wait(60), expected_exit) << c.Output();
    return c.Output();
  }
  nlohmann::json ToolJson(const std::vector<std::string>& args) {
    std::string out = Tool(args);
    size_t brace = out.find('{');
    return nlohmann::json::parse(brace == std::string::npos ? "null" : out.substr(brace), nullptr,
                                 false);
  }

  ScopedDataFile model_;
  ScopedArenaDir dir_;
};

TEST_F(NamespacesTest, TwoEnginesStartedAtOnceOneLoadsOneAttaches) {
  Child a = Engine();
  Child b = Engine();
  ASSERT_EQ(a.Wait(120), 0) << a.Output();
  ASSERT_EQ(b.Wait(120), 0) << b.Output();
  nlohmann::json ja = ParseEngineOutput(a.Output()), jb = ParseEngineOutput(b.Output());
  std::set<std::string> roles = {ja["role"].get<std::string>(), jb["role"].get<std::string>()};
  EXPECT_EQ(roles, (std::set<std::string>{"loaded", "attached"})) << a.Output() << b.Output();
  EXPECT_EQ(ja["sum"], FileSum(model_.path()));
  EXPECT_EQ(jb["sum"], ja["sum"]);
  EXPECT_EQ(ja["pid"], 1) << "each engine is the first process of its own PID namespace";
  EXPECT_EQ(jb["pid"], 1);
  // Whoever waited does not report the loader's pid as one of its namespace.
  EXPECT_EQ(ja["waited_for"], 0);
  EXPECT_EQ(jb["waited_for"], 0);
}

TEST_F(NamespacesTest, LoaderKilledInOneNamespaceIsReloadedFromAnother) {
  Child loader = Engine("hang");
  ASSERT_TRUE(loader.WaitForOutput("LOADING", 60)) << loader.Output();
  // ls from another container and from the host: the loader is pid 1 of another namespace.
  const std::string listed = Tool({"ls", kInside});
  EXPECT_NE(listed.find("being loaded by pid 1 of another PID namespace"), std::string::npos)
      << listed;
  Child host_ls = SpawnProgram(BinDir() + "/expert-arena", {"ls", dir_.path(), "--json"});
  ASSERT_EQ(host_ls.Wait(60), 0);
  nlohmann::json hj = nlohmann::json::parse(host_ls.Output(), nullptr, false);
  ASSERT_TRUE(hj.is_object()) << host_ls.Output();
  ASSERT_EQ(hj["arenas"].size(), 1u) << hj;
  EXPECT_EQ(hj["arenas"][0]["loader_pid_local"], false) << hj;

  Child waiter = Engine("none", "60");
  // The waiter says who it waits for, as a pid of another namespace (it is pid 1 itself).
  ASSERT_TRUE(waiter.WaitForOutput("of another PID namespace", 60)) << waiter.Output();
  loader.Kill(SIGKILL);
  loader.Wait(30);
  ASSERT_EQ(waiter.Wait(120), 0) << waiter.Output();
  nlohmann::json w = ParseEngineOutput(waiter.Output());
  EXPECT_EQ(w["role"], "loaded") << waiter.Output();
  EXPECT_EQ(w["waited_for"], 0);
  EXPECT_EQ(w["sum"], FileSum(model_.path()));
  // And a third container attaches to it.
  Child third = Engine();
  ASSERT_EQ(third.Wait(120), 0) << third.Output();
  EXPECT_EQ(ParseEngineOutput(third.Output())["role"], "attached");
  EXPECT_EQ(ParseEngineOutput(third.Output())["sum"], w["sum"]);
  const std::string after = Tool({"ls", kInside});
  EXPECT_NE(after.find("not in use; kept for the next engine"), std::string::npos) << after;
}

TEST_F(NamespacesTest, StreamProducerInOneNamespaceConsumerInAnother) {
  Child producer = SpawnContained(Container(), "ns_produce", {"s1", "stop"});
  ASSERT_TRUE(producer.WaitForOutput("PRODUCED", 60)) << producer.Output();
  // ls from a third container and from the host: a live owner, pid of another namespace.
  nlohmann::json seen = ToolJson({"ls", kInside, "--json"});
  ASSERT_TRUE(seen.is_object());
  ASSERT_GE(seen["segments"].size(), 1u) << seen;
  EXPECT_EQ(seen["segments"][0]["owner_alive"], true) << seen;
  EXPECT_EQ(seen["segments"][0]["owner_pid"], 1) << seen;
  EXPECT_EQ(seen["segments"][0]["owner_pid_local"], false) << seen;

  Child consumer = SpawnContained(Container(), "ns_consume", {"s1"});
  ASSERT_EQ(consumer.Wait(60), 0) << consumer.Output();
  EXPECT_NE(consumer.Output().find("ok 3000000"), std::string::npos) << consumer.Output();
  std::ofstream(dir_.File("s1.stop")) << "1";
  EXPECT_EQ(producer.Wait(120), 0)
      << "the block came back from the other namespace: " << producer.Output();
}

TEST_F(NamespacesTest, KilledProducersSegmentsAreSweptFromAThirdNamespace) {
  Child producer = SpawnContained(Container(), "ns_produce", {"s2"});
  ASSERT_TRUE(producer.WaitForOutput("PRODUCED", 60)) << producer.Output();
  Child consumer = SpawnContained(Container(), "ns_consume", {"s2"});
  ASSERT_EQ(consumer.Wait(60), 0) << consumer.Output();
  // Alive: a sweep from elsewhere leaves it alone.
  Tool({"sweep", kInside});
  auto segments = [&] {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir_.path())) {
      n += e.path().filename().string().rfind("ea-stream-", 0) == 0;
    }
    return n;
  };
  ASSERT_GE(segments(), 1);
  producer.Kill(SIGKILL);
  producer.Wait(30);
  const std::string listed = Tool({"ls", kInside});
  EXPECT_NE(listed.find("owner pid 1 of another PID namespace"), std::string::npos) << listed;
  EXPECT_NE(listed.find("gone"), std::string::npos) << listed;
  const std::string swept = Tool({"sweep", kInside});
  EXPECT_EQ(segments(), 0) << swept;
  EXPECT_EQ(swept.find("pid 1 ("), std::string::npos)
      << "the dead owner is not named as this namespace's pid 1: " << swept;
}

}  // namespace
}  // namespace expert_arena::testing
