// The names of the options that library messages advise on, in each caller's words: one
// table, so that a C++ engine reads its fields, a C engine its params, the CLI's user its
// flags and Python's user its keywords.
#pragma once

#include <string_view>

#include "expert_arena/arena.h"

namespace expert_arena {

enum class OptionWord {
  kSelect,         // the option's name: "select", "--select"
  kSelectIs,       // followed by the value: "select = ", "--select ", "select="
  kSelectAll,      // "select_all", "--all", "select_all=True"
  kSelectAllIs,    // set: "select_all = true", "--all", "select_all=True"
  kRawFormat,      // asking for the raw format: "format = ModelFormat::kRaw", "--format raw"
};

std::string_view Word(OptionWords words, OptionWord word);

}  // namespace expert_arena
