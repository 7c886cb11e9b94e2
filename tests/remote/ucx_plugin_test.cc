// UCX lives in the transport plugin (src/remote/ucx_plugin.h): a process that opens and
// attaches arenas and streams tensors maps no UCX library (UCX's libucm hooks mmap, munmap and
// madvise in every process that loads it); the plugin brings UCX in at the first peer fill or
// server; a plugin that cannot be loaded is a clear error, and `load --from-peer` with the
// model files falls back to them. The peer fills themselves are peer_fill_test.cc.
#include "remote/ucx_plugin.h"

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "expert_arena/arena.h"
#include "expert_arena/stream.h"
#include "test_util.h"

namespace expert_arena {
namespace {

bool InCi() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

// The UCX libraries mapped in this process, one per line ("" when none).
std::string UcxMappings() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  std::string found;
  for (const char* name : {"/libucp", "/libucs", "/libucm", "/libuct"}) {
    maps.clear();
    maps.seekg(0);
    while (std::getline(maps, line)) {
      if (line.find(name) != std::string::npos) {
        found += line.substr(line.find('/')) + "\n";
        break;
      }
    }
  }
  return found;
}

// Loads the plugin (with EXPERT_ARENA_UCX_PLUGIN set to args[0] when given) and prints what
// happened: "loaded <ucx version>" and the UCX libraries now mapped, or "refused <message>".
// Exit 0 when loaded, 1 when refused, 2 when UCX was mapped before the load.
EA_CHILD_ROLE(load_ucx_plugin) {
  if (!args.empty()) setenv("EXPERT_ARENA_UCX_PLUGIN", args[0].c_str(), 1);
  if (!UcxMappings().empty()) {
    std::printf("mapped before the load:\n%s", UcxMappings().c_str());
    return 2;
  }
  auto plugin = remote::Ucx();
  if (!plugin.ok()) {
    std::printf("refused %s %s\n", StatusCodeName(plugin.status().code()),
                plugin.status().message().c_str());
    return 1;
  }
  std::printf("loaded %s\n%s", (*plugin)->ucx_version, UcxMappings().c_str());
  return 0;
}

// Runs a shell command line; its stdout and stderr in `out`.
int Sh(const std::string& command, std::string* out) {
  auto child = testing::SpawnProgram("/bin/sh", {"-c", command + " 2>&1"});
  int code = child.Wait(120);
  *out = child.Output();
  return code;
}

TEST(UcxPluginTest, ArenaAndStreamRoundMapNoUcx) {
  testing::ScopedDataFile model(3 << 20, 7);
  testing::ScopedPath shared("ucx-free");
  testing::ScopedArenaDir streams("ucx-free-stream");
  ModelSpec spec{.files = {model.path()}, .format = ModelFormat::kRaw};
  ArenaOptions options;
  options.shared_path = shared.path();
  ASSERT_OK_AND_ASSIGN(Arena loaded, Arena::Open(spec, options));
  ASSERT_OK_AND_ASSIGN(Arena attached, Arena::AttachExisting(shared.path(), options));
  ASSERT_EQ(attached.tensor_count(), 1u);
  EXPECT_EQ(attached.tensor(0).checksum, loaded.tensor(0).checksum);

  StreamOptions stream;
  stream.directory = streams.path();
  stream.spill_directory = streams.path();
  stream.segment_bytes = 2 << 20;
  stream.max_segments = 2;
  ASSERT_OK_AND_ASSIGN(StreamProducer producer, StreamProducer::Create(stream));
  std::vector<std::byte> bytes(64 << 10);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(i * 31);
  ASSERT_OK_AND_ASSIGN(std::string descriptor,
                       producer.Put("request-1", bytes, {.dtype = "u8", .shape = {bytes.size()}}));
  ConsumerOptions consume;
  consume.directory = streams.path();
  consume.spill_directory = streams.path();
  ASSERT_OK_AND_ASSIGN(StreamConsumer consumer, StreamConsumer::Create(consume));
  {
    ASSERT_OK_AND_ASSIGN(StreamTensor tensor, consumer.Open(descriptor));
    ASSERT_EQ(tensor.bytes().size(), bytes.size());
    EXPECT_EQ(std::memcmp(tensor.bytes().data(), bytes.data(), bytes.size()), 0);
  }
  ASSERT_OK(producer.Reclaim());

  EXPECT_EQ(UcxMappings(), "") << "UCX is mapped in a process that never used a peer";
}

TEST(UcxPluginTest, PluginBringsUcxInAtFirstUse) {
  if (!remote::RemoteBuilt()) {
    if (InCi()) FAIL() << "built without UCX (libucx-dev)";
    GTEST_SKIP() << "built without UCX (libucx-dev)";
  }
  // Found next to this binary (build/bin), where the build copies it.
  auto child = testing::SpawnRole("load_ucx_plugin", {});
  ASSERT_EQ(child.Wait(60), 0) << child.Output();
  EXPECT_NE(child.Output().find("loaded "), std::string::npos) << child.Output();
  EXPECT_NE(child.Output().find("/libucp"), std::string::npos) << child.Output();
  EXPECT_NE(child.Output().find("/libucs"), std::string::npos) << child.Output();
}

TEST(UcxPluginTest, ASharedObjectThatIsNotThePluginIsRefused) {
  if (!remote::RemoteBuilt()) GTEST_SKIP() << "built without UCX: nothing to load";
  auto child = testing::SpawnRole("load_ucx_plugin", {EA_TEST_CORE_LIBRARY});
  ASSERT_EQ(child.Wait(60), 1) << child.Output();
  const std::string& out = child.Output();
  EXPECT_NE(out.find("refused unsupported"), std::string::npos) << out;
  EXPECT_NE(out.find("EXPERT_ARENA_UCX_PLUGIN"), std::string::npos) << out;
  // The core is the process's own library, already loaded: the dynamic linker hands back that
  // object and names it by the name it was loaded under (build/lib/libexpert_arena.so.0).
  EXPECT_NE(out.find("/libexpert_arena.so.0: undefined symbol: expert_arena_ucx_v1"),
            std::string::npos)
      << out;
}

TEST(UcxPluginTest, MissingPluginIsAClearErrorAndLoadFallsBackToTheModel) {
  if (!remote::RemoteBuilt()) GTEST_SKIP() << "built without UCX: nothing to load";
  const std::string tool = testing::BinDir() + "/expert-arena";
  const std::string missing = "/nonexistent-ea-dir/libexpert_arena_ucx.so";
  testing::ScopedArenaDir dir("ucx-missing");
  const std::string model = dir.File("m.gguf");
  std::string out;
  ASSERT_EQ(Sh(tool + " gen-model --format gguf --out " + model +
                   " --layers 2 --experts 4 --hidden 64 --ffn 64",
               &out),
            0)
      << out;
  const std::string env = "EXPERT_ARENA_UCX_PLUGIN=" + missing + " ";

  // The fill cannot start: the model files are read instead, and the report says why.
  ASSERT_EQ(Sh(env + tool + " load --model " + model + " --arena " + dir.File("a") +
                   " --from-peer 127.0.0.1:9 --json",
               &out),
            0)
      << out;
  nlohmann::json report;
  for (size_t at = 0; at < out.size();) {
    size_t end = out.find('\n', at);
    if (end == std::string::npos) end = out.size();
    if (out[at] == '{') report = nlohmann::json::parse(out.substr(at, end - at), nullptr, false);
    at = end + 1;
  }
  ASSERT_TRUE(report.is_object()) << out;
  EXPECT_EQ(report["role"], "loaded");
  EXPECT_EQ(report["from_peer"], "");
  EXPECT_GT(report["bytes_read"].get<uint64_t>(), report["tensor_bytes"].get<uint64_t>() / 2);
  const std::string note = report["peer_note"];
  EXPECT_NE(note.find("UCX transport plugin"), std::string::npos) << note;
  EXPECT_NE(note.find(missing), std::string::npos) << note;
  EXPECT_NE(note.find("No such file"), std::string::npos) << note;
  EXPECT_NE(note.find("read the model files instead"), std::string::npos) << note;

  // Without the files there is nothing to fall back to: exit 1 with the same reason.
  EXPECT_EQ(Sh(env + tool + " load --arena " + dir.File("b") + " --from-peer 127.0.0.1:9", &out),
            1);
  EXPECT_NE(out.find(missing), std::string::npos) << out;
  EXPECT_EQ(dir.entries(), std::vector<std::string>({"a", "m.gguf"}));

  // serve refuses before listening.
  EXPECT_EQ(Sh(env + tool + " serve " + dir.File("a") + " --listen 127.0.0.1:0", &out), 1);
  EXPECT_NE(out.find("cannot load the UCX transport plugin"), std::string::npos) << out;
  EXPECT_NE(out.find(missing), std::string::npos) << out;
}

}  // namespace
}  // namespace expert_arena
