// moe-engine as operators run it: real processes on models made by `expert-arena gen-model`.
// Two engines started at once on a fresh arena (one loads, one waits and attaches), a
// restart that attaches, a private arena with the same checksum, every weight dtype in both
// model formats, and the memory of two engines sharing one arena (counted once).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "platform/process_memory.h"
#include "test_util.h"

namespace expert_arena::testing {
namespace {

constexpr uint64_t kMiB = 1024 * 1024;

struct ModelShape {
  std::string format = "gguf";
  std::string dtype = "f16";
  int layers = 2;
  int experts = 8;
  int hidden = 256;
  int ffn = 512;
};

std::string ShapeName(const ModelShape& s) { return s.format + "_" + s.dtype; }
void PrintTo(const ModelShape& s, std::ostream* os) { *os << ShapeName(s); }

// A model written by `expert-arena gen-model` in /tmp; removed with the object.
class GeneratedModel {
 public:
  explicit GeneratedModel(const ModelShape& shape)
      : path_("model." + std::string(shape.format == "gguf" ? "gguf" : "safetensors"), "/tmp") {
    Child gen =
        SpawnProgram(BinDir() + "/expert-arena",
                     {"gen-model", "--format", shape.format, "--out", path_.path(), "--layers",
                      std::to_string(shape.layers), "--experts", std::to_string(shape.experts),
                      "--hidden", std::to_string(shape.hidden), "--ffn", std::to_string(shape.ffn),
                      "--dtype", shape.dtype, "--seed", "7"});
    exit_code_ = gen.Wait(120);
  }
  bool ok() const { return exit_code_ == 0; }
  const std::string& path() const { return path_.path(); }

 private:
  ScopedPath path_;
  int exit_code_ = -1;
};

struct EngineResult {
  int exit_code = -1;
  nlohmann::json json;
  std::string output;
};

std::vector<std::string> EngineArgs(const std::string& model, const std::string& arena,
                                    std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--model", model, "--json", "--tokens", "8"};
  if (!arena.empty()) {
    args.insert(args.end(), {"--shared-expert-arena", arena, "--arena-wait-timeout", "60"});
  }
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

EngineResult Finish(Child& child) {
  EngineResult r;
  r.exit_code = child.Wait(120);
  r.output = child.Output();
  r.json = nlohmann::json::parse(r.output, nullptr, /*allow_exceptions=*/false);
  return r;
}

EngineResult RunEngine(const std::vector<std::string>& args) {
  Child child = SpawnProgram(BinDir() + "/moe-engine", args);
  return Finish(child);
}

#define ASSERT_ENGINE_OK(r)                                                     \
  do {                                                                          \
    ASSERT_EQ((r).exit_code, 0) << (r).output;                                  \
    ASSERT_TRUE((r).json.is_object()) << "not one JSON object: " << (r).output; \
  } while (0)

TEST(MoeEngineTest, TwoAtOnceOneLoadsOneAttachesThenRestartAndPrivateAgree) {
  GeneratedModel model({});
  ASSERT_TRUE(model.ok()) << "expert-arena gen-model failed";
  ScopedPath arena("engine.arena");

  Child first = SpawnProgram(BinDir() + "/moe-engine", EngineArgs(model.path(), arena.path()));
  Child second = SpawnProgram(BinDir() + "/moe-engine", EngineArgs(model.path(), arena.path()));
  EngineResult a = Finish(first), b = Finish(second);
  ASSERT_ENGINE_OK(a);
  ASSERT_ENGINE_OK(b);
  std::set<std::string> roles = {a.json["role"], b.json["role"]};
  EXPECT_EQ(roles, (std::set<std::string>{"loaded", "attached"})) << a.output << b.output;
  EXPECT_EQ(a.json["checksum"], b.json["checksum"]);
  const nlohmann::json& loaded = a.json["role"] == "loaded" ? a.json : b.json;
  const nlohmann::json& attached = a.json["role"] == "loaded" ? b.json : a.json;
  // The attaching engine reads only the model's header, never its tensor data.
  EXPECT_GE(loaded["bytes_read"].get<uint64_t>(), loaded["tensor_bytes"].get<uint64_t>());
  EXPECT_LT(attached["bytes_read"].get<uint64_t>(), 1 * kMiB) << attached;
  EXPECT_EQ(attached["layers"], 2);
  EXPECT_EQ(attached["experts"], 8);
  EXPECT_EQ(attached["hidden"], 256);
  EXPECT_EQ(attached["ffn"], 512);
  EXPECT_EQ(attached["dtype"], "f16");
  EXPECT_EQ(attached["expert_calls"], 8 * 2 * 2);

  // A restart finds the published file and attaches.
  EngineResult restart = RunEngine(EngineArgs(model.path(), arena.path()));
  ASSERT_ENGINE_OK(restart);
  EXPECT_EQ(restart.json["role"], "attached");
  EXPECT_EQ(restart.json["checksum"], a.json["checksum"]);
  EXPECT_LT(restart.json["bytes_read"].get<uint64_t>(), 1 * kMiB);

  // Without the flag: a private arena, the same output.
  EngineResult priv = RunEngine(EngineArgs(model.path(), ""));
  ASSERT_ENGINE_OK(priv);
  EXPECT_EQ(priv.json["role"], "private");
  EXPECT_EQ(priv.json["checksum"], a.json["checksum"]);
  EXPECT_EQ(priv.json["arena"], "");

  // More threads, same bits.
  EngineResult threaded = RunEngine(EngineArgs(model.path(), "", {"--threads", "2"}));
  ASSERT_ENGINE_OK(threaded);
  EXPECT_EQ(threaded.json["checksum"], a.json["checksum"]);
}

TEST(MoeEngineTest, TextOutputHasStartLineAndChecksum) {
  GeneratedModel model({});
  ASSERT_TRUE(model.ok());
  ScopedPath arena("text.arena");
  Child c =
      SpawnProgram(BinDir() + "/moe-engine", {"--model", model.path(), "--shared-expert-arena",
                                              arena.path(), "--tokens", "4", "--gpu", "cuda"});
  ASSERT_EQ(c.Wait(120), 0) << c.Output();
  const std::string& out = c.Output();
  EXPECT_NE(out.find("moe-engine: loaded "), std::string::npos) << out;
  EXPECT_NE(out.find("on 2 MiB pages"), std::string::npos) << out;
  // A small model: sizes in MiB or KiB, a rate per second.
  EXPECT_NE(out.find("/s"), std::string::npos) << out;
  EXPECT_EQ(out.find("0.00 GiB"), std::string::npos) << out;
  EXPECT_NE(out.find("moe-engine: checksum "), std::string::npos) << out;
  // No device here (or no CUDA in this build): one line says so and the CPU computes.
  EXPECT_NE(out.find("moe-engine: gpu: "), std::string::npos) << out;
}

TEST(MoeEngineTest, RefusalsAndUsageErrors) {
  EngineResult missing = RunEngine({"--model", "/nonexistent/model.gguf"});
  EXPECT_EQ(missing.exit_code, 1);
  EngineResult usage = RunEngine({"--tokens", "3"});
  EXPECT_EQ(usage.exit_code, 2);
  GeneratedModel model({});
  ASSERT_TRUE(model.ok());
  EngineResult bad_k = RunEngine(EngineArgs(model.path(), "", {"--top-k", "9"}));
  EXPECT_EQ(bad_k.exit_code, 1);
}

class MoeEngineDtypeTest : public ::testing::TestWithParam<ModelShape> {};

TEST_P(MoeEngineDtypeTest, PrivateLoadedAndAttachedGiveOneChecksum) {
  GeneratedModel model(GetParam());
  ASSERT_TRUE(model.ok()) << "gen-model " << ShapeName(GetParam());
  ScopedPath arena("dtype.arena");
  EngineResult priv = RunEngine(EngineArgs(model.path(), ""));
  EngineResult loaded = RunEngine(EngineArgs(model.path(), arena.path()));
  EngineResult attached = RunEngine(EngineArgs(model.path(), arena.path()));
  ASSERT_ENGINE_OK(priv);
  ASSERT_ENGINE_OK(loaded);
  ASSERT_ENGINE_OK(attached);
  EXPECT_EQ(priv.json["role"], "private");
  EXPECT_EQ(loaded.json["role"], "loaded");
  EXPECT_EQ(attached.json["role"], "attached");
  EXPECT_EQ(priv.json["checksum"], loaded.json["checksum"]);
  EXPECT_EQ(priv.json["checksum"], attached.json["checksum"]);
  EXPECT_EQ(attached.json["naming"], GetParam().format);
  EXPECT_EQ(attached.json["dtype"], GetParam().dtype);
}

INSTANTIATE_TEST_SUITE_P(FormatsAndDtypes, MoeEngineDtypeTest,
                         ::testing::Values(ModelShape{"gguf", "f32"}, ModelShape{"gguf", "f16"},
                                           ModelShape{"gguf", "bf16"}, ModelShape{"gguf", "q8_0"},
                                           ModelShape{"safetensors", "f32"},
                                           ModelShape{"safetensors", "f16"},
                                           ModelShape{"safetensors", "bf16"}),
                         [](const auto& info) { return ShapeName(info.param); });

// A sharded safetensors model named by its index: the shards' tensors make one table.
TEST(MoeEngineTest, ShardedSafetensorsThroughTheIndex) {
  char tmpl[] = "/tmp/ea-test-shards-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  struct RemoveDir {
    std::string dir;
    ~RemoveDir() { std::filesystem::remove_all(dir); }
  } remove_dir{tmpl};
  const std::string dir = tmpl;
  Child gen = SpawnProgram(
      BinDir() + "/expert-arena",
      {"gen-model", "--format", "safetensors", "--out", dir, "--layers", "2", "--experts", "4",
       "--hidden", "128", "--ffn", "256", "--dtype", "bf16", "--shards", "3", "--seed", "7"});
  ASSERT_EQ(gen.Wait(120), 0) << gen.Output();
  const std::string index = dir + "/model.safetensors.index.json";
  ScopedPath arena("shards.arena");
  EngineResult priv = RunEngine(EngineArgs(index, ""));
  EngineResult loaded = RunEngine(EngineArgs(index, arena.path()));
  EngineResult attached = RunEngine(EngineArgs(index, arena.path()));
  ASSERT_ENGINE_OK(priv);
  ASSERT_ENGINE_OK(loaded);
  ASSERT_ENGINE_OK(attached);
  EXPECT_EQ(attached.json["role"], "attached");
  EXPECT_EQ(attached.json["experts"], 4);
  EXPECT_EQ(attached.json["tensors"], 2 * 4 * 3);
  EXPECT_EQ(priv.json["checksum"], loaded.json["checksum"]);
  EXPECT_EQ(priv.json["checksum"], attached.json["checksum"]);
}

// Two engines that share the arena hold one copy: summed over both, Pss (which divides a
// shared page between its users) stays near one arena; two private engines hold two.
TEST(MoeEngineTest, TwoSharedEnginesCountTheArenaOnce) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's shadow memory inflates each engine's private RSS";
#endif
  ModelShape shape;
  shape.dtype = "f32";
  shape.layers = 4;
  shape.experts = 8;
  shape.hidden = 512;
  shape.ffn = 1024;  // 4 x 8 experts x 6 MiB = 192 MiB
  GeneratedModel model(shape);
  ASSERT_TRUE(model.ok());
  const double arena_bytes = 4.0 * 8 * 3 * 512 * 1024 * 4;
  const double slack = 64.0 * kMiB;

  auto measure_pair = [&](const std::string& arena_path, double* pss_sum,
                          std::vector<nlohmann::json>* reports) {
    std::vector<Child> engines;
    engines.push_back(
        SpawnProgram(BinDir() + "/moe-engine", EngineArgs(model.path(), arena_path, {"--hold"})));
    engines.push_back(
        SpawnProgram(BinDir() + "/moe-engine", EngineArgs(model.path(), arena_path, {"--hold"})));
    *pss_sum = 0;
    for (Child& e : engines) {
      ASSERT_TRUE(e.WaitForOutput("}\n", 120)) << e.Output();
    }
    // Both engines are alive and mapped now.
    for (Child& e : engines) {
      auto mem = platform::ProcessMemory(e.pid());
      ASSERT_OK(mem);
      *pss_sum += static_cast<double>(mem->pss);
      reports->push_back(nlohmann::json::parse(e.Output()));
    }
    for (Child& e : engines) {
      e.Kill(SIGTERM);
      EXPECT_EQ(e.Wait(30), 0);
    }
  };

  ScopedPath arena("rss.arena");
  double shared_pss = 0;
  std::vector<nlohmann::json> shared;
  measure_pair(arena.path(), &shared_pss, &shared);
  ASSERT_EQ(shared.size(), 2u);
  EXPECT_EQ(shared[0]["checksum"], shared[1]["checksum"]);
  EXPECT_LT(shared_pss, 1.5 * arena_bytes + slack)
      << "two engines on one arena hold " << shared_pss / kMiB << " MiB (arena "
      << arena_bytes / kMiB << " MiB)";
  // Each engine's memory outside the arena is small, and the engine that measured second
  // saw the arena's pages shared with the other one.
  uint64_t max_shared = 0;
  for (const auto& r : shared) {
    EXPECT_LT(r["private_rss_bytes"].get<double>(), slack) << r;
    EXPECT_GE(r["arena_rss_bytes"].get<double>(), arena_bytes) << r;
    max_shared = std::max(max_shared, r["shared_bytes"].get<uint64_t>());
  }
  EXPECT_GE(static_cast<double>(max_shared), arena_bytes);

  double private_pss = 0;
  std::vector<nlohmann::json> priv;
  measure_pair("", &private_pss, &priv);
  ASSERT_EQ(priv.size(), 2u);
  EXPECT_EQ(priv[0]["checksum"], shared[0]["checksum"]);
  EXPECT_GT(private_pss, 1.8 * arena_bytes) << "two private engines should hold two copies";
  RecordProperty("shared_pair_pss_mib", std::to_string(shared_pss / kMiB));
  RecordProperty("private_pair_pss_mib", std::to_string(private_pss / kMiB));
  std::printf("arena %.0f MiB: two shared engines Pss %.0f MiB, two private engines %.0f MiB\n",
              arena_bytes / kMiB, shared_pss / kMiB, private_pss / kMiB);
}

}  // namespace
}  // namespace expert_arena::testing
