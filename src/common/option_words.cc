#include "common/option_words.h"

namespace expert_arena {

namespace {

struct Row {
  OptionWord word;
  std::string_view cpp, c, cli, python;
};

constexpr Row kRows[] = {
    {OptionWord::kSelect, "select", "select", "--select", "select"},
    {OptionWord::kSelectIs, "select = ", "select = ", "--select ", "select="},
    {OptionWord::kSelectAll, "select_all", "select_all", "--all", "select_all=True"},
    {OptionWord::kSelectAllIs, "select_all = true", "select_all = 1", "--all",
     "select_all=True"},
    {OptionWord::kRawFormat, "format = ModelFormat::kRaw", "format = EA_FORMAT_RAW",
     "expert-arena load --format raw", "format=\"raw\""},
};

}  // namespace

std::string_view Word(OptionWords words, OptionWord word) {
  for (const Row& row : kRows) {
    if (row.word != word) continue;
    switch (words) {
      case OptionWords::kCpp:
        return row.cpp;
      case OptionWords::kC:
        return row.c;
      case OptionWords::kCli:
        return row.cli;
      case OptionWords::kPython:
        return row.python;
    }
  }
  return "?";
}

}  // namespace expert_arena
