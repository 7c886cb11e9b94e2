// expert-arena gen-model: write a deterministic synthetic MoE model (GGUF or safetensors).
#include <chrono>
#include <cstdio>

#include "commands.h"
#include "common/units.h"
#include "generators/synthetic_model.h"

namespace expert_arena::cli {
namespace {

int RunGenModel(source::SyntheticModelOptions options) {
  auto start = std::chrono::steady_clock::now();
  if (Status s = source::ApplyLayoutDefaults(options); !s.ok()) {
    std::fprintf(stderr, "expert-arena gen-model: %s\n", s.message().c_str());
    return 2;
  }
  auto report = source::WriteSyntheticModel(options);
  if (!report.ok()) {
    std::fprintf(stderr, "expert-arena gen-model: %s\n", report.status().message().c_str());
    return report.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "wrote %s (%s %s, %llu layers x %llu experts, hidden %llu, ffn %llu, %s): %llu tensors, "
      "%s in %zu file%s; experts %llu tensors, %s; %.2f s\n",
      options.out.c_str(), options.layout.c_str(), options.format.c_str(), static_cast<unsigned long long>(options.layers),
      static_cast<unsigned long long>(options.experts),
      static_cast<unsigned long long>(options.hidden), static_cast<unsigned long long>(options.ffn),
      options.dtype.c_str(), static_cast<unsigned long long>(report->tensors),
      FormatBytes(report->file_bytes).c_str(), report->files.size(),
      report->files.size() == 1 ? "" : "s", static_cast<unsigned long long>(report->expert_tensors),
      FormatBytes(report->expert_bytes).c_str(), seconds);
  return 0;
}

}  // namespace

void RegisterGenModel(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<source::SyntheticModelOptions>();
  CLI::App* cmd = app.add_subcommand(
      "gen-model", "Write a deterministic synthetic MoE model (GGUF or safetensors)");
  cmd->add_option("--format", options->format, "gguf|safetensors")
      ->required()
      ->check(CLI::IsMember({"gguf", "safetensors"}));
  cmd->add_option("--out", options->out,
                  "Model file, or a directory for sharded safetensors (--shards K > 1)")
      ->required();
  cmd->add_option("--layout", options->layout,
                  "Tensor names and shapes: synthetic (default), or a real checkpoint family's: "
                  "deepseek-v3 (safetensors, FP8 + weight_scale_inv), qwen3-moe, mixtral "
                  "(safetensors, or a GGUF that llama.cpp loads)")
      ->check(CLI::IsMember({"synthetic", "deepseek-v3", "qwen3-moe", "mixtral"}));
  cmd->add_option("--layers", options->layers,
                  "Layers (L); required for synthetic, a named layout defaults to its release's");
  cmd->add_option("--experts", options->experts,
                  "Experts per layer (E); required for synthetic, a named layout's default: its "
                  "release's");
  cmd->add_option("--hidden", options->hidden,
                  "Hidden size (H); required for synthetic, 16 for a named layout (64 as GGUF)");
  cmd->add_option("--ffn", options->ffn,
                  "Expert feed-forward size (F); required for synthetic, 16 for a named layout "
                  "(64 as GGUF)");
  cmd->add_option("--dtype", options->dtype,
                  "Expert dtype: f32|f16|bf16|q8_0|f8_e4m3 (q8_0: GGUF only; f8_e4m3: "
                  "deepseek-v3). Default: f32; as safetensors f8_e4m3 for deepseek-v3, bf16 for the others")
      ->check(CLI::IsMember({"f32", "f16", "bf16", "q8_0", "f8_e4m3"}));
  cmd->add_option("--shards", options->shards, "safetensors shards (K files + index)");
  cmd->add_option("--seed", options->seed, "Seed of the values");
  cmd->callback([options, &exit_code] { exit_code = RunGenModel(*options); });
}

}  // namespace expert_arena::cli
