// Which tensors of a model go into the arena.
//
// By default the routed experts, recognised by name:
//   GGUF          blk.N.ffn_{gate,up,down,gate_up}_exps.*  (weights, biases, scales)
//   safetensors   a component "experts.N." as in Mixtral block_sparse_moe.experts.N.w1 and
//                 DeepSeek/Qwen mlp.experts.N.{gate,up,down}_proj (with their scale tensors:
//                 weight_scale_inv, ...), and fused expert stacks "experts.{gate_up,gate,up,
//                 down}_proj*" (gpt-oss, Llama 4)
// Shared experts (ffn_*_shexp, shared_experts.*) and the router are not routed experts.
// ModelSpec::select (an ECMAScript regex, searched in the name) or select_all override it.
#pragma once

#include <memory>
#include <regex>
#include <string>
#include <string_view>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"

namespace expert_arena::source {

// True for a routed-expert tensor name of either naming family.
bool IsRoutedExpertName(std::string_view name);

class TensorSelector {
 public:
  // Fails with kInvalidArgument when spec.select is not a valid regex.
  static Result<TensorSelector> Make(const ModelSpec& spec);

  // Whether `name` is selected; fails only when the regex engine gives up on a name.
  Result<bool> Selects(const std::string& name) const;
  // "routed experts", "every tensor (--all)", or "names matching /REGEX/": for messages, in
  // the spec's words.
  std::string Describe() const;
  // "use --all or --select REGEX", in the spec's words.
  std::string Advice() const;

 private:
  enum class Mode { kRoutedExperts, kAll, kRegex };
  Mode mode_ = Mode::kRoutedExperts;
  OptionWords words_ = OptionWords::kCpp;
  std::string pattern_;
  std::shared_ptr<const std::regex> regex_;
};

}  // namespace expert_arena::source
