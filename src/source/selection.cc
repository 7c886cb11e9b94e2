#include "source/selection.h"

#include <array>

#include "common/option_words.h"

namespace expert_arena::source {
namespace {

bool AllDigits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// blk.N.ffn_{gate,up,down,gate_up}_exps.*
bool IsGgufRoutedExpert(std::string_view name) {
  if (!StartsWith(name, "blk.")) return false;
  name.remove_prefix(4);
  size_t dot = name.find('.');
  if (dot == std::string_view::npos || !AllDigits(name.substr(0, dot))) return false;
  name.remove_prefix(dot + 1);
  for (std::string_view kind :
       {"ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps.", "ffn_gate_up_exps."}) {
    if (StartsWith(name, kind)) return true;
  }
  return false;
}

// A component "experts" followed by a number and something more, or by a fused projection.
bool IsSafetensorsRoutedExpert(std::string_view name) {
  static constexpr std::array<std::string_view, 4> kFused = {"gate_up_proj", "gate_proj", "up_proj",
                                                             "down_proj"};
  size_t start = 0;
  while (start <= name.size()) {
    size_t dot = name.find('.', start);
    std::string_view component =
        name.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
    if (dot == std::string_view::npos) return false;
    if (component == "experts") {
      std::string_view rest = name.substr(dot + 1);
      size_t next_dot = rest.find('.');
      if (next_dot != std::string_view::npos && next_dot + 1 < rest.size() &&
          AllDigits(rest.substr(0, next_dot))) {
        return true;
      }
      std::string_view next = rest.substr(0, next_dot);
      for (std::string_view fused : kFused) {
        if (next == fused ||
            (StartsWith(next, fused) && next.size() > fused.size() && next[fused.size()] == '_')) {
          return true;
        }
      }
    }
    start = dot + 1;
  }
  return false;
}

}  // namespace

bool IsRoutedExpertName(std::string_view name) {
  return IsGgufRoutedExpert(name) || IsSafetensorsRoutedExpert(name);
}

Result<TensorSelector> TensorSelector::Make(const ModelSpec& spec) {
  TensorSelector selector;
  selector.words_ = spec.words;
  auto word = [&](OptionWord w) { return std::string(Word(spec.words, w)); };
  if (spec.select_all) {
    if (!spec.select.empty()) {
      return InvalidArgument(word(OptionWord::kSelect) + " and " + word(OptionWord::kSelectAll) +
                             " exclude each other");
    }
    selector.mode_ = Mode::kAll;
    return selector;
  }
  if (spec.select.empty()) return selector;
  selector.mode_ = Mode::kRegex;
  selector.pattern_ = spec.select;
  try {
    selector.regex_ = std::make_shared<const std::regex>(spec.select, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return InvalidArgument(word(OptionWord::kSelectIs) + spec.select +
                           ": not a valid regular expression (" +
                           e.what() + ")");
  }
  return selector;
}

Result<bool> TensorSelector::Selects(const std::string& name) const {
  switch (mode_) {
    case Mode::kAll:
      return true;
    case Mode::kRoutedExperts:
      return IsRoutedExpertName(name);
    case Mode::kRegex:
      try {
        return std::regex_search(name, *regex_);
      } catch (const std::regex_error& e) {
        return InvalidArgument(std::string(Word(words_, OptionWord::kSelectIs)) + pattern_ +
                               " failed on tensor " + name + " (" +
                               e.what() + ")");
      }
  }
  return false;
}

std::string TensorSelector::Describe() const {
  switch (mode_) {
    case Mode::kAll:
      return "every tensor (" + std::string(Word(words_, OptionWord::kSelectAllIs)) + ")";
    case Mode::kRoutedExperts:
      return "routed experts (names like blk.N.ffn_*_exps.* or *.experts.N.*)";
    case Mode::kRegex:
      return "names matching /" + pattern_ + "/";
  }
  return "";
}

std::string TensorSelector::Advice() const {
  return "use " + std::string(Word(words_, OptionWord::kSelectAllIs)) + " or " +
         std::string(Word(words_, OptionWord::kSelectIs)) + "REGEX";
}

}  // namespace expert_arena::source
