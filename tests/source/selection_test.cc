// Which tensors are routed experts, and the --select / --all overrides.
#include "source/selection.h"

#include "generators/gguf_writer.h"
#include "generators/safetensors_writer.h"
#include "source/model_source.h"
#include "source_test_util.h"
#include "test_util.h"

namespace expert_arena::source {
namespace {

TEST(SelectionTest, GgufNames) {
  EXPECT_TRUE(IsRoutedExpertName("blk.0.ffn_gate_exps.weight"));
  EXPECT_TRUE(IsRoutedExpertName("blk.12.ffn_up_exps.weight"));
  EXPECT_TRUE(IsRoutedExpertName("blk.3.ffn_down_exps.weight"));
  EXPECT_TRUE(IsRoutedExpertName("blk.3.ffn_gate_up_exps.weight"));
  EXPECT_TRUE(IsRoutedExpertName("blk.3.ffn_gate_exps.bias"));
  EXPECT_FALSE(IsRoutedExpertName("blk.3.ffn_gate_shexp.weight"));
  EXPECT_FALSE(IsRoutedExpertName("blk.3.ffn_gate_inp.weight"));
  EXPECT_FALSE(IsRoutedExpertName("blk.3.ffn_up.weight"));
  EXPECT_FALSE(IsRoutedExpertName("blk.x.ffn_up_exps.weight"));
  EXPECT_FALSE(IsRoutedExpertName("token_embd.weight"));
}

TEST(SelectionTest, MixtralNames) {
  EXPECT_TRUE(IsRoutedExpertName("model.layers.0.block_sparse_moe.experts.0.w1.weight"));
  EXPECT_TRUE(IsRoutedExpertName("model.layers.31.block_sparse_moe.experts.7.w2.weight"));
  EXPECT_TRUE(IsRoutedExpertName("model.layers.31.block_sparse_moe.experts.7.w3.weight"));
  EXPECT_FALSE(IsRoutedExpertName("model.layers.0.block_sparse_moe.gate.weight"));
  EXPECT_FALSE(IsRoutedExpertName("model.layers.0.self_attn.q_proj.weight"));
}

TEST(SelectionTest, DeepSeekAndQwenNames) {
  EXPECT_TRUE(IsRoutedExpertName("model.layers.3.mlp.experts.12.gate_proj.weight"));
  EXPECT_TRUE(IsRoutedExpertName("model.layers.3.mlp.experts.255.down_proj.weight"));
  EXPECT_TRUE(IsRoutedExpertName("model.layers.3.mlp.experts.0.up_proj.weight_scale_inv"));
  EXPECT_TRUE(IsRoutedExpertName("model.layers.3.mlp.experts.0.up_proj.weight_scale"));
  EXPECT_TRUE(IsRoutedExpertName("model.layers.3.mlp.experts.gate_up_proj_blocks"));  // gpt-oss
  EXPECT_TRUE(IsRoutedExpertName("language_model.model.layers.0.feed_forward.experts.down_proj"));
  EXPECT_FALSE(IsRoutedExpertName("model.layers.3.mlp.shared_experts.gate_proj.weight"));
  EXPECT_FALSE(IsRoutedExpertName("model.layers.3.mlp.gate.weight"));
  EXPECT_FALSE(IsRoutedExpertName("model.layers.3.mlp.gate.e_score_correction_bias"));
  EXPECT_FALSE(IsRoutedExpertName("model.layers.3.mlp.experts"));
  EXPECT_FALSE(IsRoutedExpertName("model.layers.3.mlp.experts.7"));
}

TEST(SelectionTest, OverridesAndCounts) {
  testing::ScopedDir dir("select");
  SafetensorsWriter w;
  const char* names[] = {"model.embed_tokens.weight",
                         "model.layers.0.mlp.gate.weight",
                         "model.layers.0.mlp.shared_experts.up_proj.weight",
                         "model.layers.0.mlp.experts.0.up_proj.weight",
                         "model.layers.0.mlp.experts.0.up_proj.weight_scale_inv",
                         "model.layers.0.mlp.experts.1.up_proj.weight"};
  for (const char* n : names) ASSERT_OK(w.AddTensor(n, "BF16", {8, 8}));
  std::string path = dir.File("model.safetensors");
  ASSERT_OK(w.WriteFile(path, [](size_t, uint64_t, std::span<std::byte> out) {
    std::fill(out.begin(), out.end(), std::byte{3});
    return Status::Ok();
  }));
  ModelSpec spec;
  spec.files = {path};
  ASSERT_OK_AND_ASSIGN(ModelPlan plan, PlanModel(spec));
  EXPECT_EQ(plan.table.tensors.size(), 3u);
  EXPECT_EQ(plan.table.model_tensors_total, 6u);
  EXPECT_EQ(plan.table.model_bytes_total, 6u * 128);
  EXPECT_GT(plan.metadata_bytes_read, 8u);

  spec.select = "shared_experts|embed";
  ASSERT_OK_AND_ASSIGN(plan, PlanModel(spec));
  ASSERT_EQ(plan.table.tensors.size(), 2u);

  spec.select = "";
  spec.select_all = true;
  ASSERT_OK_AND_ASSIGN(plan, PlanModel(spec));
  EXPECT_EQ(plan.table.tensors.size(), 6u);

  spec.select = "(";
  auto bad = PlanModel(spec);
  ASSERT_FALSE(bad.ok());  // --select with --all
  spec.select_all = false;
  bad = PlanModel(spec);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("not a valid regular expression"), std::string::npos);

  spec.select = "nothing-matches";
  bad = PlanModel(spec);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("no tensor of"), std::string::npos)
      << bad.status().ToString();
}

// The advice names the options as the caller spells them: C++ fields, C params, CLI flags,
// Python keywords, from one table; never another front end's.
TEST(SelectionTest, MessagesNameTheOptionsInTheCallersWords) {
  testing::ScopedDir dir("words");
  SafetensorsWriter w;
  ASSERT_OK(w.AddTensor("model.embed_tokens.weight", "BF16", {8, 8}));
  std::string path = dir.File("model.safetensors");
  ASSERT_OK(w.WriteFile(path, [](size_t, uint64_t, std::span<std::byte> out) {
    std::fill(out.begin(), out.end(), std::byte{3});
    return Status::Ok();
  }));
  const struct {
    OptionWords words;
    const char* advice;
    const char* regex;
    const char* both;
  } cases[] = {
      {OptionWords::kCpp, "use select_all = true or select = REGEX", "select = (:",
       "select and select_all exclude"},
      {OptionWords::kC, "use select_all = 1 or select = REGEX", "select = (:",
       "select and select_all exclude"},
      {OptionWords::kCli, "use --all or --select REGEX", "--select (:", "--select and --all"},
      {OptionWords::kPython, "use select_all=True or select=REGEX", "select=(:",
       "select and select_all=True exclude"},
  };
  for (const auto& c : cases) {
    ModelSpec spec{.files = {path}, .select = "nothing", .words = c.words};
    auto none = PlanModel(spec);
    ASSERT_FALSE(none.ok());
    EXPECT_NE(none.status().message().find(c.advice), std::string::npos) << none.status().ToString();
    spec.select = "(";
    auto bad = PlanModel(spec);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find(c.regex), std::string::npos) << bad.status().ToString();
    spec.select_all = true;
    bad = PlanModel(spec);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find(c.both), std::string::npos) << bad.status().ToString();
    if (c.words != OptionWords::kCli) {
      EXPECT_EQ(none.status().message().find("--"), std::string::npos) << none.status().ToString();
    }
  }
}

TEST(SelectionTest, ArenaOrderFollowsTheFile) {
  testing::ScopedDir dir("order");
  GgufWriter w;
  ASSERT_OK(w.AddTensor("blk.1.ffn_up_exps.weight", *FindGgmlType(0), {8}));
  ASSERT_OK(w.AddTensor("blk.0.ffn_up_exps.weight", *FindGgmlType(0), {8}));
  std::string path = dir.File("m.gguf");
  ASSERT_OK(w.WriteFile(path, [](size_t, uint64_t, std::span<std::byte> out) {
    std::fill(out.begin(), out.end(), std::byte{1});
    return Status::Ok();
  }));
  ASSERT_OK_AND_ASSIGN(ModelPlan plan, PlanModel({.files = {path}}));
  ASSERT_EQ(plan.table.tensors.size(), 2u);
  EXPECT_EQ(plan.table.tensors[0].name, "blk.1.ffn_up_exps.weight");
  EXPECT_LT(plan.table.tensors[0].source_offset, plan.table.tensors[1].source_offset);
  EXPECT_LT(plan.table.tensors[0].arena_offset, plan.table.tensors[1].arena_offset);
}

}  // namespace
}  // namespace expert_arena::source
