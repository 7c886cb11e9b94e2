// The project against the real llama.cpp: its prebuilt libraries from the npm registry
// (@node-llama-cpp/linux-x64, installed by scripts/llamacpp-peer.sh into a cache outside the
// tree), loaded here with dlopen.
//  - every ggml type id the real libggml-base knows matches the project's type table (name,
//    block size, type size) and the table has no id ggml refuses;
//  - ggml's own GGUF reader (gguf_init_from_file) accepts gen-model's files, and for every
//    tensor `expert-arena info --json` reports, its type and size agree and the arena file
//    holds, at file_offset, exactly the model bytes at the offset ggml's reader gives;
//  - llama.cpp (through node-llama-cpp, tools/llama-peer) loads `gen-model --layout qwen3-moe`
//    and `mixtral` GGUFs, with and without mmap, and evaluates tokens to finite probabilities.
// Outside CI (CI=true) a missing npm package or node skips with the reason; in CI it fails.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "generators/gguf_writer.h"
#include "generators/synthetic_model.h"
#include "format/dtypes.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using testing::BinDir;
using testing::Child;
using testing::ScopedPath;
using testing::SpawnProgram;

bool InCi() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::strcmp(ci, "true") == 0;
}

std::string SourceDir() {
  const char* dir = std::getenv("EXPERT_ARENA_SOURCE_DIR");
  return dir ? dir : EA_SOURCE_DIR;
}

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

// The real ggml: the few C functions of libggml-base.so the checks need (ggml.h, gguf.h).
struct GgmlPeer {
  struct GgufInitParams {
    bool no_alloc;
    void** ctx;
  };
  void* handle = nullptr;
  const char* (*type_name)(int) = nullptr;
  int64_t (*blck_size)(int) = nullptr;
  size_t (*type_size)(int) = nullptr;
  void* (*gguf_init_from_file)(const char*, GgufInitParams) = nullptr;
  void (*gguf_free)(void*) = nullptr;
  int64_t (*gguf_get_n_tensors)(const void*) = nullptr;
  int64_t (*gguf_find_tensor)(const void*, const char*) = nullptr;
  const char* (*gguf_get_tensor_name)(const void*, int64_t) = nullptr;
  int (*gguf_get_tensor_type)(const void*, int64_t) = nullptr;
  size_t (*gguf_get_tensor_offset)(const void*, int64_t) = nullptr;
  size_t (*gguf_get_tensor_size)(const void*, int64_t) = nullptr;
  size_t (*gguf_get_data_offset)(const void*) = nullptr;
  std::string lib_dir;
  std::string npm_prefix;
  std::string node;     // node >= 20 (the one on PATH, or one the script installed from npm)
  std::string why_not;  // set when the peer is not there

  // A GGUF context, freed on scope exit; null when ggml refused the file.
  struct Gguf {
    const GgmlPeer* peer;
    void* ctx;
    ~Gguf() {
      if (ctx) peer->gguf_free(ctx);
    }
  };
  Gguf Open(const std::string& path) const {
    return Gguf{this, gguf_init_from_file(path.c_str(), GgufInitParams{true, nullptr})};
  }
};

template <typename F>
bool Bind(void* handle, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(handle, name));
  return out != nullptr;
}

// Installs the peer (idempotent; a cached install does not touch the network) and binds it.
const GgmlPeer& Peer() {
  static GgmlPeer* peer = [] {
    auto* p = new GgmlPeer;
    const std::string script = SourceDir() + "/scripts/llamacpp-peer.sh";
    Child install = SpawnProgram("/bin/bash", {script});
    int rc = install.Wait(600);
    if (rc != 0) {
      p->why_not = script + " exited " + std::to_string(rc) +
                   " (npm install of @node-llama-cpp/linux-x64 and node-llama-cpp failed; see "
                   "stderr)";
      return p;
    }
    p->lib_dir = Trim(install.Output());
    Child prefix = SpawnProgram("/bin/bash", {script, "--prefix"});
    if (prefix.Wait(60) != 0) {
      p->why_not = script + " --prefix failed";
      return p;
    }
    p->npm_prefix = Trim(prefix.Output());
    Child node = SpawnProgram("/bin/bash", {script, "--node"});
    if (node.Wait(60) != 0) {
      p->why_not = script + " --node failed";
      return p;
    }
    p->node = Trim(node.Output());
    const std::string lib = p->lib_dir + "/libggml-base.so";
    p->handle = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (p->handle == nullptr) {
      p->why_not = std::string("dlopen: ") + dlerror();
      return p;
    }
    bool ok = Bind(p->handle, "ggml_type_name", p->type_name) &&
              Bind(p->handle, "ggml_blck_size", p->blck_size) &&
              Bind(p->handle, "ggml_type_size", p->type_size) &&
              Bind(p->handle, "gguf_init_from_file", p->gguf_init_from_file) &&
              Bind(p->handle, "gguf_free", p->gguf_free) &&
              Bind(p->handle, "gguf_get_n_tensors", p->gguf_get_n_tensors) &&
              Bind(p->handle, "gguf_find_tensor", p->gguf_find_tensor) &&
              Bind(p->handle, "gguf_get_tensor_name", p->gguf_get_tensor_name) &&
              Bind(p->handle, "gguf_get_tensor_type", p->gguf_get_tensor_type) &&
              Bind(p->handle, "gguf_get_tensor_offset", p->gguf_get_tensor_offset) &&
              Bind(p->handle, "gguf_get_tensor_size", p->gguf_get_tensor_size) &&
              Bind(p->handle, "gguf_get_data_offset", p->gguf_get_data_offset);
    if (!ok) p->why_not = lib + " lacks a ggml/gguf function: " + dlerror();
    return p;
  }();
  return *peer;
}

#define REQUIRE_PEER()                                                          \
  do {                                                                          \
    const GgmlPeer& p_ = Peer();                                                \
    if (!p_.why_not.empty()) {                                                  \
      if (InCi()) FAIL() << "llama.cpp peer unavailable in CI: " << p_.why_not; \
      GTEST_SKIP() << "llama.cpp peer unavailable: " << p_.why_not;             \
    }                                                                           \
  } while (0)

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Whether ggml's GGUF reader accepts a tensor of type `id` with ne[0] = 256 (a multiple of
// every block size). The reader refuses ids at or past GGML_TYPE_COUNT and removed types
// (block size 0): this is how the test learns the range without reading past ggml's tables.
bool GgufAcceptsType(const GgmlPeer& peer, const std::string& path, uint32_t id) {
  source::GgufWriter w;
  w.AddTensorInfo("t", id, {256}, 0, 256 * 8);
  Status st = w.WriteFile(path, [](size_t, uint64_t, std::span<std::byte> out) {
    std::memset(out.data(), 0, out.size());
    return Status::Ok();
  });
  if (!st.ok()) {
    ADD_FAILURE() << st.ToString();
    return false;
  }
  return peer.Open(path).ctx != nullptr;
}

TEST(LlamaCppPeerTest, GgmlTypeTableMatchesRealGgml) {
  REQUIRE_PEER();
  const GgmlPeer& peer = Peer();
  ScopedPath file("ggml-type", "/tmp");
  uint32_t known = 0, highest = 0;
  for (uint32_t id = 0; id < 128; ++id) {
    const source::GgmlType* ours = source::FindGgmlType(id);
    if (!GgufAcceptsType(peer, file.path(), id)) {
      EXPECT_EQ(ours, nullptr) << "the table has type id " << id << " (" << ours->name
                               << ") that ggml's GGUF reader refuses";
      continue;
    }
    ++known;
    highest = id;
    const std::string name = peer.type_name(static_cast<int>(id));
    ASSERT_NE(ours, nullptr) << "ggml knows type id " << id << " (" << name
                             << ") that the table lacks";
    EXPECT_EQ(Lower(name), ours->name) << "type id " << id;
    EXPECT_EQ(peer.blck_size(static_cast<int>(id)), static_cast<int64_t>(ours->block_elems))
        << name;
    EXPECT_EQ(peer.type_size(static_cast<int>(id)), static_cast<size_t>(ours->block_bytes)) << name;
  }
  EXPECT_EQ(known, source::AllGgmlTypes().size());
  EXPECT_GE(highest, 42u) << "this ggml predates q2_0 (42)";
  std::printf("ggml (%s) knows %u types, ids up to %u; all match the table\n", peer.lib_dir.c_str(),
              known, highest);
}

std::string ReadRange(const std::string& path, uint64_t offset, uint64_t bytes) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(offset));
  std::string out(bytes, '\0');
  in.read(out.data(), static_cast<std::streamsize>(bytes));
  EXPECT_EQ(static_cast<uint64_t>(in.gcount()), bytes) << path << " at " << offset;
  return out;
}

int RunTool(const std::string& program, const std::vector<std::string>& args, std::string* out,
            double timeout = 120) {
  Child child = SpawnProgram(program, args);
  int rc = child.Wait(timeout);
  if (out) *out = child.Output();
  return rc;
}

struct GenCase {
  const char* layout;
  const char* dtype;
};
void PrintTo(const GenCase& c, std::ostream* os) { *os << c.layout << " " << c.dtype; }

// The qwen3-moe naming contract as the project's own reader sees it, and moe-engine running on
// the file (no peer needed).
TEST(LayoutGgufTest, Qwen3MoeNamingContractAndMoeEngine) {
  ScopedPath path("layout-qwen3", "/tmp");
  source::SyntheticModelOptions o;
  o.format = "gguf";
  o.out = path.path();
  o.layout = "qwen3-moe";
  o.layers = 2;
  o.experts = 4;
  o.hidden = 256;
  o.ffn = 64;
  o.dtype = "f16";
  ASSERT_OK_AND_ASSIGN(source::SyntheticModelReport report, source::WriteSyntheticModel(o));
  EXPECT_EQ(report.expert_tensors, 6u);
  ASSERT_OK_AND_ASSIGN(source::GgufFile f, source::ReadGguf(path.path()));
  EXPECT_EQ(f.Find("general.architecture")->str, "qwen3moe");
  const std::pair<const char*, uint64_t> keys[] = {
      {"qwen3moe.block_count", 2},
      {"qwen3moe.context_length", 4096},
      {"qwen3moe.embedding_length", 256},
      {"qwen3moe.expert_feed_forward_length", 64},
      {"qwen3moe.expert_count", 4},
      {"qwen3moe.expert_used_count", 2},
      {"qwen3moe.attention.head_count", 2},
      {"qwen3moe.attention.head_count_kv", 2},
      {"qwen3moe.attention.key_length", 128},
      {"qwen3moe.rope.dimension_count", 128},
  };
  for (const auto& [key, value] : keys) {
    const source::GgufValue* v = f.Find(key);
    ASSERT_NE(v, nullptr) << key;
    EXPECT_EQ(v->u, value) << key;
  }
  ASSERT_NE(f.Find("qwen3moe.attention.layer_norm_rms_epsilon"), nullptr);
  ASSERT_NE(f.Find("qwen3moe.rope.freq_base"), nullptr);
  EXPECT_EQ(f.Find("tokenizer.ggml.model")->str, "llama");
  EXPECT_EQ(f.Find("tokenizer.ggml.tokens")->count, 512u);
  EXPECT_EQ(f.Find("tokenizer.ggml.tokens")->elements[13].str, "<0x0A>");
  std::map<std::string, std::pair<std::string, std::vector<uint64_t>>> want = {
      {"token_embd.weight", {"f32", {256, 512}}},
      {"output.weight", {"f32", {256, 512}}},
      {"output_norm.weight", {"f32", {256}}},
      {"blk.1.attn_q.weight", {"f16", {256, 256}}},
      {"blk.1.attn_k.weight", {"f16", {256, 256}}},
      {"blk.1.attn_output.weight", {"f16", {256, 256}}},
      {"blk.1.attn_q_norm.weight", {"f32", {128}}},
      {"blk.1.attn_k_norm.weight", {"f32", {128}}},
      {"blk.1.ffn_norm.weight", {"f32", {256}}},
      {"blk.1.ffn_gate_inp.weight", {"f32", {256, 4}}},
      {"blk.1.ffn_gate_exps.weight", {"f16", {256, 64, 4}}},
      {"blk.1.ffn_down_exps.weight", {"f16", {64, 256, 4}}},
  };
  EXPECT_EQ(f.tensors.size(), 3u + 2 * 12);
  size_t seen = 0;
  for (const source::GgufTensorInfo& t : f.tensors) {
    auto it = want.find(t.name);
    if (it == want.end()) continue;
    ++seen;
    EXPECT_EQ(t.type->name, it->second.first) << t.name;
    EXPECT_EQ(t.ne, it->second.second) << t.name;
  }
  EXPECT_EQ(seen, want.size());
  std::string out;
  ASSERT_EQ(
      RunTool(BinDir() + "/moe-engine", {"--model", path.path(), "--tokens", "4", "--json"}, &out),
      0)
      << out;
  nlohmann::json j = nlohmann::json::parse(out);
  EXPECT_EQ(j["layers"], 2);
  EXPECT_EQ(j["experts"], 4);
  EXPECT_EQ(j["hidden"], 256);
  EXPECT_EQ(j["ffn"], 64);
}

// What a named layout cannot be is refused before anything is written (no peer needed).
TEST(LayoutGgufTest, RefusesWhatItCannotWrite) {
  ScopedPath out("layout-refused", "/tmp");
  source::SyntheticModelOptions o;
  o.format = "gguf";
  o.out = out.path();
  o.layout = "qwen3-moe";
  o.layers = 1;
  o.experts = 2;
  o.hidden = 48;  // not a multiple of 32: no head size fits
  o.ffn = 32;
  auto r = source::WriteSyntheticModel(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--hidden to be a multiple of 32 (got 48)"),
            std::string::npos)
      << r.status().message();
  o.hidden = 64;
  o.layout = "deepseek-v3";  // written as safetensors only
  r = source::WriteSyntheticModel(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("deepseek-v3 has no GGUF writer"), std::string::npos)
      << r.status().message();
  EXPECT_FALSE(std::ifstream(out.path()).good()) << "nothing is written for a refused layout";
}

class GgufAgreementTest : public ::testing::TestWithParam<GenCase> {};

TEST_P(GgufAgreementTest, GgmlReaderAgreesWithInfoJson) {
  REQUIRE_PEER();
  const GgmlPeer& peer = Peer();
  const GenCase c = GetParam();
  const std::string tool = BinDir() + "/expert-arena";
  ScopedPath model("gen-" + std::string(c.layout) + "-" + c.dtype, "/tmp");
  ScopedPath arena("arena");
  std::string out;
  ASSERT_EQ(RunTool(tool,
                    {"gen-model", "--format", "gguf", "--layout", c.layout, "--dtype", c.dtype,
                     "--out", model.path(), "--layers", "2", "--experts", "4", "--hidden", "128",
                     "--ffn", "64", "--seed", "7"},
                    &out),
            0)
      << out;
  ASSERT_EQ(
      RunTool(tool, {"load", "--model", model.path(), "--arena", arena.path(), "--all"}, &out), 0)
      << out;
  ASSERT_EQ(RunTool(tool, {"info", arena.path(), "--json"}, &out), 0) << out;
  nlohmann::json info = nlohmann::json::parse(out);

  GgmlPeer::Gguf gguf = peer.Open(model.path());
  ASSERT_NE(gguf.ctx, nullptr) << "ggml's gguf_init_from_file refused " << model.path();
  const int64_t n = peer.gguf_get_n_tensors(gguf.ctx);
  ASSERT_EQ(static_cast<size_t>(n), info["tensors"].size()) << "tensor count";
  const uint64_t data_offset = peer.gguf_get_data_offset(gguf.ctx);
  size_t experts = 0;
  for (const nlohmann::json& t : info["tensors"]) {
    const std::string name = t["name"];
    const int64_t i = peer.gguf_find_tensor(gguf.ctx, name.c_str());
    ASSERT_GE(i, 0) << name << " is not in ggml's view of " << model.path();
    EXPECT_EQ(Lower(peer.type_name(peer.gguf_get_tensor_type(gguf.ctx, i))),
              Lower(t["dtype"].get<std::string>()))
        << name;
    const uint64_t bytes = t["bytes"];
    EXPECT_EQ(peer.gguf_get_tensor_size(gguf.ctx, i), bytes) << name;
    const uint64_t model_offset = data_offset + peer.gguf_get_tensor_offset(gguf.ctx, i);
    const bool same = ReadRange(model.path(), model_offset, bytes) ==
                      ReadRange(arena.path(), t["file_offset"].get<uint64_t>(), bytes);
    EXPECT_TRUE(same) << name << ": the arena at " << t["file_offset"] << " does not hold the "
                      << bytes << " model bytes ggml places at " << model_offset;
    if (name.find("_exps.weight") != std::string::npos) ++experts;
  }
  EXPECT_EQ(experts, 6u) << "2 layers x gate/up/down expert tensors";
  EXPECT_EQ(RunTool(tool, {"rm", arena.path()}, &out), 0) << out;
}

INSTANTIATE_TEST_SUITE_P(Layouts, GgufAgreementTest,
                         ::testing::Values(GenCase{"synthetic", "f32"},
                                           GenCase{"synthetic", "q8_0"},
                                           GenCase{"qwen3-moe", "bf16"},
                                           GenCase{"qwen3-moe", "q8_0"}, GenCase{"mixtral", "f16"}),
                         [](const ::testing::TestParamInfo<GenCase>& info) {
                           std::string s = std::string(info.param.layout) + "_" + info.param.dtype;
                           for (char& ch : s) {
                             if (ch == '-') ch = '_';
                           }
                           return s;
                         });

// llama.cpp itself loads the file and evaluates tokens (real node-llama-cpp process).
class LlamaCppEvalTest : public ::testing::TestWithParam<GenCase> {};

TEST_P(LlamaCppEvalTest, LoadsAndEvaluatesWithAndWithoutMmap) {
  REQUIRE_PEER();
  const GgmlPeer& peer = Peer();
  const GenCase c = GetParam();
  ScopedPath model("eval-" + std::string(c.layout), "/tmp");
  std::string out;
  ASSERT_EQ(
      RunTool(BinDir() + "/expert-arena",
              {"gen-model", "--format", "gguf", "--layout", c.layout, "--dtype", c.dtype, "--out",
               model.path(), "--layers", "2", "--experts", "8", "--hidden", "256", "--ffn", "128"},
              &out),
      0)
      << out;
  for (const char* mmap : {"on", "off"}) {
    ASSERT_EQ(RunTool(peer.node,
                      {SourceDir() + "/tools/llama-peer/llama-peer.mjs", "--prefix",
                       peer.npm_prefix, "--model", model.path(), "--mmap", mmap, "--tokens", "6"},
                      &out, 300),
              0)
        << "llama.cpp could not load or evaluate " << model.path() << " (mmap " << mmap
        << "): " << out;
    nlohmann::json j = nlohmann::json::parse(out);
    EXPECT_EQ(j["mmap"].get<bool>(), std::strcmp(mmap, "on") == 0);
    EXPECT_NEAR(j["probability_sum"].get<double>(), 1.0, 1e-3);
    EXPECT_GE(j["top_token"].get<int>(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, LlamaCppEvalTest,
                         ::testing::Values(GenCase{"qwen3-moe", "q8_0"}, GenCase{"mixtral", "f16"}),
                         [](const ::testing::TestParamInfo<GenCase>& info) {
                           std::string s = info.param.layout;
                           for (char& ch : s) {
                             if (ch == '-') ch = '_';
                           }
                           return s;
                         });

}  // namespace
}  // namespace expert_arena
