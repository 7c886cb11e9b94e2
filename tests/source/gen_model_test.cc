// expert-arena gen-model: the naming contract moe-engine relies on, the values, and usage
// errors (through the real CLI).
#include <cmath>
#include <cstring>
#include <filesystem>

#include "expert_arena/arena.h"
#include "generators/synthetic_model.h"
#include "source/gguf_reader.h"
#include "source/model_source.h"
#include "source/safetensors_reader.h"
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

// --layout deepseek-v3: the FP8 release's names, dtypes and shape rules at any size: dense
// first layers, MLA attention, shared experts, a router with its bias, and a weight_scale_inv
// beside every FP8 projection; the default selection takes the routed experts and their scales.
TEST(GenModelTest, DeepSeekV3Layout) {
  ScopedDir dir("gen-dsv3");
  const std::string out = dir.File("m");
  ASSERT_EQ(GenModel({"gen-model", "--format", "safetensors", "--layout", "deepseek-v3", "--out",
                      out, "--layers", "5", "--experts", "4", "--hidden", "256", "--ffn", "128",
                      "--shards", "4", "--seed", "3"}),
            0);
  ASSERT_OK_AND_ASSIGN(SafetensorsIndex index, ReadSafetensorsIndex(out + "/" + kSafetensorsIndexName));
  EXPECT_EQ(index.shards.size(), 4u);
  std::map<std::string, std::pair<std::string, std::vector<uint64_t>>> seen;
  std::map<std::string, std::string> file_of;
  for (const std::string& shard : index.shards) {
    ASSERT_OK_AND_ASSIGN(SafetensorsFile f, ReadSafetensors(shard));
    for (const auto& t : f.tensors) {
      seen[t.name] = {t.dtype, t.shape};
      file_of[t.name] = shard;
    }
  }
  // Per layer 2 norms + 5 attention projections (+ scales) + 2 attention norms; 3 dense
  // layers of 3 projections; 2 MoE layers of router + bias, 4 x 3 experts and 3 shared
  // projections; embed, norm, lm_head.
  const size_t attention = 2 + 5 * 2 + 2;
  EXPECT_EQ(seen.size(), 5 * attention + 3 * 3 * 2 + 2 * (2 + 4 * 3 * 2 + 3 * 2) + 3);
  using Shape = std::vector<uint64_t>;
  auto expect = [&](const std::string& name, const std::string& dtype, const Shape& shape) {
    auto it = seen.find(name);
    ASSERT_NE(it, seen.end()) << name;
    EXPECT_EQ(it->second.first, dtype) << name;
    EXPECT_EQ(it->second.second, shape) << name;
  };
  // Dimensions scale by hidden / 7168: q_lora_rank 1536 -> 54, kv 576 -> 20.
  expect("model.layers.0.self_attn.q_a_proj.weight", "F8_E4M3", Shape{54, 256});
  expect("model.layers.0.self_attn.q_a_proj.weight_scale_inv", "F32", Shape{1, 2});
  expect("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "F8_E4M3", Shape{20, 256});
  expect("model.layers.0.self_attn.kv_a_layernorm.weight", "BF16", Shape{18});
  expect("model.layers.2.mlp.gate_proj.weight", "F8_E4M3", Shape{9 * 128, 256});
  expect("model.layers.2.mlp.down_proj.weight_scale_inv", "F32", Shape{2, 9});
  expect("model.layers.3.mlp.gate.weight", "BF16", Shape{4, 256});
  expect("model.layers.3.mlp.gate.e_score_correction_bias", "F32", Shape{4});
  expect("model.layers.4.mlp.experts.3.down_proj.weight", "F8_E4M3", Shape{256, 128});
  expect("model.layers.4.mlp.experts.3.down_proj.weight_scale_inv", "F32", Shape{2, 1});
  expect("model.layers.4.mlp.shared_experts.up_proj.weight", "F8_E4M3", Shape{128, 256});
  expect("lm_head.weight", "BF16", Shape{64, 256});
  EXPECT_EQ(seen.count("model.layers.2.mlp.gate.weight"), 0u) << "dense layers have no router";
  EXPECT_EQ(seen.count("model.layers.2.mlp.experts.0.up_proj.weight"), 0u);
  // Values: FP8 times its scale_inv is the synthetic value to E4M3's precision.
  const std::string name = "model.layers.3.mlp.experts.2.up_proj.weight";
  auto tensors = testing::ParseSafetensorsIndependently(file_of[name]);
  auto fp8 = testing::ReadRange(file_of[name], tensors.at(name).offset, 64);
  auto scale_bytes = testing::ReadRange(file_of[name + "_scale_inv"],
                                        testing::ParseSafetensorsIndependently(
                                            file_of[name + "_scale_inv"])
                                            .at(name + "_scale_inv")
                                            .offset,
                                        4);
  float scale;
  std::memcpy(&scale, scale_bytes.data(), 4);
  uint64_t seed = SyntheticTensorSeed(name, 3);
  for (int k = 0; k < 64; ++k) {
    float x = SyntheticValue(seed, k);
    float got = E4M3ToFloat(static_cast<uint8_t>(fp8[k])) * scale;
    EXPECT_NEAR(got, x, std::fabs(x) / 16 + 1e-5) << k;
  }
  // The routed experts and their scales are the default selection.
  ASSERT_OK_AND_ASSIGN(ModelPlan plan, PlanModel({.files = {out}}));
  EXPECT_EQ(plan.table.tensors.size(), 2u * 4 * 3 * 2);
}

TEST(GenModelTest, QwenAndMixtralLayouts) {
  ScopedDir dir("gen-layouts");
  ASSERT_EQ(GenModel({"gen-model", "--format", "safetensors", "--layout", "qwen3-moe", "--out",
                      dir.File("q.safetensors"), "--layers", "2", "--experts", "3"}),
            0);
  ASSERT_OK_AND_ASSIGN(SafetensorsFile q, ReadSafetensors(dir.File("q.safetensors")));
  std::map<std::string, SafetensorsTensorInfo> qs;
  for (const auto& t : q.tensors) qs[t.name] = t;
  // Per layer: 2 norms, q/k/v/o, q_norm, k_norm, router, 3 x 3 experts; embed, norm, lm_head.
  EXPECT_EQ(qs.size(), 2u * (2 + 4 + 2 + 1 + 9) + 3);
  EXPECT_EQ(qs.at("model.layers.1.mlp.experts.2.down_proj.weight").dtype, "BF16");
  EXPECT_EQ(qs.at("model.layers.1.mlp.experts.2.down_proj.weight").shape,
            (std::vector<uint64_t>{16, 16}));
  EXPECT_EQ(qs.at("model.layers.0.self_attn.k_norm.weight").shape, (std::vector<uint64_t>{1}));
  EXPECT_EQ(qs.count("model.layers.0.mlp.experts.0.up_proj.weight_scale_inv"), 0u);

  ASSERT_EQ(GenModel({"gen-model", "--format", "safetensors", "--layout", "mixtral", "--out",
                      dir.File("x.safetensors"), "--layers", "2", "--hidden", "64", "--ffn", "224",
                      "--dtype", "f16"}),
            0);
  ASSERT_OK_AND_ASSIGN(SafetensorsFile x, ReadSafetensors(dir.File("x.safetensors")));
  std::map<std::string, SafetensorsTensorInfo> xs;
  for (const auto& t : x.tensors) xs[t.name] = t;
  EXPECT_EQ(xs.size(), 2u * (2 + 4 + 1 + 8 * 3) + 3);  // 8 experts by default
  EXPECT_EQ(xs.at("model.layers.1.block_sparse_moe.experts.7.w2.weight").shape,
            (std::vector<uint64_t>{64, 224}));
  EXPECT_EQ(xs.at("model.layers.1.block_sparse_moe.experts.7.w2.weight").dtype, "F16");
  EXPECT_EQ(xs.at("model.layers.1.self_attn.k_proj.weight").shape,
            (std::vector<uint64_t>{16, 64}));
  ASSERT_OK_AND_ASSIGN(ModelPlan plan, PlanModel({.files = {dir.File("x.safetensors")}}));
  EXPECT_EQ(plan.table.tensors.size(), 2u * 8 * 3);
}

TEST(GenModelTest, LayoutUsageErrors) {
  ScopedDir dir("gen-layout-usage");
  // deepseek-v3 has no GGUF writer (qwen3-moe and mixtral do: layout_gguf.cc): a clear
  // refusal, nothing left behind.
  EXPECT_EQ(GenModel({"gen-model", "--format", "gguf", "--layout", "deepseek-v3", "--out",
                      dir.File("g")}),
            2);
  EXPECT_FALSE(std::filesystem::exists(dir.File("g")));
  SyntheticModelOptions o;
  o.format = "gguf";
  o.layout = "deepseek-v3";
  o.out = dir.File("g");
  auto written = WriteSyntheticModel(o);
  ASSERT_FALSE(written.ok());
  EXPECT_NE(written.status().message().find("--layout deepseek-v3 has no GGUF writer"),
            std::string::npos)
      << written.status().message();
  // FP8 belongs to deepseek-v3; unknown layouts; synthetic still needs its sizes.
  EXPECT_EQ(GenModel({"gen-model", "--format", "safetensors", "--layout", "mixtral", "--out",
                      dir.File("x"), "--dtype", "f8_e4m3"}),
            2);
  EXPECT_EQ(GenModel({"gen-model", "--format", "safetensors", "--layout", "llama", "--out",
                      dir.File("x")}),
            2);
  EXPECT_EQ(GenModel({"gen-model", "--format", "safetensors", "--out", dir.File("x")}), 2);
  EXPECT_FALSE(std::filesystem::exists(dir.File("x")));
}

TEST(GenModelTest, E4M3Conversions) {
  EXPECT_EQ(FloatToE4M3(0.0f), 0x00);
  EXPECT_EQ(FloatToE4M3(1.0f), 0x38);
  EXPECT_EQ(FloatToE4M3(-2.0f), 0xc0);
  EXPECT_EQ(FloatToE4M3(448.0f), 0x7e);
  EXPECT_EQ(FloatToE4M3(1e6f), 0x7e) << "saturates: E4M3 has no infinity";
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.0f, -9)), 0x01) << "smallest subnormal";
  EXPECT_EQ(FloatToE4M3(1.0625f), 0x38) << "halfway rounds to even";
  EXPECT_EQ(FloatToE4M3(1.1875f), 0x3a) << "halfway rounds to even";
  for (int v = 0; v < 256; ++v) {
    if ((v & 0x7f) == 0x7f) continue;  // NaN
    EXPECT_EQ(FloatToE4M3(E4M3ToFloat(static_cast<uint8_t>(v))), v == 0x80 ? 0x80 : v) << v;
  }
}

}  // namespace
}  // namespace expert_arena::source
