// expert-arena gen-model: the naming contract moe-engine relies on, the values, and usage
// errors (through the real CLI).
#include <cmath>
#include <cstring>
#include <filesystem>

#include "expert_arena/arena.h"
#include "source/gguf_reader.h"
#include "source/model_source.h"
#include "source/safetensors_reader.h"
#include "source/synthetic_model.h"
#include "source_test_util.h"
#include "test_util.h"

namespace expert_arena::source {
namespace {

using testing::ScopedDir;

int GenModel(const std::vector<std::string>& args) {
  auto child = testing::SpawnProgram(testing::BinDir() + "/expert-arena", args);
  return child.Wait(120);
}

TEST(GenModelTest, GgufNamingContract) {
  ScopedDir dir("gen-gguf");
  const std::string path = dir.File("m.gguf");
  ASSERT_EQ(GenModel({"gen-model", "--format", "gguf", "--out", path, "--layers", "2", "--experts",
                      "3", "--hidden", "64", "--ffn", "96", "--dtype", "q8_0", "--seed", "5"}),
            0);
  ASSERT_OK_AND_ASSIGN(GgufFile f, ReadGguf(path));
  EXPECT_EQ(f.version, 3u);
  EXPECT_EQ(f.alignment, 32u);
  EXPECT_EQ(f.Find("general.architecture")->str, "synthmoe");
  EXPECT_EQ(f.Find("synthmoe.block_count")->u, 2u);
  EXPECT_EQ(f.Find("synthmoe.expert_count")->u, 3u);
  EXPECT_EQ(f.Find("synthmoe.expert_used_count")->u, 2u);
  EXPECT_EQ(f.Find("synthmoe.embedding_length")->u, 64u);
  EXPECT_EQ(f.Find("synthmoe.expert_feed_forward_length")->u, 96u);
  std::map<std::string, std::pair<std::string, std::vector<uint64_t>>> want = {
      {"token_embd.weight", {"f32", {64, 64}}},
      {"blk.1.attn_norm.weight", {"f32", {64}}},
      {"blk.1.ffn_gate_inp.weight", {"f32", {64, 3}}},
      {"blk.1.ffn_gate_exps.weight", {"q8_0", {64, 96, 3}}},
      {"blk.1.ffn_up_exps.weight", {"q8_0", {64, 96, 3}}},
      {"blk.1.ffn_down_exps.weight", {"q8_0", {96, 64, 3}}},
  };
  EXPECT_EQ(f.tensors.size(), 11u);
  for (const GgufTensorInfo& t : f.tensors) {
    auto it = want.find(t.name);
    if (it == want.end()) continue;
    EXPECT_EQ(t.type->name, it->second.first) << t.name;
    EXPECT_EQ(t.ne, it->second.second) << t.name;
  }
  // q8_0 values: the first block of a gate tensor dequantizes close to the generator's values.
  const GgufTensorInfo* gate = nullptr;
  for (const auto& t : f.tensors) {
    if (t.name == "blk.0.ffn_gate_exps.weight") gate = &t;
  }
  ASSERT_NE(gate, nullptr);
  auto block = testing::ReadRange(path, gate->absolute_offset, 34);
  uint16_t dh;
  std::memcpy(&dh, block.data(), 2);
  float d = HalfToFloat(dh);
  uint64_t seed = SyntheticTensorSeed("blk.0.ffn_gate_exps.weight", 5);
  for (int k = 0; k < 32; ++k) {
    float x = SyntheticValue(seed, k);
    EXPECT_NEAR(d * static_cast<int8_t>(block[2 + k]), x, d * 0.51 + 1e-6) << k;
    EXPECT_LT(std::fabs(x), 0.05f);
  }
  // Routed experts are the default selection: 3 tensors per layer.
  ASSERT_OK_AND_ASSIGN(ModelPlan plan, PlanModel({.files = {path}}));
  EXPECT_EQ(plan.table.tensors.size(), 6u);
  EXPECT_EQ(plan.table.model_tensors_total, 11u);
}

TEST(GenModelTest, SafetensorsNamingContractAndValues) {
  ScopedDir dir("gen-st");
  const std::string path = dir.File("m.safetensors");
  ASSERT_EQ(GenModel({"gen-model", "--format", "safetensors", "--out", path, "--layers", "1",
                      "--experts", "2", "--hidden", "16", "--ffn", "24", "--dtype", "f32"}),
            0);
  auto tensors = testing::ParseSafetensorsIndependently(path);
  EXPECT_EQ(tensors.size(), 1u + 2 + 2 * 3);
  ASSERT_OK_AND_ASSIGN(SafetensorsFile f, ReadSafetensors(path));
  std::map<std::string, std::vector<uint64_t>> shapes;
  for (const auto& t : f.tensors) shapes[t.name] = t.shape;
  EXPECT_EQ(shapes["model.embed_tokens.weight"], (std::vector<uint64_t>{64, 16}));
  EXPECT_EQ(shapes["model.layers.0.input_layernorm.weight"], (std::vector<uint64_t>{16}));
  EXPECT_EQ(shapes["model.layers.0.mlp.gate.weight"], (std::vector<uint64_t>{2, 16}));
  EXPECT_EQ(shapes["model.layers.0.mlp.experts.1.gate_proj.weight"],
            (std::vector<uint64_t>{24, 16}));
  EXPECT_EQ(shapes["model.layers.0.mlp.experts.1.up_proj.weight"], (std::vector<uint64_t>{24, 16}));
  EXPECT_EQ(shapes["model.layers.0.mlp.experts.1.down_proj.weight"],
            (std::vector<uint64_t>{16, 24}));
  const auto& up = tensors.at("model.layers.0.mlp.experts.1.up_proj.weight");
  EXPECT_EQ(up.dtype, "F32");
  auto bytes = testing::ReadRange(path, up.offset, 16);
  uint64_t seed = SyntheticTensorSeed("model.layers.0.mlp.experts.1.up_proj.weight", 0);
  for (int k = 0; k < 4; ++k) {
    float v;
    std::memcpy(&v, bytes.data() + 4 * k, 4);
    EXPECT_EQ(v, SyntheticValue(seed, k));
  }
  // Norm weights sit near 1 so activations keep their scale.
  auto norm = tensors.at("model.layers.0.input_layernorm.weight");
  auto nb = testing::ReadRange(path, norm.offset, 4);
  float n0;
  std::memcpy(&n0, nb.data(), 4);
  EXPECT_NEAR(n0, 1.0f, 0.05f);
}

TEST(GenModelTest, DeterministicAcrossRunsAndSeedsDiffer) {
  ScopedDir dir("gen-det");
  auto gen = [&](const std::string& name, const std::string& seed) {
    EXPECT_EQ(GenModel({"gen-model", "--format", "gguf", "--out", dir.File(name), "--layers", "1",
                        "--experts", "2", "--hidden", "32", "--ffn", "32", "--dtype", "bf16",
                        "--seed", seed}),
              0);
    return testing::ReadFileBytes(dir.File(name));
  };
  auto a = gen("a.gguf", "1"), b = gen("b.gguf", "1"), c = gen("c.gguf", "2");
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(GenModelTest, UsageErrorsExitTwo) {
  ScopedDir dir("gen-usage");
  EXPECT_EQ(GenModel({"gen-model", "--format", "safetensors", "--out", dir.File("x"), "--layers",
                      "1", "--experts", "2", "--hidden", "32", "--ffn", "32", "--dtype", "q8_0"}),
            2);
  EXPECT_FALSE(std::filesystem::exists(dir.File("x")));
  EXPECT_EQ(GenModel({"gen-model", "--format", "gguf", "--out", dir.File("x"), "--layers", "1",
                      "--experts", "2", "--hidden", "33", "--ffn", "32", "--dtype", "q8_0"}),
            2);
  EXPECT_EQ(GenModel({"gen-model", "--format", "gguf", "--out", dir.File("x"), "--layers", "0",
                      "--experts", "2", "--hidden", "32", "--ffn", "32"}),
            2);
  EXPECT_EQ(GenModel({"gen-model", "--format", "gguf", "--out", dir.File("x"), "--layers", "1",
                      "--experts", "2", "--hidden", "32", "--ffn", "32", "--shards", "2"}),
            2);
  EXPECT_EQ(GenModel({"gen-model", "--format", "onnx", "--out", dir.File("x"), "--layers", "1",
                      "--experts", "2", "--hidden", "32", "--ffn", "32"}),
            2);
}

TEST(GenModelTest, ShardsSplitEvenly) {
  ScopedDir dir("gen-shards");
  SyntheticModelOptions o{.format = "safetensors",
                          .out = dir.File("m"),
                          .layers = 4,
                          .experts = 4,
                          .hidden = 64,
                          .ffn = 64,
                          .dtype = "f16",
                          .shards = 4};
  ASSERT_OK_AND_ASSIGN(SyntheticModelReport r, WriteSyntheticModel(o));
  ASSERT_EQ(r.files.size(), 5u);
  EXPECT_EQ(std::filesystem::path(r.files[0]).filename(), "model-00001-of-00004.safetensors");
  EXPECT_EQ(std::filesystem::path(r.files[4]).filename(), "model.safetensors.index.json");
  for (size_t s = 0; s < 4; ++s) {
    uint64_t size = std::filesystem::file_size(r.files[s]);
    EXPECT_GT(size, r.tensor_bytes / 8) << r.files[s];
    EXPECT_LT(size, r.tensor_bytes / 2) << r.files[s];
  }
  // As many shards as tensors still works; more is refused.
  o.layers = 1;
  o.experts = 1;
  o.shards = 6;
  o.out = dir.File("tiny");
  ASSERT_OK(WriteSyntheticModel(o));
  o.shards = 7;
  EXPECT_FALSE(WriteSyntheticModel(o).ok());
}

TEST(GenModelTest, HalfAndBFloat16Conversions) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(1e6f), 0x7c00);
  EXPECT_EQ(FloatToHalf(5.9604645e-8f), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
  for (float x : {0.049f, -0.0123f, 3.0e-5f, 1.0f / 3}) {
    EXPECT_NEAR(HalfToFloat(FloatToHalf(x)), x, std::fabs(x) * 1e-3 + 6e-8) << x;
  }
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(-0.5f), 0xbf00);
}

}  // namespace
}  // namespace expert_arena::source
